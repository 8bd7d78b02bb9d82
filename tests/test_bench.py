"""keepkv.bench: correctness only (no timing asserts)."""

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from transformers import LlamaConfig

import keepkv
from keepkv import bench
from keepkv.bench.core import build_parser, main, parse_params
from keepkv.bench.runner import MethodTimer, cache_bytes_per_row, max_batch, run_once
from keepkv.methods import METHODS

from conftest import tiny_model

from keepkv.plotting import have_matplotlib

# Tests of the plot extra (keepkv[plot], matplotlib) skip where it is absent, as after `pip install -e ".[test]"`.
needs_plot = pytest.mark.skipif(not have_matplotlib(), reason="matplotlib (keepkv[plot]) is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(layers=2):
    return LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )


# -- capacity search ------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["full", "h2o"])
def test_capacity_search_on_a_simulated_cap(method):
    """Byte accounting from a real CPU probe; the batch found fits and batch + 1 does not."""
    model = tiny_model("llama-gqa")
    probe = run_once(model, method, 0.25, prompt_len=48, gen_len=2, batch=1)
    acct = cache_bytes_per_row(probe, prompt_len=48, gen_len=16)
    assert acct["prefill_bytes"] == probe["cache_bytes_prefill"]  # the probe ran at the same prompt length
    if method == "full":
        assert acct["decode_bytes"] > acct["prefill_bytes"]  # grows to prompt + generated
    else:
        assert acct["decode_bytes"] < acct["prefill_bytes"]  # compressed after prefill
    weights, workspace = 10_000_000, 123_457
    per_row = acct["peak_bytes"] + workspace

    def bytes_for_batch(b):
        return weights + b * per_row

    for target in (1, 2, 7, 64, 1000):
        for extra in (0, 1, per_row // 2, per_row - 1):
            cap = bytes_for_batch(target) + extra
            found = max_batch(cap, bytes_for_batch)
            assert found == target
            assert bytes_for_batch(found) <= cap < bytes_for_batch(found + 1)
    assert max_batch(bytes_for_batch(1) - 1, bytes_for_batch) == 0


def test_capacity_search_nonlinear_and_limit():
    cost = lambda b: 1000 + 3 * b * b + (b // 5) * 17  # noqa: E731  (monotone, not linear)
    for cap in range(1000, 40_000, 997):
        found = max_batch(cap, cost)
        assert (found == 0 and cost(1) > cap) or (cost(found) <= cap < cost(found + 1))
    assert max_batch(10, lambda b: 0, limit=64) == 64


# -- JSON schema ------------------------------------------------------------------------------------
def _resolve(value, parts):
    """Every value at a documented path; ``[]`` spans a list, ``<...>`` every dict key."""
    if not parts:
        return [value]
    head, rest = parts[0], parts[1:]
    if value is None:
        return []
    name = head[:-2] if head.endswith("[]") else head
    if name.startswith("<") and name.endswith(">"):
        assert isinstance(value, dict) and value, f"{head}: expected a non-empty dict"
        children = list(value.values())
    else:
        assert isinstance(value, dict) and name in value, f"missing field {name!r}"
        children = [value[name]]
    if head.endswith("[]"):
        children = [item for child in children for item in (child or [])]
        assert children, f"{head}: empty list, cannot check its fields"
    return [found for child in children for found in _resolve(child, rest)]


@pytest.fixture(scope="module")
def full_result():
    return bench.run_bench(
        config=tiny_config(),
        methods=["full", "h2o"],
        budget=8,  # an entry count: a fraction of a 32-token prompt is under the budget floor
        prompt_len=32,
        gen_len=6,
        batches=[1, 2],
        repeats=2,
        warmup=1,
        memory_cap_gb=0.25,
        max_measure_batch=2,
        overhead_steps=3,
        profile_steps=2,
        progress=False,
    )


def test_json_has_every_documented_field(full_result):
    fields = bench.documented_fields()
    assert len(fields) > 80 and "fixed[].tokens_per_s" in fields and "memory_cap.methods[].max_batch" in fields
    encoded = json.loads(json.dumps(full_result))  # JSON-serialisable
    for path in fields:
        _resolve(encoded, path.split("."))


def test_every_field_is_documented(full_result):
    documented = set(bench.documented_fields())
    checks = {
        "": [full_result],
        "versions.": [full_result["versions"]],
        "host.": [full_result["host"]],
        "model.": [full_result["model"]],
        "settings.": [full_result["settings"]],
        "fixed[].": full_result["fixed"],
        "overhead[].": full_result["overhead"],
        "memory_cap.": [full_result["memory_cap"]],
        "memory_cap.methods[].": full_result["memory_cap"]["methods"],
        "profile.<method>.": list(full_result["profile"].values()),
        "profile.<method>.ops[].": [op for p in full_result["profile"].values() for op in p["ops"]],
    }
    for prefix, records in checks.items():
        for record in records:
            for key in record:
                assert prefix + key in documented, f"undocumented field {prefix + key}"


def test_result_is_consistent(full_result):
    fixed = {(r["batch"], r["method"]): r for r in full_result["fixed"]}
    assert set(fixed) == {(1, "full"), (1, "h2o"), (2, "full"), (2, "h2o")}
    for (batch, method), record in fixed.items():
        assert record["tokens_per_s_min"] <= record["tokens_per_s"] <= record["tokens_per_s_max"]
        assert record["step_ms_mean_min"] <= record["step_ms_mean"] <= record["step_ms_mean_max"]
        assert record["step_ms_p95"] > 0 and record["prefill_s"] > 0
        assert record["repeats"] == 2
        if method == "full":
            assert record["tokens_per_s_vs_full"] == 1.0
            assert record["cache_bytes"] == record["cache_bytes_peak"]
    # h2o compresses each layer as its prefill ends: its peak is one uncompressed layer (plus scores)
    # above its final size, below full's whole prompt
    h2o, full = fixed[(2, "h2o")], fixed[(2, "full")]
    assert h2o["cache_bytes"] < h2o["cache_bytes_prefill"] < full["cache_bytes_prefill"]
    cap = full_result["memory_cap"]
    for row in cap["methods"]:
        assert row["bytes_at_max_batch"] <= cap["capacity_bytes"] < row["bytes_at_max_batch_plus_1"]
        assert row["measured_batch"] == min(row["max_batch"], 2)
    assert {r["method"] for r in full_result["overhead"]} == {"full", "h2o"}
    for row in full_result["overhead"]:
        assert 0 <= row["method_ms"] <= row["step_ms"]
    assert set(full_result["profile"]) == {"full", "h2o"}
    names = [op["name"] for op in full_result["profile"]["h2o"]["ops"]]
    assert "keepkv::compress" in names and "keepkv::observe" in names
    assert full_result["model"]["random_weights"] and full_result["model"]["note"] == "random weights: speed only"


# -- runs ------------------------------------------------------------------------------------------
def test_tiny_cpu_run_completes():
    """smollm2-135m shapes cut to 2 layers, L=32, G=8, b=2: completes in seconds on CPU."""
    result = bench.run_bench(
        config="smollm2-135m", layers=2, device="cpu", prompt_len=32, gen_len=8, batches=2, repeats=1,
        warmup=0, methods="full,h2o", budget=0.25, progress=False,
    )
    assert result["model"]["num_layers"] == 2 and result["model"]["dtype"] == "float32"
    assert [r["method"] for r in result["fixed"]] == ["full", "h2o"]
    for record in result["fixed"]:
        assert record["batch"] == 2 and record["gen_len"] == 8 and record["tokens_per_s"] > 0
    assert "random weights: speed only" in bench.format_table(result)


def test_timing_proxies_are_removed_and_change_nothing():
    model = tiny_model("llama-gqa")
    plain = run_once(model, "h2o", 0.5, prompt_len=24, gen_len=4, batch=2)
    timed = run_once(model, "h2o", 0.5, prompt_len=24, gen_len=4, batch=2, overhead_steps=3, profile_steps=2)
    assert plain["cache_bytes"] == run_once(model, "h2o", 0.5, prompt_len=24, gen_len=4, batch=2)["cache_bytes"]
    assert timed["overhead"]["steps"] == 3
    # full never observes or compresses: its timers stay at 0, h2o's count what it ran
    full = run_once(model, "full", 0.5, prompt_len=24, gen_len=4, batch=2, overhead_steps=3)["overhead"]
    assert full["compress_ms"] == full["observe_ms"] == 0 < timed["overhead"]["compress_ms"]
    assert 0 < timed["overhead"]["observe_ms"] < timed["overhead"]["step_ms"]
    cache = keepkv.CompressedCache(model.config, "h2o", 0.5)
    timer = MethodTimer("cpu")
    timer.install(cache)
    assert "observe" in vars(cache.method) and "append" in vars(cache.layers[0])
    timer.uninstall()
    assert "observe" not in vars(cache.method) and "append" not in vars(cache.layers[0])
    assert "forward_layer" not in vars(cache)


def test_a_failing_method_is_reported_not_fatal(monkeypatch):
    @dataclass
    class Broken(METHODS["h2o"]):
        name = "broken-bench-test"

        def compress(self, layer, stats):
            raise RuntimeError("boom")

    monkeypatch.setitem(METHODS, Broken.name, Broken)
    result = bench.run_bench(
        config=tiny_config(), methods=["full", Broken.name], budget=0.25, prompt_len=16, gen_len=2,
        repeats=1, warmup=0, progress=False,
    )
    assert [r["method"] for r in result["fixed"]] == ["full"]
    assert "boom" in result["errors"][Broken.name]


@pytest.mark.parametrize("progress", [False, True])
def test_progress_flag_governs_every_bar_and_message(capsys, progress):
    result = bench.run_bench(
        config=tiny_config(), methods=["full"], prompt_len=16, gen_len=3, repeats=1, warmup=0,
        memory_cap_gb=0.25, max_measure_batch=1, progress=progress,
    )
    assert result["memory_cap"]["methods"][0]["measured_batch"] == 1
    shown = capsys.readouterr().err
    assert ("memory cap rep" in shown) == progress
    assert ("step" in shown) == progress


@needs_plot
def test_cli_writes_json_table_and_png(tmp_path, capsys):
    args = build_parser().parse_args(
        ["--config", "smollm2-135m", "--layers", "1", "--prompt-len", "16", "--gen-len", "2", "--batch", "1", "2",
         "--repeats", "1", "--warmup", "0", "--methods", "h2o", "--budget", "0.5", "--param", "interval=2",
         "--param", "h2o.recent_ratio=0.25", "--out", str(tmp_path), "--json", str(tmp_path / "x.json"),
         "--no-progress"]
    )
    assert main(args) == 0
    shown = capsys.readouterr().out
    assert "random weights: speed only" in shown and "Fixed batch" in shown
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result == json.loads((tmp_path / "x.json").read_text())
    assert result["settings"]["methods"] == ["full", "h2o"]
    assert result["settings"]["method_params"] == {"full": {"interval": 2}, "h2o": {"interval": 2, "recent_ratio": 0.25}}
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "bench.txt").read_text().startswith("keepkv bench:")


def test_bad_arguments():
    assert parse_params(["interval=4", "h2o.recent_ratio=0.1"]) == {"*": {"interval": 4}, "h2o": {"recent_ratio": 0.1}}
    with pytest.raises(ValueError):
        parse_params(["interval"])
    with pytest.raises(ValueError, match="unknown method"):
        bench.run_bench(config=tiny_config(), methods="nope", progress=False)
    with pytest.raises(ValueError, match="unknown config"):
        bench.run_bench(config="gpt-17", progress=False)
    with pytest.raises(ValueError, match="batches"):
        bench.run_bench(config=tiny_config(), batches=[0], progress=False)
    args = build_parser().parse_args(["--layers", "2"])
    assert main(args) == 2


def test_main_accepts_a_parent_parsers_model_and_json_flag(capsys):
    """`keepkv bench` in the main CLI inherits --model and --json (a flag) from a parent parser."""
    import argparse

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model")
    common.add_argument("--json", action="store_true")
    parser = argparse.ArgumentParser(parents=[common])
    bench.add_arguments(parser)
    args = parser.parse_args(
        ["--config", "smollm2-135m", "--layers", "1", "--prompt-len", "16", "--gen-len", "2", "--repeats", "1",
         "--warmup", "0", "--methods", "full", "--json", "--no-progress"]
    )
    assert args.json is True
    assert main(args) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["fixed"][0]["method"] == "full"
    assert "Fixed batch" in captured.err


# Run in a fresh interpreter: in the suite's process the heap holds whatever earlier tests left
# (fragments that malloc_trim cannot return), so the same check failed at random there.
HEAP_PROBE = """
import torch
from keepkv.bench.runner import PeakMemory, current_rss

blocks = [torch.ones(1 << 14) for _ in range(4000)]  # 4000 x 64 KiB, below glibc's mmap threshold
del blocks
retained = current_rss()
with PeakMemory("cpu") as memory:
    pass
print(retained - memory.start)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc heap behaviour")
def test_cpu_peak_memory_does_not_start_from_heap_an_earlier_run_freed():
    # Many small blocks stay in glibc's heap after they are freed; a probe measured on top of
    # them would reuse that memory and show no growth (the memory cap then saw zero workspace).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    probe = subprocess.run([sys.executable, "-c", HEAP_PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert probe.returncode == 0, probe.stderr
    released = int(probe.stdout.split()[-1])
    assert released > 150 << 20  # most of the 250 MiB freed went back to the OS before the probe started


def test_prefill_rows_admits_groups_and_bounds_the_prefill_cache():
    """Rows prefilled one at a time, then stacked (test_stack.py: each decodes as alone): the
    cache's prefill peak is one uncompressed prompt beside the compressed rows, not the batch's."""
    model = tiny_model("llama-gqa", layers=2)
    runs = {
        rows: run_once(model, "h2o", 12, prompt_len=48, gen_len=4, batch=3, prefill_chunk=16, prefill_rows=rows)
        for rows in (None, 1)
    }
    one_prompt = runs[None]["cache_bytes_prefill"] / 3
    assert runs[1]["cache_bytes_prefill"] < 2 * one_prompt < runs[None]["cache_bytes_prefill"]
    assert runs[1]["kept_entries"] == runs[None]["kept_entries"]
    with pytest.raises(ValueError, match="prefill_rows must be an int >= 1"):
        bench.run_bench(config=tiny_config(), prefill_rows=0, progress=False)


def test_method_timer_times_a_compiled_step_whole_and_puts_it_back():
    """compile=True: observe and compress run inside the compiled graph, so the timer wraps the
    cache's step (as compress) and leaves them alone; uninstall restores the step itself."""
    from keepkv.bench.runner import MethodTimer

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    cache = keepkv.CompressedCache(config, "keepkv", 0.5, compile=True)
    step = cache._method_step
    timer = MethodTimer(torch.device("cpu"))
    timer.install(cache)
    assert cache._method_step is not step
    assert "observe" not in vars(cache.method) and "compress" not in vars(cache.method)
    assert "attention_entries" in vars(cache.method)
    timer.uninstall()
    assert cache._method_step is step and "attention_entries" not in vars(cache.method)
