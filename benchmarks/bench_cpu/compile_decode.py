"""Method time per decode step, eager vs ``CompressedCache(compile=True)``, interleaved in one process.

SmolLM2-135M shapes with random weights, 4 layers, one 4096-token prompt batch of 4 (prefilled
once, then forked), budget 0.1, one thread; each fork decodes 48 steps, the first 16 untimed
(compilation happens there). Times the method's own ``observe`` + ``compress`` per step.

    python benchmarks/bench_cpu/compile_decode.py > docs/record/data/bench_cpu/compile_decode.txt
"""

import statistics
import time

import torch

import keepkv
from keepkv.attention import Needs
from keepkv.bench.configs import build_config, random_model
from keepkv.methods import get_method

METHODS = ["h2o", "snapkv", "keepkv"]
PROMPT, BATCH, WARM, TIMED, REPEATS = 4096, 4, 16, 32, 3

torch.set_num_threads(1)
model = random_model(build_config("smollm2-135m", layers=4))
keepkv.enable(model)
ids = torch.randint(0, model.config.vocab_size, (BATCH, PROMPT), generator=torch.Generator().manual_seed(0))
mask = torch.ones_like(ids)
record = keepkv.CompressedCache(model.config, "full", record=Needs.union([get_method(m).needs(True) for m in METHODS]))
with torch.no_grad():
    first = model(input_ids=ids, attention_mask=mask, past_key_values=record).logits[:, -1].argmax(-1, keepdim=True)


def method_ms_per_step(name: str, compile: bool) -> float:
    cache = record.fork(name, 0.1)
    cache.compile = compile
    spent = [0.0]
    for hook in ("observe", "compress"):
        inner = getattr(cache.method, hook)

        def timed(*args, inner=inner):
            start = time.perf_counter()
            inner(*args)
            spent[0] += time.perf_counter() - start

        setattr(cache.method, hook, timed)
    token, seen = first, mask
    with torch.no_grad():
        for step in range(WARM + TIMED):
            if step == WARM:
                spent[0] = 0.0
            seen = torch.cat([seen, torch.ones_like(token)], -1)
            token = model(input_ids=token, attention_mask=seen, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
    return 1000 * spent[0] / TIMED


print(f"method ms per decode step (observe + compress, 4 layers, B={BATCH}, prompt {PROMPT}, budget 0.1)")
for name in METHODS:
    runs = {False: [], True: []}
    for _ in range(REPEATS):
        for compile in (False, True):
            runs[compile].append(method_ms_per_step(name, compile))
    eager, fused = statistics.median(runs[False]), statistics.median(runs[True])
    print(f"{name:8s} eager {eager:6.2f}  compiled {fused:6.2f}  ratio {fused / eager:.2f}  "
          f"(runs eager {[round(x, 2) for x in runs[False]]}, compiled {[round(x, 2) for x in runs[True]]})", flush=True)
