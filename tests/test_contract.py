"""The method contract (docs/architecture.md): every method's outputs equal its recorded reference,
and no method writes a store field.

The reference logits (tests/fixtures/contract/, one file per variant) are exact (1e-6) on the kind
of CPU that recorded them. Elsewhere torch's kernels use other vector widths and their float sums
round differently (within 1.9e-5 between an AVX512 and an AVX2 host, every greedy token the same),
so there the logits are compared to 1e-4 and the greedy tokens exactly: a changed decision still
fails."""

import warnings

import pytest
import torch

import keepkv
import keepkv.reconstruction

from fixtures import contract_golden as golden


def tolerance(reference) -> float:
    """Absolute tolerance of the logits: exact where this CPU is of the recording's kind."""
    return 1e-6 if reference["cpu_capability"] == golden.cpu_capability() else 1e-4


def test_every_reference_is_a_listed_variant_with_every_cell():
    recorded = sorted(file.stem for file in golden.FOLDER.glob("*.json"))
    assert set(recorded) <= set(golden.VARIANTS), f"references of no listed variant: {set(recorded) - set(golden.VARIANTS)}"
    cells = {golden.cell(kind, budget) for kind in golden.MODELS for budget in golden.BUDGETS}
    for spec in recorded:
        assert set(golden.load(spec)["logits"]) == cells, spec


@pytest.mark.parametrize("kind", golden.MODELS)
@pytest.mark.parametrize("spec", golden.VARIANTS)
def test_logits_equal_the_reference(kind, spec):
    from conftest import tiny_model

    reference = golden.load(spec)
    if reference is None:
        pytest.skip(f"{spec} has no reference yet: record it with python tests/fixtures/contract_golden.py --add-missing")
    if reference["torch"] != str(torch.__version__):
        pytest.skip(f"{spec}'s reference was made with torch {reference['torch']}, this is {torch.__version__}")
    model = tiny_model(kind, layers=3)
    for budget in golden.BUDGETS:
        expected = reference["logits"][golden.cell(kind, budget)]
        got = golden.run(model, spec, budget)
        assert got.shape == expected.shape
        assert torch.equal(got.argmax(-1), expected.argmax(-1)), f"{kind} {spec} budget={budget}: greedy tokens"
        torch.testing.assert_close(got, expected, rtol=0, atol=tolerance(reference), msg=f"{kind} {spec} budget={budget}")


def test_a_variant_without_a_reference_is_skipped_not_failed(tmp_path, monkeypatch):
    monkeypatch.setattr(golden, "FOLDER", tmp_path)
    with pytest.raises(pytest.skip.Exception, match="contract_golden.py --add-missing"):
        test_logits_equal_the_reference("llama-gqa", "h2o")


def test_the_store_tensors_are_read_only(gqa_model):
    cache = keepkv.CompressedCache(gqa_model.config, "h2o", 8)
    with keepkv.enabled(gqa_model), torch.no_grad():
        gqa_model(torch.randint(3, 100, (1, 20)), past_key_values=cache)
    layer = cache.layers[0]
    for name in ("keys", "values", "bias", "positions", "extras", "extra_fill"):
        with pytest.raises(AttributeError):
            setattr(layer, name, getattr(layer, name))
    with pytest.raises(TypeError):
        layer.extras["score"] = torch.zeros_like(layer.bias)


@pytest.mark.parametrize("spec", golden.VARIANTS)
def test_no_method_assigns_a_store_attribute(spec, monkeypatch):
    """Every method and variant runs with a guard on the store: an attribute assigned from a method's
    (or the merge arithmetic's) code fails the test, whatever the attribute."""
    import sys

    from conftest import tiny_model
    from keepkv.store import LayerStore

    assigned = []
    plain = object.__setattr__

    def guarded(self, name, value):
        module = sys._getframe(1).f_globals.get("__name__", "")
        if module.startswith(("keepkv.methods", "keepkv.merging")):
            assigned.append(f"{module} assigns layer.{name}")
        plain(self, name, value)

    monkeypatch.setattr(LayerStore, "__setattr__", guarded)
    golden.run(tiny_model("llama-gqa", layers=2), spec, 24)
    assert not assigned, assigned


def test_a_method_is_a_selection_plus_a_merge():
    from keepkv.methods import MERGES, SELECTIONS
    from keepkv.methods.base import ComposedMethod, Merge
    from keepkv.methods.keepkv import KeepKV, KeepKVMerge
    from keepkv.methods.keepkv import ZipMerge

    assert keepkv.get_method("snapkv").merging == Merge()
    zipped = keepkv.get_method("snapkv+merge=zip+threshold=0.5+protect=0.25")
    assert zipped.merging == ZipMerge(threshold=0.5, protect=0.25)
    assert zipped.selection == keepkv.get_method("snapkv").selection
    assert zipped.needs(False).logits and not keepkv.get_method("snapkv").needs(False).logits
    assert zipped.needs(True).window == 32  # the selection's own needs stay
    assert isinstance(keepkv.get_method("keepkv").merging, KeepKVMerge)
    # KeepKV is a selection plus its merge: no compression of its own
    assert "compress" not in vars(KeepKV) and issubclass(KeepKV, ComposedMethod)
    with pytest.raises(ValueError, match="threshold must be in"):
        keepkv.get_method("h2o+merge=zip+threshold=2.0")
    with pytest.raises(ValueError, match="unknown parameter"):
        keepkv.get_method("h2o+threshold=0.5")  # evicting takes no threshold


@pytest.mark.parametrize("selection", ["window", "streamingllm", "h2o", "snapkv", "pyramidkv", "kvzip", "keydiff", "d2o", "cam", "ema"])
@pytest.mark.parametrize("merge", ["none", "zip", "keepkv", "d2o", "pivot", "spread"])
def test_every_selection_pairs_with_every_merge_or_is_refused_in_one_line(selection, merge):
    from keepkv.methods import MERGES, SELECTIONS

    try:
        method = keepkv.get_method(f"keepkv+selection={selection}+merge={merge}")
    except ValueError as error:
        assert "\n" not in str(error) and (selection in str(error) or merge in str(error)), error
        refusals = {("ema", m) for m in MERGES if m != "keepkv"} | {(s, "pivot") for s in ("window", "streamingllm", "keydiff", "cam", "ema")}
        assert (selection, merge) in refusals, f"{selection}+{merge} refused: {error}"
        return
    assert type(method.selection) is SELECTIONS[selection] and type(method.merging) is MERGES[merge]
    # The pair runs end to end and keeps the budget: every layer, row and head within its own
    # budget, and the budgets average 24.
    from conftest import tiny_model
    from conftest import char_tokenizer

    model = tiny_model("llama-gqa", layers=2)
    ids, mask = golden.prompts(model.config.vocab_size)
    cache = keepkv.CompressedCache(model.config, method, 24)
    with keepkv.enabled(model), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        keepkv.reconstruction.prefill(model, char_tokenizer(), cache, ids, mask, chat=False)
        model(input_ids=ids[:, -1:], attention_mask=torch.cat([mask, mask[:, -1:]], -1), past_key_values=cache)
    for layer in cache.layers:
        assert bool((layer.live_counts() <= layer.budget).all()) and int(layer.live_counts().min()) >= 1
    assert torch.equal(cache.layer_budgets.double().mean((0, 2)), torch.full((2,), 24.0, dtype=torch.float64))
