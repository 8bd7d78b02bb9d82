"""Where a paged cache keeps each slot's key, value and words (:class:`PagedGeometry`), and the
check every paged decode backend runs on its call (:func:`check_call`): shared by
:mod:`keepkv.kernels.paged` and its backends, which it imports on first use."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedGeometry:
    """Where slot ``s`` of (block, KV head) keeps its key, value and bias (the layout is
    :mod:`keepkv.kernels.paged`'s module docstring).

    Offsets count the model dtype's elements within a cell (keys, values) or fp32 words within it
    (words); ``cell`` is a cell's length in elements of the model dtype."""

    block_size: int
    kv_heads: int
    head_dim: int
    cell: int
    keys_at: int = 0
    values_at: int = -1  # default: right after the keys
    keys_by_dim: bool = False  # keys packed [head_dim, block_size] per cell (vLLM's CPU "vec" kernel)
    values_by_dim: bool = False
    words_at: int = 0  # fp32 word of slot 0's first word, within a cell
    words: int = 0  # fp32 words per slot
    bias_word: int = -1  # which of a slot's words is its bias; -1: no bias

    def __post_init__(self):
        if self.values_at < 0:
            object.__setattr__(self, "values_at", self.keys_at + self.block_size * self.head_dim)

    @property
    def biased(self) -> bool:
        return self.bias_word >= 0


def check_call(query, kv_cache, block_table, seq_lens, geometry: PagedGeometry, max_len: int) -> None:
    """ValueError, in one line, unless a paged decode call's tensors fit ``geometry`` and each other
    (every backend of :func:`keepkv.kernels.paged.paged_decode` reads them alike)."""
    if query.dim() != 3 or query.shape[-1] != geometry.head_dim or query.shape[1] % geometry.kv_heads:
        raise ValueError(f"paged_decode needs query [R, H, {geometry.head_dim}] with H a multiple of "
                         f"{geometry.kv_heads} KV heads; got {tuple(query.shape)}")
    if kv_cache.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"paged_decode reads float32, bfloat16 or float16 caches; got {kv_cache.dtype}")
    if kv_cache.numel() % (geometry.kv_heads * geometry.cell) or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be contiguous blocks of {geometry.kv_heads} cells of {geometry.cell} elements")
    rows = query.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != rows or tuple(seq_lens.shape) != (rows,):
        raise ValueError(f"block_table [R, blocks] and seq_lens [R] must match the query's R = {rows}; got "
                         f"{tuple(block_table.shape)} and {tuple(seq_lens.shape)}")
    if max_len > block_table.shape[1] * geometry.block_size:
        raise ValueError(f"max_len {max_len} is more than a block table of {block_table.shape[1]} blocks holds")
    if geometry.biased and geometry.cell * kv_cache.element_size() % 4:
        raise ValueError(f"a biased cell of {geometry.cell} {kv_cache.dtype} elements is not a whole number of fp32 words")
