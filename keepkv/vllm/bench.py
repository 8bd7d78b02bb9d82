"""Throughput under memory pressure: stock vLLM (full cache) against keepkv methods, same KV bytes.

    python -m keepkv.vllm.bench --methods snapkv,window --budget 0.1 --full-requests 4 --json out.json

Every engine gets the KV bytes that hold ``--full-requests`` full-cache requests of the workload
(prompt + generated tokens), as a block count (keepkv's slots are a little larger: each also
holds its position, bias and score, so it gets fewer blocks). All requests are submitted at
once; the engine is stepped by hand to record how many run concurrently. Prompts are slices of
the Python standard library's sources, each request its own. Run in the serving venv.
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import math
import os
import sys
import tempfile
import time

BLOCK_SIZE = 128  # vLLM's CPU default


def stdlib_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens, each from another stdlib source file."""
    root = os.path.dirname(os.__file__)
    prompts = []
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        ids = tokenizer(open(path, encoding="utf-8", errors="replace").read()).input_ids
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == count:
            return prompts
    raise SystemExit(f"keepkv.vllm.bench: only {len(prompts)} stdlib files have {length} tokens; lower --requests")


def run_engine(model_dir: str, prompts, gen_len: int, blocks: int, keepkv: dict | None) -> dict:
    """Serve every prompt at once with ``blocks`` KV blocks; tokens/s and peak concurrency."""
    import vllm

    args = dict(
        model=model_dir, dtype="float32", max_model_len=len(prompts[0]) + gen_len, enforce_eager=True,
        enable_prefix_caching=False, enable_chunked_prefill=False, num_gpu_blocks_override=blocks, seed=0,
        block_size=BLOCK_SIZE,
        max_num_seqs=256,
    )
    args["max_num_batched_tokens"] = args["max_model_len"]
    if keepkv:
        args["additional_config"] = {"keepkv": keepkv}
    llm = vllm.LLM(**args)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    params = vllm.SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    peak, steps, generated = 0, 0, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                generated += len(output.outputs[0].token_ids)
        peak = max(peak, len(scheduler.running))
        steps += 1
    seconds = time.perf_counter() - start
    layers = llm.llm_engine.model_config.hf_config.num_hidden_layers
    block_bytes = layers * scheduler.kv_cache_manager.coordinator.single_type_managers[0].kv_cache_spec.page_size_bytes
    del llm, engine, scheduler
    gc.collect()
    return {
        "method": keepkv["method"] if keepkv else "full (stock vLLM)",
        "blocks": blocks, "kv_bytes": blocks * block_bytes, "peak_running": peak, "steps": steps,
        "seconds": round(seconds, 2), "generated_tokens": generated, "tokens_per_s": round(generated / seconds, 2),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m keepkv.vllm.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="snapkv,window,streamingllm", help="comma-separated keepkv methods")
    parser.add_argument("--budget", type=float, default=0.1, help="fraction of each prompt kept (default 0.1)")
    parser.add_argument("--requests", type=int, default=32, help="requests submitted at once (default 32)")
    parser.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens per request (default 1024)")
    parser.add_argument("--gen-len", type=int, default=128, help="generated tokens per request (default 128)")
    parser.add_argument("--full-requests", type=int, default=4, help="full-cache requests the KV memory holds (default 4)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    for name in ("requests", "prompt_len", "gen_len", "full_requests"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.budget <= 1:
        parser.error("--budget must be in (0, 1]")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler is read in-process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import keepkv
    from keepkv.paged import PagedCompression

    model, tokenizer = keepkv.load_model()
    model_dir = tempfile.mkdtemp(prefix="keepkv-vllm-")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    prompts = stdlib_prompts(tokenizer, args.requests, args.prompt_len)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    stock_slot = 2 * head_dim * 4  # fp32 key + value per head
    full_blocks = args.full_requests * math.ceil((args.prompt_len + args.gen_len) / BLOCK_SIZE)
    results = [run_engine(model_dir, prompts, args.gen_len, full_blocks, None)]
    for method in args.methods.split(","):
        paged = PagedCompression(config, method, args.budget)
        slot = paged.content_bytes(head_dim, model.dtype)
        blocks = full_blocks * stock_slot // slot  # the same bytes
        results.append(run_engine(model_dir, prompts, args.gen_len, blocks, {"method": method, "budget": args.budget}))
        results[-1]["tokens_per_s_vs_full"] = round(results[-1]["tokens_per_s"] / results[0]["tokens_per_s"], 2)
    report = {"settings": vars(args), "results": results}
    for row in results:
        print(json.dumps(row), file=sys.stdout, flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
