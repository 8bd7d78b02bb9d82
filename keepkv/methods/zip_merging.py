"""ZIP-merging with Electoral Votes: a merge any selection can take (``merge=zip``).

KeepKV's paper says its merging "imposes no specific constraints on cache allocation or token
selection" and combines it with H2O and PyramidInfer (its Figure 5). :class:`ZipMerge` ZIP-merges
(eq. 7 / 25) each entry a selection evicts into its most cosine-similar kept entry (similarity >=
``threshold``), the merged entry carrying the summed votes as ln p in the cache's bias, with the
exact logits of the current query (the last prompt query at prefill, the newest query while
decoding), so each merge leaves that query's attention output unchanged on an MHA model
(Theorem 3). KeepKV's own merge (:class:`keepkv.methods.keepkv.KeepKVMerge`) adds EMA-predicted
scores for decode-time merges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..attention import Needs, scaled_logits
from ..merging import KEY_RULES, MergedRows, cosine_nearest, zip_merge_rows
from ..store import NEG_INF
from .base import EvictionPlan, Merge, check_range, register_merge

def pool_log_scores(head_scores: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Pool per-query-head log-scores of a GQA group into one log-score per entry.

    head_scores [B, H_kv, g, S] (ln s^h, -inf on empty slots), bias [B, H_kv, S] (ln p)
    -> [B, H_kv, S].

    The pooled score is the mean over the group's heads of each entry's per-vote attention share
    s_i^h / Z_h (Z_h = Σ_j p_j s_j^h), mapped back to the logit scale by the geometric mean of
    the heads' partition functions:

        ln ŝ_i = ln( (1/g) Σ_h s_i^h / Z_h ) + (1/g) Σ_h ln Z_h.

    Weighting each head by its normalised attention makes the merge weights w_i = p_i ŝ_i
    proportional to the attention mass the entry carries summed over the heads, which is the
    weighting under which one merged value best serves all heads at once. With g = 1 it is the
    identity (ln ŝ = ln s exactly, no rounding), so MHA keeps Theorem 3's exact logits.
    """
    if head_scores.shape[2] == 1:
        return head_scores[:, :, 0]
    log_z = torch.logsumexp(head_scores + bias[:, :, None], dim=-1)  # [B, H_kv, g]
    log_z = log_z.where(torch.isfinite(log_z), 0.0)
    shares = torch.logsumexp(head_scores - log_z[..., None], dim=2) - math.log(head_scores.shape[2])
    return shares + log_z.mean(-1, keepdim=True)


