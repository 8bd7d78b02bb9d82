"""Local window: the most recent tokens only."""

from dataclasses import dataclass, field

from .base import ComposedMethod, Merge, ScoredSelection, Selection, register, register_selection


@register_selection
@dataclass(frozen=True)
class Recent(ScoredSelection):
    """The ``budget`` most recent tokens of each row."""

    name = "window"
    served = True

    def recent_count(self, budget):
        return budget


@register
@dataclass
class Window(ComposedMethod):
    """Keep the ``budget`` most recent tokens of each row (a sliding window).

    Selection ``window`` (:class:`Recent`); merge ``none`` (evict). ``merge=zip`` (or any other
    merge) folds what leaves into what stays.
    """

    name = "window"
    paper = "local window attention (baseline)"
    selection: Selection = field(default_factory=Recent)
    merging: Merge = field(default_factory=Merge)
