"""Learned selection: KVzip's scores predicted from each entry's key and value, with no second pass
(KVzap, arXiv 2601.07891).

A selection, paired with any method's merge: ``snapkv+selection=learned`` evicts what it does not
keep, ``keepkv+selection=learned`` ZIP-merges it (KeepKV's merge), ``+scorer=PATH`` names the
scorer file.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..scorer import cached_scorer, check_key, config_key, default_scorer
from ..store import NEG_INF
from .base import (
    ScoredSelection, check_choice, check_range, generated_recent_count, note_prompt_end, prompt_tail, protected,
    register_selection,
)
from .kvzip import BUDGETS, ContextReconstruction

LEARNED_BUDGETS = (*BUDGETS, "trained")
# Predicted log scores are ranked at this resolution (nats). Entries of one token in the first layer
# differ only by how their rotary pairs' norms round (about 1e-7), which a serving engine's kernels
# round otherwise than the Hugging Face path; rounded, they tie, and ties rank by slot on every path.
SCORE_STEP = 2.0**-8


@register_selection
@dataclass(frozen=True)
class LearnedScores(ScoredSelection):
    """KVzap's selection (arXiv 2601.07891): a scorer trained on KVzip's scores
    (:mod:`keepkv.scorer`, :func:`keepkv.scorer_training.train_scorer`) predicts each entry's log
    score from its key (the RoPE-invariant norms of its rotary pairs and its log norm) and its value,
    per layer and KV head; the highest predicted entries are kept. The score of an entry is a
    function of that entry alone: no attention statistics, no question and no reconstruction pass,
    so a prompt compresses at a prefill's cost, chunk by chunk as it is read with the default
    ``budgets="trained"`` (layer budgets from the prompt's length alone). Scores are computed from
    the stored entries whenever the layer is planned.

    While decoding, new entries are scored the same way, and the newest ``window`` generated tokens
    are kept whatever their scores (as ``kvzip``'s).

    Parameters
    ----------
    scorer : str or None
        Path of a scorer file (:meth:`keepkv.scorer.Scorer.save`). None: the scorer shipped for the
        embedded model (SmolLM2-135M-Instruct, :func:`keepkv.scorer.default_scorer`). A scorer
        trained on another model is refused in one line where the cache is built
        (:meth:`check_model`): ``keepkv train-scorer`` trains one for any supported model.
    sinks : int
        Leading tokens always kept (4, as ``kvzip``).
    window : int
        While decoding under the budget, the newest generated tokens always kept, up to this many
        (capped by what the sinks leave). 0: scores alone.
    prompt_window : int
        The prompt's last tokens always kept, at its compression and while decoding, up to this
        many (capped by what the sinks and ``window`` leave): a question inside the prompt, and the
        chat template's turn that follows it, which an entry's own key and value do not mark as
        needed. With ``budgets="trained"`` every layer keeps room for it and the sinks before the
        shares split the rest. 2 (default: the dev grid's best, docs/methods.md), 0: none (the
        scores alone rank the prompt's entries).
    first_head : int
        The model's KV head that the cache's head 0 is: 0, or a tensor-parallel rank's first (the
        paged adapter sets it from :func:`keepkv.paged.rank_config`; :meth:`for_heads`).
    budgets : str
        How the budget is split over layers and KV heads, as ``kvzip``'s, from the predicted scores:
        "trained" (default: each layer keeps the share of the budget that the "layers" split gives
        it on typical documents, measured when the scorer was trained,
        :attr:`keepkv.scorer.Scorer.layer_shares`; on the dev grid as good as "layers", in less
        memory, docs/methods.md), "layers" (kvzip's: every head of a layer keeps as many entries,
        the layers sized by one top-k over their slots), "global", "heads", or "uniform" (every
        layer and head keeps the budget; far worse on the dev grid).
        "uniform" and "trained" depend on the prompt's length alone: each layer is compressed as its
        own prefill ends, chunk by chunk when read in chunks, and a serving engine runs them. The
        others compress every layer at once, after the last one's prefill.
    """

    name = "learned"
    served = True  # the paged adapter gathers the keys, values and positions it scores ("uniform", "trained")
    per_model_head = True  # one scorer per KV head of the model
    # Per layer too, but a store of several layers' rows names each row's (LayerStore.row_layers),
    # so the paged step compresses a step's layers as one batch.
    scores_alone = True  # a prompt read in chunks is compressed chunk by chunk ("uniform", "trained")
    sinks: int = 4
    window: int = 32
    prompt_window: int = 2
    scorer: str | None = None
    budgets: str = "trained"
    first_head: int = 0

    def __post_init__(self):
        super().__post_init__()
        check_range("window", self.window, 0, math.inf)
        check_range("prompt_window", self.prompt_window, 0, math.inf)
        check_choice("budgets", self.budgets, LEARNED_BUDGETS)
        check_range("first_head", self.first_head, 0, math.inf)
        if self.scorer is not None:
            cached_scorer(self.scorer)  # a missing or unreadable file is refused where the method is built

    @property
    def allocates_from_all_layers(self) -> bool:
        return self.budgets not in ("uniform", "trained")

    @property
    def layered(self) -> bool:
        """Layer budgets of their own, split from the predictions, unless ``budgets="uniform"``."""
        return self.budgets != "uniform"

    def allocation_scores(self, layer) -> torch.Tensor:
        """[B, H_kv, S] the predicted log scores, -inf on empty slots."""
        return self.scores(layer).masked_fill(~layer.live(), NEG_INF)

    def allocate(self, layers, kv_heads, row_budget, prompt_lengths, scores=None):
        """Budgets [L, B, H_kv] whose mean is each row's budget, split as ``kvzip``'s are
        (:meth:`keepkv.methods.kvzip.ContextReconstruction.allocate`) from the predicted scores;
        with ``budgets="trained"``, by the scorer's layer shares at the row's budget as a fraction of
        its prompt (:meth:`keepkv.scorer.Scorer.shares_at`): a function of the lengths alone. With a
        ``prompt_window``, every layer first keeps room for its sinks and that window, and the
        shares split the rest."""
        if self.budgets == "trained":
            fraction = row_budget.double() / torch.as_tensor(prompt_lengths, device=row_budget.device).double().clamp(min=1)
            shares = self._scorer().shares_at(fraction).to(row_budget.device)  # [B, L]
            if shares.shape[1] != layers:
                raise ValueError(f"learned: the scorer's layer shares are for {shares.shape[1]} layers, not {layers}: "
                                 "train one for this model with `keepkv train-scorer`")
            # Each layer keeps its sinks and the prompt's last tokens (prompt_window), then its share of the rest.
            reserve = row_budget.double().clamp(max=self.sinks + self.prompt_window if self.prompt_window else 0)
            per_layer = (reserve[:, None] + (row_budget.double() - reserve)[:, None] * shares).t()  # [L, B]
            cumulative = per_layer.cumsum(0).round()  # rounded so that the layers' total is the rows'
            budgets = torch.diff(cumulative, dim=0, prepend=torch.zeros_like(cumulative[:1])).long().clamp(min=1)
            return budgets[:, :, None].expand(layers, -1, kv_heads).clone()
        split = ContextReconstruction(sinks=self.sinks, budgets=self.budgets)
        return split.allocate(layers, kv_heads, row_budget, prompt_lengths, scores)

    def observe(self, layer, stats):
        if stats.is_prefill:
            note_prompt_end(layer)

    def _scorer(self):
        return cached_scorer(self.scorer if self.scorer is not None else default_scorer())

    def check_model(self, config) -> None:
        """ValueError, in one line, unless its scorer was trained on a model of ``config``: the
        shipped one is the embedded model's; any other model needs ``keepkv train-scorer``."""
        if self.scorer is None and not default_scorer().is_file():
            raise ValueError(f"learned: the shipped scorer is missing ({default_scorer()}): reinstall keepkv, or "
                             "train one with `keepkv train-scorer` and pass scorer=PATH")
        where = (f"the scorer {self.scorer!r}" if self.scorer is not None
                 else "the shipped scorer (the embedded SmolLM2-135M-Instruct's)")
        check_key(self._scorer().key, config_key(config), f"learned: {where}")
        if self.budgets == "trained" and not self._scorer().layer_shares:
            raise ValueError(f"learned: {where} has no layer shares for budgets='trained': train it again with "
                             "`keepkv train-scorer`, which measures them")

    def for_heads(self, first_kv_head: int) -> "LearnedScores":
        return self if first_kv_head == self.first_head else dataclasses.replace(self, first_head=first_kv_head)

    def scores(self, layer) -> torch.Tensor:
        """[B, H_kv, S] the scorer's predicted log KVzip scores of the layer's entries (empty slots
        included: the plan leaves them out), each row by its layer's and the scorer's heads from
        ``first_head``, rounded to :data:`SCORE_STEP`."""
        layers = layer.row_layers if layer.row_layers is not None else layer.layer_idx
        predicted = self._scorer().predict(layers, layer.keys, layer.values, layer.positions, self.first_head)
        return torch.round(predicted / SCORE_STEP) * SCORE_STEP

    def priority(self, layer, merge_scores=None) -> torch.Tensor:
        """[B, H_kv, S]: +inf for the sinks, the decoding window and the prompt's last
        ``prompt_window`` tokens, else the predicted log score."""
        recent = generated_recent_count(layer, self.window)
        is_protected = protected(layer, self.sinks, recent)
        if self.prompt_window:
            sinks = layer.open_budget.clamp(max=self.sinks)
            taken = sinks + torch.minimum(recent, layer.open_budget - sinks)  # what protected() kept
            is_protected = is_protected | prompt_tail(layer, self.prompt_window, taken)
        return self.scores(layer).masked_fill(is_protected, float("inf"))

