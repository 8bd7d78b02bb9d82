"""The engine's keepkv settings, checked against its whole config (any platform, no CPU imports).

Runs where vLLM builds the engine's config, before any worker starts (the plugin's hook on the
platform's ``check_and_update_config``), and again in each worker (the backend reads the same
settings): what keepkv would not honour is refused there in one line. ``keepkv serve`` refuses
the same settings from its flags, before vLLM is even imported (:mod:`keepkv.vllm.serve`).
"""

from __future__ import annotations

from . import SettingError, check

# What keepkv.vllm does not serve: why, and how to turn it off (the refusal's one line).
REFUSED = {
    "prefix caching": "a block shared between requests cannot be compacted per request "
                      "(--no-enable-prefix-caching, enable_prefix_caching=False), unless prompts are kept "
                      "whole (keepkv serve --keep-prompt, keep_prompt=True)",
    "speculative decoding": "a request's cache takes one token per decode step (drop --speculative-config)",
    "tensor or pipeline parallelism > 1": "untested (--tensor-parallel-size 1 --pipeline-parallel-size 1)",
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
    try:
        chosen = check(vllm_config.additional_config["keepkv"])
    except ValueError as error:
        raise SettingError(str(error)) from None
    parallel, cache = vllm_config.parallel_config, vllm_config.cache_config
    found = {
        "prefix caching": cache.enable_prefix_caching and not chosen.get("keep_prompt"),
        "speculative decoding": vllm_config.speculative_config is not None,
        "tensor or pipeline parallelism > 1": parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1,
        "LoRA": vllm_config.lora_config is not None,
        "an fp8 KV cache": str(cache.cache_dtype).startswith("fp8"),
        "sliding-window models": bool(getattr(vllm_config.model_config.hf_text_config, "sliding_window", None)),
    }
    problems = [name for name, present in found.items() if present]
    if problems:
        raise SettingError(refusal(*problems))
    return chosen | {"chunked": bool(vllm_config.scheduler_config.enable_chunked_prefill)}
