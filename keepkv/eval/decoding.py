"""Decoding on compressed caches: one prefill, greedy or teacher-forced steps, many caches at once.

``prefill`` fills a cache (the runner's recording cache) and returns the last logits;
``greedy_decode`` is a plain forward loop from those logits on one cache (the cache
compresses *during* decoding as its method says); ``decode_cells`` runs several forks of one
prefill in ONE forward pass per step through :class:`JointCache`, so the model's linear
layers run once for every (method, budget) cell.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from transformers.cache_utils import Cache

from .. import reconstruction
from ..attention import enable, hand_over
from ..cache import CompressedCache
from ..models import CACHE_KWARG


def _position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Positions of a left-padded batch as ``generate()`` gives them (padding at 1)."""
    positions = mask.long().cumsum(-1) - 1
    return positions.masked_fill(mask == 0, 1)


@torch.inference_mode()
def prefill(model, cache, input_ids: torch.Tensor, attention_mask: torch.Tensor, tokenizer=None,
            chat: bool = True) -> torch.Tensor:
    """Run the prompt through ``model`` into ``cache``; return the last position's logits [B, V].

    When the cache (or what it records) needs reconstruction passes (KVzip), they run over the
    prompt afterwards (:mod:`keepkv.reconstruction`, with ``tokenizer`` and ``chat``)."""
    enable(model)
    passes = (cache.record or cache.method.needs(True)).reconstruct
    if passes:
        if tokenizer is None:
            raise ValueError("a reconstruction pass (kvzip) needs the tokenizer")
        cache.expect_reconstruction()
    output = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=_position_ids(attention_mask),
        **{CACHE_KWARG: cache},
        use_cache=True,
        logits_to_keep=1,
    )
    if passes:
        reconstruction.run(model, tokenizer, cache, input_ids, attention_mask, chat)
    return output.logits[:, -1].float()


@torch.inference_mode()
def greedy_decode(
    model,
    cache,
    first_logits: torch.Tensor,
    attention_mask: torch.Tensor,
    steps,
    eos: int | None,
    *,
    force: torch.Tensor | None = None,
    observe=None,
    progress: bool = False,
) -> torch.Tensor:
    """Greedy decoding with a manual forward loop on ``cache``, from the prefill's last logits.

    Parameters
    ----------
    first_logits : [B, V]
        Logits of the prompt's last position (they choose the first new token).
    attention_mask : [B, T]
        The prompt's mask (left padding); one column of ones is appended per step.
    steps : int or sequence of int
        New tokens per row (the loop runs to the largest; a row stops at its own).
    eos : int or None
        A row that emits ``eos`` is done; later positions hold ``eos`` and are not scored.
    force : [B, steps] int, optional
        Teacher forcing: where ``force >= 0`` that token is fed instead of the argmax.
    observe : callable, optional
        ``observe(t, logits)`` with the [B, V] logits that predict new token ``t``.

    Returns
    -------
    [B, n] token ids, n <= max(steps); the model runs n - 1 times (none after the last token).
    """
    batch = first_logits.shape[0]
    device = first_logits.device
    limits = torch.as_tensor([steps] * batch if isinstance(steps, int) else list(steps), device=device)
    total = int(limits.max()) if batch else 0
    fill = eos if eos is not None else 0
    done = limits <= 0
    mask = attention_mask
    logits = first_logits
    tokens = []
    bar = tqdm(total=total, desc="decoding", unit="tok", leave=False, disable=not progress)
    for t in range(total):
        if observe is not None:
            observe(t, logits)
        token = logits.argmax(-1)
        if force is not None and t < force.shape[1]:
            token = torch.where(force[:, t] >= 0, force[:, t], token)
        token = token.masked_fill(done, fill)
        tokens.append(token)
        if eos is not None:
            done = done | (token == eos)
        done = done | (limits <= t + 1)
        bar.update(1)
        if t == total - 1 or bool(done.all()):
            break
        mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=-1)
        logits = model(
            input_ids=token[:, None],
            attention_mask=mask,
            position_ids=mask.long().sum(-1, keepdim=True) - 1,
            **{CACHE_KWARG: cache},
            use_cache=True,
        ).logits[:, -1].float()
    bar.close()
    if not tokens:
        return first_logits.new_zeros(batch, 0, dtype=torch.long)
    return torch.stack(tokens, dim=1)


