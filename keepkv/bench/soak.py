"""``keepkv bench --soak``: long decodes of every method, to show that memory stays bounded.

Each method decodes ``steps`` tokens (20,000 by default) after one prompt, one row, on a model of
the embedded SmolLM2-135M's shape with random weights and a small depth (``layers``, 2 by
default, so that every method finishes on a CPU). The decoder runs without its LM head and is
fed random token ids: a soak measures the cache, not the answers.

At each checkpoint (steps 100, 1,000, 10,000 and 20,000, those within ``steps``, and the last
step) it records the cache's bytes (``cache.nbytes()``), the process's current RSS and the mean
kept entries per layer and KV head. The growth between the last two checkpoints, per token, is checked against
what each method documents:

- every compressing method: 0 bytes per token (its cache holds at most its budget);
- KVReviver: 8 x H_kv x L bytes per token (an int32 position and an fp32 score per vague token,
  per KV head and layer; its stored entries and sketch stay constant);
- full: no bound (it keeps every token), reported only.

JSON (``--json``): ``{"soak": {...}}`` with ``settings``, ``model`` and ``methods[]``, each with
``checkpoints[]`` (``step``, ``cache_bytes``, ``rss_bytes``, ``kept_entries``),
``growth_bytes_per_token``, ``expected_growth_bytes_per_token`` (null for full), ``bounded``
(the growth matches, or null for full) and ``seconds``.
"""

from __future__ import annotations

import gc
import sys
import time

import torch
from tqdm.auto import tqdm

from .. import reconstruction
from ..attention import enabled
from ..budgets import budget_for
from ..cache import CompressedCache
from ..models import CACHE_KWARG
from .setup import resolve_params, stand_in_tokenizer
from .runner import current_rss

CHECKPOINTS = (100, 1_000, 10_000, 20_000)


def documented_growth(spec: str, config) -> int | None:
    """Bytes per decoded token the cache of a method (a name or variant) may grow by, once it
    compresses (None: unbounded)."""
    name = spec.split("+")[0]
    if name == "full":
        return None
    if name == "kvreviver":
        return 8 * config.num_key_value_heads * config.num_hidden_layers
    return 0


@torch.inference_mode()
def soak_method(model, method: str, budget, prompt_len: int, steps: int, checkpoints, seed: int = 0,
                progress: bool = True, **params) -> dict:
    """One method's soak: its checkpoints and growth per token (see the module docstring)."""
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    decoder = model.get_decoder()
    cache = CompressedCache(config, method, budget_for(method, budget), **params)
    cache.method.prepare(model)
    prompt = torch.randint(0, config.vocab_size, (1, prompt_len), generator=generator)
    tokens = torch.randint(0, config.vocab_size, (1, steps), generator=generator)
    marks, records = sorted({c for c in checkpoints if c <= steps} | {steps}), []
    bar = tqdm(total=steps, desc=f"soak {method}", unit="tok", leave=False, disable=not progress)
    began = time.perf_counter()
    with enabled(model):
        if cache.defers_to_reconstruction:  # KVzip: the prompt's pass runs through the whole model once
            reconstruction.prefill(model, stand_in_tokenizer(config.vocab_size), cache, prompt, torch.ones_like(prompt),
                                   chat=False, positions="slots")
        else:
            decoder(input_ids=prompt, **{CACHE_KWARG: cache}, use_cache=True)
        for step in range(1, steps + 1):
            decoder(input_ids=tokens[:, step - 1 : step], **{CACHE_KWARG: cache}, use_cache=True)
            bar.update(1)
            if step in marks:
                gc.collect()
                kept = torch.stack([layer.live_counts().double().mean() for layer in cache.layers]).mean()
                records.append(
                    {"step": step, "cache_bytes": cache.nbytes(), "rss_bytes": current_rss(), "kept_entries": round(float(kept), 2)}
                )
    bar.close()
    seconds = time.perf_counter() - began
    growth, expected, bounded = None, documented_growth(method, config), None
    if len(records) >= 2:
        first, last = records[-2], records[-1]
        growth = (last["cache_bytes"] - first["cache_bytes"]) / (last["step"] - first["step"])
        if expected is not None:
            bounded = abs(growth - expected) <= 0.01 * max(expected, 1)
    return {
        "method": method,
        "checkpoints": records,
        "growth_bytes_per_token": growth,
        "expected_growth_bytes_per_token": expected,
        "bounded": bounded,
        "seconds": round(seconds, 1),
    }


