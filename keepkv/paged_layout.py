"""Where a paged request's entries live: the planes of an engine's KV blocks, and the engine's kernel.

A serving engine (vLLM) keeps one tensor per layer, ``kv_cache [blocks, H_kv, block_size, C]``
of the model's dtype. keepkv reads each (block, head) cell of ``block_size * C`` elements as
three planes:

    keys    block_size x Dk     in the engine kernel's packed order (``PagedKernel.orders``)
    values  block_size x Dk     likewise
    words   block_size x M      fp32 words per slot: position, [bias], the method's extras

so the engine's own cache write fills the key and value planes and its own attention kernel
reads them in place (it takes strided plane views), while the words sit beside them in the same
block, allocated, counted and freed with it.

Dk = D for a method that only evicts: its entries carry no bias, so the kernel's plain softmax is
its attention. A merging method's entries carry votes, ln p added to their logits, which the
kernel cannot add: their keys are Dk >= D + 2 wide, the bias split into two words that sum to
bias / scaling (a high and a low part, so a bf16 plane keeps it to about 16 bits), and the query
is padded with ones there, so each logit gains exactly the entry's bias; an empty slot's bias is
-inf. Values are padded with zeros, and the output's first D dimensions are the attention's.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Protocol

import torch

NEG_INF = float("-inf")
BIAS_WORDS = 2  # key dimensions past D that carry a biased layout's bias (high and low part)


class PagedKernel(Protocol):
    """An engine's paged attention as the adapter calls it: :class:`TorchPagedKernel` here (the
    reference the tests run), vLLM's CPU kernel in :mod:`keepkv.vllm.backend`."""

    def key_dim(self, head_dim: int, biased: bool) -> int:
        """Dk: the key and value width the kernel attends over for a model head of ``head_dim``
        (``biased``: room for the bias words, rounded up to a width the kernel takes)."""

    def orders(self, block_size: int, key_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[block_size, Dk] int64 each: where element (slot, d) lies within a block's key plane and
        within its value plane (the packing the kernel's cache write uses)."""

    def write(self, keys_plane, values_plane, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """The engine's cache write: keys, values [N, H_kv, Dk] into slots [N] (int64, block *
        block_size + offset) of the planes [blocks, H_kv, block_size * Dk]."""

    def plan(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_heads: int, layout: "PagedLayout"):
        """What the kernel needs of one call's shapes (int32 host tensors: [R + 1], [R]), built once
        per step and shared by every layer whose requests hold the same sizes."""

    def attend(self, query: torch.Tensor, keys_plane, values_plane, block_table: torch.Tensor,
               query_start_loc: torch.Tensor, seq_lens: torch.Tensor, plan, scaling: float, output: torch.Tensor) -> None:
        """Causal attention of query [T, H, Dk] (request after request, as ``query_start_loc``)
        over each request's first ``seq_lens`` slots (its last query tokens are its last slots),
        through ``block_table`` [R, max_blocks] int32, into output [T, H, Dk]."""


class TorchPagedKernel:
    """A paged kernel in plain torch: the reference the tests run where no engine is installed.
    Its key planes are packed as vLLM's CPU "vec" kernel packs them (each block's keys transposed,
    [Dk, block_size]), its value planes plainly, so the adapter's reads and writes of packed
    planes are exercised. Its attention gathers each request's blocks (a loop over requests)."""

    def key_dim(self, head_dim: int, biased: bool) -> int:
        return head_dim + (BIAS_WORDS if biased else 0)

    @functools.lru_cache(maxsize=8)
    def orders(self, block_size: int, key_dim: int, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
        slot = torch.arange(block_size)[:, None]
        dim = torch.arange(key_dim)[None, :]
        return dim * block_size + slot, slot * key_dim + dim

    def write(self, keys_plane, values_plane, keys, values, slots) -> None:
        key_dim = keys.shape[-1]
        block_size = keys_plane.shape[-1] // key_dim
        key_order, value_order = self.orders(block_size, key_dim)
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
        key_dim = query.shape[-1]
        block_size = cell // key_dim
        key_order, value_order = self.orders(block_size, key_dim)
        starts = query_start_loc.tolist()
        for row, length in enumerate(seq_lens.tolist()):
            blocks = block_table[row, : math.ceil(length / block_size)].long()
            keys = keys_plane[blocks][..., key_order].transpose(0, 1).reshape(kv_heads, -1, key_dim)[:, :length]
            values = values_plane[blocks][..., value_order].transpose(0, 1).reshape(kv_heads, -1, key_dim)[:, :length]
            rows = query[starts[row] : starts[row + 1]].float()  # [q, H, Dk]
            block = rows.shape[0]
            grouped = rows.transpose(0, 1).reshape(kv_heads, -1, block, key_dim)  # [H_kv, g, q, Dk]
            logits = grouped @ keys.float().transpose(-1, -2)[:, None] * scaling  # [H_kv, g, q, S]
            visible = torch.arange(length)[None, :] <= (length - block + torch.arange(block))[:, None]
            probs = logits.masked_fill(~visible, NEG_INF).softmax(-1)
            attended = probs @ values.float()[:, None]  # [H_kv, g, q, Dk]
            output[starts[row] : starts[row + 1]] = attended.reshape(-1, block, key_dim).transpose(0, 1).to(output.dtype)


@dataclass(frozen=True)
class PagedLayout:
    """One layer's planes, for a model of ``kv_heads`` KV heads of ``head_dim`` (shapes in the
    module docstring). ``biased``: keys carry the bias words and the words hold the bias too;
    ``words``: M, the fp32 words per slot (position, [bias], extras)."""

    block_size: int
    kv_heads: int
    head_dim: int
    key_dim: int
    words: int
    dtype: torch.dtype
    biased: bool

    @property
    def itemsize(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    @property
    def cell_bytes(self) -> int:
        """Bytes of one slot of one KV head: its key, value and words (vLLM's ``state_content_bytes``)."""
        return 2 * self.key_dim * self.itemsize + 4 * self.words

    @property
    def cell(self) -> int:
        """Elements of the model's dtype in one (block, head) cell of ``block_size`` slots."""
        return self.block_size * self.cell_bytes // self.itemsize

    def planes(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys, values) planes [blocks, H_kv, block_size * Dk] (views of ``kv_cache``) and its
        fp32 view, flat (the words are indexed in it: :meth:`word_index`)."""
        blocks = kv_cache.shape[0]
        cells = kv_cache.view(blocks, self.kv_heads, self.cell)
        plane = self.block_size * self.key_dim
        return cells[..., :plane], cells[..., plane : 2 * plane], kv_cache.view(-1).view(torch.float32)

    def word_index(self, blocks: torch.Tensor, heads: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Index in the flat fp32 view of word 0 of slot ``offsets`` of ``blocks``, ``heads``
        (broadcast together)."""
        cell_words = self.cell * self.itemsize // 4
        plane_words = 2 * self.block_size * self.key_dim * self.itemsize // 4
        return (blocks * self.kv_heads + heads) * cell_words + plane_words + offsets * self.words

    def unpack(self, cells: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """[N, H_kv, block_size * Dk] planes of N blocks -> [N, H_kv, block_size, Dk] entries, as ``order``
        [block_size, Dk] packs them: a view where the packing is plain or each block transposed
        (vLLM's "vec" keys), else one gather along the plane."""
        count, heads = cells.shape[:2]
        slot = torch.arange(self.block_size, device=order.device)[:, None]
        dim = torch.arange(self.key_dim, device=order.device)[None, :]
        if torch.equal(order, slot * self.key_dim + dim):
            return cells.view(count, heads, self.block_size, self.key_dim)
        if torch.equal(order, dim * self.block_size + slot):
            return cells.view(count, heads, self.key_dim, self.block_size).transpose(-1, -2)
        return cells.index_select(-1, order.flatten()).view(count, heads, self.block_size, self.key_dim)

    def key_rows(self, keys: torch.Tensor, bias: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """keys [..., D] as the key plane stores them [..., Dk]: a biased layout's bias [...] split into
        its two words (bias / scaling = high + low; -inf: -inf and 0), zeros past them."""
        if self.key_dim == self.head_dim:
            return keys
        rows = keys.new_zeros(*keys.shape[:-1], self.key_dim)
        rows[..., : self.head_dim] = keys
        if bias is not None:
            scaled = bias.float() / scaling
            high = scaled.to(self.dtype)
            low = (scaled - high.float()).nan_to_num(nan=0.0).to(self.dtype)  # -inf - -inf: the high word says it
            rows[..., self.head_dim] = high
            rows[..., self.head_dim + 1] = low
        return rows

    def padded(self, tensor: torch.Tensor, ones: bool = False) -> torch.Tensor:
        """[..., D] -> [..., Dk] (a value: zeros past D; a query, ``ones``: ones on the bias words)."""
        if self.key_dim == self.head_dim:
            return tensor
        rows = tensor.new_zeros(*tensor.shape[:-1], self.key_dim)
        rows[..., : self.head_dim] = tensor
        if ones:
            rows[..., self.head_dim : self.head_dim + BIAS_WORDS] = 1
        return rows
