"""Where a compiled decode step's time goes on the host: the method's step per layer, eager and
with ``CompressedCache(compile=True)``, and, for the compiled one, the profiler's "TorchDynamo
Cache Lookup" (dynamo's guard evaluation before every call) and "Call CompiledFxGraph" (the
compiled graph's wrapper and its kernels).

    python benchmarks/bench_cpu/compiled_host_overhead.py [--prompt 1024] [--batch 4] [METHOD ...]

SmolLM2-135M shapes with random weights, 4 layers, one thread, budget 0.1; 30 decode steps
(compiling and settling), 10 timed, then 10 under the profiler. The committed output: docs/record/data/bench_cpu/compiled_host_overhead.txt.
"""

from __future__ import annotations

import argparse
import time

import torch

from keepkv.attention import enabled
from keepkv.bench.configs import build_config, random_model
from keepkv.cache import CompressedCache
from keepkv.models import CACHE_KWARG

RANGES = ("TorchDynamo Cache Lookup", "Call CompiledFxGraph")


@torch.inference_mode()
def measure(model, method: str, compile: bool, prompt: int, batch: int, warm: int = 30, steps: int = 10) -> dict:
    """The mean time of the method's step per layer (µs, ``steps`` steps after ``warm``), and the
    profiler's µs per call of each of RANGES over ``steps`` more."""
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    cache = CompressedCache(model.config, method, 0.1, compile=compile)
    step, times = cache._method_step, []

    def timed(*args):
        start = time.perf_counter()
        step(*args)
        times.append(time.perf_counter() - start)

    cache._method_step = timed
    with enabled(model):
        token = model(input_ids=ids, attention_mask=mask, **{CACHE_KWARG: cache}, logits_to_keep=1).logits[:, -1:].argmax(-1)
        for index in range(warm + 2 * steps):
            if index == warm:
                times.clear()
            if index == warm + steps:
                step_us = 1e6 * sum(times) / len(times)
                profiler = torch.profiler.profile()
                profiler.__enter__()
            mask = torch.cat([mask, torch.ones_like(token)], -1)
            token = model(input_ids=token, attention_mask=mask, **{CACHE_KWARG: cache}).logits[:, -1:].argmax(-1)
        profiler.__exit__(None, None, None)
    record = {"method": method, "compile": compile, "step_us": step_us}
    for event in profiler.key_averages():
        for name in RANGES:
            if name in event.key:
                record[name] = event.cpu_time_total / event.count  # µs per call (one call per layer-step)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("methods", nargs="*", default=["h2o", "keepkv"])
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = random_model(build_config("smollm2-135m", layers=4))
    print(f"{args.batch} x {args.prompt} tokens, budget 0.1, 4 layers, 1 thread; µs per layer and decode step")
    print(f"{'method':<8} {'eager step':>10} {'compiled step':>13} {'guard lookup':>12} {'graph call':>10}")
    for method in args.methods:
        eager = measure(model, method, False, args.prompt, args.batch)
        compiled = measure(model, method, True, args.prompt, args.batch)
        print(f"{method:<8} {eager['step_us']:>10.0f} {compiled['step_us']:>13.0f} "
              f"{compiled.get(RANGES[0], float('nan')):>12.0f} {compiled.get(RANGES[1], float('nan')):>10.0f}")


if __name__ == "__main__":
    main()
