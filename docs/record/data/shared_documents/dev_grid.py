"""The dev grid through vLLM with --share-prefix: each prompt's answer when its request reads and
compresses its document itself (a cold engine cache), against its answer when the same prompt
comes again and finds the compressed chunks in the prefix cache. Dev seed 1001, question after
the context, 1,024-token contexts, 16 greedy tokens.

    .venv-vllm/bin/python dev_grid.py [--samples 16] [--share 2] [--budget 64] [--method snapkv] [--out PATH]
"""
import argparse, json, os, tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import keepkv
import keepkv.vllm
from keepkv.eval.tasks import make_suite
from keepkv.generation import context_and_question_ids

SUITES = [("needle", {}), ("passkey", {}), ("needle", {"haystack": "prose", "digits": 5})]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--share", type=int, default=2)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--method", default="snapkv")
    parser.add_argument("--seed", type=int, default=1001)
    parser.add_argument("--out")
    args = parser.parse_args()
    import vllm

    model, tokenizer = keepkv.load_model()
    model_dir = tempfile.mkdtemp(prefix="keepkv-dev-grid-")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    llm = vllm.LLM(model_dir, dtype="float32", max_model_len=2048, enforce_eager=True, enable_prefix_caching=True,
                   seed=0, additional_config=keepkv.vllm.config(args.method, args.budget, share_prefix=args.share))
    params = vllm.SamplingParams(temperature=0.0, max_tokens=16)
    rows = []
    for suite, variant in SUITES:
        samples = make_suite(suite, args.samples, 1024, args.seed, lambda text: len(tokenizer(text).input_ids), **variant)
        for sample in samples:
            head, tail = context_and_question_ids(tokenizer, sample.context, sample.question, True, sample.answer_prefix)
            prompt = {"prompt_token_ids": head + tail}
            alone, cached = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
            row = {"suite": suite + "".join(f"+{k}={v}" for k, v in variant.items()), "id": sample.id,
                   "prompt_tokens": len(head) + len(tail), "hit_tokens": [alone.num_cached_tokens, cached.num_cached_tokens],
                   "equal": list(alone.outputs[0].token_ids) == list(cached.outputs[0].token_ids),
                   "right": [all(a in out.outputs[0].text for a in sample.answers) for out in (alone, cached)]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {}
    for row in rows:
        cell = summary.setdefault(row["suite"], {"n": 0, "equal": 0, "right_alone": 0, "right_cached": 0})
        cell["n"] += 1
        cell["equal"] += row["equal"]
        cell["right_alone"] += row["right"][0]
        cell["right_cached"] += row["right"][1]
    print(json.dumps({"args": vars(args), "summary": summary}))
    if args.out:
        json.dump({"args": vars(args), "rows": rows, "summary": summary}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
