"""CompressedCache: a Hugging Face cache whose layers (:class:`keepkv.store.LayerStore`) keep
at most a budget of entries, and when the method compresses them.

The cache schedules: it appends each new block, runs attention, hands the method the step's
statistics and calls its compression once a layer's prefill ends and every ``interval`` decode
steps. Budgets come from :mod:`keepkv.budgets`; the tensors live in the layer stores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from .attention import DECODE_KERNELS, Needs, Reconstruction, attend, decode_kernel_for, hand_over, join_prefill_stats
from .budgets import check_keep_prompt, decode_interval, prompt_budgets, validate_budget
from .checks import as_bool, shown
from .continuation import P, ids_hash
from .diagnostics import warn_budget
from .methods import Method, get_method
from .models import check_architecture, check_context, sliding_window
from .step import DECODING, LayerStep
from .store import LayerStore


def method_of(method, method_params: dict, compress_once: bool = False) -> Method:
    """The Method of a registered name or variant built with ``method_params`` (on its compress-once
    selection with ``compress_once``, :func:`keepkv.methods.get_method`), or ``method`` itself (then
    without parameters); ValueError in one line otherwise."""
    if isinstance(method, Method):
        if method_params:
            raise ValueError("pass method parameters either to get_method() or here, not with an instance")
        return method
    if isinstance(method, str):
        return get_method(method, compress_once=compress_once, **method_params)
    raise ValueError(f"method must be a method name or variant (str, see keepkv.describe_methods()) or a "
                     f"keepkv.Method, got {shown(method)}")


@dataclass
class CacheSummary:
    """Per-row memory of a CompressedCache (lists indexed by row).

    ``cache_bytes[r] == entry_bytes[r] + padding_bytes[r] + spare_bytes[r] + state_bytes[r]``,
    and ``sum(cache_bytes) == cache.nbytes()``: the rows' figures add up to the real bytes.
    """

    kept_entries: list[float]  # mean live entries per layer and KV head
    cache_bytes: list[int]  # what the row holds: the four parts below
    entry_bytes: list[int]  # its live entries: keys, values, bias, positions, per-entry method state
    padding_bytes: list[int]  # its empty slots below each layer's size (left padding, ragged rows/heads)
    spare_bytes: list[int]  # its slots past each layer's size, kept for the next appends
    state_bytes: list[int]  # its share of per-layer method state (e.g. KVReviver's sketch)
    full_cache_bytes: list[int]  # keys + values an uncompressed cache of the row's tokens would hold



# What decoding does after the prompt is compressed (DECODING, keepkv.step): "compress" keeps the
# budget (the method compresses every ``interval`` new tokens); "append" lets every later token in
# uncompressed (a context compressed once, then a question and its answer appended: kvpress's and
# KVzip's setting); "keep_prompt" compresses nothing of the prompt and keeps ``budget`` of the
# generated tokens (a serving engine's prompt blocks then stay shareable: prefix caching).


class CompressedCache(Cache):
    """A KV cache that keeps at most ``budget`` entries per layer and head, chosen by ``method``.

    Pass it as ``past_key_values`` to ``model.generate()`` or a forward loop of a model whose
    attention implementation is ``"keepkv"`` (``keepkv.enable(model)`` or ``with
    keepkv.enabled(model)`` sets it). At the end of the prefill it warns
    (:class:`keepkv.KeepKVWarning`) when a compressed row's budget is below the method's
    ``protected_entries()``, or when an int budget of 1 was likely meant as 1.0.

    Parameters
    ----------
    config : transformers.PretrainedConfig or model
        The model's config (Llama, Mistral, Qwen2 or Qwen3), or the model (its config is taken).
    method : str or Method
        A registered method name or variant (``keepkv methods``, ``"keepkv+protect=0.9"``) or an
        instance.
    budget : float or int
        A float in (0, 1): that fraction of each row's prompt length, but at least the method's
        protected tokens + ``SCORED_FLOOR`` (:func:`budget_floor`). 1.0 compresses nothing, for
        every method: neither the prompt nor anything generated after it (the cache grows by one
        entry per token, as the full cache does; ``keeps_everything``). An int in [1, 2**48]
        (``keepkv.budgets.MAX_BUDGET``): an entry count; integer numpy scalars count as ints.
        Methods may split it unevenly over layers and heads; the mean stays at the budget.
    kernel : str
        "torch" (default): decode steps attend with torch operations (the reference path).
        "triton": a decode step that needs attention probabilities or logits runs the one-pass
        Triton kernel (:mod:`keepkv.kernels`; CUDA, or Triton's interpreter with
        ``TRITON_INTERPRET=1``), refused in one line where it cannot run.
    decoding : str
        "compress" (default): the method keeps the budget while decoding, compressing every
        ``interval`` new tokens. "append": the prompt is compressed once, at the end of its
        prefill, and every later token (a question asked of a compressed context, the answer) is
        appended uncompressed, so nothing the compression kept is evicted to make room for it;
        the cache then grows by one entry per token. "keep_prompt": the prompt is never
        compressed, and while decoding the method keeps ``budget`` (an int) of the generated
        entries per layer and head, compressing every ``interval`` new tokens: no prompt entry is
        evicted, merged into or moved, so a long generation holds at most prompt + budget +
        interval entries. For methods that evict (merge ``none``) or ZIP-merge (``zip``,
        ``keepkv``).
    compile : bool
        Run each layer's decode-time method step (``observe`` and ``compress``) as one
        ``torch.compile`` graph (see :mod:`keepkv.fused`): a few fused kernels per layer-step
        instead of hundreds of operations, and no host sync, after a one-off compilation per
        layer shape (inductor's cache shortens it in later processes); eager, with one warning,
        where compiling fails.
    static_shapes : bool or None
        Decode steps keep static shapes and never read a tensor back to the host (what a GPU's
        launch queue and ``compile`` need). None (default): on an accelerator and with
        ``compile=True``; on CPU otherwise KeepKV's decoding merge compares and ZIP-merges only
        the evicted entries that pass its gates (one host read each compression): the same cache,
        bit for bit. ``keepkv bench --ops`` counts with True.
    compress_once : bool
        The cache holds a context compressed before any question is seen (:func:`keepkv.compress`
        sets it): a method given by name runs on its compress-once selection where it names one
        (``keepkv``: KVzip's), unless ``selection=NAME`` is given.
    **method_params
        Parameters of the method when it is given by name.

    One cache holds one sequence per row. A second ``model.generate`` on it continues that
    sequence: pass the whole sequence so far (prompt and generated tokens) plus any new tokens.
    The cache keeps a running hash of each row's token ids and their count (``see_ids``, handed
    the ids by ``model.generate`` on a model that ``keepkv.enable`` switched), and refuses in one
    line, before anything changes, input that does not continue it: a new prompt, longer or
    shorter, padded or not; use a fresh cache, ``cache.copy()`` of a compressed context, or
    ``reset()``. Fed by a forward loop, which hands it no ids, it checks positions only
    (``check_continuation``: a padded new prompt is refused, an unpadded one cannot be told from
    a continuation). Beam search and ``num_return_sequences`` are supported (every per-row tensor,
    the hash and the method's state follow ``reorder_cache``); ``crop`` (assisted decoding) is refused.

    A cache built with ``record=Needs(...)`` compresses nothing and keeps the prefill's
    statistics, so that ``fork()`` can start any number of methods from one prefill.

    Each layer is compressed as soon as its own prefill ends, so the whole uncompressed prompt
    never sits in memory at once (unless the method's ``allocates_from_all_layers``, as D2O's);
    ``prefill_peak_bytes`` is the largest ``nbytes()`` seen during the prefill.

    Chunked prefill: call ``start_prefill(attention_mask)`` with the prompt's 2-D mask, then feed
    the prompt in blocks (``keepkv.generate(prefill_chunk=N)`` does both). Each layer then
    attends chunk by chunk, sums the method's statistics over the chunks and compresses once
    its whole prompt is in, exactly as an unchunked prefill would: the attention workspace is
    bounded by one chunk, but every layer holds its uncompressed prompt until the last chunk
    reaches it, so the cache peaks at the full prompt cache of all layers. A method that scores
    each entry alone (``compresses_chunks``: selection ``learned`` with ``merge=none``) is instead
    compressed after every chunk, to its whole prompt's budget (``start_prefill(...,
    compress_chunks=False)`` turns this off): a layer then holds at most its budget plus one
    chunk, and later chunks attend to the compressed earlier ones.
    """

    def __init__(
        self, config, method: str | Method = "full", budget: int | float = 1.0, record: Needs | None = None,
        compile: bool = False, decoding: str = "compress", kernel: str = "torch", compress_once: bool = False,
        static_shapes: bool | None = None, **method_params,
    ):
        if isinstance(config, torch.nn.Module) and hasattr(config, "config"):
            config = config.config  # the model, for its config
        if not isinstance(getattr(config, "model_type", None), str) or not hasattr(config, "num_hidden_layers"):
            raise ValueError(f"config must be the model's transformers config (model.config) or the model, got "
                             f"{shown(config)}")
        check_architecture(config)
        budget = validate_budget(budget)
        self.compile = as_bool("compile", compile)
        if record is not None and not isinstance(record, Needs):
            raise ValueError(f"record must be a keepkv.attention.Needs or None, got {shown(record)}")
        if not isinstance(decoding, str) or decoding not in DECODING:
            raise ValueError(f"decoding must be one of {', '.join(map(repr, DECODING))}, got {shown(decoding)}")
        self.decoding = decoding
        if not isinstance(kernel, str) or kernel not in DECODE_KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(map(repr, DECODE_KERNELS))}, got {shown(kernel)}")
        if kernel == "triton":  # refused now, before any work, where it cannot run (the default device)
            decode_kernel_for(kernel, "cuda" if torch.cuda.is_available() else "cpu")
        self.kernel = kernel
        self._decode_kernels: dict = {}  # device -> the decode kernel ``kernel`` names, resolved once
        self.method = method_of(method, method_params, as_bool("compress_once", compress_once))
        if static_shapes is not None and not isinstance(static_shapes, bool):
            raise ValueError(f"static_shapes must be True, False or None, got {shown(static_shapes)}")
        self.static_shapes = static_shapes
        # what the method does to a layer, by phase
        self.step = LayerStep(self.method, decoding, self.compile, static_shapes)
        self.method_spec = method if isinstance(method, str) else method.name  # the variant as given
        self.budget = budget
        self.num_layers = config.num_hidden_layers
        self.config = config
        self.sliding_window = sliding_window(config)
        shared = {}
        super().__init__(layers=[LayerStore(i, shared) for i in range(self.num_layers)])
        self.prompt_lengths: torch.Tensor | None = None
        self.layer_budgets: torch.Tensor | None = None
        self.row_budgets: torch.Tensor | None = None  # [B] each row's mean budget, set as its prompt ends
        self.prefill_peak_bytes = 0
        self.prompt_mask: torch.Tensor | None = None
        self._chunk_compression = True
        self.chunk_keep: tuple[int, int] | None = None  # start_prefill(chunk_keep=(tokens, kept))
        self.record = record
        self._reconstruction: Reconstruction | None = None  # the pass whose block is being fed
        self._reconstruction_expected = False
        # Callables (layer_idx, query, keys, values, block_mask, scaling, output, is_prefill) that
        # see every attention call after the method ran: they read, never write.
        self.observers: list = []
        # What the rows have seen (see_ids): the hash [B] of each row's token ids (ids_hash), their
        # count [B], and the tokens (padding included) the record covers; None: ids never seen.
        self.token_hash: torch.Tensor | None = None
        self.token_count: torch.Tensor | None = None
        self.ids_seen = 0
        self.pending: tuple | None = None  # (hash, count, ids_seen) once the announced forward has run
        self.method.check_budget(self)
        self.method.check_model(config)
        if decoding == "keep_prompt":
            check_keep_prompt(self.method, budget)

    # -- HF Cache API ------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx >= self.num_layers or (layer_idx == 0 and not self.layers[0].is_initialized):
            self._check_shapes(key_states, layer_idx)  # the first forward: the model's shapes
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        hand_over(self, key_states, self.config)
        return key_states, value_states

    def _check_shapes(self, key_states: torch.Tensor, layer_idx: int) -> None:
        """Refuse, in one line, a model other than the one whose config built this cache (its KV
        heads, head size or depth differ): it would fail deep inside a method on its first forward."""
        config = self.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        got = (key_states.shape[1], key_states.shape[-1])
        if layer_idx >= self.num_layers:
            raise ValueError(f"this CompressedCache was built from the config of a model with {self.num_layers} layers, "
                             f"and the model it runs in has a layer {layer_idx}: build the cache from this model's "
                             "config (CompressedCache(model.config, ...))")
        if got != (config.num_key_value_heads, head_dim):
            raise ValueError(
                f"this CompressedCache was built from the config of a model with {config.num_key_value_heads} KV heads "
                f"of {head_dim}, and the model it runs in gives {got[0]} of {got[1]}: build the cache from this "
                "model's config (CompressedCache(model.config, ...))"
            )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].seen

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def reset(self) -> None:
        """Forget every entry; the next forward is a new prefill."""
        super().reset()
        self._reconstruction, self._reconstruction_expected = None, False
        self.prompt_lengths = None
        self.layer_budgets = self.row_budgets = None
        self.prefill_peak_bytes = 0
        self.prompt_mask = None
        self.chunk_keep = None
        self.token_hash = self.token_count = self.pending = None
        self.ids_seen = 0

    # -- row-reshaping hooks transformers calls ----------------------------------------------
    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: row r becomes old row ``beam_idx[r]`` [B], every per-row tensor included."""
        self.select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row repeated ``repeats`` times in place (row r becomes rows r·repeats … r·repeats+repeats−1)."""
        rows = self._rows()
        if rows:
            self.select_rows(torch.arange(rows).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only rows ``indices`` (int or bool [B])."""
        indices = torch.as_tensor(indices)
        if indices.dtype == torch.bool:
            indices = indices.nonzero().view(-1)
        self.select_rows(indices)

    def _rows(self) -> int:
        """Rows of the cache (0 before its first forward)."""
        first = self.layers[0]
        return first.keys.shape[0] if first.is_initialized else 0

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` [B'] (int64, repeats allowed), in that order, of every layer's store and
        method state and of the cache's own per-row figures. Raises ValueError, changing nothing,
        where the method's state cannot follow (see ``Method.select_rows``)."""
        index = torch.as_tensor(index).long().view(-1).cpu()
        rows = self._rows()
        if not rows:
            return
        if index.numel() == 0 or int(index.min()) < 0 or int(index.max()) >= rows:
            raise ValueError(f"row indices must be in [0, {rows}), got {index.tolist()}")
        states = [self.method.select_rows(layer, index.to(layer.device)) for layer in self.layers]
        for layer, state in zip(self.layers, states):  # every state moved before any layer changes
            layer.select_rows(index)
            layer.state = state
        if self.prompt_lengths is not None:
            self.prompt_lengths = self.prompt_lengths.index_select(0, index.to(self.prompt_lengths.device))
        if self.layer_budgets is not None:
            self.layer_budgets = self.layer_budgets.index_select(1, index.to(self.layer_budgets.device))
        if self.row_budgets is not None:
            self.row_budgets = self.row_budgets.index_select(0, index.to(self.row_budgets.device))
        if self.prompt_mask is not None:
            self.prompt_mask = self.prompt_mask.index_select(0, index.to(self.prompt_mask.device))
        if self.token_hash is not None:
            self.token_hash, self.token_count = (t.index_select(0, index.to(t.device))
                                                 for t in (self.token_hash, self.token_count))
        if self.pending is not None:
            self.pending = (*(t.index_select(0, index.to(t.device)) for t in self.pending[:2]), self.pending[2])

    @property
    def is_croppable(self) -> bool:
        """False: compressed entries cannot be put back (assisted decoding refuses before it drafts)."""
        return False

    def crop(self, tokens_to_remove: int) -> None:
        """Only ``crop(0)`` (nothing to remove) is accepted: entries a method merged or evicted cannot
        be restored, so rolling back tokens (assisted or speculative decoding) is refused."""
        if tokens_to_remove != 0:
            raise ValueError(
                f"crop({tokens_to_remove}): a CompressedCache cannot roll back tokens (assisted/speculative "
                "decoding); generate without assistant_model, or with a DynamicCache"
            )

    def see_ids(self, input_ids: torch.Tensor, fed: int | None = None, attention_mask: torch.Tensor | None = None,
                check: bool = True) -> None:
        """Take the token ids of the next forward: refuse them in one line (ValueError, nothing
        changed) unless they continue what this cache holds, and note the new ones for its record.

        input_ids [B, T]: the sequence up to the end of the next forward, which feeds its last
        ``fed`` columns (default: those past the ``seen`` this cache holds). Its first T - fed
        columns, when there are any, must be the ones this cache holds, ids included; with none,
        the block is taken as following them (only positions can be checked then). attention_mask
        [B, T] or [B, seen + fed]: 1 = real token (left padding); None: all real. check: compare
        the ids with the record (one host sync; ``model.generate``'s hook checks at the first step
        of each call only).

        ``model.generate`` on a model switched by ``keepkv.enable`` calls this at every step
        (:mod:`keepkv.continuation`); a forward loop may call it before each forward. The new ids
        enter the record once their forward has run (at the next call); a forward it was not told
        about leaves the record unknown, and positions alone are checked from then on.
        """
        seen, rows, width = self.get_seq_length(), input_ids.shape[0], input_ids.shape[1]
        fed = width - seen if fed is None else fed
        if self.pending is not None and seen == self.pending[2]:
            self.token_hash, self.token_count, self.ids_seen = self.pending
        self.pending = None
        if self.ids_seen != seen:
            self.token_hash = self.token_count = None  # a forward it was not told about
        if seen and rows != self._rows():
            self._refuse(f"input of {rows} rows, the cache holds {self._rows()}")
        if fed < 1 or width - fed not in (0, seen):
            self._refuse(f"input of {width} tokens")
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        start = torch.zeros(rows, dtype=torch.long, device=input_ids.device)
        if seen and width > fed and check and self.token_hash is not None:
            before, count = ids_hash(input_ids[:, :seen], mask[:, :seen], start)
            differ = (before != self.token_hash.to(before.device)) | (count != self.token_count.to(count.device))
            if bool(differ.any()):
                self._refuse(f"row {int(differ.nonzero()[0])} has other token ids")
        if seen == 0:
            self.token_hash, self.token_count = start, start
        if self.token_hash is not None:
            added, count = ids_hash(input_ids[:, width - fed:], mask[:, mask.shape[1] - fed:], self.token_count)
            self.pending = ((self.token_hash + added) % P, self.token_count + count, seen + fed)

    def _refuse(self, why: str):
        raise ValueError(
            f"this CompressedCache holds {self.get_seq_length()} tokens per row and the input does not continue it "
            f"({why}): for a new prompt pass a fresh cache (or cache.copy() of a compressed context, or "
            "cache.reset()); to continue, pass the whole sequence so far plus the new tokens"
        )

    def check_continuation(self, layer_idx: int, position_ids: torch.Tensor, block_mask: torch.Tensor) -> None:
        """Raise ValueError unless a block of several tokens fed after the prefill continues the
        sequence this cache holds: its last token's position (position_ids [B or 1, q]) must be each
        row's real tokens so far plus the block's. A second ``model.generate`` on one cache continues
        it (input_ids: the whole sequence so far, then the new tokens); HF slices off as many tokens
        as the cache has seen, so a new padded prompt would otherwise be fed from the middle,
        silently (an unpadded one lines up: ``see_ids`` tells it by its ids). Checked on the first
        layer only: one host sync per multi-token continuation block."""
        layer = self.layers[layer_idx]
        if layer_idx != 0 or layer.seen == 0 or layer.seen < self.prefill_tokens or self._reconstruction is not None:
            return  # a reconstruction pass's block is read once and forgotten: it continues nothing
        due = layer.real_seen + block_mask[:, 0, -1, :].sum(-1) - 1
        got = position_ids[:, -1].to(due.device).expand_as(due)
        if not torch.equal(got, due):
            self._refuse(f"last position {got.tolist()}, due {due.tolist()}")

    def start_prefill(self, attention_mask: torch.Tensor, compress_chunks: bool = True,
                      chunk_keep: tuple[int, int] | None = None) -> None:
        """Announce a prompt that will be fed in several blocks: attention_mask [B, T] (1 = real
        token, left padding), the whole prompt's. Its padding is read from here, since a block's
        mask cannot tell a block of padding from one real token (each query sees itself).
        ``compress_chunks``: a method that scores each entry alone compresses the prompt after each
        block (:attr:`compresses_chunks`, the default); False: once, at its end, as every other
        method (and as ``keepkv.vllm`` serves every method today).

        ``chunk_keep=(N, K)`` (with ``decoding="keep_prompt"``): the prompt is fed in blocks of N
        tokens (the last may be shorter), and each whole block is compressed alone as it arrives,
        by the method's selection and merge, to K entries per layer and head, chosen among its own
        entries; the entries before it are never touched again, nor are any prompt entries while
        decoding. A shorter last block is kept whole. The entries a block keeps are then a
        function of the tokens up to its end alone: a compressed document is the same prefix
        whatever follows it (what a prefix cache of compressed documents needs)."""
        if chunk_keep is not None:
            if (not isinstance(chunk_keep, tuple) or len(chunk_keep) != 2
                    or not all(isinstance(n, int) and not isinstance(n, bool) for n in chunk_keep)
                    or not 1 <= chunk_keep[1] < chunk_keep[0]):
                raise ValueError(f"chunk_keep must be (tokens, kept), ints with 1 <= kept < tokens, got {shown(chunk_keep)}")
            if self.decoding != "keep_prompt":
                raise ValueError("chunk_keep compresses a prompt's chunks once and keeps them: use it with "
                                 "CompressedCache(decoding='keep_prompt')")
            if self.record is not None or self.defers_to_reconstruction:
                raise ValueError(f"chunk_keep compresses each chunk as it arrives: {self.method.name} "
                                 + ("records instead" if self.record is not None else "scores the prompt after it, with a reconstruction pass"))
        self.prompt_mask = attention_mask.bool()
        self._chunk_compression = as_bool("compress_chunks", compress_chunks)
        self.chunk_keep = chunk_keep

    @property
    def prefill_tokens(self) -> int:
        """Tokens of an announced chunked prompt (padding included); 0 when none was announced."""
        return 0 if self.prompt_mask is None else self.prompt_mask.shape[1]

    # -- one attention call --------------------------------------------------------------
    def forward_layer(self, layer_idx, query, keys, values, block_mask, scaling) -> torch.Tensor:
        """Append the new block, attend over the kept entries, let the method compress; then hand
        the call to each of ``observers`` (analyses such as keepkv.perturbation).

        query [B, H, q, D]; keys, values [B, H_kv, q, D]; block_mask [B, 1, q, q] bool
        (causal within the block, False for padded keys). Returns [B, q, H, D].
        """
        if self._reconstruction is not None:  # a side pass: attended once, then forgotten
            return self._reconstruction_step(self.layers[layer_idx], query, keys, values, block_mask, scaling)
        is_prefill = self.layers[layer_idx].seen < max(1, self.prefill_tokens)
        output = self._forward_layer(layer_idx, query, keys, values, block_mask, scaling)
        for observer in self.observers:
            observer(layer_idx, query, keys, values, block_mask, scaling, output, is_prefill)
        return output

    def _forward_layer(self, layer_idx, query, keys, values, block_mask, scaling) -> torch.Tensor:
        layer = self.layers[layer_idx]
        block = keys.shape[2]
        if self.sliding_window is not None:  # refused before anything changes (models.check_context)
            check_context(self.config, max(layer.seen + block, self.prefill_tokens))
        is_prefill = layer.seen == 0 or layer.seen < self.prefill_tokens
        if layer.seen == 0:
            if self.defers_to_reconstruction and not self._reconstruction_expected:
                raise ValueError(
                    f"{self.method.name} scores the prompt with a reconstruction pass after its prefill: use "
                    "keepkv.generate or keepkv.compress, or keepkv.reconstruction.prefill(model, tokenizer, cache, ...)"
                )
            self.step.start(layer)
            # A chunked prefill's buffers take the whole prompt at once, not a growth step per chunk
            # (one chunk more when the prompt is compressed chunk by chunk).
            headroom = block if self.compresses_chunks or self.chunk_keep else self.prefill_tokens - block
            layer.reserve(headroom if self.prefill_tokens > block else None)
        if self.chunk_keep is not None and is_prefill:
            self._check_chunk(layer.seen, block)  # before the block changes anything
        is_real = block_mask[:, 0, -1, :]
        if layer.seen < self.prefill_tokens:  # a block of an announced prompt may be all padding
            is_real = self.prompt_mask[:, layer.seen : layer.seen + block].to(is_real.device)
        layer.append(keys, values, is_real)
        needs = self.record if is_prefill and self.record else self.method.needs(is_prefill)
        entries = self.method.attention_entries(layer)
        binary_bias = entries[2] is layer.bias and layer.binary_bias()
        kernel = None if is_prefill else self._decode_kernel(query.device)
        output, stats = attend(query, *entries, block_mask, scaling, needs, is_prefill, binary_bias, kernel)
        if is_prefill:
            if layer.prefill_stats is not None:  # an earlier chunk of this prompt
                stats = join_prefill_stats(layer.prefill_stats, stats, needs.window)
            layer.prefill_stats = stats
            chunk_alone = self.chunk_keep is not None and block == self.chunk_keep[0]
            if chunk_alone:  # observed and compressed alone; its statistics are spent
                self._compress_chunk_alone(layer, stats, block)
            if layer.seen < self.prefill_tokens:
                if self.compresses_chunks:
                    self._compress_chunk(layer, stats)
                return output
        if is_prefill:
            if self.defers_to_reconstruction:  # compressed once its reconstruction passes ran
                return output
            # no pass ran at 1.0; a chunk compressed alone was observed then
            if not chunk_alone and not (self.keeps_everything and self.method.needs(True).reconstruct):
                self.step.observe_prompt(layer, stats)
            if not self.method.allocates_from_all_layers:
                self._end_prefill([layer])
            elif layer_idx == self.num_layers - 1:
                self._end_prefill(self.layers)
            return output
        if self.keeps_everything and layer.budget is None:  # budget 1.0: nothing will be compressed
            return output
        self.step.decode(layer, stats)
        return output

    def _decode_kernel(self, device):
        """The decode kernel of ``kernel`` for ``device`` (None: the torch path), looked up once per device."""
        if device not in self._decode_kernels:
            self._decode_kernels[device] = decode_kernel_for(self.kernel, device)
        return self._decode_kernels[device]

    # -- reconstruction passes (KVzip) --------------------------------------------------------
    @property
    def keeps_everything(self) -> bool:
        """True at budget 1.0 (the float): the identity. Nothing is compressed, neither the prompt
        nor anything generated after it, and no reconstruction pass runs: the cache grows by one
        entry per token, as the full cache does (1.0 bounds nothing while decoding). A recording
        cache (``record=``) keeps its statistics for ``fork`` instead."""
        return self.record is None and isinstance(self.budget, float) and self.budget == 1.0

    @property
    def defers_to_reconstruction(self) -> bool:
        """True when the method scores the prompt with reconstruction passes
        (:class:`keepkv.attention.Reconstruction`): the prefill then compresses nothing, and the
        prompt is compressed by :meth:`finish_reconstruction` once the passes ran. A recording cache
        keeps the passes' results for ``fork`` instead."""
        return self.record is None and not self.keeps_everything and bool(self.method.needs(True).reconstruct)

    def expect_reconstruction(self) -> None:
        """Announce that the caller runs the reconstruction passes after the prefill
        (:mod:`keepkv.reconstruction` does); a prefill without this announcement is refused for a
        method that needs them, since its prompt would otherwise never be compressed."""
        self._reconstruction_expected = True

    def begin_reconstruction(self, reconstruction: Reconstruction) -> None:
        """Until :meth:`end_reconstruction`, every block fed is a block of ``reconstruction``: it is
        attended over the prompt's entries and itself, with the column maxima of its real queries,
        which raise each prompt entry's ``prefill_stats.reconstructed[reconstruction]``, and then
        forgotten. The block is never appended: the layers keep their prompt buffers, and one
        layer at a time holds the prompt and the block as a transient for its attention call, so
        the pass peaks at the prompt cache plus one layer's prompt and block
        (``prefill_peak_bytes`` counts that transient and the scores)."""
        if any(layer.prefill_stats is None for layer in self.layers) or self.layer_budgets is not None:
            raise ValueError("a reconstruction pass runs after the prompt's prefill and before its compression")
        self._reconstruction = reconstruction

    def end_reconstruction(self) -> None:
        self._reconstruction = None

    def finish_reconstruction(self) -> None:
        """After the passes: every layer observes its prefill (with the passes' results) and is
        compressed, all layers at once (the method may allocate from every layer's scores). A
        recording cache compresses nothing and keeps the statistics for ``fork``."""
        if self.defers_to_reconstruction:
            for layer in self.layers:
                self.step.observe_prompt(layer, layer.prefill_stats)
            self._end_prefill(self.layers)

    def _reconstruction_step(self, layer, query, keys, values, block_mask, scaling) -> torch.Tensor:
        size = layer.size
        is_real = block_mask[:, 0, -1, :]  # [B, q]
        block_bias = torch.zeros(is_real.shape, device=layer.device).masked_fill(~is_real, float("-inf"))
        entries = (
            torch.cat([layer.keys, keys.to(layer.keys.dtype)], dim=2),
            torch.cat([layer.values, values.to(layer.values.dtype)], dim=2),
            torch.cat([layer.bias, block_bias[:, None].expand(-1, layer.bias.shape[1], -1)], dim=2),
        )
        known = layer.prefill_stats.reconstructed
        held = sum(t.nbytes for t in entries) + sum(t.nbytes for l in self.layers if l.prefill_stats is not None
                                                    for t in l.prefill_stats.reconstructed.values())
        self.prefill_peak_bytes = max(self.prefill_peak_bytes, self.nbytes() + held)
        output, stats = attend(query, *entries, block_mask, scaling, Needs(colmax=True), False, layer.binary_bias())
        del entries
        found = stats.colmax[..., :size]  # [B, H_kv, g, S] over the prompt's entries
        pass_ = self._reconstruction
        known[pass_] = found if pass_ not in known else torch.maximum(known[pass_], found)
        return output

    def _end_prefill(self, layers: list[LayerStore]) -> None:
        """Compress ``layers`` as their prefill ends (each layer at once, so the uncompressed prompt
        is held for one layer at a time); the first call fixes every layer's budget."""
        self.prefill_peak_bytes = max(self.prefill_peak_bytes, self.nbytes())
        self._fix_budgets(layers[0].real_seen)
        frozen = self.prompt_lengths if self.decoding == "keep_prompt" else None
        held = None if self.chunk_keep is None else self._prompt_held()
        for layer in layers:
            budget = None if self.layer_budgets is None else self.layer_budgets[layer.layer_idx]
            # each layer its own interval: a small budget's does not slow the others' (decode_interval)
            interval = 1 if budget is None else decode_interval(self.method.interval, budget,
                                                                 frozen if held is None else held,
                                                                 self.method.protected_entries())
            self.step.close_prompt(layer, budget, self.row_budgets, frozen, layer.prefill_stats, interval, held)
            if self.record is None:
                layer.prefill_stats = None

    def _fix_budgets(self, prompt_lengths: torch.Tensor) -> None:
        """Every layer's budgets [L, B, H_kv] and the rows' [B], from the prompts' real lengths [B],
        once per prompt (at the first layer's end of prompt, or its first chunk's compression)."""
        if self.prompt_lengths is not None:
            return
        self.prompt_lengths = prompt_lengths.clone()
        scores = ([self.method.allocation_scores(layer) for layer in self.layers]
                  if self.method.allocates_from_all_layers else None)
        self.layer_budgets, self.row_budgets = prompt_budgets(
            self.method, self.budget, self.decoding, self.num_layers, self.config.num_key_value_heads,
            self.prompt_lengths, scores,
        )
        if self.layer_budgets is not None and self.chunk_keep is not None:  # the prompt holds fewer than its tokens
            held = self._prompt_held().to(self.layer_budgets.device)
            self.layer_budgets = self.layer_budgets - (self.prompt_lengths.to(held.device) - held)[None, :, None]
        if self.layer_budgets is not None and self.decoding != "keep_prompt":
            self._warn_budget(self.row_budgets)

    @property
    def compresses_chunks(self) -> bool:
        """Whether an announced chunked prompt (``start_prefill``) is compressed chunk by chunk as it
        arrives (the method ``compresses_chunks``, the cache compresses its prompt: not
        ``decoding="keep_prompt"``, no recording),
        so that a layer holds at most its budget plus one chunk."""
        return (self.prompt_mask is not None and self._chunk_compression and self.decoding != "keep_prompt"
                and self.record is None
                and not self.keeps_everything and self.method.compresses_chunks)

    def _check_chunk(self, start: int, block: int) -> None:
        """Refuse, in one line, a block of an announced prompt that breaks its chunks
        (``chunk_keep``): one of N tokens from a multiple of N, or a shorter last block."""
        tokens = self.chunk_keep[0]
        if start % tokens or block > tokens or (block < tokens and start + block != self.prefill_tokens):
            raise ValueError(f"chunk_keep=({tokens}, {self.chunk_keep[1]}) needs the prompt fed in blocks of {tokens} "
                             f"tokens (the last may be shorter): got a block of {block} from token {start}")

    def _held_before(self, tokens: int) -> torch.Tensor:
        """[B] entries the prompt's first ``tokens`` tokens (whole chunks) hold per layer and head,
        each chunk compressed alone to its ``chunk_keep``."""
        size, kept = self.chunk_keep
        mask = self.prompt_mask[:, :tokens]
        return mask.reshape(mask.shape[0], -1, size).sum(-1).clamp(max=kept).sum(-1)

    def _prompt_held(self) -> torch.Tensor:
        """[B] entries the whole prompt holds per layer and head (``chunk_keep``): its whole chunks
        compressed, its shorter last block whole."""
        whole = self.prefill_tokens // self.chunk_keep[0] * self.chunk_keep[0]
        return self._held_before(whole) + self.prompt_mask[:, whole:].sum(-1)

    def _compress_chunk_alone(self, layer: LayerStore, stats, block: int) -> None:
        """A whole chunk is in (``chunk_keep``): the entries before it frozen (positions below the
        chunk's first, [B]; ``held`` of them), each row and head keeps K of the chunk's own (all of
        a row's, where it has fewer) (:meth:`keepkv.step.LayerStep.compress_chunk`)."""
        self.prefill_peak_bytes = max(self.prefill_peak_bytes, self.nbytes())
        start = layer.seen - block
        device = layer.real_seen.device
        real = self.prompt_mask[:, start:layer.seen].sum(-1).to(device)  # [B] the chunk's real tokens
        held = self._held_before(start).to(device)
        kept = real.clamp(max=self.chunk_keep[1])
        budget = (held + kept)[:, None].expand(-1, layer.bias.shape[1]).contiguous()
        self.step.compress_chunk(layer, budget, kept, stats, frozen=layer.real_seen - real, frozen_held=held)
        layer.prefill_stats = None  # the next chunks' statistics are over the compressed layer

    def _compress_chunk(self, layer: LayerStore, stats) -> None:
        """A chunk of an announced prompt is in (not its last): compress the layer to its whole
        prompt's budget (:meth:`keepkv.step.LayerStep.compress_chunk`)."""
        self.prefill_peak_bytes = max(self.prefill_peak_bytes, self.nbytes())
        self._fix_budgets(self.prompt_mask.sum(-1).to(layer.real_seen.device))
        if self.layer_budgets is None:
            return
        self.step.compress_chunk(layer, self.layer_budgets[layer.layer_idx], self.row_budgets, stats)
        layer.prefill_stats = None  # the next chunks' statistics are over the compressed layer

    @property
    def _method_step(self):
        """The decode step's method call (eager, or compiled: :mod:`keepkv.fused`), which
        benchmarks wrap to time or count it."""
        return self.step._method_step

    @_method_step.setter
    def _method_step(self, step) -> None:
        self.step._method_step = step

    def _warn_budget(self, per_row: torch.Tensor) -> None:
        """Warn (once per prefill, one host sync) about the compressed row that keeps the fewest entries."""
        lengths, kept = self.prompt_lengths.tolist(), per_row.tolist()
        compressed = [(entries, length) for entries, length in zip(kept, lengths) if length > entries]
        if compressed:
            entries, length = min(compressed)
            warn_budget(self.method, self.budget, length, entries)

    @classmethod
    def stack(cls, caches: list["CompressedCache"]) -> "CompressedCache":
        """One cache whose rows are the rows of ``caches``, in order: a decode batch of requests
        prefilled apart, as a serving engine admits them.

        Each request's layers were compressed as its own prefill ended, so at most one prompt is
        held uncompressed at a time, and a memory cap then buys a batch of compressed rows. The
        caches must run the same method and budget, have ended their prefills and have seen as
        many tokens (pad prompts of unequal length on the left); their layers are padded with
        empty slots to the largest. Decoding the stacked cache gives each row what decoding its
        own cache would. The rows move: each given cache is left empty, one layer at a time, so
        the stack never holds more than one layer twice. Raises ValueError naming what differs.
        """
        if not caches:
            raise ValueError("stack needs at least one cache")
        first = caches[0]
        for cache in caches:
            if cache.record is not None or cache.prompt_lengths is None:
                raise ValueError("stack: every cache must have ended its prefill (and record nothing)")
            if (cache.method, cache.budget, cache.num_layers, cache.compile, cache.decoding) != (
                first.method, first.budget, first.num_layers, first.compile, first.decoding
            ):
                raise ValueError("stack: the caches differ in method, budget, depth, compile or decoding")
        for i in range(first.num_layers):  # everything checked before the first layer moves
            LayerStore.check_stackable([cache.layers[i] for cache in caches])
        known = all(cache.token_hash is not None and cache.ids_seen == cache.get_seq_length() for cache in caches)
        out = cls(first.config, first.method, first.budget, compile=first.compile, decoding=first.decoding,
                  kernel=first.kernel)
        for i in range(first.num_layers):
            out.layers[i] = LayerStore.stack([cache.layers[i] for cache in caches], out.layers[i].shared)
            for cache in caches:
                cache.layers[i] = LayerStore(i, cache.layers[i].shared)
        out.prompt_lengths = torch.cat([cache.prompt_lengths for cache in caches])
        if first.layer_budgets is not None:
            out.layer_budgets = torch.cat([cache.layer_budgets for cache in caches], dim=1)
        out.row_budgets = torch.cat([cache.row_budgets for cache in caches])
        out.prefill_peak_bytes = max(cache.prefill_peak_bytes for cache in caches)
        if known:
            out.token_hash = torch.cat([cache.token_hash for cache in caches])
            out.token_count = torch.cat([cache.token_count for cache in caches])
            out.ids_seen = first.ids_seen
        return out

    def fork(self, method: str | Method, budget: int | float = 1.0, decoding: str = "compress",
             **method_params) -> "CompressedCache":
        """A new cache for ``method`` that starts from this recorded prefill, without a forward pass.

        What running ``method`` from the start would give, since prefill attention never depends
        on the method: only the statistics it asked for, which were recorded. Exactly, up to
        rounding: a prefill that computes column sums or probabilities takes its output from the
        same explicit pass, SDPA's output differs from it in the last bits.
        """
        if self.record is None or self.prompt_lengths is None:
            raise ValueError("fork() needs a cache built with record=Needs(...) that has seen a prefill")
        cache = CompressedCache(self.config, method, budget, compile=self.compile, decoding=decoding, kernel=self.kernel,
                                static_shapes=self.static_shapes, **method_params)
        missing = self.record.missing(cache.method.needs(True))
        if missing:
            raise ValueError(
                f"fork({cache.method.name!r}): the recorded prefill lacks {', '.join(missing)}; record "
                f"Needs.union([method.needs(True) for method in the methods to fork])"
            )
        for i, source in enumerate(self.layers):
            core = {name: source.named_tensors()[name] for name in ("keys", "values", "bias", "positions")}
            layer = LayerStore.from_entries(
                i, core, {}, seen=source.seen, real_seen=source.real_seen.clone(),
                binary=source.binary_bias(), shared=cache.layers[i].shared,
            )
            layer.resume(pending=source.pending)
            cache.layers[i] = layer
            cache.step.start(layer)
            cache.step.observe_prompt(layer, source.prefill_stats)
            layer.prefill_stats = source.prefill_stats
        cache._end_prefill(cache.layers)
        cache.token_hash, cache.token_count, cache.ids_seen = self.token_hash, self.token_count, self.ids_seen
        return cache

    def copy(self) -> "CompressedCache":
        """An independent deep copy: every layer's tensors, buffers and method state, so that
        decoding the copy (a question on a compressed context, ``keepkv.compress``) leaves this
        cache untouched. The model config and the compiled decode step are shared, not copied."""
        import copy as _copy

        # Normal tensors, as the store's buffers (written in place also outside inference mode);
        # deepcopy keeps each view on its copied buffer.
        with torch.inference_mode(False):
            shared = {id(self.config): self.config, id(self.step): self.step}
            return _copy.deepcopy(self, memo=shared)

    # -- reporting -------------------------------------------------------------------------
    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def summary(self) -> CacheSummary:
        """Kept entries and bytes per row, next to what an uncompressed cache would hold."""
        first = self.layers[0]
        _, kv_heads, _, head_dim = first.keys.shape
        kept = torch.stack([layer.live_counts().double().mean(-1) for layer in self.layers]).mean(0)
        per_entry = 2 * head_dim * first.keys.element_size() * kv_heads * self.num_layers
        rows = [layer.row_nbytes() for layer in self.layers]
        parts = {part: sum(row[part] for row in rows).tolist() for part in ("entries", "padding", "spare", "state")}
        return CacheSummary(
            kept_entries=[round(float(k), 2) for k in kept],
            cache_bytes=[sum(row) for row in zip(*parts.values())],
            entry_bytes=parts["entries"],
            padding_bytes=parts["padding"],
            spare_bytes=parts["spare"],
            state_bytes=parts["state"],
            full_cache_bytes=[int(t) * per_entry for t in first.real_seen],
        )
