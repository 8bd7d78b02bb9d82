"""Entries read and written whole along a layer's entry axis.

A layer's tensors are ``x [B, H_kv, S, ...]``: one entry per slot, with trailing features (a key's
D words, an EMA's g words) or none (a bias, a position). An index ``[B, H_kv, E]`` names E slots
of each row and head, each in [0, S).

On CPU, ``torch.gather`` and ``scatter_`` with an index expanded over the features walk it element
by element; here an entry's features move as one vector: an ``index_select`` / ``index_copy_`` /
``index_add_`` over the tensor's entries as rows of a 2-D view of its memory (a store's tensors
are views of buffers with spare slots, so the view follows their strides), or an advanced index
where the memory is not laid out as rows. That is one operation more (the rows' offsets added to
the index). On other devices the gather and scatter kernels are vectorised and each operation is
a kernel launch, so there they run as they are.
"""

from __future__ import annotations

import functools
import math

import torch


def _rows(x: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, row index): ``x [B, H_kv, S, *F]`` as ``rows [N, prod(F)]``, a view of its memory,
    and ``index [B, H_kv, E]`` as the flat [B·H_kv·E] rows it names; None where an entry's features
    are not one contiguous run or the rows are not whole multiples of it."""
    features = math.prod(x.shape[3:])
    strides = x.stride()
    contiguous_features = all(
        stride == math.prod(x.shape[d + 1:]) for d, stride in enumerate(strides[3:], start=3) if x.shape[d] > 1
    )
    if (not contiguous_features or strides[2] != features or features == 0
            or strides[0] % features or strides[1] % features or min(strides[:2]) <= 0):
        return None
    batch, kv_heads, slots = x.shape[:3]
    if (kv_heads > 1 and strides[1] < slots * features) or (
            batch > 1 and strides[0] < (kv_heads - 1) * strides[1] + slots * features):
        return None  # rows of different (row, head) pairs would overlap
    # rows up to the last entry's
    last = (batch - 1) * strides[0] // features + (kv_heads - 1) * strides[1] // features + slots
    rows = x.as_strided((last, features), (features, 1))
    return rows, (_row_starts(batch, kv_heads, strides[0] // features, strides[1] // features, index.device)
                  + index).reshape(-1)


@functools.lru_cache(maxsize=64)
def _row_starts(batch: int, kv_heads: int, batch_rows: int, head_rows: int, device: torch.device) -> torch.Tensor:
    """[B, H_kv, 1] the first row of each (row, head) pair, made once per shape (a decode step's
    shapes repeat). Read only."""
    return ((torch.arange(batch, device=device) * batch_rows)[:, None, None]
            + (torch.arange(kv_heads, device=device) * head_rows)[:, None])


def _expanded(index: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """index [B, H_kv, E] expanded over x's features, as torch.gather and scatter_ take it."""
    return index.view(*index.shape, *(1,) * (x.dim() - 3)).expand(*index.shape, *x.shape[3:])


def _advanced(x: torch.Tensor, index: torch.Tensor) -> tuple:
    """The advanced index of x [B, H_kv, S, ...] at index [B, H_kv, E]."""
    batch, kv_heads = x.shape[:2]
    return (torch.arange(batch, device=index.device)[:, None, None],
            torch.arange(kv_heads, device=index.device)[:, None], index)


def gather_entries(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, H_kv, S, *F] at index [B, H_kv, E] -> [B, H_kv, E, *F], a new tensor."""
    if x.dim() == 3 or x.device.type != "cpu":
        return x.gather(2, _expanded(index, x))
    flat = _rows(x, index)
    if flat is None:
        return x[_advanced(x, index)]
    rows, at = flat
    return rows.index_select(0, at).view(*index.shape, *x.shape[3:])


def write_entries_(x: torch.Tensor, index: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
    """x[b, h, index[b, h, e]] = entries[b, h, e] in place (x [B, H_kv, S, *F], entries
    [B, H_kv, E, *F] of x's dtype); returns x. Where an index repeats, the entries written to that
    slot must agree: which write lands is unspecified."""
    if x.dim() == 3 or x.device.type != "cpu":
        return x.scatter_(2, _expanded(index, x), entries)
    flat = _rows(x, index)
    if flat is None:
        x[_advanced(x, index)] = entries
        return x
    rows, at = flat
    rows.index_copy_(0, at, entries.reshape(at.shape[0], rows.shape[1]))
    return x


def add_entries(x: torch.Tensor, index: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
    """A copy of x [B, H_kv, S, *F] with entries [B, H_kv, E, *F] added at index [B, H_kv, E]
    (repeated indices add up, in index order on CPU)."""
    if x.dim() == 3 or x.device.type != "cpu" or math.prod(x.shape[3:]) == 0:
        return x.scatter_add(2, _expanded(index, x), entries)
    out = x.clone(memory_format=torch.contiguous_format)
    flat = _rows(out, index)
    if flat is None:
        return out.index_put_(_advanced(out, index), entries, accumulate=True)
    rows, at = flat
    rows.index_add_(0, at, entries.reshape(at.shape[0], rows.shape[1]))
    return out
