"""Time keepkv.paged's decode step alone: 8 requests of 512 prompt tokens, SmolLM2-135M's
attention shapes (9 heads, 3 KV heads, D = 64, 30 layers), budget 0.1, blocks of 128, two
threads (the paged step itself runs on ``keepkv.paged.STEP_THREADS``).

    python benchmarks/vllm_cpu/paged_step.py [method ...]    # default: snapkv window
    python benchmarks/vllm_cpu/paged_step.py --requests 32 --prompt 1024 snapkv keepkv   # the bench's shapes
    python benchmarks/vllm_cpu/paged_step.py --requests 32 --prompt 1024 --ragged snapkv keepkv
                                                  # prompts of 512..1,536 tokens: unequal budgets

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


def run(method: str, requests: int = REQUESTS, prompt: int = PROMPT, ragged: bool = False) -> tuple[float, float]:
    """(milliseconds per layer and decode step, seconds of the prompts' step per prompt).
    ``ragged``: prompts spread evenly over prompt/2 .. 3·prompt/2 tokens instead of all ``prompt``."""
    generator = torch.Generator().manual_seed(0)
    paged = PagedCompression(CONFIG, method, 0.1)
    prompts = [prompt // 2 + (prompt * i) // max(1, requests - 1) for i in range(requests)] if ragged else [prompt] * requests
    blocks = [math.ceil(paged.capacity(length) / BLOCK) for length in prompts]
    words = 2 * HEAD_DIM + paged.meta_words
    caches = [torch.randn(1 + sum(blocks), KV_HEADS, BLOCK, words, generator=generator) for _ in range(LAYERS)]
    first = [1 + sum(blocks[:i]) for i in range(requests)]
    table = torch.tensor([[f + j if j < n else 0 for j in range(max(blocks))] for f, n in zip(first, blocks)], dtype=torch.int32)

    def step(lengths: list[int], computed: list[int]) -> None:
        starts = [0]
        for length in lengths:
            starts.append(starts[-1] + length)
        query = torch.randn(starts[-1], HEADS, HEAD_DIM, generator=generator)
        key, value = (torch.randn(starts[-1], KV_HEADS, HEAD_DIM, generator=generator) for _ in range(2))
        batch = paged.batch(starts, [done + length for done, length in zip(computed, lengths)], table)
        for layer, kv_cache in enumerate(caches):
            paged.forward(kv_cache, query, key, value, batch, HEAD_DIM**-0.5, layer)

    start = time.perf_counter()
    step(prompts, [0] * requests)
    prefill = (time.perf_counter() - start) / requests
    for t in range(3):
        step([1] * requests, [length + t for length in prompts])
    start = time.perf_counter()
    for t in range(3, 33):
        step([1] * requests, [length + t for length in prompts])
    return (time.perf_counter() - start) / 30 / LAYERS * 1000, prefill


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("methods", nargs="*", default=["snapkv", "window"])
    parser.add_argument("--requests", type=int, default=REQUESTS, help=f"requests decoding together (default {REQUESTS})")
    parser.add_argument("--prompt", type=int, default=PROMPT, help=f"prompt tokens per request (default {PROMPT})")
    parser.add_argument("--ragged", action="store_true", help="prompts of prompt/2 .. 3·prompt/2 tokens")
    args = parser.parse_args()
    torch.set_num_threads(2)
    for method in args.methods:
        runs = [run(method, args.requests, args.prompt, args.ragged) for _ in range(3)]
        print(method, " ".join(f"{decode:.2f}" for decode, _ in runs), "ms per layer-step;",
              " ".join(f"{prefill:.2f}" for _, prefill in runs), "s per prompt's step")
