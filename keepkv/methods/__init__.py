"""Compression methods, one per file, registered by name."""

from .base import METHODS, Method, describe_methods, get_method, register
from . import full, window, streamingllm, h2o, snapkv, pyramidkv  # noqa: F401  (registration)

__all__ = ["METHODS", "Method", "describe_methods", "get_method", "register"]
