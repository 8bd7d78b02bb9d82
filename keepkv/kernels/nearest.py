"""The most cosine-similar allowed slot of each evicted entry (D2O eq. 8; KeepKV's merge target), in
keepkv's C++ CPU kernels: the decode-time path of :func:`keepkv.merging.cosine_nearest`, which has
the contract and the torch code.

A decode step's plan evicts a few entries per row and KV head (E, up to the interval) and searches
the few hundred kept ones; in torch that is a normalisation of every key, a batched GEMM of few
columns, a masked fill and a max, each over [B, H_kv, E, S]. The C++ search (``paged_cpu.cpp``,
built by :mod:`keepkv.kernels.paged_cpp`) does it in one pass per (row, KV head), reading fp32,
bf16 or fp16 keys in place, the evicted entries side by side in vector lanes (each candidate's
key is read once per W of them). It agrees with the torch code to fp32 rounding: the same slot but where
two candidates' similarities are within it (``tests/test_nearest.py``).
"""

from __future__ import annotations

import torch

MAX_EVICTED = 64  # past this many evicted entries per row and head (a prompt's end), torch's GEMM is faster
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def cpp_takes(keys: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether :func:`nearest_cpp` serves this search: keys on CPU in a dtype it reads, dimensions
    contiguous, at most MAX_EVICTED evicted entries per row and head, outside ``torch.compile``,
    where keepkv's C++ kernels build (:func:`keepkv.kernels.paged.cpu_backend`)."""
    if keys.device.type != "cpu" or keys.dtype not in _DTYPES or src.shape[-1] > MAX_EVICTED:
        return False
    if torch.compiler.is_compiling():  # a raw-address call has no place in a graph
        return False
    from .paged import cpu_backend

    return cpu_backend() == "cpp"


def nearest_cpp(keys: torch.Tensor, src: torch.Tensor, allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot [B, H_kv, E] int64, similarity [B, H_kv, E] fp32) of the allowed slot whose key is most
    cosine-similar to each evicted entry's: the first of the largest; -inf (and slot 0) where a row
    and head allows none. keys [B, H_kv, S, D]; src [B, H_kv, E] (negative: slot 0); allowed
    [B, H_kv, S] bool."""
    from .paged_cpp import extension

    batch, kv_heads, size, dim = keys.shape
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    src = src if src.dtype == torch.int64 else src.long()
    allowed = allowed if allowed.dtype == torch.bool else allowed.bool()
    evicted = src.shape[-1]
    idx = torch.empty(batch, kv_heads, evicted, dtype=torch.int64)
    sim = torch.empty(batch, kv_heads, evicted)
    error = extension().nearest(
        keys.data_ptr(), src.data_ptr(), allowed.data_ptr(), idx.data_ptr(), sim.data_ptr(), _DTYPES[keys.dtype],
        batch, kv_heads, size, dim, evicted, *keys.stride()[:3], *src.stride(), *allowed.stride())
    if error:
        raise ValueError(f"the C++ nearest search does not take keys {tuple(keys.shape)}")
    return idx, sim
