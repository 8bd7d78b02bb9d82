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
DEMO_AGNOSTIC_METHODS = ("snapkv", "keydiff", "kvzip", "keepkv")
DEMO_BUDGETS = (0.5, 0.25, 0.1)


def budget_arg(text: str) -> int | float:
    """'0.1' -> 0.1 (fraction), '128' -> 128 (entries); out of range is refused as the arguments are
    parsed (before torch is imported), in ``keepkv.checks.validate_budget``'s words."""
    from .checks import validate_budget

    try:
        value = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"budget must be a float in (0, 1] or an int in [1, 2**48], got {text!r}") from None
    try:
        return validate_budget(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def check_device_option(device) -> None:
    """Refuse, in one line naming the flag, a ``--device`` (``keepkv eval``, ``keepkv bench``) torch
    cannot use here: not a device name, or a CUDA device on a torch without CUDA (imports torch)."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"--device {device}: not a device; give cpu, cuda or cuda:N") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is available here (torch {torch.__version__}): "
                         "use --device cpu")


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
