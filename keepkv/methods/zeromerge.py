"""ZeroMerge: context + residual merge slots + proximity window, with α·log w attention compensation."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..attention import Needs
from ..merging import momentum_merge_rows
from ..store import slots_of
from .base import Extra, Method, check_range, register

def slot_bias(counts: torch.Tensor, alpha: float) -> torch.Tensor:
    """The attention-logit compensation α·ln w of an entry that fused w tokens (eq. 8)."""
    return alpha * counts.float().log()


@register
@dataclass
class ZeroMerge(Method):
    """ZeroMerge (Liu, Liu & Tang, "ZeroMerge: Parameter-Free KV Cache Compression for
    Memory-Efficient Long-Context LLMs", 2025; code: github.com/SusCom-Lab/ZeroMerge).

    Each row and KV head splits its budget B into proximity (the ``max(min_recent,
    ⌊recent_ratio·B⌋)`` newest tokens), ``merge_slots`` residual slots, and context (the rest:
    the highest contribution scores). Scores decay: s <- λ·s + a at every query (eq. 5),
    a summed over the GQA group (the code's ``de_repeat_kv``). The prefill scores are the same
    recursion over the prompt's queries, Σ_i λ^(T−1−i)·a_i, which the prefill's attention pass
    sums as it goes (``Needs.decays``).

    Whenever the entries outside the residual slots and the proximity window exceed the
    context budget, the lowest-scoring ones leave the context (Algorithm 1; the token that just
    left the window competes with the others). Leaving entries fill the residual slots that do
    not exist yet (the lowest-scoring first, count w = 1); the others merge into the slot whose
    key has the highest dot product with theirs (eq. 6) by momentum,
    x <- (w·x + x_e)/(w + 1), w <- w + 1 (eq. 7), and the slot's score becomes the max of the
    two (the code's default ``score_update="max"``). A slot's attention logit gets + α·ln w
    through the cache bias (eq. 8).

    With the default single slot this is exactly the authors' code at prefill (all tokens that
    leave are averaged into one slot of count n) and Algorithm 1 during decoding. With several
    slots and several tokens leaving at once, the targets are chosen against the slots' keys
    before this compression's merges (one batched step; the code splits prefill residuals into
    slots by position order instead). The code's first-``cache_dense``-tokens-become-slots
    behaviour for prompts shorter than the budget is not reproduced: slots are always made of
    tokens that left the context.

    ``layer.extras["count"]`` holds each entry's fusion count w, ``layer.extras["slot"]`` marks
    the residual slots and ``layer.state["dropped"]`` [B, H_kv] counts tokens evicted without a
    merge (only when ``merge_slots=0``), so that live counts + dropped = tokens seen.

    Parameters
    ----------
    alpha : float
        Compensation strength α in [0, 1] (the paper's experiments: 0.6; the code's default: 1).
    decay : float
        Score decay λ in (0, 1] (paper and code: 0.98).
    recent_ratio : float
        Share of the budget kept as the proximity window (code: 0.1).
    min_recent : int
        Smallest proximity window (code: 2).
    merge_slots : int
        Residual merge slots per row and head (code: 1). 0 turns merging off (pure eviction).
    interval : int
        Compress every ``interval`` decode steps.
    """

    name = "zeromerge"
    paper = "Liu, Liu & Tang 2025, ZeroMerge (github.com/SusCom-Lab/ZeroMerge)"
    alpha: float = 0.6
    decay: float = 0.98
    recent_ratio: float = 0.1
    min_recent: int = 2
    merge_slots: int = 1

    def __post_init__(self):
        super().__post_init__()
        check_range("alpha", self.alpha, 0.0, 1.0)
        check_range("decay", self.decay, 0.0, 1.0, low_open=True)
        check_range("recent_ratio", self.recent_ratio, 0.0, 1.0)
        check_range("min_recent", self.min_recent, 0, math.inf)
        check_range("merge_slots", self.merge_slots, 0, math.inf)

    def needs(self, is_prefill):
        return Needs(decays=(self.decay,))  # Σ_i λ^(q-1-i) a_i over the block's rows (eq. 5)

    def setup_layer(self, layer):
        layer.add_extra("score")
        layer.add_extra("count", fill=1.0)
        layer.add_extra("slot", fill=False, dtype=torch.bool)

    def entry_extras(self, group):
        return {"score": Extra(), "count": Extra(1.0), "slot": Extra(False, torch.bool)}

    # -- scores ------------------------------------------------------------------------
    def observe(self, layer, stats):
        if "dropped" not in layer.state:
            layer.state["dropped"] = torch.zeros(layer.bias.shape[:2], dtype=torch.long, device=layer.bias.device)
        rows = stats.query.shape[3]
        layer.overwrite(score=layer.extras["score"] * self.decay**rows + stats.decayed[self.decay].sum(2))

    def protected_entries(self):
        return self.merge_slots + self.min_recent

    # -- compression -------------------------------------------------------------------
    def split(self, budget: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slots, recent, context) [B, H_kv] of each budget; they add up to the budget."""
        slots = torch.minimum(torch.full_like(budget, self.merge_slots), (budget - 1).clamp(min=0))
        recent = (budget.double() * self.recent_ratio).floor().long().clamp(min=self.min_recent)
        recent = torch.minimum(recent, budget - slots)
        return slots, recent, budget - slots - recent

    def compress(self, layer, stats):
        if layer.size <= layer.min_budget:
            return
        size = layer.size
        slots, recent, context = self.split(layer.budget)
        live = layer.live()
        is_slot = layer.extras["slot"] & live
        is_recent = live & ~is_slot & (layer.positions >= (layer.real_seen[:, None] - recent)[..., None])
        candidate = live & ~is_slot & ~is_recent
        score = layer.extras["score"]

        # Rank context candidates by score (0 = best); the lowest leave the context.
        order = score.masked_fill(~candidate, -math.inf).argsort(dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(size, device=live.device).expand_as(order))
        # A row and head that fits its budget is left alone, even when others of the batch compress
        # (no slot is opened for it: that would change how it merges later).
        fits = live.sum(-1) <= layer.budget
        leaving = candidate & (rank >= context[..., None]) & ~fits[..., None]
        keep_context = candidate & ~leaving
        missing_slots = (slots - is_slot.sum(-1)).clamp(min=0)
        seeds = leaving & (rank >= (candidate.sum(-1) - missing_slots)[..., None])  # lowest scores open slots
        merging = leaving & ~seeds
        is_slot = is_slot | seeds

        # Residual slots of each row and head, and the merge plan: slot of highest key dot product.
        slot_idx, slot_valid = slots_of(is_slot, max(1, self.merge_slots))
        sources = max(1, size - layer.min_budget)
        src, src_valid = slots_of(merging, sources)
        head_dim = layer.keys.shape[-1]
        src_keys = layer.keys.gather(2, src[..., None].expand(*src.shape, head_dim)).float()
        slot_keys = layer.keys.gather(2, slot_idx[..., None].expand(*slot_idx.shape, head_dim)).float()
        dot = (src_keys @ slot_keys.transpose(-1, -2)).masked_fill(~slot_valid[..., None, :], -math.inf)
        dst = slot_idx.gather(-1, dot.argmax(-1))
        merge = src_valid & slot_valid.any(-1, keepdim=True)
        layer.state["dropped"] = layer.state["dropped"] + (src_valid & ~merge).sum(-1)

        layer.merge_into(momentum_merge_rows(layer.keys, layer.values, layer.extras["count"], src, dst, merge))
        incoming = score.gather(-1, src).masked_fill(~merge, -math.inf)
        layer.overwrite(
            score=score.scatter_reduce(-1, dst.where(merge, 0), incoming, "amax", include_self=True),
            slot=is_slot,
            bias=torch.where(is_slot, slot_bias(layer.extras["count"], self.alpha), layer.bias),
        )

        kept = is_slot | is_recent | keep_context
        layer.keep(kept, min(size, layer.capacity))
