"""A paged step's plan: the rows and index tensors one engine step shares among its layers.

:class:`StepPlan` sorts a step's requests by what they do (:class:`~keepkv.paged_requests.PagedBatch`'s
phases) and builds, once per step (per layer where layers hold different sizes or compress at
intervals of their own, PyramidKV's), the
index tensors the layers read, on the host, from token counts
(:class:`keepkv.budgets.RequestSizes`: what a layer of a request holds after any token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .budgets import RequestSizes
from .kernels.paged import PagedGeometry
from .paged_layout import PagedLayout
from .paged_requests import PagedBatch, PagedRequests


def held(sizes: RequestSizes, batch: PagedBatch, row: int, layer: int, after: bool) -> int:
    """Entries ``row`` of ``batch`` holds in ``layer`` once the step's tokens are in (``after``:
    after the step's compressions too)."""
    phase, done, length = batch.phases[row], batch.computed[row], batch.query_lengths[row]
    if phase == "chunk":  # a prompt read in chunks is held whole until its close, unless compressed chunk by chunk
        end = batch.ends[row] if batch.ends is not None else 0
        if not end:
            return done + length
        written = sizes.read(end, done, layer) + length
        return sizes.read(end, written, layer) if after and done + length < end else written
    if phase == "prefill":  # a whole prompt, compressed in its own step
        return sizes.stored(length, length, layer) if after else length
    prompt, closed = batch.prompt[row], batch.closed[row]
    if after:
        return sizes.stored(prompt, done + 1, layer, closed)
    return sizes.stored(prompt, done, layer, closed) + 1  # what it held, and the step's token


@dataclass
class KernelCall:
    """One engine kernel call's shapes (host int32 tensors) and plan; ``tokens``: the attending
    rows' tokens in the step's token axis (None: every token)."""

    tokens: torch.Tensor | None
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    plan: object


@dataclass
class DecodeCall:
    """keepkv's paged kernel's call over decoding rows (their tokens in the step, block table and
    lengths on the step's device, the longest length, where an entry lives)."""

    tokens: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    max_len: int
    geometry: PagedGeometry


