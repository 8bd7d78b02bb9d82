"""The engine's keepkv settings, checked against its whole config (any platform, no CPU imports).

Runs where vLLM builds the engine's config, before any worker starts (the plugin's hook on the
platform's ``check_and_update_config``), and again in each worker (the backend reads the same
settings): what keepkv would not honour is refused there in one line. ``keepkv serve`` refuses
the same settings from its flags, before vLLM is even imported (:mod:`keepkv.vllm.serve`).
"""

from __future__ import annotations

import os

from . import SettingError, check

BIND = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM's CPU build: each rank's cores, "auto" by default

# What keepkv.vllm does not serve: why, and how to turn it off (the refusal's one line).
REFUSED = {
    "prefix caching": "a block shared between requests cannot be compacted per request "
                      "(--no-enable-prefix-caching, enable_prefix_caching=False), unless prompts are kept "
                      "whole (keepkv serve --keep-prompt, keep_prompt=True) or compressed chunk by chunk "
                      "(keepkv serve --share-prefix, share_prefix=True)",
    "speculative decoding": "a request's cache takes one token per decode step (drop --speculative-config)",
    "pipeline parallelism > 1": "vLLM 0.32.0's CPU build dies on an eager engine's first request (the second "
                                "stage's `assert self.intermediate_tensors is not None`: its eager warm-up skips the "
                                "dummy run that allocates them) (--pipeline-parallel-size 1)",
    "KV heads replicated over ranks": "with a tensor-parallel size above the model's KV heads each copy of a KV head "
                                      "sees part of its query group, so the copies would score and keep different "
                                      "entries (an all-reduce of their scores is not built): take a "
                                      "--tensor-parallel-size that divides the KV heads",
    "layer budgets drawn from every layer's scores under tensor parallelism":
        "each rank holds only its own heads' scores (an all-gather across ranks is not built) "
        "(--tensor-parallel-size 1)",
    "LoRA": "untested with keepkv's attention (drop --enable-lora)",
    "an fp8 KV cache": "keepkv's slots hold keys and values in the model's dtype (--kv-cache-dtype auto)",
    "sliding-window models": "keepkv attends over every kept entry",
}


def refusal(*features: str) -> str:
    """The one line that refuses ``features`` (keys of :data:`REFUSED`)."""
    return "keepkv.vllm does not support " + "; ".join(f"{name}: {REFUSED[name]}" for name in features)


def engine_settings(vllm_config) -> dict | None:
    """The engine's ``additional_config["keepkv"]`` ({"method", "budget"}) checked, with
    "chunked" (whether the engine reads prompts in chunks); None if absent.

    Raises :class:`~keepkv.vllm.SettingError`, in one line, for what keepkv.vllm does not serve
    (:data:`REFUSED`), another platform than CPU, or a method it does not serve.
    """
    if vllm_config is None or not (vllm_config.additional_config or {}).get("keepkv"):
        return None
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise SettingError(
            f"keepkv.vllm serves on vLLM's CPU build only, not on {current_platform.device_name!r}: "
            "the CUDA design (docs/serving.md) is not built yet"
        )
    from ..methods import get_method

    try:
        chosen = check(vllm_config.additional_config["keepkv"])
        get_method(chosen["method"]).check_model(vllm_config.model_config.hf_config)  # a scorer for this model
    except ValueError as error:
        raise SettingError(str(error)) from None
    parallel, cache = vllm_config.parallel_config, vllm_config.cache_config
    found = {
        "prefix caching": cache.enable_prefix_caching and not chosen.get("keep_prompt"),
        "speculative decoding": vllm_config.speculative_config is not None,
        **dict.fromkeys(parallel_problems(chosen["method"], parallel.tensor_parallel_size,
                                          parallel.pipeline_parallel_size,
                                          vllm_config.model_config.get_total_num_kv_heads()), True),
        "LoRA": vllm_config.lora_config is not None,
        "an fp8 KV cache": str(cache.cache_dtype).startswith("fp8"),
        "sliding-window models": bool(getattr(vllm_config.model_config.hf_text_config, "sliding_window", None)),
    }
    problems = [name for name, present in found.items() if present]
    if problems:
        raise SettingError(refusal(*problems))
    binding = thread_binding(parallel.world_size)
    if binding is not None and os.environ.get(BIND, "auto") == "auto":
        raise SettingError(unbound(parallel.world_size, binding))
    return chosen | {"chunked": bool(vllm_config.scheduler_config.enable_chunked_prefill)}


def parallel_problems(method: str, tensor_parallel: int, pipeline_parallel: int, kv_heads: int) -> list[str]:
    """What of :data:`REFUSED` a parallel engine of ``method`` (a name or variant) would need, for a
    model of ``kv_heads`` KV heads: each tensor-parallel rank compresses its own KV heads, with no
    communication, which serves every method whose decisions are per KV head."""
    from ..methods import get_method

    found = {
        "pipeline parallelism > 1": pipeline_parallel > 1,
        "KV heads replicated over ranks": tensor_parallel > kv_heads,
        "layer budgets drawn from every layer's scores under tensor parallelism":
            tensor_parallel > 1 and get_method(method).allocates_from_all_layers,
    }
    return [name for name, present in found.items() if present]


def memory_nodes() -> int:
    """NUMA nodes this process may allocate on (``Mems_allowed_list`` of /proc/self/status; 1 where
    it cannot be read): vLLM's default thread binding gives each of a host's ranks one of them."""
    try:
        with open("/proc/self/status") as status:
            allowed = next(line.split(":", 1)[1].strip() for line in status if line.startswith("Mems_allowed_list:"))
    except (OSError, StopIteration):
        return 1
    count = 0
    for part in filter(None, allowed.split(",")):
        low, _, high = part.partition("-")
        count += int(high or low) - int(low) + 1
    return max(1, count)


def thread_binding(ranks: int, cpus=None) -> str | None:
    """A value of :data:`BIND` that starts ``ranks`` CPU workers on this host, or None where vLLM's
    default binding does (one rank, or a NUMA node per rank): the cores this process may run on
    (``cpus``: ``os.sched_getaffinity(0)`` by default) split into ``ranks`` contiguous lists, or,
    with fewer cores than ranks, one core each, in turn (``"0|1|0"`` for 3 ranks on 2 cores)."""
    if ranks <= 1 or memory_nodes() >= ranks:
        return None
    cores = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if len(cores) < ranks:
        return "|".join(str(cores[rank % len(cores)]) for rank in range(ranks))
    return "|".join(",".join(map(str, cores[len(cores) * rank // ranks: len(cores) * (rank + 1) // ranks]))
                    for rank in range(ranks))


def unbound(ranks: int, binding: str) -> str:
    """The one line that asks for a thread binding where vLLM's default cannot start ``ranks`` workers."""
    return (f"keepkv.vllm: {ranks} CPU workers on {memory_nodes()} NUMA node(s): vLLM's default thread binding "
            f"needs a node per worker; set {BIND}={binding!r} (each worker's cores, '|' between workers; "
            "keepkv serve sets it when unset)")
