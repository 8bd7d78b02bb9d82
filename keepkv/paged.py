"""The paged adapter: methods run on requests whose entries live in a serving engine's blocks,
and the engine's own kernel attends over them in place.

A serving engine (vLLM) stores each request's KV entries in blocks of ``block_size`` slots listed
in a block table, and frees whole blocks. Here every head of a request holds the same number of
entries, S, in its slots 0..S-1 (S is known from token counts alone: :meth:`PagedCompression.stored`),
so to the engine's kernel a compressed request is an ordinary shorter sequence with its own block
table, and an uncompressed one is exactly what stock vLLM holds. One layer's step over a batch of
requests (:meth:`PagedCompression.forward`):

1. the prompts that ended are compressed (a prompt read in chunks, at its first decode step; one
   whose method scores each entry alone, also after each of its chunks: :attr:`PagedCompression.compresses_chunks`);
2. the step's keys and values go in through the engine's own cache write, at each request's
   next slots, with their words (position, the method's extras at their fill);
3. every request is attended over its slots, in place: the compressed decoding ones by keepkv's
   paged kernel, which adds a merging method's votes (every method's where it runs in C++:
   :data:`OUR_DECODE_BACKENDS`; else a merging method's), the rest in one call of the engine's
   kernel (a request never compressed is attended as stock's);
4. a decoding request's query is kept (a few rows per request and layer): the method's
   statistics are computed when it compresses, not at every step;
5. the requests whose ``interval`` came round are compressed: their slots are read once into a
   :class:`~keepkv.store.LayerStore`, the method observes the queries kept since its last
   compression and compresses (:class:`~keepkv.step.LayerStep`, the Hugging Face path's code),
   and the kept entries are written back into the leading slots.

Between compressions nothing reads a request's cache but the kernel. A method that needs the
attention of every decoding query (H2O's and SnapKV's accumulated scores, KeepKV's EMA) gets it
at the compression, from the kept queries against the keys
(:func:`keepkv.attention.kept_query_stats`): the entries a query saw are those still held at its
position (nothing is evicted or merged between compressions), so its probabilities are the ones
it had.

The parts, one module each: the planes of a block (:mod:`keepkv.paged_layout`), reading and
writing a layer's slots (:mod:`keepkv.paged_slots`), the requests and what they file between
steps (:mod:`keepkv.paged_requests`), the step's rows and index tensors (:mod:`keepkv.paged_plan`),
a prompt's phases (:mod:`keepkv.paged_prompt`), the step's due compressions
(:mod:`keepkv.paged_compress`), sizes from token counts (:class:`keepkv.budgets.RequestSizes`). This module knows nothing of vLLM (``keepkv.vllm`` wires it in, with vLLM's kernel);
:class:`~keepkv.paged_layout.TorchPagedKernel` is the reference kernel.
"""

from __future__ import annotations

import contextlib
import functools
import math
from types import SimpleNamespace

import torch

from .attention import StepStats, group_queries, kept_query_stats
from .budgets import RequestSizes, check_keep_prompt, validate_budget
from .methods import METHODS, get_method
from .methods.base import ComposedMethod, serving_refusal, served_names
from .kernels.paged import cpu_backend, numba_threads, paged_decode
from .paged_layout import NEG_INF, PagedKernel, PagedLayout, TorchPagedKernel
from .paged_chunks import check_chunk_blocks
from .paged_compress import DueCompression, compress_due, runs_due
from .paged_plan import StepPlan
from .paged_prompt import PagedPrompts
from .paged_requests import PagedBatch, PagedRequests
from .paged_slots import PagedSlots
from .step import LayerStep
from .store import LayerStore

