"""The kept queries' masked softmax: the attention each decoding query a paged cache kept since its
last compression gave, recomputed at the compression over the entries it saw
(:func:`keepkv.attention.kept_query_stats`).

Per (row, KV head), query head h and kept query i (oldest first)::

    probs(s) = exp(logits(s) + bias(s)) / Σ_{pos_t <= qpos_i} exp(logits(t) + bias(t))

where pos_s <= qpos_i, else 0 (a row that sees nothing, a padding row: all 0).

**Backends:** ``"torch"``, :func:`kept_softmax_reference`: the visible bias built once per row and
KV head, then a softmax over [B, H_kv, g, N, S] (any device, and inside ``torch.compile``);
``"cpp"``, one pass per (row, KV head) in keepkv's C++ CPU kernels (``paged_cpu.cpp``, built by
:mod:`keepkv.kernels.paged_cpp`), the visible bias built once for the group's heads. ``"auto"``
takes the C++ one for fp32 tensors on CPU where keepkv's C++ kernels build
(:func:`keepkv.kernels.paged.cpu_backend`), outside ``torch.compile``; else torch. The two agree
to fp32 rounding (``tests/test_kept_softmax.py``).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")
BACKENDS = ("auto", "cpp", "torch")


def visible_bias(bias: torch.Tensor, positions: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
    """[B, H_kv, N, S]: each kept query's view of the bias [B, H_kv, S], -inf on the entries it does
    not see (positions [B, H_kv, S] past its own, query_pos [B, N]; -1: a padding row sees none)."""
    visible = positions[:, :, None, :] <= query_pos[:, None, :, None]
    return bias[:, :, None, :].masked_fill(~visible, NEG_INF)


def kept_softmax_reference(logits: torch.Tensor, bias: torch.Tensor, positions: torch.Tensor,
                           query_pos: torch.Tensor) -> torch.Tensor:
    """:func:`kept_softmax` in torch ops (the arguments as there)."""
    biased = logits + visible_bias(bias, positions, query_pos)[:, :, None]  # [B, H_kv, g, N, S]
    return torch.softmax(biased, dim=-1).nan_to_num_(0.0)  # a row that sees nothing: 0, not NaN


def cpp_takes(logits: torch.Tensor, bias: torch.Tensor) -> bool:
    """Whether the C++ pass serves these tensors: fp32 logits [B, H_kv, g, N, S] and bias on CPU,
    outside ``torch.compile``, where keepkv's C++ kernels build."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or bias.dtype != torch.float32:
        return False
    if logits.dim() != 5 or logits.shape[-1] == 0 or logits.shape[3] == 0:
        return False
    if torch.compiler.is_compiling():  # a raw-address call has no place in a graph
        return False
    from .paged import cpu_backend

    return cpu_backend() == "cpp"


def _kept_cpp(logits, bias, positions, query_pos) -> torch.Tensor:
    from .paged_cpp import extension

    batch, kv_heads, group, rows, size = logits.shape
    if (bias.shape != (batch, kv_heads, size) or positions.shape != (batch, kv_heads, size)
            or query_pos.shape != (batch, rows) or logits.dtype != torch.float32 or bias.dtype != torch.float32):
        raise ValueError(f"the C++ kept softmax takes fp32 logits [B, H_kv, g, N, S], fp32 bias and positions "
                         f"[B, H_kv, S], query_pos [B, N]; got {tuple(logits.shape)}, {tuple(bias.shape)}, "
                         f"{tuple(positions.shape)}, {tuple(query_pos.shape)}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    positions = positions if positions.dtype == torch.int64 else positions.long()
    query_pos = query_pos if query_pos.dtype == torch.int64 else query_pos.long()
    probs = torch.empty(batch, kv_heads, group, rows, size)
    error = extension().kept_softmax(
        logits.data_ptr(), bias.data_ptr(), positions.data_ptr(), query_pos.data_ptr(), probs.data_ptr(),
        batch, kv_heads, group, rows, size, *logits.stride()[:4], *bias.stride(), *positions.stride(),
        *query_pos.stride())
    if error:
        raise ValueError(f"the C++ kept softmax does not take logits {tuple(logits.shape)}")
    return probs


def kept_softmax(logits: torch.Tensor, bias: torch.Tensor, positions: torch.Tensor, query_pos: torch.Tensor,
                 backend: str = "auto") -> torch.Tensor:
    """probs [B, H_kv, g, N, S] fp32, as the module docstring says.

    logits [B, H_kv, g, N, S] fp32: q·k·scaling of the kept queries, no bias; bias, positions
    [B, H_kv, S] (an empty slot: bias -inf); query_pos [B, N] int64 (-1: padding).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    if backend == "cpp" or (backend == "auto" and cpp_takes(logits, bias)):
        return _kept_cpp(logits, bias, positions, query_pos)
    return kept_softmax_reference(logits, bias, positions, query_pos)
