"""The scheduler side: a KV cache spec that carries the method, and a manager that caps blocks.

The manager sees token counts only. A request's first allocation is its prompt (keepkv.vllm
admits whole-prompt prefills only), which fixes its capacity; from then on it never holds more
than ceil(capacity / block_size) blocks, prefill included: the worker compresses the prompt in
its own workspace and writes only the kept entries (:mod:`keepkv.paged`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from types import SimpleNamespace

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec

from ..paged import PagedCompression


@dataclass(frozen=True, kw_only=True)
class KeepKVSpec(FullAttentionSpec):
    """Full attention whose requests keep at most ``capacity_bound`` entries per layer and head.

    method, budget: as ``keepkv.CompressedCache``'s; num_layers: the model's depth (the bound
    reads it). ``state_content_bytes`` holds each slot's key, value and metadata words.
    """

    method: str = "full"
    budget: float | int = 1.0
    num_layers: int = 1

    @classmethod
    def merge(cls, specs: list["KeepKVSpec"]) -> "KeepKVSpec":
        merged = super().merge(specs)  # builds cls(...) from the base fields only
        first = specs[0]
        return replace(merged, method=first.method, budget=first.budget, num_layers=first.num_layers)

    @functools.cached_property
    def compression(self) -> PagedCompression:
        config = SimpleNamespace(num_hidden_layers=self.num_layers, num_key_value_heads=self.num_kv_heads)
        return PagedCompression(config, self.method, self.budget)

    def capacity_tokens(self, prompt_length: int) -> int:
        """Slots a request of ``prompt_length`` prompt tokens ever needs."""
        return _capacity(self.compression, prompt_length)


@functools.lru_cache(maxsize=4096)
def _capacity(compression: PagedCompression, prompt_length: int) -> int:
    return compression.capacity(prompt_length)


class KeepKVManager(FullAttentionManager):
    """FullAttentionManager whose requests stop growing at their capacity."""

    def __init__(self, kv_cache_spec: KeepKVSpec, **kwargs):
        super().__init__(kv_cache_spec, **kwargs)
        self.prompt_tokens: dict[str, int] = {}  # request -> tokens of its first step

    def _capped(self, request_id: str, num_tokens: int) -> int:
        prompt = self.prompt_tokens.get(request_id, num_tokens)
        return min(num_tokens, self.kv_cache_spec.capacity_tokens(prompt))

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, *args, **kwargs) -> int:
        return super().get_num_blocks_to_allocate(request_id, self._capped(request_id, num_tokens), *args, **kwargs)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int):
        if not self.req_to_blocks.get(request_id):
            self.prompt_tokens[request_id] = num_tokens
        capped = self._capped(request_id, num_tokens)
        return super().allocate_new_blocks(request_id, capped, min(num_tokens_main_model, capped))

    def pop_blocks_for_free(self, request_id: str):
        self.prompt_tokens.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)
