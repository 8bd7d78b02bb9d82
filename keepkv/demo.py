"""`keepkv demo`: a ~700-token document with a hidden pass key, answered at several budgets.

One prefill is shared by every (method, budget) cell through ``CompressedCache.fork()``, and the
cells decode together in one batch (the eval runner's machinery), so the whole sweep costs about
two generations. Every figure is measured at run time with the methods' current defaults.
"""

from __future__ import annotations

import random

import torch
from pydoc_data.topics import topics

from .attention import Needs, enabled
from .cache import CompressedCache
from .eval.decoding import decode_cells, prefill
from .generation import build_prompts, encode
from .methods import get_method

FACT = "The secret pass key for the archive is {key}. Remember it, it will be asked later."
QUESTION = "What is the secret pass key for the archive mentioned in the text above?"
ANSWER_PREFIX = "The secret pass key for the archive is"
# A baseline that keeps only recent tokens, the two classic selection methods, and keepkv.
DEMO_METHODS = ("streamingllm", "h2o", "snapkv", "keepkv")
DEMO_BUDGETS = (0.5, 0.25, 0.1)
# A space and a five-digit key, one token per digit (SmolLM2).
DEMO_NEW_TOKENS = 6
# Long enough that a tenth of it is a real squeeze, short enough for the demo to run in a minute or two.
DEMO_DOCUMENT_TOKENS = 600


