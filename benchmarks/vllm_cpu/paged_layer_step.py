"""Time one attention layer's decode step of keepkv.paged against stock vLLM's, on vLLM's CPU kernel.

Stock: vLLM's cache write and ``cpu_attention_with_kv_cache`` over every request's tokens.
keepkv: ``PagedCompression.forward`` with ``VllmCpuKernel`` (the same write and kernel over the
blocks' planes, in place) over 4 layers per step (the step's batch built once), its compression
every ``interval`` steps included: the mean over whole intervals is what a served step pays. SmolLM2-135M's attention shapes (9 heads, 3 KV heads,
D = 64), blocks of 128, the served dtype. Run in the serving venv:

    python benchmarks/vllm_cpu/paged_layer_step.py --mode keep_prompt --methods snapkv,keepkv
    python benchmarks/vllm_cpu/paged_layer_step.py --mode compressed --methods snapkv,keepkv

``keep_prompt``: 16 requests of 1,056 prompt tokens kept whole, 64 generated entries kept (the
serving bench's shared-prefix shape, each request with its own blocks here). ``compressed``: 16
requests of 2,048-token prompts at budget 0.1. Prints milliseconds per layer-step: stock's, and
keepkv's mean, its steps without a compression, and its compressing steps: medians over
``--rounds`` rounds of every engine (the order rotated each round), each round timing
``--measured`` intervals of decode steps; each method's ratio to the first is paired by round.
"""

import argparse
import json
import math
import statistics
import time

import torch
from transformers import LlamaConfig

from keepkv.checks import as_int
from keepkv.paged import PagedCompression
from keepkv.vllm.backend import VllmCpuKernel

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 128
CONFIG = LlamaConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                     num_hidden_layers=30, intermediate_size=16, vocab_size=32)
LAYERS = 4  # layers per step: the step's host work is shared by every layer, as in an engine
MODES = {"keep_prompt": (16, 1056, 64), "compressed": (16, 2048, 0.1)}  # requests, prompt, budget