def run_soak(model, methods: list[str], budget, prompt_len: int = 256, steps: int = 20_000,
             checkpoints=CHECKPOINTS, seed: int = 0, progress: bool = True, method_params: dict | None = None,
             compile: bool = False) -> dict:
    """Soak every method in ``methods`` on ``model`` (a decoder whose cache a CompressedCache can be)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"soak steps must be an int >= 1, got {steps!r}")
    results = []
    for method, params in resolve_params(methods, method_params).items():
        results.append(soak_method(model, method, budget, prompt_len, steps, checkpoints, seed, progress,
                                   compile=compile, **params))
        if progress:  # each method's line as it ends: a long soak shows its figures before the table
            last = results[-1]["checkpoints"][-1]
            tqdm.write(f"soak {method}: step {last['step']} cache {last['cache_bytes']} B, rss {last['rss_bytes']} B, "
                       f"growth {results[-1]['growth_bytes_per_token']} B/token, {results[-1]['seconds']} s", file=sys.stderr)
    config = model.config
    return {
        "settings": {"steps": steps, "prompt_len": prompt_len, "budget": budget, "batch": 1, "seed": seed,
                     "checkpoints": sorted({c for c in checkpoints if c <= steps} | {steps}), "compile": compile},
        "model": {"num_layers": config.num_hidden_layers, "num_key_value_heads": config.num_key_value_heads,
                  "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
                  "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")},
        "methods": results,
    }


def format_soak(result: dict) -> str:
    """A text table: cache bytes and RSS (MiB) at each checkpoint, growth per token, verdict."""
    steps = result["settings"]["checkpoints"]
    head = ["method"] + [f"cache@{s}" for s in steps] + [f"rss_MiB@{s}" for s in steps] + ["B/token", "expected", "bounded", "s"]
    rows = [head]
    for record in result["methods"]:
        by_step = {c["step"]: c for c in record["checkpoints"]}
        rows.append(
            [record["method"]]
            + [str(by_step[s]["cache_bytes"]) if s in by_step else "-" for s in steps]
            + [f"{by_step[s]['rss_bytes'] / 2**20:.0f}" if s in by_step else "-" for s in steps]
            + [
                "-" if record["growth_bytes_per_token"] is None else f"{record['growth_bytes_per_token']:.1f}",
                "-" if record["expected_growth_bytes_per_token"] is None else str(record["expected_growth_bytes_per_token"]),
                {True: "yes", False: "NO", None: "-"}[record["bounded"]],
                str(record["seconds"]),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows)


# `keepkv bench --soak --soak-text`: greedy text, not random ids.
TEXT_STEPS = 1500
TEXT_CHECKPOINTS = (100, 500, 1000, 1500)
NGRAM = 4


def repeated_share(tokens: list[int], n: int = NGRAM) -> float:
    """The share of the n-grams of ``tokens`` that already occurred earlier in them: 0 for text
    that never repeats itself, near 1 for a loop."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


