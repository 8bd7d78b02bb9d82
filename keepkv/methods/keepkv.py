"""KeepKV: ZIP-merging with Electoral Votes, EMA attention scores and periodic lossless refresh.

Two merges any selection can take and one selection, from KeepKV's paper:

- merge ``zip`` (:class:`ZipMerge`): every evicted entry ZIP-merged into its most similar kept
  entry, weighed by the current query's exact logits;
- merge ``keepkv`` (:class:`KeepKVMerge`): ZIP-merging whose decode-time weights are
  EMA-predicted attention scores (eq. 8), which it keeps per entry, with merge gates, the paper's
  merge-first prefill as an option and the periodic lossless refresh;
- selection ``ema`` (:class:`EmaAttention`): KeepKV's own ranking, by the EMA that merge
  ``keepkv`` keeps;

and the method ``keepkv`` (:class:`KeepKV`). The arithmetic is :mod:`keepkv.merging`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..attention import CHUNK_ELEMENTS, Needs, StepStats, scaled_logits, static_shapes
from ..kernels.ema import ema_fold
from ..kernels.protect import open_to_merges
from ..merging import (
    KEY_RULES, LogScores, cosine_nearest, ema_log_scores, pool_log_scores, zip_rows, zip_rows_with_ema,
)
from ..offload import FullKVCopy
from ..store import NEG_INF, slots_of
from .base import (
    ComposedMethod, EvictionPlan, Extra, Merge, ScoredSelection, Selection, check_choice, check_range, protected,
    register, register_merge, register_selection,
)
from .snapkv import ObservationWindow

SCORE_MODES = ("ema", "exact")
SCORE_NORMS = ("none", "row")
EMA_HEADS = ("pooled", "each")
PREFILL_ORDERS = ("merge_first", "evict_first")
SIMILARITIES = ("key", "key_value")


def merge_first_targets(
    keys: torch.Tensor, live: torch.Tensor, priority: torch.Tensor, protected: torch.Tensor, budget: torch.Tensor,
    threshold: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KeepKV's merge-first plan (Appendix B, Table 3): (src, dst, merge) [B, H_kv, E] of the entries
    that consolidate before any eviction.

    A root is a live entry that is ``protected`` or has no higher-``priority`` live entry at least
    ``threshold`` cosine-similar; every other live entry (a mover) may merge into its most similar
    root if that one is at least ``threshold`` similar. At most the entries each row and head must
    shed (live - ``budget`` [B, H_kv]) merge, the most similar first: merging never takes a row
    below its budget, and a row that fits is untouched. keys [B, H_kv, S, D]; live, priority,
    protected [B, H_kv, S]. One host sync (the most movers and roots of any row and head).
    """
    excess = (live.sum(-1) - budget).clamp(min=0)  # [B, H_kv]
    order = priority.masked_fill(~live, NEG_INF).argsort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, ranks)
    unit = F.normalize(keys.float(), dim=-1)
    batch, kv_heads, size = live.shape
    has_better = torch.zeros_like(live)
    step = max(1, CHUNK_ELEMENTS // (batch * kv_heads * size))
    for start in range(0, size, step):
        stop = min(size, start + step)
        sim = unit[:, :, start:stop] @ unit.transpose(-1, -2)  # [B, H_kv, c, S]
        better = (rank[:, :, None, :] < rank[:, :, start:stop, None]) & live[:, :, None, :]
        has_better[:, :, start:stop] = ((sim >= threshold) & better).any(-1)
    roots = live & (protected | ~has_better)
    movers = live & ~roots
    # Only movers look for a root: the second similarity pass is (movers x S), not S x S.
    src, is_mover = slots_of(movers, int(movers.sum(-1).max()))
    root_idx = slots_of(roots, int(roots.sum(-1).max()))[0]
    dst, sim = cosine_nearest(keys, src, roots, root_idx)
    merge = is_mover & (sim >= threshold)
    by_similarity = sim.masked_fill(~merge, NEG_INF).argsort(dim=-1, descending=True, stable=True)
    sim_rank = torch.empty_like(by_similarity).scatter_(-1, by_similarity, ranks[..., : src.shape[-1]])
    return src, dst, merge & (sim_rank < excess[..., None])


def _count_lost_votes(layer, plan: EvictionPlan, dropped: torch.Tensor) -> None:
    """Add the votes p of the plan's evicted entries where ``dropped`` [B, H_kv, E] (evicted, not
    merged) to ``layer.state["lost_votes"]`` [B, H_kv]."""
    votes, lost = layer.bias.gather(-1, plan.evict_idx).exp(), layer.state["lost_votes"]
    if votes.shape[-1] == 1:  # a decode step's one entry: lost += p · dropped, no sum to run
        lost.addcmul_(votes[..., 0], dropped[..., 0])
    else:
        lost += (votes * dropped).sum(-1)


def _counted(mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(mask [B, H_kv, E], the most True of any row and head): :func:`slots_of`'s arguments to
    keep every True slot. One host sync."""
    return mask, int(mask.sum(-1).max())


@register_merge
@dataclass(frozen=True)
class ZipMerge(Merge):
    """ZIP-merging with Electoral Votes (KeepKV eq. 7 / 25) of what a plan evicts, with the exact
    logits of the current query (the last prompt query at a prompt's end, the newest query while
    decoding), so each merge leaves that query's attention output unchanged on an MHA model
    (Theorem 3); then the plan's entries kept. KeepKV's paper says its merging "imposes no specific
    constraints on cache allocation or token selection" and combines it with H2O and PyramidInfer
    (its Figure 5): any selection takes it.

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
    protect_window : bool
        True: the selection's own protected entries (its sinks and window) take no merges either,
        so with ``protect=s`` merges go only into the lowest-ranked 1 - s of the scored kept
        entries, slots of their own, and every other kept entry is never altered. False: they
        may take merges.
    similarity : str
        Target rule: "key", the kept entry whose key is most cosine-similar (KeepKV, D2O);
        "key_value", the one most similar in key and value alike, by the mean of the two cosine
        similarities, which ``threshold`` then bounds (an entry whose value differs is not
        merged into, however similar its key).
    min_mass : float
        An evicted entry merges only if it carries at least this share in [0, 1] of its row and
        head's attention mass by the merge's weights, p_e ŝ_e / Σ_j p_j ŝ_j (else it is evicted).
        0: every evicted entry may merge.
    """

    name = "zip"
    keeps_prompt = True
    writes_bias = True  # Electoral Votes: ln p of each merged entry
    threshold: float = 0.8
    zip_key: str = "projection"
    protect: float = 0.0
    max_value_change: float | None = None
    max_share: float = 1.0
    protect_window: bool = False
    similarity: str = "key"
    min_mass: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        check_range("threshold", self.threshold, -1.0, 1.0)
        check_choice("similarity", self.similarity, SIMILARITIES)
        check_range("min_mass", self.min_mass, 0.0, 1.0)
        if self.zip_key not in KEY_RULES:
            raise ValueError(f"zip_key must be one of {', '.join(map(repr, KEY_RULES))}, got {self.zip_key!r}")
        check_range("protect", self.protect, 0.0, 1.0)
        check_range("max_share", self.max_share, 0.0, 1.0)
        if self.max_value_change is not None:
            check_range("max_value_change", self.max_value_change, 0.0, math.inf)

    def merge_candidates(self, layer, plan: EvictionPlan) -> torch.Tensor:
        """[B, H_kv, S] bool: the kept entries that may take merges: not the ``protect`` share of the
        kept scored entries, the selection's highest-ranked first, nor a kept prompt's. An evicted
        entry merges into the most cosine-similar of them if it is at least ``threshold`` similar;
        the value gate and the weight cap apply where the rows merge (:meth:`gates`)."""
        allowed = open_to_merges(plan.kept, plan.priority, self.protect) if self.protect > 0 else plan.kept
        if self.protect_window:
            allowed = allowed & torch.isfinite(plan.priority)  # the selection's sinks and window: +inf
        frozen = layer.frozen_entries()
        return allowed if frozen is None else allowed & ~frozen

    def nearest(self, layer, plan: EvictionPlan, candidates: torch.Tensor, candidate_idx: torch.Tensor | None = None,
                src: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(target slot, similarity) [B, H_kv, E] of each evicted entry (the plan's, or the slots
        ``src`` [B, H_kv, E]) among ``candidates`` (searched at ``candidate_idx`` [B, H_kv, K] if
        given, else at the plan's), by the ``similarity`` rule: the cosine of keys, or the mean of
        the cosines of keys and of values (the cosine of the unit key and unit value side by side)."""
        candidate_idx = plan.candidate_idx() if candidate_idx is None else candidate_idx
        src = plan.evict_idx if src is None else src
        if self.similarity == "key":
            return cosine_nearest(layer.keys, src, candidates, candidate_idx)
        both = torch.cat([F.normalize(layer.keys.float(), dim=-1), F.normalize(layer.values.float(), dim=-1)], -1)
        return cosine_nearest(both, src, candidates, candidate_idx)

    def worth_merging(self, layer, plan: EvictionPlan, pooled: torch.Tensor, merge: torch.Tensor) -> torch.Tensor:
        """``merge`` [B, H_kv, E] bool, less the evicted entries that carry under ``min_mass`` of
        their row and head's attention mass, ln p + ln ŝ (``pooled`` [B, H_kv, S]) normalised over
        the live entries (``merge`` itself when ``min_mass`` is 0)."""
        if self.min_mass <= 0:
            return merge
        mass = layer.bias + pooled  # -inf on every empty slot (its bias): the sum runs over the live ones
        share = mass.gather(-1, plan.evict_idx) - torch.logsumexp(mass, dim=-1, keepdim=True)
        return merge & (share >= math.log(self.min_mass))

    def gates(self) -> tuple[float, float]:
        """(ε, δ): the value gate and the weight cap as :func:`keepkv.merging.zip_rows` takes them."""
        return math.inf if self.max_value_change is None else self.max_value_change, self.max_share

    def needs(self, is_prefill: bool) -> Needs:
        # While decoding, the merges read the logits the attention computed.
        return Needs(logits=not is_prefill)

    def apply(self, layer, plan: EvictionPlan, stats: StepStats) -> None:
        if plan.evict_idx.shape[-1] > 0:
            candidates = self.merge_candidates(layer, plan)
            query = stats.query[:, :, :, -1]  # [B, H_kv, g, D]
            if stats.is_prefill:  # only the last query's row is needed, whatever rows the statistics hold
                logits = scaled_logits(query[:, :, :, None], layer.keys, stats.scaling)[:, :, :, 0]
            else:
                logits = stats.logits[:, :, :, -1]
            logits = logits.where(layer.live()[:, :, None], NEG_INF)
            pooled = pool_log_scores(logits, layer.bias)
            dst, similarity = self.nearest(layer, plan, candidates)
            merge = self.worth_merging(layer, plan, pooled, plan.evict_valid & (similarity >= self.threshold))
            layer.merge_into(zip_rows(
                layer.keys, layer.values, layer.bias, plan.evict_idx, dst, merge, logits, query, stats.scaling,
                self.zip_key, pooled, *self.gates(),
            ))
        layer.keep(plan.kept, plan.slots)


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
    layered = True
    served = True
    ranks_by_merge_scores = True
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
        if not merging.keeps_scores:
            return f"selection 'ema' ranks by the EMA that merge 'keepkv' keeps; merge {merging.name!r} keeps none"
        return None

    @property
    def keeps_order(self) -> bool:
        """The pooled ranking compares neighbouring slots: the kept entries stay in position order."""
        return self.kernel > 1

    def recent_count(self, budget: torch.Tensor) -> torch.Tensor:
        sinks = budget.clamp(max=self.sinks)
        return ((budget - sinks).double() * self.recent_ratio).round().long()

    def allocate(self, layers, kv_heads, row_budget, prompt_lengths, scores=None) -> torch.Tensor:
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

    def priority(self, layer, merge_scores: LogScores | None = None) -> torch.Tensor:
        """[B, H_kv, S]: +inf for sinks and recent, else the predicted attention mass ln p + ln ŝ,
        max-pooled over ``kernel`` neighbouring slots; ln ŝ: the EMA log-scores pooled over the
        group, as KeepKV's merge hands them (``merge_scores``, :meth:`KeepKVMerge.ranking_scores`)."""
        if merge_scores is None:
            raise ValueError("selection 'ema' ranks by the EMA that merge 'keepkv' keeps (pass its ranking_scores)")
        # Recent tokens are a share of the row's mean budget, alike in every layer (see allocate).
        recent = self.recent_count(layer.row_budget)[:, None].expand_as(layer.budget)
        mass = layer.bias + merge_scores.pooled
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
        As ZIP's (:class:`ZipMerge`; T = 0.8 as the paper's).
    protect, max_value_change, min_mass : float
        Merge gates of evict-then-merge; here 0.75, 1.0 and 0.001: the top 3/4 of the entries
        kept by score take no merges, the others move by at most their norm, and only an evicted
        entry with at least 0.1% of its row and head's attention mass merges (docs/keepkv.md,
        "Merge gates"). ``protect=0+max_value_change=None+min_mass=0``: the paper's merge.
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
        only), and compress it as a prompt's end with the exact logits of the newest query, so
        the rebuilt store is lossless for it on MHA. None: never, and no full copy is kept.
    ema_heads : str or None
        "pooled": one EMA word per entry and KV head, of the mean over the GQA group of each
        query's scores (with ``score_norm="none"``, the mean of the g per-head EMAs), so an entry
        costs one word whatever the group size. "each": one EMA per query head of the group
        (g words), pooled as merges read them (:func:`keepkv.merging.pool_log_scores`). The same
        on an MHA model (g = 1). None (default): "pooled", or "each" with ``zip_key="group"``,
        whose key rule weighs each query head by its own EMA.
    """

    name = "keepkv"
    served = True
    keeps_prompt = True
    keeps_scores = True
    protect: float = 0.75
    max_value_change: float | None = 1.0
    min_mass: float = 0.001
    alpha: float = 0.94
    window: int = 32
    score_norm: str = "none"
    scores: str = "ema"
    prefill_scores: str = "exact"
    prefill_order: str = "evict_first"
    refresh_interval: int | None = None
    ema_heads: str | None = None

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
        if self.ema_heads is not None:
            check_choice("ema_heads", self.ema_heads, EMA_HEADS)
        if self.ema_heads == "pooled" and self.zip_key == "group":
            raise ValueError("zip_key='group' weighs each query head by its own EMA: use it with ema_heads='each'")

    @property
    def pooled_ema(self) -> bool:
        """Whether the EMA is one word per entry and KV head (``ema_heads``)."""
        return self.ema_heads == "pooled" or (self.ema_heads is None and self.zip_key != "group")

    @property
    def reads_every_entry(self) -> bool:
        return self.score_norm == "row"  # each query's partition function, over every entry it sees

    def refusal(self, selection) -> str | None:
        if self.refresh_interval is not None and not selection.ranks_by_merge_scores:
            return "refresh_interval re-ranks entries by the EMA: use it with selection='ema'"
        return None

    def needs(self, is_prefill: bool) -> Needs:
        # While decoding, the EMA and the merges read the logits the attention computed; at prefill
        # the merge computes its window's logits itself.
        return Needs(logits=not is_prefill)

    def entry_extras(self, group: int) -> dict[str, Extra]:
        """The EMA (:meth:`observe`): ln S pooled over the group (one word), or per query head
        (``ema_heads="each"``). Its normaliser ln N is not stored: it follows from the entry's
        position (:meth:`ema_log_n`)."""
        return {"ema_log_s": Extra(NEG_INF, trailing=(self._ema_words(group),))}

    def _ema_words(self, group: int) -> int:
        """EMA words per entry and KV head: 1 pooled, ``group`` with ``ema_heads="each"``."""
        return 1 if self.pooled_ema else group

    # -- the EMA ----------------------------------------------------------------------------
    def observe(self, layer, stats: StepStats) -> None:
        """Fold the call's query rows into the EMA (at the prefill: the last ``window``, which start
        it); with ``refresh_interval``, keep the full copy and the query window a refresh reads."""
        query = stats.query  # [B, H_kv, g, q, D]
        rows = query.shape[3]
        if stats.is_prefill:
            self._start_layer(layer, query.shape[2], stats.scaling)
            window = min(self.window, rows)
            # the rows' logits, where the prompt's statistics hold them (a paged prompt's end)
            logits = None if stats.logits is None else stats.logits[:, :, :, -window:]
            self._update_ema(layer, query[:, :, :, -window:], layer.positions[:, 0, -window:], logits)
        else:
            self._update_ema(layer, query, layer.positions[:, 0, -rows:], stats.logits)
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

    def _start_layer(self, layer, group: int, scaling: float) -> None:
        batch, kv_heads = layer.bias.shape[:2]
        layer.add_extra("ema_log_s", fill=NEG_INF, trailing=(self._ema_words(group),))
        layer.state.pop("ema_span", None)
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

    def _update_ema(
        self, layer, queries: torch.Tensor, query_pos: torch.Tensor, logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Fold r query rows (oldest first) into the EMA (eq. 8); returns their logits.

        queries [B, H_kv, g, r, D]; query_pos [B, r] their positions (-1: padding, skipped);
        logits [B, H_kv, g, r, S]: their q·k·scaling against the layer's keys, if the attention
        computed them (else computed here). Row r' of r gets weight (1 - α) α^(r-1-r'); the old
        state decays by α^r. A row scores only the live entries at or before its position (causal,
        padding excluded); a kept prompt's entries stay unscored (``LayerStore.overwrite``). A slot
        that holds no entry may get anything: every reader masks it (:meth:`ranking_scores`), and an
        entry that takes the slot brings its own (an append: the fill).
        """
        rows = queries.shape[3]
        if logits is None:  # a prompt's end whose statistics hold none, or a refresh: computed here
            logits = scaled_logits(queries, layer.keys, layer.state["scaling"])  # [B, H_kv, g, r, S]
        visible_at = None  # a decode step: the newest query sees every live entry, and the bias hides the rest
        if rows > 1:
            # A row sees the entries at or before its position. Only live slots matter (see above),
            # and a padding row (position -1) sees none of them.
            visible_at = layer.positions
        scores = logits
        if self.score_norm == "row":
            # ln Z = ln Σ_j p_j s_j of each query row over what it sees: each query then counts
            # equally in the EMA, as in H2O's and SnapKV's sums of attention probabilities.
            seen = logits + layer.bias[:, :, None, None]  # -inf on empty slots
            if visible_at is not None:
                visible = visible_at[:, :, None, :] <= query_pos[:, None, :, None]  # [B, H_kv, r, S]
                seen = seen.masked_fill(~visible[:, :, None], NEG_INF)
            log_z = torch.logsumexp(seen, dim=-1).nan_to_num(0.0, 0.0, 0.0)  # [B, H_kv, g, r]; 0: nothing seen
            scores = logits - log_z[..., None]
            layer.state["log_z"] = log_z[..., -1]  # [B, H_kv, g]: the newest query's, see _log_scale
        # eq. 8 over the rows, one pass (keepkv.kernels.ema): ln S [B, H_kv, g', S], g' = 1 pooled
        ema_s = ema_fold(scores, layer.extras["ema_log_s"], visible_at, query_pos, self.alpha, self.pooled_ema)
        layer.overwrite(ema_log_s=ema_s.permute(0, 1, 3, 2))
        self._fold_span(layer, query_pos)
        return logits

    @staticmethod
    def _fold_span(layer, query_pos: torch.Tensor) -> None:
        """Record the positions of the query rows folded since the EMA (re)started, per row:
        ``layer.state["ema_span"]`` [B, 2] int64, the first and the newest (-1: none yet). The rows
        are folded oldest first and are consecutive positions, so this says which queries saw an
        entry (:meth:`ema_log_n`). query_pos [B, r], -1 on padding."""
        real = query_pos >= 0
        first = query_pos.masked_fill(~real, torch.iinfo(query_pos.dtype).max).amin(-1)
        newest = query_pos.amax(-1)  # -1 where every row is padding
        span = layer.state.get("ema_span")
        if span is not None:
            first, newest = torch.minimum(span[:, 0], first), torch.maximum(span[:, 1], newest)
        layer.state["ema_span"] = torch.stack([first, newest], dim=-1)

    def ema_log_n(self, layer) -> torch.Tensor:
        """[B, H_kv, S] ln N of every slot, N = Σ (1 - α) α^age over the queries that saw the entry
        (eq. 8 applied to a score of 1): the queries folded since the EMA started at or after its
        position, a of them, so N = 1 - α^a (-inf where none did; empty slots read garbage, which
        every reader masks). A merge target keeps its position, so its N too."""
        span = layer.state["ema_span"]
        first, newest = span[:, 0, None, None], span[:, 1, None, None]
        seen = (newest - torch.maximum(layer.positions, first) + 1).clamp_(min=0)  # a, [B, H_kv, S]
        return torch.log(-torch.expm1(seen * math.log(self.alpha)))

    def _log_scale(self, layer) -> torch.Tensor | float:
        """[B, H_kv, g] ln Z of the newest query with ``score_norm="row"`` (else 0): the EMA of
        normalised scores times it is on the logit scale of that query, as ZIP's key rule needs."""
        if self.score_norm != "row":
            return 0.0
        log_z = layer.state["log_z"]
        if self.pooled_ema:  # the group's shares on one scale: the geometric mean of the heads'
            log_z = log_z.mean(-1, keepdim=True)
        return log_z[..., None]

    def ranking_scores(self, layer) -> LogScores:
        """The EMA log-scores of the live entries, per query head and pooled over the group
        (:func:`keepkv.merging.ema_log_scores`): what selection ``ema`` ranks by and the merges
        weigh with."""
        log_scale = self._log_scale(layer)
        ema_s = layer.extras["ema_log_s"].permute(0, 1, 3, 2)
        scored = layer.live()
        frozen = layer.frozen_entries()
        if frozen is not None:  # a kept prompt's entries are unscored (their EMA stays at its fill): no mass of theirs
            scored = scored & ~frozen
        return ema_log_scores(ema_s, self.ema_log_n(layer), layer.bias, scored, log_scale)

    # -- compression -------------------------------------------------------------------------
    def _exact(self, stats: StepStats) -> bool:
        """Whether merges weigh with the newest query's exact logits: as ``prefill_scores`` says at a
        prompt's end and ``scores`` while decoding; always after a refresh, whose statistics hold
        the logits of the layer it rebuilt."""
        if stats.is_prefill:
            return stats.rebuilt or self.prefill_scores == "exact"
        return self.scores == "exact"

    def merge_weights(self, layer, ema: LogScores, stats: StepStats) -> LogScores:
        """The log-scores a merge weighs with (:meth:`_exact`): the EMA's ``ema``, or the newest
        query's exact logits over the live entries, per query head and pooled over the group."""
        if not self._exact(stats):
            return ema
        if not stats.is_prefill:
            logits = stats.logits[:, :, :, -1]
        else:  # a prompt's end (or a refresh): the last query's row alone, whatever rows the EMA read
            logits = scaled_logits(stats.query[:, :, :, -1:], layer.keys, stats.scaling)[:, :, :, 0]
        heads = logits.where(layer.live()[:, :, None], NEG_INF)
        return LogScores(heads, pool_log_scores(heads, layer.bias))

    def merge_before_eviction(self, layer, plan: EvictionPlan, stats: StepStats) -> StepStats | None:
        """The paper's merge-first prefill (``prefill_order="merge_first"``): similar entries
        consolidate into their roots before any eviction (:func:`keepkv.merging.merge_first_targets`);
        returns the statistics of the changed layer, None when nothing merged."""
        if not stats.is_prefill or self.prefill_order != "merge_first":
            return None
        live = layer.live()
        src, dst, merge = merge_first_targets(layer.keys, live, plan.priority, plan.protected, layer.budget,
                                              self.threshold)
        if not bool(merge.any()):
            return None
        log_scale, ema = self._log_scale(layer), plan.merge_scores
        weights = self.merge_weights(layer, ema, stats)
        rows = zip_rows_with_ema(
            layer.keys, layer.values, layer.bias, self.ema_log_n(layer), src, dst, merge, weights, ema.heads,
            stats.query[:, :, :, -1].contiguous(), stats.scaling, self.zip_key, log_scale,
        )
        layer.merge_into(rows)
        layer.drop(torch.zeros_like(live).scatter_(-1, src, merge))  # src slots are distinct
        query = stats.query[:, :, :, -1:]
        if not self._exact(stats):
            return StepStats(query=query, scaling=stats.scaling, is_prefill=True, rebuilt=stats.rebuilt)
        # the merged keys changed: the query's exact logits over the new store
        logits = scaled_logits(query.contiguous(), layer.keys, stats.scaling)
        return StepStats(query=query, scaling=stats.scaling, is_prefill=True, logits=logits, rebuilt=stats.rebuilt)

    def apply(self, layer, plan: EvictionPlan, stats: StepStats) -> None:
        """Merge each evicted entry into its most similar kept one (>= ``threshold``, gated), count
        the votes of those dropped (``layer.state["lost_votes"]``), then keep the plan's entries.

        Where a host read costs nothing (a prompt's end, one compression of many entries; and a
        decode step that need not keep static shapes, :func:`keepkv.attention.static_shapes`: on
        CPU outside ``torch.compile``) the evicted entries that carry enough mass are compared
        with the merge candidates only, and only those that merge go through ZIP: the result is
        the same, bit for bit. Elsewhere (a decode step on CUDA, or compiled) every evicted entry
        goes through the merge with static shapes, with no host read: an empty merge changes
        nothing."""
        if plan.evict_idx.shape[-1] > 0:
            log_scale, ema = self._log_scale(layer), plan.merge_scores
            candidates = self.merge_candidates(layer, plan)
            candidate_idx = plan.candidate_idx()
            if stats.is_prefill:
                count = int(candidates.sum(-1).max())
                candidate_idx = slots_of(candidates, count)[0] if count > 0 else None
            if not stats.is_prefill or candidate_idx is not None:
                self._merge(layer, plan, stats, candidates, candidate_idx, ema, log_scale)
        if plan.keeps_order:  # the selection's pooled ranking needs slots in position order
            layer.select(plan.keep_idx, plan.keep_valid)
        else:
            layer.keep(plan.kept, plan.slots)

    def _merge(self, layer, plan: EvictionPlan, stats: StepStats, candidates: torch.Tensor,
               candidate_idx: torch.Tensor | None, ema: LogScores, log_scale) -> None:
        """ZIP-merge the plan's evicted entries into ``candidates`` (see :meth:`apply`). The gates weigh
        as the merge does. An evicted slot is no merge's target: its votes read the same after."""
        weights = self.merge_weights(layer, ema, stats)
        if stats.is_prefill or not static_shapes(stats, layer.keys):
            # Only the entries that may merge (enough mass) are compared with the candidates, and
            # only those that do (similar enough) go through ZIP: the result is the same.
            order, eligible = slots_of(*_counted(self.worth_merging(layer, plan, weights.pooled, plan.evict_valid)))
            dst, similarity = self.nearest(layer, plan, candidates, candidate_idx, plan.evict_idx.gather(-1, order))
            within, merge = slots_of(*_counted(eligible & (similarity >= self.threshold)))
            order, dst = order.gather(-1, within), dst.gather(-1, within)
            src = plan.evict_idx.gather(-1, order)
        else:
            order = None
            dst, similarity = self.nearest(layer, plan, candidates, candidate_idx)
            src = plan.evict_idx
            merge = self.worth_merging(layer, plan, weights.pooled, plan.evict_valid & (similarity >= self.threshold))
        if merge.shape[-1] == 0:  # nothing merges: every evicted entry's votes are lost
            _count_lost_votes(layer, plan, plan.evict_valid)
            return
        rows = zip_rows_with_ema(
            layer.keys, layer.values, layer.bias, self.ema_log_n(layer), src, dst, merge, weights,
            ema.heads, stats.query[:, :, :, -1].contiguous(), stats.scaling, self.zip_key, log_scale, *self.gates(),
        )
        merged = rows.merge if order is None else torch.zeros_like(plan.evict_valid).scatter_(-1, order, rows.merge)
        _count_lost_votes(layer, plan, plan.evict_valid ^ merged)  # evict_valid & ~merged: only a valid entry merges
        layer.merge_into(rows)

    # -- periodic refresh --------------------------------------------------------------------
    def refresh(self, layer, stats: StepStats) -> StepStats | None:
        """Every ``refresh_interval`` decode steps: the layer's entries become every token seen (1 vote
        each, from the full copy) and the EMA starts again over the last ``window`` queries; returns
        their statistics, with their exact logits, for the compression that follows."""
        if self.refresh_interval is None or stats.is_prefill or layer.budget is None:
            return None
        rows, steps = stats.query.shape[3], layer.state["steps"]
        if steps // self.refresh_interval <= (steps - rows) // self.refresh_interval:
            return None
        keys, values, is_real = layer.state["offload"].load(layer.device)
        layer.reload(keys, values, is_real)
        layer.state["lost_votes"] = torch.zeros_like(layer.state["lost_votes"])
        layer.state["refreshes"] += 1
        layer.state.pop("ema_span", None)  # the EMA starts again
        window = layer.state["query_window"]
        logits = self._update_ema(layer, window, layer.state["query_window_pos"])
        return StepStats(query=window, scaling=layer.state["scaling"], is_prefill=True, logits=logits, rebuilt=True)


