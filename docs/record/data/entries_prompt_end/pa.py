import torch, time
torch.set_num_threads(1)
from transformers import LlamaConfig
from keepkv.paged import PagedCompression
from keepkv.store import LayerStore
from keepkv.attention import kept_query_stats, Needs, group_queries
cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30, intermediate_size=16, vocab_size=32)
for m in ("snapkv", "keepkv"):
    p = PagedCompression(cfg, m, 0.1, chunked=True)
    S=2048
    st = LayerStore(0); k=torch.randn(1,3,S,64); v=torch.randn(1,3,S,64)
    st.lazy_initialization(k, v); p.step.start(st); st.append(k, v, torch.ones(1,S,dtype=torch.bool))
    q = torch.randn(1,9,32,64)
    def f(): return p._prompt_attention(q, st, 0.125, last_rows=True)
    f(); t=time.perf_counter()
    for _ in range(20): f()
    a=(time.perf_counter()-t)/20*1e3
    qg = group_queries(q, 3)
    pos = torch.arange(S-32, S)[None]
    def g(): return kept_query_stats(qg, st.keys, st.bias, st.positions, pos, 0.125, Needs(probs=True, logits=True))
    g(); t=time.perf_counter()
    for _ in range(20): g()
    b=(time.perf_counter()-t)/20*1e3
    out, s1 = f(); s2 = g()
    print(m, "prompt_attention ms", round(a,3), "kept_query_stats ms", round(b,3), "window_probs", tuple(s1.window_probs.shape), "maxdiff", (s1.window_probs - s2.probs).abs().max().item(), "equal", torch.equal(s1.window_probs, s2.probs))
