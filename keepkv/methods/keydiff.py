"""KeyDiff: keep the keys least like the layer's mean key."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .base import (
    ComposedMethod, Merge, ScoredSelection, Selection, check_range, generated_recent_count, note_prompt_end, protected,
    register, register_selection,
)


@register_selection
@dataclass(frozen=True)
class KeyDeviation(ScoredSelection):
    """KeyDiff's selection: an entry's score is the negative cosine similarity of its key to the anchor, the mean of the
    unit keys of its row and KV head: keys unlike the rest are kept. It reads no attention, so the
    prefill runs SDPA and the score costs one pass over the keys; it needs no question (the cheap
    question-agnostic baseline). The anchor is taken over the live entries whenever the layer is
    compressed, so decoding keeps the budget by the same rule; a new key like the others would
    leave as soon as it came, so the newest ``window`` generated tokens are kept whatever their
    scores (not the paper's).

    Parameters
    ----------
    sinks : int
        Leading tokens always kept (0, as the paper and kvpress's KeyDiffPress).
    window : int
        While decoding under the budget, the newest generated tokens always kept, up to this many
        (capped by what the sinks leave of each head's budget). The prompt's own compression
        protects none, so the window does not count in ``protected_entries()`` (the budget floor).
        0: the paper's rule, every entry by its key.
    """

    name = "keydiff"
    served = True
    window: int = 32

    def __post_init__(self):
        super().__post_init__()
        check_range("window", self.window, 0, float("inf"))

    def observe(self, layer, stats):
        if stats.is_prefill:
            note_prompt_end(layer)

    @property
    def reads_every_entry(self) -> bool:
        return True  # the anchor is the mean unit key of every live entry

    def priority(self, layer, merge_scores=None) -> torch.Tensor:
        """[B, H_kv, S]: +inf for the sinks and the decoding window, else -cos(k, mean unit key of
        the live entries)."""
        live = layer.live()
        unit = F.normalize(layer.keys.float(), dim=-1)  # [B, H_kv, S, D]
        anchor = (unit * live[..., None]).sum(2) / live.sum(-1, keepdim=True).clamp_min(1)  # [B, H_kv, D]
        similarity = F.cosine_similarity(unit, anchor[:, :, None], dim=-1)
        return (-similarity).masked_fill(protected(layer, self.sinks, generated_recent_count(layer, self.window)), float("inf"))


@register
@dataclass
class KeyDiff(ComposedMethod):
    """KeyDiff (Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM
    Inference in Resource-Constrained Environments", arXiv 2504.15364).

    Selection ``keydiff`` (:class:`KeyDeviation`: keys least like their row and head's mean key),
    merge ``none`` (evict). No attention statistics and no extra pass: the cheap question-agnostic
    baseline.
    """

    name = "keydiff"
    paper = "Park et al. 2025, arXiv 2504.15364"
    selection: Selection = field(default_factory=KeyDeviation)
    merging: Merge = field(default_factory=Merge)