def stock_steps(requests: int, prompt: int, steps: int, dtype, generator) -> list[float]:
    """Seconds of each of ``steps`` stock decode layer-steps (cache write + kernel), past ``prompt``."""
    kernel = VllmCpuKernel()
    blocks = math.ceil((prompt + steps + 1) / BLOCK)
    caches = [torch.randn(1 + requests * blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM, generator=generator).to(dtype)
              for _ in range(LAYERS)]
    planes = [cache.view(cache.shape[0], KV_HEADS, -1) for cache in caches]
    table = torch.tensor([[1 + r * blocks + j for j in range(blocks)] for r in range(requests)], dtype=torch.int32)
    times = []
    from keepkv.paged_layout import PagedLayout

    layout = PagedLayout(BLOCK, KV_HEADS, HEAD_DIM, 0, dtype, False)
    for t in range(steps):
        held = prompt + t + 1
        query = torch.randn(requests, HEADS, HEAD_DIM, generator=generator).to(dtype)
        key, value = (torch.randn(requests, KV_HEADS, HEAD_DIM, generator=generator).to(dtype) for _ in range(2))
        slots = table[:, (held - 1) // BLOCK].long() * BLOCK + (held - 1) % BLOCK
        output = torch.empty_like(query)
        start = time.perf_counter()
        starts = torch.arange(requests + 1, dtype=torch.int32)
        lens = torch.full((requests,), held, dtype=torch.int32)
        plan = kernel.plan(starts, lens, HEADS, layout)  # vLLM builds it once per step, for every layer
        begin = time.perf_counter()
        for plane in planes:  # as many layers as keepkv's steps run
            keys_plane, values_plane = plane[..., : BLOCK * HEAD_DIM], plane[..., BLOCK * HEAD_DIM :]
            kernel.write(keys_plane, values_plane, key, value, slots)
            kernel.attend(query, keys_plane, values_plane, table, starts, lens, plan, HEAD_DIM**-0.5, output)
        times.append((time.perf_counter() - begin) / LAYERS + (begin - start) / CONFIG.num_hidden_layers)
    return times


def keepkv_steps(method: str, requests: int, prompt: int, budget, steps: int, dtype, generator,
                 keep_prompt: bool) -> tuple[list[float], list[bool]]:
    """Seconds per layer of each decode step of ``method`` over LAYERS layers, and whether it compressed."""
    paged = PagedCompression(CONFIG, method, budget, chunked=True, keep_prompt=keep_prompt, kernel=VllmCpuKernel())
    blocks = math.ceil(max(prompt, paged.capacity(prompt)) / BLOCK) + 1
    cell = paged.content_bytes(HEAD_DIM, dtype, BLOCK) // torch.empty(0, dtype=dtype).element_size()
    caches = [torch.randn(1 + requests * blocks, KV_HEADS, BLOCK, cell, generator=generator).to(dtype)
              for _ in range(LAYERS)]
    table = torch.tensor([[1 + r * blocks + j for j in range(blocks)] for r in range(requests)], dtype=torch.int32)

    def step(length: int, computed: int, prefilling: bool) -> float:
        """One engine step over LAYERS layers (the step's batch built once, as an engine builds it):
        seconds per layer."""
        starts = list(range(0, requests * length + 1, length))
        query = torch.randn(starts[-1], HEADS, HEAD_DIM, generator=generator).to(dtype)
        key, value = (torch.randn(starts[-1], KV_HEADS, HEAD_DIM, generator=generator).to(dtype) for _ in range(2))
        begin = time.perf_counter()
        batch = paged.batch(starts, [computed + length] * requests, table, [prefilling] * requests, block_size=BLOCK,
                            prompts=[prompt] * requests, layers=LAYERS)  # every layer runs the batch, as an engine's
        for layer, cache in enumerate(caches):
            paged.forward(cache, query, key, value, batch, HEAD_DIM**-0.5, layer)
        return (time.perf_counter() - begin) / LAYERS

    step(prompt, 0, True)
    interval = paged.method.interval
    done = prompt
    warm = (budget if keep_prompt else 0) + 2 * interval  # past the budget: compressions evict
    for _ in range(warm):
        step(1, done, False)
        done += 1
    times, compressing = [], []
    for _ in range(steps):
        times.append(step(1, done, False))
        done += 1
        compressing.append((done - prompt) % interval == 0)
    return times, compressing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=sorted(MODES), default="keep_prompt")
    parser.add_argument("--methods", default="snapkv,keepkv")
    parser.add_argument("--intervals", default="16", help="comma-separated intervals (default 16, the serving default)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of every engine, the order rotated each round; figures are medians over rounds")
    parser.add_argument("--measured", type=int, default=4, help="intervals of decode steps timed per round (default 4)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    try:
        as_int("--threads", args.threads, low=1)
        as_int("--rounds", args.rounds, low=1)
        as_int("--measured", args.measured, low=1)
        intervals = [as_int("--intervals", int(i) if i.strip().lstrip("-").isdigit() else i, low=1)
                     for i in args.intervals.split(",")]
    except ValueError as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    requests, prompt, budget = MODES[args.mode]
    generator = torch.Generator().manual_seed(0)
    steps = args.measured * max(intervals)
    engines = ["stock"] + [f"{method}+interval={interval}" for method in args.methods.split(",") for interval in intervals]
    runs = {engine: [] for engine in engines}  # engine -> per round (mean, without, compressing) in ms
    for round_ in range(args.rounds):
        shift = round_ % len(engines)
        for engine in engines[shift:] + engines[:shift]:
            if engine == "stock":
                stock = stock_steps(requests, prompt + (budget if args.mode == "keep_prompt" else 0), steps, dtype, generator)
                runs[engine].append((statistics.mean(stock) * 1000, None, None))
                continue
            times, compressing = keepkv_steps(engine, requests, prompt, budget, steps, dtype, generator,
                                              args.mode == "keep_prompt")
            plain = [t for t, c in zip(times, compressing) if not c]
            squeezed = [t for t, c in zip(times, compressing) if c]
            runs[engine].append((statistics.mean(times) * 1000, statistics.mean(plain) * 1000,
                                 statistics.mean(squeezed) * 1000 if squeezed else None))
        print(f"round {round_ + 1}/{args.rounds}: " + ", ".join(f"{e} {runs[e][-1][0]:.3f}" for e in engines), flush=True)
    stock_ms = statistics.median(run[0] for run in runs["stock"])
    first = engines[1]
    rows = [{"engine": "stock", "ms": stock_ms, "rounds": [run[0] for run in runs["stock"]]}]
    print(f"stock vLLM: {stock_ms:.3f} ms per layer-step ({requests} requests; median of {args.rounds} rounds)")
    for engine in engines[1:]:
        mean = statistics.median(run[0] for run in runs[engine])
        squeezed = [run[2] for run in runs[engine] if run[2] is not None]
        # paired ratios: each round's engine against the first method in the same round
        vs_first = statistics.median(a[0] / b[0] for a, b in zip(runs[engine], runs[first]))
        row = {"engine": engine, "ms": mean, "vs_stock": mean / stock_ms, f"vs_{first}": vs_first,
               "ms_without_compression": statistics.median(run[1] for run in runs[engine]),
               "ms_compressing": statistics.median(squeezed) if squeezed else None,
               "rounds": [run[0] for run in runs[engine]]}
        rows.append(row)
        print(f"{engine}: {mean:.3f} ms per layer-step ({mean / stock_ms:.2f}x stock, {vs_first:.2f}x {first} "
              f"paired): {row['ms_without_compression']:.3f} without a compression, "
              f"{row['ms_compressing'] or 0:.3f} compressing (1 step in {engine.rsplit('=', 1)[1]})")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"settings": vars(args), "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
