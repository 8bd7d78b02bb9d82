"""Eager vs torch.compile of KeepKV's per-layer decode-step score math (EMA update of eq. 8 and the
GQA pooling of pool_log_scores), at B=4, H_kv=3, g=3, S=410 (10% of 4k), one thread."""
import math, time, torch
from keepkv.merging import pool_log_scores
torch.set_num_threads(1)
NEG_INF = float("-inf")
alpha = 0.94

def step(ema_s, ema_n, logits, live, bias):
    """ema_s [B,H,g,S], ema_n [B,H,S], logits [B,H,g,S], live [B,H,S] bool, bias [B,H,S]."""
    decay, fresh = math.log(alpha), math.log1p(-alpha)
    ema_s = torch.logaddexp(ema_s + decay, logits + fresh).masked_fill(~live[:, :, None], NEG_INF)
    ema_n = torch.logaddexp(ema_n + decay, torch.full_like(ema_n, fresh)).masked_fill(~live, NEG_INF)
    heads = (ema_s - ema_n.masked_fill(~live, 0.0)[:, :, None]).masked_fill(~live[:, :, None], NEG_INF)
    return ema_s, ema_n, pool_log_scores(heads, bias)

B, H, g, S = 4, 3, 3, 410
ema_s, logits = torch.randn(B, H, g, S), torch.randn(B, H, g, S)
ema_n, bias = torch.randn(B, H, S), torch.zeros(B, H, S)
live = torch.rand(B, H, S) > 0.02
compiled = torch.compile(step, dynamic=False)
t0 = time.perf_counter(); compiled(ema_s, ema_n, logits, live, bias); first = time.perf_counter() - t0
for name, fn in (("eager", step), ("compiled", compiled)):
    for _ in range(20):
        fn(ema_s, ema_n, logits, live, bias)
    t0 = time.perf_counter()
    for _ in range(500):
        out = fn(ema_s, ema_n, logits, live, bias)
    print(f"{name:9s} {1e6 * (time.perf_counter() - t0) / 500:7.1f} us per call")
ref, got = step(ema_s, ema_n, logits, live, bias), compiled(ema_s, ema_n, logits, live, bias)
print("first compiled call (compile time) %.1f s; max abs diff %.2e" % (first, max((a - b).nan_to_num(0, 0, 0).abs().max().item() for a, b in zip(ref, got))))
