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

import contextlib
import math

import torch
from tqdm.auto import tqdm

from .attention import RECONSTRUCTION_PICKS, PassDone, Reconstruction
from .models import CACHE_KWARG
from .templates import split_template

REPEAT_FIRST = "\n\nRepeat the previous context exactly."
REPEAT_NEXT = "\n\nRepeat the part of the previous context exactly, starting with"
CARRY = 8  # the previous block's last tokens, quoted in the next block's instruction
PICK_RUN = 16  # tokens per run of a "blocks" pick


def repeated(ids: list[int], share: float, pick: str, salience: list[float] | None = None) -> list[int]:
    """The tokens of ``ids`` a pass repeats: all of them, or (``share`` < 1) about that share:
    single tokens at an even stride ("stride"), runs of ``PICK_RUN`` tokens at an even stride
    ("blocks"), or runs of ``PICK_RUN`` tokens around the most salient tokens ("keys": ``salience``
    per token, each run starting 3/4 of a run before its token, so that the model has read the
    words before it when it repeats it), in the prompt's order."""
    if share >= 1.0 or not ids:
        return list(ids)
    count = len(ids)
    if pick == "stride":
        kept = max(1, math.ceil(count * share))
        return [ids[math.floor(i * count / kept)] for i in range(kept)]
    if pick == "blocks":
        runs = max(1, math.ceil(count * share / PICK_RUN))
        starts = [math.floor(i * count / runs) for i in range(runs)]
        return [token for start in starts for token in ids[start : start + PICK_RUN]]
    wanted, covered, taken = math.ceil(count * share), [False] * count, 0
    for position in sorted(range(count), key=lambda p: -salience[p]):
        if taken >= wanted:
            break
        start = max(0, min(position - PICK_RUN * 3 // 4, count - PICK_RUN))
        for index in range(start, min(count, start + PICK_RUN)):
            taken += not covered[index]
            covered[index] = True
    return [token for token, keep in zip(ids, covered) if keep]


def pass_blocks(tokenizer, contexts: list[list[int]], reconstruction: Reconstruction, suffix: str,
                salience: list[list[float]] | None = None) -> list[list[list[int]]]:
    """[steps][rows] token ids of each row's block at each step (the module docstring's layout).
    A row whose context has fewer blocks gets the first instruction alone at the later steps: its
    queries read the cache as any instruction's do, and no row of a step is all padding.
    ``salience``: per row, per context token, what a "keys" pick ranks by."""
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    first, later, tail = encode(REPEAT_FIRST), encode(REPEAT_NEXT), encode(suffix)
    chunk = reconstruction.chunk
    per_row = []
    for row, ids in enumerate(contexts):
        parts = repeated(ids, reconstruction.share, reconstruction.pick, None if salience is None else salience[row])
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
        progress: bool = False, positions: str = "real", surprisal: torch.Tensor | None = None) -> None:
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
        contexts, saliences = [], []
        distinct = None
        if any(p.pick == "keys" and p.share < 1 for p in needs.reconstruct):
            distinct = key_distinctness(cache)
        elif any(p.pick == "surprise" and p.share < 1 for p in needs.reconstruct):
            if surprisal is None:
                raise ValueError("a 'surprise' pick needs the prompt's surprisal (surprisal_capture around its prefill)")
            distinct = surprisal
        for row, (ids, real) in enumerate(zip(input_ids.tolist(), attention_mask.bool().tolist())):
            ids = [token for token, keep in zip(ids, real) if keep]
            skip = len(prefix) if prefix and ids[: len(prefix)] == prefix else 0
            contexts.append(ids[skip:])
            if distinct is not None:
                saliences.append(distinct[row][torch.tensor(real)].tolist()[skip:])
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        for reconstruction in needs.reconstruct:
            steps = pass_blocks(tokenizer, contexts, reconstruction, suffix, saliences or None)
            cache.begin_reconstruction(reconstruction)
            try:
                for blocks in tqdm(steps, desc="reconstruction", unit="block", leave=False, disable=not progress):
                    try:
                        _feed(model, cache, blocks, attention_mask, pad, positions == "real")
                    except PassDone:  # a shallow pass (depth < 1) stopped the block's forward
                        pass
            finally:
                cache.end_reconstruction()
            if reconstruction.depth < 1:
                cache.fill_unscored(reconstruction)
    cache.finish_reconstruction()


SURPRISE_CHUNK = 64  # positions whose logits are taken at once (each [B, 64, vocab] fp32)


@contextlib.contextmanager
def surprisal_capture(model, input_ids: torch.Tensor, wanted: bool):
    """Around a prompt's forward: when ``wanted``, the surprisal of each prompt token (its negative
    log-likelihood given the tokens before it, [B, T]; 0 for the first) in the yielded dict under
    "nll", from the decoder's final hidden states (a hook on its last norm) and the LM head, a few
    positions at a time. What a "surprise" pick ranks by."""
    captured: dict = {}
    if not wanted:
        yield captured
        return
    states = []
    hook = model.get_decoder().norm.register_forward_hook(lambda module, args, output: states.append(output))
    try:
        yield captured
    finally:
        hook.remove()
    hidden = torch.cat(states, dim=1)  # [B, T, hidden] (the blocks of a chunked prefill, in order)
    head = model.get_output_embeddings()
    nll = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    for start in range(0, input_ids.shape[1] - 1, SURPRISE_CHUNK):
        stop = min(start + SURPRISE_CHUNK, input_ids.shape[1] - 1)
        logp = torch.log_softmax(head(hidden[:, start:stop]).float(), dim=-1)
        nll[:, start + 1 : stop + 1] = -logp.gather(-1, input_ids[:, start + 1 : stop + 1, None])[..., 0]
    captured["nll"] = nll


def key_distinctness(cache) -> torch.Tensor:
    """[B, T] how unlike each prompt token's keys are to their row's mean key: KeyDiff's score
    (minus the cosine to the mean unit key), averaged over every layer and KV head; read from the
    prefilled cache, before any pass."""
    total = 0.0
    for layer in cache.layers:
        live = layer.live()  # [B, H_kv, T]
        unit = torch.nn.functional.normalize(layer.keys.float(), dim=-1)
        anchor = torch.nn.functional.normalize((unit * live[..., None]).sum(2), dim=-1)  # [B, H_kv, D]
        total = total - (unit @ anchor[..., None])[..., 0].mean(1)  # [B, T]
    return total / len(cache.layers)


def needs_surprisal(cache) -> bool:
    """Whether a pass the cache needs picks its tokens by surprisal."""
    needs = cache.record if cache.record is not None else cache.method.needs(True)
    return any(p.pick == "surprise" and p.share < 1 for p in needs.reconstruct)


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
    with surprisal_capture(model, input_ids, needs_surprisal(cache)) as captured:
        for start in range(0, total, chunk):
            stop = min(start + chunk, total)
            extra = {"position_ids": numbered[:, start:stop]} if positions == "real" else {}
            logits = model(
                input_ids=input_ids[:, start:stop], attention_mask=attention_mask[:, :stop], **extra,
                **{CACHE_KWARG: cache}, use_cache=True, logits_to_keep=1,
            ).logits
    run(model, tokenizer, cache, input_ids, attention_mask, chat, progress, positions, captured.get("nll"))
    return logits[:, -1].float()
