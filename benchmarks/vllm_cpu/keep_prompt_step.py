"""Time keepkv.paged's decode step with prompts kept whole (keep_prompt), and where it goes:
16 requests of 1,056 prompt tokens (the serving bench's shared-prefix shape), 64 generated entries
kept, SmolLM2-135M's attention shapes (9 heads, 3 KV heads, D = 64), blocks of 128, 4 layers,
two threads.

    python benchmarks/vllm_cpu/keep_prompt_step.py [method] [--profile]

Prints the mean milliseconds per layer and decode step over 10 steps taken past the budget (every
step compresses), and with ``--profile`` the ATen operations of 3 more steps by self CPU time.
"""

import argparse
import math
import time

import torch
from transformers import LlamaConfig

from keepkv.paged import PagedCompression

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 128, 4
REQUESTS, PROMPT, GENERATED = 16, 1056, 64
CONFIG = LlamaConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                     num_hidden_layers=30, intermediate_size=16, vocab_size=32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("method", nargs="?", default="snapkv")
    parser.add_argument("--profile", action="store_true", help="also print the ATen operations of 3 steps")
    args = parser.parse_args()
    torch.set_num_threads(2)
    generator = torch.Generator().manual_seed(0)
    paged = PagedCompression(CONFIG, args.method, GENERATED, keep_prompt=True)
    blocks = math.ceil(paged.capacity(PROMPT) / BLOCK)
    words = 2 * HEAD_DIM + paged.meta_words
    caches = [torch.randn(1 + REQUESTS * blocks, KV_HEADS, BLOCK, words, generator=generator) for _ in range(LAYERS)]
    table = torch.tensor([[1 + r * blocks + j for j in range(blocks)] for r in range(REQUESTS)], dtype=torch.int32)

    def step(length: int, computed: int, prefilling: bool) -> None:
        starts = list(range(0, REQUESTS * length + 1, length))
        query = torch.randn(starts[-1], HEADS, HEAD_DIM, generator=generator)
        key, value = (torch.randn(starts[-1], KV_HEADS, HEAD_DIM, generator=generator) for _ in range(2))
        batch = paged.batch(starts, [computed + length] * REQUESTS, table, [prefilling] * REQUESTS, block_size=BLOCK)
        for layer, kv_cache in enumerate(caches):
            paged.forward(kv_cache, query, key, value, batch, HEAD_DIM**-0.5, layer)

    step(PROMPT, 0, True)
    for t in range(GENERATED + 5):  # past the budget: every step then compresses
        step(1, PROMPT + t, False)
    start, count = time.perf_counter(), 10
    for t in range(GENERATED + 5, GENERATED + 5 + count):
        step(1, PROMPT + t, False)
    print(f"{args.method}: {(time.perf_counter() - start) / count / LAYERS * 1000:.2f} ms per layer-step")
    if args.profile:
        from torch.profiler import profile

        with profile() as prof:
            for t in range(GENERATED + 15, GENERATED + 18):
                step(1, PROMPT + t, False)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
