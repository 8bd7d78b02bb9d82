"""Question after the context (compress once): a context compressed whole (keepkv.compress) against
the same context read in chunks of N tokens, each compressed alone to K entries per layer and head
(CompressedCache(decoding="keep_prompt").start_prefill(mask, chunk_keep=(N, K)); K/N = the budget),
the question and answer appended uncompressed in both; the whole context keeps as many entries as
the chunks hold (their shorter last block is kept whole). Dev seed 1001.

    OMP_NUM_THREADS=1 python quality.py METHOD [--samples 16] [--chunk 256] [--budget 0.1] [--out PATH]
"""
import argparse, json, math, time

import torch

import keepkv
from keepkv.cache import CompressedCache
from keepkv.eval.tasks import make_suite
from keepkv.generation import _run, context_and_question_ids

SUITES = [("needle", {}), ("passkey", {}), ("needle", {"haystack": "prose", "digits": 5})]


@torch.inference_mode()
def chunked_context(model, tokenizer, context, method, chunk, kept):
    cache = CompressedCache(model.config, method, 100_000, decoding="keep_prompt", compress_once=True)
    cache.method.prepare(model)
    head, _ = context_and_question_ids(tokenizer, context, "", True)
    ids = torch.tensor([head])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    cache.start_prefill(inputs["attention_mask"], chunk_keep=(chunk, kept))
    _run(model, tokenizer, cache, inputs, 0, False, chunk, True)
    cache.context_ids, cache.context_chat = head, True
    return cache


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("method")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--budget", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=1001)
    parser.add_argument("--out")
    args = parser.parse_args()
    model, tokenizer = keepkv.load_model()
    kept = max(1, round(args.chunk * args.budget))
    rows = []
    for suite, variant in SUITES:
        samples = make_suite(suite, args.samples, 1024, args.seed, lambda text: len(tokenizer(text).input_ids), **variant)
        for sample in samples:
            row = {"suite": suite + "".join(f"+{k}={v}" for k, v in variant.items()), "id": sample.id}
            for mode in ("chunks", "whole"):  # whole: as many entries as the chunks hold (their tail is kept whole)
                began = time.perf_counter()
                if mode == "whole":
                    cache = keepkv.compress(model, tokenizer, sample.context, args.method, row["chunks"]["entries"])
                else:
                    cache = chunked_context(model, tokenizer, sample.context, args.method, args.chunk, kept)
                entries = int(cache.layers[0].live()[0].sum(-1).max())
                answer = keepkv.generate(model, tokenizer, [sample.question], past_key_values=cache, max_new_tokens=16,
                                         answer_prefix=sample.answer_prefix)[0].answer
                row[mode] = {"right": all(a in answer for a in sample.answers), "entries": entries,
                             "seconds": round(time.perf_counter() - began, 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {}
    for row in rows:
        cell = summary.setdefault(row["suite"], {"whole": 0, "chunks": 0, "n": 0, "whole_only": 0, "chunks_only": 0})
        cell["n"] += 1
        for mode in ("whole", "chunks"):
            cell[mode] += row[mode]["right"]
        cell["whole_only"] += row["whole"]["right"] and not row["chunks"]["right"]
        cell["chunks_only"] += row["chunks"]["right"] and not row["whole"]["right"]
    print(json.dumps({"method": args.method, "chunk": args.chunk, "kept": kept, "budget": args.budget, "summary": summary}))
    if args.out:
        json.dump({"args": vars(args), "kept": kept, "rows": rows, "summary": summary}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
