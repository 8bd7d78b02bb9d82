"""KeepKV's EMA fold: a decode interval's query rows folded into the EMA of attention scores (eq. 8).

For each (row, KV head) and entry ``s``, the ``r`` query rows (oldest first) fold in with weights
(1 - α) α^(r-1-i), and the old state decays by α^r::

    new_h(s) = ln Σ_{i < r, pos_s <= qpos_i} exp(score_{h,i,s}) (1 - α) α^(r-1-i)
    out_h(s) = logaddexp(old_h(s) + r ln α, new_h(s))

Pooled (one EMA word per KV head), the sum also runs over the group's g query heads and ``new``
takes - ln g: the EMA of the group's mean score. A row sees the entries at or before its position
(``positions``), and a padding row (position -1) sees none; without ``positions`` (a decode step's
one row) every row sees every entry.

**Backends:** ``"cpp"``, one pass over the scores per (row, KV head) in keepkv's C++ CPU kernels
(``paged_cpu.cpp``, built by :mod:`keepkv.kernels.paged_cpp`); ``"torch"``,
:func:`ema_fold_reference`, a handful of tensor ops over [B, H_kv, g, r, S] (any device, and
inside ``torch.compile``). ``"auto"`` takes the C++ one for fp32 tensors on CPU where keepkv's C++
kernels build (:func:`keepkv.kernels.paged.cpu_backend`), outside ``torch.compile``; else torch.
The two agree to fp32 rounding (``tests/test_ema_fold.py``).

"""

from __future__ import annotations

import math

import torch

NEG_INF = float("-inf")


def _logsumexp_in_place(x: torch.Tensor, dim: int) -> torch.Tensor:
    """ln Σ exp(x) over ``dim`` (removed), in ``x``'s own memory (overwritten); -inf where every
    term is -inf."""
    top = x.amax(dim, keepdim=True).clamp_min_(torch.finfo(x.dtype).min)  # finite: -inf - top stays -inf
    return x.sub_(top).exp_().sum(dim).log_().add_(top.squeeze(dim))


def ema_fold_reference(scores: torch.Tensor, old: torch.Tensor, positions: torch.Tensor | None,
                       query_pos: torch.Tensor, alpha: float, pool: bool) -> torch.Tensor:
    """:func:`ema_fold` in torch ops (the arguments as there)."""
    rows, group = scores.shape[3], scores.shape[2]
    log_fresh = math.log1p(-alpha)
    pool = pool and group > 1
    if positions is None:  # every row sees every entry
        visible = None
    else:
        visible = positions[:, :, None, :] <= query_pos[:, None, :, None]  # [B, H_kv, r, S]
    if rows == 1 and visible is None:
        if pool:
            scores = scores.logsumexp(dim=2, keepdim=True) - math.log(group)  # [B, H_kv, 1, 1, S]
        new_s = scores[:, :, :, 0] + log_fresh
    else:
        ages = torch.arange(rows - 1, -1, -1, device=scores.device, dtype=torch.float32)
        weights = (log_fresh + ages * math.log(alpha))[:, None]  # [r, 1]
        if visible is not None:
            weights = weights.masked_fill(~visible, NEG_INF)  # [B, H_kv, r, S]
        terms = scores + weights[..., None, :, :] if visible is not None else scores + weights
        if pool:  # one sum over the group's heads and the rows at once, then the mean over the heads
            new_s = _logsumexp_in_place(terms.flatten(2, 3), 2).unsqueeze(2) - math.log(group)
        else:
            new_s = _logsumexp_in_place(terms, 3)  # [B, H_kv, g, S]
    # logaddexp on a strided view (ln S's stored [B, H_kv, S, g] order) is slow on CPU: a contiguous copy
    return torch.logaddexp(old.permute(0, 1, 3, 2).contiguous() + rows * math.log(alpha), new_s)


def ema_fold(scores: torch.Tensor, old: torch.Tensor, positions: torch.Tensor | None, query_pos: torch.Tensor,
             alpha: float, pool: bool, backend: str = "auto") -> torch.Tensor:
    """The EMA after folding ``r`` query rows in (see the module docstring): [B, H_kv, g', S] fp32,
    g' = 1 where ``pool`` or g = 1, else g.

    scores [B, H_kv, g, r, S] fp32: each row's log-scores (its logits, or with row-normalised
    scores its logits less ln Z); old [B, H_kv, S, g'] fp32: the EMA's log-state ln S, in the
    store's order (a view is read as it is); positions [B, H_kv, S] int64 or None; query_pos
    [B, r] int64 (-1: padding); alpha in (0, 1).
    """
    if backend == "auto":
        backend = "cpp" if _cpp_takes(scores, old) else "torch"
    if backend == "torch":
        return ema_fold_reference(scores, old, positions, query_pos, alpha, pool)
    if backend != "cpp":
        raise ValueError(f"backend must be 'auto', 'cpp' or 'torch'; got {backend!r}")
    return _cpp_fold(scores, old, positions, query_pos, alpha, pool)


def _cpp_takes(scores: torch.Tensor, old: torch.Tensor) -> bool:
    if scores.device.type != "cpu" or scores.dtype != torch.float32 or old.dtype != torch.float32:
        return False
    if torch.compiler.is_compiling():  # a raw-address call has no place in a graph
        return False
    from .paged import cpu_backend

    return cpu_backend() == "cpp"


def _cpp_fold(scores, old, positions, query_pos, alpha: float, pool: bool) -> torch.Tensor:
    from .paged_cpp import extension

    batch, kv_heads, group, rows, size = scores.shape
    pool = pool and group > 1
    outputs = 1 if pool else group
    if old.shape != (batch, kv_heads, size, outputs):
        raise ValueError(f"the EMA state must be [B, H_kv, S, {outputs}] = {(batch, kv_heads, size, outputs)}; "
                         f"got {tuple(old.shape)}")
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    old = old if old.dtype == torch.float32 else old.float()
    query_pos = query_pos if query_pos.dtype == torch.int64 else query_pos.long()
    if positions is not None and positions.dtype != torch.int64:
        positions = positions.long()
    out = torch.empty(batch, kv_heads, outputs, size)
    pos_ptr, pos_strides = (0, (0, 0, 0)) if positions is None else (positions.data_ptr(), positions.stride())
    error = extension().ema_fold(
        scores.data_ptr(), old.data_ptr(), pos_ptr, query_pos.data_ptr(), out.data_ptr(),
        batch, kv_heads, group, rows, size, *scores.stride()[:4], *old.stride(), *pos_strides, *query_pos.stride(),
        int(pool), math.log1p(-alpha), math.log(alpha), rows * math.log(alpha))
    if error:
        raise ValueError(f"the C++ EMA fold does not take scores {tuple(scores.shape)}")
    return out
