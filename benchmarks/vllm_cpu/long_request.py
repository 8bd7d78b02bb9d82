"""Seconds for one long request (by default 7,000 prompt tokens from the stdlib's sources + 32
generated), stock vLLM against keepkv methods, each engine with memory to spare (serving venv):

    .venv-vllm/bin/python benchmarks/vllm_cpu/long_request.py [method ...]   # default: keepkv snapkv
    .venv-vllm/bin/python benchmarks/vllm_cpu/long_request.py --prompt 1500 --generated 64 --rounds 2 snapkv keepkv

Prints one JSON line per engine and round (stock first in each round): seconds from submission
to the last token (each engine serves the request once untimed, to warm up, then ``--repeats``
times: their median), and the ratio to that round's stock; then each method's median ratio over
the rounds. Budget 0.1; fp32; blocks of 128; prefix
caching off; chunked prefill as vLLM's default (on) unless ``--no-chunked-prefill``.
"""

import json
import os
import statistics
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


def seconds(model_dir: str, prompt: list[int], generated: int, keepkv: dict | None, chunked: bool,
            repeats: int) -> float:
    """The median of ``repeats`` timed runs of the request, after one untimed run on the same engine."""
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
    times = []
    for _ in range(1 + repeats):
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    took = statistics.median(times[1:])
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
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per engine after an untimed one, their median reported (default 3)")
    parser.add_argument("--no-chunked-prefill", dest="chunked", action="store_false")
    args = parser.parse_args()
    from keepkv.checks import as_int

    try:  # before the model loads
        for name in ("prompt", "generated", "rounds", "repeats"):
            as_int(f"--{name}", getattr(args, name), low=1)
    except ValueError as error:
        parser.error(str(error))
    model, tokenizer = keepkv.load_model()
    model_dir = tempfile.mkdtemp(prefix="keepkv-vllm-")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    prompt = prompt_ids(tokenizer, args.prompt)
    del model
    ratios = {method: [] for method in args.methods}
    for round_ in range(args.rounds):
        stock = None
        for method in [None, *args.methods]:
            took = seconds(model_dir, prompt, args.generated, {"method": method, "budget": 0.1} if method else None,
                           args.chunked, args.repeats)
            stock = stock or took
            if method:
                ratios[method].append(took / stock)
            print(json.dumps({"round": round_, "method": method or "full (stock vLLM)", "prompt_tokens": args.prompt,
                              "generated": args.generated, "chunked_prefill": args.chunked, "seconds": round(took, 2),
                              "vs_stock": round(took / stock, 2)}), flush=True)
    for method, values in ratios.items():
        print(json.dumps({"method": method, "rounds": args.rounds, "median_vs_stock": round(statistics.median(values), 3)}))
