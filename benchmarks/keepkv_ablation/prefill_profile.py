"""One prefill per method on random weights of SmolLM2's shape (8 layers, one thread), timed twice
after a warm-up, then a cProfile of one more prefill of the last method named, restricted to
keepkv's modules: where a method's prompt-end work goes.

    python benchmarks/keepkv_ablation/prefill_profile.py BATCH PROMPT_LEN snapkv,keepkv keepkv
"""

import cProfile
import io
import pstats
import sys
import time

import torch

import keepkv
from keepkv.bench.configs import build_config, random_model

torch.set_num_threads(1)
batch, length, methods, profiled = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4]
config = build_config("smollm2-135m")
config.num_hidden_layers = 8
model = random_model(config)
keepkv.enable(model)
ids = torch.randint(0, config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))


def prefill(method: str) -> None:
    cache = keepkv.CompressedCache(model.config, method, 0.1)
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, logits_to_keep=1)


for method in methods:
    prefill(method)  # warm-up
for _ in range(2):
    for method in methods:
        started = time.perf_counter()
        prefill(method)
        print(f"{method} {time.perf_counter() - started:.3f} s")
profile = cProfile.Profile()
profile.enable()
prefill(profiled)
profile.disable()
text = io.StringIO()
pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats("keepkv/(methods|merging|step|store|cache|attention)", 35)
print(text.getvalue())
