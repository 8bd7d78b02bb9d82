"""CaM: value-only cache merging of tokens that leave the local window."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..attention import Needs
from ..merging import spread_values_rows
from .base import ComposedMethod, Merge, Selection, check_range, register, register_merge, register_selection

_MASK32 = 0xFFFFFFFF
# Floats per batch row in one chunk of spread shares (evicted entries × m successors × head dim).
SPREAD_CHUNK_ELEMENTS = 1 << 24


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (int64 tensors holding values in [0, 2^32)); products stay below 2^63."""
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def keyed_uniform(seed: int, layer_idx: int, positions: torch.Tensor) -> torch.Tensor:
    """Reproducible uniforms in [0, 1), one per (seed, layer, KV head, token position).

    positions [B, H_kv, E] int64. The draw depends on nothing else (not on the batch, the row's
    slot in it, the device or earlier draws), so a row draws the same numbers alone or in a
    batch, and every token is drawn for once, when it leaves the window.
    """
    heads = torch.arange(positions.shape[1], device=positions.device).view(1, -1, 1)
    x = _mix32(torch.full_like(positions, seed & _MASK32))
    x = _mix32(x ^ (layer_idx & _MASK32))
    x = _mix32(x ^ heads)
    x = _mix32(x ^ (positions & _MASK32))
    return (x >> 8).float() / float(1 << 24)  # 24 bits: exact in fp32


@register_selection
@dataclass(frozen=True)
class StartAndRecent(Selection):
    """CaM's selection: the leading ``start_ratio`` of the budget, then the newest tokens.

    Parameters
    ----------
    start_ratio : float
        Share of the budget kept as the leading tokens, in [0, 1] (code: start_ratio =
        recent_ratio = 0.1 of the prompt, so 0.5).
    """

    name = "cam"
    start_ratio: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        check_range("start_ratio", self.start_ratio, 0.0, 1.0)

    def priority(self, layer, merge_scores=None) -> torch.Tensor:
        """[B, H_kv, S]: the leading ``start_ratio`` of the budget (+inf), then the newest."""
        start = (layer.budget.double() * self.start_ratio).round().long()  # [B, H_kv]
        positions = layer.positions
        is_start = layer.live() & (positions >= 0) & (positions < start[..., None])
        return positions.float().masked_fill(is_start, math.inf)


