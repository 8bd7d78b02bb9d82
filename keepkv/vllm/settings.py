"""The engine's keepkv settings, checked against its whole config (any platform, no CPU imports).

Runs where vLLM builds the engine's config, before any worker starts (the plugin's hook on the
platform's ``check_and_update_config``), and again in each worker (the backend reads the same
settings): what keepkv would not honour is refused there in one line.
"""

from __future__ import annotations

from . import SettingError, check

# Why each refused setting is refused, and the flag that turns it off (vLLM's defaults are on).
REFUSED = {
    "prefix caching": "a block shared between requests cannot be compacted per request "
                      "(--no-enable-prefix-caching, enable_prefix_caching=False)",
}


def engine_settings(vllm_config) -> dict | None:
    """The engine's ``additional_config["keepkv"]`` ({"method", "budget"}) checked, with
    "chunked" (whether the engine reads prompts in chunks); None if absent.

    Raises :class:`~keepkv.vllm.SettingError`, in one line, for what keepkv.vllm does not serve: another platform than
    CPU, a method it does not serve, prefix caching, speculative decoding, tensor or pipeline
    parallelism, sliding-window models.
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
    problems = []
    if vllm_config.cache_config.enable_prefix_caching:
        problems.append(f"prefix caching: {REFUSED['prefix caching']}")
    if vllm_config.speculative_config is not None:
        problems.append("speculative decoding")
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        problems.append("tensor or pipeline parallelism > 1 (untested)")
    if getattr(vllm_config.model_config.hf_text_config, "sliding_window", None):
        problems.append("sliding-window models")
    if problems:
        raise SettingError("keepkv.vllm does not support " + "; ".join(problems))
    return chosen | {"chunked": bool(vllm_config.scheduler_config.enable_chunked_prefill)}
