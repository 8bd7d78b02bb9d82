"""`keepkv demo`: a ~1k-token document with a hidden fact, answered by every method."""

from __future__ import annotations

import random
import textwrap

from pydoc_data.topics import topics

from .generation import generate
from .methods import METHODS

FACT = "The secret pass key for the archive is {key}. Remember it, it will be asked later."
QUESTION = "What is the secret pass key for the archive mentioned in the text above?"
ANSWER_PREFIX = "The secret pass key for the archive is"


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


def run_demo(model, tokenizer, methods=None, budget=0.1, max_new_tokens=12, progress=True) -> list[dict]:
    """Answer the demo question with the full cache and each method; one row per method."""
    doc, key = document()
    prompt = f"{doc}\n\n{QUESTION}"
    rows = []
    for name in methods or ["full", *sorted(m for m in METHODS if m != "full")]:
        result = generate(
            model, tokenizer, prompt, method=name, budget=1.0 if name == "full" else budget,
            max_new_tokens=max_new_tokens, answer_prefix=" " + ANSWER_PREFIX, progress=progress,
        )[0]
        rows.append({**result.to_dict(), "correct": key in result.answer, "key": key})
    return rows


def format_demo(rows: list[dict]) -> str:
    """A side-by-side table of the demo's answers and memory."""
    first = rows[0]
    lines = [
        f"Document: {first['prompt_tokens']} tokens, pass key {first['key']} hidden at 40% depth.",
        f"{'method':<13} {'budget':>6} {'kept':>7} {'cache MB':>9} {'of full':>8}  ok  answer",
    ]
    for row in rows:
        share = row["cache_bytes"] / row["full_cache_bytes"]
        answer = textwrap.shorten(row["answer"], 40, placeholder="…")
        lines.append(
            f"{row['method']:<13} {'-' if row['budget'] is None else row['budget']:>6} {row['kept_entries']:>7.1f} "
            f"{row['cache_bytes'] / 2**20:>9.2f} {share:>7.0%}  {'yes' if row['correct'] else 'no ':<3} {answer}"
        )
    return "\n".join(lines)