@torch.inference_mode()
def text_soak_method(model, prompt_ids: torch.Tensor, method: str, budget, steps: int, checkpoints,
                     progress: bool = True, tokenizer=None, **params) -> dict:
    """One method's greedy text of ``steps`` tokens after ``prompt_ids`` [1, P]: the cache's bytes at
    each checkpoint, the generated ids and their repeated n-gram share. Every step feeds the
    argmax, end-of-text tokens included, so that every method writes as many tokens."""
    cache = CompressedCache(model.config, method, budget_for(method, budget), **params)
    cache.method.prepare(model)
    mask = torch.ones_like(prompt_ids)
    marks, records, generated = sorted({c for c in checkpoints if c <= steps} | {steps}), [], []
    bar = tqdm(total=steps, desc=f"text soak {method}", unit="tok", leave=False, disable=not progress)
    began = time.perf_counter()
    with enabled(model):
        if cache.defers_to_reconstruction:
            logits = reconstruction.prefill(model, tokenizer or stand_in_tokenizer(model.config.vocab_size), cache,
                                            prompt_ids, mask, chat=False, positions="slots")
        else:
            logits = model(input_ids=prompt_ids, **{CACHE_KWARG: cache}, use_cache=True, logits_to_keep=1).logits[:, -1]
        for step in range(1, steps + 1):
            token = logits.argmax(-1, keepdim=True)
            generated.append(int(token))
            logits = model(input_ids=token, **{CACHE_KWARG: cache}, use_cache=True).logits[:, -1]
            bar.update(1)
            if step in marks:
                records.append({"step": step, "cache_bytes": cache.nbytes()})
    bar.close()
    return {"method": method, "checkpoints": records, "generated": generated,
            "repeated_share": repeated_share(generated), "seconds": round(time.perf_counter() - began, 1)}


def run_text_soak(model, tokenizer, methods: list[str], budget, prompt_ids: torch.Tensor, steps: int = TEXT_STEPS,
                  checkpoints=TEXT_CHECKPOINTS, progress: bool = True, method_params: dict | None = None) -> dict:
    """Greedy text of every method in ``methods`` (full first) after one prompt: bounded memory
    (each compressing method's cache no larger at the last checkpoint than at the first past its
    prompt, KVReviver within its documented growth) and text no more repetitive than the full
    cache's over the same tokens (``repeated_share``, ``NGRAM``-grams)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"soak steps must be an int >= 1, got {steps!r}")
    names = ["full", *[m for m in methods if m != "full"]]
    results = []
    for method, params in resolve_params(names, method_params).items():
        results.append(text_soak_method(model, prompt_ids, method, budget, steps, checkpoints, progress, tokenizer,
                                        **params))
        if progress:  # each method's line as it ends: a long soak shows its figures before the table
            record = results[-1]
            tqdm.write(f"text soak {method}: cache bytes {[c['cache_bytes'] for c in record['checkpoints']]}, "
                       f"repeated {record['repeated_share']:.3f}, {record['seconds']} s", file=sys.stderr)
    full = results[0]
    for record in results:
        first, last = record["checkpoints"][0], record["checkpoints"][-1]
        expected = documented_growth(record["method"], model.config)
        record["bounded"] = None if expected is None else (
            last["cache_bytes"] - first["cache_bytes"] <= expected * (last["step"] - first["step"]))
        record["repeated_vs_full"] = record["repeated_share"] - full["repeated_share"]
        if tokenizer is not None:
            record["text_head"] = tokenizer.decode(record["generated"][:60])
    return {"settings": {"steps": steps, "prompt_tokens": int(prompt_ids.shape[1]), "budget": budget,
                         "ngram": NGRAM, "checkpoints": sorted({c for c in checkpoints if c <= steps} | {steps})},
            "methods": results}


def format_text_soak(result: dict) -> str:
    """A text table: cache bytes at each checkpoint, bounded, repeated n-gram share against full's."""
    steps = result["settings"]["checkpoints"]
    rows = [["method", *[f"cache_KiB@{s}" for s in steps], "bounded", "repeated", "vs full", "s"]]
    for record in result["methods"]:
        by_step = {c["step"]: c for c in record["checkpoints"]}
        rows.append([record["method"], *[f"{by_step[s]['cache_bytes'] / 1024:.0f}" for s in steps],
                     {True: "yes", False: "NO", None: "-"}[record["bounded"]], f"{record['repeated_share']:.3f}",
                     f"{record['repeated_vs_full']:+.3f}", str(record["seconds"])])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows)
