"""keepkv in vLLM: a general plugin serving compressed KV caches (phase 1: vLLM's CPU build).

Installed with ``pip install -e ".[vllm]"`` (its own venv: vLLM pins its own transformers), the
plugin loads in every vLLM process and stays inert until the engine is given::

    LLM(model, additional_config=keepkv.vllm.config("snapkv", 0.1), enable_prefix_caching=False)

(``config`` returns ``{"keepkv": {"method": ..., "budget": ...}}``, checked) or ``keepkv serve``
(:mod:`keepkv.vllm.serve`, vLLM's OpenAI-compatible server). Then the attention backend
(:mod:`keepkv.vllm.backend`) runs the method on each request's paged entries (:mod:`keepkv.paged`)
and the KV cache manager (:mod:`keepkv.vllm.spec`) caps each request's blocks at
``keepkv.capacity_bound``.

The settings are checked in the process that builds the engine's config, before any worker
starts (:func:`register` hooks the platform's ``check_and_update_config``): a setting keepkv would
not honour is refused in one line, never ignored.
"""

from __future__ import annotations

import logging
import os

BACKEND = "keepkv.vllm.backend.KeepKVBackend"
PLUGIN = "keepkv"  # the entry point's name (pyproject.toml), as VLLM_PLUGINS lists it
DEFAULT_GENERATED = 256  # generated entries a request keeps with keep_prompt, unless a budget is given
# Served, a method compresses every SERVING_INTERVAL tokens unless its variant names an interval
# (``snapkv+interval=1``): a request's slots are read once per compression, and between
# compressions only the engine's kernel reads them (docs/serving.md has the measured choice).
SERVING_INTERVAL = 16
# Blocks of a prompt's chunk with share_prefix: each whole chunk of 8 blocks (1,024 tokens at vLLM's
# CPU block size) is compressed alone to one block, a ratio of 1/8.
SHARE_CHUNK_BLOCKS = 8


class SettingError(RuntimeError):
    """A keepkv setting the engine would not honour (raised where the engine's config is built;
    not a ValueError, which vLLM's pydantic config would wrap in a three-line validation error)."""


def check(given) -> dict:
    """``additional_config["keepkv"]`` checked, without vLLM: {"method", "budget"}, and
    "keep_prompt": True when given so (prompts kept whole, ``budget`` generated entries kept: the
    mode that serves with prefix caching), and "share_prefix": the blocks of a chunk (True:
    :data:`SHARE_CHUNK_BLOCKS`) when given (a kept prompt's whole chunks each compressed alone to one
    block, which the prefix cache shares; it implies keep_prompt).

    The method comes back as the variant served: one without an interval of its own compresses
    every :data:`SERVING_INTERVAL` tokens (``"snapkv"`` -> ``"snapkv+interval=16"``).

    Raises ValueError in one line: unknown keys, a method the paged adapter does not serve (the
    message names those it serves), a bad budget, an entry budget that cannot hold the method's
    protected tokens (``keepkv.budgets.check_budget_holds``), a fraction with keep_prompt.
    """
    from ..budgets import check_budget_holds, check_keep_prompt, validate_budget
    from ..methods.base import parse_method_spec
    from ..paged import servable_method

    if not isinstance(given, dict):
        raise ValueError(f'additional_config["keepkv"] is a dict {{"method": ..., "budget": ...}}, got {given!r}')
    unknown = sorted(set(given) - {"method", "budget", "keep_prompt", "share_prefix"})
    if unknown or "method" not in given:
        raise ValueError(f'additional_config["keepkv"] takes "method", "budget", "keep_prompt" and "share_prefix", '
                         f'got {sorted(given)}')
    keep_prompt = given.get("keep_prompt", False)
    if not isinstance(keep_prompt, bool):
        raise ValueError(f'additional_config["keepkv"]["keep_prompt"] must be true or false, got {keep_prompt!r}')
    share = given.get("share_prefix", False)
    share = SHARE_CHUNK_BLOCKS if share is True else share
    if share is not False:
        if isinstance(share, bool) or not isinstance(share, int) or share < 2:
            raise ValueError(f'additional_config["keepkv"]["share_prefix"] is true or the blocks of a chunk (>= 2), '
                             f'got {given["share_prefix"]!r}')
        keep_prompt = True
    budget = validate_budget(given.get("budget", DEFAULT_GENERATED if keep_prompt else 0.1))
    if not isinstance(given["method"], str):
        raise ValueError(f'additional_config["keepkv"]["method"] must be a method name (str), got {given["method"]!r}')
    spec = str(given["method"])
    method = servable_method(spec)
    if "interval" not in parse_method_spec(spec)[1]:
        spec += f"+interval={SERVING_INTERVAL}"
        method = servable_method(spec)
    check_budget_holds(method, budget)
    if keep_prompt:
        check_keep_prompt(method, budget)
        if share:
            from ..paged_chunks import check_chunk_blocks

            check_chunk_blocks(method, share, True)
            return {"method": spec, "budget": budget, "keep_prompt": True, "share_prefix": share}
        return {"method": spec, "budget": budget, "keep_prompt": True}
    return {"method": spec, "budget": budget}


