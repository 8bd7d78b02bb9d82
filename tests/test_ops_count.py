"""``keepkv bench --ops``: the counter counts kernel operations and host syncs of a decode step
(the figures come from the bench, not from here; these are tiny shapes)."""

import json

import pytest
import torch
from hypothesis import given, strategies as st

from keepkv.bench.core import build_parser, main
from keepkv.bench.ops import OpCounter, count_method, format_ops, run_ops

from conftest import tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::keepkv.KeepKVWarning")

# (operation, kernel operations it launches): views launch none.
STEPS = {
    "add": (lambda x: x + 1, 1),
    "mul_": (lambda x: x.mul_(2), 1),
    "exp": (lambda x: x.exp(), 1),
    "view": (lambda x: x.view(-1).view(x.shape), 0),
    "transpose": (lambda x: x.transpose(0, 1).transpose(0, 1), 0),
    "slice": (lambda x: x[:, :].narrow(1, 0, 4).unsqueeze(0)[0], 0),
    "softmax": (lambda x: torch.softmax(x, -1), 1),
    "matmul": (lambda x: x @ x, 1),  # square [4, 4]: one mm
}


@given(st.lists(st.sampled_from(sorted(STEPS)), max_size=12))
def test_counter_counts_a_known_sequence_of_operations(sequence):
    x = torch.randn(4, 4)
    with OpCounter() as counter:
        for name in sequence:
            x = STEPS[name][0](x)
    assert counter.total_ops == sum(STEPS[name][1] for name in sequence)
    assert counter.total_syncs == 0


SYNCS = {
    "item": lambda x, m: x[0, 0].item(),
    "bool": lambda x, m: bool(x.sum() > 0),
    "tolist": lambda x, m: x.tolist(),
    "cpu": lambda x, m: x.cpu(),
    "nonzero": lambda x, m: m.nonzero(),
    "mask_index": lambda x, m: x[m],
    "mask_assign": lambda x, m: x.clone().__setitem__(m, 0.0),
    "solve": lambda x, m: torch.linalg.solve(x @ x.T + 4 * torch.eye(4), x[:, 0]),
}


@pytest.mark.parametrize("name", sorted(SYNCS))
def test_every_kind_of_host_sync_is_detected(name):
    x, mask = torch.randn(4, 4), torch.rand(4, 4) > 0.5
    with OpCounter() as counter:
        SYNCS[name](x, mask)
    assert counter.total_syncs >= 1, name
    assert all(" at tests/test_ops_count.py:" in site or "test_ops_count.py" in site for site in counter.sync_sites)


def test_gathers_are_not_syncs_and_the_patches_are_undone():
    x, index = torch.randn(4, 4), torch.tensor([2, 0])
    tolist = torch.Tensor.tolist
    with OpCounter() as counter:
        x[index]
        x.gather(1, index[None].expand(4, -1))
        torch.where(x > 0, x, 0.0)
    assert counter.total_ops >= 3 and counter.total_syncs == 0
    assert torch.Tensor.tolist is tolist
    assert x.tolist() == tolist(x)


def test_parts_attribute_operations_to_the_innermost_region():
    x = torch.randn(3)
    with OpCounter() as counter:
        x + 1
        with counter.part("method"):
            x * 2
            with counter.part("append"):
                x.exp()
                x.exp()
            x - 1
    assert dict(counter.ops) == {"model": 1, "method": 2, "append": 2}


def test_decode_step_counts_full_below_h2o_and_repeatable():
    model = tiny_model("llama-gqa", layers=2)
    result = run_ops(model, ["full", "h2o", "keepkv"], 8, prompt_len=32, progress=False)
    again = run_ops(model, ["full", "h2o", "keepkv"], 8, prompt_len=32, progress=False)
    by = {r["method"]: r for r in result["methods"]}
    assert not result["errors"]
    assert by["full"]["method_ops"] == 0 and by["h2o"]["method_ops"] > 0
    assert by["full"]["ops_per_layer_step"] < by["h2o"]["ops_per_layer_step"]
    assert by["h2o"]["extra_vs_full"] == by["h2o"]["ops_per_layer_step"] - by["full"]["ops_per_layer_step"]
    for r in result["methods"]:
        assert r["ops_per_layer_step"] == sum(r[f"{p}_ops"] for p in ("method", "append", "attention", "model"))
    assert [r["ops_per_layer_step"] for r in again["methods"]] == [r["ops_per_layer_step"] for r in result["methods"]]
    assert [r["syncs"] for r in again["methods"]] == [r["syncs"] for r in result["methods"]]
    assert by["h2o"]["kept_entries"] <= 8 < by["full"]["kept_entries"]
    assert sum(by["h2o"]["method_op_names"].values()) == by["h2o"]["method_ops"] and not by["full"]["method_op_names"]
    assert "| h2o |" in format_ops(result)


