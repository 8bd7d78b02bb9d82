"""Argument parsers shared by the command lines (keepkv.cli, keepkv.eval.cli, keepkv.bench).

A module of its own so that ``keepkv.cli``, which imports the eval and bench command lines,
is imported by neither.
"""

from __future__ import annotations

import argparse

# `keepkv demo`'s defaults. Question inside the prompt: a baseline that keeps only recent tokens,
# the two classic selection methods, and keepkv. Question after the compression: the selection
# that wins with the question inside (snapkv) and keepkv on it, the cheap question-agnostic
# baseline (keydiff), and the context-reconstruction selection with and without KeepKV's merge.
DEMO_METHODS = ("streamingllm", "h2o", "snapkv", "keepkv")
DEMO_AGNOSTIC_METHODS = ("snapkv", "keepkv", "keydiff", "kvzip", "keepkv+selection=kvzip")
DEMO_BUDGETS = (0.5, 0.25, 0.1)


def budget_arg(text: str) -> int | float:
    """'0.1' -> 0.1 (fraction), '128' -> 128 (entries); out of range is refused as the arguments are
    parsed (before torch is imported)."""
    wanted = f"budget must be a float in (0, 1] (a fraction of the prompt) or an int in [1, 2**48] (entries), got {text!r}"
    try:
        value = int(text)
        if not 1 <= value <= 2**48:
            raise argparse.ArgumentTypeError(wanted)
        return value
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(wanted) from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(wanted)
    return value


def _unset(default) -> bool:
    """A default that means "not given" (0 is a value: ``0 == False`` must not hide it)."""
    return default is None or default is False or default is argparse.SUPPRESS or default in ([], "")


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every option's default as "(default: X)", in one place for every command.

    Options whose default means "not given" (None, False, an empty list) show none: their help
    says what happens then. A list default is written as on the command line ("0.5 0.25 0.1").
    """

    def _get_help_string(self, action):
        help_text = action.help or ""
        default = action.default
        if (
            "%(default)" in help_text or "(default" in help_text or _unset(default) or not action.option_strings
        ):
            return action.help
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{help_text} (default: {shown.replace('%', '%%')})".lstrip()