def plugin_enabled(environ=None) -> bool:
    """Whether vLLM will load this plugin: VLLM_PLUGINS unset, or listing ``keepkv``
    (``environ``: os.environ by default)."""
    allowed = (os.environ if environ is None else environ).get("VLLM_PLUGINS")
    return allowed is None or PLUGIN in [name.strip() for name in allowed.split(",")]


def require_plugin(environ=None) -> None:
    """Raise RuntimeError, in one line, when vLLM would not load the plugin (keepkv's settings
    would then be ignored, and every request served with the full cache)."""
    environ = os.environ if environ is None else environ
    if not plugin_enabled(environ):
        raise RuntimeError(
            f"VLLM_PLUGINS={environ['VLLM_PLUGINS']!r} leaves out keepkv's plugin, so vLLM would ignore "
            "additional_config['keepkv']: add keepkv to VLLM_PLUGINS or unset it"
        )


def config(method: str | None = None, budget: int | float | None = None, keep_prompt: bool = False,
           share_prefix: bool | int = False) -> dict:
    """The engine's ``additional_config`` for keepkv, checked in the caller's process: the method
    is served, the budget valid, and vLLM will load the plugin. An entry budget under the
    method's budget floor warns (:class:`keepkv.KeepKVWarning`, one line).

    method: a served method or variant (default snapkv; keydiff with ``share_prefix``).
    budget: a fraction of each prompt or an entry count (default 0.1); with ``keep_prompt`` the
    generated entries each request keeps (an int, default :data:`DEFAULT_GENERATED`), its prompt
    kept whole, so that the engine may share prompt blocks (``enable_prefix_caching=True``).
    ``share_prefix``: True, or the blocks of a chunk (default :data:`SHARE_CHUNK_BLOCKS`): each whole
    chunk of a prompt is compressed alone to one block, and the engine's prefix cache shares the
    compressed chunks (implies ``keep_prompt``; ``enable_prefix_caching=True``)."""
    keep_prompt = keep_prompt or share_prefix is not False
    if method is None:  # keydiff answers best through shared chunks (docs/serving.md)
        method = "keydiff" if share_prefix is not False else "snapkv"
    if budget is None:
        budget = DEFAULT_GENERATED if keep_prompt else 0.1
    import warnings

    from ..budgets import floor_warning
    from ..diagnostics import KeepKVWarning
    from ..methods import get_method

    require_plugin()
    settings = check({"method": method, "budget": budget, "keep_prompt": keep_prompt}
                     | ({"share_prefix": share_prefix} if share_prefix is not False else {}))
    warning = None if keep_prompt else floor_warning(get_method(method), budget)
    if warning:
        warnings.warn(warning, KeepKVWarning, stacklevel=2)
    return {"keepkv": settings}


def register() -> None:
    """The ``vllm.general_plugins`` entry point.

    In every process: hook the platform's config check, so that an engine given
    ``additional_config["keepkv"]`` is checked where its config is built (the main process),
    before any worker starts; show vLLM's warning that it casts a checkpoint's weights to the
    served dtype once per dtype pair, not once per weight (122 lines for SmolLM2's fp32 copy
    served in bf16). On CPU also route attention through keepkv's backend (which
    delegates to vLLM's own while keepkv is not configured) and register the KV cache spec whose
    manager frees blocks.
    """
    from vllm.platforms import current_platform

    _hook_config_check(type(current_platform))
    casts = logging.getLogger(CAST_LOGGER)
    if not any(isinstance(existing, _OncePerCast) for existing in casts.filters):
        casts.addFilter(_OncePerCast())
    if not current_platform.is_cpu():
        return  # phase 1: CPU only; the hook refuses keepkv settings here (docs/serving.md)
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from .spec import KeepKVManager, KeepKVSpec

    # The CPU platform picks CPU_ATTN whatever --attention-backend says: override that entry.
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
    KVCacheSpecRegistry._ensure_registered()  # else the built-in specs are never registered
    KVCacheSpecRegistry.register(KeepKVSpec, KeepKVManager)


CAST_LOGGER = "vllm.model_executor.models.utils"  # where vLLM warns of each weight it casts
CAST_WARNING = "Attempted to load weight %s with dtype %s into parameter with dtype %s"


class _OncePerCast(logging.Filter):
    """Lets through vLLM's cast warning once per (checkpoint dtype, served dtype), reworded to
    say so; every other record as it is."""

    def __init__(self):
        super().__init__()
        self.seen: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != CAST_WARNING or len(record.args or ()) != 3:
            return True
        pair = (str(record.args[1]), str(record.args[2]))
        if pair in self.seen:
            return False
        self.seen.add(pair)
        record.msg, record.args = "Casting the checkpoint's %s weights to %s as they load (shown once, not per weight)", pair
        return True


def _hook_config_check(platform_class) -> None:
    """Wrap ``platform_class.check_and_update_config`` (a classmethod VllmConfig calls once its
    settings are resolved) to refuse keepkv settings it will not honour. Idempotent."""
    original = platform_class.check_and_update_config
    if getattr(original, "_keepkv", False):
        return

    def checked(cls, vllm_config) -> None:
        original(vllm_config)  # the platform's own check first: it may still change settings
        if (vllm_config.additional_config or {}).get("keepkv"):
            from .settings import engine_settings

            engine_settings(vllm_config)

    checked._keepkv = True
    platform_class.check_and_update_config = classmethod(checked)
