"""``CompressedCache(compile=True)``: a layer's whole decode-time method step as one compiled graph.

Eager, a method's decode step is hundreds of small tensor operations per layer (KeepKV's EMA
update, selection, similarity search, gates, the ZIP merge of key, value, votes and EMA, the
in-place move of the kept entries); on a GPU each is a kernel launch (docs/performance.md has
the counts). :func:`method_step` (``observe``, ``refresh``, ``compress`` when due) traces into one
``torch.compile`` graph per layer shape: the store's in-place writes become the graph's input
mutations, and the fused kernels plus the library calls inductor keeps (sort, top-k, cumsum,
scatter-reduce) are what a step launches (``keepkv bench --ops --compile`` counts them).

The traced code is the eager code (which makes no host sync in a decode step either), so the
outputs are the eager path's. What the compiler adds are guards: dynamo specialises on the
Python values the step reads (the layer's sizes, the store's binary-bias flag), so a steady
decode reuses one or two graphs; prefill never compiles (prompt shapes change with every prompt).

The step compiles whole (``fullgraph``) or not at all: if compiling fails (no C++ compiler, an
unsupported operation, a method whose step needs a host sync), one warning names the error and
the step runs eagerly from then on.
"""

from __future__ import annotations

import types
import warnings

import torch


def method_step(method, layer, stats, compress: bool) -> None:
    """One layer's decode-time method work: fold the step's statistics in; the method's refresh, when
    one is due, then the compression of the rebuilt layer; else the step's compression, if due."""
    method.observe(layer, stats)
    rebuilt = method.refresh(layer, stats)
    if rebuilt is not None:
        method.compress(layer, rebuilt)
    elif compress:
        method.compress(layer, stats)


_STEPS: dict[type, object] = {}  # one code object per method class: bounded by the registered classes


def _step_for(method_type: type):
    """:func:`method_step` with its own code object per method class: dynamo caches graphs, and
    counts recompilations against its limit, per code object, so one method's graphs never use
    up another's (caches of one method share theirs)."""
    if method_type not in _STEPS:
        code = method_step.__code__.replace()
        _STEPS[method_type] = types.FunctionType(code, method_step.__globals__, f"method_step_{method_type.__name__}")
    return _STEPS[method_type]


class CompiledStep:
    """:func:`method_step` through ``torch.compile``, eager from the first failure on."""

    def __init__(self):
        self._compiled: dict[type, object] = {}
        self.failed: str | None = None

    def __call__(self, method, layer, stats, compress: bool) -> None:
        if self.failed is None:
            kind = type(method)
            if kind not in self._compiled:
                self._compiled[kind] = torch.compile(_step_for(kind), dynamic=None, fullgraph=True)
            try:
                return self._compiled[kind](method, layer, stats, compress)
            except COMPILE_ERRORS as error:
                # fullgraph: raised while tracing or compiling, before the graph runs, so the
                # store is as it was and the eager step below is the step's only run.
                self.failed = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                warnings.warn(f"keepkv: torch.compile of the decode step failed ({self.failed}); it runs eagerly")
        method_step(method, layer, stats, compress)


COMPILE_ERRORS = (
    torch._dynamo.exc.TorchDynamoException,
    torch._dynamo.exc.FailOnRecompileLimitHit,  # more layer shapes than dynamo's recompile limit
    torch._inductor.exc.InductorError,
)
