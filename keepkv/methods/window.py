"""Local window: the most recent tokens only."""

from dataclasses import dataclass

from .base import ScoredEviction, register


@register
@dataclass
class Window(ScoredEviction):
    """Keep the ``budget`` most recent tokens of each row (a sliding window).

    Parameters
    ----------
    interval : int
        Compress every ``interval`` decode steps.
    """

    name = "window"
    paper = "local window attention (baseline)"

    def recent_count(self, budget):
        return budget
