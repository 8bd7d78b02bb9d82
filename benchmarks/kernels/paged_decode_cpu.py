"""Time one decode layer of paged attention on CPU: keepkv's C++ kernel, its Numba kernel, and vLLM's
own CPU kernel (``cpu_attention_with_kv_cache``, which adds no bias) where vLLM is importable.

SmolLM2-135M's attention shapes: 16 requests, 9 query heads, 3 KV heads, D = 64, blocks of 128,
every request ``--entries`` long (default 210 and 1,120), its blocks shuffled in the cache. The
cache is packed as vLLM packs it (keys dimension-major, values slot-major: ``PagedLayout.geometry``
of ``VllmCpuKernel.orders``, or of ``TorchPagedKernel``'s orders, the same packing, without vLLM),
with two fp32 words per slot, the second the bias. keepkv's kernels are timed through
``paged_decode`` (argument checks, allocation of the outputs included), out only ("out") and
with the per-entry logits and probabilities too ("+stats"); vLLM's through its op, its scheduler
metadata built once outside the timing (vLLM builds it once per step for every layer). Medians
of ``--calls`` calls per cell, taken in ``--rounds`` interleaved rounds. Before timing, the
kernels' outputs are compared (vLLM's with the bias words zeroed, as it reads none).

    python benchmarks/kernels/paged_decode_cpu.py                  # cpp and numba
    .venv-vllm/bin/python benchmarks/kernels/paged_decode_cpu.py --json paged_decode_cpu.json   # + vLLM

Run it on an idle machine: the load average is printed and kept in the JSON. keepkv's calls
allocate their outputs (as the engine's do) and vLLM's writes into one made once: under glibc's
default malloc, outputs of ~100 kB are handed back to the system and faulted in again on every
call (tens of microseconds on two threads at 210 entries); ``MALLOC_MMAP_THRESHOLD_=4000000`` in
the environment keeps them (the JSON records it), as a process under tcmalloc or jemalloc would.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time

import torch

from keepkv.kernels.paged import numba_available, numba_threads, paged_decode
from keepkv.paged_layout import PagedLayout, TorchPagedKernel

REQUESTS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 9, 3, 64, 128


def vllm_kernel():
    """vLLM's CPU kernel wrapper (keepkv.vllm.backend.VllmCpuKernel), or None where vLLM is not importable."""
    try:
        from keepkv.vllm.backend import VllmCpuKernel
    except Exception:  # noqa: BLE001 - any failure to import vLLM means: no vLLM column
        return None
    return VllmCpuKernel()


