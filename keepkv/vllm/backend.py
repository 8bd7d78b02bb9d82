"""The worker side: vLLM's CPU attention backend, with keepkv's paged methods when configured.

While the engine's ``additional_config`` has no ``"keepkv"`` entry every call goes to vLLM's
own CPU attention, so installing the plugin changes nothing. With one, the layer's spec becomes
a :class:`~keepkv.vllm.spec.KeepKVSpec` (each slot also holds the entry's position, bias and
scores), the metadata builder turns each step into a :class:`~keepkv.paged.PagedBatch`, and the
attention call runs :meth:`keepkv.paged.PagedCompression.forward`, which writes the new entries
itself (vLLM's slot mapping addresses positions, not compacted slots).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

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
)

from ..paged import PagedBatch, PagedCompression
from .settings import engine_settings
from .spec import KeepKVSpec

# The PagedCompression of the engine configuration this process serves now (an engine's layers keep
# their own reference, so a later engine of another configuration replaces it: one entry at most).
_COMPRESSIONS: dict[tuple, PagedCompression] = {}
# The worker's engine, set when its attention layers are built: customize_spec() runs later,
# outside vLLM's config context.
_WORKER: dict = {}


def compression(vllm_config: VllmConfig) -> PagedCompression | None:
    """This process's PagedCompression for the engine, or None when keepkv is not configured."""
    chosen = engine_settings(vllm_config)
    if chosen is None:
        _WORKER.clear()  # a stock engine after a keepkv one in this process: its spec is stock's
        return None
    key = (chosen["method"], chosen["budget"], chosen["chunked"], chosen.get("keep_prompt", False))
    if key not in _COMPRESSIONS:
        _COMPRESSIONS.clear()
        _COMPRESSIONS[key] = PagedCompression(vllm_config.model_config.hf_text_config, **chosen)
    _WORKER.update(paged=_COMPRESSIONS[key], num_layers=vllm_config.model_config.hf_text_config.num_hidden_layers,
                   max_model_len=vllm_config.model_config.max_model_len)
    return _COMPRESSIONS[key]


@dataclass
class StockRows:
    """The step's uncompressed rows (``PagedCompression.uncompressed``), as vLLM's own CPU kernel
    reads them: their blocks copied into vLLM's layout (``blocks``: the block ids, in order;
    ``slots``: every slot of the copy, in order), block_table [n, max_blocks] int32 into that copy, query_start_loc [n+1] and seq_lens [n]
    int32, tokens [t] long (where their tokens are in the step's flat token axis), and the
    kernel's scheduler metadata."""

    blocks: torch.Tensor
    slots: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    tokens: torch.Tensor
    scheduler_metadata: torch.Tensor


@dataclass
class KeepKVMetadata:
    """What one step's attention calls read: the paged batch, the tokens it covers, and its
    uncompressed rows for vLLM's kernel (None if there are none)."""

    num_actual_tokens: int
    batch: PagedBatch
    stock: StockRows | None = None


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
                          chunked=paged.chunked, max_model_len=_WORKER["max_model_len"], keep_prompt=paged.keep_prompt)


class KeepKVMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.paged = compression(vllm_config)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False):
        if self.paged is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        common = common_attn_metadata
        rows = common.num_reqs
        # Host copies vLLM keeps (exact without speculative decoding, which keepkv refuses):
        # nothing waits on the device to build the step.
        seq_lens = common.seq_lens_cpu_upper_bound if common.seq_lens_cpu_upper_bound is not None else common.seq_lens.cpu()
        # is_prefilling: computed < prompt before the step (a host tensor), read by a chunked engine.
        prefilling = common.is_prefilling[:rows].tolist() if self.paged.chunked else None
        starts, lengths = common.query_start_loc_cpu[: rows + 1].tolist(), seq_lens[:rows].tolist()
        batch = self.paged.batch(starts, lengths, common.block_table_tensor[:rows], prefilling,
                                 block_size=self.kv_cache_spec.block_size)
        return KeepKVMetadata(num_actual_tokens=common.num_actual_tokens, batch=batch,
                              stock=self._stock_rows(batch, self.paged.uncompressed(batch), lengths))

    def _stock_rows(self, batch: PagedBatch, rows: list[int], seq_lens: list[int]) -> StockRows | None:
        """The uncompressed ``rows`` as vLLM's kernel reads them (:class:`StockRows`), or None."""
        if not rows:
            return None
        row_lens = torch.tensor([seq_lens[r] for r in rows], dtype=torch.int32)
        counts = (row_lens + self.block_size - 1) // self.block_size  # [n] blocks each row reads
        column = torch.arange(int(counts.max()))
        held = column < counts[:, None]  # [n, max_blocks]
        blocks = batch.block_table[rows][:, : column.numel()][held].long()  # row after row, in order
        table = (column + (counts.cumsum(0) - counts)[:, None]).where(held, 0).to(torch.int32)
        lengths = torch.tensor([batch.query_lengths[r] for r in rows])
        query_start_loc = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
        starts = torch.tensor([batch.query_start[r] for r in rows])
        total = int(lengths.sum())
        tokens = torch.arange(total) + torch.repeat_interleave(starts - query_start_loc[:-1], lengths, output_size=total)
        scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(rows), num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            seq_lens=row_lens, dtype=self.dtype, query_start_loc=query_start_loc, causal=True,
            sliding_window_size=self.window_size, isa=self.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        slots = torch.arange(blocks.numel() * self.block_size)
        return StockRows(blocks, slots, table, query_start_loc, row_lens, tokens, scheduler_metadata)


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
        output[:tokens] = self.paged.forward(
            kv_cache, query[:tokens], key[:tokens], value[:tokens], attn_metadata.batch, self.scale, self.layer_index
        ).view_as(output[:tokens])
        if attn_metadata.stock is not None:
            self._stock_attention(layer, query, kv_cache, attn_metadata.stock, output)
        return output

    def _stock_attention(self, layer, query, kv_cache, stock: StockRows, output) -> None:
        """The uncompressed rows' attention by vLLM's own kernel, in its numerics, over the entries
        the step has just written: a request the method does not compress answers as stock vLLM
        (in bf16 too). Their blocks' keys and values are written into a copy in vLLM's own layout
        (which its kernel packs per ISA) by vLLM's own cache write, slot for slot: keepkv's slots
        also hold metadata words, and hold keys and values plainly."""
        head = self.head_size
        held = kv_cache.index_select(0, stock.blocks)  # [n, H_kv, block_size, C]
        blocks, kv_heads, block_size, _ = held.shape
        keys, values = (held[..., start : start + head].transpose(1, 2).reshape(blocks * block_size, kv_heads, head)
                        for start in (0, head))  # [n·block_size, H_kv, D], slot after slot
        key_cache, value_cache = held.new_empty(blocks, kv_heads, 2 * block_size, head).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, stock.slots, layer.isa,
                                       k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
                                       kv_cache_dtype=self.kv_cache_dtype)
        rows_query = query.index_select(0, stock.tokens)  # [t, H, D]
        rows_output = torch.empty_like(rows_query)
        ops.cpu_attention_with_kv_cache(
            query=rows_query, key_cache=key_cache, value_cache=value_cache, output=rows_output,
            query_start_loc=stock.query_start_loc, seq_lens=stock.seq_lens, scale=self.scale, causal=True,
            alibi_slopes=self.alibi_slopes, sliding_window=self.sliding_window, block_table=stock.block_table,
            softcap=self.logits_soft_cap, scheduler_metadata=stock.scheduler_metadata, s_aux=self.sinks,
            dynamic_causal=None, k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        output.view(output.shape[0], self.num_heads, head).index_copy_(0, stock.tokens, rows_output)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.paged is None:  # keepkv writes its entries in forward(), at compacted slots
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