def document(target_tokens: int = 1000, depth: float = 0.4, seed: int = 0) -> tuple[str, str]:
    """Python-documentation prose of about ``target_tokens`` tokens with a pass key hidden at ``depth``.

    Returns (document, key). Token counts use ~4.2 characters per token.
    """
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    prose = " ".join(" ".join(topics[name].split()) for name in sorted(topics))
    start = rng.randrange(0, len(prose) // 2)
    text = prose[start : start + int(target_tokens * 4.2)]
    cut = text.rfind(". ", 0, int(len(text) * depth)) + 2
    return f"{text[:cut]}{FACT.format(key=key)} {text[cut:]}", key


@torch.inference_mode()
def run_demo(model, tokenizer, methods=DEMO_METHODS, budgets=DEMO_BUDGETS, max_new_tokens=DEMO_NEW_TOKENS,
             progress=True) -> dict:
    """Answer the pass-key question with the full cache and with each method at each budget.

    Returns a dict with ``key``, ``prompt_tokens``, ``budgets``, ``cells`` (one per method and
    budget, the full cache first: method, budget, answer, correct, kept_entries, cache_bytes,
    full_cache_bytes, share), ``needs`` (per method, the smallest budget from which on every
    larger budget shown keeps the answer, or None) and ``best`` (the cell of least memory among
    the correct ones at the smallest budget where any method is correct, or None).
    """
    methods, budgets = list(methods or DEMO_METHODS), sorted(budgets or DEMO_BUDGETS, reverse=True)
    specs = [("full", 1.0), *((name, budget) for name in methods for budget in budgets)]
    instances = [get_method(name) for name, _ in specs]  # bad names fail before the prefill
    doc, key = document(DEMO_DOCUMENT_TOKENS)
    texts = build_prompts(tokenizer, [f"{doc}\n\n{QUESTION}"], True, " " + ANSWER_PREFIX)
    inputs = encode(tokenizer, texts, True, next(model.parameters()).device)
    mask = inputs["attention_mask"]
    with enabled(model):
        record = CompressedCache(model.config, "full", record=Needs.union([m.needs(True) for m in instances]))
        first_logits = prefill(model, record, inputs["input_ids"], mask, tokenizer)
        caches = [record.fork(method, budget) for method, (_, budget) in zip(instances, specs)]
        del record
        outs = decode_cells(model, caches, first_logits, mask, max_new_tokens, tokenizer.eos_token_id,
                            progress=progress)
    cells = []
    for (name, budget), cache, out in zip(specs, caches, outs):
        summary = cache.summary()
        answer = tokenizer.decode(out[0], skip_special_tokens=True).strip()
        cells.append({
            "method": name, "budget": budget, "answer": answer, "correct": key in answer,
            "kept_entries": summary.kept_entries[0], "cache_bytes": summary.cache_bytes[0],
            "full_cache_bytes": summary.full_cache_bytes[0],
            "share": summary.cache_bytes[0] / summary.full_cache_bytes[0],
        })
    return {
        "key": key, "prompt_tokens": int(mask.sum()), "budgets": budgets, "cells": cells,
        "needs": needed_budgets(cells, methods, budgets), "best": best_cell(cells[1:], budgets),
    }


def needed_budgets(cells: list[dict], methods: list[str], budgets: list) -> dict:
    """Per method, the smallest budget b such that every budget >= b keeps the answer (None: none)."""
    needs = {}
    for name in methods:
        correct = {cell["budget"]: cell["correct"] for cell in cells if cell["method"] == name}
        needs[name] = None
        for budget in budgets:  # largest first
            if not correct[budget]:
                break
            needs[name] = budget
    return needs


def best_cell(cells: list[dict], budgets: list) -> dict | None:
    """Among the correct cells at the smallest budget where any is correct, the one of least memory."""
    for budget in reversed(budgets):
        correct = [cell for cell in cells if cell["budget"] == budget and cell["correct"]]
        if correct:
            return min(correct, key=lambda cell: cell["cache_bytes"])
    return None


def compare_with_selection(cells: list[dict], method: str = "keepkv", selection: str = "snapkv") -> str | None:
    """One line: does ``method`` keep the answer at every budget where ``selection`` (the
    selection it merges on top of) keeps it? None when either is not in the cells."""
    correct = {(c["method"], c["budget"]): c["correct"] for c in cells}
    budgets = [c["budget"] for c in cells if c["method"] == selection]
    if not budgets or not any(c["method"] == method for c in cells):
        return None
    lost = [b for b in budgets if correct[(selection, b)] and not correct.get((method, b), False)]
    gained = [b for b in budgets if correct.get((method, b), False) and not correct[(selection, b)]]
    if lost:
        text = f"{method} LOSES the answer where {selection}, its selection, keeps it: at {', '.join(map(str, lost))}."
    elif any(correct[(selection, b)] for b in budgets):
        text = f"{method} keeps the answer at every budget where {selection}, its selection, keeps it."
    else:
        text = f"{selection}, {method}'s selection, keeps the answer at no budget shown."
    if gained:
        text += f" It also keeps it where {selection} does not: at {', '.join(map(str, gained))}."
    return text


def format_demo(result: dict) -> str:
    """Memory kept against correctness: one row per method, one column per budget."""
    full, *cells = result["cells"]
    best = result["best"]
    width = 13
    lines = [
        f"Document: {result['prompt_tokens']} tokens, pass key {result['key']} hidden at 40% depth.",
        f"Full cache: {full['cache_bytes'] / 2**20:.2f} MiB, answer {full['answer']!r} "
        f"({'correct' if full['correct'] else 'WRONG: the model itself misses the key'}).",
        "Each cell: the cache's memory as a share of the full cache, and whether the answer holds the key.",
        "",
        f"{'method':<13}" + "".join(f"{'budget ' + str(b):>{width}}" for b in result["budgets"]) + "  needs",
    ]
    for name, needs in result["needs"].items():
        row = f"{name:<13}"
        for cell in (c for c in cells if c["method"] == name):
            mark = "*" if cell is best else " "
            row += f"{cell['share']:>8.0%} {'yes' if cell['correct'] else 'no ':<3}{mark}"
        lines.append(f"{row}  {needs if needs is not None else 'more than ' + str(result['budgets'][0])}")
    lines.append("")
    if best is None:
        lines.append("No method kept the answer at these budgets.")
    else:
        lines.append(
            f"* best at the smallest budget that keeps the answer: {best['method']} at {best['budget']} "
            f"({best['cache_bytes'] / 2**20:.2f} MiB, {best['share']:.0%} of the full cache), answer {best['answer']!r}"
        )
    comparison = compare_with_selection(cells)
    if comparison:
        lines.append(comparison)
    wrong = [f"{c['method']}@{c['budget']}: {c['answer']!r}" for c in cells if not c["correct"]]
    if wrong:
        lines.append("Wrong answers: " + "; ".join(wrong))
    return "\n".join(lines)
