"""Seconds to keepkv's refusal of what keepkv.vllm does not serve (serving venv):

    .venv-vllm/bin/python benchmarks/vllm_cpu/refusal_time.py

Two ways in: ``keepkv serve <flags>`` (seconds from the command's start to its exit, Python's
start-up included: it refuses before torch or vLLM is imported), and ``LLM(...)`` with the same
setting (seconds from the call to the refusal, vLLM already imported, in the process that builds
the engine's config, before any EngineCore starts). Prints one line per case: the seconds and the
refusal's line, or what happened instead.
"""

import os
import subprocess
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # an EngineCore would start here, not in a child

# case -> (keepkv serve's flags, LLM's keyword arguments)
CASES = {
    "speculative decoding": (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
                             {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                                     "prompt_lookup_max": 2}}),
    "tensor parallelism 9 (SmolLM2's 3 KV heads replicated)": (["--tensor-parallel-size", "9"], {"tensor_parallel_size": 9}),
    "pipeline parallelism 2": (["--pipeline-parallel-size", "2"], {"pipeline_parallel_size": 2}),
    "LoRA": (["--enable-lora"], {"enable_lora": True}),
    "fp8 KV cache": (["--kv-cache-dtype", "fp8"], {"kv_cache_dtype": "fp8"}),
    "prefix caching": (["--enable-prefix-caching"], {"enable_prefix_caching": True}),
    "budget 2 (below keepkv's 32 protected tokens)": (["--budget", "2"], {"budget": 2}),
}


def serve_refusal(flags: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "keepkv.cli", "serve", "--method", "keepkv", *flags],
                          capture_output=True, text=True, timeout=300)
    return time.perf_counter() - start, (done.stderr.strip().splitlines() or ["(nothing)"])[-1]


def engine_refusal(model: str, overrides: dict) -> tuple[float, str]:
    from vllm import LLM
    from vllm.v1.engine.core import EngineCore

    started = []
    init = EngineCore.__init__
    EngineCore.__init__ = lambda self, *a, **k: started.append(1) or init(self, *a, **k)
    budget = overrides.pop("budget", 0.1)
    settings = dict(enforce_eager=True, max_model_len=512, enable_prefix_caching=False, enable_chunked_prefill=False)
    start = time.perf_counter()
    try:
        LLM(model, additional_config={"keepkv": {"method": "keepkv", "budget": budget}}, **(settings | overrides))
        line = "not refused"
    except Exception as error:  # what the user sees
        line = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    finally:
        EngineCore.__init__ = init
    seconds = time.perf_counter() - start
    return seconds, line + (" (an EngineCore had started)" if started else "")


if __name__ == "__main__":
    print(f"load average at start: {os.getloadavg()}")
    for name, (flags, _) in CASES.items():
        seconds, line = serve_refusal(flags)
        print(f"keepkv serve, {name}: {seconds:.2f} s: {line}", flush=True)
    start = time.perf_counter()
    import vllm  # noqa: F401

    from keepkv.models import model_directory

    print(f"import vllm: {time.perf_counter() - start:.1f} s", flush=True)
    model = str(model_directory())
    for name, (_, overrides) in CASES.items():
        seconds, line = engine_refusal(model, dict(overrides))
        print(f"LLM(...), {name}: {seconds:.2f} s: {line}", flush=True)
    print(f"load average at end: {os.getloadavg()}")
