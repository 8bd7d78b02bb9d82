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

_COMPRESSIONS: dict[tuple, PagedCompression] = {}  # one per engine configuration, per process
# The worker's engine, set when its attention layers are built: customize_spec() runs later,
# outside vLLM's config context.
_WORKER: dict = {}


def compression(vllm_config: VllmConfig) -> PagedCompression | None:
    """This process's PagedCompression for the engine, or None when keepkv is not configured."""
    chosen = engine_settings(vllm_config)
    if chosen is None:
        return None
    key = (chosen["method"], chosen["budget"], chosen["chunked"])
    if key not in _COMPRESSIONS:
        _COMPRESSIONS[key] = PagedCompression(vllm_config.model_config.hf_text_config, **chosen)
    _WORKER.update(paged=_COMPRESSIONS[key], num_layers=vllm_config.model_config.hf_text_config.num_hidden_layers)
    return _COMPRESSIONS[key]


@dataclass
class KeepKVMetadata:
    """What one step's attention calls read: the paged batch, and the tokens it covers."""

    num_actual_tokens: int
    batch: PagedBatch


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
                          chunked=paged.chunked)


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
        batch = self.paged.batch(
            common.query_start_loc_cpu[: rows + 1].tolist(), seq_lens[:rows].tolist(), common.block_table_tensor[:rows],
            prefilling,
        )
        return KeepKVMetadata(num_actual_tokens=common.num_actual_tokens, batch=batch)


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
        return output

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.paged is None:  # keepkv writes its entries in forward(), at compacted slots
            super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