__all__ = ["PagedBatch", "PagedCompression", "SERVED_METHODS", "rank_config", "servable_method"]


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
# Backends of keepkv's paged kernel that attend every method's compressed requests, with votes or
# without: on CPU its C++ kernel took at most vLLM's time for 16 one-token rows over 210 and 1,120
# entries, fp32 and bf16, one and two threads (benchmarks/kernels/paged_decode_cpu.py). Elsewhere
# the engine's kernel attends every row without votes. A request never compressed stays on the
# engine's kernel everywhere: it answers as stock's, in its numerics.
OUR_DECODE_BACKENDS = ("cpp",)


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
        compressed at its first decode step, when it is known to be whole. Where the engine gives
        where each prompt ends (:meth:`batch`'s ``ends``) and the method scores each entry alone
        (:attr:`compresses_chunks`), each chunk but the last is compressed as it is attended.
    keep_prompt : bool
        As ``CompressedCache(decoding="keep_prompt")``: a prompt is never compressed (its slots
        are never written after its own steps wrote them, so an engine may share its blocks:
        prefix caching), and ``budget`` (an int) of each request's generated entries are kept. A
        prompt may start past a shared prefix; prompts are read as ``chunked`` ones, and each
        step's :meth:`batch` is given each request's prompt length.
    kernel : PagedKernel
        The engine's cache write and attention (default: :class:`~keepkv.paged_layout.TorchPagedKernel`).
    chunk_blocks : int
        With ``keep_prompt``: 0 keeps a prompt whole; c >= 2 compresses each whole chunk of c blocks
        of a prompt alone, as it arrives, to one block of entries, the entries before it never
        touched again, so that an engine's prefix cache may share compressed prompts
        (:mod:`keepkv.paged_chunks`; the Hugging Face path's ``start_prefill(chunk_keep=(c *
        block_size, block_size))``).
    """

    def __init__(self, config, method: str, budget: int | float, chunked: bool = False, keep_prompt: bool = False,
                 kernel: PagedKernel | None = None, chunk_blocks: int = 0):
        validate_budget(budget)
        self.method = servable_method(method).for_heads(getattr(config, "first_kv_head", 0))
        if keep_prompt:
            check_keep_prompt(self.method, budget)
        check_chunk_blocks(self.method, chunk_blocks, keep_prompt)
        self.chunk_blocks = chunk_blocks
        self.config = config
        self.budget = budget
        self.keep_prompt = keep_prompt
        self.chunked = chunked or keep_prompt
        self.spec = method
        self.kernel = kernel if kernel is not None else TorchPagedKernel()
        self.step = LayerStep(self.method, self.decoding)
        self.sizes = RequestSizes(self.method, budget, config, keep_prompt)
        # Budget 1.0 is the identity: requests are attended in place and nothing else runs.
        self.keeps_everything = isinstance(budget, float) and budget == 1.0
        self.biased = self.method.merging.writes_bias  # votes: a bias word, and keys wide enough to carry it
        self._decode_needs = decode = self.method.needs(False)  # what the method reads of a decoding query
        # Query rows kept per request and layer between compressions: the attention every decoding
        # query gave (probabilities, logits), or the newest query a merge reads.
        query_rows = self.method.interval if (decode.probs or decode.logits or self.biased) else 0
        self.requests = PagedRequests(self.chunked, keep_prompt, query_rows, chunk_blocks)
        self.prompts = PagedPrompts(self.step, self.requests, keep_prompt, config)
        # keep_prompt: a compression reads only the generated entries (see _gather_due).
        self._generated_alone = keep_prompt and not self.method.reads_every_entry

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

    @functools.cached_property
    def meta_words(self) -> int:
        """fp32 words per slot and KV head: the position, the bias (a merging method's), each extra's words."""
        return 1 + self.biased + sum(math.prod(shape) for shape in self.extras.values())

    def layout(self, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> PagedLayout:
        """The planes of this method's blocks (:class:`~keepkv.paged_layout.PagedLayout`)."""
        return _layout(self.kernel, block_size, kv_heads, head_dim, dtype, self.biased, self.meta_words)

    def content_bytes(self, head_dim: int, dtype: torch.dtype, block_size: int = 128) -> int:
        """Bytes per slot and KV head of the paged layout (key, value, words: vLLM's ``state_content_bytes``)."""
        return self.layout(block_size, self.config.num_key_value_heads, head_dim, dtype).cell_bytes

    # Sizes from token counts (an engine's scheduler reads them): keepkv.budgets.RequestSizes's.
    def kept(self, prompt_length: int, layer: int = 0) -> int:
        """Entries per head ``layer`` of a request keeps once its prompt is compressed."""
        return self.sizes.kept(prompt_length, layer)

    def interval(self, prompt_length: int, layer: int = 0) -> int:
        """Decode steps between ``layer``'s compressions of a request."""
        return self.sizes.interval(prompt_length, layer)

    def stored(self, prompt_length: int, computed: int, layer: int = 0, closed: int | None = None) -> int:
        """Entries ``layer`` of a request holds per head after ``computed`` tokens (prompt included)."""
        return self.sizes.stored(prompt_length, computed, layer, closed)

    def capacity(self, prompt_length: int, layers: tuple[int, ...] | None = None) -> int:
        """Slots a request needs at most (``keepkv.capacity_bound``, the largest layer; of ``layers``
        alone when given)."""
        return self.sizes.capacity(prompt_length, layers)

    def reading(self, prompt_length: int, computed: int, layers: tuple[int, ...] | None = None) -> int:
        """Slots a request holds (the largest layer's; of ``layers`` alone when given) after its first
        ``computed`` tokens of a prompt of ``prompt_length`` read in chunks: every token, or, where
        prompts are compressed chunk by chunk (:attr:`compresses_chunks`), at most the whole
        prompt's budget (:meth:`keepkv.budgets.RequestSizes.read`)."""
        if not self.compresses_chunks:
            return computed
        return max(self.sizes.read(prompt_length, computed, layer)
                   for layer in (range(self.config.num_hidden_layers) if layers is None else layers))

    # -- one step's phases ------------------------------------------------------------------------
    def batch(
        self, query_start: list[int], seq_lens: list[int], block_table: torch.Tensor,
        prefilling: list[bool] | None = None, block_size: int | None = None, prompts: list[int] | None = None,
        layers: int | None = None, due: list | None = None, ends: list[int] | None = None,
    ) -> PagedBatch:
        """The step's :class:`PagedBatch`, each request in its phase (:meth:`keepkv.paged_requests.PagedRequests.batch`).
        ``ends`` [R]: where each request's prompt read in chunks ends (the engine's prefill end);
        given, a method that :attr:`compresses_chunks` compresses it after each chunk but the last."""
        ends = ends if self.compresses_chunks else None
        return self.requests.batch(query_start, seq_lens, block_table, prefilling, block_size, prompts, layers, due,
                                   ends)

    @property
    def compresses_chunks(self) -> bool:
        """Whether a prompt read in chunks, whose end the engine gives (:meth:`batch`'s ``ends``), is
        compressed after each chunk but its last, to its whole prompt's budget, as
        ``CompressedCache.start_prefill`` compresses it: a method that scores each entry alone and
        only evicts (``snapkv+selection=learned``, ``"uniform"`` and ``"trained"`` budgets), prompts
        compressed (not ``keep_prompt``), a budget below 1.0. A request then holds at most its
        budget plus one chunk while it reads its prompt (:meth:`keepkv.budgets.RequestSizes.read`)."""
        return self.chunked and self.sizes.compresses_chunks and not self.keeps_everything

    def forward(self, kv_cache: torch.Tensor, query, key, value, batch: PagedBatch, scaling: float, layer: int = 0):
        """One attention call of every request in ``batch``, for the model's layer ``layer``.

        kv_cache [blocks, H_kv, block_size, C]; query [T, H, D]; key, value [T, H_kv, D] (T: the
        step's new tokens, request after request). Writes the step's entries into kv_cache,
        compresses the requests that are due, and returns the attention output [T, H, D].
        """
        kv_heads, block_size = kv_cache.shape[1:3]
        layout = self.layout(block_size, kv_heads, query.shape[-1], kv_cache.dtype)
        if "step" not in batch.plans:  # the step's rows and index tensors, built at its first layer
            batch.plans["step"] = StepPlan.build(self.sizes, self.requests, batch, block_size, query.device)
        plan = batch.plans["step"]
        slots = PagedSlots(layout.planes(kv_cache), layout, self.kernel, plan.orders(self.kernel, layout), self.extras,
                           self.extra_fill, self.method.interval)
        output = query.new_empty(query.shape)
        if self.keeps_everything:  # budget 1.0: the full cache, attended in place
            with _threads(STEP_THREADS):
                self._write_new(slots, plan, key, value, layer)
            self._attend(slots, plan, query, scaling, layer, output, kv_cache)
            return output
        # prompts read in chunks, whole now: closed (those of one length together) before their first decode token
        for rows in self.prompts.closing_groups(plan, layer):
            with _threads(PROMPT_THREADS):
                self.prompts.close(slots, plan, rows, scaling, layer)
        for rows in plan.dense:  # a whole prompt over its budget: attended and compressed before it is written
            with _threads(PROMPT_THREADS):
                self.prompts.dense(slots, plan, rows, query, key, value, scaling, layer, output)
        if plan.attending:
            with _threads(STEP_THREADS):  # a few small writes: the new tokens' slots and words
                self._write_new(slots, plan, key, value, layer)
            for rows in plan.waves:  # a prompt's chunk is compressed before the tokens after it attend
                self._attend(slots, plan, query, scaling, layer, output, kv_cache, rows)
                for row in plan.chunk_ends(rows):
                    with _threads(PROMPT_THREADS):
                        self.prompts.compress_chunk_alone(slots, plan, row, query, scaling, layer)
        for rows in plan.prompts_ending:  # a whole prompt within its budget, attended in place: its statistics
            with _threads(PROMPT_THREADS):
                self.prompts.close(slots, plan, rows, scaling, layer, query=query)
        for row in plan.chunks:
            with _threads(PROMPT_THREADS):
                self.prompts.file_chunk(slots, plan, row, query, scaling, layer)
        if plan.decoding and self.requests.query_rows:
            with _threads(STEP_THREADS):  # each decoding row's query, for its compression's statistics
                self.requests.keep_queries(layer, query.index_select(0, plan.decode_tokens), plan.decode_slab_rows,
                                           plan.query_index(layer))
        for rows in plan.compressing(layer):
            with _threads(STEP_THREADS):
                plan.due.append(self._gather_due(slots, plan, rows, query, scaling, layer))
        if plan.due and runs_due(plan, layer, self.method):  # the step's last layer, or stores of many bytes
            with _threads(STEP_THREADS):
                compress_due(plan, self.step)
        return output

    # -- writes and the kernels --------------------------------------------------------------------
    def _write_new(self, slots: PagedSlots, plan: StepPlan, key, value, layer: int) -> None:
        """The step's keys and values at each attending row's next slots, with their words:
        position, bias 0 (a biased layout's), the extras at their fill."""
        new_slots, tokens, positions = plan.new_slots(layer)
        slots.write_new(new_slots, key if tokens is None else key.index_select(0, tokens),
                        value if tokens is None else value.index_select(0, tokens), plan.word_rows(slots.layout, new_slots),
                        plan.fresh_words(self.extras, self.extra_fill, slots.layout, positions))

    def _attend(self, slots: PagedSlots, plan: StepPlan, query, scaling: float, layer: int, output, kv_cache,
                rows: list[int] | None = None) -> None:
        """Every attending row (``rows``: those of one wave, none biased), over its slots, in place:
        the decoding rows that were compressed through keepkv's paged kernel, a biased method's
        (their votes are a bias the engine's kernel cannot add) and, where the kernel's backend
        is one of :data:`OUR_DECODE_BACKENDS`, every method's; it hands back the step's
        statistics as well. The rest in one call of the engine's kernel: a prompt's rows, and a
        request under its budget, attended as stock's."""
        on_ours = slots.layout.biased or (_decode_backend(query.device) in OUR_DECODE_BACKENDS
                                          and _readable(self.kernel, slots.layout))
        ours = plan.compressed(layer) if on_ours and rows is None else ()
        engine_rows = plan.engine_rows(ours) if ours else (plan.attending if rows is None else rows)
        if engine_rows:
            call = plan.kernel_call(self.kernel, layer, slots.layout, query.shape[1], engine_rows)
            keys_plane, values_plane, _ = slots.planes
            rows_query = query if call.tokens is None else query.index_select(0, call.tokens)
            attended = output if call.tokens is None else rows_query.new_empty(rows_query.shape)
            self.kernel.attend(rows_query, keys_plane, values_plane, call.block_table, call.query_start_loc,
                               call.seq_lens, call.plan, scaling, attended)
            if call.tokens is not None:
                output.index_copy_(0, call.tokens, attended)
        if ours:  # keepkv's paged kernel; the method's statistics of the step's query come back from the same pass
            call = plan.decode_call(ours, layer, _geometry(self.kernel, slots.layout))
            want = bool(plan.compressing(layer)) and self.method.interval == 1
            out, probs, logits = paged_decode(query.index_select(0, call.tokens), kv_cache, call.block_table,
                                              call.seq_lens, scaling, call.geometry, max_len=call.max_len,
                                              probs=want and self._decode_needs.probs,
                                              logits=want and self._decode_needs.logits,
                                              backend=_decode_backend(query.device))
            output.index_copy_(0, call.tokens, out)
            if want:
                plan.cache["stats", layer] = (ours, probs, logits)

    # -- decoding ---------------------------------------------------------------------------------
    def _gather_due(self, slots: PagedSlots, plan: StepPlan, rows: list[int], query, scaling: float,
                    layer: int) -> DueCompression:
        """Decoding rows whose ``interval`` came round (each holding as many entries), in a store with
        the method's state and the statistics of every query since their last compression; with
        ``keep_prompt`` only the generated entries, unless the method ``reads_every_entry`` (a
        kept prompt is never evicted, merged into or rescored: :func:`keepkv.step.generated_share`)."""
        batch = plan.batch
        written = plan.held(rows, layer, "written")
        budget, mean, frozen, held = plan.budgets(rows, layer, query.device)
        first = batch.prompt[rows[0]] if self._generated_alone else 0  # the rows of a group share their prompt's length
        if first:
            budget, frozen, held = budget - first, None, None
        store = slots.gather(plan.blocks_of(rows, max(written)), tuple(size - first for size in written),
                             tuple(batch.computed[r] + batch.offsets[r] + 1 for r in rows), layer, first)
        store.resume(state=self.requests.states([batch.first_block[r] for r in rows], layer),
                     pending=plan.interval(rows, layer))
        stats = self._decode_stats(plan, rows, store, query, scaling, layer, first)
        return DueCompression(layer, plan, self.requests, slots, rows, store, stats,
                              (store.positions.clone(), store.bias.clone()), first, (budget, mean, frozen, held))

    def _decode_stats(self, plan: StepPlan, rows, store: LayerStore, query, scaling, layer, prompt: int = 0) -> StepStats:
        """What the attention of the ``interval`` decoding queries since the last compression gave:
        from keepkv's paged kernel's pass where it attended them (one query), else computed now
        over the store (:func:`keepkv.attention.kept_query_stats`). A store past a kept prompt
        (``prompt`` > 0) gives each query's attention among the generated entries, as the
        Hugging Face path's keep_prompt counts it (:func:`keepkv.step.generated_share`)."""
        batch, kv_heads = plan.batch, store.keys.shape[1]
        tokens = torch.tensor([batch.query_start[r] for r in rows], device=query.device)
        if not self.requests.query_rows:
            return StepStats(query=group_queries(query.index_select(0, tokens)[:, :, None], kv_heads),
                             scaling=scaling, is_prefill=False)
        attended, *stats = plan.cache.get(("stats", layer), ((),))
        interval = plan.interval(rows, layer)
        if interval == 1 and set(rows) <= set(attended):  # the kernel's pass gave them
            return _kernel_stats(stats, plan.index_among(attended, rows), store, query.index_select(0, tokens),
                                 scaling, prompt)
        # [R, N, H, D], oldest first: the rows' interval N, at most the method's (a small budget's is less)
        queries = self.requests.kept_queries([batch.first_block[r] for r in rows], layer, interval)
        newest = torch.tensor([batch.computed[r] + batch.offsets[r] for r in rows], device=query.device)  # each row's last query position
        query_positions = newest[:, None] - torch.arange(queries.shape[1] - 1, -1, -1, device=query.device)  # [R, N]
        return kept_query_stats(group_queries(queries.transpose(1, 2), kv_heads), store.keys, store.bias,
                                store.positions, query_positions, scaling, self._decode_needs)


def _kernel_stats(stats, index, store: LayerStore, query, scaling: float, prompt: int) -> StepStats:
    """The statistics of the step's query (the store's interval is 1) from keepkv's paged kernel:
    ``stats`` (probs, logits) [R_decoding, H_kv, g, max_len] over each row's slots; ``index`` [R]
    picks the compressing rows. A store past a kept prompt (``prompt`` > 0) takes its slots and the
    probabilities among them (:func:`keepkv.step.generated_share`), as the second pass computes them."""
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
    return StepStats(query=group_queries(query[:, :, None], store.keys.shape[1]), scaling=scaling, is_prefill=False,
                     probs=probs, logits=logits)


@functools.lru_cache(maxsize=64)
def _layout(kernel, block_size, kv_heads, head_dim, dtype, biased, words) -> PagedLayout:
    layout = PagedLayout(block_size, kv_heads, head_dim, words, dtype, biased)
    if biased:  # keepkv's kernel must read the engine's packing: refused here, before any request
        _geometry(kernel, layout)
    return layout


@functools.lru_cache(maxsize=64)
def _geometry(kernel, layout: PagedLayout):
    """Where keepkv's paged kernel finds an entry in ``layout``'s blocks as ``kernel`` packs them."""
    return layout.geometry(*kernel.orders(layout.block_size, layout.head_dim, layout.dtype))


@functools.lru_cache(maxsize=64)
def _readable(kernel, layout: PagedLayout) -> bool:
    """Whether keepkv's paged kernel reads ``layout``'s blocks as ``kernel`` packs them (a biased
    layout's packing is checked when the layout is made; an unbiased one may be any engine's)."""
    try:
        _geometry(kernel, layout)
    except ValueError:
        return False
    return True


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
