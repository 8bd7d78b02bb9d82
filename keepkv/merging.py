"""Merge arithmetic shared by the merging methods (KeepKV, D2O, KVMerger, ZeroMerge, CaM), and the
log-scores KeepKV's merges are weighed with (a GQA group's pooled score, the EMA's).

Every function works on the cache's storage layout and is fully vectorised: all batch rows,
KV heads and merge groups are handled by the same few gathers and scatters. The plan is first
numbered into a compact *group space* of E positions per (row, head) (a sort of the targets),
so the arithmetic costs O(E·D) and the only O(S·D) work is the copy of the output; a decode
step that merges one entry does not touch the rest of the cache, and ZIP needs no sort for it:
each group is a pair, the target and its entry, read side by side (:func:`_zip_pairs`).

Storage layout
--------------
keys, values : [B, H_kv, S, D], any float dtype (math is done in fp32, results cast back)
bias         : [B, H_kv, S] fp32, additive attention bias; KeepKV stores ln p (p = Electoral
               Votes, 0 for a plain token), -inf marks an empty slot.

Eviction plan
-------------
src   : [B, H_kv, E] int64, slot of each evicted entry.
dst   : [B, H_kv, E] int64, slot of the kept entry it merges into (many-to-one allowed).
merge : [B, H_kv, E] bool, True = merge into ``dst``, False = dropped or padding.

Padded plan entries must have ``merge=False``; their ``src``/``dst`` may hold anything
(-1 included). Merged entries need 0 <= src, dst < S, and the set of merged ``src`` slots
must be disjoint from the set of ``dst`` slots (no chains within one call). The merge *group*
of a target c is G_c = {c} ∪ {e : dst[e] = c, merge[e]}.

Every ``*_rows`` function returns the merged rows of its targets (:class:`MergedRows`), which a
method hands to ``LayerStore.merge_into`` (written in place): only the targets of at least one
merge change, and all other slots (the evicted ones included) stay bit-identical. The caller
keeps the plan's slots afterwards.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .entries import add_entries, gather_entries
from .kernels import nearest

NEG_INF = float("-inf")


__all__ = [
    "GROUP_RIDGE",
    "KEY_RULES",
    "PAPER_MAX_KEY_GAIN",
    "Groups",
    "LogScores",
    "MergedRows",
    "convex_merge_rows",
    "cosine_nearest",
    "ema_log_scores",
    "gathers_candidates",
    "group_logsumexp",
    "mean_merge_rows",
    "merged_ema_rows",
    "momentum_merge_rows",
    "pool_log_scores",
    "spread_values_rows",
    "zip_merge_rows",
    "zip_rows",
    "zip_rows_with_ema",
]

PAPER_MAX_KEY_GAIN = 10.0
"""Default bound G for the "paper" key rule: eq. 25's key is the weighted mean key scaled by
g = t / m̄, and it is kept only where 1/G <= g <= G (see :func:`zip_merge_rows`)."""

GROUP_RIDGE = 1e-6
"""Ridge of the "group" key rule, relative to the mean squared norm of the group's queries."""

KEY_RULES = ("paper", "projection", "group", "mean")


class Groups(NamedTuple):
    """An eviction plan in compact group space: group j of a (row, head) is its j-th distinct target.

    Group space has E positions per (row, head), enough for E distinct targets; the unused ones,
    and the one collecting all unmerged plan entries, are invalid. A merge's rows are laid out by
    it (:attr:`MergedRows.groups`), so a method that writes a row of its own beside them (KeepKV's
    merged EMA) gathers by ``slot`` and ``src`` and reduces over ``entry_group``, or, for a plan of
    one entry per (row, head) (a decode step's: ``entry_group`` None), gathers at ``pair`` and
    reduces over its last axis.
    """

    entry_group: torch.Tensor | None  # [..., E] int64, group of each plan entry; None for a pair plan (``pair``)
    slot: torch.Tensor  # [..., E] int64, target slot of each group (0 where invalid)
    valid: torch.Tensor  # [..., E] bool, the group is a real merge target
    src: torch.Tensor  # [..., E] int64, slot of each plan entry (a valid slot where unmerged: safe to gather)
    pair: torch.Tensor | None = None  # [..., 2] a one-entry plan's (target, entry) slots (:func:`_zip_pairs`)


def _group_plan(src: torch.Tensor, dst: torch.Tensor, merge: torch.Tensor, num_slots: int) -> Groups:
    """Number the distinct merge targets of each (row, head) by sorting the plan's targets."""
    if merge.shape[-1] == 1:  # one entry per (row, head), a decode step's usual plan: nothing to sort
        return Groups(torch.zeros_like(dst), dst.where(merge, 0), merge, src.where(merge, 0))
    target_key = dst.where(merge, num_slots)  # [..., E]; unmerged entries sort last, into one invalid group
    sorted_key, order = target_key.sort(dim=-1)
    is_first = torch.ones_like(merge)
    is_first[..., 1:] = sorted_key[..., 1:] != sorted_key[..., :-1]
    sorted_group = is_first.long().cumsum(-1) - 1
    entry_group = torch.empty_like(sorted_group).scatter_(-1, order, sorted_group)
    # every entry of a group writes the same key, so the scatter is deterministic
    group_key = torch.full_like(target_key, num_slots).scatter_(-1, sorted_group, sorted_key)
    valid = group_key < num_slots
    return Groups(entry_group, group_key.where(valid, 0), valid, src.where(merge, 0))


