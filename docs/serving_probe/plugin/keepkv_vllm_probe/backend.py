import os

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl


class KeepKVProbeImpl(CPUAttentionBackendImpl):
    _calls = 0

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        cls = type(self)
        if attn_metadata is not None and cls._calls < 2:
            print(
                f"[keepkv-probe] forward pid={os.getpid()} layer={getattr(layer, 'layer_name', '?')} "
                f"q={tuple(query.shape)} kv_cache={tuple(kv_cache.shape)} "
                f"seq_lens={attn_metadata.seq_lens.tolist()} block_table={tuple(attn_metadata.block_table.shape)}",
                flush=True,
            )
        if attn_metadata is not None:
            cls._calls += 1
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)


class KeepKVProbeBackend(CPUAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "KEEPKV_PROBE"

    @staticmethod
    def get_impl_cls():
        print(f"[keepkv-probe] get_impl_cls pid={os.getpid()}", flush=True)
        return KeepKVProbeImpl
