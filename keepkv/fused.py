"""Optional ``torch.compile`` of the methods' decode-time math, with the eager code as fallback.

A method's decode step is ~150 small tensor operations per layer (KeepKV: the EMA update, the
similarity search, the ZIP merge); on CPU their cost is dispatch and memory traffic, not
arithmetic. ``torch.compile`` fuses each marked function into a few kernels. The marked
functions are pure tensor code, so the compiled and eager versions compute the same thing;
once a layer's cache keeps its size from step to step their shapes are stable and nothing
recompiles per step (a second shape, say another layer's budget, makes the sizes dynamic).

Compilation happens only inside :func:`compiled`, which the cache enters for decode steps of a
``CompressedCache(..., compile=True)``: prefill shapes change with every prompt. If compiling
fails (no C++ compiler, an unsupported operation), a warning names the function and it runs
eagerly from then on.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch

_active = False


@contextlib.contextmanager
def compiled(enabled: bool = True):
    """Within this block, functions marked :func:`fusable` run compiled (when ``enabled``)."""
    global _active
    previous, _active = _active, enabled
    try:
        yield
    finally:
        _active = previous


def fusable(fn):
    """Mark a pure tensor function: compiled on its first call inside :func:`compiled`."""
    compiled_fn = None
    failed = False

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled_fn, failed
        if not _active or failed:
            return fn(*args, **kwargs)
        if compiled_fn is None:
            compiled_fn = torch.compile(fn, dynamic=None)
        try:
            return compiled_fn(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as error:  # compile failure: run eagerly
            failed = True
            warnings.warn(f"torch.compile of {fn.__qualname__} failed ({error.__class__.__name__}); it runs eagerly")
            return fn(*args, **kwargs)

    call.eager = fn
    return call