@register_merge
@dataclass(frozen=True)
class SpreadMerge(Merge):
    """CaM's merge of a plan (see :class:`CaM`): an evicted entry of the local window spreads v/m
    over the next m kept values with probability clamp(a_e / mean(a_window), 0, 1), drawn by
    :func:`keyed_uniform`; the kept entries are then gathered in position order. At the end of the
    prefill it merges only with ``prefill_merge``.

    Parameters
    ----------
    merge_count : int
        m, the kept successors each merged value is spread over (code: 32).
    seed : int
        Seed of the Bernoulli draws; a run is reproducible for a given seed.
    prefill_merge : bool
        Also merge the prompt tokens evicted at the end of prefill (see :class:`CaM`).
    """

    name = "spread"
    per_layer = True  # its draws are keyed by the layer (keyed_uniform)
    merge_count: int = 32
    seed: int = 0
    prefill_merge: bool = False

    def __post_init__(self):
        super().__post_init__()
        check_range("merge_count", self.merge_count, 1, math.inf)  # types: check_field_types

    def needs(self, is_prefill: bool) -> Needs:
        if is_prefill:
            return Needs(window=1) if self.prefill_merge else Needs()
        return Needs(probs=True)

    def apply(self, layer, plan, stats) -> None:
        if stats.is_prefill and not self.prefill_merge:
            layer.select(plan.keep_idx, plan.keep_valid)
            return
        kept = plan.kept
        is_start = plan.priority == math.inf
        probs = stats.window_probs if stats.is_prefill else stats.probs
        attention = probs[:, :, :, -1].float().mean(2)  # [B, H_kv, S], the newest query
        window = kept & ~is_start
        reference = (attention * window).sum(-1) / window.sum(-1).clamp_min(1)  # mean over the window
        ratio = attention.gather(-1, plan.evict_idx) / reference[..., None]
        probability = ratio.nan_to_num(nan=0.0, posinf=1.0).clamp(0.0, 1.0)
        draw = keyed_uniform(self.seed, layer.layer_idx, layer.positions.gather(-1, plan.evict_idx))
        merge = plan.evict_valid & (draw < probability)

        # The next m kept entries after each evicted one (kept entries are in position order).
        kept_before = kept.long().cumsum(-1).gather(-1, plan.evict_idx)  # kept entries before it
        successor_rank = kept_before[..., None] + torch.arange(self.merge_count, device=kept.device)
        exists = successor_rank < plan.keep_valid.sum(-1)[..., None, None]
        rank_index = successor_rank.clamp(max=plan.keep_idx.shape[-1] - 1).flatten(-2)
        successors = plan.keep_idx.gather(-1, rank_index).view_as(successor_rank).where(exists, -1)
        # Sources (evicted) and receivers (kept) are disjoint, so chunks of sources add up exactly;
        # the chunk does not depend on the batch size, so a row adds its shares in the same order
        # alone or in a batch.
        _, kv_heads, _, head_dim = layer.values.shape
        chunk = max(1, SPREAD_CHUNK_ELEMENTS // (kv_heads * self.merge_count * head_dim))
        for i in range(0, merge.shape[-1], chunk):
            part = slice(i, i + chunk)
            layer.merge_into(
                spread_values_rows(
                    layer.values, plan.evict_idx[..., part], merge[..., part], self.merge_count, successors[..., part, :]
                )
            )
        layer.select(plan.keep_idx, plan.keep_valid)


@register
@dataclass
class CaM(ComposedMethod):
    """CaM (Zhang et al., "CaM: Cache Merging for Memory-efficient LLMs Inference", ICML 2024).

    Keeps the first ``start_ratio`` of the budget (leading tokens) and the newest rest (the
    local window). A token that leaves the window during decoding is merged with probability
    clamp(a_e / mean(a_recent), 0, 1), a the attention of the step's query (averaged over the
    GQA group; the ratio is the same for a sum) and a_recent that of the window's kept tokens;
    on success v_e / m is added to each of the next ``merge_count`` = m kept values (shares
    beyond the kept tokens are dropped, as in CaM). Keys are never modified.

    The authors' repository has three variants; this follows ``cam_hf/utils_hh/modify_llama_cam.py``
    (generation): the current query's attention, the mean over the rest of the recent window as
    the reference, a fixed m = 32, start/recent budgets of 0.1 of the prompt each (half the
    budget each here), and no merging of the prompt tokens evicted right after prefill (that
    code masks them from the next step on and merges only tokens leaving the window while
    decoding). The other two: ``cam_hf/utils_lm_eval/modify_llama_cam.py`` (scoring; it merges
    every prompt token in turn as it leaves the window, with query-averaged attention, the *max*
    over start + window as the reference and m = the window size, so merged mass cascades
    through later tokens) and ``generate_task/streaming_llm/kv_cache_cam.py`` (streaming;
    accumulated attention, the mean over the next 16 tokens, m = 16).

    ``prefill_merge=True`` also merges the prompt tokens evicted at the end of prefill, in one
    batched step, with the last prompt query's attention: each spreads over the next m *kept*
    values, i.e. the start of the window, with no cascade. This matches none of the three
    variants exactly and piles the evicted mass onto the window's first m values (docs/methods.md
    has the measured error), hence off by default. Several tokens leaving at once while decoding
    (``interval`` > 1) are spread in one step too.

    The Bernoulli draws use a counter-based generator keyed by (``seed``, layer, KV head, token
    position) instead of a torch.Generator: a generator's stream depends on the batch layout
    and the order of calls, so a row would merge differently in a batch than alone.

    Selection ``cam`` (:class:`StartAndRecent`), merge ``spread`` (:class:`SpreadMerge`).
    """

    name = "cam"
    paper = "Zhang et al. 2024, ICML (openreview LCTmppB165)"
    selection: Selection = field(default_factory=StartAndRecent)
    merging: Merge = field(default_factory=SpreadMerge)
