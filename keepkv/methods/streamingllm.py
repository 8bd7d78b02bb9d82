"""StreamingLLM: attention sinks plus a recent window."""

from dataclasses import dataclass, field

from .base import ComposedMethod, Merge, ScoredSelection, Selection, register, register_selection


@register_selection
@dataclass(frozen=True)
class SinksAndRecent(ScoredSelection):
    """The first ``sinks`` tokens of each row and the most recent ones.

    Parameters
    ----------
    sinks : int
        Attention-sink tokens always kept (paper: 4).
    """

    name = "streamingllm"
    served = True
    sinks: int = 4

    def recent_count(self, budget):
        return budget


@register
@dataclass
class StreamingLLM(ComposedMethod):
    """StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024).

    Keeps the first ``sinks`` tokens of each row and fills the rest of the budget with the most
    recent ones: selection ``streamingllm`` (:class:`SinksAndRecent`), merge ``none`` (evict).
    """

    name = "streamingllm"
    paper = "Xiao et al. 2024, arXiv 2309.17453"
    selection: Selection = field(default_factory=SinksAndRecent)
    merging: Merge = field(default_factory=Merge)
