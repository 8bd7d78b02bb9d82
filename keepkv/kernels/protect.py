"""The kept entries open to KeepKV's merges under its ``protect`` gate (:class:`keepkv.methods.keepkv.ZipMerge`).

Of the n kept entries of a row and KV head whose ``priority`` is finite (the selection's own sinks
and window rank +inf and are not counted), the first ceil(protect · n) by priority, descending,
equal priorities in slot order, take no merges; every other kept entry is open to them.

**Backends:** ``"torch"``, :func:`open_to_merges_reference`: a stable descending argsort of every
row and head, its ranks scattered back (any device, and inside ``torch.compile``); ``"cpp"``, one
partial selection (``nth_element``) per (row, KV head) in keepkv's C++ CPU kernels
(``paged_cpu.cpp``, built by :mod:`keepkv.kernels.paged_cpp`): a decode step needs only which
entries rank below the cut, not the order. ``"auto"`` takes the C++ one for an fp32 priority on CPU
where keepkv's C++ kernels build (:func:`keepkv.kernels.paged.cpu_backend`), outside
``torch.compile``; else torch. The two return the same mask (``tests/test_protect.py``).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")
BACKENDS = ("auto", "cpp", "torch")


def open_to_merges_reference(kept: torch.Tensor, priority: torch.Tensor, protect: float) -> torch.Tensor:
    """:func:`open_to_merges` in torch ops (the arguments as there)."""
    scored = kept & torch.isfinite(priority)
    order = priority.where(scored, NEG_INF).argsort(dim=-1, descending=True, stable=True)  # scored first
    # The entry at rank r is protected iff r < ceil(protect · n), that is r < protect · n (r is an integer).
    is_open = torch.arange(order.shape[-1], device=order.device) >= scored.sum(-1, keepdim=True) * protect
    return kept & kept.scatter(-1, order, is_open)  # order is a permutation: the scatter writes every slot


def cpp_takes(kept: torch.Tensor, priority: torch.Tensor) -> bool:
    """Whether the C++ pass serves this mask: an fp32 ``priority`` on CPU and ``kept`` of its shape,
    outside ``torch.compile``, where keepkv's C++ kernels build (:func:`keepkv.kernels.paged.cpu_backend`)."""
    if priority.device.type != "cpu" or priority.dtype != torch.float32 or priority.dim() != 3:
        return False
    if kept.shape != priority.shape or priority.shape[-1] >= 1 << 24:  # ranks exact in fp32
        return False
    if torch.compiler.is_compiling():  # a raw-address call has no place in a graph
        return False
    from .paged import cpu_backend

    return cpu_backend() == "cpp"


def _open_cpp(kept: torch.Tensor, priority: torch.Tensor, protect: float) -> torch.Tensor:
    from .paged_cpp import extension

    if priority.device.type != "cpu" or priority.dtype != torch.float32 or priority.dim() != 3 or kept.shape != priority.shape:
        raise ValueError("the C++ merge gate takes an fp32 priority [B, H_kv, S] on CPU and kept of its shape")
    batch, kv_heads, size = priority.shape
    kept = kept if kept.dtype == torch.bool else kept.bool()
    out = torch.empty(batch, kv_heads, size, dtype=torch.bool)
    error = extension().open_to_merges(
        priority.data_ptr(), kept.data_ptr(), out.data_ptr(), batch, kv_heads, size, *priority.stride(),
        *kept.stride(), float(protect))
    if error:
        raise ValueError(f"the C++ merge gate does not take priority {tuple(priority.shape)} and protect {protect!r}")
    return out


def open_to_merges(kept: torch.Tensor, priority: torch.Tensor, protect: float, backend: str = "auto") -> torch.Tensor:
    """[B, H_kv, S] bool: the ``kept`` entries outside the top ``protect`` share (in [0, 1]) of those
    the selection ranked by score, as the module docstring says. kept [B, H_kv, S] bool; priority
    [B, H_kv, S]."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    if backend == "cpp" or (backend == "auto" and cpp_takes(kept, priority)):
        return _open_cpp(kept, priority, protect)
    return open_to_merges_reference(kept, priority, protect)
