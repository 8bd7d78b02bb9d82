"""The paged adapter: methods run on requests whose entries live in a serving engine's blocks,
and the engine's own kernel attends over them in place.

A serving engine (vLLM) stores each request's KV entries in blocks of ``block_size`` slots listed
in a block table, and frees whole blocks. Here every head of a request holds the same number of
entries, S, in its slots 0..S-1 (S is known from token counts alone: :meth:`PagedCompression.stored`),
so to the engine's kernel a compressed request is an ordinary shorter sequence with its own block
table, and an uncompressed one is exactly what stock vLLM holds. The planes of a block (keys and
values in the kernel's packing, the method's fp32 words beside them) are
:mod:`keepkv.paged_layout`'s. One layer's step over a batch of requests:

1. the prompts that ended are compressed (a prompt read in chunks, at its first decode step);
2. the step's keys and values go in through the engine's own cache write, at each request's
   next slots, with their words (position, the method's extras at their fill);
3. the engine's kernel attends every request in one call, over its slots, in place;
4. a decoding request's query is kept (a few rows per request and layer): the method's
   statistics are computed when it compresses, not at every step;
5. the requests whose ``interval`` came round are compressed: their slots are read once into a
   :class:`~keepkv.store.LayerStore`, the method observes the queries kept since its last
   compression and compresses (:class:`~keepkv.step.LayerStep`, the Hugging Face path's code),
   and the kept entries are written back into the leading slots.

Between compressions nothing reads a request's cache but the kernel. A method that needs the
attention of every decoding query (H2O's and SnapKV's accumulated scores, KeepKV's EMA) gets it
at the compression, from the kept queries against the keys: the entries a query saw are those
still held at its position (nothing is evicted or merged between compressions), so its
probabilities are the ones it had. This module knows nothing of vLLM (``keepkv.vllm`` wires it
in, with vLLM's kernel); :class:`~keepkv.paged_layout.TorchPagedKernel` is the reference kernel.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from .attention import Needs, StepStats, attend, group_queries, join_prefill_stats, scaled_logits, softmax_probs
from .budgets import (MAX_BUDGET, capacity_bound, check_keep_prompt, decode_interval, held_entries, prompt_budgets,
                      validate_budget)
from .methods import METHODS, get_method
from .methods.base import ComposedMethod, serving_refusal, served_names
from .kernels.paged import PagedGeometry, cpu_backend, numba_threads, paged_decode
from .paged_layout import NEG_INF, PagedKernel, PagedLayout, TorchPagedKernel
from .step import LayerStep
from .store import LayerStore

def servable_method(spec: str) -> ComposedMethod:
    """The method of ``spec`` (a name or variant, ``"snapkv+window=16"``) if the paged adapter
    serves it (what the method and its parts declare: ``keepkv.methods.base.serving_refusal``);
    otherwise ValueError, in one line naming what it serves."""
    methods, selections, merges = served_names()
    served = (f"keepkv.vllm serves {', '.join(sorted(methods))} (selections {', '.join(sorted(selections))}; "
              f"merge {' or '.join(sorted(merges))})")
    if not isinstance(spec, str) or spec.split("+")[0] not in METHODS:
        raise ValueError(f"{served}; got {spec!r}")
    method = get_method(spec)
    reason = serving_refusal(method)
    if reason is not None:
        in_its_words = method.not_served or (method.merging is not None and (
            method.merging.refresh_interval is not None or method.selection.serving_refusal() is not None
            or (method.allocates_from_all_layers and method.selection.served)))
        raise ValueError(f"keepkv.vllm does not serve {reason}; got {spec!r}" if in_its_words else f"{served}; got {spec!r}")
    return method


SERVED_METHODS = tuple(sorted(served_names()[0]))  # what the refusal names, for callers that list them


def rank_config(config, num_heads: int, num_kv_heads: int, rank: int = 0) -> SimpleNamespace:
    """The model's ``config`` as tensor-parallel rank ``rank`` holds it: the model's depth, and the
    ``num_heads`` query heads and ``num_kv_heads`` KV heads of the rank (vLLM gives a rank
    ``num_attention_heads // tp`` and ``num_key_value_heads // tp``, rank r the KV heads from
    ``first_kv_head = r * num_kv_heads``). A :class:`PagedCompression` given it shapes its budgets
    [L, B, H_kv], its slots' words and its stores by the rank's heads, and hands a method with
    parameters per KV head of the model (the learned selection's scorer) the rank's first head.

    Each rank's query heads must be whole groups of its KV heads (``num_heads`` a multiple of
    ``num_kv_heads``, the model's group size): a KV head replicated over ranks, each holding part of
    its group, is not such a rank (ValueError, in one line).
    """
    group = config.num_attention_heads // config.num_key_value_heads
    if num_kv_heads < 1 or num_heads != group * num_kv_heads:
        raise ValueError(f"a rank of {num_heads} query heads and {num_kv_heads} KV heads does not hold whole groups of "
                         f"the model's {group} query heads per KV head")
    return SimpleNamespace(num_hidden_layers=config.num_hidden_layers, num_attention_heads=num_heads,
                           num_key_value_heads=num_kv_heads, first_kv_head=rank * num_kv_heads)


# Intra-op threads of a compression's method work: hundreds of small tensor ops over [R, H_kv, S];
# each one that forks a parallel region waits for every one of the engine's threads, which vLLM
# pins to cores, so on a busy host an op of microseconds waits for a scheduler tick. One thread
# runs them back to back; the kernel and the model's matmuls keep the engine's threads.
STEP_THREADS = 1
# A prompt's compression (and a prompt's statistics, O(prompt²) for H2O) keeps the engine's threads.
PROMPT_THREADS = 0
# Steps a request's key may go unseen before its filed state and kept queries may go to another.
STALE_STEPS = 256


@contextlib.contextmanager
def _threads(count: int):
    """Run the block with ``count`` intra-op threads (``torch._C``'s setter: vLLM's CPU worker
    replaces ``torch.set_num_threads`` with a no-op after pinning its threads)."""
    before = torch.get_num_threads()
    if count and count != before:
        torch._C.set_num_threads(count)
    try:
        yield
    finally:
        if count and count != before:
            torch._C.set_num_threads(before)


@dataclass
class PagedBatch:
    """One engine step's requests, host-side (built once per step, read by every layer).

    query_start [R+1]: where each request's new tokens start in the flat token axis;
    computed [R]: tokens each request had before this step; prompt [R]: its prompt length (0
    while it is read in chunks); block_table [R, max_blocks] int tensor; phases [R]: "prefill",
    "chunk", "close" or "decode" (:meth:`PagedCompression.batch`; by default "prefill" where
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

    def __post_init__(self):
        if self.first_block is None:
            self.first_block = self.block_table[:, 0].tolist()
        if self.chunk_keys is None:
            self.chunk_keys = [(block, block) for block in self.first_block]
        if self.phases is None:
            self.phases = ["prefill" if done == 0 else "decode" for done in self.computed]
        if self.closed is None:
            self.closed = list(self.prompt)
        self.query_lengths = [end - start for start, end in zip(self.query_start, self.query_start[1:])]


@dataclass
class _Prompt:
    """What a prompt read in chunks carries to its next chunk or its close, per layer: the
    method's state, its statistics so far (a method whose prompt statistics need every query row,
    as H2O's column sums) or its newest query rows (one whose need only the last few), and the
    extras the store had."""

    state: dict
    stats: StepStats | None
    queries: torch.Tensor | None  # [1, H, r, D]
    extras: tuple[str, ...]
    step: int  # the step that filed it: a prompt aborted mid-way leaves it behind, dropped once stale


class PagedCompression:
    """One method and budget over paged requests: sizes, capacity, and one layer's step.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config (depth, heads and KV heads), or one tensor-parallel rank's view of it
        (:func:`rank_config`): budgets, words and stores are shaped by the heads it names.
    method : str
        A method of :data:`SERVED_METHODS`, or a variant (``"snapkv+window=16"``).
    budget : float or int
        As :class:`~keepkv.cache.CompressedCache`'s: a fraction of each request's prompt, or an
        entry count.
    chunked : bool
        The engine may split a prompt over several steps (vLLM's chunked prefill). Every prompt
        then goes through :meth:`batch`'s "chunk" rows: its entries are written whole, and it is
        compressed at its first decode step, when it is known to be whole (the engine says only
        whether a prompt is still being read, so its last chunk is not known while it runs).
    keep_prompt : bool
        As ``CompressedCache(decoding="keep_prompt")``: a prompt is never compressed (its slots
        are never written after its own steps wrote them, so an engine may share its blocks:
        prefix caching), and ``budget`` (an int) of each request's generated entries are kept. A
        prompt may start past a shared prefix; prompts are read as ``chunked`` ones, and each
        step's :meth:`batch` is given each request's prompt length.
    kernel : PagedKernel
        The engine's cache write and attention (default: :class:`~keepkv.paged_layout.TorchPagedKernel`).
    """

    def __init__(self, config, method: str, budget: int | float, chunked: bool = False, keep_prompt: bool = False,
                 kernel: PagedKernel | None = None):
        validate_budget(budget)
        self.method = servable_method(method).for_heads(getattr(config, "first_kv_head", 0))
        if keep_prompt:
            check_keep_prompt(self.method, budget)
        self.config = config
        self.budget = budget
        self.keep_prompt = keep_prompt
        self.chunked = chunked or keep_prompt
        self.spec = method
        self.kernel = kernel if kernel is not None else TorchPagedKernel()
        self.step = LayerStep(self.method, self.decoding)
        # Budget 1.0 is the identity: requests are attended in place and nothing else runs.
        self.keeps_everything = isinstance(budget, float) and budget == 1.0
        self.biased = self.method.merging.writes_bias  # votes: a bias word, and keys wide enough to carry it
        # What a method reads of a prompt: "summed" statistics of every chunk's query rows (H2O's
        # column sums), or only its newest rows, computed once the prompt is whole.
        needs = self.method.needs(True)
        self._sums_prompt = bool(needs.probs or needs.colsum or needs.decays or needs.logits or needs.colmax)
        self._prompt_rows = self.method.prefill_query_rows()
        decode = self.method.needs(False)
        # Query rows kept per request and layer between compressions: the attention every decoding
        # query gave (probabilities, logits), or the newest query a merge reads.
        self._query_rows = self.method.interval if (decode.probs or decode.logits or self.biased) else 0
        # keep_prompt: a compression reads only the generated entries (see _compress).
        self._generated_alone = keep_prompt and not self.method.reads_every_entry
        # The method's per-layer state and kept queries of each request, a row per request (its key)
        # in one slab per layer and name: a step files and reads a group's rows with one index_copy_
        # and one index_select each. A row goes to a new request when its key is reused, or once
        # its key went unseen for STALE_STEPS steps.
        self._rows: dict = {}  # key -> slab row
        self._seen: dict = {}  # key -> the step it was last seen
        self._steps = 0
        self._slabs: dict[int, dict[str, torch.Tensor]] = {}  # layer -> name -> [rows, ...]
        self._layer_state: dict[int, dict] = {}  # layer -> the state that is not per row
        self._queries: dict[int, torch.Tensor] = {}  # layer -> [rows, interval, H, D] kept queries
        self._prompts: dict[int, int | None] = {}  # first block id -> prompt length (None: chunks still coming)
        self.chunks: dict[tuple, _Prompt] = {}  # (chunk key, layer) -> a prompt read in chunks, so far
        self._kept: dict[int, list[int]] = {}  # prompt length -> entries each layer keeps
        self._intervals: dict[int, int] = {}  # prompt length -> decode steps between compressions
        # keep_prompt: a request's key is the block of its first generated slot (slot P, never
        # shared: no block holding a generated entry is hashed), block -> the tokens it held at its
        # close (P, or more after a replay); and the chunk keys whose prompt has not closed yet.
        self._generated_blocks: dict[int, int] = {}
        self._closing: set = set()
        self._lock = threading.Lock()

    # -- sizes, from token counts only -------------------------------------------------------
    @property
    def decoding(self) -> str:
        """The decoding of the Hugging Face path it matches (``CompressedCache(decoding=...)``)."""
        return "keep_prompt" if self.keep_prompt else "compress"

    @functools.cached_property
    def _extras(self) -> tuple[dict, dict]:
        """The method's per-entry extras, as it declares them: ({name: trailing shape}, {name: fill})
        (read on first use: a scheduler's sizes need no head counts beyond the KV heads)."""
        config = self.config
        declared = self.method.entry_extras(config.num_attention_heads // config.num_key_value_heads)
        return ({name: extra.trailing for name, extra in declared.items()},
                {name: extra.fill for name, extra in declared.items()})

    @property
    def extras(self) -> dict[str, tuple]:
        """The method's per-entry extras: name -> trailing shape (() for one word per entry)."""
        return self._extras[0]

    @property
    def extra_fill(self) -> dict[str, float]:
        return self._extras[1]

    @property
    def meta_words(self) -> int:
        """fp32 words per slot and KV head: the position, the bias (a merging method's), each extra's words."""
        return 1 + self.biased + sum(math.prod(shape) for shape in self.extras.values())

    def layout(self, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> PagedLayout:
        """The planes of this method's blocks (:class:`~keepkv.paged_layout.PagedLayout`)."""
        return _layout(self.kernel, block_size, kv_heads, head_dim, dtype, self.biased, self.meta_words)

    def content_bytes(self, head_dim: int, dtype: torch.dtype, block_size: int = 128) -> int:
        """Bytes per slot and KV head of the paged layout (key, value, words: vLLM's ``state_content_bytes``)."""
        return self.layout(block_size, self.config.num_key_value_heads, head_dim, dtype).cell_bytes

    def kept(self, prompt_length: int, layer: int = 0) -> int:
        """Entries per head ``layer`` of a request keeps once compressed (``keepkv.budgets.prompt_budgets``,
        the Hugging Face cache's rule; the same for every head of a layer, and for every layer but
        PyramidKV's), fixed by the prompt's length."""
        if prompt_length not in self._kept:
            budgets, _ = prompt_budgets(self.method, self.budget, self.decoding, self.config.num_hidden_layers,
                                        self.config.num_key_value_heads, torch.tensor([prompt_length]))
            layers = self.config.num_hidden_layers
            self._kept[prompt_length] = [MAX_BUDGET] * layers if budgets is None else budgets[:, 0, 0].tolist()
        return self._kept[prompt_length][layer]

    def interval(self, prompt_length: int) -> int:
        """Decode steps between a request's compressions (``keepkv.budgets.decode_interval``: the
        method's, but no more than its smallest budget beyond a kept prompt), as the Hugging Face
        cache of that request alone compresses."""
        if prompt_length not in self._intervals:
            budgets = torch.tensor([self.kept(prompt_length, layer) for layer in range(self.config.num_hidden_layers)])
            self._intervals[prompt_length] = decode_interval(
                self.method.interval, budgets - (prompt_length if self.keep_prompt else 0))
        return self._intervals[prompt_length]

    def stored(self, prompt_length: int, computed: int, layer: int = 0, closed: int | None = None) -> int:
        """Entries ``layer`` of a request holds per head after ``computed`` tokens (prompt included).

        A layer keeps min(prompt, budget - (k - 1)) after the prefill, takes one entry per decode
        step and shrinks back every k = :meth:`interval` steps: min(P + t, budget - (k - 1) + t mod
        k) after t decode steps (``keepkv.budgets.held_entries``), never more than its budget.
        ``closed``: the tokens it held at its close when more than its
        prompt (``keep_prompt``, a replay after a preemption: :class:`PagedBatch`); t counts from
        there, and every entry is held until its first compression, ``interval`` steps later.
        """
        closed = prompt_length if closed is None else closed
        interval = self.interval(prompt_length)
        if self.keep_prompt and computed - closed < interval:
            return computed  # nothing compressed since its close (a kept prompt's close compresses nothing)
        return held_entries(self.kept(prompt_length, layer), closed, computed, interval)

    def capacity(self, prompt_length: int) -> int:
        """Slots a request needs at most (``keepkv.capacity_bound``, the largest layer)."""
        return max(capacity_bound(self.method, prompt_length, self.budget, self.config, self.keep_prompt))

    # -- one step's phases ------------------------------------------------------------------------
    def batch(
        self, query_start: list[int], seq_lens: list[int], block_table: torch.Tensor,
        prefilling: list[bool] | None = None, block_size: int | None = None, prompts: list[int] | None = None,
    ) -> PagedBatch:
        """The step's :class:`PagedBatch`.

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
        generated slot (``block_size``: the engine's, needed then).
        """
        lengths = [end - start for start, end in zip(query_start, query_start[1:])]
        computed = [seq - length for seq, length in zip(seq_lens, lengths)]
        if self.keep_prompt:
            if block_size is None or prompts is None:
                raise ValueError("a keep_prompt PagedCompression needs the engine's block_size and each request's "
                                 "prompt length")
            batch = self._kept_prompt_batch(query_start, lengths, computed, block_table, prompts, block_size)
        else:
            if self.chunked and prefilling is None:
                raise ValueError("a chunked PagedCompression needs each request's prefilling flag")
            batch = self._prompt_batch(query_start, lengths, computed, block_table, prefilling)
        with self._lock:
            self._steps += 1
            for key in batch.first_block:
                self._seen[key] = self._steps
            if self._steps % STALE_STEPS == 0:  # prompts aborted mid-way: their chunks' state goes
                for key in [key for key, prompt in self.chunks.items() if prompt.step < self._steps - STALE_STEPS]:
                    del self.chunks[key]
        return batch

    def _prompt_batch(self, query_start, lengths, computed, block_table, prefilling) -> PagedBatch:
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
        return PagedBatch(list(query_start), computed, prompts, block_table[: len(lengths)], first_blocks, phases)

    def _kept_prompt_batch(self, query_start, lengths, computed, block_table, prompt_lengths, block_size) -> PagedBatch:
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
        """
        tables = block_table[: len(lengths)].tolist()
        phases, prompts, keys, chunk_keys, closed = [], [], [], [], []
        with self._lock:
            for table, done, length, prompt in zip(tables, computed, lengths, prompt_lengths):
                held = done + length
                if done < prompt or length > 1:  # a resumed request replays its outputs too
                    for index in range(done // block_size, (held - 1) // block_size + 1):
                        self._generated_blocks.pop(table[index], None)  # rewritten: no longer a request's key
                    earlier = (table[(done - 1) // block_size], done) if done else None
                    chunk_key = (table[(held - 1) // block_size], held)
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

    def forward(self, kv_cache: torch.Tensor, query, key, value, batch: PagedBatch, scaling: float, layer: int = 0):
        """One attention call of every request in ``batch``, for the model's layer ``layer``.

        kv_cache [blocks, H_kv, block_size, C]; query [T, H, D]; key, value [T, H_kv, D] (T: the
        step's new tokens, request after request). Writes the step's entries into kv_cache,
        compresses the requests that are due, and returns the attention output [T, H, D].
        """
        kv_heads, block_size = kv_cache.shape[1:3]
        layout = self.layout(block_size, kv_heads, query.shape[-1], kv_cache.dtype)
        plan = self._plan(batch, layer, block_size, query.device)
        planes = layout.planes(kv_cache)
        output = query.new_empty(query.shape)
        if self.keeps_everything:  # budget 1.0: the full cache, attended in place
            with _threads(STEP_THREADS):
                self._write_new(planes, layout, batch, plan, key, value, layer)
            self._attend(planes, layout, batch, plan, query, scaling, layer, output, kv_cache)
            return output
        for row in plan.closing:  # a prompt read in chunks, whole now: compressed before its first decode token
            with _threads(PROMPT_THREADS):
                self._close(planes, layout, batch, plan, [row], scaling, layer)
        for rows in plan.dense:  # a whole prompt over its budget: attended and compressed before it is written
            with _threads(PROMPT_THREADS):
                self._dense_prompt(planes, layout, batch, plan, rows, query, key, value, scaling, layer, output)
        if plan.attending:
            with _threads(STEP_THREADS):  # a few small writes: the new tokens' slots and words
                self._write_new(planes, layout, batch, plan, key, value, layer)
            self._attend(planes, layout, batch, plan, query, scaling, layer, output, kv_cache)
        for rows in plan.prompts_ending:  # a whole prompt within its budget, attended in place: its statistics
            with _threads(PROMPT_THREADS):
                self._close(planes, layout, batch, plan, rows, scaling, layer, new=(query, key, value))
        for row in plan.chunks:
            with _threads(PROMPT_THREADS):
                self._file_chunk(planes, layout, batch, plan, row, query, key, value, scaling, layer)
        if plan.decoding:
            with _threads(STEP_THREADS):
                self._keep_queries(plan, query, layer)
        for rows in plan.compressing:
            with _threads(STEP_THREADS):
                self._compress(planes, layout, batch, plan, rows, query, scaling, layer)
        return output

    # -- the step's plan: rows, sizes and index tensors, built at its first layer -------------------
    def _plan(self, batch: PagedBatch, layer: int, block_size: int, device) -> "_StepPlan":
        if "step" not in batch.plans:
            batch.plans["step"] = _StepPlan.build(self, batch, block_size, device)
        return batch.plans["step"]

    def _sizes(self, batch: PagedBatch, rows, layer: int, when: str) -> tuple:
        """Entries each of ``rows`` holds in layer ``layer``, per head, from token counts:
        "written" once a prompt that ended is compressed (a close row's) and the step's tokens are
        in (what the kernel reads); "after" the step, compressions included. Computed once per
        step, rows and layer."""
        key = ("sizes", tuple(rows), layer if self._layered else 0, when)
        if key not in batch.plans:
            batch.plans[key] = tuple(self._held(batch, row, layer, when == "after") for row in rows)
        return batch.plans[key]

    @functools.cached_property
    def _layered(self) -> bool:
        """Whether the layers may keep budgets of their own: the selection allocates them (PyramidKV,
        KeepKV's EMA selection); a kept prompt's budgets are the same in every layer."""
        return not self.keep_prompt and self.method.selection.layered

    def _held(self, batch: PagedBatch, row: int, layer: int, after: bool) -> int:
        phase, done, length = batch.phases[row], batch.computed[row], batch.query_lengths[row]
        if phase == "chunk":  # a prompt read in chunks is held whole until its close
            return done + length
        if phase == "prefill":  # a whole prompt, compressed in its own step
            return self.stored(length, length, layer) if after else length
        prompt, closed = batch.prompt[row], batch.closed[row]
        if after:
            return self.stored(prompt, done + 1, layer, closed)
        return self.stored(prompt, done, layer, closed) + 1  # what it held, and the step's token

    # -- writes and the kernel ---------------------------------------------------------------------
    def _write_new(self, planes, layout: PagedLayout, batch, plan, key, value, layer: int) -> None:
        """The step's keys and values through the engine's cache write, at each attending row's next
        slots, and their words: position, bias 0 (a biased layout's), the extras at their fill."""
        slots, tokens, positions = plan.new_slots(self, batch, layer)
        keys_plane, values_plane, words = planes
        new_keys = key if tokens is None else key.index_select(0, tokens)
        new_values = value if tokens is None else value.index_select(0, tokens)
        self.kernel.write(keys_plane, values_plane, new_keys, new_values, slots)
        index = plan.word_rows(layout, slots)  # [N, H_kv, M]
        fresh = plan.fresh_words(self, layout, positions)  # [N, H_kv, M]
        words.index_put_((index,), fresh)

    def _attend(self, planes, layout: PagedLayout, batch, plan, query, scaling: float, layer: int, output,
                kv_cache) -> None:
        """Every attending row, over its slots, in place: a biased method's decoding rows that were
        compressed through keepkv's paged kernel (their votes are a bias the engine's kernel cannot
        add; it hands back the step's statistics as well), the rest, whose entries carry no votes,
        in one call of the engine's kernel (a request under its budget is attended as stock's)."""
        ours = plan.voted(self, batch, layer) if layout.biased else ()
        engine_rows = plan.unvoted(self, batch, layer) if ours else plan.attending
        if engine_rows:
            call = plan.kernel_call(self, batch, layer, layout, query.shape[1], engine_rows)
            keys_plane, values_plane, _ = planes
            if call.tokens is None and output.is_contiguous():
                self.kernel.attend(query, keys_plane, values_plane, call.block_table, call.query_start_loc,
                                   call.seq_lens, call.plan, scaling, output)
            else:
                rows_query = query if call.tokens is None else query.index_select(0, call.tokens)
                attended = rows_query.new_empty(rows_query.shape)
                self.kernel.attend(rows_query, keys_plane, values_plane, call.block_table, call.query_start_loc,
                                   call.seq_lens, call.plan, scaling, attended)
                output.index_copy_(0, call.tokens, attended)
        if ours:
            self._attend_decoding(kv_cache, layout, batch, plan, query, scaling, layer, output)

    def _attend_decoding(self, kv_cache, layout: PagedLayout, batch, plan, query, scaling: float, layer: int,
                         output) -> None:
        """The decoding rows through keepkv's paged kernel (:func:`keepkv.kernels.paged.paged_decode`),
        with each entry's bias; when rows compress this step, the method's statistics of the step's
        query come back from the same pass (:meth:`_decode_stats` reads them)."""
        rows = plan.voted(self, batch, layer)
        call = plan.decode_call(self, batch, rows, layer, layout)
        needs = self.method.needs(False)
        want = bool(plan.compressing) and self.method.interval == 1
        out, probs, logits = paged_decode(query.index_select(0, call.tokens), kv_cache, call.block_table,
                                          call.seq_lens, scaling, call.geometry, max_len=call.max_len,
                                          probs=want and needs.probs, logits=want and needs.logits,
                                          backend=_decode_backend(query.device))
        output.index_copy_(0, call.tokens, out)
        if want:
            plan.cache["stats", layer] = (rows, probs, logits)

    # -- prompts ---------------------------------------------------------------------------------
    def _prompt_stats(self, query_g: torch.Tensor, store: LayerStore, scaling: float) -> StepStats:
        """The statistics the method reads of a whole prompt held in ``store`` (its tokens in
        slot order), from its newest query rows ``query_g`` [1, H_kv, g, r, D]: what a prefill of
        the whole prompt gives for a method that reads only its last rows."""
        needs = Needs(window=self.method.needs(True).window)
        return self._prompt_attention(query_g.flatten(1, 2), store, scaling, needs)[1]

    def _prompt_attention(self, query: torch.Tensor, store: LayerStore, scaling: float, needs: Needs | None = None):
        """keepkv's attention of a prompt's query rows [1, H, q, D], the store's last q entries,
        causal among them and seeing every entry before them: (output, the statistics ``needs``
        asks for, by default the method's of a prompt)."""
        rows = query.shape[2]
        mask = torch.ones(rows, rows, dtype=torch.bool, device=query.device).tril()[None, None]
        needs = self.method.needs(True) if needs is None else needs
        return attend(query, store.keys, store.values, store.bias, mask, scaling, needs, True, store.binary_bias())

    def _file_chunk(self, planes, layout, batch, plan, row: int, query, key, value, scaling, layer: int) -> None:
        """A prompt's chunk, attended in place: keep what its close will need (the method's state,
        its newest query rows, or its statistics summed so far)."""
        earlier, chunk_key = batch.chunk_keys[row]
        before = self.chunks.pop((earlier, layer), None)
        start, stop = batch.query_start[row], batch.query_start[row + 1]
        rows_query = query[start:stop].transpose(0, 1)[None]  # [1, H, q, D]
        if not self._sums_prompt or self.keep_prompt:  # a kept prompt is unscored: its newest rows do
            if before is not None and before.queries is not None:
                rows_query = torch.cat([before.queries, rows_query], dim=2)
            kept = rows_query[:, :, -self._prompt_rows :].clone()
            state = before.state if before is not None else {}
            extras = before.extras if before is not None else ()
            self.chunks[chunk_key, layer] = _Prompt(state, None, kept, extras, self._steps)
            return
        # Statistics of every query row: this chunk's queries over the prompt so far (its slots).
        done = batch.computed[row]
        store = self._gather(planes, layout, batch, plan, [row], (done + stop - start,), layer, (done + stop - start,))
        if before is None:
            self.step.start(store)
        else:
            store.resume(state=before.state)
        _, stats = self._prompt_attention(rows_query, store, scaling)
        if before is not None and before.stats is not None:
            stats = join_prefill_stats(before.stats, stats, self.method.needs(True).window)
        stats = StepStats(**{**vars(stats), "query": stats.query[:, :, :, -self._prompt_rows :]})
        self.chunks[chunk_key, layer] = _Prompt(dict(store.state), stats, None, tuple(store.extras), self._steps)

    def _close(self, planes, layout, batch, plan, rows: list[int], scaling: float, layer: int, new=None) -> None:
        """Prompts that are whole: the method observes each and compresses it (or keeps it whole),
        and its kept entries are written back compact. A close row's prompt was read in chunks;
        ``new`` (query, key, value): a whole prompt this step read and attended in place."""
        row = rows[0]
        if new is None:
            earlier, _ = batch.chunk_keys[row]
            prompt = self.chunks.pop((earlier, layer), None)
            length = batch.computed[row]
        else:
            prompt, length = None, batch.query_lengths[row]
        first = 0
        if self.keep_prompt:  # kept whole and unscored: its end reads only the slots of its newest query rows
            first = length - max(1, 0 if prompt is None or prompt.queries is None else prompt.queries.shape[2])
        store = self._gather(planes, layout, batch, plan, rows, (length - first,), layer, (length,), first)
        if prompt is None or (prompt.stats is None and not prompt.state):  # its first chunk's store, or a prefix
            self.step.start(store)
        else:
            store.resume(state=prompt.state)
        if new is not None:
            query, _, _ = new
            start, stop = batch.query_start[row], batch.query_start[row + 1]
            rows_query = query[start:stop].transpose(0, 1)[None]
            if self._sums_prompt:
                _, stats = self._prompt_attention(rows_query, store, scaling)
            else:
                stats = self._prompt_stats(group_queries(rows_query[:, :, -self._prompt_rows :], layout.kv_heads),
                                           store, scaling)
        elif prompt is not None and prompt.stats is not None:
            stats = prompt.stats
        elif prompt is not None and prompt.queries is not None and self._sums_prompt:  # a kept prompt's newest rows
            _, stats = self._prompt_attention(prompt.queries, store, scaling)
        elif prompt is not None and prompt.queries is not None:
            stats = self._prompt_stats(group_queries(prompt.queries, layout.kv_heads), store, scaling)
        else:  # a prompt whose every token another request wrote (a whole shared prefix): no query of its own
            stats = StepStats(query=store.keys.new_zeros(1, layout.kv_heads, self._group, 0, layout.head_dim),
                              scaling=scaling, is_prefill=True)
        after = self._sizes(batch, rows, layer, "after") if new is not None else tuple(
            self.stored(batch.prompt[r], batch.computed[r], layer, batch.closed[r]) - first for r in rows)
        self._end_prompt(planes, layout, batch, plan, rows, store, stats, after, layer, scaling, first=first)

    def _dense_prompt(self, planes, layout, batch, plan, rows, query, key, value, scaling, layer, output) -> None:
        """A whole prompt over its budget, read in one step: its blocks hold only what it keeps, so it
        is attended here (keepkv's attention), compressed, and its kept entries written compact."""
        row = rows[0]
        start, stop = batch.query_start[row], batch.query_start[row + 1]
        q = stop - start
        new_keys, new_values = (t[start:stop].transpose(0, 1)[None] for t in (key, value))  # [1, H_kv, q, D]
        store = LayerStore(layer)
        store.lazy_initialization(new_keys, new_values)
        self.step.start(store)
        store.append(new_keys, new_values, torch.ones(1, q, dtype=torch.bool, device=key.device))
        out, stats = self._prompt_attention(query[start:stop].transpose(0, 1)[None], store, scaling)
        output[start:stop] = out[0].to(output.dtype)
        self._end_prompt(planes, layout, batch, plan, rows, store, stats, self._sizes(batch, rows, layer, "after"),
                         layer, scaling, everything=True)

    def _end_prompt(self, planes, layout, batch, plan, rows, store: LayerStore, stats: StepStats, sizes: tuple,
                    layer: int, scaling: float, **where) -> None:
        """A whole prompt's end (``LayerStep.observe_prompt`` then ``close_prompt``, with the budgets
        the Hugging Face cache sets), its kept entries written back into its first ``sizes`` slots
        (``where``: :meth:`_write_back`'s ``everything`` or ``first``) and the method's state filed."""
        self.step.observe_prompt(store, stats)
        budget, mean, frozen = plan.budgets(self, batch, rows, layer, store.device)
        before = (store.positions.clone(), store.bias.clone())
        self.step.close_prompt(store, budget, mean, frozen, stats, plan.interval(self, batch, rows))
        self._write_back(planes, layout, batch, plan, rows, store, sizes, before, layer, **where)
        self._file_states(store.state, batch, rows, layer)

    # -- decoding ---------------------------------------------------------------------------------
    def _keep_queries(self, plan, query, layer: int) -> None:
        """Each decoding row's query into its kept rows (the compression's statistics read them)."""
        if not self._query_rows:
            return
        kept = self._query_slab(layer, query)
        kept.index_put_((plan.decode_slab_rows, plan.decode_query_index), query.index_select(0, plan.decode_tokens))

    def _query_slab(self, layer: int, like: torch.Tensor) -> torch.Tensor:
        slab = self._queries.get(layer)
        rows = max(self._rows.values(), default=0) + 1
        if slab is not None and (slab.dtype, slab.shape[2:]) != (like.dtype, like.shape[1:]):
            slab = None  # another model's queries (an engine of another dtype)
        if slab is None or slab.shape[0] < rows:
            grown = like.new_zeros(max(2 * rows, 8), self._query_rows, *like.shape[1:])
            if slab is not None:
                grown[: slab.shape[0]] = slab
            self._queries[layer] = slab = grown
        return slab

    def _compress(self, planes, layout, batch, plan, rows: list[int], query, scaling: float, layer: int) -> None:
        """Decoding rows whose ``interval`` came round (each holding as many entries): the method
        observes every query since its last compression, compresses, and the kept entries are
        written back into the leading slots. With ``keep_prompt`` the store holds only the generated
        entries, past the prompt (a prompt's entries are never evicted, merged into or rescored, and
        a query's probabilities are its attention among the generated entries:
        :func:`keepkv.step.generated_share`), unless the method reads every entry (``reads_every_entry``)."""
        written = self._sizes(batch, rows, layer, "written")
        seen = tuple(batch.computed[r] + 1 for r in rows)
        budget, mean, frozen = plan.budgets(self, batch, rows, layer, query.device)
        first = 0
        if self._generated_alone:
            first = batch.prompt[rows[0]]  # the rows of a group share their prompt's length
            written = tuple(size - first for size in written)
            budget, frozen = budget - first, None
        store = self._gather(planes, layout, batch, plan, rows, written, layer, seen, first)
        interval = plan.interval(self, batch, rows)
        self.step.set_budget(store, budget, mean, frozen, interval)
        store.resume(state=self._join_states(batch, rows, layer), pending=interval)
        stats = self._decode_stats(planes, batch, plan, rows, store, query, scaling, layer, layout, first)
        before = (store.positions.clone(), store.bias.clone())
        self.step.decode(store, stats)
        after = tuple(size - first for size in self._sizes(batch, rows, layer, "after"))
        self._write_back(planes, layout, batch, plan, rows, store, after, before, layer, first=first)
        self._file_states(store.state, batch, rows, layer)

    def _decode_stats(self, planes, batch, plan, rows, store: LayerStore, query, scaling, layer, layout,
                      prompt: int = 0) -> StepStats:
        """What the attention of the ``interval`` decoding queries since the last compression gave,
        computed now over the store: each query sees the entries held at its position (the later
        ones are masked), with their votes, exactly what it attended over. A store past a kept
        prompt (``prompt`` > 0) gives each query's attention among the generated entries, as the
        Hugging Face path's keep_prompt counts it (:func:`keepkv.step.generated_share`)."""
        tokens = torch.tensor([batch.query_start[r] for r in rows], device=query.device)
        if not self._query_rows:
            return StepStats(query=group_queries(query.index_select(0, tokens)[:, :, None], layout.kv_heads),
                             scaling=scaling, is_prefill=False)
        attended, *stats = plan.cache.get(("stats", layer), ((),))
        if store.interval == 1 and set(rows) <= set(attended):  # the kernel's pass gave them
            return self._kernel_stats(stats, plan.index_among(attended, rows), store, query.index_select(0, tokens),
                                      scaling, layout, prompt)
        slab_rows = torch.tensor([self._rows[batch.first_block[r]] for r in rows], device=query.device)
        # [R, N, H, D], oldest first: the store's interval N, at most the method's (a small budget's is less)
        queries = self._queries[layer].index_select(0, slab_rows)[:, : store.interval]
        query_g = group_queries(queries.transpose(1, 2), layout.kv_heads)  # [R, H_kv, g, N, D]
        needs = self.method.needs(False)
        logits = scaled_logits(query_g, store.keys, scaling)  # [R, H_kv, g, N, S]
        probs = None
        if needs.probs:
            count = query_g.shape[3]
            newest = torch.tensor([batch.computed[r] for r in rows], device=query.device)  # each row's last query position
            query_pos = newest[:, None] - torch.arange(count - 1, -1, -1, device=query.device)  # [R, N]
            visible = store.positions[:, :, None, :] <= query_pos[:, None, :, None]  # [R, H_kv, N, S]
            biased = (logits + store.bias[:, :, None, None, :]).masked_fill(~visible[:, :, None], NEG_INF)
            probs = softmax_probs(biased)  # a kept prompt's entries are not in the store: keepkv.step.generated_share
        return StepStats(query=query_g, scaling=scaling, is_prefill=False, probs=probs,
                         logits=logits if needs.logits else None)

    @staticmethod
    def _kernel_stats(stats, index, store: LayerStore, query, scaling: float, layout, prompt: int) -> StepStats:
        """The statistics of the step's query (the store's interval is 1) from keepkv's paged kernel:
        ``stats`` (probs, logits) [R_decoding, H_kv, g, max_len] over each row's slots; ``index``
        [R] picks the compressing rows. A store past a kept prompt (``prompt`` > 0) takes its
        slots and the probabilities among them (:func:`keepkv.step.generated_share`), as the
        second pass computes them."""
        size = store.keys.shape[2]

        def rows_of(tensor, fill):
            if tensor is None:
                return None
            picked = tensor.index_select(0, index)[..., prompt : prompt + size]
            if picked.shape[-1] < size:
                picked = torch.nn.functional.pad(picked, (0, size - picked.shape[-1]), value=fill)
            return picked[:, :, :, None]  # [R, H_kv, g, 1, S]

        probs, logits = rows_of(stats[0], 0.0), rows_of(stats[1], NEG_INF)
        if probs is not None and prompt:
            probs = probs / probs.sum(-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny)
        return StepStats(query=group_queries(query[:, :, None], layout.kv_heads), scaling=scaling, is_prefill=False,
                         probs=probs, logits=logits)

    # -- reading and writing a request's slots ----------------------------------------------------
    def _gather(self, planes, layout: PagedLayout, batch, plan, rows: list[int], sizes: tuple, layer: int,
                seen: tuple, first: int = 0) -> LayerStore:
        """A store of each row's ``sizes`` slots from slot ``first`` on (rows of equal size, or one
        row), in slot order, that has seen ``seen`` tokens per row: whole blocks read once, unpacked
        from the kernel's order."""
        keys, values = self._read(planes, layout, batch, plan, rows, max(sizes), first)
        keys_plane, values_plane, words = planes
        size = max(sizes)
        slot = torch.arange(first, first + size, device=keys.device)
        blocks = plan.blocks_of(batch, rows, first + size, layout.block_size)
        word_rows = layout.word_index(blocks[:, slot // layout.block_size][:, None, :],
                                      torch.arange(layout.kv_heads, device=blocks.device)[None, :, None],
                                      slot % layout.block_size)
        meta = words[word_rows[..., None] + torch.arange(layout.words, device=blocks.device)]  # [R, H_kv, S, M]
        empty = (slot[None, None, :] - first >= torch.tensor(sizes, device=blocks.device)[:, None, None]).expand(
            len(rows), layout.kv_heads, size)
        positions = meta[..., 0].long().masked_fill(empty, -1)
        bias = meta[..., 1] if layout.biased else torch.zeros_like(meta[..., 0])
        bias = bias.masked_fill(empty, NEG_INF)
        tensors = {"keys": keys, "values": values, "bias": bias, "positions": positions}
        word = 1 + layout.biased
        chosen = {}
        for name, shape in self.extras.items():
            width_words = math.prod(shape)
            extra = meta[..., word : word + width_words].reshape(*meta.shape[:-1], *shape)
            tensors[f"extras.{name}"] = extra.masked_fill(empty.view(*empty.shape, *(1,) * len(shape)), self.extra_fill[name])
            chosen[name] = self.extra_fill[name]
            word += width_words
        return LayerStore.from_entries(layer, tensors, chosen, seen=max(seen), real_seen=torch.tensor(seen, device=blocks.device),
                                       binary=not layout.biased or bool((bias[~empty] == 0).all()),
                                       headroom=self.method.interval)

    def _read(self, planes, layout: PagedLayout, batch, plan, rows: list[int], size: int, first: int = 0,
              values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Keys (and values) [R, H_kv, size, D] of the rows' slots first..first+size-1: their blocks
        read once (index_select), unpacked from the kernel's order."""
        keys_plane, values_plane, _ = planes
        blocks = plan.blocks_of(batch, rows, first + size, layout.block_size)[:, first // layout.block_size :]
        count, width = blocks.shape[1], layout.block_size
        key_order, value_order = plan.orders(self.kernel, layout)
        read = []
        with torch.inference_mode(False):  # the store's buffers are normal tensors (LayerStore._new_buffer)
            for plane, order in ((keys_plane, key_order), *(((values_plane, value_order),) if values else ())):
                entries = layout.unpack(plane.index_select(0, blocks.flatten()), order)  # [R·n, H_kv, bs, D]
                entries = entries.view(len(rows), count, layout.kv_heads, width, layout.head_dim).transpose(1, 2)
                entries = entries.reshape(len(rows), layout.kv_heads, count * width, layout.head_dim)
                read.append(entries[:, :, first % width : first % width + size])
        return read[0], read[1] if values else None

    def _write_back(self, planes, layout: PagedLayout, batch, plan, rows, store: LayerStore, sizes: tuple,
                    before: tuple[torch.Tensor, torch.Tensor], layer: int, everything: bool = False,
                    first: int = 0) -> None:
        """Each row's live entries of ``store`` into its first ``sizes`` slots. An entry held in a slot
        below its row's size stays in that slot; the entries past it fill the emptied slots, in slot
        order. Keys and values go through the engine's cache write for the slots whose entry or
        votes changed (a served method changes a slot's key or value only with its entry or its
        votes); the words of every slot a row may write. With ``keep_prompt`` a row writes only
        past its prompt (an engine may share those blocks). ``before``: ([R, H_kv, S] positions,
        bias) of the slots as they were read; ``everything``: the slots held nothing yet; ``first``: the
        slot of the store's first entry (``sizes`` count from it)."""
        keys_plane, values_plane, words = planes
        kv_heads = layout.kv_heads
        width = max(sizes)
        live = store.live()
        size = live.shape[-1]
        slot = torch.arange(size, device=live.device)
        after = torch.tensor(sizes, device=live.device)[:, None, None]  # [R, 1, 1]
        source = slot[:width].expand(len(rows), kv_heads, width)  # the store slot each of a row's slots gets
        spill = size - min(sizes)
        if spill > 0:
            from .store import slots_of

            holes = ~live[..., :width] & (slot[:width] < after)
            hole, has_hole = slots_of(holes, min(spill, width))
            mover, has_mover = slots_of(live & (slot >= after), min(spill, width))
            source = source.scatter(-1, hole, mover.where(has_hole & has_mover, hole))
        positions, bias = store.positions.gather(-1, source), store.bias.gather(-1, source)
        starts = torch.tensor(plan.starts(self, batch, rows), device=live.device)[:, None, None] - first
        writable = ((slot[:width] < after) & (slot[:width] >= starts)).expand(len(rows), kv_heads, width)
        if everything:
            changed = writable.any(1)
        else:
            old_positions, old_bias = before
            pad = width - old_positions.shape[-1]
            if pad > 0:
                old_positions = torch.nn.functional.pad(old_positions, (0, pad), value=-1)
                old_bias = torch.nn.functional.pad(old_bias, (0, pad), value=NEG_INF)
            differs = (positions != old_positions[..., :width]) | (bias != old_bias[..., :width])
            changed = (differs & writable).any(1)  # [R, W]: a slot written in every head, if in any
        # Host-side: which slots to write (a compression's few; none that would take a prompt's slot).
        row_index, slot_index = changed.nonzero(as_tuple=True)
        blocks = plan.blocks_of(batch, rows, first + width, layout.block_size)
        if row_index.numel():
            slot_index = slot_index + first  # in the request's slots
            flat = blocks[row_index, slot_index // layout.block_size] * layout.block_size + slot_index % layout.block_size
            take = source[row_index, :, slot_index - first]  # [N, H_kv]
            picked_keys = store.keys[row_index[:, None], torch.arange(kv_heads)[None, :], take]  # [N, H_kv, D]
            picked_values = store.values[row_index[:, None], torch.arange(kv_heads)[None, :], take]
            self.kernel.write(keys_plane, values_plane, picked_keys, picked_values, flat)
        # Words of every writable slot: position, bias, extras (scores change everywhere).
        row_index, head_index, slot_index = writable.nonzero(as_tuple=True)
        if row_index.numel():
            take = source[row_index, head_index, slot_index]
            slot_index = slot_index + first
            block = blocks[row_index, slot_index // layout.block_size]
            index = layout.word_index(block, head_index, slot_index % layout.block_size)
            columns = [store.positions[row_index, head_index, take].float()[:, None]]
            if layout.biased:
                columns.append(store.bias[row_index, head_index, take][:, None])
            for name, shape in self.extras.items():
                if name in store.extras:
                    columns.append(store.extras[name][row_index, head_index, take].reshape(len(take), -1).float())
                else:
                    columns.append(torch.full((len(take), math.prod(shape)), self.extra_fill[name]))
            words.index_put_((index[:, None] + torch.arange(layout.words),), torch.cat(columns, dim=1))

    # -- the method's per-layer state, per request -------------------------------------------------
    def _slab_row(self, key) -> int:
        """The slab row of request ``key``: its own, or one that a request unseen for
        :data:`STALE_STEPS` steps gives up, or a new one."""
        with self._lock:
            if key in self._rows:
                return self._rows[key]
            stale = [old for old, seen in self._seen.items() if old in self._rows and seen < self._steps - STALE_STEPS]
            if stale:
                row = self._rows.pop(stale[0])
                self._seen.pop(stale[0], None)
            else:
                row = len(self._rows)
                while row in self._rows.values():
                    row += 1
            self._rows[key] = row
            return row

    def _file_states(self, state: dict, batch, rows: list[int], layer: int) -> None:
        """File a layer's method state by row: a per-row tensor (first dimension the rows) into its
        slab rows, anything else as the layer's. A per-row tensor whose trailing shape changes from
        step to step is tied to one step's slots (KeepKV's newest query's logits, [R, H_kv, g, S]):
        the method rewrites it before it reads it (tested against each request's own cache), so it
        is not filed."""
        if not state:
            return
        slabs = self._slabs.setdefault(layer, {})
        shared = self._layer_state.setdefault(layer, {})
        slab_rows = torch.tensor([self._slab_row(batch.first_block[r]) for r in rows])
        for name, value in state.items():
            if not (isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == len(rows)):
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

    def _grown(self, slab: torch.Tensor) -> torch.Tensor:
        """``slab`` with a row for every request seen (zeros where none was filed), doubled when short."""
        rows = max(self._rows.values(), default=-1) + 1
        if slab.shape[0] >= rows:
            return slab
        grown = slab.new_zeros(max(2 * rows, 8), *slab.shape[1:])
        grown[: slab.shape[0]] = slab
        return grown

    def _join_states(self, batch, rows: list[int], layer: int) -> dict:
        """The rows' filed states as one layer's (per-row tensors read from their slabs)."""
        joined = dict(self._layer_state.get(layer, {}))
        slabs = self._slabs.get(layer, {})
        slab_rows = torch.tensor([self._slab_row(batch.first_block[r]) for r in rows])
        for name, slab in slabs.items():
            if slab is not None:
                slabs[name] = slab = self._grown(slab)
                joined[name] = slab.index_select(0, slab_rows.to(slab.device))
        return joined

    @property
    def _group(self) -> int:
        return self.config.num_attention_heads // self.config.num_key_value_heads


@functools.lru_cache(maxsize=64)
def _layout(kernel, block_size, kv_heads, head_dim, dtype, biased, words) -> PagedLayout:
    layout = PagedLayout(block_size, kv_heads, head_dim, words, dtype, biased)
    if biased:  # keepkv's kernel must read the engine's packing: refused here, before any request
        layout.geometry(*kernel.orders(block_size, head_dim, dtype))
    return layout


@dataclass
class _KernelCall:
    """One kernel call's shapes (host int32 tensors) and plan; ``tokens``: the attending rows'
    tokens in the step's token axis (None: every token)."""

    tokens: torch.Tensor | None
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    plan: object


@dataclass
class _DecodeCall:
    """keepkv's paged kernel's call over decoding rows (their tokens in the step, block table and
    lengths on the step's device, the longest length, where an entry lives)."""

    tokens: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    max_len: int
    geometry: PagedGeometry


@dataclass
class _StepPlan:
    """The step's rows by what they do, and the index tensors shared by its layers (built at its
    first layer; per layer where sizes differ, PyramidKV's)."""

    closing: list[int]  # close rows: a chunked prompt compressed before its first decode token
    dense: list[list[int]]  # whole prompts over their budget, each alone
    prompts_ending: list[list[int]]  # whole prompts within their budget, attended in place, each alone
    chunks: list[int]  # prompt chunks read in place
    attending: list[int]  # rows whose new tokens are written and attended in place
    decoding: list[int]  # rows decoding a token (close rows too)
    compressing: list[list[int]]  # decoding rows due to compress, by equal size
    decode_tokens: torch.Tensor
    decode_slab_rows: torch.Tensor
    decode_query_index: torch.Tensor
    block_size: int
    cache: dict = field(default_factory=dict)

    @classmethod
    def build(cls, paged: PagedCompression, batch: PagedBatch, block_size: int, device) -> "_StepPlan":
        closing, dense, ending, chunks, attending, decoding = [], [], [], [], [], []
        due = []
        for row, phase in enumerate(batch.phases):
            length, done = batch.query_lengths[row], batch.computed[row]
            if phase == "prefill":
                if length > min(paged.stored(length, length, layer) for layer in range(paged.config.num_hidden_layers)):
                    dense.append([row])
                    continue
                ending.append([row])
            elif phase == "chunk":
                chunks.append(row)
            else:
                if phase == "close":
                    closing.append(row)
                decoding.append(row)
                decoded = done - batch.closed[row] + 1  # decode steps so far, this one too
                if decoded % paged.interval(batch.prompt[row]) == 0:
                    due.append(row)
            attending.append(row)
        # Rows due to compress run together when they hold as many entries (their new entries are
        # then the store's last slots, as in the Hugging Face cache); sizes are the same in every
        # layer but PyramidKV's, whose layers scale them alike.
        by_size: dict = {}
        for row in due:
            sizes = tuple(paged._sizes(batch, [row], layer, "written")[0] for layer in range(paged.config.num_hidden_layers))
            key = (batch.prompt[row] if paged.keep_prompt else 0, paged.interval(batch.prompt[row]), sizes)
            by_size.setdefault(key, []).append(row)
        tokens = torch.tensor([batch.query_start[r] for r in decoding], dtype=torch.long)
        slab_rows = torch.tensor([paged._slab_row(batch.first_block[r]) for r in decoding], dtype=torch.long)
        query_index = torch.tensor([(batch.computed[r] - batch.closed[r]) % paged.interval(batch.prompt[r])
                                    if paged._query_rows else 0 for r in decoding], dtype=torch.long)
        return cls(closing, dense, ending, chunks, attending, decoding, list(by_size.values()),
                   tokens.to(device), slab_rows.to(device), query_index.to(device), block_size)

    # -- index tensors -------------------------------------------------------------------------
    def blocks_of(self, batch: PagedBatch, rows: list[int], size: int, block_size: int) -> torch.Tensor:
        """[R, ceil(size / block_size)] int64 the rows' blocks holding slots 0..size-1."""
        key = ("blocks", tuple(rows), size)
        if key not in self.cache:
            count = max(1, math.ceil(size / block_size))
            self.cache[key] = batch.block_table[rows][:, :count].long()
        return self.cache[key]

    def orders(self, kernel, layout: PagedLayout) -> tuple[torch.Tensor, torch.Tensor]:
        key = ("orders", layout)
        if key not in self.cache:
            self.cache[key] = kernel.orders(layout.block_size, layout.head_dim, layout.dtype)
        return self.cache[key]

    def starts(self, paged: PagedCompression, batch: PagedBatch, rows: list[int]) -> tuple:
        """The first slot each row may write: with ``keep_prompt`` a prompt's slots (which its own
        steps, or another request's, a shared prefix, wrote) are never written again."""
        if not paged.keep_prompt:
            return (0,) * len(rows)
        return tuple(batch.prompt[r] for r in rows)

    def budgets(self, paged: PagedCompression, batch: PagedBatch, rows: list[int], layer: int, device) -> tuple:
        """([R, H_kv] entries layer ``layer`` keeps, [R] mean budgets, [R] kept prompts or None), as
        the Hugging Face cache sets them when a prompt ends (``keepkv.budgets.prompt_budgets``)."""
        key = ("budgets", tuple(rows), layer)
        if key not in self.cache:
            prompts = torch.tensor([batch.prompt[r] for r in rows])  # every row but a chunk's knows its prompt
            budgets, mean = prompt_budgets(paged.method, paged.budget, paged.decoding, paged.config.num_hidden_layers,
                                           paged.config.num_key_value_heads, prompts)
            frozen = prompts.to(device) if paged.keep_prompt else None
            self.cache[key] = (budgets[layer].to(device), mean.to(device), frozen)
        return self.cache[key]

    @staticmethod
    def interval(paged: PagedCompression, batch: PagedBatch, rows: list[int]) -> int:
        """The decode interval of rows compressed together (:meth:`PagedCompression.interval`): the
        rows due together share it (``due`` groups them by it); rows closing together may not (a
        budget below the method's interval), and take the shortest."""
        return min(paged.interval(batch.prompt[r]) for r in rows)

    def new_slots(self, paged: PagedCompression, batch: PagedBatch, layer: int):
        """(slots [N] int64, tokens [N] or None: the attending rows' tokens, positions [N] int64):
        where each attending row's new tokens go (its next slots) and the positions they are."""
        sizes = paged._sizes(batch, self.attending, layer, "written")
        key = ("new", sizes)
        if key not in self.cache:
            rows = torch.tensor(self.attending)
            lengths = torch.tensor([batch.query_lengths[r] for r in self.attending])
            total = int(lengths.sum())
            row = torch.repeat_interleave(torch.arange(len(rows)), lengths, output_size=total)
            within = torch.arange(total) - (lengths.cumsum(0) - lengths)[row]  # each new token's index in its row
            slot = (torch.tensor(sizes) - lengths)[row] + within  # its slot: after what its row held
            block = batch.block_table[rows][row, slot // self.block_size].long()
            tokens = torch.tensor([batch.query_start[r] for r in self.attending])[row] + within
            positions = torch.tensor([batch.computed[r] for r in self.attending])[row] + within
            device = self.decode_tokens.device
            every = total == batch.query_start[-1]
            self.cache[key] = ((block * self.block_size + slot % self.block_size).to(device),
                               None if every else tokens.to(device), positions.to(device))
        return self.cache[key]

    def word_rows(self, layout: PagedLayout, slots: torch.Tensor) -> torch.Tensor:
        """[N, H_kv, M] indices of the words of slots [N] in the flat fp32 view."""
        key = ("words", layout, slots.data_ptr(), slots.numel())
        if key not in self.cache:
            block, offset = slots // layout.block_size, slots % layout.block_size
            first = layout.word_index(block[:, None], torch.arange(layout.kv_heads, device=slots.device)[None, :],
                                      offset[:, None])
            self.cache[key] = first[..., None] + torch.arange(layout.words, device=slots.device)
        return self.cache[key]

    def fresh_words(self, paged: PagedCompression, layout: PagedLayout, positions: torch.Tensor) -> torch.Tensor:
        """[N, H_kv, M] the words of new entries: position, bias 0, every extra at its fill."""
        fills = [0.0] * (layout.biased + 0)
        for name, shape in paged.extras.items():
            fills += [paged.extra_fill[name]] * math.prod(shape)
        tail = torch.tensor(fills, dtype=torch.float32, device=positions.device)
        words = torch.cat([positions.float()[:, None], tail[None].expand(len(positions), -1)], dim=1)
        return words[:, None].expand(-1, layout.kv_heads, -1)

    def kernel_call(self, paged: PagedCompression, batch: PagedBatch, layer: int, layout: PagedLayout,
                    num_heads: int, rows: list[int]) -> _KernelCall:
        """The engine kernel's call over ``rows`` (attending rows, in step order)."""
        sizes = paged._sizes(batch, rows, layer, "written")
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
            plan = paged.kernel.plan(starts, seq_lens, num_heads, layout)
            self.cache[key] = _KernelCall(tokens, starts, seq_lens, table, plan)
        return self.cache[key]

    def voted(self, paged: PagedCompression, batch: PagedBatch, layer: int) -> tuple[int, ...]:
        """The decoding rows that layer ``layer`` of a request has compressed (it holds fewer entries
        than it has seen): the only ones whose entries may carry votes. A request never compressed
        holds every token, unmerged."""
        key = ("voted", layer if paged._layered else 0)
        if key not in self.cache:
            sizes = paged._sizes(batch, self.decoding, layer, "written")
            self.cache[key] = tuple(row for row, size in zip(self.decoding, sizes) if size < batch.computed[row] + 1)
        return self.cache[key]

    def unvoted(self, paged: PagedCompression, batch: PagedBatch, layer: int) -> list[int]:
        """The attending rows that are not :meth:`voted`: the engine's kernel attends them."""
        key = ("unvoted", layer if paged._layered else 0)
        if key not in self.cache:
            voted = set(self.voted(paged, batch, layer))
            self.cache[key] = [row for row in self.attending if row not in voted]
        return self.cache[key]

    def decode_call(self, paged: PagedCompression, batch: PagedBatch, rows: tuple, layer: int,
                    layout: PagedLayout) -> _DecodeCall:
        """keepkv's paged kernel's call over decoding ``rows``."""
        sizes = paged._sizes(batch, rows, layer, "written")
        key = ("decode", rows, sizes, layout)
        if key not in self.cache:
            device = self.decode_tokens.device
            tokens = torch.tensor([batch.query_start[r] for r in rows], device=device)
            table = batch.block_table[list(rows)].to(device=device, dtype=torch.int32)
            seq_lens = torch.tensor(sizes, dtype=torch.int32, device=device)
            self.cache[key] = _DecodeCall(tokens, table, seq_lens, max(sizes),
                                          layout.geometry(*self.orders(paged.kernel, layout)))
        return self.cache[key]

    def index_among(self, attended: tuple, rows: list[int]) -> torch.Tensor:
        """[R] where ``rows`` are among ``attended`` (rows of one kernel call)."""
        key = ("index", attended, tuple(rows))
        if key not in self.cache:
            where = {row: index for index, row in enumerate(attended)}
            self.cache[key] = torch.tensor([where[row] for row in rows], device=self.decode_tokens.device)
        return self.cache[key]


@functools.lru_cache(maxsize=4)
def _decode_backend(device: torch.device) -> str:
    """The backend of keepkv's paged kernel on ``device``: Triton on CUDA; on CPU the C++ kernel where
    it builds (a compiler and ninja; built once per machine into keepkv's cache, on the first
    decode step), else Numba where it is installed (the "test" and "vllm" extras bring it), else
    the torch reference (correct, slower). Both run on torch's intra-op threads (the engine's)."""
    if device.type == "cuda":
        return "triton"
    backend = cpu_backend()
    if backend == "numba":
        numba_threads(torch.get_num_threads())
    return backend
