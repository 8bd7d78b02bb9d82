"""SnapKV: what the last prompt queries attend to, pooled, picks the kept prefix."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention import Needs
from .base import ScoredEviction, check_range, pool_group, register


@register
@dataclass
class SnapKV(ScoredEviction):
    """SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", 2024).

    At the end of prefill, the attention of the last ``window`` queries (the observation
    window), summed over those queries and averaged over each GQA group, is max-pooled along
    the sequence with ``kernel`` and the top entries are kept with the window itself.
    The paper compresses at prefill only; here decoding keeps memory bounded too: new
    tokens' attention is added to the scores and the newest ``window`` tokens stay protected.

    Parameters
    ----------
    window : int
        Observation window w (paper: 32). Also the recent tokens always kept.
    kernel : int
        Max-pool kernel size (paper: 7; odd).
    interval : int
        Compress every ``interval`` decode steps.
    """

    name = "snapkv"
    paper = "Li et al. 2024, arXiv 2404.14469"
    window: int = 32
    kernel: int = 7

    def __post_init__(self):
        super().__post_init__()
        check_range("window", self.window, 1, float("inf"))
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be an odd int >= 1, got {self.kernel!r}")

    def needs(self, is_prefill):
        return Needs(window=self.window) if is_prefill else Needs(probs=True)

    def observe(self, layer, stats):
        if stats.is_prefill:
            votes = pool_group(stats.window_probs, row_dim=3)
            batch, kv_heads, size = votes.shape
            pooled = F.max_pool1d(votes.view(-1, 1, size), self.kernel, stride=1, padding=self.kernel // 2)
            layer.extras["score"] += pooled.view(batch, kv_heads, size)
        else:
            layer.extras["score"] += pool_group(stats.probs, row_dim=3)

    def recent_count(self, budget):
        return torch.full_like(budget, self.window)