def build(dtype, entries: int, vllm, generator):
    """One layer's cache, filled through vLLM's cache write where it is there (else written in the
    same packing), with its planes, the keepkv geometry, a query, a shuffled block table and lengths."""
    layout = PagedLayout(BLOCK, KV_HEADS, HEAD_DIM, 2, dtype, True)
    kernel = vllm or TorchPagedKernel()
    geometry = layout.geometry(*kernel.orders(BLOCK, HEAD_DIM, dtype))
    need = math.ceil(entries / BLOCK)
    blocks = REQUESTS * need + 1
    kv_cache = torch.zeros(blocks, KV_HEADS, layout.cell, dtype=dtype)
    keys_plane, values_plane, words = layout.planes(kv_cache)
    table = torch.randperm(blocks, generator=generator)[: REQUESTS * need].view(REQUESTS, need).to(torch.int32)
    slots = (table.long()[:, :, None] * BLOCK + torch.arange(BLOCK)).view(REQUESTS, -1)[:, :entries].reshape(-1)
    keys, values = (torch.randn(slots.numel(), KV_HEADS, HEAD_DIM, generator=generator).to(dtype) for _ in range(2))
    kernel.write(keys_plane, values_plane, keys, values, slots)
    bias_at = layout.word_index(slots[:, None] // BLOCK, torch.arange(KV_HEADS)[None, :], slots[:, None] % BLOCK) + 1
    bias = torch.randn(slots.numel(), KV_HEADS, generator=generator).mul(0.5)
    words[bias_at] = bias
    query = torch.randn(REQUESTS, HEADS, HEAD_DIM, generator=generator).to(dtype)
    lens = torch.full((REQUESTS,), entries, dtype=torch.int32)
    return dict(kv_cache=kv_cache, keys_plane=keys_plane, values_plane=values_plane, words=words, bias_at=bias_at,
                geometry=geometry, layout=layout, query=query, table=table, lens=lens)


def calls_for(case, entries: int, backends, vllm):
    """{name: a zero-argument call} for one case."""
    scaling = HEAD_DIM**-0.5
    args = (case["query"], case["kv_cache"], case["table"], case["lens"], scaling, case["geometry"])
    calls = {}
    for backend in backends:
        if backend == "vllm":
            continue
        calls[f"{backend}"] = lambda b=backend: paged_decode(*args, max_len=entries, backend=b)
        calls[f"{backend}+stats"] = lambda b=backend: paged_decode(*args, max_len=entries, logits=True, probs=True,
                                                                   backend=b)
    if vllm is not None and "vllm" in backends:
        starts = torch.arange(REQUESTS + 1, dtype=torch.int32)
        plan = vllm.plan(starts, case["lens"], HEADS, case["layout"])
        output = torch.empty_like(case["query"])

        def stock():
            vllm.attend(case["query"], case["keys_plane"], case["values_plane"], case["table"], starts, case["lens"],
                        plan, scaling, output)
            return output

        calls["vllm"] = stock
    return calls


def check(case, calls, dtype) -> dict:
    """The largest |difference| of each kernel's out from cpp's (vLLM's: with the bias words zeroed)."""
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    want = calls["cpp"]()[0].float() if "cpp" in calls else None
    found = {}
    for name, call in calls.items():
        if name == "vllm" or want is None:
            continue
        found[name] = (call()[0].float() - want).abs().max().item()
    if "vllm" in calls and want is not None:
        saved = case["words"][case["bias_at"]].clone()
        case["words"][case["bias_at"]] = 0.0
        unbiased = calls["cpp"]()[0].float()
        found["vllm"] = (calls["vllm"]().float() - unbiased).abs().max().item()
        case["words"][case["bias_at"]] = saved
    for name, difference in found.items():
        if not difference <= tolerance:
            raise SystemExit(f"{name} differs from cpp by {difference:.3g} ({dtype}): not timing a wrong kernel")
    return found


def timed(calls, count: int, rounds: int) -> dict:
    """{name: median ms}: ``count`` calls each, in ``rounds`` interleaved rounds after a warm-up."""
    samples = {name: [] for name in calls}
    for call in calls.values():
        for _ in range(10):
            call()
    per_round = math.ceil(count / rounds)
    for _ in range(rounds):
        for name, call in calls.items():
            for _ in range(per_round):
                begin = time.perf_counter()
                call()
                samples[name].append(time.perf_counter() - begin)
    return {name: statistics.median(values) * 1000 for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", default="210,1120", help="entries per request, comma-separated")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--backends", default="cpp,numba,vllm", help="of cpp, numba, vllm (vllm: where importable)")
    parser.add_argument("--calls", type=int, default=300, help="timed calls per cell (at least 200)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    if args.calls < 200:
        parser.error("--calls: at least 200")
    backends = [b for b in args.backends.split(",") if b]
    if "numba" in backends and not numba_available():
        backends.remove("numba")
    vllm = vllm_kernel() if "vllm" in backends else None
    load = {"before": os.getloadavg()}
    built = time.perf_counter()
    if "cpp" in backends:
        from keepkv.kernels.paged_cpp import extension, isa

        extension()
        cpp = {"isa": isa(), "load_s": time.perf_counter() - built}
        print(f"cpp: {cpp['isa']} build, loaded (or compiled) in {cpp['load_s']:.3f} s")
    else:
        cpp = None
    generator = torch.Generator().manual_seed(0)
    rows = []
    header = None
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        if "numba" in backends:
            numba_threads(threads)
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            for entries in [int(e) for e in args.entries.split(",")]:
                case = build(dtype, entries, vllm, generator)
                calls = calls_for(case, entries, backends, vllm)
                differences = check(case, calls, dtype)
                ms = timed(calls, args.calls, args.rounds)
                row = {"threads": threads, "dtype": dtype_name, "entries": entries, "ms": ms,
                       "max_abs_difference_from_cpp": differences}
                rows.append(row)
                if header is None:
                    header = list(ms)
                    print(f"{'threads':>7} {'dtype':>8} {'entries':>7} " + " ".join(f"{n:>12}" for n in header)
                          + "   (median ms per layer call)")
                print(f"{threads:>7} {dtype_name:>8} {entries:>7} " + " ".join(f"{ms[n]:>12.3f}" for n in header),
                      flush=True)
    load["after"] = os.getloadavg()
    print(f"load average before {load['before'][0]:.2f}, after {load['after'][0]:.2f} (1 min)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"settings": vars(args), "shape": {"requests": REQUESTS, "heads": HEADS, "kv_heads": KV_HEADS,
                                                          "head_dim": HEAD_DIM, "block_size": BLOCK},
                       "cpp": cpp, "vllm": vllm is not None, "torch": torch.__version__,
                       "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                       "load_average": load, "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
                       "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
