"""D2O: layer budgets from attention variance, H2O eviction, EMA-thresholded similarity merging."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..merging import MergedRows, convex_merge_rows, cosine_nearest, mean_merge_rows
from .base import ComposedMethod, Merge, Selection, check_choice, check_range, register, register_merge, register_selection
from .h2o import AccumulatedAttention

ALLOCATIONS = ("paper", "code")
MERGE_RULES = ("paper", "code")


def d2o_merge_rows(keys, values, src, dst, merge, similarity, rule: str = "paper") -> MergedRows:
    """Merge evicted entries into their nearest kept entry with D2O's similarity weights.

    ``rule="paper"`` (eqs. 10-11): x_c <- (e·x_c + Σ exp(u_i) x_i) / (e + Σ exp(u_i)), u_i the
    cosine similarity of evicted key i to the target's key (a convex combination; the target's
    own similarity is 1, hence its weight e).
    ``rule="code"`` (the authors' ``scatter_reduce(..., 'mean', include_self=True)`` of u·x,
    :func:`keepkv.merging.mean_merge_rows`): x_c <- (x_c + Σ u_i x_i) / (1 + n). Not convex: the
    coefficients sum to (1 + Σu)/(1 + n) <= 1.

    keys, values [B, H_kv, S, D]; src, dst, merge, similarity [B, H_kv, E]. Returns the merged
    rows of "keys" and "values" (``LayerStore.merge_into`` writes them).
    """
    if rule == "paper":
        weights = (similarity.float() - 1.0).exp().masked_fill(~merge, 0.0)
        return convex_merge_rows(keys, values, src, dst, merge, weights)
    return mean_merge_rows(keys, values, src, dst, merge, similarity)


def masked_variance(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased variance of ``x`` [..., S] over the entries where ``mask`` is True."""
    count = mask.sum(-1).clamp_min(1)
    mean = (x * mask).sum(-1) / count
    return ((x - mean.unsqueeze(-1)).square() * mask).sum(-1) / (count - 1).clamp_min(1)