@register
@dataclass
class KeepKV(ComposedMethod):
    """KeepKV (Tian et al., "KeepKV: Achieving Periodic Lossless KV Cache Compression for
    Efficient LLM Inference", arXiv 2504.09936).

    A selection plus KeepKV's merge (:class:`KeepKVMerge`: ZIP-merging with Electoral Votes, EMA
    scores, merge gates). What is kept is the selection's choice: SnapKV's by default
    (``selection=snapkv``), and KVzip's for a context compressed before its question is seen
    (:func:`keepkv.compress`, the eval's agnostic setting; ``compress_once_selection``): the best
    measured selection of each setting (docs/keepkv.md, "Measured choices"). KeepKV's own is
    ``selection=ema`` (:class:`EmaAttention`); the paper's runs select with PyramidInfer. Any
    registered selection pairs with it. ``merge=none`` is the selection alone.

    The paper-literal configuration is
    ``keepkv+selection=ema+prefill_order=merge_first+protect=0+max_value_change=None+min_mass=0``.
    """

    name = "keepkv"
    paper = "Tian et al. 2025, arXiv 2504.09936"
    compress_once_selection = "kvzip"
    selection: Selection = field(default_factory=ObservationWindow)
    merging: Merge = field(default_factory=KeepKVMerge)
