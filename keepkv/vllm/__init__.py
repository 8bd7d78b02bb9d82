"""keepkv in vLLM: a general plugin serving compressed KV caches (phase 1: vLLM's CPU build).

Installed with ``pip install -e ".[vllm]"`` (its own venv: vLLM pins its own transformers), the
plugin loads in every vLLM process and stays inert until the engine is given::

    LLM(model, additional_config={"keepkv": {"method": "snapkv", "budget": 0.1}},
        enable_prefix_caching=False, enable_chunked_prefill=False)

or ``vllm serve MODEL --additional-config '{"keepkv": {...}}' --no-enable-prefix-caching
--no-enable-chunked-prefill``. Then the attention backend (:mod:`keepkv.vllm.backend`) runs the
method on each request's paged entries (:mod:`keepkv.paged`) and the KV cache manager
(:mod:`keepkv.vllm.spec`) caps each request's blocks at ``keepkv.capacity_bound``.
"""

from __future__ import annotations

BACKEND = "keepkv.vllm.backend.KeepKVBackend"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: route CPU attention through keepkv's backend
    (which delegates to vLLM's own while keepkv is not configured) and register the KV cache
    spec whose manager frees blocks."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return  # phase 1: CPU only (docs/serving.md)
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from .spec import KeepKVManager, KeepKVSpec

    # The CPU platform picks CPU_ATTN whatever --attention-backend says: override that entry.
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
    KVCacheSpecRegistry._ensure_registered()  # else the built-in specs are never registered
    KVCacheSpecRegistry.register(KeepKVSpec, KeepKVManager)
