"""H2O: heavy hitters by accumulated attention, plus a recent window."""

from dataclasses import dataclass

from ..attention import Needs
from .base import ScoredEviction, check_range, pool_group, register
from .zip_merging import ZipChoice


@dataclass
class AccumulatedAttention(ScoredEviction):
    """H2O's selection (see :class:`H2O`), shared by the methods built on it: H2O, D2O, KVMerger."""

    recent_ratio: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        check_range("recent_ratio", self.recent_ratio, 0.0, 1.0)

    def selection_needs(self, is_prefill):
        return Needs(colsum=True) if is_prefill else Needs(probs=True)

    def observe(self, layer, stats):
        if stats.is_prefill:
            layer.add_to("score", pool_group(stats.colsum))
        else:
            layer.add_to("score", pool_group(stats.probs, row_dim=3))

    def recent_count(self, budget):
        return (budget * self.recent_ratio).round().long()


@register
@dataclass
class H2O(ZipChoice, AccumulatedAttention):
    """H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference", NeurIPS 2023).

    Each entry's score is the attention it has received, summed over every query so far
    (prefill column sums, then one row per decode step); GQA groups are pooled by their mean.
    The budget is split between the most recent tokens and the highest-scoring rest, and
    eviction continues during decoding.

    Parameters
    ----------
    recent_ratio : float
        Share of the budget kept as a recent window (paper: 0.5, half heavy, half recent).
    sinks : int
        Leading tokens always kept (0 in the paper).
    merge, threshold, zip_key
        ``merge="zip"`` ZIP-merges evicted entries with Electoral Votes
        (:class:`keepkv.methods.zip_merging.ZipChoice`); the paper evicts ("none").
    interval : int
        Compress every ``interval`` decode steps.
    """

    name = "h2o"
    paper = "Zhang et al. 2023, arXiv 2306.14048"
