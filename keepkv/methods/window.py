"""Local window: the most recent tokens only."""

from dataclasses import dataclass

from .base import ScoredEviction, register
from .zip_merging import ZipChoice


@register
@dataclass
class Window(ZipChoice, ScoredEviction):
    """Keep the ``budget`` most recent tokens of each row (a sliding window).

    Parameters
    ----------
    merge, threshold, zip_key
        ``merge="zip"`` ZIP-merges evicted entries with Electoral Votes
        (:class:`keepkv.methods.zip_merging.ZipChoice`); default "none" (evict).
    interval : int
        Compress every ``interval`` decode steps.
    """

    name = "window"
    paper = "local window attention (baseline)"
    scored = False  # recency alone: no per-entry score is kept

    def recent_count(self, budget):
        return budget
