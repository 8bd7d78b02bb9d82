"""Throughput under memory pressure: stock vLLM (full cache) against keepkv methods, same KV bytes.

    python -m keepkv.vllm.bench --methods snapkv,window --budget 0.1 --full-requests 4 --json out.json

Every engine gets the KV bytes that hold ``--full-requests`` full-cache requests of the workload
(prompt + generated tokens), as a block count (keepkv's slots are a little larger: each also
holds its position, bias and score, so it gets fewer blocks). All requests are submitted at
once; the engine is stepped by hand to record how many run concurrently. Prompts are slices of
the Python standard library's sources, each request its own; ``--ragged`` spreads their lengths
over half to 1.5 times ``--prompt-len`` (a serving mix: unequal budgets in one batch). Run in
the serving venv.

With ``--shared-prefix N`` every prompt starts with the same N tokens (a shared system prompt or
document), prefix caching is on for every engine (stock vLLM shares those blocks too), and the
methods run with ``--keep-prompt`` (prompts kept whole, ``--budget`` generated entries kept)::

    python -m keepkv.vllm.bench --shared-prefix 1024 --prompt-len 32 --requests 16 --gen-len 512 \
        --full-requests 2 --methods snapkv,keepkv --budget 64

With ``--documents D`` there are D shared prefixes (documents) of N tokens instead of one, and
request i starts with document i mod D (submitted interleaved: 1, 2, ..., D, 1, 2, ...), the
"shared documents" shape: each engine also reports the prompt tokens it computed (a count, steady
from run to run). ``--prompt-modes keep,compress`` runs each method twice: keeping prompts whole
(prefix caching on) and compressing each request's prompt to ``--prompt-budget`` (its document
read again by every request: keepkv's prompt-compressing mode turns prefix caching off); ``share``
compresses each prompt chunk by chunk (chunks of ``--share-blocks`` blocks, each kept as one block)
and shares the compressed chunks through the prefix cache (``keepkv serve --share-prefix``)::

    python -m keepkv.vllm.bench --shared-prefix 4096 --documents 8 --prompt-len 32 --requests 64 \
        --gen-len 64 --full-requests 2 --methods snapkv --budget 64 --prompt-modes keep,compress,share

With ``--tensor-parallel-size N`` every engine runs N ranks, each with the blocks above for its
share of the heads; each engine's start time (building ``LLM``) is reported beside its tokens/s.

Each engine also reports the most KV memory its requests held at once (``peak KV in use``, MiB
on all ranks: the blocks taken from the pool, whichever group of layers holds them). With
``--chunk-tokens N`` vLLM's chunked prefill reads at most N tokens a step (its
``max_num_batched_tokens``), so a long prompt comes in chunks; a method that compresses a prompt
chunk by chunk (the learned selection) then holds its budget plus one chunk while it reads::

    python -m keepkv.vllm.bench --requests 1 --prompt-len 4096 --gen-len 16 --full-requests 2 \
        --chunk-tokens 512 --methods snapkv,snapkv+selection=learned --budget 0.1
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import math
import os
import random
import sys
import tempfile
import time

BLOCK_SIZE = 128  # vLLM's CPU default
PROGRESS_EVERY = 10.0  # seconds between progress lines of one engine
COLUMNS = [("engine", "engine"), ("KV blocks", "blocks"), ("peak concurrent requests", "peak_running"),
           ("scheduler steps", "steps"), ("tokens/s", "tokens_per_s"), ("vs stock", "tokens_per_s_vs_full")]
PEAK_KV = ("peak KV in use (MiB)", "peak_kv_mib")
START = ("start (s)", "start_seconds")
COMPUTED = ("prompt tokens computed", "prompt_tokens_computed")
FIRST_TOKEN = ("first token on a cached document (ms)", "first_token_ms")
PROBES = 5  # --documents: one request that reads document 0, then 4 timed
PROMPT_MODES = ("keep", "compress", "share")


def prompt_lengths(count: int, length: int, ragged: bool) -> list[int]:
    """Tokens of each of ``count`` prompts: ``length`` each, or (``ragged``) spread evenly over
    length/2 .. 3·length/2, in a shuffled order (a fixed one), so their mean is about ``length``."""
    if not ragged:
        return [length] * count
    spread = [max(1, length // 2 + (length * i) // max(1, count - 1)) for i in range(count)]
    random.Random(0).shuffle(spread)
    return spread


def interleaved(documents: int, requests: int) -> list[int]:
    """The document each of ``requests`` requests asks about, submitted interleaved over ``documents``:
    0, 1, ..., documents - 1, 0, 1, ..."""
    return [i % documents for i in range(requests)]


def prompt_tokens_computed(output, requests: dict) -> int:
    """Prompt tokens a scheduler step (vLLM's ``SchedulerOutput``) computes: each scheduled request's
    tokens that fall in its prompt (``requests``: the scheduler's, id -> request with its
    ``num_prompt_tokens``), past what it had computed or found in the prefix cache. A preempted
    request's prompt read again counts again."""
    done = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
    cached = output.scheduled_cached_reqs
    done.update(zip(cached.req_ids, cached.num_computed_tokens))
    return sum(max(0, min(count, requests[request].num_prompt_tokens - done[request]))
               for request, count in output.num_scheduled_tokens.items())


def stdlib_prompts(tokenizer, lengths: list[int]) -> list[list[int]]:
    """One prompt of each of ``lengths`` tokens, each from another stdlib source file."""
    root = os.path.dirname(os.__file__)
    prompts = []
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        ids = tokenizer(open(path, encoding="utf-8", errors="replace").read()).input_ids
        if len(ids) >= max(lengths):
            prompts.append(ids[: lengths[len(prompts)]])
        if len(prompts) == len(lengths):
            return prompts
    raise SystemExit(f"keepkv.vllm.bench: only {len(prompts)} stdlib files have {max(lengths)} tokens; lower --requests")


def run_engine(model_dir: str, prompts, gen_len: int, blocks: int, keepkv: dict | None, progress=None,
               chunked_prefill: bool = True, prefix_caching: bool = False, tensor_parallel_size: int = 1,
               probes=None, repeats: int = 1, block_size: int = BLOCK_SIZE, chunk_tokens: int | None = None) -> dict:
    """Serve every prompt at once with ``blocks`` KV blocks of ``block_size`` slots (on each rank);
    the engine's start time, tokens/s and peak concurrency. ``progress(finished, total, generated, seconds)`` is called every
    few seconds while it runs. ``chunked_prefill``: vLLM's chunked prefill (its default), with its
    CPU default of tokens per step; ``tensor_parallel_size``: ranks, each a process holding its share
    of the heads. ``probes``: prompts on one document, run alone after the workload: the first reads
    the document (it ends at its second token), then each other's time to first token is timed
    (``first_token_ms``: their median, on a prefix-cache hit where the engine has one).
    ``repeats``: the workload served that many times on the engine, its prefix cache reset between
    them; the figures are the repeat of median time's, and ``repeats`` lists each one's.
    ``chunk_tokens``: with chunked prefill, the most tokens a step reads (vLLM's
    ``max_num_batched_tokens``; None: its default). ``peak_kv_mib``: the most blocks the requests
    held at once, in MiB on all ranks."""
    import vllm

    args = dict(
        model=model_dir, dtype="float32", max_model_len=max(map(len, prompts)) + gen_len, enforce_eager=True,
        enable_prefix_caching=prefix_caching, enable_chunked_prefill=chunked_prefill, num_gpu_blocks_override=blocks,
        seed=0,
        block_size=block_size,
        max_num_seqs=256,
        tensor_parallel_size=tensor_parallel_size,
    )
    if not chunked_prefill:  # each prompt in one step
        args["max_num_batched_tokens"] = args["max_model_len"]
    elif chunk_tokens is not None:
        args["max_num_batched_tokens"] = chunk_tokens
    if keepkv:
        args["additional_config"] = {"keepkv": keepkv}
    began = time.perf_counter()
    llm = vllm.LLM(**args)
    started = time.perf_counter() - began
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    params = vllm.SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    computed = [0]
    schedule = scheduler.schedule

    def counted_schedule(*args, **kwargs):
        output = schedule(*args, **kwargs)
        computed[0] += prompt_tokens_computed(output, scheduler.requests)
        return output

    scheduler.schedule = counted_schedule

    def serve(repeat: int) -> dict:
        """Every prompt at once, until the last finishes: the workload's figures."""
        computed[0] = 0
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}.{repeat}", {"prompt_token_ids": prompt}, params)
        peak, steps, generated, finished, cached, shown, in_use = 0, 0, 0, 0, 0, start, 0
        so_far: dict[str, int] = {}  # request -> tokens generated so far (for progress)
        while engine.has_unfinished_requests():
            for output in engine.step():
                so_far[output.request_id] = len(output.outputs[0].token_ids)
                if output.finished:
                    generated += len(output.outputs[0].token_ids)
                    cached += output.num_cached_tokens or 0  # vLLM's prefix-cache hits
                    finished += 1
            peak = max(peak, len(scheduler.running))
            in_use = max(in_use, pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())  # vLLM's null block is never free
            steps += 1
            if progress is not None and time.perf_counter() - shown >= PROGRESS_EVERY:
                shown = time.perf_counter()
                progress(finished, len(prompts), sum(so_far.values()), shown - start)
        return {"seconds": time.perf_counter() - start, "peak": peak, "steps": steps, "generated": generated,
                "cached": cached, "computed": computed[0], "in_use": in_use}

    runs = []
    for repeat in range(repeats):
        if repeat and not llm.reset_prefix_cache():  # each repeat reads its prompts anew
            raise RuntimeError("keepkv.vllm.bench: the engine's prefix cache could not be reset between repeats")
        runs.append(serve(repeat))
    scheduler.schedule = schedule  # the count is the workload's
    # the repeat of median time gives the figures (the first, with one repeat)
    median = sorted(runs, key=lambda run: run["seconds"])[(len(runs) - 1) // 2]
    seconds, peak, steps, generated, cached = (median[key] for key in ("seconds", "peak", "steps", "generated", "cached"))
    first_token = None
    if probes:
        for index, prompt in enumerate(probes):
            began = time.perf_counter()
            engine.add_request(f"probe{index}", {"prompt_token_ids": prompt},
                               vllm.SamplingParams(temperature=0.0, max_tokens=1 if index else 2, ignore_eos=True))
            while engine.has_unfinished_requests():
                engine.step()
            if index:
                first_token = (first_token or []) + [time.perf_counter() - began]
        first_token = round(1000 * sorted(first_token)[len(first_token) // 2], 1)
    # A block holds one KV cache group's layers (every layer's, unless keepkv groups them by budget).
    group_spec = scheduler.kv_cache_config.kv_cache_groups[0]
    block_bytes = len(group_spec.layer_names) * group_spec.kv_cache_spec.page_size_bytes
    engine_core = engine.engine_core
    del llm, engine, scheduler
    engine_core.shutdown()  # a parallel engine's workers stop before the next engine starts
    gc.collect()
    return {
        "method": keepkv["method"] if keepkv else "full (stock vLLM)",
        "prefix_cache_hit_tokens": cached if prefix_caching else None, "prompt_tokens_computed": median["computed"],
        "tensor_parallel_size": tensor_parallel_size,
        "blocks": blocks, "kv_bytes": blocks * block_bytes * tensor_parallel_size, "peak_running": peak,
        "peak_kv_mib": round(median["in_use"] * block_bytes * tensor_parallel_size / 2**20, 1), "steps": steps,
        "start_seconds": round(started, 2), "seconds": round(seconds, 2), "generated_tokens": generated,
        "tokens_per_s": round(generated / seconds, 2),
    } | ({"first_token_ms": first_token} if probes else {}) | (
        {"repeats": [{"tokens_per_s": round(run["generated"] / run["seconds"], 2), "steps": run["steps"],
                      "prompt_tokens_computed": run["computed"]} for run in runs]} if repeats > 1 else {})


def engine_name(keepkv: dict | None) -> str:
    """An engine's name in the table: stock, or the method and, where the bench runs prompt modes,
    how it treats the prompt."""
    if not keepkv:
        return "full (stock vLLM)"
    mode = keepkv.get("prompt_mode")
    return keepkv["method"] if mode is None else f"{keepkv['method']} ({mode} prompts)"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m keepkv.vllm.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="snapkv,window,streamingllm", help="comma-separated keepkv methods")
    parser.add_argument("--budget", type=float, default=None,
                        help="fraction of each prompt kept (default 0.1); with --shared-prefix, generated entries kept "
                        "per request (an int, default 256)")
    parser.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                        help="every prompt starts with the same N tokens (one of --documents); prefix caching on, and "
                        "methods keep prompts whole unless --prompt-modes says compress")
    parser.add_argument("--documents", type=int, default=1, metavar="D",
                        help="with --shared-prefix: D shared prefixes of N tokens, request i starting with document "
                        "i mod D (default 1)")
    parser.add_argument("--prompt-modes", default="keep", metavar="MODES",
                        help="with --shared-prefix, comma-separated: 'keep' (prompts kept whole, prefix caching on; "
                        "the default), 'compress' (each prompt compressed to --prompt-budget, prefix caching off) "
                        "and/or 'share' (each prompt compressed chunk by chunk, the chunks shared through the prefix "
                        "cache: keepkv serve --share-prefix)")
    parser.add_argument("--share-blocks", type=int, default=None, metavar="C",
                        help="with --prompt-modes share: blocks of a chunk, each chunk kept as one block (default 8)")
    parser.add_argument("--prompt-budget", type=float, default=0.1,
                        help="with --prompt-modes compress: fraction of each prompt kept (default 0.1)")
    parser.add_argument("--requests", type=int, default=32, help="requests submitted at once (default 32)")
    parser.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens per request (default 1024)")
    parser.add_argument("--ragged", action="store_true",
                        help="prompts of unequal lengths, spread over half to 1.5 times --prompt-len (the KV memory stays that of --full-requests of --prompt-len)")
    parser.add_argument("--gen-len", type=int, default=128, help="generated tokens per request (default 128)")
    parser.add_argument("--full-requests", type=int, default=4, help="full-cache requests the KV memory holds (default 4)")
    parser.add_argument("--repeats", type=int, default=1, metavar="N",
                        help="serve the workload N times on each engine (its prefix cache reset between them) and "
                        "report the repeat of median time (default 1): steadier figures on a noisy host")
    parser.add_argument("--blocks", type=int, default=None, metavar="N",
                        help="every method's engine gets N KV blocks, whatever its slot's bytes (default: the blocks "
                        "that fit stock's memory); a diagnostic that compares steps at equal blocks")
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE, metavar="SLOTS",
                        help=f"slots per KV block, every engine's (default {BLOCK_SIZE}, vLLM's CPU default; a multiple of 16)")
    parser.add_argument("--no-chunked-prefill", dest="chunked_prefill", action="store_false",
                        help="vLLM's chunked prefill off, for every engine (default: on, vLLM's default; each prompt "
                        "then comes in one step)")
    parser.add_argument("--chunk-tokens", type=int, default=None, metavar="N",
                        help="with chunked prefill, the most tokens a step reads (vLLM's max_num_batched_tokens; "
                        "default: vLLM's), so that a long prompt comes in chunks")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="vLLM's tensor parallelism, for every engine: N ranks, each with --full-requests' KV "
                        "bytes for its share of the heads (default 1)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    for name in ("requests", "prompt_len", "gen_len", "full_requests", "tensor_parallel_size", "documents", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    modes = args.prompt_modes.split(",")
    if any(mode not in PROMPT_MODES for mode in modes) or len(set(modes)) != len(modes):
        parser.error(f"--prompt-modes takes {', '.join(PROMPT_MODES)}, comma-separated, got {args.prompt_modes!r}")
    if args.share_blocks is not None and "share" not in modes:
        parser.error("--share-blocks needs --prompt-modes share")
    if args.share_blocks is not None and args.share_blocks < 2:
        parser.error("--share-blocks (the blocks of a chunk) must be >= 2")
    if not args.shared_prefix and (args.documents > 1 or modes != ["keep"]):
        parser.error("--documents and --prompt-modes need --shared-prefix")
    if args.chunk_tokens is not None and (args.chunk_tokens < 1 or not args.chunked_prefill):
        parser.error("--chunk-tokens must be >= 1, with chunked prefill on")
    if args.block_size < 16 or args.block_size % 16:
        parser.error(f"--block-size must be a multiple of 16 (vLLM's CPU attention), got {args.block_size}")
    if args.blocks is not None and args.blocks < 2:
        parser.error("--blocks must be >= 2 (vLLM keeps one as its null block)")
    if not 0 < args.prompt_budget <= 1:
        parser.error("--prompt-budget must be in (0, 1]")
    keep_prompt = args.shared_prefix > 0
    if args.budget is None:
        args.budget = 256 if keep_prompt else 0.1
    if keep_prompt and (args.budget != int(args.budget) or args.budget < 1):
        parser.error("--budget with --shared-prefix is the generated entries kept: an int >= 1")
    if keep_prompt:
        args.budget = int(args.budget)
    elif not 0 < args.budget <= 1:
        parser.error("--budget must be in (0, 1]")
    from . import SHARE_CHUNK_BLOCKS

    share_blocks = SHARE_CHUNK_BLOCKS if args.share_blocks is None else args.share_blocks
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler is read in-process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from .settings import BIND, thread_binding
    from .spec import engine_layer_groups

    if os.environ.get(BIND, "auto") == "auto" and thread_binding(args.tensor_parallel_size):
        os.environ[BIND] = thread_binding(args.tensor_parallel_size)  # as keepkv serve sets it

    import keepkv
    from keepkv.paged import PagedCompression
    from keepkv.vllm.backend import VllmCpuKernel

    model, tokenizer = keepkv.load_model()
    model_dir = tempfile.mkdtemp(prefix="keepkv-vllm-")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    documents = args.documents if keep_prompt else 0
    lengths = prompt_lengths(args.requests, args.prompt_len, args.ragged) + [args.shared_prefix] * documents
    prompts = stdlib_prompts(tokenizer, lengths)  # the shared prefixes: more stdlib files
    probes = None
    if keep_prompt:
        prefixes, prompts = prompts[args.requests:], prompts[: args.requests]
        prompts = [prefixes[document] + prompt for document, prompt in zip(interleaved(documents, args.requests), prompts)]
        if args.documents > 1:  # document 0 with other requests' questions, alone after the workload
            probes = [prefixes[0] + prompt[args.shared_prefix:] for prompt in prompts[1 : 1 + PROBES]]
    request_len = args.shared_prefix + args.prompt_len
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    stock_slot = 2 * head_dim * 4  # fp32 key + value per head
    full_blocks = args.full_requests * math.ceil((request_len + args.gen_len) / args.block_size)
    engines = [(None, full_blocks)]
    for method in args.methods.split(","):
        for mode in modes if keep_prompt else ["compress"]:
            keep = mode in ("keep", "share") and keep_prompt
            chunk_blocks = share_blocks if mode == "share" else 0
            budget = args.budget if keep or not keep_prompt else args.prompt_budget
            try:  # a budget or mode the method cannot keep: one line, before any engine starts
                paged = PagedCompression(config, method, budget, keep_prompt=keep, kernel=VllmCpuKernel(),
                                         chunk_blocks=chunk_blocks)
            except ValueError as error:
                parser.error(str(error))
            slot = paged.content_bytes(head_dim, model.dtype)  # as the engine lays it out (vLLM's kernel widths)
            # Layers grouped by budget: a block holds one group's layers, so the same bytes are more blocks.
            groups = engine_layer_groups(paged, max(map(len, prompts)) + args.gen_len, args.block_size)
            layers = config.num_hidden_layers
            per_block = len(groups[0]) if groups else layers
            settings = ({"method": method, "budget": budget} | ({"keep_prompt": True} if keep else {})
                        | ({"share_prefix": chunk_blocks} if chunk_blocks else {}))
            if len(modes) > 1:
                settings["prompt_mode"] = mode  # the bench's, for the row's name; not the engine's
            engines.append((settings, args.blocks or full_blocks * stock_slot * layers // (slot * per_block)))  # same bytes

    def run(keepkv, blocks, progress):
        engine = None if keepkv is None else {key: value for key, value in keepkv.items() if key != "prompt_mode"}
        # prefix caching on with shared prefixes, but for a method that compresses prompts (it refuses it)
        caching = keep_prompt and (keepkv is None or bool(keepkv.get("keep_prompt")))
        row = run_engine(model_dir, prompts, args.gen_len, blocks, engine, progress, args.chunked_prefill, caching,
                         args.tensor_parallel_size, probes, args.repeats, args.block_size, args.chunk_tokens)
        return row | {"engine": engine_name(keepkv)}

    run_all(engines, run, vars(args), args.json)


def run_all(engines, run, settings: dict, json_path: str | None, out=None, err=None) -> list[dict]:
    """Run each engine ((keepkv settings or None for stock, blocks)) with ``run(keepkv, blocks,
    progress)``; print its JSON line on ``out`` as it finishes (progress lines on ``err``), rewrite
    ``json_path`` after each (a time-out keeps the engines done), and print a table at the end."""
    out, err = out or sys.stdout, err or sys.stderr
    results = []
    for index, (keepkv, blocks) in enumerate(engines, 1):
        name = engine_name(keepkv)
        label = f"[{index}/{len(engines)}] {name}"
        print(f"{label}: starting ({blocks} KV blocks)", file=err, flush=True)

        def progress(finished, total, generated, seconds, label=label):
            print(f"{label}: {finished}/{total} requests done, {generated} tokens, {seconds:.0f} s", file=err, flush=True)

        row = run(keepkv, blocks, progress)
        if results:
            row["tokens_per_s_vs_full"] = round(row["tokens_per_s"] / results[0]["tokens_per_s"], 2)
        results.append(row)
        print(json.dumps(row), file=out, flush=True)
        if json_path:
            with open(json_path, "w") as handle:
                json.dump({"settings": settings, "results": results}, handle, indent=2)
    print(table(results), file=out, flush=True)
    return results


def table(results: list[dict]) -> str:
    """The results as a Markdown table (docs/serving.md's columns, the peak KV in use where every row
    has it, the prompt tokens computed where a row counted them, and each engine's start time when every row has one); stock's ratio is 1.00×."""
    columns = list(COLUMNS)
    if all(PEAK_KV[1] in row for row in results):  # after the peak concurrency
        columns.insert(3, PEAK_KV)
    columns += [COMPUTED] * any(row.get(COMPUTED[1]) is not None for row in results)
    columns += [FIRST_TOKEN] * all(row.get(FIRST_TOKEN[1]) is not None for row in results)
    columns += [START] * all(START[1] in row for row in results)
    lines = ["| " + " | ".join(title for title, _ in columns) + " |", "| --- |" + " ---: |" * (len(columns) - 1)]
    for row in results:
        values = {"engine": row["method"], **row, "tokens_per_s_vs_full": f"{row.get('tokens_per_s_vs_full', 1.0):.2f}×"}
        lines.append("| " + " | ".join(f"{values[key]:,}" if isinstance(values[key], int) else str(values[key])
                                       for _, key in columns) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
