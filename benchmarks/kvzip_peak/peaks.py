"""KVzip's reconstruction pass: its peak cache against a full cache of the same prompt, one run per
length, no warm-up (the memory figures of ``keepkv bench --reconstruction``, from the same
functions, without its timed repetitions). Run on another tree's keepkv with PYTHONPATH to compare.

    python benchmarks/kvzip_peak/peaks.py OUT.json 256 1024 2048 8192
"""

import json
import sys

import torch

import keepkv
from keepkv.bench.reconstruction import full_cache_bytes, measure, prose_ids

torch.set_num_threads(2)
model, tokenizer = keepkv.load_model()
rows = []
for length in map(int, sys.argv[2:]):
    ids = prose_ids(tokenizer, length)
    full = full_cache_bytes(model, ids)
    run = measure(model, tokenizer, "kvzip", ids)
    rows.append({"tokens": length, "full_mib": full / 2**20, "peak_mib": run["peak_cache_bytes"] / 2**20,
                 "peak_to_full": run["peak_cache_bytes"] / full, "prefill_s": run["prefill_s"], "pass_s": run["pass_s"]})
    print(json.dumps(rows[-1]), flush=True)
with open(sys.argv[1], "w") as handle:
    json.dump({"keepkv": keepkv.__file__, "rows": rows}, handle, indent=1)
