"""Plots are an extra: ``pip install "keepkv[plot]"`` brings matplotlib, which the core does not need.

``keepkv eval`` and ``keepkv bench`` write every number without it, and say in one line how to get
their plots (:func:`can_plot`).
"""

from __future__ import annotations

import sys

PLOT_EXTRA = 'pip install "keepkv[plot]" (from a checkout: pip install -e ".[plot]")'


def have_matplotlib() -> bool:
    """Whether matplotlib imports."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def can_plot(command: str, numbers: str) -> bool:
    """Whether matplotlib imports. Where it does not, one line on stderr says that ``command``
    ("keepkv eval") draws no plot, how to get plots, and where the numbers are (``numbers``)."""
    if have_matplotlib():
        return True
    print(f"{command}: note: no plot without matplotlib ({PLOT_EXTRA}); {numbers}", file=sys.stderr)
    return False
