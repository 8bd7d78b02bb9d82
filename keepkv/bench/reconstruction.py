"""``keepkv bench --reconstruction``: what a reconstruction pass (KVzip) costs beside the prefill.

For each prompt length (256, 1,024, 2,048 and 8,192 tokens by default) and each method that runs
a pass (``kvzip``, its cheaper ``kvzip+share=0.3``), one row of documentation prose from
``pydoc_data`` is prefilled into a cache of that method, and the pass then runs
(:mod:`keepkv.reconstruction`); both are timed, ``repeats`` times, interleaved, after one warm-up.
Reported: the medians of the prefill's and the pass's seconds and their ratio, and the pass's
peak (the cache, plus the one layer's prompt and block its attention call holds, plus the
pass's scores: ``CompressedCache.prefill_peak_bytes``) against the full cache of the same
prompt (a ``full`` cache's bytes after its prefill). The target: at most ``PEAK_TARGET`` (1.25)
times the full cache at every length, so that compressing never needs more memory than the
uncompressed prompt would, give or take a quarter.

JSON (``--json``): ``{"reconstruction": {...}}`` with ``settings``, ``model`` and ``rows[]``,
each with ``method``, ``prompt_tokens``, ``prefill_s`` / ``pass_s`` (median, min, max),
``pass_to_prefill`` (the medians' ratio), ``peak_cache_bytes``, ``prompt_cache_bytes`` (the
method's cache after its prefill), ``full_cache_bytes``, ``peak_to_full`` and ``within_target``
(peak_to_full <= PEAK_TARGET).
"""

from __future__ import annotations

import statistics
import time

import torch
from tqdm.auto import tqdm

from .. import reconstruction
from ..attention import enabled
from ..cache import CompressedCache
from ..models import CACHE_KWARG

LENGTHS = (256, 1024, 2048, 8192)
PEAK_TARGET = 1.25  # the pass's peak against the full cache of the same prompt, at most
METHODS = ("kvzip", "kvzip+share=0.3")


def prose_ids(tokenizer, tokens: int) -> torch.Tensor:
    """[1, tokens] ids of pydoc_data's prose (repeated if the corpus were shorter)."""
    from pydoc_data.topics import topics

    text = " ".join(" ".join(topics[name].split()) for name in sorted(topics))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    while len(ids) < tokens:
        ids = ids + ids
    return torch.tensor([ids[:tokens]])


def _timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


@torch.inference_mode()
def measure(model, tokenizer, method: str, ids: torch.Tensor) -> dict:
    """One prefill and one pass of ``method`` over ``ids`` [1, T]: seconds and cache bytes."""
    mask = torch.ones_like(ids)
    cache = CompressedCache(model.config, method, 0.1)
    cache.expect_reconstruction()
    with enabled(model):
        prefill_s = _timed(lambda: model(input_ids=ids, attention_mask=mask, **{CACHE_KWARG: cache}, use_cache=True,
                                         logits_to_keep=1))
        prompt_bytes = cache.nbytes()
        pass_s = _timed(lambda: reconstruction.run(model, tokenizer, cache, ids, mask, chat=False))
    return {"prefill_s": prefill_s, "pass_s": pass_s, "peak_cache_bytes": cache.prefill_peak_bytes,
            "prompt_cache_bytes": prompt_bytes}


@torch.inference_mode()
def full_cache_bytes(model, ids: torch.Tensor) -> int:
    """Bytes of a full cache holding ``ids`` [1, T] after its prefill."""
    cache = CompressedCache(model.config, "full")
    with enabled(model):
        model(input_ids=ids, attention_mask=torch.ones_like(ids), **{CACHE_KWARG: cache}, use_cache=True,
              logits_to_keep=1)
    return cache.nbytes()


def run_reconstruction_bench(model, tokenizer, methods=METHODS, lengths=LENGTHS, repeats: int = 3,
                             progress: bool = True) -> dict:
    """The rows of ``keepkv bench --reconstruction`` (see the module docstring)."""
    rows = []
    bar = tqdm(total=len(lengths) * len(methods) * (repeats + 1), desc="reconstruction", leave=False,
               disable=not progress)
    for length in lengths:
        ids = prose_ids(tokenizer, length)
        full_bytes = full_cache_bytes(model, ids)
        runs = {method: [] for method in methods}
        for repeat in range(repeats + 1):  # the first round warms up and is not counted
            for method in methods:
                result = measure(model, tokenizer, method, ids)
                if repeat:
                    runs[method].append(result)
                bar.update(1)
        for method, results in runs.items():
            prefill = [r["prefill_s"] for r in results]
            passes = [r["pass_s"] for r in results]
            last = results[-1]
            rows.append({
                "method": method, "prompt_tokens": length,
                "prefill_s": {"median": statistics.median(prefill), "min": min(prefill), "max": max(prefill)},
                "pass_s": {"median": statistics.median(passes), "min": min(passes), "max": max(passes)},
                "pass_to_prefill": statistics.median(passes) / statistics.median(prefill),
                "peak_cache_bytes": last["peak_cache_bytes"], "prompt_cache_bytes": last["prompt_cache_bytes"],
                "full_cache_bytes": full_bytes, "peak_to_full": last["peak_cache_bytes"] / full_bytes,
                "within_target": last["peak_cache_bytes"] <= PEAK_TARGET * full_bytes,
            })
    bar.close()
    return {"settings": {"methods": list(methods), "lengths": list(lengths), "repeats": repeats,
                         "threads": torch.get_num_threads()}, "rows": rows}


def format_reconstruction(result: dict) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| method | prompt tokens | prefill s | pass s | pass / prefill | peak MiB | full cache MiB | peak / full |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    mib = 2 ** 20
    for row in result["rows"]:
        lines.append(
            f"| {row['method']} | {row['prompt_tokens']} | {row['prefill_s']['median']:.2f} | "
            f"{row['pass_s']['median']:.2f} | {row['pass_to_prefill']:.2f} | {row['peak_cache_bytes'] / mib:.1f} | "
            f"{row['full_cache_bytes'] / mib:.1f} | {row['peak_to_full']:.2f}{'' if row['within_target'] else ' (over)'} |"
        )
    return "\n".join(lines)
