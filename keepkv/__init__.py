"""keepkv: KV-cache compression for Hugging Face LLMs (KeepKV and the methods it is measured against).

The public names below load on first use (torch and transformers with them), so that a command
that needs neither, such as ``keepkv serve``'s checks, starts in a fraction of a second.
"""

import importlib

# name -> the module that defines it
_PUBLIC = {
    "enable": ".attention",
    "enabled": ".attention",
    "capacity_bound": ".budgets",
    "CompressedCache": ".cache",
    "KeepKVWarning": ".diagnostics",
    "GenerationResult": ".generation",
    "compress": ".generation",
    "generate": ".generation",
    "Method": ".methods",
    "describe_methods": ".methods",
    "get_method": ".methods",
    "load_model": ".models",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    """Load the public names on first use (all at once: importing them registers keepkv's
    attention with transformers, as ``import keepkv`` did)."""
    if name not in _PUBLIC:
        raise AttributeError(f"module 'keepkv' has no attribute {name!r}")
    for public, module in _PUBLIC.items():
        globals()[public] = getattr(importlib.import_module(module, __name__), public)
    return globals()[name]


def __dir__():
    return sorted(set(globals()) | set(__all__))
