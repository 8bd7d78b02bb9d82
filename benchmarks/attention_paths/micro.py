"""Per-layer micro-benchmarks of the attention-path changes of issue 14 (1 thread, CPU).

    git show 3f8ba7a:keepkv/attention.py > /tmp/attention_3f8ba7a.py
    PYTHONPATH=$PWD python benchmarks/attention_paths/micro.py /tmp/attention_3f8ba7a.py 2048

Prints, for SmolLM2-135M's attention shapes (H = 9, H_kv = 3, D = 64, batch 1): prefill
attention of the old module (given by path) and of this tree at T tokens, with no statistics
(full), with column sums (H2O) and with the last 32 rows (SnapKV, KeepKV); SDPA's prefill with
the old bool mask against is_causal; and a bf16 decode step (batch 4, 4096 entries) on the
explicit path against SDPA with a bool mask. Min of 3 runs, old and new interleaved.
"""

import importlib.util
import sys
import time

import torch
import torch.nn.functional as F

from keepkv.attention import Needs, attend, block_causal_mask

torch.set_num_threads(1)


def best(fn, reps=3) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(old_path: str, length: int) -> None:
    spec = importlib.util.spec_from_file_location("old_attention", old_path)
    old = importlib.util.module_from_spec(spec)
    sys.modules["old_attention"] = old
    spec.loader.exec_module(old)
    query, keys, values = torch.randn(1, 9, length, 64), torch.randn(1, 3, length, 64), torch.randn(1, 3, length, 64)
    bias, mask = torch.zeros(1, 3, length), block_causal_mask(1, length, None, "cpu")
    for name, fields in (("full (no stats)", {}), ("colsum (h2o)", {"colsum": True}), ("window 32", {"window": 32})):
        times = {"old": [], "new": []}
        for _ in range(3):
            for label, fn, needs in (("old", old.attend, old.Needs(**fields)), ("new", attend, Needs(**fields))):
                times[label].append(best(lambda: fn(query, keys, values, bias, mask, 0.125, needs, True), 1))
        before, after = min(times["old"]), min(times["new"])
        print(f"prefill T={length} {name}: {before:.3f} -> {after:.3f} s per layer ({before / after:.2f}x)")
    masked = best(lambda: F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True))
    causal = best(lambda: F.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=True))
    print(f"prefill SDPA T={length}: bool mask {masked:.3f} s, is_causal {causal:.3f} s per layer")
    batch, size = 4, 4096
    query = torch.randn(batch, 9, 1, 64, dtype=torch.bfloat16)
    keys = torch.randn(batch, 3, size, 64, dtype=torch.bfloat16)
    bias, mask = torch.zeros(batch, 3, size), block_causal_mask(batch, 1, None, "cpu")
    explicit = best(lambda: attend(query, keys, keys, bias, mask, 0.125, binary_bias=False), 10)
    sdpa = best(lambda: attend(query, keys, keys, bias, mask, 0.125, binary_bias=True), 10)
    print(f"bf16 decode B={batch} S={size}: explicit {explicit * 1e3:.2f} ms, bool-mask SDPA {sdpa * 1e3:.2f} ms per layer")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2048)
