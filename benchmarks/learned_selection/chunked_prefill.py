"""Prefill cost and peak cache of a long prompt on the embedded model: the learned selection read
whole or in chunks (compressed chunk by chunk), against snapkv, kvzip and the full cache.

    python benchmarks/learned_selection/chunked_prefill.py --tokens 4096 --chunk 512 --budget 0.1

Prints, per method and reading, the seconds of ``keepkv.compress`` (prefill + compression; kvzip's
second pass included) and the cache's peak during the prefill as a share of the full cache's
bytes (every layer's uncompressed prompt). ``--json`` writes the rows.
"""

import argparse
import json
import time

import torch

import keepkv
from keepkv.eval.tasks import prose_corpus


def document(tokenizer, tokens: int) -> str:
    """About ``tokens`` tokens of pydoc prose (the chat template adds a few)."""
    text = prose_corpus()
    ids = tokenizer(text[: tokens * 8])["input_ids"][: tokens - 40]
    return tokenizer.decode(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--budget", type=float, default=0.1)
    parser.add_argument("--methods", default="snapkv+selection=learned,snapkv+selection=learned+budgets=layers,snapkv,kvzip")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = keepkv.load_model()
    text = document(tokenizer, args.tokens)
    full = keepkv.compress(model, tokenizer, text, "full", 1.0)
    full_bytes = full.nbytes()
    prompt = full.layers[0].seen
    rows = []
    for method in args.methods.split(","):
        for chunk in (None, args.chunk):
            start = time.perf_counter()
            cache = keepkv.compress(model, tokenizer, text, method, args.budget, prefill_chunk=chunk)
            seconds = time.perf_counter() - start
            row = {"method": method, "chunk": chunk, "prompt_tokens": prompt, "seconds": round(seconds, 2),
                   "peak_share": round(cache.prefill_peak_bytes / full_bytes, 3),
                   "kept_share": round(cache.nbytes() / full_bytes, 3), "chunk_by_chunk": cache.compresses_chunks}
            rows.append(row)
            print(f"{method:<28} chunk {str(chunk):>5}: {seconds:6.2f} s, peak {row['peak_share']:.3f} of the full "
                  f"cache, kept {row['kept_share']:.3f}{' (compressed chunk by chunk)' if cache.compresses_chunks else ''}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"settings": vars(args), "full_cache_bytes": full_bytes, "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
