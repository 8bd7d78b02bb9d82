"""Seconds for one long request (7,000 prompt tokens from the stdlib's sources + 32 generated),
stock vLLM against keepkv methods, each engine with memory to spare (serving venv):

    .venv-vllm/bin/python benchmarks/vllm_cpu/long_request.py [method ...]   # default: keepkv snapkv

Prints one JSON line per engine (stock first): seconds from submission to the last token, and
the ratio to stock's. Budget 0.1; fp32; blocks of 128; prefix caching and chunked prefill off.
"""

import json
import os
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT, GENERATED = 7000, 32


def prompt_ids(tokenizer) -> list[int]:
    import glob

    ids: list[int] = []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
        ids += tokenizer(open(path, encoding="utf-8", errors="replace").read()).input_ids
        if len(ids) >= PROMPT:
            return ids[:PROMPT]
    raise SystemExit("not enough stdlib tokens")


def seconds(model_dir: str, prompt: list[int], keepkv: dict | None) -> float:
    import vllm

    args = dict(model=model_dir, dtype="float32", max_model_len=PROMPT + GENERATED, enforce_eager=True,
                enable_prefix_caching=False, enable_chunked_prefill=False, seed=0, block_size=128,
                max_num_batched_tokens=PROMPT + GENERATED)
    if keepkv:
        args["additional_config"] = {"keepkv": keepkv}
    llm = vllm.LLM(**args)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=GENERATED, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - start


if __name__ == "__main__":
    import keepkv

    model, tokenizer = keepkv.load_model()
    model_dir = tempfile.mkdtemp(prefix="keepkv-vllm-")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    prompt = prompt_ids(tokenizer)
    del model
    stock = None
    for method in [None, *(sys.argv[1:] or ["keepkv", "snapkv"])]:
        took = seconds(model_dir, prompt, {"method": method, "budget": 0.1} if method else None)
        stock = stock or took
        print(json.dumps({"method": method or "full (stock vLLM)", "prompt_tokens": PROMPT, "generated": GENERATED,
                          "seconds": round(took, 2), "vs_stock": round(took / stock, 2)}), flush=True)
