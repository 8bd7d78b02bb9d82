"""keepkv: KV-cache compression for Hugging Face LLMs (KeepKV and the methods it is measured against)."""

from .attention import enable, enabled
from .budgets import capacity_bound
from .cache import CompressedCache
from .diagnostics import KeepKVWarning
from .generation import GenerationResult, compress, generate
from .methods import Method, describe_methods, get_method
from .models import load_model

__all__ = [
    "CompressedCache",
    "GenerationResult",
    "KeepKVWarning",
    "Method",
    "capacity_bound",
    "compress",
    "describe_methods",
    "enable",
    "enabled",
    "generate",
    "get_method",
    "load_model",
]