def _gather_entries(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Gather slots along the sequence axis: x [..., S] -> [..., E], x [B, H_kv, S, D] -> [B, H_kv, E, D]."""
    if x.dim() == index.dim():
        return x.gather(-1, index)
    return gather_entries(x, index)


def _per_entry(x: torch.Tensor, entry_group: torch.Tensor) -> torch.Tensor:
    """Each plan entry's group value: x [..., E(, D)] in group space -> [..., E(, D)] per entry."""
    return x if entry_group.shape[-1] == 1 else _gather_entries(x, entry_group)


def _own_and_incoming(x: torch.Tensor, groups: Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, H_kv, S(, D)] at each group's target and at each plan entry, in fp32."""
    return _gather_entries(x, groups.slot).float(), _gather_entries(x, groups.src).float()


def _group_sum(own: torch.Tensor, incoming: torch.Tensor, entry_group: torch.Tensor) -> torch.Tensor:
    """Sum over each group: own [..., E(, D)] (the target's term) plus incoming [..., E(, D)] per entry."""
    if entry_group.shape[-1] == 1:  # one group of one entry: the same single addition, unscattered
        return own + incoming
    if own.dim() == entry_group.dim():
        return own.scatter_add(-1, entry_group, incoming)
    return add_entries(own, entry_group, incoming)


def _merged_rows(
    groups: Groups, total: torch.Tensor, own_weight: torch.Tensor | None = None,
    incoming_weight: torch.Tensor | None = None, **tensors: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The rows of a weighted merge: for each x [B, H_kv, S, D] of ``tensors``, (w_t x_t + Σ_e w_e x_e)
    / total over each group, x read at its target t and its plan entries e -> [B, H_kv, E, D] fp32.
    own_weight [B, H_kv, E, 1] per group and incoming_weight [B, H_kv, E, 1] per plan entry (None:
    1); total [B, H_kv, E, 1] per group."""
    rows = {}
    for name, x in tensors.items():
        own, incoming = _own_and_incoming(x, groups)
        if own_weight is not None:
            own = own_weight * own
        if incoming_weight is not None:
            incoming = incoming_weight * incoming
        rows[name] = _group_sum(own, incoming, groups.entry_group) / total
    return rows


class MergedRows(NamedTuple):
    """What a merge writes: for each named tensor (keys, values, bias, an extra), each valid group's
    merged row [B, H_kv, E(, D)] at its target slot. ``LayerStore.merge_into`` writes them in place
    (:func:`keepkv.store.write_rows`)."""

    groups: Groups
    rows: dict[str, torch.Tensor]
    merge: torch.Tensor | None = None  # [B, H_kv, E] the plan entries that merged (after any gate)


def _group_weights(
    log_own: torch.Tensor, log_incoming: torch.Tensor, entry_group: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights of each group from log-weights, shifted by the group max so that none overflows.

    Parameters
    ----------
    log_own : [..., E] log-weight of each group's target.
    log_incoming : [..., E] log-weight of each plan entry.
    entry_group : [..., E] group of each plan entry.

    Returns
    -------
    group_max : [..., E] max log-weight over the group.
    own_weight : [..., E] exp(log_own - group_max), in [0, 1].
    incoming_weight : [..., E] exp(log_incoming - group_max of the entry's group), in [0, 1].
    """
    if entry_group.shape[-1] == 1:  # one group of one entry (see _group_plan)
        group_max = torch.maximum(log_own, log_incoming)
        return group_max, (log_own - group_max).exp(), (log_incoming - group_max).exp()
    group_max = log_own.scatter_reduce(-1, entry_group, log_incoming, "amax", include_self=True)
    own_weight = (log_own - group_max).exp()
    incoming_weight = (log_incoming - group_max.gather(-1, entry_group)).exp()
    return group_max, own_weight, incoming_weight


def group_logsumexp(log_own: torch.Tensor, log_incoming: torch.Tensor, entry_group: torch.Tensor) -> torch.Tensor:
    """[..., E] logsumexp over each group of its target's and its incoming entries' log-values,
    without overflow: log_own [..., E] per group (its target's), log_incoming [..., E] per plan
    entry, entry_group [..., E] the group of each plan entry (:attr:`Groups.entry_group`). A merge
    adds the votes of its group this way (ln Σ p from each entry's ln p)."""
    group_max, own_weight, incoming_weight = _group_weights(log_own, log_incoming, entry_group)
    return group_max + _group_sum(own_weight, incoming_weight, entry_group).log()


def _shift_along_query(
    mean_keys: torch.Tensor, query: torch.Tensor, logit_gap: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Move each key along the query so that its logit q·k·scaling changes by exactly logit_gap.

    mean_keys [B, H_kv, E, D] fp32, query [B, H_kv, D], logit_gap [B, H_kv, E] -> [B, H_kv, E, D].
    """
    q = query.float()
    # q / (scaling ‖q‖²) raises q·k·scaling by exactly 1; a zero query moves nothing.
    unit_logit_step = q / (scaling * q.square().sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny))
    return torch.addcmul(mean_keys, logit_gap.unsqueeze(-1), unit_logit_step.unsqueeze(-2))  # k̄ + gap · step


def _min_norm_shift(
    mean_keys: torch.Tensor, queries: torch.Tensor, logit_gaps: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Smallest key change (in the span of the g queries) that shifts every head's logit by its gap.

    k_r = k̄ + Qᵀ (Q Qᵀ + λI)⁻¹ (gap / scaling): one g×g system per (row, KV head), all groups
    solved at once as right-hand-side columns. λ = GROUP_RIDGE · mean_h ‖q_h‖² keeps nearly
    parallel query heads solvable; the key condition then holds up to a relative error of about
    λ / σ_min(Q Qᵀ).

    mean_keys [B, H_kv, E, D] fp32, queries [B, H_kv, g, D], logit_gaps [B, H_kv, g, E]
    -> [B, H_kv, E, D].
    """
    q = queries.float()
    gram = q @ q.transpose(-1, -2)  # [B, H_kv, g, g]
    mean_sq_norm = gram.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(torch.finfo(torch.float32).tiny)  # [B, H_kv]
    eye = torch.eye(q.shape[-2], dtype=q.dtype, device=q.device)
    gram = gram + (GROUP_RIDGE * mean_sq_norm)[..., None, None] * eye
    # solve_ex: no host sync on CUDA (solve checks for singularity); the ridge keeps gram invertible.
    coeff = torch.linalg.solve_ex(gram, logit_gaps / scaling).result  # [B, H_kv, g, E]
    return mean_keys + coeff.transpose(-1, -2) @ q  # [B, H_kv, E, g] @ [B, H_kv, g, D]


def _gate_keep(
    own_w: torch.Tensor, incoming_w: torch.Tensor, entry_group: torch.Tensor, own_values: torch.Tensor,
    incoming_values: torch.Tensor, max_value_change: float, max_share: float,
) -> torch.Tensor | None:
    """[..., E] bool per valid group: ZIP-merging its entries moves the target's value by at most
    ``max_value_change`` relative and brings at most ``max_share`` of the merged weight (the gates
    of :func:`zip_merge_rows`); None where no gate is on. own_w, incoming_w [..., E]: the weights of
    :func:`_group_weights`; own_values, incoming_values [..., E, D] fp32: v_t per group, v_e per
    plan entry. Unmerged plan entries sit in an invalid group, whose answer means nothing."""
    incoming_sum = _group_sum(torch.zeros_like(own_w), incoming_w, entry_group)
    weight_sum = own_w + incoming_sum
    keep = None
    if max_share < 1.0:  # incoming <= own + incoming holds for any weights >= 0: no cap to compare
        keep = incoming_sum <= max_share * weight_sum
    if math.isfinite(max_value_change):
        entry_target = _per_entry(own_values, entry_group)  # v_t of each entry's target
        pull = _group_sum(torch.zeros_like(own_values), incoming_w[..., None] * (incoming_values - entry_target),
                          entry_group)
        change = pull.norm(dim=-1) / weight_sum  # ‖v_r - v_t‖ = ‖Σ_e w_e (v_e - v_t)‖ / Σ w
        small = change <= max_value_change * own_values.norm(dim=-1)
        keep = small if keep is None else keep & small
    return keep


def _gated(groups: Groups, merge: torch.Tensor, keep: torch.Tensor | None) -> tuple[Groups, torch.Tensor]:
    """The plan's groups and ``merge`` [..., E] with every group that fails ``keep`` [..., E]
    dropped whole (an invalid group targets slot 0, as :func:`keepkv.store.write_rows` needs)."""
    if keep is None:
        return groups, merge
    valid = groups.valid & keep
    return groups._replace(valid=valid, slot=groups.slot.where(valid, 0)), merge & _per_entry(keep, groups.entry_group)


def zip_merge_rows(
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    log_scores: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    merge: torch.Tensor,
    *,
    key_rule: str = "projection",
    queries: torch.Tensor | None = None,
    scaling: float | None = None,
    group_log_scores: torch.Tensor | None = None,
    paper_max_gain: float = PAPER_MAX_KEY_GAIN,
    max_value_change: float = math.inf,
    max_share: float = 1.0,
) -> MergedRows:
    """KeepKV's ZIP-Merging with Electoral Votes (eq. 7, many-to-one eq. 25; EMA scores eq. 26).

    For each target c with group G = G_c, p_i = exp(bias_i) the votes and ln ŝ_i = log_scores_i
    (an exact logit q·k_i·scaling, or an EMA log-score, eq. 8):

    - w_i = p_i ŝ_i, handled as ln w_i = bias_i + ln ŝ_i and shifted by the group max before exp
      (no overflow in any dtype, whatever the logits);
    - v_r = Σ w_i v_i / Σ w_i                                   (eq. 23 / 25)
    - p_r = Σ p_i, stored as bias_r = logsumexp_G(bias)          (eq. 6)
    - target logit t = ln(Σ w_i / Σ p_i)                          (eq. 22: p_r s_r = Σ p_i s_i)
    - key by ``key_rule``, with k̄ = Σ w_i k_i / Σ w_i and m̄ = Σ w_i ln ŝ_i / Σ w_i. Note
      m̄ - t = KL(w/Σw ‖ p/Σp) >= 0: merging costs exactly this much logit ("attention sag"):

      "paper"
          k_r = (Σ w_i k_i) t / (Σ w_i ln ŝ_i) = (t / m̄) k̄  (eq. 25), needs no query.
          Safeguard: the key is the weighted mean key scaled by the gain g = t / m̄. Near m̄ = 0
          (logits of opposite sign cancelling) g explodes, and for 0 < m̄ < KL it is negative
          (the key flips direction); for m̄ -> 0⁺ with t > 0 it collapses towards 0. The
          eq. 25 key is therefore kept only where 1/G <= g <= G, G = ``paper_max_gain``
          (default 10); elsewhere (and where m̄ = 0 exactly) the group falls back to the
          "projection" key when ``queries`` is given, else to k̄. A bound on the gain rather
          than on |m̄| alone because near-cancellation of m̄ always implies a large |g| (the
          spread logits that cancel make KL, hence |t|, large), whereas a small |m̄| with a
          small |t| (all logits ≈ 0) is harmless; and the sign flip, which is exact for the
          current query but inverts the key for every later one, is caught too.
          ``paper_max_gain=math.inf`` keeps eq. 25 everywhere except sign flips and m̄ = 0.
      "projection"
          k_r = k̄ + (t - m̄) q / (scaling ‖q‖²): the weighted mean key moved along the query
          by the logit the merge loses. When ``log_scores`` are the exact logits of ``queries``,
          m̄ = scaling·q·k̄, so q·k_r·scaling = t exactly (Theorem 3). With EMA scores only the
          score-implied gap t - m̄ (-KL) is applied, so identical entries are left in place
          (Lemma 6) instead of being pulled to the EMA's absolute level.
      "group"
          GQA: for the g query heads Q [g, D] sharing this KV head, per-head targets
          t_h = ln(Σ p_i s_i^h / Σ p_i) and gaps t_h - m̄_h with m̄_h = Σ w_i ln s_i^h / Σ w_i;
          k_r = k̄ + Qᵀ (Q Qᵀ + λI)⁻¹ (t - m̄)/scaling, the min-norm correction (λ = GROUP_RIDGE
          relative). With exact per-head logits, q_h·k_r·scaling = t_h for every head. The
          weights of v_r and k̄ come from ``log_scores`` (the caller's pooled score): the value
          condition cannot hold for all g heads at once in general.
      "mean"
          k_r = k̄, the weighted mean key with no correction: the authors' released code (votes
          in the bias, values and keys averaged with the same weights). Not lossless: the merged
          entry's logit is m̄ instead of t.

    Parameters
    ----------
    keys, values : [B, H_kv, S, D], any float dtype.
    bias : [B, H_kv, S] fp32, ln p per entry (0 for a plain token). Targets must be occupied
        slots (finite bias).
    log_scores : [B, H_kv, S], ln ŝ per entry, finite on every slot a merge reads (a non-finite
        one, an empty slot's -inf that only an unmerged plan entry reads, counts as 0).
    src, dst, merge : [B, H_kv, E] eviction plan (see module docstring).
    key_rule : "paper", "projection", "group" or "mean".
    queries : [B, H_kv, D] for "projection" (and the "paper" fallback): one query direction per
        KV head (the current query, or the caller's pooling over the group / window);
        [B, H_kv, g, D] for "group".
    scaling : attention scale (1/√D); needed whenever ``queries`` is.
    group_log_scores : [B, H_kv, g, S], per-query-head ln s^h, only for "group" (as ``log_scores``).
    paper_max_gain : bound G on the eq. 25 key gain, only for "paper".
    max_value_change, max_share : the merge gates ε and δ. A group is dropped whole (its entries
        unmerged, left for the caller to evict) where ZIP-merging it would

        - move the target's value by more than ε relative:
          ‖v_r - v_t‖ = ‖Σ_e w_e (v_e - v_t)‖ / Σ w > ε ‖v_t‖, or
        - give the incoming entries more than δ of the merged weight: Σ_e w_e / Σ w > δ,

        so every target that still merges moves by at most ε and takes at most δ of foreign
        weight. The gates read the weights and values the merge gathers anyway.

    Returns
    -------
    The merged rows of "keys", "values" (v_r, k_r) and "bias" (logsumexp of the group's bias:
    votes add) at each target, with ``merge`` the plan entries that merged (after the gates).
    A plan of one entry per (row, head), a decode step's, takes the same arithmetic without the
    sort and the scatters (:func:`_zip_pairs`).
    """
    if key_rule not in KEY_RULES:
        raise ValueError(f"key_rule must be one of {KEY_RULES}, got {key_rule!r}")
    if key_rule in ("projection", "group") and queries is None:
        raise ValueError(f"key_rule={key_rule!r} needs queries")
    if queries is not None and scaling is None:
        raise ValueError("queries need scaling")
    if key_rule == "group" and (group_log_scores is None or queries.dim() != 4):
        raise ValueError('key_rule="group" needs queries [B, H_kv, g, D] and group_log_scores [B, H_kv, g, S]')
    if key_rule != "group" and queries is not None and queries.dim() != 3:
        raise ValueError(f"key_rule={key_rule!r} takes one query per KV head: [B, H_kv, D]")

    if src.shape[-1] == 1:  # one entry per (row, head), a decode step's plan: each group is a pair
        return _zip_pairs(keys, values, bias, log_scores, src, dst, merge, key_rule, queries, scaling,
                          group_log_scores, paper_max_gain, max_value_change, max_share)
    groups = _group_plan(src, dst, merge, keys.shape[-2])
    entry_group = groups.entry_group  # [B, H_kv, E]

    own_log_votes, incoming_log_votes = _own_and_incoming(bias, groups)  # [B, H_kv, E]  ln p
    own_log_scores, incoming_log_scores = (_finite(x) for x in _own_and_incoming(log_scores, groups))  # ln ŝ

    # Weights w = p ŝ relative to the group max (the common factor cancels in every ratio).
    group_max, own_w, incoming_w = _group_weights(
        own_log_votes + own_log_scores, incoming_log_votes + incoming_log_scores, entry_group
    )
    weight_sum = _group_sum(own_w, incoming_w, entry_group)  # [B, H_kv, E]

    def weighted_mean(own: torch.Tensor, incoming: torch.Tensor) -> torch.Tensor:
        """Σ w_i x_i / Σ w_i over each group; own, incoming [.., E(, D)]."""
        if own.dim() == own_w.dim():
            return _group_sum(own_w * own, incoming_w * incoming, entry_group) / weight_sum
        summed = _group_sum(own_w.unsqueeze(-1) * own, incoming_w.unsqueeze(-1) * incoming, entry_group)
        return summed / weight_sum.unsqueeze(-1)

    own_values, incoming_values = _own_and_incoming(values, groups)  # [B, H_kv, E, D]
    merged_values = weighted_mean(own_values, incoming_values)  # v_r
    if math.isfinite(max_value_change) or max_share < 1.0:
        keep = _gate_keep(own_w, incoming_w, entry_group, own_values, incoming_values, max_value_change, max_share)
        groups, merge = _gated(groups, merge, keep)
    mean_keys = weighted_mean(*_own_and_incoming(keys, groups))  # [B, H_kv, E, D]  k̄
    merged_log_votes = group_logsumexp(own_log_votes, incoming_log_votes, entry_group)  # ln Σ p
    target_logit = group_max + weight_sum.log() - merged_log_votes  # [B, H_kv, E]  t = ln(Σw / Σp)
    mean_logit = weighted_mean(own_log_scores, incoming_log_scores)  # [B, H_kv, E]  m̄

    head_targets = head_mean_logits = None
    if key_rule == "group":
        num_heads = group_log_scores.shape[-2]
        head_groups = entry_group.unsqueeze(-2).expand(-1, -1, num_heads, -1)  # [B, H_kv, g, E]
        own_head_log_scores = _finite(group_log_scores.gather(
            -1, groups.slot.unsqueeze(-2).expand(-1, -1, num_heads, -1)
        ).float())  # [B, H_kv, g, E]  ln s^h
        incoming_head_log_scores = _finite(group_log_scores.gather(
            -1, groups.src.unsqueeze(-2).expand(-1, -1, num_heads, -1)
        ).float())
        head_targets = group_logsumexp(
            own_log_votes.unsqueeze(-2) + own_head_log_scores,
            incoming_log_votes.unsqueeze(-2) + incoming_head_log_scores,
            head_groups,
        ) - merged_log_votes.unsqueeze(-2)  # [B, H_kv, g, E]  t_h
        head_mean_logits = _group_sum(
            own_w.unsqueeze(-2) * own_head_log_scores, incoming_w.unsqueeze(-2) * incoming_head_log_scores, head_groups
        ) / weight_sum.unsqueeze(-2)  # [B, H_kv, g, E]  m̄_h = scaling·q_h·k̄ for exact logits
    merged_keys = _merged_keys(key_rule, mean_keys, target_logit, mean_logit, queries, scaling, paper_max_gain,
                               head_targets, head_mean_logits)
    return MergedRows(groups, {"keys": merged_keys, "values": merged_values, "bias": merged_log_votes}, merge)


def _finite(log_scores: torch.Tensor) -> torch.Tensor:
    """Log-scores with every non-finite one read as 0: an empty slot's -inf, which only an unmerged
    plan entry reads, so that no 0·(-inf) can reach a group's sum."""
    return log_scores.nan_to_num(0.0, 0.0, 0.0)


def _merged_keys(
    key_rule: str, mean_keys: torch.Tensor, target_logit: torch.Tensor, mean_logit: torch.Tensor,
    queries: torch.Tensor | None, scaling: float | None, paper_max_gain: float,
    head_targets: torch.Tensor | None = None, head_mean_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """k_r of each group by ``key_rule`` (see :func:`zip_merge_rows`) from k̄ ``mean_keys`` [B, H_kv, E, D],
    t ``target_logit`` and m̄ ``mean_logit`` [B, H_kv, E]; "group" also reads t_h and m̄_h [B, H_kv, g, E]."""
    if key_rule == "paper":
        gain = target_logit / mean_logit  # ±inf or NaN where m̄ = 0: rejected below
        use_eq25 = (gain >= 1.0 / paper_max_gain) & (gain <= paper_max_gain)
        if queries is None:
            fallback_keys = mean_keys
        else:
            fallback_keys = _shift_along_query(mean_keys, queries, target_logit - mean_logit, scaling)
        return torch.where(use_eq25.unsqueeze(-1), gain.unsqueeze(-1) * mean_keys, fallback_keys)
    if key_rule == "mean":
        return mean_keys
    if key_rule == "projection":
        return _shift_along_query(mean_keys, queries, target_logit - mean_logit, scaling)
    return _min_norm_shift(mean_keys, queries, head_targets - head_mean_logits, scaling)


def _zip_pairs(
    keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, log_scores: torch.Tensor, src: torch.Tensor,
    dst: torch.Tensor, merge: torch.Tensor, key_rule: str, queries: torch.Tensor | None, scaling: float | None,
    group_log_scores: torch.Tensor | None, paper_max_gain: float, max_value_change: float, max_share: float,
) -> MergedRows:
    """:func:`zip_merge_rows` of a plan with one entry per (row, head), E = 1 (a decode step's): every
    group is a pair, its target t and its entry e, read side by side along a last axis of 2, so each
    sum over a group (eq. 25's Σ_G) is a sum over that axis: no sort, no scatter. The arithmetic is
    the general path's, term for term (``tests/test_merging.py`` compares the two). Its groups have
    no ``entry_group``: each entry is its own group, read with its target at ``pair``."""
    pair = torch.cat([dst, src], dim=-1).clamp_min(0)  # [B, H_kv, 2]: t, e (an unmerged entry may hold -1)
    log_votes = bias.gather(-1, pair)  # ln p_t, ln p_e
    log_scores = _finite(log_scores.gather(-1, pair).float())  # ln ŝ_t, ln ŝ_e

    # w = p ŝ relative to the pair's max (eq. 25's weights; the common factor cancels in every ratio)
    log_weights = log_votes + log_scores
    weights = (log_weights - log_weights.amax(-1, keepdim=True)).exp()  # [B, H_kv, 2]  w_t, w_e
    weight_sum = weights.sum(-1, keepdim=True)  # [B, H_kv, 1]  Σ w
    # values, keys and log-scores side by side: one weighted mean gives v_r (eq. 23 / 25), k̄ and m̄
    head_dim = values.shape[-1]
    entries = torch.cat([_gather_entries(values, pair).float(), _gather_entries(keys, pair).float(),
                         log_scores.unsqueeze(-1)], dim=-1)  # [B, H_kv, 2, 2D + 1]
    means = (weights.unsqueeze(-1) * entries).sum(-2) / weight_sum  # [B, H_kv, 2D + 1]
    merged_values = means[..., None, :head_dim]  # v_r [B, H_kv, 1, D]
    mean_keys = means[..., None, head_dim:-1]  # k̄
    mean_logit = means[..., -1:]  # m̄ = Σ w ln ŝ / Σ w  [B, H_kv, 1]

    if math.isfinite(max_value_change) or max_share < 1.0:  # the gates of _gate_keep, on the pair
        keep = None
        if max_share < 1.0:
            keep = weights[..., 1:] <= max_share * weight_sum
        if math.isfinite(max_value_change):
            own_values, incoming_values = entries[..., 0, :head_dim], entries[..., 1, :head_dim]
            change = (weights[..., 1:] * (incoming_values - own_values)).norm(dim=-1, keepdim=True) / weight_sum
            bound = own_values.norm(dim=-1, keepdim=True)  # ‖v_r - v_t‖ <= ε ‖v_t‖
            small = change <= (bound if max_value_change == 1.0 else max_value_change * bound)  # ε = 1: no product
            keep = small if keep is None else keep & small
        merge = merge & keep  # a pair's group is its one entry: both are dropped together

    sums = torch.stack([log_votes, log_weights], dim=-2).logsumexp(-1)  # [B, H_kv, 2]: ln Σ p (eq. 6), ln Σ w
    merged_log_votes = sums[..., :1]  # [B, H_kv, 1]
    target_logit = sums[..., 1:] - merged_log_votes  # t = ln(Σw / Σp) (eq. 22)

    head_targets = head_mean_logits = None
    if key_rule == "group":
        heads = pair.unsqueeze(-2).expand(-1, -1, group_log_scores.shape[-2], -1)  # [B, H_kv, g, 2]
        head_log_scores = _finite(group_log_scores.gather(-1, heads).float())  # ln s^h_t, ln s^h_e
        head_targets = ((log_votes.unsqueeze(-2) + head_log_scores).logsumexp(-1, keepdim=True)
                        - merged_log_votes.unsqueeze(-2))  # [B, H_kv, g, 1]  t_h
        head_mean_logits = (weights.unsqueeze(-2) * head_log_scores).sum(-1, keepdim=True) / weight_sum.unsqueeze(-2)
    merged_keys = _merged_keys(key_rule, mean_keys, target_logit, mean_logit, queries, scaling, paper_max_gain,
                               head_targets, head_mean_logits)
    groups = Groups(None, pair[..., :1].where(merge, 0), merge, pair[..., 1:], pair)
    return MergedRows(groups, {"keys": merged_keys, "values": merged_values, "bias": merged_log_votes}, merge)


# -- ZIP-merging with log-scores (KeepKV) -------------------------------------------------------
class LogScores(NamedTuple):
    """Per-entry log-scores ln ŝ a ZIP merge weighs with: per query head [B, H_kv, g, S] (-inf on
    empty slots) and pooled over the GQA group [B, H_kv, S] (:func:`pool_log_scores`)."""

    heads: torch.Tensor
    pooled: torch.Tensor


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
    # [B, H_kv, g]; 0 where a head has no entry
    log_z = torch.logsumexp(head_scores + bias[:, :, None], dim=-1).nan_to_num(0.0, 0.0, 0.0)
    shares = torch.logsumexp(head_scores - log_z[..., None], dim=2) - math.log(head_scores.shape[2])
    return shares + log_z.mean(-1, keepdim=True)


def zip_rows(
    keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
    merge: torch.Tensor, head_log_scores: torch.Tensor, query: torch.Tensor, scaling: float, zip_key: str,
    pooled: torch.Tensor, max_value_change: float = math.inf, max_share: float = 1.0,
) -> MergedRows:
    """The merged rows of ZIP-merging ``src`` into ``dst`` where ``merge`` (all [B, H_kv, E]) in a
    layer's keys, values [B, H_kv, S, D] and bias [B, H_kv, S] (``LayerStore.merge_into`` writes
    them), the groups that fail the gates (``max_value_change``, ``max_share``:
    :func:`zip_merge_rows`) dropped whole.

    head_log_scores [B, H_kv, g, S]: ln s^h per query head (-inf on empty slots); pooled
    [B, H_kv, S]: their pool over the group (:func:`pool_log_scores`), the merge weights; query
    [B, H_kv, g, D]: the queries the key rule moves the key along (their mean, or each of them for
    ``zip_key="group"``).
    """
    group = zip_key == "group"
    # Empty slots (-inf) never take part in a merge: zip_merge_rows reads their scores as 0.
    return zip_merge_rows(
        keys,
        values,
        bias,
        pooled,
        src,
        dst,
        merge,
        key_rule=zip_key,
        queries=query if group else query.mean(2),
        scaling=scaling,
        group_log_scores=head_log_scores if group else None,
        max_value_change=max_value_change,
        max_share=max_share,
    )


def _scaled(log_scale: torch.Tensor | float) -> bool:
    """Whether a log-scale is more than the float 0 (then adding it is no op to run)."""
    return not (isinstance(log_scale, float) and log_scale == 0.0)


def ema_log_scores(
    ema_log_s: torch.Tensor, ema_log_n: torch.Tensor, bias: torch.Tensor, live: torch.Tensor,
    log_scale: torch.Tensor | float,
) -> LogScores:
    """KeepKV's bias-corrected EMA log-scores ln ŝ^h = ln S^h - ln N (+ ln Z with row-normalised
    scores: ``log_scale``), per query head [B, H_kv, g, S] (-inf on empty slots) and pooled over
    the group [B, H_kv, S].

    ema_log_s [B, H_kv, g, S] (a view of the stored [B, H_kv, S, g]); ema_log_n, bias, live [B, H_kv, S].
    Slots that are not ``live`` read -inf, whatever the EMA holds there.
    """
    # A copy in [B, H_kv, g, S] order: the reductions over S and over the group that read it run about
    # twice as fast as on the stored [B, H_kv, S, g] order, which every op on the view keeps.
    heads = (ema_log_s - ema_log_n[:, :, None]).clone(memory_format=torch.contiguous_format)
    if _scaled(log_scale):  # ln Z of row-normalised scores
        heads = heads + log_scale
    heads = heads.where(live[:, :, None], NEG_INF)
    return LogScores(heads, pool_log_scores(heads, bias))


def merged_ema_rows(
    ema_log_n: torch.Tensor, bias: torch.Tensor, heads: torch.Tensor, groups: Groups, votes: torch.Tensor,
    log_scale: torch.Tensor | float,
) -> torch.Tensor:
    """[B, H_kv, E, g]: the stored EMA row of each merge target (``groups``, the merge's group
    space), the per-vote group mean Σ p ŝ^h / Σ p of its EMA log-scores, on the stored scale.

    ema_log_n, bias [B, H_kv, S] and heads [B, H_kv, g, S] (EMA log-scores ln ŝ^h) from before the
    merge; votes [B, H_kv, E]: each group's merged ln Σ p (the merged bias rows).
    """
    group = heads.shape[2]
    if groups.pair is not None:  # one entry per (row, head): the pair (t, e) side by side, as _zip_pairs
        log_w = (bias[:, :, None] + heads).gather(-1, groups.pair[:, :, None].expand(-1, -1, group, -1))  # ln(p ŝ^h)
        mean_score = log_w.logsumexp(-1, keepdim=True) - votes[:, :, None]  # [B, H_kv, g, 1]
    else:
        log_w = bias[:, :, None] + heads  # ln(p ŝ^h)
        own_w = log_w.gather(-1, groups.slot[:, :, None].expand(-1, -1, group, -1))  # [B, H_kv, g, E]
        incoming_w = log_w.gather(-1, groups.src[:, :, None].expand(-1, -1, group, -1))
        head_groups = groups.entry_group[:, :, None].expand(-1, -1, group, -1)
        mean_score = group_logsumexp(own_w, incoming_w, head_groups) - votes[:, :, None]
    if _scaled(log_scale):
        mean_score = mean_score - log_scale
    log_n = ema_log_n.gather(-1, groups.slot)[:, :, None]
    return (mean_score + log_n).transpose(-1, -2)


def zip_rows_with_ema(
    keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, ema_log_n: torch.Tensor, src: torch.Tensor,
    dst: torch.Tensor, merge: torch.Tensor, weights: LogScores, ema_heads: torch.Tensor, query: torch.Tensor,
    scaling: float, zip_key: str, log_scale: torch.Tensor | float, max_value_change: float = math.inf,
    max_share: float = 1.0,
) -> MergedRows:
    """KeepKV's merge: :func:`zip_rows` weighed by ``weights`` (its EMA's or exact logits), with
    each target's EMA row under "ema_log_s" (:func:`merged_ema_rows` of ``ema_heads`` [B, H_kv, g, S],
    ``ema_log_n`` [B, H_kv, S] and ``log_scale``, from before the merge)."""
    merged = zip_rows(keys, values, bias, src, dst, merge, weights.heads, query, scaling, zip_key, weights.pooled,
                      max_value_change, max_share)
    ema_rows = merged_ema_rows(ema_log_n, bias, ema_heads, merged.groups, merged.rows["bias"], log_scale)
    return MergedRows(merged.groups, {**merged.rows, "ema_log_s": ema_rows}, merged.merge)


def convex_merge_rows(
    keys: torch.Tensor,
    values: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    merge: torch.Tensor,
    weights: torch.Tensor,
) -> MergedRows:
    """Classic convex (weighted) merge of keys and values (KeepKV eq. 5 / eq. 11).

    Each target becomes x_r = (x_c + Σ_e w_e x_e) / (1 + Σ_e w_e): the target has weight 1 and
    each merged entry its unnormalised weight w_e relative to it, normalised per group, so the
    coefficients are >= 0 and sum to 1. Weight conventions of the methods (KeepKV eq. 12):

    - D2O (its eq. 10-11): target weight e = exp(cos(k_c, k_c)), entry weight exp(u_e), so pass
      ``weights = exp(u_e - 1)`` with u_e the cosine similarity to the target.
    - KVMerger: Gaussian kernel, 1 for the target itself, so pass exp(-‖k_e - k_c‖² / 2σ²).

    No votes are kept, so the merged entry's attention mass sags (Theorem 2 / 7).

    Parameters
    ----------
    keys, values : [B, H_kv, S, D], any float dtype.
    src, dst, merge : [B, H_kv, E] eviction plan (see module docstring).
    weights : [B, H_kv, E], >= 0, weight of each evicted entry relative to its target's 1.

    Returns
    -------
    The merged rows of "keys" and "values" at each target.
    """
    groups = _group_plan(src, dst, merge, keys.shape[-2])
    incoming_w = weights.float().unsqueeze(-1)  # [B, H_kv, E, 1]
    weight_sum = _group_sum(torch.ones_like(incoming_w), incoming_w, groups.entry_group)  # 1 + Σ w_e
    return MergedRows(groups, _merged_rows(groups, weight_sum, incoming_weight=incoming_w, keys=keys, values=values))


def mean_merge_rows(
    keys: torch.Tensor, values: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, merge: torch.Tensor,
    weights: torch.Tensor,
) -> MergedRows:
    """Each target becomes the mean of itself and its weighted incoming entries:
    x_r = (x_c + Σ_e w_e x_e) / (1 + n), n the entries merged into it (D2O's released code: a
    ``scatter_reduce(..., "mean", include_self=True)`` of u·x, u the cosine similarity). Not a
    convex combination: the coefficients sum to (1 + Σ w) / (1 + n).

    keys, values [B, H_kv, S, D]; src, dst, merge [B, H_kv, E] eviction plan; weights [B, H_kv, E]
    (an unmerged entry's is ignored). Returns the merged rows of "keys" and "values".
    """
    groups = _group_plan(src, dst, merge, keys.shape[-2])
    incoming_w = weights.float().where(merge, 0.0).unsqueeze(-1)  # [B, H_kv, E, 1]
    count = _group_sum(torch.ones_like(incoming_w), merge.float().unsqueeze(-1), groups.entry_group)  # 1 + n
    return MergedRows(groups, _merged_rows(groups, count, incoming_weight=incoming_w, keys=keys, values=values))


def momentum_merge_rows(
    keys: torch.Tensor,
    values: torch.Tensor,
    counts: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    merge: torch.Tensor,
) -> MergedRows:
    """ZeroMerge's momentum merge into residual slots (ZeroMerge eq. 7), many sources at once.

    One source: x_slot <- (w x_slot + x) / (w + 1), w <- w + 1. Applied for n sources in turn
    this telescopes to x_slot <- (w x_slot + Σ x) / (w + n), w <- w + n, which is computed here
    in one scatter. Each source counts as one token (as in the paper), whatever its own count.
    The method then adds α·ln w to the slot's logit (ZeroMerge eq. 8).

    Parameters
    ----------
    keys, values : [B, H_kv, S, D], any float dtype.
    counts : [B, H_kv, S] float, fusion count w of each slot (1 for a plain token).
    src, dst, merge : [B, H_kv, E] eviction plan (see module docstring).

    Returns
    -------
    The merged rows of "keys", "values" and "count" (w + n) at each target.
    """
    groups = _group_plan(src, dst, merge, keys.shape[-2])
    own_counts = counts.gather(-1, groups.slot).float().unsqueeze(-1)  # [B, H_kv, E, 1]  w
    new_counts = _group_sum(own_counts, torch.ones_like(own_counts), groups.entry_group)  # w + n
    rows = _merged_rows(groups, new_counts, own_weight=own_counts, keys=keys, values=values)
    return MergedRows(groups, {**rows, "count": new_counts.squeeze(-1)})


def spread_values_rows(
    values: torch.Tensor,
    src: torch.Tensor,
    merge: torch.Tensor,
    m: int,
    kept_next_idx: torch.Tensor,
) -> MergedRows:
    """CaM's value merge: the evicted value v_e / m is added to each of the next m kept values.

    The share is v_e / m even where fewer than m successors exist (index -1, skipped): those
    shares are dropped, as in CaM. Keys are untouched.

    Parameters
    ----------
    values : [B, H_kv, S, D], any float dtype.
    src : [B, H_kv, E] slot of each evicted entry.
    merge : [B, H_kv, E] bool, True = spread this entry (CaM's Bernoulli draw), False = drop.
    m : number of successors each value is spread over.
    kept_next_idx : [B, H_kv, E, m] int64, slots of the next m kept entries, -1 = none.

    Returns
    -------
    The merged rows of "values" at each receiving slot.
    """
    if kept_next_idx.shape[-1] != m:
        raise ValueError(f"kept_next_idx has {kept_next_idx.shape[-1]} successors per entry, expected m={m}")
    # one plan entry per (evicted entry, successor): [B, H_kv, E*m]
    receives = (kept_next_idx >= 0) & merge.unsqueeze(-1)
    sources = src.unsqueeze(-1).expand_as(kept_next_idx)
    groups = _group_plan(sources.flatten(-2), kept_next_idx.flatten(-2), receives.flatten(-2), values.shape[-2])
    own = _gather_entries(values, groups.slot).float()  # [B, H_kv, E*m, D]
    shares = _gather_entries(values, groups.src).float() / m
    return MergedRows(groups, {"values": _group_sum(own, shares, groups.entry_group)})


def gathers_candidates(candidates: int, slots: int) -> bool:
    """Whether :func:`cosine_nearest` compares with ``candidates`` gathered keys rather than all
    ``slots``: when they are under half of them (a prefill compression)."""
    return 2 * candidates < slots


def cosine_nearest(
    keys: torch.Tensor,
    src: torch.Tensor,
    candidates_mask: torch.Tensor,
    candidate_idx: torch.Tensor | None = None,
    chunk_elements: int = 1 << 24,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Most cosine-similar candidate of each evicted key (D2O eq. 8; KeepKV's merge target).

    Only the evicted keys are compared: (k_e · K^T) / (‖k_e‖ ‖K‖), in chunks of the plan
    holding at most ``chunk_elements`` similarities.

    Parameters
    ----------
    keys : [B, H_kv, S, D].
    src : [B, H_kv, E] slot of each evicted entry (negative padding is clamped to 0).
    candidates_mask : [B, H_kv, S] bool, slots allowed as targets (normally the kept ones).
    candidate_idx : [B, H_kv, K], optional slots that include every candidate (a plan's
        ``keep_idx``). When K < S / 2 (a prefill compression) the keys are compared with these
        K keys only, not with all S.

    Returns
    -------
    best_idx : [B, H_kv, E] int64, slot of the most similar candidate.
    best_sim : [B, H_kv, E] fp32, its cosine similarity; -inf (with any index) where a row has
        no candidate.
    """
    if nearest.cpp_takes(keys, src):  # a decode step's few evicted entries: one C++ pass, the same slots
        return nearest.nearest_cpp(keys, src, candidates_mask)
    keys = keys.float()
    if candidate_idx is not None and gathers_candidates(candidate_idx.shape[-1], keys.shape[2]):
        targets, allowed = _gather_entries(keys, candidate_idx), candidates_mask.gather(-1, candidate_idx)
    else:
        targets, allowed, candidate_idx = keys, candidates_mask, None
    target_norms = targets.norm(dim=-1).clamp_min(1e-12).unsqueeze(-2)  # F.normalize's eps
    excluded = ~allowed.unsqueeze(-2)
    best_idx, best_sim = [], []
    for part in src.clamp_min(0).split(max(1, chunk_elements // allowed.numel()), dim=-1):
        src_keys = _gather_entries(keys, part)  # [B, H_kv, e, D]
        src_unit = src_keys / src_keys.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        # [B, H_kv, e, S or K], as a view of the [S or K, e] product: a GEMM with few columns is slow on CPU
        similarity = (targets @ src_unit.transpose(-1, -2)).transpose(-1, -2).div_(target_norms)
        similarity.masked_fill_(excluded, -math.inf)  # in place: one workspace, not two
        sim, idx = similarity.max(dim=-1)
        best_idx.append(idx)
        best_sim.append(sim)
    # one chunk (a decode step's plan): its own tensors, not a copy
    best_idx, best_sim = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1) for parts in (best_idx, best_sim))
    if candidate_idx is not None:
        best_idx = candidate_idx.gather(-1, best_idx)
    return best_idx, best_sim