def largest_remainder(shares: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
    """Round ``shares`` [L, B] (float, summing to ``totals`` [B]) to ints with the same column sums."""
    floors = shares.floor()
    missing = (totals.double() - floors.sum(0)).round().long()  # [B]
    fraction_rank = (floors - shares).argsort(dim=0, stable=True).argsort(dim=0)  # 0 = largest fraction
    return floors.long() + (fraction_rank < missing[None]).long()


@register_selection
@dataclass(frozen=True)
class VarianceBudgets(AccumulatedAttention):
    """D2O's selection: H2O's accumulated attention (GQA groups pooled by their mean) with ``sinks``
    leading tokens and a recent window of ``recent_ratio`` of the budget (heavy:recent 3:1,
    Sec. 5.1), and layer budgets from the variance of each layer's prompt attention.

    At prefill each layer records the variance of the prompt's attention column sums (eq. 4), from
    the chunked column sums of the attention path (never a T×T matrix), over the row's real tokens.
    After the last layer has prefilled, ``allocate`` turns the L variances of each row into layer
    budgets:

    - ``allocation="paper"`` (default, Sec. 4.1): the variance is that of the column sums of the
      layer's head-averaged attention map; layers above the gate ``gate`` get S, the others
      ``alpha``·S, with S chosen so that the budgets add up to L × the row's budget (rounded by
      largest remainder, so the sum is exact). The default because it is what the paper
      describes and keeps the total memory fixed.
    - ``allocation="code"`` (the authors' code): per-head variances, min-max normalised over the
      heads and averaged; layer ratio = clamp(softmax(−var)·L·ρ, 0.01, 1) of the prompt length,
      ρ = budget / prompt length. The clamp can lose budget (the sum then falls short of the
      total). The code's exemption of layers 0, 1 and L−1 from compression is not reproduced:
      it would break the memory budget.

    Parameters
    ----------
    allocation : {"paper", "code"}
        Layer-budget rule (see above).
    gate : float
        Gate coefficient g on the raw column-sum variance (paper: 100). Only for "paper".
        The variance grows with the prompt length (the column sums average 1), so short prompts
        fall below the gate in every layer and get uniform budgets.
    alpha : float
        Scale α of the budget of low-variance layers relative to high-variance ones
        (paper: 2-4; default 2). Only for "paper".
    recent_ratio : float
        Share of the budget kept as the recent window (default 0.25: heavy:recent = 3:1).
    sinks : int
        Leading tokens always kept (paper: 4).
    """

    name = "d2o"
    allocates_from_all_layers = True
    layered = True
    recent_ratio: float = 0.25
    sinks: int = 4
    allocation: str = "paper"
    gate: float = 100.0
    alpha: float = 2.0

    def __post_init__(self):
        super().__post_init__()
        check_range("gate", self.gate, 0.0, math.inf)
        check_range("alpha", self.alpha, 0.0, math.inf, low_open=True)
        check_choice("allocation", self.allocation, ALLOCATIONS)

    def observe(self, layer, stats):
        super().observe(layer, stats)
        if stats.is_prefill:
            colsum = stats.colsum.float()  # [B, H_kv, g, S]
            real = layer.live()[:, 0]  # [B, S] (padding is the same in every head)
            layer.state["variance_paper"] = masked_variance(colsum.mean((1, 2)), real)  # [B]
            per_head = masked_variance(colsum.flatten(1, 2), real[:, None])  # [B, H]
            low, high = per_head.amin(-1, keepdim=True), per_head.amax(-1, keepdim=True)
            layer.state["variance_code"] = ((per_head - low) / (high - low + 1e-6)).mean(-1)  # [B]

    def allocation_scores(self, layer) -> torch.Tensor:
        """[B] the variance of the layer's prompt attention that ``allocation`` reads."""
        return layer.state["variance_paper" if self.allocation == "paper" else "variance_code"]

    def allocate(self, layers, kv_heads, row_budget, prompt_lengths, scores=None):
        if scores is None:
            raise ValueError("d2o allocates from every layer's prefill statistics: pass their allocation_scores")
        variance = torch.stack(scores).double()  # [L, B]
        total = row_budget.double() * layers  # [B]
        if self.allocation == "paper":
            high = variance > self.gate
            unit = total / (high.sum(0) + self.alpha * (~high).sum(0))  # S per row
            shares = torch.where(high, unit[None], self.alpha * unit[None])
            budgets = largest_remainder(shares, total)
        else:
            prompt = prompt_lengths.double()
            ratio = (torch.softmax(-variance, dim=0) * layers * (row_budget.double() / prompt)[None]).clamp(0.01, 1.0)
            budgets = (ratio * prompt[None]).floor().long()
        return budgets.clamp(min=1)[:, :, None].expand(layers, -1, kv_heads).clone()


@register_merge
@dataclass(frozen=True)
class D2OMerge(Merge):
    """D2O's token-level merge (Sec. 4.2): each evicted entry's nearest kept entry by key cosine
    (eq. 8) takes it if their similarity reaches the EMA threshold τ (eq. 9), by the weights of
    ``merge_rule`` (:func:`d2o_merge_rows`); the others are dropped.

    **Threshold τ.** One τ per row and KV head, in ``layer.state["tau"]``. The first compression
    sets τ = mean of the evicted entries' max similarities; each later one sets
    τ = β·mean(max similarities) + (1 − β)·τ, then merges the entries whose max similarity is
    >= τ (the code's order). With one token evicted per step this is eq. 9 exactly. τ is reset
    for every new sequence: it lives in the layer store, which is new for every CompressedCache,
    cleared by ``cache.reset()``, and set back to "unset" at every prefill, so a new prompt never
    inherits the previous one's τ (the authors' code keeps ``self.threshold`` across samples).

    Parameters
    ----------
    beta : float
        EMA smoothing β of eq. 9, in [0, 1]. Default 0.5: the authors' released default
        (``threshold = 0.5·threshold + 0.5·mean``) and the low end of the paper's 0.5-0.9 grid.
    merge_rule : {"paper", "code"}
        Merge weights: eqs. 10-11 (default) or the code's (x_c + Σ u·x)/(1 + n) (see
        :func:`d2o_merge_rows`).
    """

    name = "d2o"
    beta: float = 0.5
    merge_rule: str = "paper"

    def __post_init__(self):
        super().__post_init__()
        check_range("beta", self.beta, 0.0, 1.0)
        check_choice("merge_rule", self.merge_rule, MERGE_RULES)

    def observe(self, layer, stats) -> None:
        if stats.is_prefill:
            layer.state["tau"] = None  # a new sequence: forget any earlier threshold

    def apply(self, layer, plan, stats) -> None:
        target, similarity = cosine_nearest(layer.keys, plan.evict_idx, plan.kept, plan.candidate_idx())
        candidate = plan.evict_valid & torch.isfinite(similarity)
        tau = self.update_threshold(layer, similarity, candidate)
        merge = candidate & (similarity >= tau.unsqueeze(-1))
        layer.merge_into(d2o_merge_rows(layer.keys, layer.values, plan.evict_idx, target, merge, similarity, self.merge_rule))
        layer.keep(plan.kept, plan.slots)

    def update_threshold(self, layer, similarity: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
        """EMA threshold τ [B, H_kv] (eq. 9) after this compression's evicted entries."""
        count = candidate.sum(-1)
        mean_max = similarity.where(candidate, 0.0).sum(-1) / count.clamp_min(1)
        tau = layer.state.get("tau")
        if tau is None:
            tau = torch.full_like(mean_max, math.nan)
        updated = torch.where(tau.isnan(), mean_max, self.beta * mean_max + (1.0 - self.beta) * tau)
        tau = torch.where(count > 0, updated, tau)
        layer.state["tau"] = tau
        return tau


@register
@dataclass
class D2O(ComposedMethod):
    """D2O (Wan et al., "D2O: Dynamic Discriminative Operations for Efficient Long-Context
    Inference of Large Language Models", 2024).

    **Layer level**: selection ``d2o`` (:class:`VarianceBudgets`: layer budgets from the variance of
    each layer's prompt attention, H2O's scores within a layer). **Token level**: merge ``d2o``
    (:class:`D2OMerge`): every evicted entry merges into its nearest kept entry (sinks and recent
    included) by key cosine similarity if that similarity reaches the EMA threshold τ, else is
    dropped; at the end of prefill and at every decode-time compression.
    """

    name = "d2o"
    paper = "Wan et al. 2024, arXiv 2406.13035"
    selection: Selection = field(default_factory=VarianceBudgets)
    merging: Merge = field(default_factory=D2OMerge)
