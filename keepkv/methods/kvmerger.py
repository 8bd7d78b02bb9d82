"""KVMerger: evicted entries merge into the pivot of their run of adjacent similar keys."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..merging import MergedRows, convex_merge_rows
from ..store import slots_of
from .base import ComposedMethod, Merge, Selection, check_range, register, register_merge
from .h2o import AccumulatedAttention


def gaussian_weights(keys: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """exp(−‖k_src − k_dst‖² / 2σ²) [B, H_kv, E]; keys [B, H_kv, S, D], sigma [B, H_kv]."""
    head_dim = keys.shape[-1]
    k_src = keys.gather(2, src.clamp_min(0)[..., None].expand(*src.shape, head_dim)).float()
    k_dst = keys.gather(2, dst.clamp_min(0)[..., None].expand(*dst.shape, head_dim)).float()
    return (-(k_src - k_dst).square().sum(-1) / (2.0 * sigma.float().square()[..., None])).exp()


def kvmerger_merge_rows(keys, values, src, dst, merge, sigma) -> MergedRows:
    """Gaussian-kernel convex merge toward the pivot (KeepKV eq. 12): the pivot weighs exp(0) = 1.

    keys, values [B, H_kv, S, D]; src, dst, merge [B, H_kv, E]; sigma [B, H_kv]. No votes.
    """
    return convex_merge_rows(keys, values, src, dst, merge, gaussian_weights(keys, src, dst, sigma))


@register_merge
@dataclass(frozen=True)
class PivotMerge(Merge):
    """KVMerger's merge of a plan: evicted members of a merging set go into its pivot, by
    Gaussian-kernel weights; the kept entries are then gathered in position order, since sets are
    runs of adjacent slots.

    - **Merging sets.** KVMerger observes that adjacent tokens' keys are highly similar and
      groups consecutive tokens into merging sets. Here a set is a maximal run of live entries,
      adjacent in position, whose consecutive keys have cosine similarity >= ``threshold``
      (a chain, computed for all rows and heads at once), and a set matters when it holds at
      least one entry chosen for eviction.
    - **Pivot.** KVMerger's pivotal state is the set's most attended token; here the kept member
      of the set with the highest score of the selection (its per-entry ``"score"``), since the
      merged state must survive. Evicted members of a set with no kept member, and evicted tokens
      in no set, are dropped.
    - **Weights.** The evicted members merge into the pivot by the plain convex merge of eq. 11
      with Gaussian-kernel weights exp(−‖k_i − k_p‖²/2σ²) (eq. 12; the pivot's own is 1). No votes,
      no bias: the merged entry's attention sags (Theorem 2).
    - **σ.** ``sigma=None`` (default) takes σ = the mean key norm of the row and head's live
      entries, so the kernel is scale-free (keys with RoPE have norms of tens in real models); a
      float fixes σ.

    Parameters
    ----------
    threshold : float
        Cosine similarity in [-1, 1] that links two adjacent keys into one merging set.
    sigma : float or None
        Kernel width σ > 0, or None for the mean key norm.
    """

    name = "pivot"
    threshold: float = 0.8
    sigma: float | None = None

    def __post_init__(self):
        super().__post_init__()
        check_range("threshold", self.threshold, -1.0, 1.0)
        if self.sigma is not None:
            check_range("sigma", self.sigma, 0.0, math.inf, low_open=True)

    def refusal(self, selection) -> str | None:
        if not selection.scored:
            return f"merge 'pivot' picks each set's pivot by the selection's scores; selection {selection.name!r} keeps none"
        return None

    def apply(self, layer, plan, stats) -> None:
        pivot, has_pivot = self.pivots(layer, plan.kept)
        src = plan.evict_idx
        merge = plan.evict_valid & has_pivot.gather(-1, src)
        sigma = self.kernel_width(layer)
        layer.merge_into(kvmerger_merge_rows(layer.keys, layer.values, src, pivot.gather(-1, src), merge, sigma))
        layer.select(plan.keep_idx, plan.keep_valid)

    def kernel_width(self, layer) -> torch.Tensor:
        """σ [B, H_kv]."""
        if self.sigma is not None:
            return torch.full(layer.bias.shape[:2], float(self.sigma), device=layer.bias.device)
        live = layer.live()
        norms = layer.keys.float().norm(dim=-1)
        return ((norms * live).sum(-1) / live.sum(-1).clamp_min(1)).clamp_min(torch.finfo(torch.float32).tiny)

    def pivots(self, layer, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each slot's merging-set pivot (slot index) and whether the set has one, [B, H_kv, S] each."""
        live = layer.live()
        size = live.shape[-1]
        device = live.device
        # Live entries first, in position order (empty slots can sit between live ones).
        order = slots_of(live, size)[0]
        head_dim = layer.keys.shape[-1]
        unit = F.normalize(layer.keys.gather(2, order[..., None].expand(*order.shape, head_dim)).float(), dim=-1)
        live_c, kept_c = live.gather(-1, order), kept.gather(-1, order)
        linked = live_c[..., 1:] & live_c[..., :-1] & ((unit[..., 1:, :] * unit[..., :-1, :]).sum(-1) >= self.threshold)
        starts = torch.cat([torch.ones_like(linked[..., :1]), ~linked], dim=-1)
        set_id = starts.long().cumsum(-1) - 1  # [B, H_kv, S], ids in [0, S)

        score = layer.extras["score"].gather(-1, order).masked_fill(~kept_c, -math.inf)
        best = torch.full_like(score, -math.inf).scatter_reduce(-1, set_id, score, "amax", include_self=True)
        is_best = kept_c & (score == best.gather(-1, set_id))
        index = torch.arange(size, device=device).expand_as(set_id)
        pivot_c = torch.full_like(set_id, size).scatter_reduce(
            -1, set_id, index.where(is_best, size), "amin", include_self=True
        )
        pivot_of = pivot_c.gather(-1, set_id)  # compact index of the entry's pivot, size = none
        has_c = live_c & (pivot_of < size)
        pivot_slot_c = order.gather(-1, pivot_of.clamp(max=size - 1))
        pivot = torch.zeros_like(order).scatter_(-1, order, pivot_slot_c)
        has_pivot = torch.zeros_like(live).scatter_(-1, order, has_c)
        return pivot, has_pivot


@register
@dataclass
class KVMerger(ComposedMethod):
    """KVMerger (Wang et al., "Model Tells You Where to Merge: Adaptive KV Cache Merging for
    LLMs on Long-Context Tasks", 2024), following the paper as summarised in KeepKV's appendix
    A.2 (eq. 12); no public code exists.

    Selection ``h2o`` (:class:`~keepkv.methods.h2o.AccumulatedAttention`: so KVMerger differs from
    H2O only by merging; at the end of prefill and at every decode-time compression), merge
    ``pivot`` (:class:`PivotMerge`: evicted members of a run of adjacent similar keys merge into
    its most attended kept member).
    """

    name = "kvmerger"
    paper = "Wang et al. 2024, arXiv 2407.08454"
    selection: Selection = field(default_factory=AccumulatedAttention)
    merging: Merge = field(default_factory=PivotMerge)
