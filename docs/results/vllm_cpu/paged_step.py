"""Time keepkv.paged's decode step alone: 8 requests of 512 prompt tokens, SmolLM2-135M's
attention shapes (9 heads, 3 KV heads, D = 64, 30 layers), budget 0.1, blocks of 128, two
threads (the paged step itself runs on ``keepkv.paged.STEP_THREADS``).

    python docs/results/vllm_cpu/paged_step.py [method ...]    # default: snapkv window
    python docs/results/vllm_cpu/paged_step.py --requests 32 --prompt 1024 snapkv keepkv   # the bench's shapes

Each engine step builds one batch and runs PagedCompression.forward for every layer (its own
KV cache), as vLLM does. Prints the mean milliseconds per layer and decode step (over 30 steps
after 3 warm-up steps), three runs per method, and then the seconds of the first step (every
prompt, each in a group of its own, as in the engine) per prompt over the 30 layers.
"""

import argparse
import math
import time

import torch
from transformers import LlamaConfig

from keepkv.paged import PagedCompression

HEADS, KV_HEADS, HEAD_DIM, BLOCK, REQUESTS, PROMPT, LAYERS = 9, 3, 64, 128, 8, 512, 30
CONFIG = LlamaConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                     num_hidden_layers=LAYERS, intermediate_size=16, vocab_size=32)


def run(method: str, requests: int = REQUESTS, prompt: int = PROMPT) -> tuple[float, float]:
    """(milliseconds per layer and decode step, seconds of the prompts' step per prompt)."""
    generator = torch.Generator().manual_seed(0)
    paged = PagedCompression(CONFIG, method, 0.1)
    blocks = math.ceil(paged.capacity(prompt) / BLOCK)
    words = 2 * HEAD_DIM + paged.meta_words
    caches = [torch.randn(1 + requests * blocks, KV_HEADS, BLOCK, words, generator=generator) for _ in range(LAYERS)]
    table = torch.arange(1, 1 + requests * blocks, dtype=torch.int32).view(requests, blocks)

    def step(length: int, computed: int) -> None:
        tokens = requests * length
        query = torch.randn(tokens, HEADS, HEAD_DIM, generator=generator)
        key, value = (torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=generator) for _ in range(2))
        batch = paged.batch(list(range(0, tokens + 1, length)), [computed + length] * requests, table)
        for layer, kv_cache in enumerate(caches):
            paged.forward(kv_cache, query, key, value, batch, HEAD_DIM**-0.5, layer)

    start = time.perf_counter()
    step(prompt, 0)
    prefill = (time.perf_counter() - start) / requests
    for t in range(3):
        step(1, prompt + t)
    start = time.perf_counter()
    for t in range(3, 33):
        step(1, prompt + t)
    return (time.perf_counter() - start) / 30 / LAYERS * 1000, prefill


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("methods", nargs="*", default=["snapkv", "window"])
    parser.add_argument("--requests", type=int, default=REQUESTS, help=f"requests decoding together (default {REQUESTS})")
    parser.add_argument("--prompt", type=int, default=PROMPT, help=f"prompt tokens per request (default {PROMPT})")
    args = parser.parse_args()
    torch.set_num_threads(2)
    for method in args.methods:
        runs = [run(method, args.requests, args.prompt) for _ in range(3)]
        print(method, " ".join(f"{decode:.2f}" for decode, _ in runs), "ms per layer-step;",
              " ".join(f"{prefill:.2f}" for _, prefill in runs), "s per prompt's step")
