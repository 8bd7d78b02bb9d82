"""KeepKV: Electoral Votes, ZIP-Merging, EMA attention scores and periodic lossless refresh.

KeepKV is a selection plus KeepKV's merge (:class:`KeepKVMerge`): ZIP-merging with Electoral
Votes whose decode-time weights are EMA-predicted attention scores (eq. 8), with merge gates, the
paper's merge-first prefill as an option and the periodic lossless refresh. The merge keeps the
EMA; KeepKV's own ranking by it is the selection ``ema`` (:class:`EmaAttention`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..attention import CHUNK_ELEMENTS, Needs, StepStats, scaled_logits
from ..merging import Groups, MergedRows, cosine_nearest, group_logsumexp
from ..offload import FullKVCopy
from ..store import NEG_INF, slots_of
from .base import (
    ComposedMethod, Extra, Merge, ScoredSelection, Selection, check_choice, check_range, plan_eviction, protected,
    register, register_merge, register_selection,
)
from .snapkv import ObservationWindow
from .zip_merging import ZipMerge, pool_log_scores, zip_rows

SCORE_MODES = ("ema", "exact")
SCORE_NORMS = ("none", "row")
PREFILL_ORDERS = ("merge_first", "evict_first")


def ema_log_scores(
    ema_log_s: torch.Tensor, ema_log_n: torch.Tensor, bias: torch.Tensor, live: torch.Tensor,
    log_scale: torch.Tensor | float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bias-corrected EMA log-scores ln ŝ^h = ln S^h - ln N (+ ln Z, see ``score_norm``), per
    query head [B, H_kv, g, S] (-inf on empty slots) and pooled over the group [B, H_kv, S].

    ema_log_s [B, H_kv, g, S] (a view of the stored [B, H_kv, S, g]); ema_log_n, bias, live [B, H_kv, S].
    """
    empty = ~live
    log_n = ema_log_n.masked_fill(empty, 0.0)[:, :, None]
    heads = (ema_log_s - log_n + log_scale).masked_fill(empty[:, :, None], NEG_INF)
    return heads, pool_log_scores(heads, bias)


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
    log_w = bias[:, :, None] + heads  # ln(p ŝ^h)
    own_w = log_w.gather(-1, groups.slot[:, :, None].expand(-1, -1, group, -1))  # [B, H_kv, g, E]
    incoming_w = log_w.gather(-1, groups.src[:, :, None].expand(-1, -1, group, -1))
    head_groups = groups.entry_group[:, :, None].expand(-1, -1, group, -1)
    mean_score = group_logsumexp(own_w, incoming_w, head_groups) - votes[:, :, None]
    log_n = ema_log_n.gather(-1, groups.slot)[:, :, None]
    return (mean_score - log_scale + log_n).transpose(-1, -2)


