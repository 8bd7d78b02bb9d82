"""Time KeepKV's three merge steps that have a C++ pass on CPU against their torch code, the kept
queries' softmax a paged compression computes, and KeepKV's whole decode-time method step with
and without the C++ passes.

The shapes are a compressing step of the serving layer-step bench (``benchmarks/vllm_cpu/
paged_layer_step.py --mode compressed``): 16 rows, SmolLM2-135M's 3 KV heads of 3 query heads
each, D = 64, 206 entries a row and head, interval 16 (16 query rows folded, 16 entries evicted
per row and head):

- the EMA fold (``keepkv.kernels.ema.ema_fold``): [16, 3, 3, 16, 206] scores into the pooled EMA;
- the kept queries' masked softmax (``keepkv.kernels.kept.kept_softmax``): the 16 rows' logits
  over what each sees, with the entries' votes (a paged compression's statistics);
- the target search (``keepkv.merging.cosine_nearest``): 16 evicted entries per row and head
  against the candidates open to merges (a quarter of the entries, KeepKV's ``protect=0.75``);
- the ``protect`` gate (``keepkv.kernels.protect.open_to_merges``): which of the 190 kept entries
  of each row and head (16 of them the selection's window, +inf) are open to merges at 0.75;
- the Hugging Face cache's compressing layer call (``CompressedCache.forward_layer``: the
  attention over 206 entries, then the method's step: fold, ranking, plan, merges, the kept
  entries' move) of ``keepkv+interval=16`` and ``snapkv+interval=16``, random keys and values
  (few merges pass KeepKV's gates on them: a model's keys merge more).

Medians of ``--calls`` calls, the variants interleaved in ``--rounds`` rounds, one thread
(``--threads``). "torch" runs KeepKV's torch code for the three steps (their ``cpp_takes`` off),
"cpp" the C++ passes where they build.

    python benchmarks/kernels/keepkv_merge_cpu.py [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from contextlib import contextmanager

import torch

from keepkv import merging
from keepkv.kernels import ema, kept, nearest, protect
from keepkv.kernels.ema import ema_fold
from keepkv.kernels.kept import kept_softmax
from keepkv.kernels.protect import open_to_merges

ROWS, KV_HEADS, GROUP, HEAD_DIM, ENTRIES, INTERVAL = 16, 3, 3, 64, 206, 16


@contextmanager
def backend(name: str):
    """KeepKV's C++ passes on ("cpp") or off ("torch") inside the block."""
    saved = ema._cpp_takes, nearest.cpp_takes, protect.cpp_takes, kept.cpp_takes
    if name == "torch":
        ema._cpp_takes = lambda *args: False
        nearest.cpp_takes = lambda *args: False
        protect.cpp_takes = lambda *args: False
        kept.cpp_takes = lambda *args: False
    try:
        yield
    finally:
        ema._cpp_takes, nearest.cpp_takes, protect.cpp_takes, kept.cpp_takes = saved


def fold_inputs(generator):
    scores = torch.randn(ROWS, KV_HEADS, GROUP, INTERVAL, ENTRIES, generator=generator) * 3
    old = torch.randn(ROWS, KV_HEADS, ENTRIES + 16, 1, generator=generator)[:, :, :ENTRIES] - 2
    positions = torch.randint(0, 400, (ROWS, KV_HEADS, ENTRIES), generator=generator)
    query_pos = torch.arange(400 - INTERVAL, 400).expand(ROWS, INTERVAL)
    return scores, old, positions, query_pos


def search_inputs(generator):
    keys = torch.randn(ROWS, KV_HEADS, ENTRIES + 16, HEAD_DIM, generator=generator)[:, :, :ENTRIES]
    src = torch.randint(0, ENTRIES, (ROWS, KV_HEADS, INTERVAL), generator=generator)
    allowed = torch.rand(ROWS, KV_HEADS, ENTRIES, generator=generator) < 0.25
    return keys, src, allowed


def gate_inputs(generator):
    priority = torch.randn(ROWS, KV_HEADS, ENTRIES, generator=generator)
    priority[:, :, ENTRIES - 2 * INTERVAL : ENTRIES - INTERVAL] = float("inf")  # the window
    order = torch.rand(ROWS, KV_HEADS, ENTRIES, generator=generator).argsort(-1)
    kept = order >= INTERVAL  # 190 of 206
    return kept, priority


