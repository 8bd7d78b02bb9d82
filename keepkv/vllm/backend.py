"""The worker side: vLLM's CPU attention backend, with keepkv's paged methods when configured.

While the engine's ``additional_config`` has no ``"keepkv"`` entry every call goes to vLLM's
own CPU attention, so installing the plugin changes nothing. With one, the layer's spec becomes
a :class:`~keepkv.vllm.spec.KeepKVSpec` (each slot's cell also holds the entry's fp32 words:
position and the method's scores), the metadata builder turns each step into a
:class:`~keepkv.paged.PagedBatch`, and the attention call runs
:meth:`keepkv.paged.PagedCompression.forward` with :class:`VllmCpuKernel`: vLLM's own cache write
and kernel over the key and value planes of each block (``keepkv.paged_layout``), so a request
is attended in place, as stock vLLM attends it; a merging method's decoding requests go to
keepkv's own paged kernel (:mod:`keepkv.kernels.paged`), which reads the same planes and adds
each entry's bias from its words. keepkv writes the new entries itself (vLLM's slot
mapping addresses positions, not compacted slots). With prompts kept whole the builder also reads
each request's prompt length, which vLLM's model runner hands it (:func:`_hand_prompt_lengths`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.config import VllmConfig, get_current_vllm_config, get_current_vllm_config_or_none
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
    _get_attn_isa,
)

from ..paged import PagedBatch, PagedCompression, rank_config
from .settings import engine_settings
from .spec import KeepKVSpec, engine_layer_groups


def engine_isa(dtype: torch.dtype, block_size: int, head_size: int | None = None, kv_cache_dtype: str | None = None) -> str:
    """The CPU kernel (vLLM's "ISA") a keepkv engine runs: vLLM's choice for these shapes, but
    "vec" where vLLM would choose "amx" (bf16 on a CPU with AMX). AMX's cache write packs keys in
    tiles of 16 slots, pairs of dimensions side by side, which keepkv's own paged kernel does not
    read (it reads a block's plane slot by slot or dimension by dimension:
    ``PagedLayout.geometry``). The cache write, the scheduler metadata and vLLM's kernel all take
    this one choice. (Same arguments as vLLM's ``_get_attn_isa``.)"""
    isa = _get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)
    return "vec" if isa == "amx" else isa


class VllmCpuKernel:
    """vLLM's CPU attention as the paged adapter's kernel (``keepkv.paged_layout.PagedKernel``):
    its cache write (``cpu_attn_reshape_and_cache``, which packs keys per ISA), its scheduler
    metadata and its kernel (``cpu_attention_with_kv_cache``), over views of the key and value
    planes, which both take as strided tensors [blocks, H_kv, block_size, D]."""

    def __init__(self, kv_cache_dtype: str = "auto"):
        self.kv_cache_dtype = kv_cache_dtype

    @functools.lru_cache(maxsize=16)
    def isa(self, dtype: torch.dtype, block_size: int, head_dim: int) -> str:
        return engine_isa(dtype, block_size, head_dim, self.kv_cache_dtype)

    @functools.lru_cache(maxsize=16)
    def orders(self, block_size: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the cache write puts element (slot, d) of a block, read off one probe block: each
        slot's index written in every dimension, then each dimension's index in every slot (exact
        in any float dtype up to 256), and the raw planes inverted."""
        isa = self.isa(dtype, block_size, head_dim)
        slots = torch.arange(block_size)
        found = []
        for coordinate in (slots[:, None].expand(-1, head_dim), torch.arange(head_dim)[None, :].expand(block_size, -1)):
            planes = torch.zeros(1, 1, 2, block_size * head_dim, dtype=dtype)
            keys, values = (planes[:, :, i].unflatten(-1, (block_size, head_dim)) for i in (0, 1))
            probe = coordinate[:, None, :].to(dtype).contiguous()  # [block_size, 1, D]
            ops.cpu_attn_reshape_and_cache(probe, probe, keys, values, slots, isa, kv_cache_dtype=self.kv_cache_dtype)
            found.append(planes[0, 0].long())  # [2, block_size * D]: the coordinate at each raw element
        orders = []
        for plane in (0, 1):
            order = torch.full((block_size, head_dim), -1, dtype=torch.long)
            order[found[0][plane], found[1][plane]] = torch.arange(block_size * head_dim)
            if bool((order < 0).any()):
                raise RuntimeError(f"keepkv.vllm: vLLM's {isa!r} cache write does not place each element of a block once")
            orders.append(order)
        return orders[0], orders[1]

    @staticmethod
    def _caches(keys_plane, values_plane, head_dim: int):
        block_size = keys_plane.shape[-1] // head_dim
        return keys_plane.unflatten(-1, (block_size, head_dim)), values_plane.unflatten(-1, (block_size, head_dim)), block_size

    def write(self, keys_plane, values_plane, keys, values, slots) -> None:
        key_cache, value_cache, block_size = self._caches(keys_plane, values_plane, keys.shape[-1])
        ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots,
                                       self.isa(key_cache.dtype, block_size, keys.shape[-1]),
                                       kv_cache_dtype=self.kv_cache_dtype)

    def plan(self, query_start_loc, seq_lens, num_heads: int, layout):
        return ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(seq_lens), num_heads=num_heads, num_kv_heads=layout.kv_heads, head_dim=layout.head_dim,
            seq_lens=seq_lens, dtype=layout.dtype, query_start_loc=query_start_loc, causal=True,
            sliding_window_size=-1, isa=self.isa(layout.dtype, layout.block_size, layout.head_dim),
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, kv_cache_dtype=self.kv_cache_dtype,
        )

    def attend(self, query, keys_plane, values_plane, block_table, query_start_loc, seq_lens, plan, scaling,
               output) -> None:
        key_cache, value_cache, _ = self._caches(keys_plane, values_plane, query.shape[-1])
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=output, query_start_loc=query_start_loc,
            seq_lens=seq_lens, scale=scaling, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=block_table, softcap=0, scheduler_metadata=plan, s_aux=None,
            kv_cache_dtype=self.kv_cache_dtype,
        )


# The PagedCompressions of the engine configuration this process serves now, one per layer group
# ((settings, group) -> it; an engine's metadata builders keep their own reference, so a later
# engine of another configuration replaces them).
_COMPRESSIONS: dict[tuple, PagedCompression] = {}
# The worker's engine, set when its attention layers are built: customize_spec() runs later,
# outside vLLM's config context.
_WORKER: dict = {}
# While vLLM's model runner builds a step's attention metadata: "prompts", its [max_num_reqs] int32
# host tensor of each batch row's prompt length (InputBatch.num_prompt_tokens_cpu_tensor, the
# length of the prompt_token_ids the scheduler handed the worker with the request, which a
# replay after a preemption keeps), which CommonAttentionMetadata carries only as is_prefilling;
# "tokens", each row's tokens (prompt and output, InputBatch.num_tokens_no_spec; with the prompt,
# where the scheduler's prefill ends: max(prompt, tokens - 1), a resumed request replaying its
# outputs too); "due", the step's list of gathered compressions that every layer group's batch shares
# (PagedBatch.due: the model's last layer runs them together).
_STEP: dict = {}


def _wrap_runner(name: str, wrap) -> None:
    """Replace vLLM's CPU model runner's method ``name`` by ``wrap(original)``, once (idempotent)."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    original = getattr(CPUModelRunner, name)
    if getattr(original, "_keepkv", False):
        return
    wrapped = functools.wraps(original)(wrap(original))
    wrapped._keepkv = True
    setattr(CPUModelRunner, name, wrapped)


def _hand_prompt_lengths() -> None:
    """Wrap vLLM's CPU model runner's ``_build_attention_metadata`` (which builds every layer group's
    metadata of a step) so that the metadata builders find in ``_STEP`` each row's prompt length
    and the step's one list of due compressions while they build a step. Idempotent."""

    def wrap(original):
        def build(self, *args, **kwargs):
            _STEP["prompts"] = self.input_batch.num_prompt_tokens_cpu_tensor
            _STEP["tokens"] = self.input_batch.num_tokens_no_spec
            _STEP["due"] = []
            try:
                return original(self, *args, **kwargs)
            finally:
                _STEP.clear()

        return build

    _wrap_runner("_build_attention_metadata", wrap)


def compression(vllm_config: VllmConfig, group: int = 0) -> PagedCompression | None:
    """This process's PagedCompression for the engine's layer group ``group`` (each group's requests
    are its own: their keys are the group's blocks), or None when keepkv is not configured: shaped
    by this rank's heads (under tensor parallelism a worker holds ``num_attention_heads // tp``
    query heads and ``num_key_value_heads // tp`` KV heads, and compresses those alone)."""
    chosen = engine_settings(vllm_config)
    if chosen is None:
        _WORKER.clear()  # a stock engine after a keepkv one in this process: its spec is stock's
        return None
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    heads = (model.get_num_attention_heads(parallel), model.get_num_kv_heads(parallel))  # this rank's
    rank = parallel.rank % parallel.tensor_parallel_size  # vLLM's worker sets the rank
    key = (chosen["method"], chosen["budget"], chosen["chunked"], chosen.get("keep_prompt", False),
           chosen.get("share_prefix", 0), str(model.dtype), heads, rank)
    if (key, group) not in _COMPRESSIONS:
        if any(known != key for known, _ in _COMPRESSIONS):
            _COMPRESSIONS.clear()
        settings = {name: value for name, value in chosen.items() if name != "share_prefix"}
        _COMPRESSIONS[key, group] = PagedCompression(
            rank_config(model.hf_text_config, *heads, rank=rank), **settings,
            kernel=VllmCpuKernel(str(vllm_config.cache_config.cache_dtype)), chunk_blocks=chosen.get("share_prefix", 0))
    paged = _COMPRESSIONS[key, 0] if (key, 0) in _COMPRESSIONS else _COMPRESSIONS[key, group]
    groups = engine_layer_groups(paged, model.max_model_len, vllm_config.cache_config.block_size)
    _WORKER.update(paged=paged, num_layers=model.hf_text_config.num_hidden_layers, max_model_len=model.max_model_len,
                   tensor_parallel_size=parallel.tensor_parallel_size, layer_groups=groups)
    if groups:
        _group_layers()
    return _COMPRESSIONS[key, group]


def _group_layers() -> None:
    """Wrap vLLM's CPU model runner's ``get_kv_cache_spec`` so that each layer's KeepKVSpec names
    its layer group (``_WORKER["layer_groups"]``: the model's layers grouped by their budgets,
    :func:`keepkv.vllm.spec.layer_groups`); vLLM then gives each group a block table of its own.
    Idempotent."""

    def wrap(original):
        def grouped(self, *args, **kwargs):
            specs = original(self, *args, **kwargs)
            groups = _WORKER.get("layer_groups", ())
            if not groups:
                return specs
            group_of = {layer: index for index, group in enumerate(groups) for layer in group}
            return {name: replace(spec, layer_groups=groups, group=group_of[extract_layer_index(name)])
                    if isinstance(spec, KeepKVSpec) else spec for name, spec in specs.items()}

        return grouped

    _wrap_runner("get_kv_cache_spec", wrap)


@dataclass
class KeepKVMetadata:
    """What one step's attention calls of one layer group read: the paged batch, the tokens it
    covers, and the group's PagedCompression."""

    num_actual_tokens: int
    batch: PagedBatch
    paged: PagedCompression


class KeepKVBackend(CPUAttentionBackend):
    """vLLM's CPU attention, or keepkv's paged methods when the engine configures them."""

    @staticmethod
    def get_impl_cls():
        return KeepKVImpl

    @staticmethod
    def get_builder_cls():
        return KeepKVMetadataBuilder

    @classmethod
    def customize_spec(cls, spec):
        vllm_config = get_current_vllm_config_or_none()
        if vllm_config is not None:
            compression(vllm_config)
        paged = _WORKER.get("paged")
        if paged is None:
            return super().customize_spec(spec)
        values = {field.name: getattr(spec, field.name) for field in fields(spec) if field.init}
        values["state_content_bytes"] = paged.content_bytes(spec.head_size, spec.dtype)
        return KeepKVSpec(**values, method=paged.spec, budget=paged.budget, num_layers=_WORKER["num_layers"],
                          chunked=paged.chunked, max_model_len=_WORKER["max_model_len"], keep_prompt=paged.keep_prompt,
                          tensor_parallel_size=_WORKER["tensor_parallel_size"], chunk_blocks=paged.chunk_blocks)


class KeepKVMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.paged = compression(vllm_config, getattr(kv_cache_spec, "group", 0))
        # The model's last layer runs the step's due compressions (every layer: PagedBatch.layers),
        # every layer group's together: their batches share one list (PagedBatch.due), which the
        # model runner's wrap hands them. A step built otherwise runs a group's at its own last layer.
        layers = getattr(kv_cache_spec, "layers", None)
        self.grouped = bool(layers)
        self.last_layer = None if self.paged is None else (
            max(layers) if layers else self.paged.config.num_hidden_layers - 1)
        if self.paged is not None and (self.paged.keep_prompt or self.grouped or self.paged.compresses_chunks):
            _hand_prompt_lengths()

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False):
        if self.paged is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        common = common_attn_metadata
        rows = common.num_reqs
        # Host copies vLLM keeps (exact without speculative decoding, which keepkv refuses):
        # nothing waits on the device to build the step.
        seq_lens = common.seq_lens_cpu_upper_bound if common.seq_lens_cpu_upper_bound is not None else common.seq_lens.cpu()
        prefilling = prompts = ends = None
        if self.paged.keep_prompt:  # the prompt's length itself: a replay after a preemption may span its end
            if "prompts" not in _STEP:
                raise RuntimeError("keepkv.vllm: the model runner handed no prompt lengths (keep_prompt reads them "
                                   "from vLLM's V1 CPU model runner: VLLM_USE_V2_MODEL_RUNNER=0)")
            prompts = _STEP["prompts"][:rows].tolist()
        elif self.paged.chunked:  # is_prefilling: computed < prompt before the step (a host tensor)
            prefilling = common.is_prefilling[:rows].tolist()
            if self.paged.compresses_chunks:  # where each prompt's chunks end: the scheduler's prefill end
                if "prompts" not in _STEP:
                    raise RuntimeError("keepkv.vllm: the model runner handed no prompt lengths (a prompt compressed "
                                       "chunk by chunk reads them from vLLM's V1 CPU model runner: "
                                       "VLLM_USE_V2_MODEL_RUNNER=0)")
                ends = [max(prompt, tokens - 1) for prompt, tokens in
                        zip(_STEP["prompts"][:rows].tolist(), _STEP["tokens"][:rows].tolist())]
        starts, lengths = common.query_start_loc_cpu[: rows + 1].tolist(), seq_lens[:rows].tolist()
        # Every layer of the model runs this batch, in order: the step's compressions wait for the last.
        due = _STEP.get("due") if self.grouped else None
        last = self.paged.config.num_hidden_layers - 1 if due is not None else self.last_layer
        batch = self.paged.batch(starts, lengths, common.block_table_tensor[:rows], prefilling,
                                 block_size=self.kv_cache_spec.block_size, prompts=prompts, layers=last + 1, due=due,
                                 ends=ends)
        return KeepKVMetadata(num_actual_tokens=common.num_actual_tokens, batch=batch, paged=self.paged)


class KeepKVImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.paged = compression(get_current_vllm_config())
        self.layer_index: int | None = None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        if self.paged is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if attn_metadata is None:  # warm-up
            return output
        if self.layer_index is None:  # the model's layer: its budget is its own (PyramidKV)
            self.layer_index = extract_layer_index(layer.layer_name)
        tokens = attn_metadata.num_actual_tokens
        output[:tokens] = attn_metadata.paged.forward(  # the layer group's
            kv_cache, query[:tokens], key[:tokens], value[:tokens], attn_metadata.batch, self.scale, self.layer_index
        ).view_as(output[:tokens])
        return output

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.paged is None:  # keepkv writes its entries in forward(), at compacted slots
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
