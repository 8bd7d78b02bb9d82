"""A paged layer's slots as a compression reads and writes them: gathered into a
:class:`~keepkv.store.LayerStore`, and the store's kept entries written back in place.

A request's entries live in its slots 0..S-1 (:mod:`keepkv.paged`); a block holds, per KV head,
the keys and values in the engine kernel's packing and fp32 words beside them (position, [bias],
the method's extras: :class:`~keepkv.paged_layout.PagedLayout`). Gathering reads a group of rows'
whole blocks once and unpacks them into a store's tensors [R, H_kv, S, ...]; writing back puts
each row's live entries into its first ``sizes`` slots, through the engine's cache write for the
keys and values that changed.

Host reads (each a device sync on a GPU), both in a compression, never in a decode step that
does not compress (on CPU a KeepKV merge reads one more: ``keepkv.attention.static_shapes``):

- :meth:`PagedSlots.gather` asks whether every entry it read has a bias of 0 (a store without
  votes then attends through a bool mask, as the Hugging Face cache's does);
- :meth:`PagedSlots.write_back` lists the slots whose entry or votes changed (``nonzero``): only
  those go through the engine's cache write, so their count depends on the data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .paged_layout import NEG_INF, PagedKernel, PagedLayout
from .store import LayerStore, slots_of


@dataclass
class PagedSlots:
    """One layer's planes in one step (``planes``: :meth:`PagedLayout.planes` of its KV tensor).

    ``orders``: the kernel's key and value packing (:meth:`PagedKernel.orders`); ``extras``: the
    method's per-entry extras, name -> trailing shape, in word order; ``fills``: name -> the fill of
    a new entry; ``headroom``: the spare slots of a gathered store (the method's interval)."""

    planes: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    layout: PagedLayout
    kernel: PagedKernel
    orders: tuple[torch.Tensor, torch.Tensor]
    extras: dict[str, tuple]
    fills: dict[str, float]
    headroom: int

    def write_new(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, word_rows: torch.Tensor,
                  words: torch.Tensor) -> None:
        """New entries: keys, values [N, H_kv, D] through the engine's cache write into slots [N]
        (block * block_size + offset), and their words [N, H_kv, M] at ``word_rows`` [N, H_kv, M]
        (indices in the flat fp32 view)."""
        keys_plane, values_plane, word_plane = self.planes
        self.kernel.write(keys_plane, values_plane, keys, values, slots)
        word_plane.index_put_((word_rows,), words)

    def gather(self, blocks: torch.Tensor, sizes: tuple, seen: tuple, layer: int, first: int = 0) -> LayerStore:
        """A store of each row's ``sizes`` slots from slot ``first`` on (rows of equal size, or one
        row), in slot order, that has seen ``seen`` tokens per row. ``blocks`` [R, n] int64: the
        rows' blocks holding slots 0..first + max(sizes) - 1, read once each."""
        layout = self.layout
        size = max(sizes)
        keys, values = self.read(blocks, size, first)
        slot = torch.arange(first, first + size, device=keys.device)
        word_rows = layout.word_index(blocks[:, slot // layout.block_size][:, None, :],
                                      torch.arange(layout.kv_heads, device=blocks.device)[None, :, None],
                                      slot % layout.block_size)
        meta = self.planes[2][word_rows[..., None] + torch.arange(layout.words, device=blocks.device)]  # [R, H_kv, S, M]
        empty = (slot[None, None, :] - first >= torch.tensor(sizes, device=blocks.device)[:, None, None]).expand(
            len(sizes), layout.kv_heads, size)
        positions = meta[..., 0].long().masked_fill(empty, -1)
        bias = meta[..., 1] if layout.biased else torch.zeros_like(meta[..., 0])
        bias = bias.masked_fill(empty, NEG_INF)
        tensors = {"keys": keys, "values": values, "bias": bias, "positions": positions}
        word = 1 + layout.biased
        for name, shape in self.extras.items():
            width = math.prod(shape)
            extra = meta[..., word : word + width].reshape(*meta.shape[:-1], *shape)
            tensors[f"extras.{name}"] = extra.masked_fill(empty.view(*empty.shape, *(1,) * len(shape)), self.fills[name])
            word += width
        return LayerStore.from_entries(layer, tensors, dict(self.fills), seen=max(seen),
                                       real_seen=torch.tensor(seen, device=blocks.device),
                                       binary=None if layout.biased else True,  # read from the bias if asked
                                       headroom=self.headroom)

    def read(self, blocks: torch.Tensor, size: int, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [R, H_kv, size, D] of slots first..first+size-1 of the rows whose blocks
        are ``blocks`` [R, n]: each block read once (index_select), unpacked from the kernel's order."""
        layout = self.layout
        blocks = blocks[:, first // layout.block_size :]
        count, width = blocks.shape[1], layout.block_size
        read = []
        with torch.inference_mode(False):  # the store's buffers are normal tensors (LayerStore._new_buffer)
            for plane, order in zip(self.planes[:2], self.orders):
                entries = layout.unpack(plane.index_select(0, blocks.flatten()), order)  # [R·n, H_kv, bs, D]
                entries = entries.view(len(blocks), count, layout.kv_heads, width, layout.head_dim).transpose(1, 2)
                entries = entries.reshape(len(blocks), layout.kv_heads, count * width, layout.head_dim)
                read.append(entries[:, :, first % width : first % width + size])
        return read[0], read[1]

    def write_back(self, blocks: torch.Tensor, starts: tuple, store: LayerStore, sizes: tuple,
                   before: tuple[torch.Tensor, torch.Tensor] | None, first: int = 0) -> None:
        """Each row's live entries of ``store`` into its first ``sizes`` slots (counted from slot
        ``first``, the store's first entry's). An entry held in a slot below its row's size stays
        in that slot; the entries past it fill the emptied slots, in slot order. Keys and values
        go through the engine's cache write for the slots whose entry or votes changed (a served
        method changes a slot's key or value only with its entry or its votes); the words of every
        slot a row may write. ``blocks`` [R, n]: the rows' blocks; ``starts`` [R]: the first slot each
        row may write (a kept prompt's slots are an engine's to share); ``before``: ([R, H_kv, S]
        positions, bias) of the slots as they were read, None: they held nothing yet."""
        layout = self.layout
        keys_plane, values_plane, word_plane = self.planes
        kv_heads, rows = layout.kv_heads, len(sizes)
        width = max(sizes)
        live = store.live()
        size = live.shape[-1]
        slot = torch.arange(size, device=live.device)
        after = torch.tensor(sizes, device=live.device)[:, None, None]  # [R, 1, 1]
        source = slot[:width].expand(rows, kv_heads, width)  # the store slot each of a row's slots gets
        spill = size - min(sizes)
        if spill > 0:
            holes = ~live[..., :width] & (slot[:width] < after)
            hole, has_hole = slots_of(holes, min(spill, width))
            mover, has_mover = slots_of(live & (slot >= after), min(spill, width))
            source = source.scatter(-1, hole, mover.where(has_hole & has_mover, hole))
        positions, bias = store.positions.gather(-1, source), store.bias.gather(-1, source)
        starts = torch.tensor(starts, device=live.device)[:, None, None] - first
        writable = ((slot[:width] < after) & (slot[:width] >= starts)).expand(rows, kv_heads, width)
        if before is None:
            changed = writable.any(1)
        else:
            old_positions, old_bias = before
            pad = width - old_positions.shape[-1]
            if pad > 0:
                old_positions = torch.nn.functional.pad(old_positions, (0, pad), value=-1)
                old_bias = torch.nn.functional.pad(old_bias, (0, pad), value=NEG_INF)
            differs = (positions != old_positions[..., :width]) | (bias != old_bias[..., :width])
            changed = (differs & writable).any(1)  # [R, W]: a slot written in every head, if in any
        # Host-side: which slots to write (a compression's few; none that would take a prompt's slot).
        row_index, slot_index = changed.nonzero(as_tuple=True)
        heads = torch.arange(kv_heads)[None, :]
        if row_index.numel():
            slot_index = slot_index + first  # in the request's slots
            flat = blocks[row_index, slot_index // layout.block_size] * layout.block_size + slot_index % layout.block_size
            take = source[row_index, :, slot_index - first]  # [N, H_kv]
            self.kernel.write(keys_plane, values_plane, store.keys[row_index[:, None], heads, take],
                              store.values[row_index[:, None], heads, take], flat)
        # Words of every writable slot: position, bias, extras (scores change everywhere).
        row_index, head_index, slot_index = writable.nonzero(as_tuple=True)
        if row_index.numel():
            take = source[row_index, head_index, slot_index]
            slot_index = slot_index + first
            index = layout.word_index(blocks[row_index, slot_index // layout.block_size], head_index,
                                      slot_index % layout.block_size)
            columns = [store.positions[row_index, head_index, take].float()[:, None]]
            if layout.biased:
                columns.append(store.bias[row_index, head_index, take][:, None])
            for name, shape in self.extras.items():
                if name in store.extras:
                    columns.append(store.extras[name][row_index, head_index, take].reshape(len(take), -1).float())
                else:
                    columns.append(torch.full((len(take), math.prod(shape)), self.fills[name]))
            word_plane.index_put_((index[:, None] + torch.arange(layout.words),), torch.cat(columns, dim=1))
