"""The paged adapter: methods run on requests whose entries live in a serving engine's blocks.

A serving engine (vLLM) stores each request's KV entries in blocks of ``block_size`` slots
listed in a block table, and frees whole blocks. Here a request keeps its entries compact in
its leading slots, so its scheduler can free every block past ``capacity_bound``. One attention
call over a batch of requests runs through the very code of :class:`~keepkv.cache.CompressedCache`:
the requests' slots are gathered into a :class:`~keepkv.store.LayerStore` (one row per request),
``CompressedCache.forward_layer`` appends, attends, scores and compresses, and the kept entries
are written back (the index tensors of a step are built at its first layer). A prompt's step
writes its kept entries compacted; a decode step leaves every entry that stays where it was,
moves only the entries past a request's size into its emptied slots, and writes keys and values
only where an entry or its votes changed (a few slots per request), the metadata words of all.
This module knows nothing of vLLM (``keepkv.vllm`` wires it in).

Paged layout, per layer::

    kv_cache : [blocks, H_kv, block_size, C]   model dtype; C holds the key (D), the value (D),
                                               then the entry's metadata as fp32 words:
                                               position, bias, the method's per-entry extras
    block_table : [R, max_blocks] int          the blocks of each request, in order

Slot j of a request is (block_table[j // block_size], j % block_size). A request that holds S
entries uses its slots 0..S-1; S is known from token counts alone (:meth:`PagedCompression.stored`),
so neither side ever reads a size back from the other.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from .budgets import (
    budget_floor, capacity_bound, check_keep_prompt, held_entries, layer_budgets, row_budgets, validate_budget,
)
from .cache import CompressedCache
from .methods import get_method
from .store import NEG_INF, LayerStore
from .methods.base import ComposedMethod, slots_of

# Methods the paged adapter serves: selections whose scores need no pass beyond the prompt's own
# attention and whose layer budgets are drawn from the prompt's length alone (PyramidKV's and
# KeepKV's EMA selection differ by layer), with eviction or KeepKV's merge (its votes are the bias
# word; its EMA, per-entry extras in the slots' words, plus a little per-layer state per request,
# filed apart per request).
SERVED_METHODS = ("window", "streamingllm", "snapkv", "h2o", "pyramidkv", "keydiff", "keepkv")
SERVED_SELECTIONS = ("window", "streamingllm", "snapkv", "h2o", "pyramidkv", "keydiff", "ema")
SERVED_MERGES = ("none", "keepkv")


def servable_method(spec: str) -> ComposedMethod:
    """The method of ``spec`` (a name or variant, ``"snapkv+window=16"``) if the paged adapter
    serves it; otherwise ValueError, in one line naming what it serves."""
    served = (f"keepkv.vllm serves {', '.join(SERVED_METHODS)} (selections {', '.join(SERVED_SELECTIONS)}; "
              f"merge {' or '.join(SERVED_MERGES)})")
    if not isinstance(spec, str) or spec.split("+")[0] not in SERVED_METHODS:
        if isinstance(spec, str) and spec.split("+")[0] == "kvzip":
            raise ValueError(f"keepkv.vllm does not serve kvzip: its reconstruction pass is a second prefill the engine "
                             f"does not schedule (docs/serving.md, 'KVzip'); serve keydiff for a context compressed "
                             f"before its questions; got {spec!r}")
        raise ValueError(f"{served}; got {spec!r}")
    method = get_method(spec)
    if method.selection.name not in SERVED_SELECTIONS or method.merging.name not in SERVED_MERGES:
        raise ValueError(f"{served}; got {spec!r}")
    if getattr(method.merging, "refresh_interval", None) is not None:  # a full copy of every entry, per request
        raise ValueError(f"keepkv.vllm does not serve refresh_interval (it keeps a full copy of the cache); got {spec!r}")
    return method


# Intra-op threads of one paged decode step. The step is hundreds of small tensor ops (a method's
# scoring, selection and merges over [R, H_kv, S] with S near the budget); each one that forks
# a parallel region waits for every one of the engine's threads, which vLLM pins to cores, so
# on a busy host an op of microseconds waits for a scheduler tick (docs/serving.md has the
# figures). One thread runs them back to back; the model's own matmuls keep the engine's threads.
STEP_THREADS = 1
# A prompt's step (a prefill, a chunk, or the close that compresses a chunked prompt) is few large
# ops (its causal attention is O(prompt²)): it keeps the engine's threads (0: leave them as they are).
PROMPT_THREADS = 0


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
    nothing was computed, else "decode").
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

    def __post_init__(self):
        if self.first_block is None:
            self.first_block = self.block_table[:, 0].tolist()
        if self.chunk_keys is None:
            self.chunk_keys = [(block, block) for block in self.first_block]
        if self.phases is None:
            self.phases = ["prefill" if done == 0 else "decode" for done in self.computed]

    @property
    def query_lengths(self) -> list[int]:
        return [end - start for start, end in zip(self.query_start, self.query_start[1:])]


class PagedCompression:
    """One method and budget over paged requests: sizes, capacity, and one layer's step.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config (depth and KV heads).
    method : str
        A method of :data:`SERVED_METHODS`, or a variant (``"snapkv+window=16"``).
    budget : float or int
        As :class:`~keepkv.cache.CompressedCache`'s: a fraction of each request's prompt, or an
        entry count.
    chunked : bool
        The engine may split a prompt over several steps (vLLM's chunked prefill). Every prompt
        then goes through :meth:`batch`'s "chunk" rows: its entries are written whole, its
        statistics summed chunk by chunk, and it is compressed at its first decode step, when
        it is known to be whole (the engine says only whether a prompt is still being read, so
        its last chunk is not known while it runs).
    keep_prompt : bool
        As ``CompressedCache(decoding="keep_prompt")``: a prompt is never compressed (its slots
        are never written after its own steps wrote them, so an engine may share its blocks:
        prefix caching), and ``budget`` (an int) of each request's generated entries are kept. A
        prompt may start past a shared prefix; prompts are read as ``chunked`` ones.
    """

    def __init__(self, config, method: str, budget: int | float, chunked: bool = False, keep_prompt: bool = False):
        validate_budget(budget)
        self.method = servable_method(method)
        if keep_prompt:
            check_keep_prompt(self.method, budget)
        self.config = config
        self.budget = budget
        self.keep_prompt = keep_prompt
        self.chunked = chunked or keep_prompt
        self.spec = method
        self.binary = self.method.merging.name == "none"  # evicting only: the bias is 0 or -inf
        # The method's per-layer state of each request (KeepKV: its lost votes): per-row tensors in
        # one slab per layer and name, a row per request (its first block's), so a step files and
        # reads a group's rows with one index_copy_ and one index_select each; anything else (a
        # scalar) once per layer. A request's row is rewritten when a new request takes its block.
        self._state_rows: dict[int, int] = {}  # first block -> slab row
        self._slabs: dict[int, dict[str, torch.Tensor]] = {}  # layer -> name -> [rows, ...]
        self._layer_state: dict[int, dict] = {}  # layer -> the state that is not per row
        self._prompts: dict[int, int | None] = {}  # first block id -> prompt length (None: chunks still coming)
        # (first block, layer) -> (method state, prefill statistics, extras so far) of a prompt read in chunks
        self.chunks: dict[tuple[int, int], tuple[dict, object, tuple[str, ...]]] = {}
        self._kept: dict[int, list[int]] = {}  # prompt length -> entries each layer keeps
        # keep_prompt: a request's key is the block of its first generated slot (slot P, never
        # shared: no block holding a generated entry is hashed), block -> prompt length P; and the
        # chunk keys whose prompt has not reached its first decode step yet.
        self._generated_blocks: dict[int, int] = {}
        self._closing: set = set()
        self._lock = threading.Lock()

    # -- sizes, from token counts only -------------------------------------------------------
    @property
    def decoding(self) -> str:
        """The decoding of the CompressedCache each step runs (``CompressedCache(decoding=...)``)."""
        return "keep_prompt" if self.keep_prompt else "compress"

    @functools.cached_property
    def _layout(self) -> tuple[dict, dict]:
        """The method's per-entry extras, as it declares them: ({name: trailing shape}, {name: fill})
        (read on first use: a scheduler's sizes need no head counts beyond the KV heads)."""
        config = self.config
        declared = self.method.entry_extras(config.num_attention_heads // config.num_key_value_heads)
        return ({name: extra.trailing for name, extra in declared.items()},
                {name: extra.fill for name, extra in declared.items()})

    @property
    def extras(self) -> dict[str, tuple]:
        """The method's per-entry extras: name -> trailing shape (() for one word per entry)."""
        return self._layout[0]

    @property
    def extra_fill(self) -> dict[str, float]:
        return self._layout[1]

    @property
    def meta_words(self) -> int:
        """fp32 words of metadata per entry and head: position, bias, each extra's words."""
        return 2 + sum(math.prod(shape) for shape in self.extras.values())

    def content_bytes(self, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes per slot and head of the paged layout (key, value, metadata)."""
        return 2 * head_dim * dtype.itemsize + 4 * self.meta_words

    def kept(self, prompt_length: int, layer: int = 0) -> int:
        """Entries per head ``layer`` of a request keeps once compressed: the cache's layer budget
        (``keepkv.budgets.layer_budgets``; the same for every head of a layer, and for every layer
        but PyramidKV's), fixed by the prompt's length."""
        if prompt_length not in self._kept and self.keep_prompt:
            self._kept[prompt_length] = [prompt_length + self.budget] * self.config.num_hidden_layers
        if prompt_length not in self._kept:
            budgets = layer_budgets(
                self.method, self.config.num_hidden_layers, self.config.num_key_value_heads, self.budget,
                torch.tensor([prompt_length]),
            )
            self._kept[prompt_length] = budgets[:, 0, 0].tolist()
        return self._kept[prompt_length][layer]

    def stored(self, prompt_length: int, computed: int, layer: int = 0) -> int:
        """Entries ``layer`` of a request holds per head after ``computed`` tokens (prompt included).

        A layer keeps min(prompt, budget) after the prefill, takes one entry per decode step and
        shrinks back to its budget every ``interval`` steps: min(P + t, budget + t mod interval)
        after t decode steps.
        """
        return held_entries(self.kept(prompt_length, layer), prompt_length, computed, self.method.interval)

    def capacity(self, prompt_length: int) -> int:
        """Slots a request needs at most (``keepkv.capacity_bound``, the largest layer)."""
        return max(capacity_bound(self.method, prompt_length, self.budget, self.config, self.keep_prompt))

    def uncompressed(self, batch: "PagedBatch") -> list[int]:
        """The rows of ``batch`` that every layer holds whole after this step, each token in the
        slot of its position: never compressed, and not compressing now (a prompt under its
        budget that has not outgrown it; a prompt read in chunks while its tokens so far would
        be one). Their attention is the full cache's, so an engine may run it with its own
        kernel and numerics (keepkv.vllm does); the step still runs them through the method,
        which observes them. From host-side token counts only."""
        rows = []
        interval = self.method.interval
        for row, (phase, done, length) in enumerate(zip(batch.phases, batch.computed, batch.query_lengths)):
            after = done + length
            prompt = after if phase == "chunk" else batch.prompt[row]
            self.kept(prompt)  # fills self._kept[prompt]: each layer's budget
            if held_entries(min(self._kept[prompt]), prompt, after, interval) == after:
                rows.append(row)
        return rows

    # -- one step -----------------------------------------------------------------------------
    def batch(
        self, query_start: list[int], seq_lens: list[int], block_table: torch.Tensor,
        prefilling: list[bool] | None = None, block_size: int | None = None,
    ) -> PagedBatch:
        """The step's :class:`PagedBatch`.

        ``prefilling`` [R]: whether each request was still reading its prompt before this step
        (vLLM's ``is_prefilling``; needed when ``chunked``). Each row gets a phase:

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
        if self.chunked and prefilling is None:
            raise ValueError("a chunked PagedCompression needs each request's prefilling flag")
        if self.keep_prompt:
            if block_size is None:
                raise ValueError("a keep_prompt PagedCompression needs the engine's block_size")
            return self._kept_prompt_batch(query_start, lengths, computed, block_table, prefilling, block_size)
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
                elif self._prompts[block] is None:
                    self._prompts[block] = done
                    phases.append("close")
                else:
                    phases.append("decode")
            prompts = [self._prompts[block] or 0 for block in first_blocks]
        return PagedBatch(list(query_start), computed, prompts, block_table[: len(lengths)], first_blocks, phases)

    def _kept_prompt_batch(self, query_start, lengths, computed, block_table, prefilling, block_size) -> PagedBatch:
        """:meth:`batch` with ``keep_prompt``: requests may share their leading (prompt) blocks.

        A prompt step is a "chunk" (it may start past a shared prefix); its state is filed under
        (the block of its last slot, the tokens then held), which no other request writes, and its
        next chunk or its first decode step ("close") finds it there. At the close, the request's
        key becomes the block of its first generated slot P, never shared, filed with P; a decode
        step finds its request's key as the first of its blocks filed at that very index (a block
        filed for a request that has ended may come back later in another request's table, never
        before its own key: a chunk step unfiles every block it writes).
        """
        tables = block_table[: len(lengths)].tolist()
        phases, prompts, keys, chunk_keys = [], [], [], []
        with self._lock:
            for row, (table, done, length) in enumerate(zip(tables, computed, lengths)):
                held = done + length
                if prefilling[row] or length > 1:  # a resumed request replays its outputs too
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
                    continue
                last = (done - 1) // block_size  # the block of the prompt's last slot, if it just closed
                earlier = (table[last] if last < len(table) else None, done)
                if earlier in self._closing:
                    self._closing.discard(earlier)
                    self._generated_blocks[table[done // block_size]] = done
                    phases.append("close")
                    prompts.append(done)
                    keys.append(table[done // block_size])
                    chunk_keys.append((earlier, None))
                    continue
                prompt = next((self._generated_blocks[block] for index, block in enumerate(table[: done // block_size + 1])
                               if self._generated_blocks.get(block, -1) // block_size == index
                               and self._generated_blocks[block] <= done), None)
                if prompt is None:
                    raise ValueError(f"paged: a decode step ({done} tokens held) of a request whose prompt this "
                                     "PagedCompression never read")
                phases.append("decode")
                prompts.append(prompt)
                keys.append(table[prompt // block_size])
                chunk_keys.append((None, None))
        return PagedBatch(list(query_start), computed, prompts, block_table[: len(lengths)], keys, phases,
                          chunk_keys=chunk_keys)

    def forward(self, kv_cache: torch.Tensor, query, key, value, batch: PagedBatch, scaling: float, layer: int = 0):
        """One attention call of every request in ``batch``, for the model's layer ``layer``.

        kv_cache [blocks, H_kv, block_size, C]; query [T, H, D]; key, value [T, H_kv, D] (T: the
        step's new tokens, request after request). Writes the kept entries back into kv_cache and
        returns the attention output [T, H, D].
        """
        output = query.new_empty(query.shape)
        for group in self._groups(batch, query.device):
            with _threads(STEP_THREADS if group.phase == "decode" else PROMPT_THREADS):
                self._forward_rows(kv_cache, query, key, value, batch, group, scaling, output, layer)
        return output

    def _groups(self, batch: PagedBatch, device) -> list["_Group"]:
        """The step's groups of rows run together, with their index tensors (built at the step's
        first layer, read by every layer): each prefill, chunk and close alone, then the decodes
        that compress now, then those that do not (interval > 1).

        Each prompt alone: prompts of unequal length in one call would be left-padded to the
        longest (wasted work), and their compression then runs on other shapes than a request's
        own cache (float noise; KeepKV's merge decisions follow it)."""
        if "groups" not in batch.plans:
            interval = self.method.interval
            decodes = [r for r, phase in enumerate(batch.phases) if phase == "decode"]
            compressing = [r for r in decodes if (batch.computed[r] - batch.prompt[r]) % interval == interval - 1]
            rows = [*([r] for r, phase in enumerate(batch.phases) if phase != "decode"), compressing,
                    [r for r in decodes if r not in compressing]]
            batch.plans["groups"] = groups = [_Group.build(batch, group, interval, device) for group in rows if group]
            for group in groups:  # each request's row of the state slabs (a new request: the next free)
                if group.phase == "chunk":  # a prompt's chunk files its state by its chunk key
                    continue
                slab_rows = [self._state_rows.setdefault(batch.first_block[r], len(self._state_rows)) for r in group.rows]
                group.state_rows = torch.tensor(slab_rows, device=device)
        return batch.plans["groups"]

    def _forward_rows(self, kv_cache, query, key, value, batch, group: "_Group", scaling, output, layer: int = 0):
        """Gather the group's rows into one LayerStore, run CompressedCache.forward_layer, write back.

        Each call runs as the cache's layer ``layer`` (its budget is that layer's; the other
        layers of the cache stay empty). A prompt read in chunks runs as the Hugging Face path's
        chunked prefill does (``CompressedCache.start_prefill``): each chunk attends over the
        chunks before it and sums the method's statistics, and the prompt is compressed once
        whole, here at the request's first decode step ("close"), before that step's token.
        """
        rows, tokens, real = group.rows, group.tokens, group.real
        new_query = query[tokens].masked_fill(~real[..., None, None], 0).transpose(1, 2)  # [R, H, q, D]
        new_keys = key[tokens].masked_fill(~real[..., None, None], 0).transpose(1, 2)  # [R, H_kv, q, D]
        new_values = value[tokens].masked_fill(~real[..., None, None], 0).transpose(1, 2)
        earlier, chunk_key = batch.chunk_keys[rows[0]]  # where a prompt's chunks file their state

        cache = CompressedCache(self.config, self.method, self.budget, decoding=self.decoding)
        if group.phase in ("prefill", "chunk") and group.seen == 0:
            cache.layers[layer].lazy_initialization(new_keys, new_values)
        elif group.phase == "chunk" and self.keep_prompt and (earlier, layer) not in self.chunks:
            # A prompt past a prefix another request wrote (prefix caching): its entries, no statistics.
            sizes = group.sizes(self, batch, layer, after=False)
            cache.adopt_prefix(layer, self._gather(kv_cache, batch, group, sizes, new_keys, layer, ()))
        elif group.phase in ("chunk", "close"):  # the prompt so far, whole, and what its chunks summed
            state, stats, extras = self.chunks.pop((earlier, layer))
            store = self._gather(kv_cache, batch, group, group.sizes(self, batch, layer, after=False), new_keys, layer, extras)
            store.resume(state=state, prefill_stats=stats)
            cache.adopt_layer(layer, store)
            if group.phase == "close":
                cache.finish_prefill(layer)
        else:
            store = self._gather(kv_cache, batch, group, group.sizes(self, batch, layer, after=False), new_keys, layer)
            pending = self.method.interval - 1 if group.compressing else 0  # this step's append compresses, or not
            store.resume(state=self._join_states(group, layer), pending=pending)
            cache.adopt_layer(layer, store)
            before = (store.positions.clone(), store.bias.clone())  # what each slot held: see _write_changed
        if group.phase == "chunk":  # announced a token longer: the cache attends and sums, and compresses nothing yet
            cache.start_prefill(torch.ones(1, group.seen + group.lengths[0] + 1, dtype=torch.bool))
        out = cache.forward_layer(layer, new_query, new_keys, new_values, group.mask, scaling)  # [R, q, H, D]
        output.index_copy_(0, group.token_index, out.flatten(0, 1).index_select(0, group.real_index).to(output.dtype))
        store = cache.layers[layer]
        if group.phase == "decode":
            self._write_changed(kv_cache, batch, group, store, layer, before)
        else:
            self._write(kv_cache, batch, group, store, group.sizes(self, batch, layer, after=True))
        if group.phase == "chunk":
            self.chunks[chunk_key, layer] = (dict(store.state), self._trimmed(store.prefill_stats), tuple(store.extras))
        else:
            self._keep_states(store.state, group, layer)

    def _trimmed(self, stats):
        """A chunked prompt's summed statistics, kept until its next chunk: the newest query rows
        only, as many as a served method reads of a prefill's queries (KeepKV: its window; its merge:
        the last), not the whole prompt's."""
        rows = max(1, self.method.needs(True).window, getattr(self.method.merging, "window", 0) or 0)
        return replace(stats, query=stats.query[:, :, :, -rows:])

    # -- the method's per-layer state, per request ----------------------------------------------
    def _keep_states(self, state: dict, group: "_Group", layer: int) -> None:
        """File a layer's method state by row: a per-row tensor (first dimension the group's rows)
        into its slab rows, anything else as the layer's. A per-row tensor whose trailing shape
        changes from step to step is tied to one step's slots (KeepKV's newest query's logits,
        [R, H_kv, g, S]): the method rewrites it before it reads it (tested against each
        request's own cache), so it is not filed."""
        if not state:
            return
        slabs = self._slabs.setdefault(layer, {})
        shared = self._layer_state.setdefault(layer, {})
        rows = group.state_rows
        for name, value in state.items():
            if not (isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == len(group.rows)):
                shared[name] = value
                continue
            slab = slabs.get(name)
            if slab is not None and (slab.shape[1:] != value.shape[1:] or slab.dtype != value.dtype):
                slabs[name] = None  # a per-step tensor: never filed again
                continue
            if name in slabs and slab is None:
                continue
            slabs[name] = slab = self._grown(value.new_zeros(0, *value.shape[1:]) if slab is None else slab)
            slab.index_copy_(0, rows, value)

    def _grown(self, slab: torch.Tensor) -> torch.Tensor:
        """``slab`` with a row for every request seen (zeros where none was filed), doubled when short."""
        if slab.shape[0] >= len(self._state_rows):
            return slab
        grown = slab.new_zeros(max(2 * len(self._state_rows), 8), *slab.shape[1:])
        grown[: slab.shape[0]] = slab
        return grown

    def _join_states(self, group: "_Group", layer: int) -> dict:
        """The group's rows' filed states as one layer's (per-row tensors read from their slabs; a
        row nothing was filed for reads zeros)."""
        joined = dict(self._layer_state.get(layer, {}))
        slabs = self._slabs.get(layer, {})
        for name, slab in slabs.items():
            if slab is not None:
                slabs[name] = slab = self._grown(slab)
                joined[name] = slab.index_select(0, group.state_rows)
        return joined

    # -- gather / write ------------------------------------------------------------------------
    def _gather(self, kv_cache, batch: PagedBatch, group: "_Group", sizes: tuple, like, layer: int = 0,
                extras: tuple[str, ...] | None = None) -> LayerStore:
        """A decode-ready LayerStore of each row's first ``sizes`` slots (slots past a row's size
        are empty), its budgets fixed by its prompt; or, for a prompt read in chunks (``extras``:
        the extras its method has added so far), the prompt so far, without budgets.

        Keys and values are read by one index_select each straight into the store's buffers, with
        room for the step's append (``LayerStore._extend`` appends in place); the metadata words by
        one more. ``like``: [R, H_kv, q, D] of the model's dtype.
        """
        kv_heads, block_size, words = kv_cache.shape[1:]
        head_dim = like.shape[-1]
        slots = group.slots(sizes, kv_heads, block_size)
        rows, _, size = slots.flat.shape
        spare = self.method.interval  # the store's headroom (below): spare slots for the step's append
        flat = kv_cache.view(-1, words)  # vLLM's per-layer cache is one contiguous tensor
        with torch.inference_mode(False):  # the store's buffers are normal tensors (LayerStore._new_buffer)
            keys, values = (
                flat[:, start : start + head_dim].index_select(0, group.reads(sizes, spare, slots)).view(rows, kv_heads, size + spare, head_dim)
                for start in (0, head_dim)
            )
        meta_words = 4 * self.meta_words // kv_cache.element_size()
        meta = flat[:, 2 * head_dim : 2 * head_dim + meta_words].index_select(0, slots.flat.view(-1))
        meta = meta.view(torch.float32).view(*slots.flat.shape, self.meta_words)
        empty = slots.empty
        positions = meta[..., 0].long().masked_fill_(empty, -1)
        bias = meta[..., 1].masked_fill(empty, NEG_INF)
        reading = extras is not None
        chosen = set(self.extras if extras is None else extras)
        tensors, word = {"keys": keys.narrow(2, 0, size), "values": values.narrow(2, 0, size), "bias": bias, "positions": positions}, 2
        for name, shape in self.extras.items():
            width = math.prod(shape)
            if name in chosen:
                extra = meta[..., word : word + width].reshape(*meta.shape[:-1], *shape)
                tensors[f"extras.{name}"] = extra.masked_fill(empty.view(*empty.shape, *(1,) * len(shape)), self.extra_fill[name])
            word += width
        store = LayerStore.from_entries(
            layer, tensors, {name: self.extra_fill[name] for name in chosen}, seen=group.seen, real_seen=group.computed,
            binary=self.binary, headroom=spare, buffers={"keys": keys, "values": values},
        )
        if reading:
            return store
        kept, mean, frozen = group.budgets(self, batch, layer)
        store.set_budget(kept[:, None].expand(-1, kv_heads).contiguous(), mean, frozen)  # as CompressedCache._end_prefill
        return store

    def _write(self, kv_cache, batch: PagedBatch, group: "_Group", layer: LayerStore, sizes: tuple) -> None:
        """Write each row's live entries, compacted, into its first ``sizes`` slots: whole slots
        (key, value, metadata) packed once, then one index_select of the written slots' sources and
        one index_copy_ into the cache, over slot indices built once per step, no host sync (which
        slots a step's eviction or merge changed is data; writing every kept slot is not)."""
        kv_heads, block_size, slot_words = kv_cache.shape[1:]
        slots = group.slots(sizes, kv_heads, block_size, group.starts(self, batch))
        index, _ = slots_of(layer.live(), max(sizes))  # [R, H_kv, W] live slots first, in slot order
        dtype = kv_cache.dtype
        packed = torch.cat([layer.keys.to(dtype), layer.values.to(dtype), self._meta_words(layer).view(dtype)], dim=-1)
        rows, size, width = packed.shape[0], packed.shape[2], packed.shape[-1]  # [R, H_kv, S, C']
        # Each written slot's source: [N, H_kv] rows of packed.view(-1, C'), (row, head, slot) flattened.
        source = (slots.row[:, None] * kv_heads + slots.heads[None, :]) * size + index[slots.row, :, slots.slot]
        content = packed.view(rows * kv_heads * size, width).index_select(0, source.flatten())
        flat = kv_cache.view(-1, slot_words)  # vLLM's per-layer cache is one contiguous tensor
        flat[:, :width].index_copy_(0, slots.written, content)

    def _meta_words(self, layer: LayerStore) -> torch.Tensor:
        """[R, H_kv, S, M] fp32: each entry's metadata words as a slot stores them (position, bias,
        the method's extras in order; an extra the store has not added yet, as in a prompt read in
        chunks, at its fill value)."""
        words = [layer.positions.float()[..., None], layer.bias[..., None]]
        for name, shape in self.extras.items():
            if name in layer.extras:
                words.append(layer.extras[name].flatten(3) if len(shape) else layer.extras[name][..., None])
            else:  # a prompt read in chunks: the method adds its extras when it compresses
                words.append(words[0].new_full((*words[0].shape[:3], math.prod(shape)), self.extra_fill[name]))
        return torch.cat(words, dim=-1)

    def _write_changed(self, kv_cache, batch: PagedBatch, group: "_Group", layer: LayerStore, layer_idx: int,
                       before: tuple[torch.Tensor, torch.Tensor]) -> None:
        """A decode step's write: each row's entries into its first ``sizes`` slots, moving only what
        changed. An entry that stays in a slot below the row's size stays in that slot; the entries
        past it (the step's new token, a kept entry of a ragged row) fill the emptied slots below, in
        slot order. The metadata words (position, bias, scores, EMA) of every slot are written; the
        key and value only of the slots whose entry or votes changed.

        ``before`` ([R, H_kv, S] positions and bias of the gathered slots, before the step): a served
        method changes a slot's key or value only with its entry (position) or its votes (bias: a
        merge adds the merged entry's), so a slot whose position and bias are unchanged holds the
        key and value it was read with. No host sync: how many slots change is bounded by the step's
        sizes, known on the host (:meth:`_Group.changed_bound`).
        """
        kv_heads, block_size, slot_words = kv_cache.shape[1:]
        sizes = group.sizes(self, batch, layer_idx, after=True)
        slots = group.slots(sizes, kv_heads, block_size, group.starts(self, batch))
        rows, _, size = layer.bias.shape  # [R, H_kv, S']
        width = max(sizes)
        live = layer.live()
        after = group.size_tensor(sizes)  # [R, 1, 1]
        slot = torch.arange(size, device=live.device)
        source = slot[:width].expand(rows, kv_heads, width)  # [R, H_kv, W] the store slot each slot gets
        spill = size - min(sizes)  # at most this many entries per row past its size
        if spill > 0:
            holes = ~live[..., :width] & (slot[:width] < after)
            hole, has_hole = slots_of(holes, min(spill, width))
            mover, has_mover = slots_of(live & (slot >= after), min(spill, width))
            source = source.scatter(-1, hole, mover.where(has_hole & has_mover, hole))
        # Metadata of every slot within sizes: [N, H_kv] rows of the packed words.
        meta = self._meta_words(layer)  # [R, H_kv, S', M] fp32
        meta_rows = (slots.row[:, None] * kv_heads + slots.heads[None, :]) * size + source[slots.row, :, slots.slot]
        head_dim = layer.keys.shape[-1]
        meta_width = 4 * meta.shape[-1] // kv_cache.element_size()
        flat = kv_cache.view(-1, slot_words)  # vLLM's per-layer cache is one contiguous tensor
        content = meta.view(-1, meta.shape[-1]).index_select(0, meta_rows.flatten()).view(kv_cache.dtype)
        flat[:, 2 * head_dim : 2 * head_dim + meta_width].index_copy_(0, slots.written, content)
        # Keys and values of the changed slots only; the rest (padding) rewrite a slot with its own.
        old_positions, old_bias = (t[..., :width] for t in before)
        if width > old_positions.shape[-1]:  # slots the row did not hold before: empty then
            pad = width - old_positions.shape[-1]
            old_positions = F.pad(old_positions, (0, pad), value=-1)
            old_bias = F.pad(old_bias, (0, pad), value=NEG_INF)
        changed = (layer.positions.gather(-1, source) != old_positions) | (layer.bias.gather(-1, source) != old_bias)
        changed &= slot[:width] < after
        bound = group.changed_bound(group.sizes(self, batch, layer_idx, after=False), sizes, (before[0].shape[-1], size))
        index, is_changed = slots_of(changed, bound)
        starts = group.starts(self, batch)  # padding rewrites a slot the step may write, with its own
        index = index.where(is_changed, 0 if starts is None else group.size_tensor(starts))  # [R, H_kv, C]
        take = source.gather(-1, index)[..., None].expand(-1, -1, -1, head_dim)
        key_value = torch.cat([layer.keys.gather(2, take), layer.values.gather(2, take)], dim=-1).to(kv_cache.dtype)
        flat[:, : 2 * head_dim].index_copy_(0, slots.flat.gather(-1, index).flatten(), key_value.view(-1, 2 * head_dim))


@dataclass
class _Slots:
    """Index tensors of a group's first ``sizes`` slots (built once per step and sizes).

    flat [R, H_kv, S]: each slot's row in ``kv_cache.view(-1, C)`` (block 0 past a row's size);
    empty [R, H_kv, S]: past the row's size; row, slot [N]: the (row, slot) pairs within sizes;
    written [N·H_kv]: their flat rows, head after head (the order of ``[N, H_kv]``)."""

    flat: torch.Tensor
    empty: torch.Tensor
    row: torch.Tensor
    slot: torch.Tensor
    written: torch.Tensor
    heads: torch.Tensor  # [H_kv] 0..H_kv-1


@dataclass
class _Group:
    """Rows of one step run together, and their index tensors (built once per step).

    tokens, real [R, q]: the rows' new tokens left-padded to one block (flat token indices,
    padding 0); mask [R, 1, q, q]; token_index, real_index [n]: where the real tokens are in the
    step's flat token axis and in the group's [R·q]; computed [R]: tokens before this step."""

    rows: list[int]
    lengths: list[int]
    phase: str  # PagedBatch.phases: "prefill", "chunk", "close" or "decode"
    compressing: bool
    table: torch.Tensor
    tokens: torch.Tensor
    real: torch.Tensor
    mask: torch.Tensor
    token_index: torch.Tensor
    real_index: torch.Tensor
    computed: torch.Tensor
    seen: int
    cache: dict
    state_rows: torch.Tensor | None = None  # [R] the rows' slab rows (PagedCompression._keep_states)

    @classmethod
    def build(cls, batch: PagedBatch, rows: list[int], interval: int, device) -> "_Group":
        """The group of ``rows``; ValueError if they mix phases (a prefill, a chunk, a close, a
        decode that compresses now, one that does not): one LayerStore has one prefill flag and
        one pending count for its rows."""
        lengths = batch.query_lengths
        computed = [batch.computed[r] for r in rows]
        phases = {(batch.phases[r], batch.phases[r] == "decode" and (done - batch.prompt[r]) % interval == interval - 1)
                  for r, done in zip(rows, computed)}
        if len(phases) > 1 or (len(rows) > 1 and batch.phases[rows[0]] != "decode"):
            raise ValueError(f"paged: rows {rows} mix phases (prefill, compressing or plain decode), or share a "
                             "prompt step: call them apart")
        phase, compressing = phases.pop()
        counts = [lengths[r] for r in rows]
        block = max(counts)
        starts = torch.tensor([batch.query_start[r] for r in rows])
        offsets = torch.arange(block) - (block - torch.tensor(counts))[:, None]
        real = offsets >= 0
        tokens = (starts[:, None] + offsets).where(real, 0)
        mask = (torch.ones(block, block, dtype=torch.bool).tril() & real[:, None, :])[:, None]
        return cls(
            rows=list(rows), lengths=counts, phase=phase, compressing=compressing,
            table=batch.block_table[rows].long().to(device),
            tokens=tokens.to(device), real=real.to(device), mask=mask.to(device),
            token_index=tokens[real].to(device), real_index=real.flatten().nonzero().flatten().to(device),
            computed=torch.tensor(computed, device=device), seen=max(computed), cache={},
        )

    def slots(self, sizes: tuple, kv_heads: int, block_size: int, starts: tuple | None = None) -> _Slots:
        """The rows' first ``sizes`` slots (:class:`_Slots`; the pairs it writes from ``starts``, per
        row, if given), built at the first layer that asks."""
        if (sizes, starts) not in self.cache:
            device = self.table.device
            width = max(sizes)
            count = torch.tensor(sizes)
            first = torch.zeros_like(count) if starts is None else torch.tensor(starts).clamp(max=count)
            written_count = count - first
            total = int(written_count.sum())
            slot = torch.arange(width)
            valid = slot < count[:, None]  # [R, S]
            blocks = self.table.cpu()[:, slot // block_size].where(valid, 0)
            heads = torch.arange(kv_heads)
            flat = (blocks[:, None, :] * kv_heads + heads[None, :, None]) * block_size + (slot % block_size)
            # The (row, slot) pairs it writes, from the host's sizes (no device sync):
            row = torch.repeat_interleave(torch.arange(len(sizes)), written_count, output_size=total)
            slot_of_row = torch.arange(total) - (written_count.cumsum(0) - written_count)[row] + first[row]
            written = flat[row, :, slot_of_row].flatten()
            self.cache[sizes, starts] = _Slots(*(t.to(device) for t in (
                flat, ~valid[:, None, :].expand(-1, kv_heads, -1), row, slot_of_row, written, heads)))
        return self.cache[sizes, starts]

    def reads(self, sizes: tuple, spare: int, slots: "_Slots") -> torch.Tensor:
        """[R·H_kv·(S + spare)] rows of ``kv_cache.view(-1, C)``: each row and head's first ``sizes``
        slots (:meth:`slots`), then ``spare`` more that repeat its first (a buffer's spare slots, which
        appends overwrite). Built once per step, sizes and spare."""
        key = ("reads", sizes, spare)
        if key not in self.cache:
            flat = slots.flat
            self.cache[key] = torch.cat([flat, flat[..., :1].expand(-1, -1, spare)], dim=-1).flatten()
        return self.cache[key]

    def size_tensor(self, sizes: tuple) -> torch.Tensor:
        """[R, 1, 1] ``sizes`` on the device (built once per step and sizes)."""
        key = ("size_tensor", sizes)
        if key not in self.cache:
            self.cache[key] = torch.tensor(sizes, device=self.table.device)[:, None, None]
        return self.cache[key]

    def changed_bound(self, before: tuple, after: tuple, slots: tuple[int, int]) -> int:
        """Most slots of one row and head that a decode step changes (``PagedCompression._write_changed``),
        from host-side sizes. ``before``, ``after``: the rows' sizes before and after the step;
        ``slots``: the step's store's slots before and after it.

        Per row: the q new tokens and the entries a compression moves (at most the tail it cuts,
        before + q - kept) each land in one slot; it merges into at most as many targets as it
        evicts (before + q - after); the entries then past the row's size (the former, or kept
        entries of a row shrinking to its budget) fill as many of its emptied slots.
        """
        q = self.tokens.shape[1]
        tail = slots[0] + q - slots[1]
        most = max(
            q + tail + max(0, b + q - a) + min(slots[1] - a, max(0, b - a) + q + tail) for b, a in zip(before, after)
        )
        return max(1, min(max(after), most))

    def sizes(self, paged: PagedCompression, batch: PagedBatch, layer: int, after: bool) -> tuple:
        """Entries each row of layer ``layer`` holds before the step's append, or after the step
        (``PagedCompression.stored``; the same for every layer but PyramidKV's). A prompt read in
        chunks holds all its tokens until its close step compresses it."""
        key = ("sizes", layer, after)
        if key not in self.cache:
            def held(r, length):
                done = batch.computed[r] + (length if after else 0)
                if self.phase == "chunk" or (self.phase == "close" and not after):
                    return done
                return paged.stored(batch.prompt[r], done, layer)
            self.cache[key] = tuple(held(r, length) for r, length in zip(self.rows, self.lengths))
        return self.cache[key]

    def budgets(self, paged: PagedCompression, batch: PagedBatch, layer: int) -> tuple:
        """([R] entries layer ``layer`` keeps, [R] mean budgets, [R] kept prompts or None), as
        CompressedCache._end_prefill sets them."""
        key = ("budgets", layer)
        if key not in self.cache:
            prompts = torch.tensor([batch.prompt[r] for r in self.rows])
            device = self.table.device
            kept = torch.tensor([paged.kept(p, layer) for p in prompts.tolist()], device=device)
            if paged.keep_prompt:  # the generated entries' budget, and the prompt kept whole
                self.cache[key] = (kept, torch.full_like(prompts, paged.budget).to(device), prompts.to(device))
            else:
                mean = row_budgets(paged.budget, prompts, budget_floor(paged.method)).to(device)
                self.cache[key] = (kept, mean, None)
        return self.cache[key]

    def starts(self, paged: PagedCompression, batch: PagedBatch) -> tuple | None:
        """The first slot of each row that a step may write (None: slot 0): with ``keep_prompt`` the
        slots a prompt's earlier steps (or another request, a shared prefix) wrote are never
        written again, so a prompt step writes from its first new token and a decode step from
        the first generated slot."""
        if not paged.keep_prompt:
            return None
        return tuple(batch.prompt[r] if self.phase == "decode" else batch.computed[r] for r in self.rows)