def test_counting_leaves_the_cache_and_its_method_as_they_were():
    """The shadows are removed: a second count of the same method sees the same operations, and
    each layer counts its own: two layers give the same per-layer figure as one."""
    one = count_method(tiny_model("llama-gqa", layers=1), "h2o", 8, prompt_len=32)
    two = count_method(tiny_model("llama-gqa", layers=2), "h2o", 8, prompt_len=32)
    assert one["method_ops"] == two["method_ops"] and one["append_ops"] == two["append_ops"]


def test_cli_ops_json(capsys):
    args = build_parser().parse_args(
        ["--ops", "--layers", "1", "--methods", "h2o", "--prompt-len", "24", "--json", "-", "--no-progress"]
    )
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)["ops"]
    assert [r["method"] for r in out["methods"]] == ["full", "h2o"]
    assert out["settings"]["batch"] == 2 and out["settings"]["budget"] == 0.1
    assert out["model"]["num_layers"] == 1 and out["model"]["random_weights"] is True


@pytest.mark.parametrize("flags", [["--ops-steps", "0"], ["--batch", "1", "2"], ["--soak"]])
def test_cli_ops_refuses_bad_input_in_one_line(flags, capsys):
    args = build_parser().parse_args(["--ops", "--layers", "1", "--no-progress", *flags])
    assert main(args) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


# No method's decode step waits for the device, on any device (KeepKV and KVReviver included: they
# merge and swap without reading back whether anything merges or swaps).
NO_SYNC = sorted(__import__("keepkv").methods.METHODS)


def test_decode_steps_make_no_host_sync():
    """Also not in the mask: keepkv's mask builder never asks HF to test the padding on the host.
    Budget 8 of 32-token prompts: every step evicts, so KeepKV merges and KVReviver swaps."""
    model = tiny_model("llama-gqa", layers=1)
    result = run_ops(model, NO_SYNC, 8, prompt_len=32, warm_steps=6, progress=False)
    assert not result["errors"]
    assert {r["method"]: r["syncs"] for r in result["methods"]} == {method: {} for method in NO_SYNC}


def test_compiled_launches_count_kernels_and_library_calls_not_views(monkeypatch):
    """The profile of a compiled function: each generated kernel and each ATen call inductor keeps
    (here one cumsum) is a launch; views and an ATen call's own inner calls are not."""
    from collections import Counter

    import torch._inductor.config as inductor_config
    from torch.profiler import ProfilerActivity, profile

    from keepkv.bench.ops import _launches

    monkeypatch.setattr(inductor_config.cpp, "enable_kernel_profile", True)
    fn = torch.compile(lambda x: (x.sin() + 1).cumsum(-1)[:, :2].exp(), fullgraph=True)
    x = torch.randn(4, 8)
    fn(x)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(x)
    counts = Counter()
    for event in prof.events():
        if event.cpu_parent is None:
            _launches(event, False, counts)
    assert counts["cumsum"] == 1 and counts["fused kernel"] >= 1
    assert not {"slice", "as_strided", "view"} & set(counts)


def test_compiled_step_counts_its_launches_without_syncs():
    """``compile=True``: the method's step runs compiled (no fallback, no shadowed parts in its
    graph), its launches are counted, and it never waits for the host."""
    model = tiny_model("llama-gqa", layers=1)
    eager = count_method(model, "h2o", 8, prompt_len=32)
    compiled = count_method(model, "h2o", 8, prompt_len=32, compile=True)
    assert compiled["compiled"] is True
    assert 0 < compiled["method_ops"] < eager["method_ops"]
    assert compiled["method_syncs"] == 0 and compiled["syncs"] == {}
    assert compiled["model_ops"] == eager["model_ops"] and compiled["append_ops"] == eager["append_ops"]


def test_the_embedded_models_shape_counts_the_learned_selection_with_its_shipped_scorer():
    """The bench's random stand-in of the embedded model (``--config smollm2-135m``, its depth) is
    keyed as the model (architecture included), so the learned selection's shipped scorer runs on
    it and its decode step is counted; at another depth the scorer is refused, in the errors."""
    from keepkv.bench.configs import build_config, random_model
    from keepkv.scorer import cached_scorer, config_key, default_scorer

    assert config_key(build_config("smollm2-135m")) == cached_scorer(default_scorer()).key
    model = random_model(build_config("smollm2-135m"), seed=0)
    result = run_ops(model, ["snapkv+selection=learned"], 0.25, prompt_len=48, batch=1, warm_steps=1, progress=False)
    assert not result["errors"] and result["methods"][0]["method_ops"] > 0
    shallow = run_ops(random_model(build_config("smollm2-135m", layers=2), seed=0), ["snapkv+selection=learned"], 0.25,
                      prompt_len=48, batch=1, warm_steps=1, progress=False)
    assert "snapkv+selection=learned" in shallow["errors"] and not shallow["methods"]
