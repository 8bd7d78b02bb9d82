"""Reconstruction passes: the model repeats the prompt it just prefilled, and the attention each
cached entry receives while it does scores that entry (KVzip, Kim et al. 2025, arXiv 2505.23416).

After a prompt is prefilled into a :class:`~keepkv.cache.CompressedCache` whose method asks for a
pass (``Needs.reconstruct``), :func:`run` feeds, for each row,

    [instruction] [template end] [prompt tokens k·C ... (k+1)·C - 1]

for k = 0, 1, ... (C = ``Reconstruction.chunk``): the instruction is "Repeat the previous context
exactly." for the first block and "Repeat the part of the previous context exactly, starting
with" plus the previous block's last ``CARRY`` tokens for the others (the paper's prompts). Each
block continues the prompt's positions, attends over every cached prompt entry and itself, and is
forgotten once attended (``CompressedCache.begin_reconstruction``): the cache holds the prompt plus
one block at most, and the attention workspace is one row chunk of one block. The method then
observes its prefill with ``StepStats.reconstructed`` (the largest probability any block query gave
each entry) and the prompt is compressed.

A row's template start (the system prompt and the user turn's opening) is not repeated: the
instruction asks for the context, as the paper's does.
"""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from .attention import Reconstruction
from .models import CACHE_KWARG
from .templates import split_template

REPEAT_FIRST = "\n\nRepeat the previous context exactly."
REPEAT_NEXT = "\n\nRepeat the part of the previous context exactly, starting with"
CARRY = 8  # the previous block's last tokens, quoted in the next block's instruction
PICK_RUN = 16  # tokens per run of a cheaper pass


def tokens_to_repeat(ids: list[int], share: float) -> list[int]:
    """The tokens of ``ids`` a pass repeats: all of them, or (``share`` < 1) runs of ``PICK_RUN``
    tokens at an even stride, about that share of them, in the prompt's order."""
    if share >= 1.0 or not ids:
        return list(ids)
    count = len(ids)
    runs = max(1, math.ceil(count * share / PICK_RUN))
    starts = [math.floor(i * count / runs) for i in range(runs)]
    return [token for start in starts for token in ids[start : start + PICK_RUN]]


def pass_blocks(tokenizer, contexts: list[list[int]], reconstruction: Reconstruction, suffix: str) -> list[list[list[int]]]:
    """[steps][rows] token ids of each row's block at each step (the module docstring's layout).
    A row whose context has fewer blocks gets the first instruction alone at the later steps: its
    queries read the cache as any instruction's do, and no row of a step is all padding."""
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    first, later, tail = encode(REPEAT_FIRST), encode(REPEAT_NEXT), encode(suffix)
    chunk = reconstruction.chunk
    per_row = []
    for ids in contexts:
        parts = tokens_to_repeat(ids, reconstruction.share)
        pieces = [parts[start : start + chunk] for start in range(0, len(parts), chunk)] or [[]]
        per_row.append(
            [(first if k == 0 else later + pieces[k - 1][-CARRY:]) + tail + piece for k, piece in enumerate(pieces)]
        )
    steps = max(len(blocks) for blocks in per_row)
    return [[blocks[k] if k < len(blocks) else first + tail for blocks in per_row] for k in range(steps)]


def template_edges(tokenizer, chat: bool) -> tuple[list[int], str]:
    """(ids of the chat template's start, which a pass does not repeat; the text that ends a user
    turn and opens the reply, which follows each instruction). Without a template: ([], "\\n")."""
    before, after = split_template(tokenizer, chat)
    if not before and not after:
        return [], "\n"
    return tokenizer(before, add_special_tokens=False)["input_ids"], after


POSITIONS = ("real", "slots")


