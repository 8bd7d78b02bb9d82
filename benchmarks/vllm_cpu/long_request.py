"""Seconds for one long request (by default 7,000 prompt tokens from the stdlib's sources + 32
generated), stock vLLM against keepkv methods, each engine with memory to spare (serving venv):

    .venv-vllm/bin/python benchmarks/vllm_cpu/long_request.py [method ...]   # default: keepkv snapkv
    .venv-vllm/bin/python benchmarks/vllm_cpu/long_request.py --prompt 1500 --generated 64 --rounds 2 snapkv keepkv

Prints one JSON line per engine and round (stock first in each round): seconds from submission
to the last token, and the ratio to that round's stock. Budget 0.1; fp32; blocks of 128; prefix
caching off; chunked prefill as vLLM's default (on) unless ``--no-chunked-prefill``.
"""

import json
import os
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

def prompt_ids(tokenizer, length: int) -> list[int]:
    import glob

    ids: list[int] = []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
        ids += tokenizer(open(path, encoding="utf-8", errors="replace").read()).input_ids
        if len(ids) >= length:
            return ids[:length]
    raise SystemExit("not enough stdlib tokens")


def seconds(model_dir: str, prompt: list[int], generated: int, keepkv: dict | None, chunked: bool) -> float:
    import gc

    import vllm

    args = dict(model=model_dir, dtype="float32", max_model_len=len(prompt) + generated, enforce_eager=True,
                enable_prefix_caching=False, enable_chunked_prefill=chunked, seed=0, block_size=128)
    if not chunked:
        args["max_num_batched_tokens"] = len(prompt) + generated
    if keepkv:
        args["additional_config"] = {"keepkv": keepkv}
    llm = vllm.LLM(**args)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=generated, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    took = time.perf_counter() - start
    del llm
    gc.collect()
    return took


if __name__ == "__main__":
    import argparse

    import keepkv

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("methods", nargs="*", default=["keepkv", "snapkv"])
    parser.add_argument("--prompt", type=int, default=7000, help="prompt tokens (default 7000)")
    parser.add_argument("--generated", type=int, default=32, help="generated tokens (default 32)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds, each stock then every method (default 1)")
    parser.add_argument("--no-chunked-prefill", dest="chunked", action="store_false")
    args = parser.parse_args()
    from keepkv.checks import as_int

    try:  # before the model loads
        for name in ("prompt", "generated", "rounds"):
            as_int(f"--{name}", getattr(args, name), low=1)
    except ValueError as error:
        parser.error(str(error))
    model, tokenizer = keepkv.load_model()
    model_dir = tempfile.mkdtemp(prefix="keepkv-vllm-")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    prompt = prompt_ids(tokenizer, args.prompt)
    del model
    for round_ in range(args.rounds):
        stock = None
        for method in [None, *args.methods]:
            took = seconds(model_dir, prompt, args.generated, {"method": method, "budget": 0.1} if method else None,
                           args.chunked)
            stock = stock or took
            print(json.dumps({"round": round_, "method": method or "full (stock vLLM)", "prompt_tokens": args.prompt,
                              "generated": args.generated, "chunked_prefill": args.chunked, "seconds": round(took, 2),
                              "vs_stock": round(took / stock, 2)}), flush=True)
