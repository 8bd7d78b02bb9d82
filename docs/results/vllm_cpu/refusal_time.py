"""Seconds from ``LLM(...)`` to keepkv's refusal of a setting it does not honour (serving venv):

    .venv-vllm/bin/python docs/results/vllm_cpu/refusal_time.py

Prints one line per case: the error's type, its message's first line, and the seconds.
"""

import os
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

if __name__ == "__main__":
    from vllm import LLM

    from keepkv.models import model_directory

    model = str(model_directory())
    cases = {
        "vLLM's defaults (prefix caching, chunked prefill)": {},
        "an unserved method": {"enable_prefix_caching": False, "enable_chunked_prefill": False, "method": "keepkv"},
    }
    for name, overrides in cases.items():
        method = overrides.pop("method", "snapkv")
        start = time.perf_counter()
        try:
            LLM(model, enforce_eager=True, max_model_len=512, additional_config={"keepkv": {"method": method, "budget": 0.1}},
                **overrides)
        except Exception as error:  # what the user sees
            print(f"{name}: {type(error).__name__}: {str(error).splitlines()[0][:100]}... "
                  f"after {time.perf_counter() - start:.1f} s")