@torch.no_grad()
def run(model, tokenizer, cache, input_ids: torch.Tensor, attention_mask: torch.Tensor, chat: bool = True,
        progress: bool = False, positions: str = "real") -> None:
    """Run every reconstruction pass ``cache`` needs over the prompt it holds (input_ids,
    attention_mask [B, T]: that prompt, left-padded), then compress it
    (``CompressedCache.finish_reconstruction``; a recording cache keeps the passes' results for
    ``fork``). The model must be on keepkv's attention path.

    ``positions``: how the prompt's tokens were numbered, so that the blocks continue them: "real"
    (each row's real tokens from 0, as ``model.generate`` numbers them) or "slots" (by slot, padding
    included, as a forward without ``position_ids`` does)."""
    needs = cache.record if cache.record is not None else cache.method.needs(True)
    if needs.reconstruct:
        prefix, suffix = template_edges(tokenizer, chat)
        contexts = []
        for ids, real in zip(input_ids.tolist(), attention_mask.bool().tolist()):
            ids = [token for token, keep in zip(ids, real) if keep]
            skip = len(prefix) if prefix and ids[: len(prefix)] == prefix else 0
            contexts.append(ids[skip:])
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        for reconstruction in needs.reconstruct:
            steps = pass_blocks(tokenizer, contexts, reconstruction, suffix)
            cache.begin_reconstruction(reconstruction)
            try:
                for blocks in tqdm(steps, desc="reconstruction", unit="block", leave=False, disable=not progress):
                    _feed(model, cache, blocks, attention_mask, pad, positions == "real")
            finally:
                cache.end_reconstruction()
    cache.finish_reconstruction()


def _feed(model, cache, blocks: list[list[int]], attention_mask: torch.Tensor, pad: int, real_positions: bool) -> None:
    """One step of a pass: each row's block, left-padded, after the prompt (attention_mask [B, T])."""
    device = attention_mask.device
    width = max(len(block) for block in blocks)
    ids = torch.tensor([[pad] * (width - len(block)) + block for block in blocks], device=device)
    real = torch.tensor([[0] * (width - len(block)) + [1] * len(block) for block in blocks], device=device)
    mask = torch.cat([attention_mask, real.to(attention_mask.dtype)], dim=-1)
    numbered = {}
    if real_positions:  # else the model numbers the block's slots after the prompt's
        numbered["position_ids"] = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)[:, -width:]
    model(input_ids=ids, attention_mask=mask, **numbered, **{CACHE_KWARG: cache}, use_cache=True, logits_to_keep=1)


@torch.no_grad()
def prefill(model, tokenizer, cache, input_ids: torch.Tensor, attention_mask: torch.Tensor, chat: bool = True,
            prefill_chunk: int | None = None, progress: bool = False, positions: str = "real") -> torch.Tensor:
    """Prefill the prompt into ``cache``, run the reconstruction passes its method needs, and
    compress it; returns the prompt's last logits [B, V]. The model must be on keepkv's attention
    path (``keepkv.enabled``). ``prefill_chunk``: feed the prompt in blocks of that many tokens;
    ``positions``: "real" (number each row's real tokens from 0, as ``model.generate`` does) or
    "slots" (by slot, as a forward without ``position_ids`` does): decoding must go on alike."""
    if positions not in POSITIONS:
        raise ValueError(f"positions must be one of {', '.join(map(repr, POSITIONS))}, got {positions!r}")
    cache.expect_reconstruction()
    total = input_ids.shape[1]
    chunk = prefill_chunk or total
    if chunk < total:
        cache.start_prefill(attention_mask)
    numbered = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    for start in range(0, total, chunk):
        stop = min(start + chunk, total)
        extra = {"position_ids": numbered[:, start:stop]} if positions == "real" else {}
        logits = model(
            input_ids=input_ids[:, start:stop], attention_mask=attention_mask[:, :stop], **extra,
            **{CACHE_KWARG: cache}, use_cache=True, logits_to_keep=1,
        ).logits
    run(model, tokenizer, cache, input_ids, attention_mask, chat, progress, positions)
    return logits[:, -1].float()
