"""The requests a paged adapter serves, host-side: each step's phases, and what a request files
between its steps (its method state, its kept queries, its prompt's chunks so far).

An engine names a request by nothing the adapter keeps: each step hands it the requests' block
tables and token counts. A request's key is a block it holds while it lives and no other
request writes (its first block; with ``keep_prompt``, whose requests may share their prompt's
blocks, the block of its first generated slot). Per layer, a request's method state and kept
queries are a row of a slab (one tensor per name and layer), so a step files and reads a group
of requests with one ``index_copy_`` and one ``index_select`` each.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from .attention import StepStats
from .checks import as_int
from .paged_chunks import compact

# Steps a request's key may go unseen before its filed state and kept queries may go to another.
STALE_STEPS = 256


@dataclass
class PagedBatch:
    """One engine step's requests, host-side (built once per step, read by every layer).

    query_start [R+1]: where each request's new tokens start in the flat token axis;
    computed [R]: tokens each request had before this step; prompt [R]: its prompt length (0
    while it is read in chunks); block_table [R, max_blocks] int tensor; phases [R]: "prefill",
    "chunk", "close" or "decode" (:meth:`PagedRequests.batch`; by default "prefill" where
    nothing was computed, else "decode"); closed [R]: the tokens it held at its close (its first
    decode step), from which its decode steps count: its prompt length (the default), or more
    with ``keep_prompt`` when a replay after a preemption recomputed generated tokens too.
    """

    query_start: list[int]
    computed: list[int]
    prompt: list[int]
    block_table: torch.Tensor
    first_block: list | None = None  # [R] each request's key while it lives (its first block)
    phases: list[str] | None = None
    plans: dict = field(default_factory=dict, repr=False)  # index tensors built at the step's first layer
    # [R] where a prompt read in chunks finds its earlier chunks' state, and files this step's
    # (None: first_block; keep_prompt: the last slot's block and the token count, see batch())
    chunk_keys: list | None = None
    closed: list[int] | None = None
    # The model's layers that run this batch, each once and in order (an engine's step), are among
    # the first ``layers``, the last of them layer ``layers - 1`` (an engine's group of layers with
    # blocks of their own passes its last layer + 1, or the model's with ``due``): a layer's due
    # compressions then wait for that layer, which runs them as one batch. None: each layer runs its
    # own (a caller that may run only some layers).
    layers: int | None = None
    # The step's gathered compressions (keepkv.paged_compress), where the batches of an engine's layer
    # groups share one list: each group's layers then gather into it and the model's last layer
    # (``layers`` - 1, whichever group holds it) compresses them together. None: the batch's own.
    due: list | None = None
    # A prompt compressed chunk by chunk (``chunk_blocks``: keepkv.paged_chunks): [R] position - slot
    # of each row's tokens, the prompt's tokens (what a kept prompt freezes, by position), the
    # first slot of the chunk the row's tokens end (-1: none), and the row's wave (a step's rows
    # attend wave after wave, the chunks a wave ends compressed in between). None: rows by position.
    offsets: list[int] | None = None
    frozen: list[int] | None = None
    chunk_starts: list[int] | None = None
    waves: list[int] | None = None
    after_tables: torch.Tensor | None = None  # [R, W] each row's table once the chunk it ends is compressed
    # A prompt compressed chunk by chunk to its whole prompt's budget (RequestSizes.compresses_chunks):
    # [R] the token where each "chunk" row's prompt ends (the engine's prefill end; 0 for other rows).
    # None: prompts read in chunks are held whole until their close.
    ends: list[int] | None = None

    def __post_init__(self):
        if self.first_block is None:
            self.first_block = self.block_table[:, 0].tolist()
        if self.chunk_keys is None:
            self.chunk_keys = [(block, block) for block in self.first_block]
        if self.phases is None:
            self.phases = ["prefill" if done == 0 else "decode" for done in self.computed]
        if self.closed is None:
            self.closed = list(self.prompt)
        if self.offsets is None:
            self.offsets = [0] * len(self.computed)
        if self.frozen is None:
            self.frozen = list(self.prompt)
        self.query_lengths = [end - start for start, end in zip(self.query_start, self.query_start[1:])]


@dataclass
class PromptSoFar:
    """What a prompt read in chunks carries to its next chunk or its close, per layer: the
    method's state, its statistics so far (a method whose prompt statistics need every query row,
    as H2O's column sums) or its newest query rows (one whose need only the last few), and the
    extras the store had."""

    state: dict
    stats: StepStats | None
    queries: torch.Tensor | None  # [1, H, r, D]
    extras: tuple[str, ...]
    step: int  # the step that filed it: a prompt aborted mid-way leaves it behind, dropped once stale
    held: int = 0  # entries per head its slots hold, where its chunks were compressed (0: every token read)


class PagedRequests:
    """The requests of one :class:`~keepkv.paged.PagedCompression`, by key.

    ``chunked``: the engine may split a prompt over several steps; ``keep_prompt``: prompts are
    kept whole and may share leading blocks (both as ``PagedCompression``'s); ``query_rows``: the
    decoding queries kept per request and layer between its compressions (0: none)."""

    def __init__(self, chunked: bool, keep_prompt: bool, query_rows: int, chunk_blocks: int = 0):
        self.chunked, self.keep_prompt, self.query_rows = chunked, keep_prompt, query_rows
        self.chunk_blocks = chunk_blocks  # keep_prompt's prompts compressed chunk by chunk (keepkv.paged_chunks)
        # A slab row goes to a new request when its key is reused, or once its key went unseen
        # for STALE_STEPS steps.
        self._rows: dict = {}  # key -> slab row
        self._seen: dict = {}  # key -> the step it was last seen
        self.steps = 0
        self._slabs: dict[int, dict[str, torch.Tensor]] = {}  # layer -> name -> [rows, ...]
        self._layer_state: dict[int, dict] = {}  # layer -> the state that is not per row
        self._queries: dict[int, torch.Tensor] = {}  # layer -> [rows, query_rows, H, D] kept queries
        self._prompts: dict[int, int | None] = {}  # first block id -> prompt length (None: chunks still coming)
        self.chunks: dict[tuple, PromptSoFar] = {}  # (chunk key, layer) -> a prompt read in chunks, so far
        # keep_prompt: a request's key is the block of its first generated slot (slot P, never
        # shared: no block holding a generated entry is hashed), block -> the tokens it held at its
        # close (P, or more after a replay); and the chunk keys whose prompt has not closed yet.
        self._generated_blocks: dict[int, int] = {}
        self._closing: set = set()
        self._lock = threading.Lock()

    # -- a step's phases ---------------------------------------------------------------------------
    def batch(self, query_start: list[int], seq_lens: list[int], block_table: torch.Tensor,
              prefilling: list[bool] | None = None, block_size: int | None = None,
              prompts: list[int] | None = None, layers: int | None = None, due: list | None = None,
              ends: list[int] | None = None) -> PagedBatch:
        """The step's :class:`PagedBatch`: ``query_start`` [R+1] where each request's new tokens start,
        ``seq_lens`` [R] the tokens each holds after the step, ``block_table`` [R, max_blocks].

        ``prefilling`` [R]: whether each request was still reading its prompt before this step
        (vLLM's ``is_prefilling``; needed when ``chunked``). ``prompts`` [R]: each request's prompt
        length, as the engine's scheduler gave it (vLLM's ``num_prompt_tokens``; needed with
        ``keep_prompt``, which reads it instead of ``prefilling``). Each row gets a phase:

        - "prefill": a whole prompt in one step (not ``chunked``), compressed in this step;
        - "chunk": a part of a prompt (``chunked``), written whole, not compressed yet;
        - "close": the first decode step of a prompt read in chunks: its prompt is compressed,
          then the step decodes;
        - "decode": one new token of a compressed request.

        A request's prompt length is filed under its first block, which it holds until it ends;
        with ``keep_prompt`` (whose requests may share leading blocks) under the block of its first
        generated slot (``block_size``: the engine's, needed then). ``layers``: the model's layers
        that run the batch, each once and in order (:attr:`PagedBatch.layers`), or None; ``due``:
        a list the batches of an engine's other layer groups share (:attr:`PagedBatch.due`), or None.
        ``ends`` [R]: where each request's prompt read in chunks ends (vLLM's prefill end: its
        prompt, or a resumed request's replay), for prompts compressed chunk by chunk
        (:attr:`PagedBatch.ends`); None: they are held whole until their close.
        """
        layers = as_int("layers", layers, low=1, none_ok=True)  # before the step is planned
        if due is not None and not isinstance(due, list):
            raise ValueError(f"due must be a list (the step's, shared by an engine's layer groups) or None, got "
                             f"{type(due).__name__}")
        lengths = [end - start for start, end in zip(query_start, query_start[1:])]
        computed = [seq - length for seq, length in zip(seq_lens, lengths)]
        if self.keep_prompt:
            if block_size is None or prompts is None:
                raise ValueError("a keep_prompt PagedCompression needs the engine's block_size and each request's "
                                 "prompt length")
            if self.chunk_blocks:
                batch = self._chunked_prompt_batch(query_start, seq_lens, block_table, prompts, block_size)
            else:
                batch = self._kept_prompt_batch(query_start, lengths, computed, block_table, prompts, block_size)
        else:
            if self.chunked and prefilling is None:
                raise ValueError("a chunked PagedCompression needs each request's prefilling flag")
            batch = self._prompt_batch(query_start, lengths, computed, block_table, prefilling, ends)
        batch.layers, batch.due = layers, due
        with self._lock:
            self.steps += 1
            for key in batch.first_block:
                self._seen[key] = self.steps
            if self.steps % STALE_STEPS == 0:  # prompts aborted mid-way: their chunks' state goes
                for key in [key for key, prompt in self.chunks.items() if prompt.step < self.steps - STALE_STEPS]:
                    del self.chunks[key]
        return batch

    def _prompt_batch(self, query_start, lengths, computed, block_table, prefilling, ends=None) -> PagedBatch:
        if ends is not None and (len(ends) < len(lengths) or any(  # before any request's phase is filed
                0 < end < done + length for end, done, length, reading in zip(ends, computed, lengths, prefilling)
                if reading or length > 1 or done == 0)):
            raise ValueError(f"paged: a prompt read in chunks must end at or after the tokens read so far, got ends "
                             f"{ends} for {computed} tokens read and {lengths} new")
        first_blocks = block_table[: len(lengths), 0].tolist()
        phases = []
        with self._lock:
            for row, (block, done, length) in enumerate(zip(first_blocks, computed, lengths)):
                reading = self.chunked and (prefilling[row] or length > 1)  # a resumed request replays its outputs too
                if done == 0 and not self.chunked:
                    self._prompts[block] = length
                    phases.append("prefill")
                elif reading or (self.chunked and done == 0):
                    if done == 0:
                        self._prompts[block] = None
                    elif self._prompts.get(block, 0) is not None:
                        raise ValueError(f"paged: a request read more prompt tokens after its prompt was compressed "
                                         f"({length} new tokens after {done})")
                    phases.append("chunk")
                elif length != 1:
                    raise ValueError(
                        "keepkv.vllm needs one token per decode step "
                        f"(got {length} new tokens after {done}): disable speculative decoding"
                        + ("" if self.chunked else ", or let keepkv.vllm read prompts in chunks (chunked prefill)")
                    )
                elif self._prompts.get(block, 0) is None:
                    self._prompts[block] = done
                    phases.append("close")
                elif block not in self._prompts:
                    raise ValueError(f"paged: a decode step ({done} tokens held) of a request whose prompt this "
                                     "PagedCompression never read")
                else:
                    phases.append("decode")
            prompts = [self._prompts[block] or 0 for block in first_blocks]
        if ends is not None:
            ends = [end if phase == "chunk" else 0 for end, phase in zip(ends, phases)]
        return PagedBatch(list(query_start), computed, prompts, block_table[: len(lengths)], first_blocks, phases,
                          ends=ends)

    def _chunked_prompt_batch(self, query_start, seq_lens, block_table, prompts, block_size) -> PagedBatch:
        """:meth:`batch` with ``keep_prompt`` and ``chunk_blocks``: the engine's rows in slots, a step
        that crosses a chunk's end cut there (:func:`keepkv.paged_chunks.compact`), then
        :meth:`_kept_prompt_batch` over them."""
        rows = compact(query_start, seq_lens, block_table[: len(seq_lens)], prompts, block_size, self.chunk_blocks)
        lengths = [end - start for start, end in zip(rows.query_start, rows.query_start[1:])]
        computed = [seq - length for seq, length in zip(rows.seq_lens, lengths)]
        batch = self._kept_prompt_batch(rows.query_start, lengths, computed, rows.block_table, rows.prompts, block_size,
                                        rows.after_tables, rows.shrinks, rows.reading)
        batch.offsets, batch.frozen, batch.chunk_starts = rows.offsets, rows.frozen, rows.chunk_starts
        batch.waves, batch.after_tables = rows.waves, rows.after_tables
        return batch

    def _kept_prompt_batch(self, query_start, lengths, computed, block_table, prompt_lengths, block_size,
                           after_tables=None, shrinks=None, reading=None) -> PagedBatch:
        """:meth:`batch` with ``keep_prompt``: requests may share their leading (prompt) blocks.

        A step that reads the prompt, or several tokens (a replay after a preemption recomputes
        the prompt and the tokens generated before it), is a "chunk" (it may start past a shared
        prefix); its state is filed under (the block of its last slot, the tokens then held),
        which no other request writes, and its next chunk or its first decode step ("close")
        finds it there. At the close the request's key becomes the block of its first generated
        slot P (``prompt_lengths``, the engine's: a replay's generated tokens are never kept as
        prompt), never shared, filed with the tokens held then; a decode step finds it there (a
        block filed for a request that has ended may come back in another request's table, but
        not as its key before its own close refiles it: a chunk step unfiles every block it writes).
        ``after_tables`` [R, W], ``shrinks`` [R] (``chunk_blocks``): a row that ends a chunk files its
        state under its table and slots once the chunk is compressed, where its next part finds it;
        ``reading`` [R]: whether each row starts within its prompt (by position, where slots are not).
        """
        tables = block_table[: len(lengths)].tolist()
        after = tables if after_tables is None else after_tables.tolist()
        shrinks = shrinks or [0] * len(lengths)
        reading = reading or [done < prompt for done, prompt in zip(computed, prompt_lengths)]
        phases, prompts, keys, chunk_keys, closed = [], [], [], [], []
        with self._lock:
            for table, done, length, prompt, after_table, shrink, prompt_read in zip(
                    tables, computed, lengths, prompt_lengths, after, shrinks, reading):
                held = done + length
                if prompt_read or length > 1:  # a resumed request replays its outputs too
                    for index in range(done // block_size, (held - 1) // block_size + 1):
                        self._generated_blocks.pop(table[index], None)  # rewritten: no longer a request's key
                    earlier = (table[(done - 1) // block_size], done) if done else None
                    chunk_key = (after_table[(held - shrink - 1) // block_size], held - shrink)
                    self._closing.discard(earlier)
                    self._closing.add(chunk_key)
                    phases.append("chunk")
                    prompts.append(0)
                    keys.append(None)
                    chunk_keys.append((earlier, chunk_key))
                    closed.append(0)
                    continue
                key = table[prompt // block_size]
                last = (done - 1) // block_size  # the block of the last slot read, if the prompt just closed
                earlier = (table[last] if last < len(table) else None, done)
                if earlier in self._closing:
                    self._closing.discard(earlier)
                    self._generated_blocks[key] = done
                    phases.append("close")
                    chunk_keys.append((earlier, None))
                elif self._generated_blocks.get(key, done + 1) <= done:
                    phases.append("decode")
                    chunk_keys.append((None, None))
                else:
                    raise ValueError(f"paged: a decode step ({done} tokens held) of a request whose prompt this "
                                     "PagedCompression never read")
                prompts.append(prompt)
                keys.append(key)
                closed.append(self._generated_blocks[key])
        return PagedBatch(list(query_start), computed, prompts, block_table[: len(lengths)], keys, phases,
                          chunk_keys=chunk_keys, closed=closed)

    # -- a prompt read in chunks ---------------------------------------------------------------------
    def file_chunk(self, key, layer: int, state: dict, stats: StepStats | None, queries: torch.Tensor | None,
                   extras: tuple, held: int = 0) -> None:
        """What a prompt's chunks gave so far, for its next chunk or its close (``key``: the chunk
        key the step's batch gave it; ``held``: the entries its slots hold, where its chunks were
        compressed, else 0)."""
        self.chunks[key, layer] = PromptSoFar(state, stats, queries, extras, self.steps, held)

    def peek_chunk(self, key, layer: int) -> PromptSoFar | None:
        """What the prompt's earlier chunks filed under ``key`` (None: nothing), left filed."""
        return self.chunks.get((key, layer))

    def take_chunk(self, key, layer: int) -> PromptSoFar | None:
        """What the prompt's earlier chunks filed under ``key`` (None: nothing), unfiled."""
        return self.chunks.pop((key, layer), None)

    # -- per-request rows of a layer's slabs ---------------------------------------------------------
    def slab_row(self, key) -> int:
        """The slab row of request ``key``: its own, or one that a request unseen for
        :data:`STALE_STEPS` steps gives up, or a new one."""
        with self._lock:
            if key in self._rows:
                return self._rows[key]
            stale = [old for old, seen in self._seen.items() if old in self._rows and seen < self.steps - STALE_STEPS]
            if stale:
                row = self._rows.pop(stale[0])
                self._seen.pop(stale[0], None)
            else:
                row = len(self._rows)
                while row in self._rows.values():
                    row += 1
            self._rows[key] = row
            return row

    def slab_rows(self, keys: list) -> torch.Tensor:
        """[R] int64 the slab rows of requests ``keys``."""
        return torch.tensor([self.slab_row(key) for key in keys], dtype=torch.long)

    def file_states(self, state: dict, keys: list, layer: int) -> None:
        """File a layer's method state of requests ``keys``: a per-row tensor (first dimension the
        rows) into their slab rows, anything else as the layer's. A per-row tensor whose trailing
        shape changes from step to step is tied to one step's slots (KeepKV's newest query's
        logits, [R, H_kv, g, S]): the method rewrites it before it reads it (tested against each
        request's own cache), so it is not filed."""
        if not state:
            return
        slabs = self._slabs.setdefault(layer, {})
        shared = self._layer_state.setdefault(layer, {})
        slab_rows = self.slab_rows(keys)
        for name, value in state.items():
            if not (isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == len(keys)):
                shared[name] = value
                continue
            slab = slabs.get(name)
            if slab is not None and (slab.shape[1:] != value.shape[1:] or slab.dtype != value.dtype):
                slabs[name] = None  # a per-step tensor: never filed again
                continue
            if name in slabs and slab is None:
                continue
            slabs[name] = slab = self._grown(value.new_zeros(0, *value.shape[1:]) if slab is None else slab)
            slab.index_copy_(0, slab_rows.to(slab.device), value)

    def states(self, keys: list, layer: int) -> dict:
        """The filed states of requests ``keys`` as one layer's (per-row tensors read from their slabs)."""
        joined = dict(self._layer_state.get(layer, {}))
        slabs = self._slabs.get(layer, {})
        slab_rows = self.slab_rows(keys)
        for name, slab in slabs.items():
            if slab is not None:
                slabs[name] = slab = self._grown(slab)
                joined[name] = slab.index_select(0, slab_rows.to(slab.device))
        return joined

    def keep_queries(self, layer: int, query: torch.Tensor, slab_rows: torch.Tensor, index: torch.Tensor) -> None:
        """Decoding queries [N, H, D] into the kept rows ``index`` [N] of their requests' slab rows [N]."""
        if not self.query_rows:
            return
        slab = self._queries.get(layer)
        rows = max(self._rows.values(), default=0) + 1
        if slab is not None and (slab.dtype, slab.shape[2:]) != (query.dtype, query.shape[1:]):
            slab = None  # another model's queries (an engine of another dtype)
        if slab is None or slab.shape[0] < rows:
            grown = query.new_zeros(max(2 * rows, 8), self.query_rows, *query.shape[1:])
            if slab is not None:
                grown[: slab.shape[0]] = slab
            self._queries[layer] = slab = grown
        slab.index_put_((slab_rows, index), query)

    def kept_queries(self, keys: list, layer: int, count: int) -> torch.Tensor:
        """[R, count, H, D] the first ``count`` kept queries of requests ``keys``, oldest first."""
        slab = self._queries[layer]
        return slab.index_select(0, self.slab_rows(keys).to(slab.device))[:, :count]

    def _grown(self, slab: torch.Tensor) -> torch.Tensor:
        """``slab`` with a row for every request seen (zeros where none was filed), doubled when short."""
        rows = max(self._rows.values(), default=-1) + 1
        if slab.shape[0] >= rows:
            return slab
        grown = slab.new_zeros(max(2 * rows, 8), *slab.shape[1:])
        grown[: slab.shape[0]] = slab
        return grown