@register_selection
@dataclass(frozen=True)
class EmaAttention(ScoredSelection):
    """KeepKV's own selection: ``sinks`` leading tokens, a recent window (recent:heavy =
    ``recent_ratio``:(1 - ``recent_ratio``) of the budget left after the sinks) and heavy hitters
    ranked by their predicted attention mass ln p + ln ŝ (the EMA scores that KeepKV's merge keeps,
    so it pairs with merge ``keepkv`` only), with PyramidInfer's cosine-decayed layer budgets.

    Parameters
    ----------
    sinks : int
        Leading tokens always kept (4).
    kernel : int
        Odd max-pool width over neighbouring entries of the ranking (1: no pooling). Pooling
        keeps the neighbours of a highly attended token, so a multi-token fact survives whole
        (SnapKV's pooling; not in the KeepKV paper).
    recent_ratio : float
        Recent window as a share of the budget left after the sinks, in [0, 1]. Default 0.2:
        recent:heavy = 1:4, the upper end of the 1:5-1:4 range in Appendix B.3 (whose wording
        "ratio between the recent window and the heavy hitter ... 5:1 and 4:1" we read as
        recent:heavy = 1:5 to 1:4).
    last_layer_share : float
        PyramidInfer cosine decay: the heavy-hitter share of a layer falls from 1.0 at layer 0 to
        this at the last layer (Appendix B.3: 0.8), rescaled so the mean budget is the budget.
    """

    name = "ema"
    scored = False  # it ranks by the merge's EMA extras, not by a "score" of its own
    sinks: int = 4
    kernel: int = 1
    recent_ratio: float = 0.2
    last_layer_share: float = 0.8

    def __post_init__(self):
        super().__post_init__()
        check_range("recent_ratio", self.recent_ratio, 0.0, 1.0)
        check_range("last_layer_share", self.last_layer_share, 0.0, 1.0, low_open=True)
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be an odd int >= 1, got {self.kernel!r}")

    def refusal(self, merging) -> str | None:
        if not isinstance(merging, KeepKVMerge):
            return f"selection 'ema' ranks by the EMA that merge 'keepkv' keeps; merge {merging.name!r} keeps none"
        return None

    @property
    def keeps_order(self) -> bool:
        """The pooled ranking compares neighbouring slots: the kept entries stay in position order."""
        return self.kernel > 1

    def recent_count(self, budget: torch.Tensor) -> torch.Tensor:
        sinks = budget.clamp(max=self.sinks)
        return ((budget - sinks).double() * self.recent_ratio).round().long()

    def allocate(self, layers, kv_heads, row_budget, prompt_lengths, states=None) -> torch.Tensor:
        """PyramidInfer cosine decay of the heavy share; sinks and recent equal in every layer.

        Per row with mean budget b: heavy_l = (b - sinks - recent) · f_l / mean(f), with
        f_l = c + (1 - c)(1 + cos(π l / (L - 1))) / 2 falling from 1 to c = ``last_layer_share``.
        Layer budgets are rounded cumulatively, so they sum to exactly L·b.
        """
        budget = row_budget.double()
        recent = self.recent_count(row_budget)
        fixed = budget.clamp(max=self.sinks) + recent
        depth = torch.linspace(0.0, 1.0, layers, dtype=torch.float64, device=row_budget.device)
        if layers == 1:
            depth = torch.zeros(1, dtype=torch.float64, device=row_budget.device)
        share = self.last_layer_share + (1 - self.last_layer_share) * (1 + torch.cos(math.pi * depth)) / 2
        per_layer = fixed[None] + (budget - fixed)[None] * (share / share.mean())[:, None]  # [L, B]
        cumulative = per_layer.cumsum(0).round()
        budgets = torch.diff(cumulative, dim=0, prepend=torch.zeros_like(cumulative[:1])).long().clamp(min=1)
        return budgets[:, :, None].expand(layers, -1, kv_heads).clone()

    def priority(self, layer, pooled: torch.Tensor | None = None) -> torch.Tensor:
        """[B, H_kv, S]: +inf for sinks and recent, else the predicted attention mass ln p + ln ŝ,
        max-pooled over ``kernel`` neighbouring slots. ``pooled`` [B, H_kv, S]: the pooled EMA
        log-scores (:meth:`KeepKVMerge.ema`), which KeepKV's merge computes once per compression."""
        if pooled is None:
            raise ValueError("selection 'ema' ranks by the EMA that merge 'keepkv' computes (pass pooled)")
        # Recent tokens are a share of the row's mean budget, alike in every layer (see allocate).
        recent = self.recent_count(layer.row_budget)[:, None].expand_as(layer.budget)
        mass = layer.bias + pooled
        if self.kernel > 1:  # slots are in position order: neighbours are neighbouring tokens
            batch, kv_heads, size = mass.shape
            mass = F.max_pool1d(mass.view(-1, 1, size), self.kernel, stride=1, padding=self.kernel // 2)
            mass = mass.view(batch, kv_heads, size).masked_fill(~layer.live(), NEG_INF)
        return mass.masked_fill(protected(layer, self.sinks, recent), float("inf"))


@register_merge
@dataclass(frozen=True)
class KeepKVMerge(ZipMerge):
    """KeepKV's merge (Tian et al., "KeepKV: Achieving Periodic Lossless KV Cache Compression for
    Efficient LLM Inference", arXiv 2504.09936): every entry the selection evicts is ZIP-merged
    (eq. 7 / 25) into the kept entry (sinks and recent included) whose key is most cosine-similar,
    if that similarity is at least ``threshold``; otherwise it is evicted. Every entry carries
    Electoral Votes p (1 for a token; a merge adds them), stored as ln p in the cache's bias, so
    attention computes Σ p s v / Σ p s. Decode-time merges weigh entries by EMA-predicted scores
    (eq. 8), which this merge keeps per entry and query head.

    How the scores, merges, GQA pooling, refresh and prefill orders work: docs/keepkv.md, "How the
    implementation works".

    Parameters
    ----------
    threshold, zip_key, max_share
        As ZIP's (:class:`~keepkv.methods.zip_merging.ZipMerge`; T = 0.8 as the paper's).
    protect, max_value_change : float
        Merge gates of evict-then-merge; here 0.75 and 1.0: the top 3/4 of the entries kept by
        score take no merges, the others move by at most their norm (docs/keepkv.md, "Merge
        gates"). ``protect=0+max_value_change=None``: the paper's merge.
    alpha : float
        EMA decay α in (0, 1). Default 0.94 ≈ 1 - 2/(w + 1) for w = 32: the EMA whose centre of
        mass matches a w-row window (so the prefill window carries 86% of the initial weight).
        The paper gives no value.
    window : int
        w >= 1, query rows the EMA is initialised over at the end of prefill (paper: 32).
    score_norm : str
        "none" (the paper: the EMA of the unnormalised scores s, eq. 8, so a query whose logits
        are large outweighs the others) or "row" (each query's scores divided by its partition
        function Σ p s before they enter the EMA, so every query counts equally, as in H2O's and
        SnapKV's sums of attention probabilities; read back on the newest query's logit scale).
    scores : str
        "ema" or "exact": scores of decode-time merges (the EMA, or the newest query's logits).
    prefill_scores : str
        "exact" or "ema": scores of prefill merges (the last prompt query's logits, or the EMA).
    prefill_order : str
        "evict_first" (default): eviction with merging only, as during decoding. "merge_first"
        (the paper, Appendix B, Table 3): every non-protected entry that has a more important
        entry at least T similar first merges into its most similar "root" (an entry with no more
        important entry at least T similar; at most the entries a row must shed), then eviction
        (with merging) brings the layer to its budget. Decode-time compression is always
        evict-then-merge.
    refresh_interval : int or None
        N >= 1: rebuild every layer from the full copy every N decode steps (selection ``ema``
        only). None: never, and no full copy is kept.
    """

    name = "keepkv"
    protect: float = 0.75
    max_value_change: float | None = 1.0
    alpha: float = 0.94
    window: int = 32
    score_norm: str = "none"
    scores: str = "ema"
    prefill_scores: str = "exact"
    prefill_order: str = "evict_first"
    refresh_interval: int | None = None

    def __post_init__(self):
        super().__post_init__()
        check_range("alpha", self.alpha, 0.0, 1.0, low_open=True, high_open=True)
        check_range("window", self.window, 1, math.inf)  # types: check_field_types
        check_choice("score_norm", self.score_norm, SCORE_NORMS)
        if self.refresh_interval is not None:
            check_range("refresh_interval", self.refresh_interval, 1, math.inf)
        check_choice("scores", self.scores, SCORE_MODES)
        check_choice("prefill_scores", self.prefill_scores, SCORE_MODES)
        check_choice("prefill_order", self.prefill_order, PREFILL_ORDERS)

    @property
    def reads_every_entry(self) -> bool:
        return self.score_norm == "row"  # each query's partition function, over every entry it sees

    def refusal(self, selection) -> str | None:
        if self.refresh_interval is not None and not isinstance(selection, EmaAttention):
            return "refresh_interval re-ranks entries by the EMA: use it with selection='ema'"
        return None

    def needs(self, is_prefill: bool) -> Needs:
        # While decoding, the EMA and the merges read the logits the attention computed; at prefill
        # the merge computes its window's logits itself.
        return Needs(logits=not is_prefill)

    def observe(self, layer, stats: StepStats, selection) -> None:
        query = stats.query  # [B, H_kv, g, q, D]
        rows = query.shape[3]
        if stats.is_prefill:
            self._start_layer(layer, query.shape[2], stats.scaling)
            window = min(self.window, rows)
            query_pos = layer.positions[:, 0, -window:]
            self._absorb(layer, query[:, :, :, -window:], query_pos)
        else:
            query_pos = layer.positions[:, 0, -rows:]
            self._absorb(layer, query, query_pos, stats.logits)
        if self.refresh_interval is None:
            return
        is_real = layer.positions[:, 0, -rows:] >= 0
        layer.state["offload"].append(layer.keys[:, :, -rows:], layer.values[:, :, -rows:], is_real)
        keep = min(self.window, rows)
        layer.state["query_window"] = torch.cat([layer.state["query_window"], query[:, :, :, -keep:]], dim=3)[
            :, :, :, -self.window :
        ]
        layer.state["query_window_pos"] = torch.cat(
            [layer.state["query_window_pos"], layer.positions[:, 0, -keep:]], dim=1
        )[:, -self.window :]
        if not stats.is_prefill:
            layer.state["steps"] += rows  # decode steps since the prefill: only the refresh counts them
        if not stats.is_prefill and layer.budget is not None:
            steps = layer.state["steps"]
            if steps // self.refresh_interval > (steps - rows) // self.refresh_interval:
                self.refresh(layer, selection)  # a compression: the store has nothing pending after it

    def entry_extras(self, group: int) -> dict[str, Extra]:
        """The EMA (:meth:`_start_layer`): ln S per query head of the group, ln N per entry."""
        return {"ema_log_s": Extra(NEG_INF, trailing=(group,)), "ema_log_n": Extra(NEG_INF)}

    def compress(self, layer, selection, stats: StepStats) -> None:
        if layer.size > layer.min_budget:
            if stats.is_prefill:
                self._compress_prefill(layer, selection, exact=self.prefill_scores == "exact")
            else:
                self._evict_and_merge(layer, selection, exact=self.scores == "exact")
        # The newest query and its exact logits are one step's scratch (the logits over that
        # step's slots, [B, H_kv, g, S], a prompt's S after a prefill): observe writes them before
        # any read, so the state does not carry them (nor a serving engine copy them per request
        # and step).
        layer.state.pop("exact_logits", None)
        layer.state.pop("query", None)

    # -- scores ------------------------------------------------------------------------------
    def _start_layer(self, layer, group: int, scaling: float) -> None:
        batch, kv_heads = layer.bias.shape[:2]
        layer.add_extra("ema_log_s", fill=NEG_INF, trailing=(group,))
        layer.add_extra("ema_log_n", fill=NEG_INF)
        layer.state.update(
            scaling=scaling,
            steps=0,
            refreshes=0,
            # fp32: a decode step does no fp64 arithmetic on the device (slow on consumer GPUs)
            lost_votes=torch.zeros(batch, kv_heads, device=layer.device),
        )
        if self.refresh_interval is not None:
            layer.state["offload"] = FullKVCopy(layer.keys, layer.values)
            head_dim = layer.keys.shape[-1]
            layer.state["query_window"] = layer.keys.new_zeros(batch, kv_heads, group, 0, head_dim)
            layer.state["query_window_pos"] = layer.positions.new_zeros(batch, 0)

    def _absorb(self, layer, queries: torch.Tensor, query_pos: torch.Tensor, logits: torch.Tensor | None = None) -> None:
        """Fold r query rows (oldest first) into the EMA (eq. 8) and keep the newest row's logits.

        queries [B, H_kv, g, r, D]; query_pos [B, r] their positions (-1: padding, skipped);
        logits: their q·k·scaling against the layer's keys, if the attention computed them.
        Row r' of r gets weight (1 - α) α^(r-1-r'); the old state decays by α^r. A row scores only
        the live entries at or before its position (causal, padding excluded).
        """
        rows = queries.shape[3]
        live = layer.live()
        decoding = logits is not None  # a prefill or a refresh computes its own window's logits
        if logits is None:
            logits = scaled_logits(queries, layer.keys, layer.state["scaling"])  # [B, H_kv, g, r, S]
        log_fresh = math.log1p(-self.alpha)
        decay = rows * math.log(self.alpha)
        ema_s = layer.extras["ema_log_s"].permute(0, 1, 3, 2)  # [B, H_kv, g, S], a view
        if rows == 1:  # a decode step: the newest query sees every live entry
            visible = live[:, :, None, :]  # [B, H_kv, 1, S]
        else:
            key_pos = layer.positions[:, :, None, :]  # [B, H_kv, 1, S]
            visible = live[:, :, None, :] & (key_pos <= query_pos[:, None, :, None]) & (query_pos >= 0)[:, None, :, None]
        scores = logits
        if self.score_norm == "row":
            # ln Z = ln Σ_j p_j s_j of each query row over what it sees: each query then counts
            # equally in the EMA, as in H2O's and SnapKV's sums of attention probabilities.
            seen = (logits + layer.bias[:, :, None, None]).masked_fill(~visible[:, :, None], NEG_INF)
            log_z = torch.logsumexp(seen, dim=-1)  # [B, H_kv, g, r]
            log_z = log_z.where(torch.isfinite(log_z), 0.0)
            scores = logits - log_z[..., None]
            layer.state["log_z"] = log_z[..., -1]  # [B, H_kv, g]: the newest query's, see _log_scale
        if rows == 1:
            new_s = scores[:, :, :, 0] + log_fresh
            new_n = torch.full_like(layer.bias, log_fresh)
        else:
            ages = torch.arange(rows - 1, -1, -1, device=layer.device, dtype=torch.float32)
            weights = (log_fresh + ages * math.log(self.alpha))[:, None].masked_fill(~visible, NEG_INF)  # [B, H_kv, r, S]
            new_s = torch.logsumexp(weights[:, :, None] + scores, dim=3)  # [B, H_kv, g, S]
            new_n = torch.logsumexp(weights, dim=2)  # [B, H_kv, S]
        # In place: the extras stay views of the layer's buffers, so the next append copies nothing.
        # logaddexp on a strided view (the buffers' spare slots) is slow on CPU, so it reads a
        # contiguous copy and copies the result back (docs/performance.md has the figure).
        empty = ~live
        frozen = layer.frozen_entries()
        if frozen is not None:  # a kept prompt is unscored: its EMA stays at its fill (LayerStore.set_budget)
            empty = empty | frozen
        for state, fresh, mask in ((ema_s, new_s, empty[:, :, None]), (layer.extras["ema_log_n"], new_n, empty)):
            state.copy_(torch.logaddexp(state.contiguous().add_(decay), fresh).masked_fill_(mask, NEG_INF))
        layer.state["query"] = queries[:, :, :, -1].clone()  # [B, H_kv, g, D]; not a view that holds the block
        if not decoding or self.scores == "exact":  # decode merges with EMA scores need no exact logits
            layer.state["exact_logits"] = logits[:, :, :, -1].masked_fill(~live[:, :, None], NEG_INF)

    def _log_scale(self, layer) -> torch.Tensor | float:
        """[B, H_kv, g] ln Z of the newest query with ``score_norm="row"`` (else 0): the EMA of
        normalised scores times it is on the logit scale of that query, as ZIP's key rule needs."""
        return layer.state["log_z"][..., None] if self.score_norm == "row" else 0.0

    # -- compression -------------------------------------------------------------------------
    def merge_entries(
        self, layer, src: torch.Tensor, dst: torch.Tensor, merge: torch.Tensor, exact: bool, ema=None,
        pooled: torch.Tensor | None = None, gated: bool = False,
    ) -> torch.Tensor:
        """ZIP-merge the plan (src -> dst where ``merge``) into the layer's store, in place; returns
        [B, H_kv, E] the entries that merged.

        ``exact``: merge with the newest query's logits, else with the EMA scores; ``ema``: the
        (per-head, pooled) EMA log-scores if already computed; ``pooled``: the merge's scores
        pooled over the query group (:meth:`_merge_scores`), if already computed; ``gated``: the
        targets that fail the merge gates (``max_value_change``, ``max_share``) take none.
        """
        ema = ema if ema is not None else self._ema(layer)
        heads_ema = ema[0]
        heads = layer.state["exact_logits"] if exact else heads_ema
        if pooled is None:
            pooled = self._merge_scores(layer, exact, ema)[1]
        gates = self.gates() if gated else (math.inf, 1.0)
        merged = zip_rows(
            layer, src, dst, merge, heads, layer.state["query"], layer.state["scaling"], self.zip_key, pooled, *gates
        )
        # The targets' EMA, from the votes before the merge, written with the merged entries.
        ema_rows = merged_ema_rows(
            layer.extras["ema_log_n"], layer.bias, heads_ema, merged.groups, merged.rows["bias"], self._log_scale(layer)
        )
        layer.merge_into(MergedRows(merged.groups, {**merged.rows, "ema_log_s": ema_rows}))
        return merged.merge

    def _merge_scores(self, layer, exact: bool, ema) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-head [B, H_kv, g, S], pooled [B, H_kv, S]) log-scores a merge weighs with: the
        newest query's logits if ``exact``, else the EMA's (``ema``, as :meth:`_ema` returns it)."""
        if not exact:
            return ema
        logits = layer.state["exact_logits"]
        return logits, pool_log_scores(logits, layer.bias)

    def _ema(self, layer, live: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-head [B, H_kv, g, S], pooled [B, H_kv, S]) EMA log-scores, see :func:`ema_log_scores`. A
        kept prompt's entries are unscored (their EMA stays at its fill): they carry no score, so
        the pooled scores' normalisation covers the scored entries only."""
        live = layer.live() if live is None else live
        frozen = layer.frozen_entries()
        if frozen is not None:
            live = live & ~frozen
        ema_s = layer.extras["ema_log_s"].permute(0, 1, 3, 2)
        return ema_log_scores(ema_s, layer.extras["ema_log_n"], layer.bias, live, self._log_scale(layer))

    def _merge_first(self, layer, selection, exact: bool) -> None:
        """Prefill phase 1: consolidate similar entries before any eviction (Appendix B, Table 3).

        At most the entries each row and head must shed merge, the most similar to their root
        first: merging never takes a row below its budget, and a row that fits is untouched.
        """
        live = layer.live()
        excess = (live.sum(-1) - layer.budget).clamp(min=0)  # [B, H_kv]
        ema = self._ema(layer, live)
        priority = self._priority(layer, selection, ema[1])
        is_protected = torch.isinf(priority) & (priority > 0)
        order = priority.masked_fill(~live, NEG_INF).argsort(dim=-1, descending=True, stable=True)
        ranks = torch.arange(order.shape[-1], device=order.device).expand_as(order)
        rank = torch.empty_like(order).scatter_(-1, order, ranks)
        unit = F.normalize(layer.keys.float(), dim=-1)
        batch, kv_heads, size = live.shape
        has_better = torch.zeros_like(live)
        step = max(1, CHUNK_ELEMENTS // (batch * kv_heads * size))
        for start in range(0, size, step):
            stop = min(size, start + step)
            sim = unit[:, :, start:stop] @ unit.transpose(-1, -2)  # [B, H_kv, c, S]
            better = (rank[:, :, None, :] < rank[:, :, start:stop, None]) & live[:, :, None, :]
            has_better[:, :, start:stop] = ((sim >= self.threshold) & better).any(-1)
        roots = live & (is_protected | ~has_better)
        movers = live & ~roots
        # Only movers look for a root: the second similarity pass is (movers x S), not S x S.
        src, is_mover = slots_of(movers, int(movers.sum(-1).max()))  # a host sync, once per prefill
        dst, sim = cosine_nearest(layer.keys, src, roots, slots_of(roots, int(roots.sum(-1).max()))[0])
        merge = is_mover & (sim >= self.threshold)
        by_similarity = sim.masked_fill(~merge, NEG_INF).argsort(dim=-1, descending=True, stable=True)
        sim_rank = torch.empty_like(by_similarity).scatter_(-1, by_similarity, ranks[..., : src.shape[-1]])
        merge &= sim_rank < excess[..., None]
        if not bool(merge.any()):
            return
        self.merge_entries(layer, src, dst, merge, exact, ema)
        merged = torch.zeros_like(live).scatter_(-1, src, merge)  # src slots are distinct
        layer.drop(merged)
        if exact:  # the merged keys changed: the query's exact logits of the new store
            logits = scaled_logits(layer.state["query"][:, :, :, None], layer.keys, layer.state["scaling"])[:, :, :, 0]
            layer.state["exact_logits"] = logits.masked_fill(~layer.live()[:, :, None], NEG_INF)

    @staticmethod
    def _priority(layer, selection, pooled: torch.Tensor | None) -> torch.Tensor:
        """The selection's ranking; KeepKV's own (``ema``) reads the pooled EMA computed here."""
        return selection.priority(layer, pooled) if isinstance(selection, EmaAttention) else selection.priority(layer)

    def _evict_and_merge(self, layer, selection, exact: bool) -> None:
        """Keep the budget by priority; merge each evicted entry into its most similar kept one (>= T)."""
        live = layer.live()
        # Another selection ranks by its own scores: the EMA is then read only if something merges.
        ema = self._ema(layer, live) if isinstance(selection, EmaAttention) else None
        plan = plan_eviction(layer, self._priority(layer, selection, None if ema is None else ema[1]))
        if plan.evict_idx.shape[-1] > 0:
            ema = self._ema(layer, live) if ema is None else ema  # the merge's votes and EMA need it
            dst, merge = self.targets(layer, plan)
            # Always run the merge, on every device: reading "does anything merge?" would be a
            # host sync, and an empty merge changes nothing, bit for bit. The gates weigh as
            # the merge does. An evicted slot's votes are not a merge's target: still readable.
            merged = self.merge_entries(layer, plan.evict_idx, dst, merge, exact, ema, gated=True)
            dropped = plan.evict_valid & ~merged
            lost = (layer.bias.gather(-1, plan.evict_idx).exp() * dropped).sum(-1)
            layer.state["lost_votes"] += lost
        if getattr(selection, "keeps_order", False):  # the pooled ranking needs slots in position order
            layer.select(plan.keep_idx, plan.keep_valid)
        else:
            layer.keep(plan.kept, plan.slots)

    def _compress_prefill(self, layer, selection, exact: bool) -> None:
        if self.prefill_order == "merge_first":
            self._merge_first(layer, selection, exact)
        self._evict_and_merge(layer, selection, exact)

    # -- periodic refresh --------------------------------------------------------------------
    def refresh(self, layer, selection) -> None:
        """Rebuild the layer's store from the full copy with the current query's exact scores.

        The store becomes every token seen (1 vote each), the EMA is re-initialised over the
        last ``window`` queries, and the prefill compression (``prefill_order``) runs with the
        exact logits of the newest query, so the rebuilt store is lossless for it on MHA.
        """
        keys, values, is_real = layer.state["offload"].load(layer.device)
        size = keys.shape[2]
        layer.reload(keys, values, is_real)
        layer.state["lost_votes"] = torch.zeros_like(layer.state["lost_votes"])
        self._absorb(layer, layer.state["query_window"], layer.state["query_window_pos"])
        if size > layer.min_budget:
            self._compress_prefill(layer, selection, exact=True)
        layer.state["refreshes"] += 1


@register
@dataclass
class KeepKV(ComposedMethod):
    """KeepKV (Tian et al., "KeepKV: Achieving Periodic Lossless KV Cache Compression for
    Efficient LLM Inference", arXiv 2504.09936).

    A selection plus KeepKV's merge (:class:`KeepKVMerge`: ZIP-merging with Electoral Votes, EMA
    scores, merge gates). What is kept is the selection's choice: the default is SnapKV's
    (``selection=snapkv``; docs/keepkv.md, "KeepKV ablation", says why); KeepKV's own is ``selection=ema``
    (:class:`EmaAttention`); the paper's runs select with PyramidInfer. Any registered selection
    pairs with it (``keepkv+selection=kvzip`` for a context compressed before its question).
    ``merge=none`` is the selection alone.

    The paper-literal configuration is
    ``keepkv+selection=ema+prefill_order=merge_first+protect=0+max_value_change=None``.
    """

    name = "keepkv"
    paper = "Tian et al. 2025, arXiv 2504.09936"
    selection: Selection = field(default_factory=ObservationWindow)
    merging: Merge = field(default_factory=KeepKVMerge)
