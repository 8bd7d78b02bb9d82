"""What a bench run is set up from, shared by its kinds (timing, ops, soak, CUDA suite): each
method's parameters and the versions a report records."""

from __future__ import annotations

import dataclasses

from ..methods.base import parse_method_spec


def resolve_params(methods: list[str], method_params: dict | None) -> dict[str, dict]:
    """Per-method parameters. Keys of ``method_params``: a method name (its own dict) or
    ``"*"`` (applied to every method that has that field, e.g. ``{"*": {"interval": 8}}``)."""
    from ..methods import METHODS

    method_params = dict(method_params or {})
    shared = method_params.pop("*", {})
    unknown = [m for m in method_params if m not in METHODS]
    if unknown:
        raise ValueError(f"parameters given for unknown method(s): {', '.join(unknown)}")
    resolved = {}
    for method in methods:
        fields = {field.name for field in dataclasses.fields(METHODS[parse_method_spec(method)[0]])}
        params = {key: value for key, value in shared.items() if key in fields}
        params.update(method_params.get(method, {}))
        resolved[method] = params
    return resolved


def package_version() -> str:
    try:
        from importlib.metadata import version

        return version("keepkv")
    except Exception:  # not installed: running from a checkout
        return "0.1.0+checkout"


def transformers_version() -> str:
    import transformers

    return transformers.__version__