class JointCache(Cache):
    """Several forked CompressedCaches decoded in ONE forward pass.

    Cache ``i`` owns the rows ``[offset_i, offset_i + rows_i)`` of the batch. The model's
    linear layers run once for every cell together; each attention call is split by rows and
    handed to each cache's ``forward_layer`` (its own entries, its own method). All caches
    must have seen the same number of tokens (they are forks of one prefill).
    """

    def __init__(self, caches: list[CompressedCache]):
        super().__init__(layers=caches[0].layers)
        self.caches = caches
        self.rows = [cache.layers[0].keys.shape[0] for cache in caches]

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        hand_over(self, key_states, self.caches[0].config)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.caches[0].get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.caches[0].get_mask_sizes(query_length, layer_idx)

    def forward_layer(self, layer_idx, query, keys, values, block_mask, scaling) -> torch.Tensor:
        outputs, start = [], 0
        for cache, rows in zip(self.caches, self.rows):
            part = slice(start, start + rows)
            outputs.append(cache.forward_layer(layer_idx, query[part], keys[part], values[part], block_mask[part], scaling))
            start += rows
        return torch.cat(outputs, dim=0)


@torch.inference_mode()
def append_block(model, cache, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Feed ``input_ids`` [B, q] (no padding) after what ``cache`` holds, ``attention_mask`` [B, T]
    being the mask so far; return the block's last logits [B, V]. The block attends over the kept
    entries and itself, as a prompt's continuation (the cache's method observes it as decoding)."""
    mask = torch.cat([attention_mask, attention_mask.new_ones(input_ids.shape)], dim=-1)
    positions = _position_ids(mask)[:, -input_ids.shape[1] :]
    output = model(
        input_ids=input_ids, attention_mask=mask, position_ids=positions, **{CACHE_KWARG: cache}, use_cache=True,
        logits_to_keep=1,
    )
    return output.logits[:, -1].float()


def decode_cells(model, caches, first_logits, attention_mask, steps, eos, *, force=None, observe=None,
                 progress=False, question: torch.Tensor | None = None) -> list[torch.Tensor]:
    """:func:`greedy_decode` of several forks of one prefill at once; one [B, n] tensor per cache.

    ``first_logits``, ``attention_mask``, ``steps`` and ``force`` are those of one cache's rows;
    ``observe`` sees the logits of all caches' rows, cache after cache. ``question`` [B, q]: a
    block appended to every cache first (question-agnostic: the caches hold a compressed
    context); its last logits replace ``first_logits`` (then None).
    """
    count = len(caches)
    cache = caches[0] if count == 1 else JointCache(caches)
    if question is not None:
        rows = question.shape[0]
        first_logits = append_block(model, cache, question.repeat(count, 1), attention_mask.repeat(count, 1))
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(question.shape)], dim=-1)
        out = greedy_decode(
            model, cache, first_logits, attention_mask.repeat(count, 1),
            steps if isinstance(steps, int) else list(steps) * count, eos,
            force=None if force is None else force.repeat(count, 1), observe=observe, progress=progress,
        )
        return [out[i * rows : (i + 1) * rows] for i in range(count)]
    rows = first_logits.shape[0]
    out = greedy_decode(
        model, cache, first_logits.repeat(count, 1), attention_mask.repeat(count, 1),
        steps if isinstance(steps, int) else list(steps) * count, eos,
        force=None if force is None else force.repeat(count, 1), observe=observe, progress=progress,
    )
    return [out[i * rows : (i + 1) * rows] for i in range(count)]


def _strip(ids: list[int], eos: int | None) -> list[int]:
    """New tokens up to (not including) the first eos."""
    if eos is not None and eos in ids:
        return ids[: ids.index(eos)]
    return ids


def _with_eos(ids: list[int], eos: int | None) -> list[int]:
    """New tokens up to and including the first eos."""
    if eos is not None and eos in ids:
        return ids[: ids.index(eos) + 1]
    return ids
