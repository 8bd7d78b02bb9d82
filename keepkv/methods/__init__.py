"""Compression methods, one per file, each registered by name when its module is imported."""

import importlib
import pkgutil

from .base import METHODS, Method, describe_methods, get_method, register

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["METHODS", "Method", "describe_methods", "get_method", "register"]
