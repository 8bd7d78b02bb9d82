"""Training the learned selection's scorer (:mod:`keepkv.scorer`) on a model: KVzip's own pass
gives the targets (KVzap, arXiv 2601.07891, fits log KVzip scores the same way).

For each document, :func:`kvzip_scores` prefills it into a recording cache, runs keepkv's
reconstruction pass over it (:func:`keepkv.reconstruction.prefill`) and hands the recording to
the ``kvzip`` selection (``CompressedCache.fork``), whose own ``observe`` scores every entry: the
targets are exactly the scores ``kvzip`` ranks by. The entries' keys, values and positions come
from the same cache. :class:`keepkv.scorer.ScorerData` gathers them; a share of the documents is
held out to report the fit (Spearman rank correlation with KVzip's scores, overlap of the kept
sets at budgets 0.1 and 0.2).

The default corpus is the offline text the eval already reads (:mod:`keepkv.eval.tasks`):
``pydoc_data``'s prose and the running interpreter's standard-library sources, half each.
"""

from __future__ import annotations

import math
import os
import random
import sysconfig
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import reconstruction
from .attention import Needs, Reconstruction
from .cache import CompressedCache
from .eval.tasks import prose_corpus, stdlib_sources
from .generation import context_and_question_ids
from .methods import get_method
from .methods.kvzip import ContextReconstruction
from .scorer import NEEDS_POSITIONS, ScorerData, Scorer, config_key


def default_corpus(documents: int = 50, chars: int = 4000, seed: int = 0) -> list[str]:
    """``documents`` texts of about ``chars`` characters: alternately a run of ``pydoc_data`` prose
    from a seeded paragraph start and the head of a standard-library ``.py`` file (seeded order,
    no file twice), each cut at a line or space."""
    rng = random.Random(seed)
    prose = prose_corpus()
    starts = [0] + [i + 2 for i in range(len(prose) - 2) if prose[i : i + 2] == "\n\n"]
    files = list(stdlib_sources())
    rng.shuffle(files)
    root = sysconfig.get_paths()["stdlib"]
    texts = []
    for index in range(documents):
        if index % 2 == 0 or not files:
            start = rng.choice(starts)
            text = prose[start : start + chars]
            cut = text.rfind(" ")
        else:
            with open(os.path.join(root, files.pop()), encoding="utf-8", errors="replace") as source:
                text = source.read(chars)
            cut = text.rfind("\n")
        texts.append(text[: cut] if cut > 0 else text)
    return texts


@torch.no_grad()
def kvzip_scores(model, tokenizer, text: str, chat: bool = True, chunk: int = 2048,
                 share: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One document's (keys, values [L, H_kv, S, D], KVzip's scores [L, H_kv, S], positions [S]):
    the entries of ``text`` as ``keepkv.compress`` would prefill it (the chat template's start and
    the context, with ``chat``), scored by the ``kvzip`` selection after keepkv's reconstruction pass."""
    from .attention import enabled

    device = next(model.parameters()).device
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    ids, _ = context_and_question_ids(tokenizer, text, "", chat)
    input_ids = torch.tensor([ids], device=device)
    kvzip = get_method("kvzip", chunk=chunk, share=share)
    record = CompressedCache(model.config, "full", record=Needs(reconstruct=(Reconstruction(chunk, share),)))
    with enabled(model):
        reconstruction.prefill(model, tokenizer, record, input_ids, torch.ones_like(input_ids), chat=chat)
    scored = record.fork(kvzip, 1.0)  # the kvzip selection observes the recorded pass: its own scores
    layers = scored.layers
    keys = torch.stack([layer.keys[0] for layer in layers]).cpu()
    values = torch.stack([layer.values[0] for layer in layers]).cpu()
    scores = torch.stack([layer.extras["score"][0] for layer in layers]).cpu()
    positions = layers[0].positions[0, 0].cpu()
    return keys, values, scores, positions


SHARE_BUDGETS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.7, 1.0)  # the budgets layer_shares measures
SHARE_DOCUMENTS = 8  # documents layer_shares averages over


