"""Warnings where keepkv's output will be poor: legal input, one line each.

All are :class:`KeepKVWarning` (a UserWarning), so library users can filter them with
``warnings.filterwarnings("ignore", category=keepkv.KeepKVWarning)``; the CLI prints each as
one ``keepkv: warning: ...`` line.
"""

from __future__ import annotations

import warnings


class KeepKVWarning(UserWarning):
    """keepkv will run, but the answer is likely to be poor."""


def warn_context_length(config, prompt_tokens: int, new_tokens: int) -> None:
    """Warn when prompt plus new tokens run past the positions the model was trained on."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit and prompt_tokens + new_tokens > limit:
        warnings.warn(
            f"prompt ({prompt_tokens} tokens) plus {new_tokens} new tokens exceed the model's "
            f"max_position_embeddings ({limit}): expect a poor answer; shorten the prompt or generate fewer tokens",
            KeepKVWarning,
            stacklevel=3,
        )


def warn_budget(method, budget: int | float, prompt_tokens: int, kept: int) -> None:
    """Warn when a compressed row keeps fewer entries than ``method`` protects, or when an int
    budget of 1 (an entry count) was likely meant as 1.0 (nothing compressed).

    ``prompt_tokens`` and ``kept``: the prompt length and per-layer budget of the row that keeps
    the fewest entries among the rows that are compressed.
    """
    protected = method.protected_entries()
    entry_count = isinstance(budget, int) and budget == 1
    if kept < protected:
        hint = " (an int budget is an entry count; 1.0 compresses nothing)" if entry_count else ""
        warnings.warn(
            f"budget {budget!r}{hint} keeps {kept} entries per layer and head of a {prompt_tokens}-token prompt, "
            f"fewer than {method.name}'s {protected} protected tokens (sinks + recent window): expect a poor "
            f"answer; use a budget of at least {protected} entries",
            KeepKVWarning,
            stacklevel=2,
        )
    elif entry_count:
        warnings.warn(
            f"budget=1 is an entry count: it keeps 1 entry per layer and head of a {prompt_tokens}-token prompt; "
            "pass 1.0 to compress nothing",
            KeepKVWarning,
            stacklevel=2,
        )
