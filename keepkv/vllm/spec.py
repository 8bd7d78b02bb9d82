"""The scheduler side: a KV cache spec that carries the method, and a manager that caps blocks.

The manager sees token counts only; a request's prompt length fixes its capacity. Where the
method's layers keep budgets of their own (PyramidKV, the learned selection's trained split), the
layers are grouped by budget (:func:`layer_groups`), each group a KV cache group of vLLM's with a
manager and a block table of its own, capped at the group's largest layer.

- Without chunked prefill, a request's first allocation is its whole prompt; from then on it
  never holds more than ceil(capacity / block_size) blocks, prefill included: the worker
  compresses the prompt in its own workspace and writes only the kept entries
  (:mod:`keepkv.paged`).
- With chunked prefill, the prompt's chunks are written whole (a later chunk attends to them),
  so the request holds blocks for its whole prompt until its first decode step, where the
  worker compresses it; once that step is processed, the blocks past its capacity are freed
  (:meth:`KeepKVManager.remove_skipped_blocks`, which vLLM calls before every allocation), and
  it never grows past its capacity again.
- A method that compresses a prompt chunk by chunk (``PagedCompression.compresses_chunks``: the
  learned selection, merge none): the worker compresses each chunk but the last to the whole
  prompt's budget, so a request's blocks grow only to that budget plus one chunk
  (``KeepKVSpec.reading_tokens``); the worker fills them by slot, not by position (its table
  holds no null block while it reads), and the close frees the rest as above.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from types import SimpleNamespace

from vllm.logger import init_logger
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec

from ..paged import PagedCompression

logger = init_logger("vllm.keepkv")  # vLLM's handlers and format (a child of its "vllm" logger)


@dataclass(frozen=True, kw_only=True)
class KeepKVSpec(FullAttentionSpec):
    """Full attention whose requests keep at most ``capacity_bound`` entries per layer and head.

    method, budget: as ``keepkv.CompressedCache``'s; num_layers: the model's depth (the bound
    reads it); chunked: the engine reads prompts in chunks; max_model_len: the engine's context
    length (the start-up line reads it); keep_prompt: prompts are kept whole and ``budget``
    generated entries per request (its prompt blocks may then be shared: prefix caching);
    tensor_parallel_size: the ranks, each holding ``num_kv_heads`` of the model's KV heads in
    blocks of its own (every rank's block ids and sizes are the scheduler's one table);
    chunk_blocks: with keep_prompt, a prompt's whole chunks of this many blocks are compressed
    alone to one block each, and the prefix cache shares them (0: prompts kept whole;
    :mod:`keepkv.paged_chunks`); layer_groups, group: the model's layers in groups by budget
    (:func:`layer_groups`; () when one table serves every layer) and the one this layer's spec is
    in: vLLM gives each group a KV cache group, a block table of its own, whose requests hold the
    blocks of the group's largest layer.
    ``state_content_bytes`` holds each slot's key, value and metadata words.
    """

    method: str = "full"
    budget: float | int = 1.0
    num_layers: int = 1
    chunked: bool = False
    max_model_len: int = 0
    keep_prompt: bool = False
    tensor_parallel_size: int = 1
    chunk_blocks: int = 0
    layer_groups: tuple[tuple[int, ...], ...] = ()
    group: int = 0

    @classmethod
    def merge(cls, specs: list["KeepKVSpec"]) -> "KeepKVSpec":
        """One group's spec. Layers of different groups never merge (AssertionError, which vLLM's
        grouping reads as "a KV cache group of its own")."""
        first = specs[0]
        if any((spec.layer_groups, spec.group) != (first.layer_groups, first.group) for spec in specs):
            raise AssertionError("keepkv: layers of different groups keep blocks of their own")
        merged = super().merge(specs)  # builds cls(...) from the base fields only
        return replace(merged, method=first.method, budget=first.budget, num_layers=first.num_layers,
                       chunked=first.chunked, max_model_len=first.max_model_len, keep_prompt=first.keep_prompt,
                       tensor_parallel_size=first.tensor_parallel_size, chunk_blocks=first.chunk_blocks,
                       layer_groups=first.layer_groups, group=first.group)

    def is_uniform_with_collection(self, kv_cache_specs: dict) -> bool:
        """vLLM puts layers of one type in one group unless this says no: layers of different
        groups are not one type."""
        return super().is_uniform_with_collection(kv_cache_specs) and all(
            (getattr(spec, "layer_groups", ()), getattr(spec, "group", 0)) == (self.layer_groups, self.group)
            for spec in kv_cache_specs.values())

    @functools.cached_property
    def compression(self) -> PagedCompression:
        config = SimpleNamespace(num_hidden_layers=self.num_layers, num_key_value_heads=self.num_kv_heads)
        return PagedCompression(config, self.method, self.budget, chunked=self.chunked, keep_prompt=self.keep_prompt,
                                chunk_blocks=self.chunk_blocks)

    @property
    def compresses_chunks(self) -> bool:
        """Whether the worker compresses a prompt read in chunks after each chunk but its last, to its
        whole prompt's budget (``PagedCompression.compresses_chunks``)."""
        return self.compression.compresses_chunks

    def reading_tokens(self, prompt_length: int, computed: int) -> int:
        """Slots a request holds in this spec's group after its first ``computed`` tokens of a prompt
        of ``prompt_length`` read in chunks (``PagedCompression.reading``)."""
        return _reading(self.compression, prompt_length, computed, self.layers)

    @property
    def layers(self) -> tuple[int, ...] | None:
        """The model's layers whose blocks this spec's table holds (None: every layer)."""
        return self.layer_groups[self.group] if self.layer_groups else None

    def capacity_tokens(self, prompt_length: int, group: int | None = None) -> int:
        """Slots a request of ``prompt_length`` prompt tokens ever needs in this spec's group (or in
        ``group``'s)."""
        layers = self.layer_groups[group] if group is not None and self.layer_groups else self.layers
        return _capacity(self.compression, prompt_length, layers)

    def shapes(self) -> list[tuple[int, int]]:
        """The (prompt, generated tokens) requests the start-up line counts: a long document with a
        short answer (the context less 512 tokens, then 512) and a chat turn (1,024 and 1,024)."""
        long = max(1, self.max_model_len - 512)
        return [(long, min(512, self.max_model_len - long)), (1024, 1024)]

    def capacity_line(self, num_blocks: int) -> str:
        """What keepkv buys, in one line, for a KV cache of ``num_blocks`` blocks (vLLM's null block
        included): its slots, the tokens stock vLLM would hold in the same memory (a slot also holds
        the method's words, and a merging method's wider keys), and how many requests of each of
        :meth:`shapes` fit at once, each capped at its capacity in whole blocks, against stock's
        (whose requests hold every token); and which shapes gain nothing."""
        usable = num_blocks - 1  # requests never get block 0, vLLM's null block (its own figures count it)
        slots = num_blocks * self.block_size
        stock_bytes = 2 * self.head_size * self.dtype.itemsize  # key and value, per token and KV head
        # With layer groups a block holds one group's layers, and a request holds blocks in each group.
        groups = range(len(self.layer_groups)) if self.layer_groups else [None]
        group_layers = len(self.layers) if self.layer_groups else self.num_layers
        stock_tokens = slots * self.state_content_bytes * group_layers // (stock_bytes * self.num_layers)
        counted, losing = [], []
        for prompt, generated in self.shapes():
            blocks = 0
            for group in groups:
                held = min(prompt + generated, self.capacity_tokens(prompt, group))
                if self.chunk_blocks:  # each whole chunk of the prompt holds one block, behind null ones
                    held -= (self.chunk_blocks - 1) * self.block_size * (prompt // (self.chunk_blocks * self.block_size))
                blocks += math.ceil(held / self.block_size)
            mine, theirs = usable // blocks, stock_tokens / (prompt + generated)
            counted.append(f"{mine:,} of a {prompt:,}-token prompt generating {generated:,} (stock {theirs:.2f})")
            if mine <= theirs:
                losing.append(f"{prompt:,} + {generated:,}")
        budget = f"prompts kept whole, {self.budget} generated entries" if self.keep_prompt else f"budget {self.budget}"
        if self.chunk_blocks:
            budget = (f"prompts compressed chunk by chunk ({self.chunk_blocks * self.block_size:,} tokens to "
                      f"{self.block_size} entries, shared through the prefix cache), {self.budget} generated entries")
        ranks = self.tensor_parallel_size
        if ranks > 1:
            rank_bytes = num_blocks * group_layers * self.page_size_bytes
            budget += (f", tensor parallel over {ranks} ranks, each holding {self.num_kv_heads} of the model's "
                       f"{ranks * self.num_kv_heads} KV heads in {rank_bytes / 2**20:,.1f} MiB of KV cache "
                       f"({ranks * rank_bytes / 2**20:,.1f} MiB on all {ranks}); on every rank")
        if self.layer_groups:
            budget += (f", layers in {len(self.layer_groups)} groups of {group_layers} with blocks of their own "
                       f"(by their budgets)")
        # a block serves one group at a time: its slots hold that group's layers only
        of_group = f", each of one group's {group_layers} layers" if self.layer_groups else ""
        line = (f"keepkv: {self.method} at {budget}: KV cache of {slots:,} slots{of_group} (stock vLLM would hold "
                f"{stock_tokens:,} tokens in the same memory: each slot also holds {self.state_content_bytes - stock_bytes} "
                f"bytes of scores and votes per KV head); requests at once: {'; '.join(counted)}")
        if losing:
            gains = ("only requests that generate more than their budget" if self.keep_prompt else
                     "only requests whose prompt is longer than their budget")
            line += f"; no gain for {', '.join(losing)}: {gains} hold fewer slots than stock's tokens"
        return line


@functools.lru_cache(maxsize=4096)
def _reading(compression: PagedCompression, prompt_length: int, computed: int, layers: tuple[int, ...] | None) -> int:
    return compression.reading(prompt_length, computed, layers)


@functools.lru_cache(maxsize=4096)
def _capacity(compression: PagedCompression, prompt_length: int, layers: tuple[int, ...] | None = None) -> int:
    return compression.capacity(prompt_length, layers)


# Layers whose budgets differ get blocks of their own in groups (layer_groups), the fewest groups
# whose blocks per request stay within this fraction of one layer per group's: each group costs the
# engine a block table and a step's metadata.
GROUP_SLACK = 0.1


def layer_groups(compression: PagedCompression, prompt_length: int, block_size: int = 1) -> tuple[tuple[int, ...], ...]:
    """The model's layers in groups of one size, each to hold blocks of its own (vLLM's KV cache
    groups, which it keeps at one size), for a method whose layers keep budgets of their own
    (PyramidKV's, the learned selection's trained split): the layers sorted by the slots each
    needs for a prompt of ``prompt_length`` tokens, cut into the fewest groups whose blocks of
    ``block_size`` slots held per request (each group holds its largest layer's, in whole blocks)
    are within :data:`GROUP_SLACK` of a group per layer's. () when one group is within it: one
    block table serves every layer."""
    layers = compression.config.num_hidden_layers
    needed = [compression.capacity(prompt_length, (layer,)) for layer in range(layers)]
    order = sorted(range(layers), key=lambda layer: (needed[layer], layer))

    def cut(count: int) -> tuple[list[list[int]], int]:
        size = layers // count
        groups = [order[start: start + size] for start in range(0, layers, size)]
        return groups, sum(size * -(-max(needed[layer] for layer in group) // block_size) for group in groups)

    fewest = cut(layers)[1]
    for count in (count for count in range(1, layers + 1) if layers % count == 0):
        groups, blocks = cut(count)
        if blocks <= (1 + GROUP_SLACK) * fewest:
            return () if count == 1 else tuple(tuple(sorted(group)) for group in groups)
    raise AssertionError("one layer per group holds the fewest blocks")


@functools.lru_cache(maxsize=16)  # each layer's attention and each group's metadata builder ask
def engine_layer_groups(compression: PagedCompression, max_model_len: int, block_size: int) -> tuple[tuple[int, ...], ...]:
    """The layer groups an engine of context ``max_model_len`` and blocks of ``block_size`` slots
    serves ``compression`` with: by the slots each layer needs for a prompt of half the context
    (prompts kept whole: one group)."""
    return () if compression.keep_prompt else layer_groups(compression, max(1, max_model_len // 2), block_size)


class KeepKVManager(FullAttentionManager):
    """FullAttentionManager whose requests stop growing at their capacity.

    With ``chunk_blocks`` = c (:mod:`keepkv.paged_chunks`) a request's table holds, for each whole
    chunk of its prompt that the worker compressed, c - 1 null blocks and the chunk's last block,
    which holds its kept entries. Only those last blocks are hashed (their hash covers every token
    up to the chunk's end), once the step that compressed them ran; a cache hit is a run of whole
    chunks (:meth:`find_longest_cache_hit`), so a request skips reading them.
    """

    def __init__(self, kv_cache_spec: KeepKVSpec, **kwargs):
        super().__init__(kv_cache_spec, **kwargs)
        self.prompt_tokens: dict[str, int] = {}  # request -> its prompt's tokens
        self._requests: dict = {}  # chunk_blocks: request id -> the request, until it is freed
        self._computed: dict[str, int] = {}  # request -> its computed tokens at its latest allocation
        if kv_cache_spec.max_model_len and kv_cache_spec.group == 0:  # one line for every group
            logger.info(kv_cache_spec.capacity_line(self.block_pool.num_gpu_blocks))

    def _capacity(self, request_id: str) -> int:
        """Slots the request needs once its prompt is compressed. Read in chunks, its prompt is
        what the worker finds at its first decode step: the scheduler's prefill end, or one
        token more for a resumed request whose last replayed chunk also took its newest token."""
        prompt, spec = self.prompt_tokens[request_id], self.kv_cache_spec
        if not spec.chunked:
            return spec.capacity_tokens(prompt)
        return max(spec.capacity_tokens(prompt), spec.capacity_tokens(prompt + 1))

    def _capped(self, request_id: str, num_tokens: int) -> int:
        if request_id not in self.prompt_tokens:  # a whole prompt's first allocation
            return min(num_tokens, self.kv_cache_spec.capacity_tokens(num_tokens))
        if self.kv_cache_spec.chunked and num_tokens <= self.prompt_tokens[request_id]:
            if self.kv_cache_spec.compresses_chunks:  # its chunks so far hold at most the prompt's budget
                computed = self._computed.get(request_id, 0)
                held = self.kv_cache_spec.reading_tokens(self.prompt_tokens[request_id], computed)
                return min(num_tokens, held + num_tokens - computed)
            return num_tokens  # the prompt's chunks are written whole until it is compressed
        return min(num_tokens, self._capacity(request_id))

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks,
                                   total_computed_tokens: int, *args, prefill_end: int = 0, **kwargs) -> int:
        if self.kv_cache_spec.chunked and not self.req_to_blocks.get(request_id):
            if prefill_end <= 0:  # vLLM passes it unless prefix-cache retention is on (refused for full attention)
                raise RuntimeError("keepkv.vllm: the scheduler gave no prefill end for a chunked prompt")
            self.prompt_tokens[request_id] = prefill_end  # the scheduler's: where its chunks end
        self._computed[request_id] = total_computed_tokens  # allocate_new_blocks follows, for the same step
        return super().get_num_blocks_to_allocate(
            request_id, self._capped(request_id, num_tokens), new_computed_blocks, total_computed_tokens, *args,
            prefill_end=prefill_end, **kwargs
        )

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int):
        if not self.kv_cache_spec.chunked and not self.req_to_blocks.get(request_id):
            self.prompt_tokens[request_id] = num_tokens
        capped = self._capped(request_id, num_tokens)
        return super().allocate_new_blocks(request_id, capped, min(num_tokens_main_model, capped))

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None):
        """Free the blocks past a chunked request's capacity once the step that compressed its
        prompt (its first decode step) is processed: from then on the worker reads only its
        leading slots. Before that step is processed the worker may still read them, so an
        in-flight step never sees them reused. With ``chunk_blocks``: free the first c - 1 blocks
        of each chunk of the prompt that the processed steps compressed."""
        super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)
        chunk = self.kv_cache_spec.chunk_blocks
        if chunk and num_prompt_tokens is not None and self.req_to_blocks.get(request_id):
            whole = min(processed_computed_tokens, num_prompt_tokens) // (chunk * self.block_size)
            for index in range(whole):
                self._remove_blocks_in_range(request_id, chunk * index, chunk * (index + 1) - 1)
        prompt = self.prompt_tokens.get(request_id)
        if not self.kv_cache_spec.chunked or prompt is None or not self.req_to_blocks.get(request_id):
            return
        resumed = num_prompt_tokens is not None and prompt != num_prompt_tokens  # its close step may come one token later
        if processed_computed_tokens >= prompt + 1 + resumed:
            blocks = self.req_to_blocks[request_id]
            keep = -(-self._capacity(request_id) // self.block_size)
            if len(blocks) > keep and not blocks[-1].is_null:
                self._remove_blocks_in_range(request_id, keep, len(blocks))

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length: int, kv_cache_group_ids: list[int], block_pool,
                               kv_cache_spec, *args, **kwargs):
        """FullAttentionManager's, or with ``chunk_blocks`` the longest run of whole compressed chunks
        from the prompt's start: each a chunk's last block behind c - 1 null blocks, its hit the
        chunk's tokens."""
        chunk = getattr(kv_cache_spec, "chunk_blocks", 0)
        if not chunk:
            return super().find_longest_cache_hit(block_hashes, max_length, kv_cache_group_ids, block_pool,
                                                  kv_cache_spec, *args, **kwargs)
        if block_pool.hash_block_size != kv_cache_spec.block_size:
            raise RuntimeError("keepkv.vllm: compressed prefix caching hashes whole blocks of the KV cache's size")
        computed = tuple([] for _ in kv_cache_group_ids)
        for index in range(chunk - 1, max_length // kv_cache_spec.block_size, chunk):
            cached = block_pool.get_cached_block(block_hashes[index], kv_cache_group_ids)
            if not cached:
                break
            for blocks, block in zip(computed, cached):
                blocks.extend([block_pool.null_block] * (chunk - 1) + [block])
        return computed, len(computed[0]) * kv_cache_spec.block_size

    def cache_blocks(self, request, num_tokens: int, *args, **kwargs) -> None:
        """Prefix caching (keep_prompt only): hash a request's full prompt blocks, never a block
        that holds a generated entry (the worker compacts those, so their content is not their
        tokens'). With ``chunk_blocks``: hash the last block of each chunk of the prompt that an
        earlier step compressed (this step's are written as it runs: a request scheduled with it
        must not find them yet)."""
        if self.kv_cache_spec.chunk_blocks:
            if self.kv_cache_spec.prefix_cacheable:
                self._requests[request.request_id] = request  # its last chunks are hashed when it ends
                self._cache_chunks(request)
            return
        if self.kv_cache_spec.keep_prompt:
            num_tokens = min(num_tokens, request.num_prompt_tokens // self.block_size * self.block_size)
        super().cache_blocks(request, num_tokens, *args, **kwargs)

    def _cache_chunks(self, request) -> None:
        """Hash the last block of each chunk of ``request``'s prompt that its processed steps
        compressed and that is not hashed yet (``chunk_blocks``)."""
        chunk = self.kv_cache_spec.chunk_blocks
        whole = min(request.num_computed_tokens, request.num_prompt_tokens) // (chunk * self.block_size)
        cached = self.num_cached_block.get(request.request_id, 0)
        blocks = self.req_to_blocks.get(request.request_id, [])
        for end in range(chunk * (cached // chunk + 1), min(chunk * whole, len(blocks)) + 1, chunk):
            if not blocks[end - 1].is_null:
                self.block_pool.cache_full_blocks(request=request, blocks=blocks, num_cached_blocks=end - 1,
                                                  num_full_blocks=end, block_size=self.block_size,
                                                  kv_cache_group_id=self.kv_cache_group_id)
        self.num_cached_block[request.request_id] = max(cached, chunk * whole)

    def pop_blocks_for_free(self, request_id: str):
        """A request ends (or is preempted): the chunks its last step compressed are hashed first, so
        that they go to the prefix cache with the others (a request that ends at its first token
        would otherwise never hash its last chunk)."""
        self.prompt_tokens.pop(request_id, None)
        self._computed.pop(request_id, None)
        request = self._requests.pop(request_id, None)
        if request is not None and request_id in self.req_to_blocks:
            self._cache_chunks(request)
        return super().pop_blocks_for_free(request_id)
