"""Where a paged request's entries live: the planes of an engine's KV blocks, and the engine's kernel.

A serving engine (vLLM) keeps one tensor per layer, ``kv_cache [blocks, H_kv, block_size, C]``
of the model's dtype. keepkv reads each (block, head) cell of ``block_size * C`` elements as
three planes:

    keys    block_size x D      in the engine kernel's packed order (``PagedKernel.orders``)
    values  block_size x D      likewise
    words   block_size x M      fp32 words per slot: position, [bias], the method's extras

so the engine's own cache write fills the key and value planes and its own attention kernel
reads them in place (it takes strided plane views), while the words sit beside them in the same
block, allocated, counted and freed with it.

A method that only evicts attends through the engine's kernel: its entries carry no bias. A
merging method's entries carry votes, ln p added to their logits, which an engine's kernel
cannot add: its decoding requests are attended by keepkv's own paged kernel
(:func:`keepkv.kernels.paged.paged_decode`), which reads the same planes in place and the bias
from word 1 (:meth:`PagedLayout.geometry`), so a slot with votes costs one fp32 word more.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from .kernels.paged import PagedGeometry, plane_entries

NEG_INF = float("-inf")
BIAS_WORD = 1  # which of a biased slot's fp32 words is its bias (word 0: its position)


class PagedKernel(Protocol):
    """An engine's paged attention as the adapter calls it: :class:`TorchPagedKernel` here (the
    reference the tests run), vLLM's CPU kernel in :mod:`keepkv.vllm.backend`."""

    def orders(self, block_size: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[block_size, D] int64 each: where element (slot, d) lies within a block's key plane and
        within its value plane (the packing the kernel's cache write uses)."""

    def write(self, keys_plane, values_plane, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """The engine's cache write: keys, values [N, H_kv, D] into slots [N] (int64, block *
        block_size + offset) of the planes [blocks, H_kv, block_size * D]."""

    def plan(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_heads: int, layout: "PagedLayout"):
        """What the kernel needs of one call's shapes (int32 host tensors: [R + 1], [R]), built once
        per step and shared by every layer whose requests hold the same sizes."""

    def attend(self, query: torch.Tensor, keys_plane, values_plane, block_table: torch.Tensor,
               query_start_loc: torch.Tensor, seq_lens: torch.Tensor, plan, scaling: float, output: torch.Tensor) -> None:
        """Causal attention of query [T, H, D] (request after request, as ``query_start_loc``)
        over each request's first ``seq_lens`` slots (its last query tokens are its last slots),
        through ``block_table`` [R, max_blocks] int32, into output [T, H, D]."""


class TorchPagedKernel:
    """A paged kernel in plain torch: the reference the tests run where no engine is installed.
    Its key planes are packed as vLLM's CPU "vec" kernel packs them (each block's keys transposed,
    [D, block_size]), its value planes plainly, so the adapter's reads and writes of packed
    planes are exercised. Its attention gathers each request's blocks (a loop over requests)."""

    @functools.lru_cache(maxsize=8)
    def orders(self, block_size: int, head_dim: int, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
        slot = torch.arange(block_size)[:, None]
        dim = torch.arange(head_dim)[None, :]
        return dim * block_size + slot, slot * head_dim + dim

    def write(self, keys_plane, values_plane, keys, values, slots) -> None:
        head_dim = keys.shape[-1]
        block_size = keys_plane.shape[-1] // head_dim
        key_order, value_order = self.orders(block_size, head_dim)
        block = (slots // block_size)[:, None, None]
        heads = torch.arange(keys.shape[1])[None, :, None]
        offset = slots % block_size
        keys_plane[block, heads, key_order[offset][:, None, :]] = keys.to(keys_plane.dtype)
        values_plane[block, heads, value_order[offset][:, None, :]] = values.to(values_plane.dtype)

    def plan(self, query_start_loc, seq_lens, num_heads, layout):
        return None

    def attend(self, query, keys_plane, values_plane, block_table, query_start_loc, seq_lens, plan, scaling,
               output) -> None:
        kv_heads, cell = keys_plane.shape[1:]
        head_dim = query.shape[-1]
        block_size = cell // head_dim
        key_order, value_order = self.orders(block_size, head_dim)
        starts = query_start_loc.tolist()
        for row, length in enumerate(seq_lens.tolist()):
            blocks = block_table[row, : math.ceil(length / block_size)].long()
            keys = keys_plane[blocks][..., key_order].transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :length]
            values = values_plane[blocks][..., value_order].transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :length]
            rows = query[starts[row] : starts[row + 1]].float()  # [q, H, D]
            block = rows.shape[0]
            grouped = rows.transpose(0, 1).reshape(kv_heads, -1, block, head_dim)  # [H_kv, g, q, D]
            logits = grouped @ keys.float().transpose(-1, -2)[:, None] * scaling  # [H_kv, g, q, S]
            visible = torch.arange(length)[None, :] <= (length - block + torch.arange(block))[:, None]
            probs = logits.masked_fill(~visible, NEG_INF).softmax(-1)
            attended = probs @ values.float()[:, None]  # [H_kv, g, q, D]
            output[starts[row] : starts[row + 1]] = attended.reshape(-1, block, head_dim).transpose(0, 1).to(output.dtype)


@dataclass(frozen=True)
class PagedLayout:
    """One layer's planes, for a model of ``kv_heads`` KV heads of ``head_dim`` (shapes in the
    module docstring). ``biased``: the words hold the bias too (word :data:`BIAS_WORD`);
    ``words``: M, the fp32 words per slot (position, [bias], extras)."""

    block_size: int
    kv_heads: int
    head_dim: int
    words: int
    dtype: torch.dtype
    biased: bool

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @functools.cached_property  # a frozen layout: once
    def cell_bytes(self) -> int:
        """Bytes of one slot of one KV head: its key, value and words (vLLM's ``state_content_bytes``)."""
        return 2 * self.head_dim * self.itemsize + 4 * self.words

    @functools.cached_property  # a frozen layout: once
    def cell(self) -> int:
        """Elements of the model's dtype in one (block, head) cell of ``block_size`` slots."""
        return self.block_size * self.cell_bytes // self.itemsize

    @functools.cached_property  # a frozen layout: once
    def _plane_words(self) -> int:
        return 2 * self.block_size * self.head_dim * self.itemsize // 4

    def planes(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys, values) planes [blocks, H_kv, block_size * D] (views of ``kv_cache``) and its
        fp32 view, flat (the words are indexed in it: :meth:`word_index`)."""
        blocks = kv_cache.shape[0]
        cells = kv_cache.view(blocks, self.kv_heads, self.cell)
        plane = self.block_size * self.head_dim
        return cells[..., :plane], cells[..., plane : 2 * plane], kv_cache.view(-1).view(torch.float32)

    def word_index(self, blocks: torch.Tensor, heads: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Index in the flat fp32 view of word 0 of slot ``offsets`` of ``blocks``, ``heads``
        (broadcast together)."""
        cell_words = self.cell * self.itemsize // 4
        return (blocks * self.kv_heads + heads) * cell_words + self._plane_words + offsets * self.words

    def geometry(self, key_order: torch.Tensor, value_order: torch.Tensor) -> PagedGeometry:
        """Where keepkv's paged kernel finds an entry's key, value and bias (a biased layout's), for
        planes packed as ``key_order``, ``value_order`` say (:meth:`PagedKernel.orders`). ValueError,
        in one line, for a packing it does not read (each block's plane slot-major or dim-major)."""
        packed = []
        for name, order in (("keys", key_order), ("values", value_order)):
            by_dim = self._packing(order)
            if by_dim is None:
                raise ValueError(f"keepkv's paged kernel reads {name} packed per block slot by slot or dimension by "
                                 f"dimension; this engine's kernel packs them otherwise")
            packed.append(by_dim)
        return PagedGeometry(self.block_size, self.kv_heads, self.head_dim, self.cell,
                             keys_by_dim=packed[0], values_by_dim=packed[1], words_at=self._plane_words,
                             words=self.words, bias_word=BIAS_WORD if self.biased else -1)

    def _packing(self, order: torch.Tensor) -> bool | None:
        """Whether ``order`` [block_size, D] packs a plane dimension by dimension (True), slot by
        slot (False), or otherwise (None)."""
        slot = torch.arange(self.block_size, device=order.device)[:, None]
        dim = torch.arange(self.head_dim, device=order.device)[None, :]
        if torch.equal(order, slot * self.head_dim + dim):
            return False
        if torch.equal(order, dim * self.block_size + slot):
            return True
        return None

    def unpack(self, cells: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """[N, H_kv, block_size * D] planes of N blocks -> [N, H_kv, block_size, D] entries, as ``order``
        [block_size, D] packs them: a view where the packing is plain or each block transposed
        (vLLM's "vec" keys), else one gather along the plane."""
        by_dim = self._packing(order)
        if by_dim is not None:
            return plane_entries(cells, self.block_size, self.head_dim, by_dim)
        count, heads = cells.shape[:2]
        return cells.index_select(-1, order.flatten()).view(count, heads, self.block_size, self.head_dim)
