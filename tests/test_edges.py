"""Misuse refused in one line at the first call that can tell."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import keepkv

from conftest import random_batch, tiny_model


def one_line(error) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("other", [
    dict(kind="llama-mha"),  # other KV heads
    dict(kind="llama-gqa", layers=3),  # deeper
])
def test_a_cache_built_from_another_models_config_is_refused_at_its_first_forward(other):
    built_for = tiny_model("llama-gqa", layers=2)
    keepkv.enable(built_for)  # its config names keepkv's attention too: only the shapes differ
    model = tiny_model(other["kind"], layers=other.get("layers", 2))
    cache = keepkv.CompressedCache(built_for.config, "snapkv", 0.5)
    input_ids, attention_mask = random_batch()
    with keepkv.enabled(model), pytest.raises(ValueError, match="built from the config of a model with") as error:
        model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache)
    assert "CompressedCache(model.config" in one_line(error)


def test_enabled_refuses_an_unsupported_model_before_touching_it():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0))
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'") as error:
        with keepkv.enabled(model):
            pass
    one_line(error)
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        keepkv.enable(model)
    assert model.config._attn_implementation == before
    with pytest.raises(ValueError, match="must be a transformers causal LM"):
        keepkv.enable(torch.nn.Linear(2, 2))


# A stand-in for a suite's group: each forked worker prints its pid, then computes for two minutes.
SIGTERM_PROBE = """
import os, time
from types import SimpleNamespace
from keepkv.eval import runner

class Group:
    runner = SimpleNamespace(threads=2, progress=False)

    def run_shard(self, todo, shard, progress):
        os.write(1, f"{os.getpid()}\\n".encode())  # one write: the two workers' lines never interleave
        time.sleep(120)

runner._fork_map(Group(), [], [[0], [1]])
"""


def test_sigterm_ends_the_eval_workers_with_the_run():
    """`keepkv eval` stopped by SIGTERM while its forked workers compute: they are terminated and
    joined, and the run exits with 143, none left computing."""
    import os
    import signal
    import subprocess
    import sys
    import time

    run = subprocess.Popen([sys.executable, "-c", SIGTERM_PROBE], stdout=subprocess.PIPE, text=True)
    workers = []
    try:
        workers = [int(run.stdout.readline()) for _ in range(2)]
        run.send_signal(signal.SIGTERM)
        start = time.monotonic()
        assert run.wait(timeout=60) == 143
        assert time.monotonic() - start < 10
        for pid in workers:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        for pid in workers:  # what an old runner left behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        run.kill()
        run.wait()


@pytest.mark.parametrize("load, threads, busy", [(4.5, 2, True), (4.5, 1, True), (1.2, 1, False), (0.3, 2, False),
                                                 (1.0, 2, True), (None, 2, False)])
def test_bench_warns_of_a_busy_host(monkeypatch, load, threads, busy):
    """On 2 cores: a load average that leaves more than half a core fewer free than the run's
    threads is contention; the warning is one line naming the load, cores and threads."""
    import os

    from keepkv.bench.core import contention

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    found = contention(load, threads)
    assert (found is not None) == busy
    if busy:
        assert "\n" not in found and f"load average {load:.1f} on 2 cores" in found and f"for {threads} torch" in found


def test_a_bench_on_a_busy_host_warns_and_records_it(monkeypatch):
    """The load average read before the run starts: a one-line KeepKVWarning, and settings.contention
    in the JSON; on an idle host, null."""
    import os

    from transformers import LlamaConfig

    from keepkv.bench import run_bench

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    small = dict(config=config, methods="full", prompt_len=8, gen_len=2, repeats=1, warmup=0, progress=False,
                 device="cpu")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "getloadavg", lambda: (6.0, 5.0, 4.0))
    with pytest.warns(keepkv.KeepKVWarning, match=r"the host is busy \(load average 6.0 on 2 cores") as caught:
        busy = run_bench(**small)
    assert busy["settings"]["contention"] == str(caught[0].message) and "\n" not in busy["settings"]["contention"]
    assert busy["host"]["load_avg_start"] == 6.0
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert run_bench(**small)["settings"]["contention"] is None