@dataclass
class StepPlan:
    """The step's rows by what they do, and the index tensors shared by its layers (built at its
    first layer: :meth:`build`)."""

    batch: PagedBatch
    sizes: RequestSizes
    closing: list[int]  # close rows: a chunked prompt compressed before its first decode token
    dense: list[list[int]]  # whole prompts over their budget, each alone
    prompts_ending: list[list[int]]  # whole prompts within their budget, attended in place, each alone
    chunks: list[int]  # prompt chunks read in place
    attending: list[int]  # rows whose new tokens are written and attended in place
    decoding: list[int]  # rows decoding a token (close rows too)
    decode_tokens: torch.Tensor
    decode_slab_rows: torch.Tensor
    block_size: int
    keeps_queries: bool = False  # the method reads every decoding query since a compression (PagedRequests.query_rows)
    cache: dict = field(default_factory=dict)
    # keepkv.paged_compress.DueCompression, waiting for the method: the batch's list where it has one
    # (PagedBatch.due, every layer group's), else the plan's own
    due: list = field(default_factory=list)
    # Attending rows by wave (keepkv.paged_chunks: a chunk ended by one wave is compressed before the
    # next attends); [None]: every attending row at once.
    waves: list = field(default_factory=lambda: [None])

    def chunk_ends(self, rows: list[int] | None) -> list[int]:
        """The rows of ``rows`` (None: every attending row) whose tokens end a prompt's chunk."""
        starts = self.batch.chunk_starts
        if starts is None:
            return []
        return [row for row in (self.attending if rows is None else rows) if starts[row] >= 0]

    @classmethod
    def build(cls, sizes: RequestSizes, requests: PagedRequests, batch: PagedBatch, block_size: int,
              device) -> "StepPlan":
        closing, dense, ending, chunks, attending, decoding = [], [], [], [], [], []
        layers = range(sizes.config.num_hidden_layers)
        for row, phase in enumerate(batch.phases):
            length = batch.query_lengths[row]
            if phase == "prefill":
                if length > min(sizes.stored(length, length, layer) for layer in layers):
                    dense.append([row])
                    continue
                ending.append([row])
            elif phase == "chunk":
                chunks.append(row)
            else:
                if phase == "close":
                    closing.append(row)
                decoding.append(row)
            attending.append(row)
        tokens = torch.tensor([batch.query_start[r] for r in decoding], dtype=torch.long)
        slab_rows = requests.slab_rows([batch.first_block[r] for r in decoding])
        plan = cls(batch, sizes, closing, dense, ending, chunks, attending, decoding, tokens.to(device),
                   slab_rows.to(device), block_size, bool(requests.query_rows))
        if batch.due is not None:
            plan.due = batch.due
        if batch.waves is not None and max(batch.waves, default=0) > 0:
            plan.waves = [[row for row in attending if batch.waves[row] == wave] for wave in range(max(batch.waves) + 1)]
        return plan

    # -- sizes ----------------------------------------------------------------------------------
    def held(self, rows, layer: int, when: str) -> tuple:
        """Entries each of ``rows`` holds in ``layer``, per head: "written" once a prompt that ended
        is compressed (a close row's) and the step's tokens are in (what the kernel reads); "after"
        the step, compressions included."""
        key = ("sizes", tuple(rows), layer if self.sizes.layered else 0, when)
        if key not in self.cache:
            self.cache[key] = tuple(held(self.sizes, self.batch, row, layer, when == "after") for row in rows)
        return self.cache[key]

    def closed_sizes(self, rows: list[int], layer: int) -> tuple:
        """Entries each of ``rows`` (close rows) holds in ``layer`` once its prompt is compressed."""
        batch = self.batch
        return tuple(self.sizes.stored(batch.prompt[r], batch.computed[r], layer, batch.closed[r]) for r in rows)

    def budgets(self, rows: list[int], layer: int, device) -> tuple:
        """([R, H_kv] entries layer ``layer`` keeps, [R] mean budgets, [R] kept prompts or None, [R]
        the entries a kept prompt holds or None), as the Hugging Face cache sets them when a
        prompt ends (``keepkv.budgets.prompt_budgets``). A kept prompt freezes its positions below
        its length; compressed chunk by chunk it holds fewer entries than that (``frozen_held``)."""
        key = ("budgets", tuple(rows), layer)
        if key not in self.cache:
            sizes = self.sizes
            prompts = [self.batch.prompt[r] for r in rows]  # every row but a chunk's knows its prompt
            # A row's budgets are its prompt's alone (its share, the allocation and its fit are per
            # row): the request's sizes, known per prompt length, the same for every head.
            budget = torch.tensor([sizes.kept(prompt, layer) for prompt in prompts])
            mean = torch.tensor([sizes.mean(prompt) for prompt in prompts])
            frozen = held = None
            if sizes.keep_prompt:
                frozen = torch.tensor([self.batch.frozen[r] for r in rows]).to(device)
                held = torch.tensor(prompts).to(device) if any(self.batch.offsets[r] for r in rows) else None
            kv_heads = sizes.config.num_key_value_heads
            self.cache[key] = (budget[:, None].repeat(1, kv_heads).to(device), mean.to(device), frozen, held)
        return self.cache[key]

    def compresses_chunk(self, row: int, layer: int) -> bool:
        """Whether chunk row ``row`` is compressed in ``layer`` once attended: its prompt is
        compressed chunk by chunk (:attr:`PagedBatch.ends`), the row does not end it, and the layer
        then holds more than the whole prompt's budget (:meth:`keepkv.budgets.RequestSizes.read`)."""
        batch = self.batch
        if batch.ends is None or not batch.ends[row]:
            return False
        if batch.computed[row] + batch.query_lengths[row] >= batch.ends[row]:
            return False
        return held(self.sizes, batch, row, layer, True) < held(self.sizes, batch, row, layer, False)

    def chunk_budgets(self, row: int, layer: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """([1, H_kv] entries, [1] mean budget) of chunk row ``row``'s whole prompt in ``layer``, as
        the Hugging Face cache compresses a chunk (``LayerStep.compress_chunk``)."""
        end = self.batch.ends[row]
        budget = torch.full((1, self.sizes.config.num_key_value_heads), self.sizes.kept(end, layer), device=device)
        return budget, torch.tensor([self.sizes.mean(end)], device=device)

    def interval(self, rows: list[int], layer: int) -> int:
        """The decode interval of ``layer`` for rows compressed together: the rows due together
        share it (:meth:`compressing` groups them by it); rows closing together may not (a budget
        below the method's interval), and take the shortest."""
        return min(self.sizes.interval(self.batch.prompt[r], layer) for r in rows)

    def _intervals(self, layer: int) -> tuple[int, ...]:
        """Each decoding row's decode interval in ``layer`` (a layer of a small budget compresses
        more often: :meth:`keepkv.budgets.RequestSizes.interval`)."""
        key = ("intervals", layer if self.sizes.layered else 0)
        if key not in self.cache:
            self.cache[key] = tuple(self.sizes.interval(self.batch.prompt[r], layer) for r in self.decoding)
        return self.cache[key]

    def compressing(self, layer: int) -> list[list[int]]:
        """The decoding rows due to compress in ``layer`` (their layer's interval came round), by
        equal size: rows that hold as many entries run together (their new entries are then the
        store's last slots, as in the Hugging Face cache)."""
        intervals = self._intervals(layer)
        key = ("compressing", intervals, self.held(self.decoding, layer, "written"))
        if key not in self.cache:
            batch, by_size = self.batch, {}
            for row, interval in zip(self.decoding, intervals):
                decoded = batch.computed[row] - batch.closed[row] + 1  # decode steps so far, this one too
                if decoded % interval == 0:
                    size = held(self.sizes, batch, row, layer, False)
                    by_size.setdefault((batch.prompt[row] if self.sizes.keep_prompt else 0, interval, size), []).append(row)
            self.cache[key] = list(by_size.values())
        return self.cache[key]

    def query_index(self, layer: int) -> torch.Tensor:
        """[N] where each decoding row's query goes among its kept queries in ``layer``: its decode
        steps since its last compression of that layer (0 where no query is kept)."""
        intervals = self._intervals(layer)
        key = ("query index", intervals)
        if key not in self.cache:
            batch = self.batch
            self.cache[key] = torch.tensor([(batch.computed[r] - batch.closed[r]) % interval if self.keeps_queries else 0
                                            for r, interval in zip(self.decoding, intervals)],
                                           dtype=torch.long).to(self.decode_tokens.device)
        return self.cache[key]

    def starts(self, rows: list[int]) -> tuple:
        """The first slot each row may write: with ``keep_prompt`` a prompt's slots (which its own
        steps, or another request's, a shared prefix, wrote) are never written again."""
        return tuple(self.batch.prompt[r] for r in rows) if self.sizes.keep_prompt else (0,) * len(rows)

    # -- index tensors -------------------------------------------------------------------------
    def blocks_of(self, rows: list[int], size: int) -> torch.Tensor:
        """[R, ceil(size / block_size)] int64 the rows' blocks holding slots 0..size-1."""
        key = ("blocks", tuple(rows), size)
        if key not in self.cache:
            count = max(1, math.ceil(size / self.block_size))
            self.cache[key] = self.batch.block_table[rows][:, :count].long()
        return self.cache[key]

    def orders(self, kernel, layout: PagedLayout) -> tuple[torch.Tensor, torch.Tensor]:
        key = ("orders", layout)
        if key not in self.cache:
            self.cache[key] = kernel.orders(layout.block_size, layout.head_dim, layout.dtype)
        return self.cache[key]

    def new_slots(self, layer: int):
        """(slots [N] int64, tokens [N] or None: the attending rows' tokens, positions [N] int64):
        where each attending row's new tokens go (its next slots) and the positions they are. Only
        the slots depend on the layer (a layered method's rows hold more entries in some layers):
        the rest is the step's, and so are the tensors returned for them, in every layer."""
        sizes = self.held(self.attending, layer, "written")
        key = ("new", sizes)
        if key not in self.cache:
            row, within, lengths, table, tokens, positions = self._new_tokens()
            size = self.block_size
            if len(row) == len(self.attending):  # a token a row (a decode step): its slot is its row's last
                if "tables" not in self.cache:
                    self.cache["tables"] = table.tolist()
                tables = self.cache["tables"]
                slots = torch.tensor([tables[index][(count - 1) // size] * size + (count - 1) % size
                                      for index, count in enumerate(sizes)])
            else:
                slot = (torch.tensor(sizes) - lengths)[row] + within  # each new token's slot: after what its row held
                slots = table[row, slot // size] * size + slot % size
            self.cache[key] = (slots.to(self.decode_tokens.device), tokens, positions)
        return self.cache[key]

    def _new_tokens(self) -> tuple:
        """The step's new tokens, every layer's: (row [N], each one's attending row; within [N], its
        index in its row; lengths [R]; the rows' block tables [R, blocks] int64; tokens [N] on the
        step's device or None (every token); positions [N] on the step's device)."""
        if "new tokens" not in self.cache:
            batch, device = self.batch, self.decode_tokens.device
            lengths = torch.tensor([batch.query_lengths[r] for r in self.attending])
            total = int(lengths.sum())
            row = torch.repeat_interleave(torch.arange(len(self.attending)), lengths, output_size=total)
            within = torch.arange(total) - (lengths.cumsum(0) - lengths)[row]
            tokens = torch.tensor([batch.query_start[r] for r in self.attending])[row] + within
            positions = torch.tensor([batch.computed[r] + batch.offsets[r] for r in self.attending])[row] + within
            every = total == batch.query_start[-1]
            self.cache["new tokens"] = (row, within, lengths, batch.block_table[self.attending].long(),
                                        None if every else tokens.to(device), positions.to(device))
        return self.cache["new tokens"]

    def word_rows(self, layout: PagedLayout, slots: torch.Tensor) -> torch.Tensor:
        """[N, H_kv, M] indices of the words of slots [N] in the flat fp32 view."""
        key = ("words", layout, slots.data_ptr(), slots.numel())
        if key not in self.cache:
            block, offset = slots // layout.block_size, slots % layout.block_size
            first = layout.word_index(block[:, None], torch.arange(layout.kv_heads, device=slots.device)[None, :],
                                      offset[:, None])
            self.cache[key] = first[..., None] + torch.arange(layout.words, device=slots.device)
        return self.cache[key]

    def fresh_words(self, extras: dict, fills: dict, layout: PagedLayout, positions: torch.Tensor) -> torch.Tensor:
        """[N, H_kv, M] the words of new entries at ``positions`` [N] (:meth:`new_slots`'s, the same
        tensor in every layer of the step): position, bias 0, every extra at its fill."""
        key = ("fresh", layout, positions.data_ptr(), positions.numel())
        if key not in self.cache:
            words = [0.0] * layout.biased
            for name, shape in extras.items():
                words += [fills[name]] * math.prod(shape)
            tail = torch.tensor(words, dtype=torch.float32, device=positions.device)
            fresh = torch.cat([positions.float()[:, None], tail[None].expand(len(positions), -1)], dim=1)
            self.cache[key] = fresh[:, None].expand(-1, layout.kv_heads, -1)
        return self.cache[key]

    def kernel_call(self, kernel, layer: int, layout: PagedLayout, num_heads: int, rows: list[int]) -> KernelCall:
        """The engine kernel's call over ``rows`` (attending rows, in step order)."""
        batch = self.batch
        sizes = self.held(rows, layer, "written")
        key = ("call", tuple(rows), sizes)
        if key not in self.cache:
            lengths = [batch.query_lengths[r] for r in rows]
            starts = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
            tokens = None
            if len(rows) != len(batch.phases):
                tokens = torch.cat([torch.arange(batch.query_start[r], batch.query_start[r + 1]) for r in rows])
                tokens = tokens.to(self.decode_tokens.device)
            seq_lens = torch.tensor(sizes, dtype=torch.int32)
            table = batch.block_table[rows].to(torch.int32)
            self.cache[key] = KernelCall(tokens, starts, seq_lens, table, kernel.plan(starts, seq_lens, num_heads, layout))
        return self.cache[key]

    def compressed(self, layer: int) -> tuple[int, ...]:
        """The decoding rows that layer ``layer`` of a request has compressed (it holds fewer entries
        than it has seen): the only ones whose entries may carry votes, and the only ones keepkv's
        paged kernel attends. A request never compressed holds every token, unmerged, and is
        attended as stock's."""
        key = ("compressed", layer if self.sizes.layered else 0)
        if key not in self.cache:
            sizes = self.held(self.decoding, layer, "written")
            self.cache[key] = tuple(row for row, size in zip(self.decoding, sizes) if size < self.batch.computed[row] + 1)
        return self.cache[key]

    def engine_rows(self, ours: tuple[int, ...]) -> list[int]:
        """The attending rows not among ``ours``: the engine's kernel attends them."""
        key = ("engine", ours)
        if key not in self.cache:
            theirs = set(ours)
            self.cache[key] = [row for row in self.attending if row not in theirs]
        return self.cache[key]

    def decode_call(self, rows: tuple, layer: int, geometry: PagedGeometry) -> DecodeCall:
        """keepkv's paged kernel's call over decoding ``rows``, in blocks as ``geometry`` says (the
        tokens and block table the step's, the lengths the layer's)."""
        sizes = self.held(rows, layer, "written")
        key = ("decode", rows, sizes, geometry)
        if key not in self.cache:
            device = self.decode_tokens.device
            if ("decode rows", rows) not in self.cache:
                self.cache["decode rows", rows] = (
                    torch.tensor([self.batch.query_start[r] for r in rows], device=device),
                    self.batch.block_table[list(rows)].to(device=device, dtype=torch.int32))
            tokens, table = self.cache["decode rows", rows]
            seq_lens = torch.tensor(sizes, dtype=torch.int32, device=device)
            self.cache[key] = DecodeCall(tokens, table, seq_lens, max(sizes), geometry)
        return self.cache[key]

    def index_among(self, attended: tuple, rows: list[int]) -> torch.Tensor:
        """[R] where ``rows`` are among ``attended`` (rows of one kernel call)."""
        key = ("index", attended, tuple(rows))
        if key not in self.cache:
            where = {row: index for index, row in enumerate(attended)}
            self.cache[key] = torch.tensor([where[row] for row in rows], device=self.decode_tokens.device)
        return self.cache[key]
