"""StreamingLLM: attention sinks plus a recent window."""

from dataclasses import dataclass

from .base import ScoredEviction, register
from .zip_merging import ZipChoice


@register
@dataclass
class StreamingLLM(ZipChoice, ScoredEviction):
    """StreamingLLM (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024).

    Keeps the first ``sinks`` tokens of each row and fills the rest of the budget with the
    most recent ones.

    Parameters
    ----------
    sinks : int
        Attention-sink tokens always kept (paper: 4).
    merge, threshold, zip_key
        ``merge="zip"`` ZIP-merges evicted entries with Electoral Votes
        (:class:`keepkv.methods.zip_merging.ZipChoice`); default "none" (evict).
    interval : int
        Compress every ``interval`` decode steps.
    """

    name = "streamingllm"
    paper = "Xiao et al. 2024, arXiv 2309.17453"
    scored = False  # sinks and recency alone: no per-entry score is kept
    sinks: int = 4

    def recent_count(self, budget):
        return budget
