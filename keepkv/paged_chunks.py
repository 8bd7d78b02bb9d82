"""A served prompt compressed chunk by chunk, so that an engine's prefix cache can share it:
the engine's rows as the paged adapter reads them.

With ``chunk_blocks`` = c, a prompt's whole chunks of N = c · block_size tokens are each compressed
alone, as they arrive, to one block of entries (``block_size`` per KV head), the entries before
them never touched again (``CompressedCache(decoding="keep_prompt").start_prefill(chunk_keep=(N,
block_size))``, the Hugging Face path's rule). A chunk's kept entries are then a function of the
tokens up to its end alone. They live in the chunk's *last* block, whose hash in the engine's
prefix cache covers every token up to the chunk's end; the chunk's other c - 1 blocks are freed
and become the engine's null block (``keepkv.vllm.spec.KeepKVManager``). A prompt's shorter last
piece, and every generated token, are held as ``keep_prompt`` holds them.

The engine addresses a request by token positions: block i of its table holds positions
i · block_size onwards, null where a chunk was compressed. The adapter addresses it by slots
(:mod:`keepkv.paged`: slots 0..S-1, read in order). With j chunks compressed, slot s lives in

- block c · t + c - 1 of the engine's table for s in chunk t's kept block (t < j),
- block i + (c - 1) · j for the rest (slot s = position - (N - block_size) · j),

so :func:`compact` rewrites each engine row into the adapter's terms. A step that reads tokens
across a chunk's end is cut there into parts, one row each: the part that ends the chunk is
attended, then the chunk is compressed, then the next part is attended over the compressed chunk
(``PagedBatch.waves``). A request that computes a document and one that finds it in the prefix
cache then read the same entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CompactRows:
    """The engine's rows in the adapter's slots, each step that crosses a chunk's end cut there.

    query_start [R+1], seq_lens [R] (slots held after the part), block_table [R, W] (the part's
    table in slot order), prompts [R] (the prompt's slots once its chunks are compressed);
    offsets [R]: position - slot for the part's tokens; frozen [R]: the prompt's tokens;
    chunk_starts [R]: the first slot of the chunk the part ends (-1: none); after_tables [R, W]:
    the table once that chunk is compressed (the part's own where it ends none); waves [R]: the
    part's index within its engine row (parts run in wave order); source [R]: the engine row;
    reading [R]: whether the part starts within its prompt (by position); shrinks [R]: the slots
    the part's end gives up (a chunk it ends: N - block_size, else 0)."""

    query_start: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor
    prompts: list[int]
    offsets: list[int]
    frozen: list[int]
    chunk_starts: list[int]
    after_tables: torch.Tensor
    waves: list[int]
    source: list[int]
    reading: list[bool]
    shrinks: list[int]


def compacted_table(table: torch.Tensor, chunks: int, chunk_blocks: int) -> torch.Tensor:
    """[W] a row's engine table ``table`` [W] in slot order, with its first ``chunks`` chunks
    compressed: each chunk's last block, then the blocks past them (padded with the last block)."""
    width = table.shape[0]
    index = torch.arange(width)
    index = torch.where(index < chunks, chunk_blocks * index + chunk_blocks - 1, index + (chunk_blocks - 1) * chunks)
    return table[index.clamp(max=width - 1)]


def compact(query_start: list[int], seq_lens: list[int], block_table: torch.Tensor, prompts: list[int],
            block_size: int, chunk_blocks: int) -> CompactRows:
    """The engine's step (``query_start`` [R+1], ``seq_lens`` [R] tokens after the step,
    ``block_table`` [R, W] by position, ``prompts`` [R] each request's prompt length) in the
    adapter's slots (:class:`CompactRows`). A chunk counts as compressed once the step that read
    its last token ran: only whole chunks within the prompt are compressed."""
    tokens = chunk_blocks * block_size
    shrink = tokens - block_size  # slots a compressed chunk gives up
    rows = CompactRows([0], [], [], [], [], [], [], [], [], [], [], [])
    for row, (start, end_start, seq, prompt) in enumerate(zip(query_start, query_start[1:], seq_lens, prompts)):
        done = seq - (end_start - start)
        whole = prompt // tokens  # chunks the prompt compresses
        ends = [m for m in range((done // tokens + 1) * tokens, seq + 1, tokens) if m <= whole * tokens]
        cuts = [done, *ends] + ([seq] if not ends or ends[-1] < seq else [])
        table = block_table[row]
        for wave, (first, last) in enumerate(zip(cuts, cuts[1:])):
            chunks = min(first // tokens, whole)  # compressed before the part
            ends_chunk = last in ends
            rows.query_start.append(rows.query_start[-1] + last - first)
            rows.seq_lens.append(last - shrink * chunks)
            rows.block_table.append(compacted_table(table, chunks, chunk_blocks))
            rows.after_tables.append(compacted_table(table, chunks + 1, chunk_blocks) if ends_chunk else rows.block_table[-1])
            rows.prompts.append(prompt - shrink * whole)
            rows.offsets.append(shrink * chunks)
            rows.frozen.append(prompt)
            rows.chunk_starts.append(block_size * chunks if ends_chunk else -1)
            rows.waves.append(wave)
            rows.source.append(row)
            rows.reading.append(first < prompt)
            rows.shrinks.append(shrink if ends_chunk else 0)
    rows.block_table = torch.stack(rows.block_table) if rows.block_table else block_table[:0]
    rows.after_tables = torch.stack(rows.after_tables) if rows.after_tables else block_table[:0]
    return rows


def check_chunk_blocks(method, chunk_blocks, keep_prompt: bool) -> None:
    """Raise ValueError, in one line, unless ``chunk_blocks`` is 0 or a chunk of at least 2 blocks
    that ``method`` (a composed method) can compress alone, as the paged adapter serves it: a kept
    prompt (``keep_prompt``), an eviction (a merge's votes would need keepkv's kernel for every
    prompt), one budget in every layer, and statistics from a chunk's newest query rows."""
    if isinstance(chunk_blocks, bool) or not isinstance(chunk_blocks, int) or chunk_blocks < 0 or chunk_blocks == 1:
        raise ValueError(f"chunk_blocks is 0 (prompts kept whole) or the blocks of a compressed chunk (>= 2), "
                         f"got {chunk_blocks!r}")
    if not chunk_blocks:
        return
    if not keep_prompt:
        raise ValueError("chunk_blocks compresses a kept prompt chunk by chunk: use it with keep_prompt=True")
    needs = method.needs(True)
    reasons = {
        "its merge writes votes, which keepkv's own kernel would then read for every prompt":
            method.merging.writes_bias,
        "its layers take budgets of their own": method.selection.layered or method.allocates_from_all_layers,
        "it scores a prompt with the attention of every query row": bool(
            needs.probs or needs.colsum or needs.decays or needs.logits or needs.colmax),
    }
    found = [reason for reason, present in reasons.items() if present]
    if found:
        raise ValueError(f"chunk_blocks does not serve {method.name}: {'; '.join(found)} (it serves snapkv, "
                         "keydiff, streamingllm, window and the learned selection with uniform budgets)")
