"""Compression methods, one per file, each registered by name when its module is imported; the
selections and merges they pair are registered the same way (``SELECTIONS``, ``MERGES``)."""

import importlib
import pkgutil

from .base import (
    MERGES, METHODS, SELECTIONS, ComposedMethod, Merge, Method, Selection, describe_methods, get_method, register,
)

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "MERGES", "METHODS", "SELECTIONS", "ComposedMethod", "Merge", "Method", "Selection", "describe_methods",
    "get_method", "register",
]
