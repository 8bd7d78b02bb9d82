"""KVzip: entries ranked by how much the model needs them to repeat the prompt."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..attention import Needs, Reconstruction
from ..store import NEG_INF
from .base import (
    ComposedMethod, Merge, ScoredSelection, Selection, check_choice, check_range, generated_recent_count,
    note_prompt_end, protected, register, register_selection,
)

BUDGETS = ("layers", "global", "heads", "uniform")


@register_selection
@dataclass(frozen=True)
class ContextReconstruction(ScoredSelection):
    """KVzip's selection: after the prompt is prefilled, the model reads "Repeat the previous
    context exactly." and the prompt's own tokens, teacher-forced (:mod:`keepkv.reconstruction`).
    An entry's score is the largest attention probability any of those queries gave it, maxed over
    the query heads of its KV group; the highest-scoring entries are kept, and the pass's own keys
    and values are discarded. The score needs no question, so one compressed context serves any
    question asked later.

    While decoding, a new entry's score is the largest probability a decode query gives it, and the
    old scores rise the same way (the same max, over the queries that follow the prompt). Such a
    score rarely reaches those the pass gave the prompt, so the newest ``window`` generated tokens
    are kept whatever their scores (not the paper's: it compresses once, before decoding).

    Parameters
    ----------
    sinks : int
        Leading tokens always kept (4, as kvpress's KVzipPress).
    window : int
        While decoding under the budget, the newest generated tokens always kept, up to this many
        (capped by what the sinks leave of each head's budget). The prompt's own compression
        protects none, so the window does not count in ``protected_entries()`` (the budget floor).
        0: the paper's rule, every entry by its score.
    chunk : int
        Tokens the pass repeats per block (the paper: 2000): the cache holds the prompt plus one
        block during the pass.
    share : float
        Share of the prompt's tokens the pass repeats, in (0, 1]. 1: the paper's full pass; less is
        a cheaper pass over runs of 16 tokens at an even stride, about that share of them
        (docs/methods.md, "KVzip", has what it loses).
    budgets : str
        How the budget is split over layers and KV heads (the mean is the budget in every case).
        "layers" (default): every head of a layer keeps as many entries, the layers' sizes set by
        one top-k over their slots (a layer's k-th slot is worth the k-th highest score of whichever
        of its heads has the highest), so the cache's memory is the budget (docs/methods.md,
        "KVzip", compares the splits). "global" (the paper's non-uniform budgets, kvpress's default
        ``layerwise=False``): one top-k over every layer and KV head, each keeping as many entries
        as it has among the row's highest scores. "heads": one top-k over each layer's heads.
        "uniform": every layer and head keeps the budget. A layer's tensors are as long as its
        largest head's budget, so ragged heads ("global", "heads") hold empty slots: their memory
        exceeds the budget by them (reported).
    """

    name = "kvzip"
    scored = True
    layered = True
    sinks: int = 4
    window: int = 32
    chunk: int = 2048
    share: float = 1.0
    budgets: str = "layers"

    def __post_init__(self):
        super().__post_init__()
        check_range("window", self.window, 0, math.inf)
        check_range("chunk", self.chunk, 1, math.inf)
        check_range("share", self.share, 0.0, 1.0, low_open=True)
        check_choice("budgets", self.budgets, BUDGETS)

    def _reconstruction(self) -> Reconstruction:
        """The pass that scores the prompt."""
        return Reconstruction(self.chunk, self.share)

    @property
    def allocates_from_all_layers(self) -> bool:
        return self.budgets != "uniform"

    def needs(self, is_prefill):
        return Needs(reconstruct=(self._reconstruction(),)) if is_prefill else Needs(probs=True)

    def observe(self, layer, stats):
        if stats.is_prefill:
            layer.overwrite(score=stats.reconstructed[self._reconstruction()].amax(2))  # [B, H_kv, S]
            note_prompt_end(layer)
        else:
            found = stats.probs.amax(dim=(2, 3))  # [B, H_kv, S] over the group and the block's queries
            layer.overwrite(score=torch.maximum(layer.extras["score"], found))

    def priority(self, layer, merge_scores=None) -> torch.Tensor:
        """[B, H_kv, S]: +inf for the sinks and the decoding window, else the score."""
        is_protected = protected(layer, self.sinks, generated_recent_count(layer, self.window))
        return layer.extras["score"].masked_fill(is_protected, float("inf"))

    def allocation_scores(self, layer) -> torch.Tensor:
        """[B, H_kv, S] the pass's scores, -inf on empty slots."""
        return layer.extras["score"].masked_fill(~layer.live(), NEG_INF)

    def allocate(self, layers, kv_heads, row_budget, prompt_lengths, scores=None):
        """Budgets [L, B, H_kv] whose mean is each row's budget, drawn from the pass's scores:
        the entries of the row's highest scores (one top-k over every layer and head, or, for
        "heads", over each layer's heads) are counted per layer and head ("global", "heads") or per
        layer and spread evenly over its heads ("layers"); the sinks count first."""
        uniform = super().allocate(layers, kv_heads, row_budget, prompt_lengths, scores)
        if self.budgets == "uniform" or scores is None:
            return uniform
        # [L, B, H_kv, S] scores, sinks first (always kept), empty slots last (never counted)
        scores = torch.stack(scores)
        live = scores > NEG_INF
        sink = live & (live.long().cumsum(-1) <= self.sinks)
        scores = scores.masked_fill(sink, math.inf)
        batch, size = scores.shape[1], scores.shape[-1]
        if self.budgets == "layers":
            # A layer holds as many slots per head as its fullest head needs, so the same slots serve
            # every head: its k-th slot is worth the k-th highest score of whichever head has the
            # highest, and one top-k over the layers' slots sets every layer's size.
            slot_values = scores.sort(dim=-1, descending=True).values.amax(2)  # [L, B, S]
            flat = slot_values.permute(1, 0, 2).reshape(batch, -1)[None]  # [1, B, L·S]
            totals = torch.minimum(uniform.sum((0, 2))[None] // kv_heads, (flat > NEG_INF).sum(-1))
            most = int(totals.max())
            top = flat.topk(most, dim=-1).indices
            chosen = torch.zeros_like(flat, dtype=torch.bool).scatter_(
                -1, top, torch.arange(most, device=flat.device) < totals[..., None]
            )
            per_layer = chosen.view(batch, layers, size).sum(-1).t()  # [L, B]
            return per_layer[..., None].expand(-1, -1, kv_heads).clamp(min=1)
        if self.budgets == "heads":  # each layer's total over its heads: its uniform total
            flat = scores.reshape(layers, batch, -1)  # [L, B, H_kv·S]
            totals = uniform.sum(-1)  # [L, B]
        else:
            flat = scores.permute(1, 0, 2, 3).reshape(batch, -1)[None]  # [1, B, L·H_kv·S]
            totals = uniform.sum((0, 2))[None]  # [1, B]
        totals = torch.minimum(totals, (flat > NEG_INF).sum(-1))
        most = int(totals.max())
        top = flat.topk(most, dim=-1).indices  # [., B, most]
        chosen = torch.zeros_like(flat, dtype=torch.bool).scatter_(
            -1, top, torch.arange(most, device=flat.device) < totals[..., None]
        )
        if self.budgets == "heads":
            counts = chosen.view(layers, batch, kv_heads, size).sum(-1)
        else:
            counts = chosen.view(batch, layers, kv_heads, size).sum(-1).permute(1, 0, 2)  # [L, B, H_kv]
        return counts.clamp(min=1)


@register
@dataclass
class KVzip(ComposedMethod):
    """KVzip (Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
    arXiv 2505.23416).

    Selection ``kvzip`` (:class:`ContextReconstruction`: the largest attention each entry gets
    while the model repeats the prompt), merge ``none`` (evict, the paper's). Compress a context
    once, before any question (:func:`keepkv.compress`), and ask it many.
    """

    name = "kvzip"
    paper = "Kim et al. 2025, arXiv 2505.23416"
    not_served = ("its reconstruction pass is a second prefill the engine does not schedule (docs/serving.md, "
                  "'KVzip'); serve keydiff for a context compressed before its questions")
    selection: Selection = field(default_factory=ContextReconstruction)
    merging: Merge = field(default_factory=Merge)
