"""`keepkv demo`: a ~700-token document with a hidden pass key, answered at several budgets, in
both settings: the question inside the prompt that is compressed, and the question asked after
the document was compressed alone ("compress once, ask many").

Per setting, one prefill is shared by every (method, budget) cell through
``CompressedCache.fork()``, and the cells decode together in one batch (the eval runner's
machinery). Every figure is measured at run time with the methods' current defaults.
"""

from __future__ import annotations

import random

import torch
from pydoc_data.topics import topics

from .arguments import DEMO_AGNOSTIC_METHODS, DEMO_BUDGETS, DEMO_METHODS  # noqa: F401 (this module's API)
from .attention import Needs, enabled
from .cache import CompressedCache
from .eval.decoding import decode_cells, prefill
from .generation import build_prompts, context_and_question_ids, encode
from .methods import get_method

FACT = "The secret pass key for the archive is {key}. Remember it, it will be asked later."
QUESTION = "What is the secret pass key for the archive mentioned in the text above?"
ANSWER_PREFIX = "The secret pass key for the archive is"
# The methods and budgets (DEMO_METHODS, DEMO_AGNOSTIC_METHODS, DEMO_BUDGETS) are in
# keepkv/arguments.py, which the command line's parser reads before torch loads.
SETTINGS = ("aware", "agnostic")
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
             progress=True, agnostic_methods=DEMO_AGNOSTIC_METHODS, settings=SETTINGS) -> dict:
    """Answer the pass-key question with the full cache and with each method at each budget, in
    each of ``settings``: "aware" (the question inside the prompt that is compressed, ``methods``)
    and "agnostic" (the document compressed alone, then the question appended uncompressed, as
    :func:`keepkv.compress` does, ``agnostic_methods``).

    Returns a dict with ``key``, ``prompt_tokens``, ``budgets`` and, per setting in ``settings``,
    ``cells`` (one per method and budget, the full cache first: method, budget, answer, correct,
    kept_entries, cache_bytes, full_cache_bytes, share), ``needs`` (per method, the smallest budget
    from which on every larger budget shown keeps the answer, or None) and ``best`` (the cell of
    least memory among the correct ones at the smallest budget where any method is correct, or None).
    """
    budgets = sorted(budgets or DEMO_BUDGETS, reverse=True)
    chosen = {"aware": list(methods or DEMO_METHODS), "agnostic": list(agnostic_methods or DEMO_AGNOSTIC_METHODS)}
    # compressed before the question, a method runs on its compress-once selection (keepkv: kvzip's)
    once = {"aware": False, "agnostic": True}
    for setting in settings:
        for name in chosen[setting]:
            get_method(name, compress_once=once[setting])  # bad names fail before the prefill
    doc, key = document(DEMO_DOCUMENT_TOKENS)
    device = next(model.parameters()).device
    result = {"key": key, "budgets": budgets, "settings": {}}
    for setting in settings:
        names = chosen[setting]
        specs = [("full", 1.0), *((name, budget) for name in names for budget in budgets)]
        instances = [get_method(name, compress_once=once[setting]) for name, _ in specs]
        record = CompressedCache(model.config, "full", record=Needs.union([m.needs(True) for m in instances]))
        question, decoding = None, "compress"
        if setting == "aware":
            inputs = encode(tokenizer, build_prompts(tokenizer, [f"{doc}\n\n{QUESTION}"], True, " " + ANSWER_PREFIX),
                            True, device)
            ids, mask = inputs["input_ids"], inputs["attention_mask"]
        else:  # the document alone is compressed; the question part follows it, uncompressed
            head, tail = context_and_question_ids(tokenizer, doc, QUESTION, True, " " + ANSWER_PREFIX)
            ids, question = torch.tensor([head], device=device), torch.tensor([tail], device=device)
            mask, decoding = torch.ones_like(ids), "append"
        with enabled(model):
            first_logits = prefill(model, record, ids, mask, tokenizer)
            caches = [record.fork(method, budget, decoding) for method, (_, budget) in zip(instances, specs)]
            del record
            outs = decode_cells(model, caches, None if question is not None else first_logits, mask, max_new_tokens,
                                tokenizer.eos_token_id, progress=progress, question=question)
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
        result["settings"][setting] = {
            "prompt_tokens": int(mask.sum()) + (0 if question is None else question.shape[1]),
            "cells": cells, "needs": needed_budgets(cells, names, budgets), "best": best_cell(cells[1:], budgets),
        }
    result["prompt_tokens"] = next(iter(result["settings"].values()))["prompt_tokens"]
    return result


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


HEADINGS = {
    "aware": "Question inside the compressed prompt (the question is compressed with the document):",
    "agnostic": "Question after the compression (the document compressed alone, then asked: compress once, ask many;\n"
                "keepkv runs on kvzip's selection here, as keepkv.compress does):",
}
# (method, the selection it merges on top of) the demo compares, per setting
COMPARED = {"aware": ("keepkv", "snapkv"), "agnostic": ("keepkv", "kvzip")}


def format_demo(result: dict) -> str:
    """Memory kept against correctness, per setting: one row per method, one column per budget."""
    lines = [
        f"Document: {result['prompt_tokens']} tokens, pass key {result['key']} hidden at 40% depth.",
        "Each cell: the cache's memory as a share of the full cache, and whether the answer holds the key.",
    ]
    for setting, part in result["settings"].items():
        lines += ["", HEADINGS[setting], *format_setting(part, result["budgets"], *COMPARED[setting])]
    return "\n".join(lines)


def format_setting(part: dict, budgets: list, method: str, selection: str) -> list[str]:
    """The lines of one setting's table (see :func:`format_demo`)."""
    full, *cells = part["cells"]
    best = part["best"]
    width = 13
    name_width = max(13, *(len(name) + 1 for name in part["needs"]))
    lines = [
        f"Full cache: {full['cache_bytes'] / 2**20:.2f} MiB, answer {full['answer']!r} "
        f"({'correct' if full['correct'] else 'WRONG: the model itself misses the key'}).",
        f"{'method':<{name_width}}" + "".join(f"{'budget ' + str(b):>{width}}" for b in budgets) + "  needs",
    ]
    for name, needs in part["needs"].items():
        row = f"{name:<{name_width}}"
        for cell in (c for c in cells if c["method"] == name):
            mark = "*" if cell is best else " "
            row += f"{cell['share']:>8.0%} {'yes' if cell['correct'] else 'no ':<3}{mark}"
        lines.append(f"{row}  {needs if needs is not None else 'more than ' + str(budgets[0])}")
    if best is None:
        lines.append("No method kept the answer at these budgets.")
    else:
        lines.append(
            f"* best at the smallest budget that keeps the answer: {best['method']} at {best['budget']} "
            f"({best['cache_bytes'] / 2**20:.2f} MiB, {best['share']:.0%} of the full cache), answer {best['answer']!r}"
        )
    comparison = compare_with_selection(cells, method, selection)
    if comparison:
        lines.append(comparison)
    wrong = [f"{c['method']}@{c['budget']}: {c['answer']!r}" for c in cells if not c["correct"]]
    if wrong:
        lines.append("Wrong answers: " + "; ".join(wrong))
    return lines
