"""Where a served method's time goes inside vLLM: the serving bench's engines (no stock engine),
each with the paged adapter's phases timed (wall seconds summed over every layer call, and the
number of calls). Run in the serving venv with the serving bench's options:

    python benchmarks/vllm_cpu/engine_phases.py --requests 16 --prompt-len 2048 --gen-len 256 \
        --full-requests 2 --methods snapkv,keepkv --budget 0.1

Nested phases are counted in their callers too (``PagedCompression.forward`` holds them all).
Prints each engine's JSON line (as ``keepkv.vllm.bench``), then its phases, slowest first; with
``--json PATH`` also writes them.
"""

import collections
import functools
import json
import sys
import time

import keepkv.kernels.paged
import keepkv.paged
import keepkv.paged_compress
import keepkv.vllm.bench as bench
from keepkv.paged import PagedCompression
from keepkv.paged_prompt import PagedPrompts
from keepkv.paged_requests import PagedRequests
from keepkv.paged_slots import PagedSlots
from keepkv.step import LayerStep
from keepkv.store import LayerStore

SECONDS: dict = collections.defaultdict(float)
CALLS: dict = collections.defaultdict(int)


def timed(owner, name: str, label: str) -> None:
    """Replace ``owner.name`` by itself, timed under ``label``."""
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SECONDS[label] += time.perf_counter() - start
            CALLS[label] += 1

    setattr(owner, name, wrapper)


PHASES = [
    (PagedCompression, ["forward", "_write_new", "_attend", "_gather_due", "_decode_stats"]),
    (PagedPrompts, ["close", "dense", "file_chunk"]),
    (PagedSlots, ["gather", "write_back", "write_new"]),
    (PagedRequests, ["keep_queries", "kept_queries", "file_states", "states", "batch"]),
    (LayerStep, ["decode", "close_prompt"]),
    (LayerStore, ["stack", "split"]),
]


def main() -> None:
    for owner, names in PHASES:
        for name in names:
            timed(owner, name, f"{owner.__name__}.{name}")
    # module functions paged.py imported by name: timed where it calls them
    for module, name in ((keepkv.paged_compress, "compress_due"), (keepkv.kernels.paged, "paged_decode")):
        timed(module, name, f"{module.__name__}.{name}")
        setattr(keepkv.paged, name, getattr(module, name))
    argv, json_path = list(sys.argv[1:]), None
    if "--json" in argv:
        at = argv.index("--json")
        json_path = argv[at + 1]
        del argv[at : at + 2]
    results = []

    def run_all(engines, run, settings, _json_path, out=None, err=None):
        for keepkv_settings, blocks in engines[1:]:  # the methods; stock has no paged phases
            SECONDS.clear()
            CALLS.clear()
            row = run(keepkv_settings, blocks, None)
            print(json.dumps(row), flush=True)
            phases = {label: {"seconds": round(SECONDS[label], 3), "calls": CALLS[label]}
                      for label in sorted(SECONDS, key=SECONDS.get, reverse=True)}
            for label, phase in phases.items():
                print(f"  {phase['seconds']:8.2f} s {phase['calls']:7d}  {label}", flush=True)
            results.append({"engine": row, "phases": phases})
        if json_path:
            with open(json_path, "w") as handle:
                json.dump({"settings": settings, "results": results}, handle, indent=2)

    bench.run_all = run_all
    bench.main(argv)


if __name__ == "__main__":
    main()