@torch.no_grad()
def layer_shares(scorer: Scorer, documents: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                 budgets: tuple[float, ...] = SHARE_BUDGETS, sinks: int = 4) -> dict:
    """KVzip's "layers" split of ``scorer``'s predictions, averaged over ``documents`` (keys, values
    [L, H_kv, S, D] and positions [S] each): for each budget (a fraction of the document), each
    layer's budget over the mean, {"budgets": [NB], "shares": [NB][L]} (``Scorer.layer_shares``,
    what ``budgets="trained"`` splits by)."""
    split = ContextReconstruction(sinks=sinks, budgets="layers")
    shares = []
    for budget in budgets:
        total = None
        for keys, values, positions in documents:
            layers, kv_heads, size = keys.shape[:3]
            scores = [scorer.predict(layer, keys[layer][None], values[layer][None],
                                     positions.expand(kv_heads, -1)[None]) for layer in range(layers)]
            row = torch.tensor([max(1, round(budget * size))])
            per_layer = split.allocate(layers, kv_heads, row, torch.tensor([size]), scores)[:, 0, 0].double()
            per_layer = per_layer / per_layer.mean()
            total = per_layer if total is None else total + per_layer
        shares.append([round(float(x), 4) for x in total / len(documents)])
    return {"budgets": list(budgets), "shares": shares}


def train_scorer(model, tokenizer, texts: list[str] | None = None, *, kind: str = "linear", documents: int = 50,
                 chars: int = 4000, holdout: float = 0.1, features: str = "values+pairs", chat: bool = True,
                 chunk: int = 2048, share: float = 1.0, sample: int = 256, skip: int = 4, ridge: float = 1e-3,
                 hidden: int = 32, epochs: int = 30, seed: int = 0, save: str | os.PathLike | None = None,
                 progress: bool = True) -> Scorer:
    """A scorer of ``model``'s KVzip scores, fitted per layer and KV head (``kind``: "linear", ridge
    in closed form, or "mlp", the ridge plus a ``hidden``-unit MLP trained ``epochs`` with Adam).

    ``texts``: the training documents (default: :func:`default_corpus` of ``documents`` texts of
    about ``chars`` characters). ``holdout``: the share of documents (at least one when there are
    two or more) held out to report the fit, in ``scorer.report``: ``spearman`` (Spearman rank
    correlation with KVzip's scores, mean over documents, layers and heads), ``overlap@0.1`` and
    ``overlap@0.2`` (the share of KVzip's kept set, at that budget per head, that the scorer
    keeps, sinks left out), and the seconds taken. ``features``: a :data:`keepkv.scorer.FEATURES`
    name. ``chunk``, ``share``: KVzip's pass (``kvzip+chunk=..+share=..``). ``sample``: entries per
    document the MLP trains on (the ridge reads them all). ``save``: write the scorer there.
    ``progress``: a bar over the documents (and the MLP's epochs)."""
    if texts is None:
        texts = default_corpus(documents, chars, seed)
    texts = [text for text in texts if text.strip()]
    if not texts:
        raise ValueError("train_scorer needs at least one non-empty text")
    key = config_key(model)
    rope = getattr(model.config, "rope_parameters", None) or getattr(model.config, "rope_scaling", None) or {}
    if features in NEEDS_POSITIONS and rope.get("rope_type", "default") != "default":
        raise ValueError(f"features {features!r} un-rotate the keys with the default RoPE; this model's is "
                         f"{rope.get('rope_type')!r}: use features='values+pairs'")
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    held = set(order[: math.ceil(holdout * len(texts))] if len(texts) > 1 and holdout > 0 else [])
    data = ScorerData(key["layers"], key["kv_heads"], key["head_dim"], features, sample, skip, seed, key)
    kept = []  # documents layer_shares reads: the held-out ones first
    started = time.perf_counter()
    bar = tqdm(texts, desc=f"scorer: kvzip targets", unit="doc", disable=not progress)
    for index, text in enumerate(bar):
        keys, values, scores, positions = kvzip_scores(model, tokenizer, text, chat, chunk, share)
        data.add(keys, values, scores, positions, held_out=index in held)
        kept.append((index not in held, index, (keys, values, positions)))
        kept = sorted(kept, key=lambda item: item[:2])[:SHARE_DOCUMENTS]
        bar.set_postfix(tokens=int(positions.numel()), held_out=index in held)
    gathered = time.perf_counter()
    scorer = data.fit(kind, ridge, hidden, epochs, seed=seed, progress=progress)
    fitted = time.perf_counter()
    scorer.report.update(data.evaluate(scorer))
    scorer.layer_shares = layer_shares(scorer, [document for _, _, document in kept])
    scorer.report.update(kind=kind, features=features, documents=len(texts), seconds_targets=round(gathered - started, 2),
                         seconds_fit=round(fitted - gathered, 2))
    if save is not None:
        scorer.save(Path(save))
    return scorer