def nearest_kept(
    layer, plan: EvictionPlan, threshold: float, candidates: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge targets of a plan: (dst, merge), both [B, H_kv, E]: each evicted entry's most
    cosine-similar kept entry (among ``candidates`` [B, H_kv, S] if given, a subset of the kept
    ones, never a kept prompt's), and whether it is at least ``threshold`` similar."""
    allowed = plan.kept if candidates is None else candidates
    frozen = layer.frozen_entries()
    if frozen is not None:  # a kept prompt's entries take no merge
        allowed = allowed & ~frozen
    dst, sim = cosine_nearest(layer.keys, plan.evict_idx, allowed, plan.candidate_idx(layer.size))
    return dst, plan.evict_valid & (sim >= threshold)


def zip_rows(
    layer, src: torch.Tensor, dst: torch.Tensor, merge: torch.Tensor, head_log_scores: torch.Tensor,
    query: torch.Tensor, scaling: float, zip_key: str, pooled: torch.Tensor | None = None,
    max_value_change: float = math.inf, max_share: float = 1.0,
) -> MergedRows:
    """The merged rows of ZIP-merging ``src`` into ``dst`` where ``merge`` (all [B, H_kv, E]) in
    the layer's store (``LayerStore.merge_into`` writes them), the groups that fail the gates
    (``max_value_change``, ``max_share``: :func:`keepkv.merging.zip_merge_rows`) dropped whole.

    head_log_scores [B, H_kv, g, S]: ln s^h per query head (-inf on empty slots), pooled over the
    group by :func:`pool_log_scores` for the merge weights; query [B, H_kv, g, D]: the queries the
    key rule moves the key along (their mean, or each of them for ``zip_key="group"``); pooled
    [B, H_kv, S]: ``pool_log_scores(head_log_scores, layer.bias)`` if the caller has it.
    """
    group = zip_key == "group"
    if pooled is None:
        pooled = pool_log_scores(head_log_scores, layer.bias)
    # Empty slots never take part in a merge; zero them so no 0·(-inf) can reach a scatter.
    return zip_merge_rows(
        layer.keys,
        layer.values,
        layer.bias,
        pooled.where(torch.isfinite(pooled), 0.0),
        src,
        dst,
        merge,
        key_rule=zip_key,
        queries=query if group else query.mean(2),
        scaling=scaling,
        group_log_scores=head_log_scores.where(torch.isfinite(head_log_scores), 0.0) if group else None,
        max_value_change=max_value_change,
        max_share=max_share,
    )


@register_merge
@dataclass(frozen=True)
class ZipMerge(Merge):
    """ZIP-merging with Electoral Votes (KeepKV eq. 7 / 25) of what a plan evicts, with the exact
    logits of the current query, then the plan's entries kept (see the module docstring).

    Parameters
    ----------
    threshold : float
        Merge only into a kept entry whose key cosine similarity is at least this, in [-1, 1]
        (KeepKV's T, paper 0.8); -1 merges every evicted entry.
    zip_key : str
        Key rule of :func:`keepkv.merging.zip_merge_rows`: "projection", "group", "paper" or "mean".
    protect : float
        Share in [0, 1] of the kept entries, the selection's highest-ranked first, that take no
        merges (its own protected sinks and window not counted). 0: every kept entry may.
    max_value_change : float or None
        Value gate ε >= 0: a target takes its merges only if they move its value by at most ε
        relative, ‖v_r - v_t‖ <= ε ‖v_t‖ (else they are evicted). None: no gate.
    max_share : float
        Weight cap δ in [0, 1]: a target takes its merges only if they bring at most δ of the
        merged weight, Σ w_e / Σ w <= δ (else they are evicted). 1: no cap.
    """

    name = "zip"
    threshold: float = 0.8
    zip_key: str = "projection"
    protect: float = 0.0
    max_value_change: float | None = None
    max_share: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        check_range("threshold", self.threshold, -1.0, 1.0)
        if self.zip_key not in KEY_RULES:
            raise ValueError(f"zip_key must be one of {', '.join(map(repr, KEY_RULES))}, got {self.zip_key!r}")
        check_range("protect", self.protect, 0.0, 1.0)
        check_range("max_share", self.max_share, 0.0, 1.0)
        if self.max_value_change is not None:
            check_range("max_value_change", self.max_value_change, 0.0, math.inf)

    def targets(self, layer, plan: EvictionPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """(dst, merge) [B, H_kv, E]: each evicted entry's most similar kept entry that may take
        merges (``protect``: the share of the kept scored entries, the selection's highest-ranked
        first, that take none), and whether it is at least ``threshold`` similar. The value gate
        (a target's value moves by at most ``max_value_change`` relative) and the weight cap
        (merges bring at most ``max_share`` of its weight) apply where the rows merge
        (:func:`zip_rows` with :meth:`gates`)."""
        candidates = plan.kept & ~plan.top_kept(self.protect) if self.protect > 0 else None
        return nearest_kept(layer, plan, self.threshold, candidates)

    def gates(self) -> tuple[float, float]:
        """(ε, δ): the value gate and the weight cap as :func:`zip_rows` takes them."""
        return math.inf if self.max_value_change is None else self.max_value_change, self.max_share

    def needs(self, is_prefill: bool) -> Needs:
        # While decoding, the merges read the logits the attention computed.
        return Needs(logits=not is_prefill)

    def apply(self, layer, plan: EvictionPlan, stats) -> None:
        if plan.evict_idx.shape[-1] > 0:
            query = stats.query[:, :, :, -1]  # [B, H_kv, g, D]
            if stats.logits is None:  # prefill: only the last query's row is needed
                logits = scaled_logits(query[:, :, :, None], layer.keys, stats.scaling)[:, :, :, 0]
            else:
                logits = stats.logits[:, :, :, -1]
            logits = logits.masked_fill(~layer.live()[:, :, None], NEG_INF)
            pooled = pool_log_scores(logits, layer.bias)
            dst, merge = self.targets(layer, plan)
            layer.merge_into(
                zip_rows(layer, plan.evict_idx, dst, merge, logits, query, stats.scaling, self.zip_key, pooled, *self.gates())
            )
        layer.keep(plan.kept, plan.slots)
