"""H2O: heavy hitters by accumulated attention, plus a recent window."""

from dataclasses import dataclass, field

from ..attention import Needs
from .base import ComposedMethod, Merge, ScoredSelection, Selection, check_range, pool_group, register, register_selection


@register_selection
@dataclass(frozen=True)
class AccumulatedAttention(ScoredSelection):
    """H2O's selection: each entry's score is the attention it has received, summed over every
    query so far (prefill column sums, then one row per decode step), GQA groups pooled by their
    mean; the budget is split between the most recent tokens and the highest-scoring rest.

    Parameters
    ----------
    recent_ratio : float
        Share of the budget kept as a recent window (paper: 0.5, half heavy, half recent).
    sinks : int
        Leading tokens always kept (0 in the paper).
    """

    name = "h2o"
    scored = True
    served = True
    recent_ratio: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        check_range("recent_ratio", self.recent_ratio, 0.0, 1.0)

    def needs(self, is_prefill):
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
class H2O(ComposedMethod):
    """H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference", NeurIPS 2023).

    Selection ``h2o`` (:class:`AccumulatedAttention`: accumulated attention, half the budget a
    recent window), merge ``none`` (evict); eviction continues during decoding.
    """

    name = "h2o"
    paper = "Zhang et al. 2023, arXiv 2306.14048"
    selection: Selection = field(default_factory=AccumulatedAttention)
    merging: Merge = field(default_factory=Merge)