def method_store(spec: str, generator):
    """(a CompressedCache of one layer whose next decode call compresses, that call's arguments):
    a prompt of ENTRIES - INTERVAL tokens within the budget, then INTERVAL - 1 decode calls."""
    from transformers import LlamaConfig

    from keepkv.cache import CompressedCache

    config = LlamaConfig(hidden_size=GROUP * KV_HEADS * HEAD_DIM, num_attention_heads=GROUP * KV_HEADS,
                         num_key_value_heads=KV_HEADS, num_hidden_layers=1, intermediate_size=16, vocab_size=32)
    cache = CompressedCache(config, spec, ENTRIES - INTERVAL)
    keys, values = (torch.randn(ROWS, KV_HEADS, ENTRIES, HEAD_DIM, generator=generator) for _ in range(2))
    query = torch.randn(ROWS, KV_HEADS * GROUP, ENTRIES, HEAD_DIM, generator=generator)
    scaling, prompt = HEAD_DIM**-0.5, ENTRIES - INTERVAL
    causal = torch.ones(prompt, prompt, dtype=torch.bool).tril().expand(ROWS, 1, prompt, prompt)
    cache.layers[0].lazy_initialization(keys[:, :, :prompt], values[:, :, :prompt])
    cache.forward_layer(0, query[:, :, :prompt], keys[:, :, :prompt], values[:, :, :prompt], causal, scaling)
    one = torch.ones(ROWS, 1, 1, 1, dtype=torch.bool)
    for t in range(prompt, ENTRIES):
        call = (0, query[:, :, t : t + 1], keys[:, :, t : t + 1], values[:, :, t : t + 1], one, scaling)
        before = int(cache.layers[0].live_counts().max())
        if t < ENTRIES - 1:
            cache.forward_layer(*call)
    probe = copy.deepcopy(cache)
    probe.forward_layer(*call)
    if int(probe.layers[0].live_counts().max()) > before:
        raise RuntimeError(f"{spec}: the timed call does not compress")
    return cache, call


def timed(calls: int, run) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    fold = fold_inputs(generator)
    search = search_inputs(generator)
    gate = gate_inputs(generator)
    scores, _, positions, query_pos = fold
    bias = torch.zeros(ROWS, KV_HEADS, ENTRIES).masked_fill(torch.rand(ROWS, KV_HEADS, ENTRIES, generator=generator)
                                                            < 0.1, 0.7)  # a few votes
    stores = {spec: method_store(spec, generator) for spec in ("snapkv+interval=16", "keepkv+interval=16")}
    cells: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name in ("torch", "cpp"):
            with backend(name):
                cells.setdefault(f"fold/{name}", []).append(
                    timed(args.calls, lambda: ema_fold(*fold, 0.94, True)))
                cells.setdefault(f"search/{name}", []).append(
                    timed(args.calls, lambda: merging.cosine_nearest(*search)))
                cells.setdefault(f"gate/{name}", []).append(timed(args.calls, lambda: open_to_merges(*gate, 0.75)))
                cells.setdefault(f"softmax/{name}", []).append(
                    timed(args.calls, lambda: kept_softmax(scores, bias, positions, query_pos)))
                for spec, (cache, call) in stores.items():
                    if spec.startswith("snapkv") and name == "cpp":
                        continue  # no step of snapkv's has a C++ pass
                    copies = [copy.deepcopy(cache) for _ in range(args.calls // 4)]
                    times = []
                    for fresh in copies:  # each call compresses its own copy: the step that comes due
                        start = time.perf_counter()
                        fresh.forward_layer(*call)
                        times.append(time.perf_counter() - start)
                    label = spec.split("+")[0]
                    cells.setdefault(f"step/{label}/{name}", []).append(statistics.median(times) * 1e3)
    rows = {cell: statistics.median(values) for cell, values in cells.items()}
    for cell, ms in rows.items():
        print(f"{cell}: {ms:.3f} ms")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"settings": vars(args), "load_average": os.getloadavg(), "ms": rows, "rounds": cells}, handle,
                      indent=2)


if __name__ == "__main__":
    main()
