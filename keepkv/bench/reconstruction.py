"""``keepkv bench --reconstruction``: what a reconstruction pass (KVzip) costs beside the prefill.

For each prompt length (1,024 and 4,096 tokens by default) and each method that runs a pass
(``kvzip``, its cheaper ``kvzip+share=0.3``), one row of documentation prose from
``pydoc_data`` is prefilled into a cache of that method, and the pass then runs
(:mod:`keepkv.reconstruction`); both are timed, ``repeats`` times, interleaved, after one warm-up.
Reported: the medians of the prefill's and the pass's seconds and their ratio, and the cache's
peak bytes during the pass next to the bytes of the uncompressed prompt cache and of one block
of the pass (every layer's keys, values and per-entry words for ``chunk`` tokens plus the
instruction): a pass holds at most the prompt plus one block.

JSON (``--json``): ``{"reconstruction": {...}}`` with ``settings``, ``model`` and ``rows[]``,
each with ``method``, ``prompt_tokens``, ``prefill_s`` / ``pass_s`` (median, min, max),
``pass_to_prefill`` (the medians' ratio), ``peak_cache_bytes``, ``prompt_cache_bytes``,
``block_bytes`` and ``within_prompt_plus_block`` (peak <= prompt + block).
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

LENGTHS = (1024, 4096)
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
    layer = cache.layers[0]
    passes = cache.method.needs(True).reconstruct
    chunk = max(p.chunk for p in passes)
    instruction = len(tokenizer(reconstruction.REPEAT_NEXT, add_special_tokens=False)["input_ids"]) + reconstruction.CARRY + 1
    block = min(chunk, ids.shape[1]) + instruction
    block_bytes = block * layer.entry_nbytes() * cache.num_layers
    return {"prefill_s": prefill_s, "pass_s": pass_s, "peak_cache_bytes": cache.prefill_peak_bytes,
            "prompt_cache_bytes": prompt_bytes, "block_bytes": block_bytes}


def run_reconstruction_bench(model, tokenizer, methods=METHODS, lengths=LENGTHS, repeats: int = 3,
                             progress: bool = True) -> dict:
    """The rows of ``keepkv bench --reconstruction`` (see the module docstring)."""
    rows = []
    bar = tqdm(total=len(lengths) * len(methods) * (repeats + 1), desc="reconstruction", leave=False,
               disable=not progress)
    for length in lengths:
        ids = prose_ids(tokenizer, length)
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
                "block_bytes": last["block_bytes"],
                "within_prompt_plus_block": last["peak_cache_bytes"] <= last["prompt_cache_bytes"] + last["block_bytes"],
            })
    bar.close()
    return {"settings": {"methods": list(methods), "lengths": list(lengths), "repeats": repeats,
                         "threads": torch.get_num_threads()}, "rows": rows}


def format_reconstruction(result: dict) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| method | prompt tokens | prefill s | pass s | pass / prefill | peak cache MiB | prompt + block MiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    mib = 2 ** 20
    for row in result["rows"]:
        lines.append(
            f"| {row['method']} | {row['prompt_tokens']} | {row['prefill_s']['median']:.2f} | "
            f"{row['pass_s']['median']:.2f} | {row['pass_to_prefill']:.2f} | {row['peak_cache_bytes'] / mib:.1f} | "
            f"{(row['prompt_cache_bytes'] + row['block_bytes']) / mib:.1f} |"
        )
    return "\n".join(lines)
