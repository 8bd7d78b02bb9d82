"""SnapKV: what the last prompt queries attend to, pooled, picks the kept prefix."""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..attention import Needs
from .base import ComposedMethod, Merge, ScoredSelection, Selection, check_range, pool_group, register, register_selection


@register_selection
@dataclass(frozen=True)
class ObservationWindow(ScoredSelection):
    """SnapKV's selection: at the end of prefill, the attention of the last ``window`` queries
    (the observation window), summed over those queries and averaged over each GQA group, is
    max-pooled along the prefix before the window with ``kernel`` (the window's own columns are not
    pooled, as in the authors' code and kvpress: pooling them would hand the window's large
    self-attention to the tokens just before it), and the top entries are kept with the window
    itself. While decoding, new tokens' attention is added to the scores and the newest ``window``
    tokens stay protected.

    Parameters
    ----------
    window : int
        Observation window w (paper: 32). Also the recent tokens always kept.
    kernel : int
        Max-pool kernel size (paper: 7; odd).
    sinks : int
        Leading tokens always kept (0).
    """

    name = "snapkv"
    scored = True
    served = True
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
            votes = pool_group(stats.window_probs, row_dim=3)  # [B, H_kv, S]
            batch, kv_heads, size = votes.shape
            prefix = size - stats.window_probs.shape[3]
            if prefix > 0:
                votes[..., :prefix] = F.max_pool1d(
                    votes[..., :prefix].reshape(-1, 1, prefix), self.kernel, stride=1, padding=self.kernel // 2
                ).view(batch, kv_heads, prefix)
            layer.add_to("score", votes)
        else:
            layer.add_to("score", pool_group(stats.probs, row_dim=3))

    def recent_count(self, budget):
        return torch.full_like(budget, self.window)

    def protected_entries(self):
        return self.sinks + self.window


@register
@dataclass
class SnapKV(ComposedMethod):
    """SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", 2024).

    Selection ``snapkv`` (:class:`ObservationWindow`: the last 32 prompt queries' attention,
    max-pooled with kernel 7, the window kept), merge ``none`` (evict). The paper compresses at
    prefill only; here decoding keeps memory bounded too.
    """

    name = "snapkv"
    paper = "Li et al. 2024, arXiv 2404.14469"
    selection: Selection = field(default_factory=ObservationWindow)
    merging: Merge = field(default_factory=Merge)
