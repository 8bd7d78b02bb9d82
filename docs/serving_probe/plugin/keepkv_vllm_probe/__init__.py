"""Minimal vLLM general plugin: registers a delegating CPU attention backend."""
import os

_PATH = "keepkv_vllm_probe.backend.KeepKVProbeBackend"


def register():
    import multiprocessing as mp
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    print(f"[keepkv-probe] register() pid={os.getpid()} proc={mp.current_process().name}", flush=True)
    # 1) a new backend name, selectable as attention_backend="KEEPKV_PROBE"
    if "KEEPKV_PROBE" not in AttentionBackendEnum.__members__:
        register_backend("KEEPKV_PROBE", _PATH)
    # 2) optionally override CPU_ATTN itself (the CPU platform always returns CPU_ATTN's path)
    if os.environ.get("KEEPKV_PROBE_OVERRIDE_CPU_ATTN") == "1":
        register_backend(AttentionBackendEnum.CPU_ATTN, _PATH)
    # 3) optionally point CPU_ATTN at an arbitrary class path (e.g. vLLM's FlexAttentionBackend)
    if os.environ.get("KEEPKV_PROBE_CPU_ATTN_PATH"):
        register_backend(AttentionBackendEnum.CPU_ATTN, os.environ["KEEPKV_PROBE_CPU_ATTN_PATH"])
