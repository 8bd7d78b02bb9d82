"""Argument parsers shared by the command lines (keepkv.cli, keepkv.eval.cli, keepkv.bench).

A module of its own so that ``keepkv.cli``, which imports the eval and bench command lines,
is imported by neither.
"""

from __future__ import annotations

import argparse


def budget_arg(text: str) -> int | float:
    """'0.1' -> 0.1 (fraction), '128' -> 128 (entries)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"budget must be a float in (0, 1] or an int >= 1, got {text!r}")
