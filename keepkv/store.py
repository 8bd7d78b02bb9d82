"""LayerStore: the kept KV entries of one layer, and the only code that writes them.

One storage layout serves every method. Per layer, for B rows and H_kv KV heads:

    keys, values : [B, H_kv, S, D]  the kept entries; S is the layer's size, the most any
                                    row or head keeps
    bias         : [B, H_kv, S]     fp32, added to every query's logit for that entry:
                                    0 plain token, log p for p Electoral Votes, -inf empty slot
    positions    : [B, H_kv, S]     int64 original position of the entry within its row
                                    (first real token = 0), -1 for an empty slot
    extras[name] : [B, H_kv, S,...] per-entry state of the method (scores, counts), kept
                                    aligned with the entries through every append and select

Each is the prefix view of a contiguous buffer with spare slots (an eighth of its length while
the layer is uncompressed, one compression interval's worth once it is compressed), so a decode
step appends in place, and a decode-time compression that sheds at most that spare room moves
the kept new entries into the freed slots (``keep``). The tensors really shrink when a method
compresses: nothing is masked in place.

The store owns its tensors: they are read-only attributes, and a method changes them only
through the methods below (``keep``, ``select``, ``drop``, ``write``, ``merge_into``, ``overwrite``,
``add_to``, ``reload``), which write into the buffers in place. So the store always knows whether
its bias is still binary (0 or -inf: attention may then pass it as a bool mask), and no write
reallocates a layer behind its back.
"""

from __future__ import annotations

import types

import torch
from transformers.cache_utils import CacheLayerMixin

from .attention import NEG_INF
from .entries import gather_entries, write_entries_
# An uncompressed layer's buffers grow by an eighth of their length, at least GROWTH_MIN slots:
# reallocations stay rare on long sequences and spare slots stay a small share of short ones.
# A compressed layer keeps room for one interval's appends instead (LayerStore.headroom).
GROWTH_MIN = 8
GROWTH_SHARE = 8
CORE = ("keys", "values", "bias", "positions")


def _move(tensor: torch.Tensor, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Copy the entries at ``source`` [B, H_kv, n] onto ``target`` slots of tensor [B, H_kv, S, ...],
    in place (all sources are read before any target is written)."""
    return write_entries_(tensor, target, gather_entries(tensor, source))


def slots_of(mask: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``count`` slots of mask [B, H_kv, S] in slot order, True slots first:
    (index, index's slot is True), both [B, H_kv, count].

    A top-k of ``count``, not a sort of S: a True slot s ranks 2S - s, a False one S - s, so the
    order is a stable sort's (True before False, each in slot order), at the cost of the few
    slots asked for (a decode step's ``keep`` asks for one or two).
    """
    size = mask.shape[-1]
    reverse = torch.arange(size, 0, -1, device=mask.device)  # S - s
    index = (reverse + mask * size).topk(count, dim=-1).indices
    return index, mask.gather(-1, index)


def write_rows(x: torch.Tensor, groups, merged: torch.Tensor) -> torch.Tensor:
    """x [B, H_kv, S(, D)] with each valid group's merged row [B, H_kv, E(, D)] at its slot
    (``groups``: a merge's :class:`keepkv.merging.Groups`), written in place; returns x.

    Invalid group ids rewrite a value that is written anyway (group 0's, or slot 0's own value
    in a (row, head) without merges), so all writes to one slot agree and every slot that is no
    target stays bit-identical.
    """
    merged = merged.to(x.dtype)
    trailing = (1,) * (x.dim() - 3)  # the feature axis D, if any
    valid = groups.valid.view(*groups.valid.shape, *trailing)
    # group 0 is valid iff the (row, head) merges anything; else slot 0 gets its own value back
    first = merged.narrow(2, 0, 1).where(valid.narrow(2, 0, 1), x.narrow(2, 0, 1))
    if groups.valid.shape[-1] == 1:  # one group: its row is ``first``
        rows, slot = first, groups.slot
    else:
        rows = merged.where(valid, first)
        slot = groups.slot.where(groups.valid, groups.slot[..., :1])  # [B, H_kv, E]
    return write_entries_(x, slot, rows)


def split_evenly(total: int, rows: int) -> torch.Tensor:
    """[rows] int64 shares of ``total`` that differ by at most 1 and add up to it."""
    share, left = divmod(total, rows)
    return torch.full((rows,), share, dtype=torch.long) + (torch.arange(rows) < left).long()


class LayerStore(CacheLayerMixin):
    """The kept entries of one layer (shapes in the module docstring).

    Beside the tensors it tracks
    ``seen``: tokens fed so far, padding included (the logical length HF sees);
    ``real_seen`` [B]: real tokens fed so far per row;
    ``budget`` [B, H_kv]: entries each row and head keeps after a compression (None: unlimited),
    with ``capacity`` and ``min_budget`` its largest and smallest entry (``set_budget``);
    ``interval``: the decode steps between compressions, so that between steps a row and head
    holds at most ``bound`` = budget + interval - 1 entries (:meth:`keepkv.step.LayerStep.set_budget`);
    ``row_budget`` [B]: each row's mean budget over the layers (what a method's recent window is
    a share of);
    ``frozen`` [B] or None: each row's prompt length when its prompt is kept
    (``CompressedCache(decoding="keep_prompt")``): the entries of positions below it never leave
    and never take a merge; ``frozen_held`` [B]: how many entries that is (the prompt's length,
    unless its chunks were compressed as they came: ``start_prefill(chunk_keep=(N, K))``);
    ``pending``: tokens appended since the last compression;
    ``state``: the method's per-layer state that is not per entry (the method's own dict).
    """

    is_sliding = False

    def __init__(self, layer_idx: int, shared: dict | None = None):
        # Not CacheLayerMixin.__init__: it assigns keys and values, which are read-only here.
        self.is_initialized = False
        self.layer_idx = layer_idx
        # [B] the model's layer of each row, on the host, where stack() joined rows of several layers
        # (the paged step compresses a step's layers as one batch); None: every row is layer_idx's.
        self.row_layers: tuple[int, ...] | None = None
        # The method's per-cache objects, one dict shared by every layer of a cache (KVReviver's
        # rebuild tracker): not per row, not per layer, and not counted as cache bytes.
        self.shared = {} if shared is None else shared
        self._tensors: dict[str, torch.Tensor] = {}  # buffer name ("keys", "extras.score") -> prefix view
        self._extra_fill: dict[str, float] = {}
        self.state: dict = {}
        self.seen = 0
        self.real_seen: torch.Tensor | None = None
        self.budget: torch.Tensor | None = None
        self.row_budget: torch.Tensor | None = None
        self.capacity = 0
        self.min_budget = 0
        self.interval = 1
        self.frozen: torch.Tensor | None = None
        self.frozen_held: torch.Tensor | None = None
        self.pending = 0
        self.prefill_stats = None
        self.buffers: dict[str, torch.Tensor] = {}
        self.headroom: int | None = None  # spare slots of a compressed layer; None: grow in proportion
        self._binary: bool | None = True  # the bias holds only 0 and -inf (None: not known yet)

    # -- the tensors, read-only ------------------------------------------------------------
    keys = property(lambda self: self._tensors.get("keys"), doc="[B, H_kv, S, D] kept keys.")
    values = property(lambda self: self._tensors.get("values"), doc="[B, H_kv, S, D] kept values.")
    bias = property(lambda self: self._tensors.get("bias"), doc="[B, H_kv, S] fp32 ln p, -inf on empty slots.")
    positions = property(lambda self: self._tensors.get("positions"), doc="[B, H_kv, S] int64, -1 on empty slots.")

    @property
    def extras(self) -> types.MappingProxyType:
        """Read-only {name: [B, H_kv, S, ...]} per-entry method state."""
        return types.MappingProxyType({name[7:]: t for name, t in self._tensors.items() if name.startswith("extras.")})

    @property
    def extra_fill(self) -> types.MappingProxyType:
        """Read-only {name: value a new token's entry starts at}."""
        return types.MappingProxyType(self._extra_fill)

    def _name(self, name: str) -> str:
        """The buffer name of a core tensor or an extra."""
        if name in CORE:
            return name
        if f"extras.{name}" in self._tensors:
            return f"extras.{name}"
        raise KeyError(f"the layer store has no tensor {name!r}")

    # -- CacheLayerMixin -------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, kv_heads, _, head_dim = key_states.shape
        device = key_states.device
        self.dtype, self.device = key_states.dtype, device
        self._tensors = {
            "keys": key_states.new_zeros(batch, kv_heads, 0, head_dim),
            "values": value_states.new_zeros(batch, kv_heads, 0, value_states.shape[-1]),
            "bias": torch.zeros(batch, kv_heads, 0, device=device),
            "positions": torch.zeros(batch, kv_heads, 0, dtype=torch.long, device=device),
        }
        self.real_seen = torch.zeros(batch, dtype=torch.long, device=device)
        self._binary = True
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        # The attention function appends (it needs the padding mask); see CompressedCache.update.
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        """-1: no maximum length. An abstract method of transformers' CacheLayerMixin, which
        ``Cache.get_max_length`` asks of every layer."""
        return -1

    def reset(self) -> None:
        self.shared.clear()
        self.__init__(self.layer_idx, self.shared)

    # The layer-level row hooks of CacheLayerMixin would move keys and values only: the
    # CompressedCache's hooks move every per-row tensor, the method's state included.
    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        raise ValueError("reorder_cache: call it on the CompressedCache, which also moves the method's state")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ValueError("batch_repeat_interleave: call it on the CompressedCache, which also moves the method's state")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise ValueError("batch_select_indices: call it on the CompressedCache, which also moves the method's state")

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("crop: call it on the CompressedCache")

    # -- sizes and budgets -----------------------------------------------------------------
    @property
    def size(self) -> int:
        """Physical capacity S."""
        bias = self.bias
        return 0 if bias is None else bias.shape[-1]

    def set_budget(self, budget: torch.Tensor | None, row_budget: torch.Tensor | None = None,
                   frozen: torch.Tensor | None = None, interval: int = 1,
                   frozen_held: torch.Tensor | None = None) -> None:
        """Entries each row and head keeps after a compression [B, H_kv] (None: unlimited), each
        row's mean budget [B], and the decode steps between compressions (``interval``); ``capacity``
        and ``min_budget`` are derived here (one host sync, at the end of a prefill or when rows
        move). ``frozen`` [B]: the entries of positions below it (the row's
        prompt) are kept as they are (:meth:`frozen_entries`), unscored: their extras go back to
        their fill values and no later ``add_to`` or ``overwrite`` changes them. ``frozen_held`` [B]:
        the entries below ``frozen`` (default ``frozen``: a prompt held whole); given, ``frozen``
        may have moved (a prompt whose chunks are compressed as they come), and the entries it
        newly covers are unscored too."""
        self.budget = budget
        self.row_budget = row_budget
        self.interval = interval
        newly_frozen = frozen is not None and (self.frozen is None or frozen_held is not None)
        self.frozen = frozen
        self.frozen_held = frozen if frozen_held is None or frozen is None else frozen_held
        if newly_frozen:
            mask = self.frozen_entries()
            for name in self.extras:
                current = self._tensors[f"extras.{name}"]
                current.masked_fill_(mask.view(*mask.shape, *(1,) * (current.dim() - 3)), self._extra_fill[name])
        if budget is None:
            self.capacity = self.min_budget = 0
        else:
            self.capacity, self.min_budget = int(budget.max()), int(budget.min())

    @property
    def bound(self) -> torch.Tensor | None:
        """[B, H_kv] the most entries each row and head holds between steps: its budget at a
        compression plus the interval's appends before the next, interval - 1 (None: unlimited)."""
        return None if self.budget is None else self.budget + (self.interval - 1)

    def reserve(self, headroom: int | None) -> None:
        """Spare slots each (re)allocation of the buffers gets (:meth:`spare_slots`); None: grow in
        proportion to the entries held."""
        self.headroom = headroom

    def restart_interval(self) -> None:
        """A compression just ran (or the prompt closed): no token is pending since."""
        self.pending = 0

    def resume(self, *, state: dict | None = None, pending: int | None = None) -> None:
        """Take up a sequence whose layer was rebuilt between steps (``from_entries``: a serving
        engine's request): the method's per-layer ``state`` it had (added to ``self.state``) and the
        tokens ``pending`` since its last compression. None leaves a field as it is."""
        if state:
            self.state.update(state)
        if pending is not None:
            self.pending = pending

    @property
    def open_budget(self) -> torch.Tensor | None:
        """[B, H_kv] entries each row and head keeps beyond a kept prompt's (``budget`` less the frozen
        prompt, ``decoding="keep_prompt"``; ``budget`` itself when no prompt is kept): what a
        selection's recent window and sinks are shares of."""
        if self.budget is None or self.frozen is None:
            return self.budget
        return self.budget - self.frozen_held[:, None]

    def binary_bias(self) -> bool:
        """True if the bias holds only 0 and -inf: only appends, selections and drops wrote it (or,
        for a store built not knowing, :meth:`from_entries`' ``binary=None``, its bias says so when
        first asked)."""
        if self._binary is None:
            self._binary = bool((torch.isneginf(self.bias) | (self.bias == 0)).all())
        return self._binary

    def live(self) -> torch.Tensor:
        """[B, H_kv, S] bool: slots holding an entry."""
        return self.bias > NEG_INF

    def frozen_entries(self) -> torch.Tensor | None:
        """[B, H_kv, S] bool: the live entries that are kept as they are (a kept prompt's), or None:
        a compression never evicts them, and a merge never writes into them."""
        if self.frozen is None:
            return None
        return (self.positions < self.frozen[:, None, None]) & self.live()

    def live_counts(self) -> torch.Tensor:
        """[B, H_kv] entries kept per row and head."""
        return self.live().sum(-1)

    def add_extra(self, name: str, fill: float = 0.0, dtype=torch.float32, trailing=()) -> None:
        """Register a per-entry tensor that follows the entries; new tokens get ``fill``."""
        if f"extras.{name}" in self._tensors:
            return
        batch, kv_heads, size = self.bias.shape
        with torch.inference_mode(False):  # written in place, as the buffers (see _new_buffer)
            self._tensors[f"extras.{name}"] = torch.full(
                (batch, kv_heads, size, *trailing), fill, dtype=dtype, device=self.device
            )
        self._extra_fill[name] = fill

    # -- writes of the cache: appends and row moves ----------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor, is_real: torch.Tensor) -> None:
        """Append a block of q new tokens, in place when the buffers have room.

        keys, values: [B, H_kv, q, D]; is_real: [B, q] bool, False for left padding.
        """
        batch, kv_heads, block = keys.shape[:3]
        block_pos = self.real_seen[:, None] + is_real.long().cumsum(-1) - 1
        block_pos = block_pos.masked_fill(~is_real, -1)
        block_bias = torch.zeros(batch, block, device=self.device).masked_fill(~is_real, NEG_INF)
        fresh = {
            "keys": keys,
            "values": values,
            "bias": block_bias[:, None].expand(batch, kv_heads, block),
            "positions": block_pos[:, None].expand(batch, kv_heads, block),
        }
        for name, current in self._tensors.items():
            block_of = fresh[name] if name in fresh else self._extra_fill[name[7:]]
            self._tensors[name] = self._extend(name, current, block_of, block)
        self.seen += block
        self.real_seen = self.real_seen + is_real.sum(-1)
        self.pending += block

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` [B'] (int64, repeats allowed) of every per-row tensor, in that order:
        keys, values, bias, positions, extras (their buffers' spare slots too), ``real_seen`` and
        the budgets. The method's per-layer state is the method's to move (``Method.select_rows``)."""
        if not self.is_initialized:
            return
        index = index.to(self.device)
        for name, current in self._tensors.items():
            buffer = self._buffer_of(name, current)
            if buffer is None:
                self._tensors[name] = current.index_select(0, index)
            else:
                self.buffers[name] = buffer.index_select(0, index)
                self._tensors[name] = self.buffers[name].narrow(2, 0, current.shape[2])
        self.real_seen = self.real_seen.index_select(0, index)
        if self.budget is not None:
            row_budget = None if self.row_budget is None else self.row_budget.index_select(0, index)
            frozen = None if self.frozen is None else self.frozen.index_select(0, index)
            held = None if self.frozen_held is self.frozen else self.frozen_held.index_select(0, index)
            self.set_budget(self.budget.index_select(0, index), row_budget, frozen, self.interval, held)
        if self.prefill_stats is not None:
            self.prefill_stats = self.prefill_stats.rows(index)

    # -- writes of a compression -----------------------------------------------------------
    def select(self, index: torch.Tensor, valid: torch.Tensor) -> None:
        """Keep only the entries at ``index`` [B, H_kv, K]; slots where ``valid`` is False become empty."""
        kept = index.shape[2]
        # The spare slots copy any kept entry; appends overwrite them.
        index = torch.cat([index, index[..., :1].expand(-1, -1, self.spare_slots(kept))], dim=-1)
        rows = {}  # source slots -> flat row index, shared by the tensors whose buffers match
        for name, current in self._tensors.items():
            self._tensors[name] = self._gather(name, current, index, kept, rows)
        self.bias.masked_fill_(~valid, NEG_INF)
        self.positions.masked_fill_(~valid, -1)

    def keep(self, kept: torch.Tensor, slots: int) -> None:
        """Keep the entries where ``kept`` [B, H_kv, S] and shrink the layer to ``slots`` (>= the most
        any row and head keeps).

        A decode step sheds only the few slots past ``slots`` (one per interval step): the kept
        entries among them move into the freed slots below, in place, and the rest stays where it
        is, since positions are stored and attention does not depend on order. Any larger shrink
        (the end of a prefill) copies the kept entries into a new buffer (:meth:`select`).
        """
        tail = self.size - slots
        if tail > (self.headroom or 0):
            self.select(*slots_of(kept, slots))
            return
        self.drop(~kept)
        if tail > 0:
            # Pair the j-th kept entry of the tail with the j-th free slot below ``slots``: a prefix
            # that keeps at most ``slots`` entries has at least as many free slots as the tail has
            # kept entries (so at most min(tail, slots) move). Unpaired moves go from the tail to the
            # tail, where they are dropped.
            count = min(tail, slots)
            free = (~kept[..., :slots]).to(torch.uint8).topk(count, dim=-1).indices
            if tail == 1:  # a decode step's tail: its one slot is the only mover, no top-k to find it
                source, target = torch.full_like(free, slots), free.where(kept[..., slots:], slots)
            else:
                movers, moves = slots_of(kept[..., slots:], count)
                unpaired = slots + torch.arange(count, device=kept.device).expand_as(free)
                source, target = slots + movers, free.where(moves, unpaired)
            for name, current in self._tensors.items():
                self._tensors[name] = _move(current, source, target).narrow(2, 0, slots)

    def drop(self, mask: torch.Tensor) -> None:
        """Empty the slots where ``mask`` [B, H_kv, S] (bias -inf, position -1), in place."""
        self.bias.masked_fill_(mask, NEG_INF)
        self.positions.masked_fill_(mask, -1)

    def write(self, index: torch.Tensor, **rows: torch.Tensor) -> None:
        """Overwrite the entries at slots ``index`` [B, H_kv, E] (distinct per row and head) with
        ``rows``: name (keys, values, bias, positions or an extra) -> [B, H_kv, E, ...], in place."""
        for name, row in rows.items():
            current = self._tensors[self._name(name)]
            write_entries_(current, index, row.to(current.dtype))
        if "bias" in rows:
            self._binary = False

    def merge_into(self, merged) -> None:
        """Write a merge's rows (:class:`keepkv.merging.MergedRows`: each target slot's merged row per
        tensor name) into the store, in place; every slot that is no target stays bit-identical."""
        for name, rows in merged.rows.items():
            write_rows(self._tensors[self._name(name)], merged.groups, rows)
        if "bias" in merged.rows:
            self._binary = False

    def overwrite(self, **tensors: torch.Tensor) -> None:
        """Overwrite whole tensors (name -> [B, H_kv, S, ...] of the stored shape), in place."""
        frozen = self.frozen_entries()
        for name, tensor in tensors.items():
            current = self._tensors[self._name(name)]
            if frozen is not None:  # a kept prompt's entries stay as they are
                tensor = tensor.where(~frozen.view(*frozen.shape, *(1,) * (current.dim() - 3)), current)
            current.copy_(tensor)
        if "bias" in tensors:
            self._binary = False

    def add_to(self, name: str, delta: torch.Tensor) -> None:
        """Add ``delta`` [B, H_kv, S, ...] to a stored tensor (a method's accumulated scores), in place."""
        current = self._tensors[self._name(name)]
        frozen = self.frozen_entries()
        if frozen is not None:  # a kept prompt's entries stay as they are
            delta = delta.masked_fill(frozen.view(*frozen.shape, *(1,) * (current.dim() - 3)), 0)
        current.add_(delta)
        if name == "bias":
            self._binary = False

    def reload(self, keys: torch.Tensor, values: torch.Tensor, is_real: torch.Tensor) -> None:
        """Replace every entry by ``keys``, ``values`` [B, H_kv, S, D] of S tokens seen from the start
        (is_real [B, S]: False for padding; the store takes the two tensors over): one vote each,
        positions renumbered, every extra back to its fill value, nothing pending (KeepKV's
        periodic refresh)."""
        batch, kv_heads, size = keys.shape[:3]
        positions = (is_real.long().cumsum(-1) - 1).masked_fill(~is_real, -1)
        bias = torch.zeros(batch, size, device=self.device).masked_fill(~is_real, NEG_INF)
        fresh = {
            "keys": keys,
            "values": values,
            "bias": bias[:, None].expand(-1, kv_heads, -1),
            "positions": positions[:, None].expand(-1, kv_heads, -1),
        }
        # Plain tensors, not buffers: the compression that follows a reload gathers the kept
        # entries into new buffers anyway (the loaded keys and values are not copied twice).
        with torch.inference_mode(False):
            for name, current in self._tensors.items():
                if name in ("keys", "values"):
                    self._tensors[name] = fresh[name]
                elif name in fresh:
                    self._tensors[name] = fresh[name].contiguous()
                else:
                    trailing = current.shape[3:]
                    self._tensors[name] = current.new_full((batch, kv_heads, size, *trailing), self._extra_fill[name[7:]])
        self.pending = 0
        self._binary = True

    def spare_slots(self, slots: int) -> int:
        """Spare slots a buffer of ``slots`` in-use slots gets when it is (re)allocated."""
        return self.headroom if self.headroom is not None else max(GROWTH_MIN, slots // GROWTH_SHARE)

    # Every per-entry tensor is the prefix [:, :, :S] of a contiguous buffer [B, H_kv, S + spare, ...],
    # so appends write in place instead of copying the layer (torch.cat) at every step.
    def _buffer_of(self, name: str, current: torch.Tensor) -> torch.Tensor | None:
        """The named buffer if ``current`` is its prefix view, else None."""
        buffer = self.buffers.get(name)
        if (
            buffer is None
            or buffer.data_ptr() != current.data_ptr()
            or buffer.stride() != current.stride()
            or buffer.shape[:2] + buffer.shape[3:] != current.shape[:2] + current.shape[3:]
        ):
            return None
        return buffer

    def _new_buffer(self, name: str, like: torch.Tensor, slots: int) -> torch.Tensor:
        # A normal tensor even under torch.inference_mode: its in-place writes must also work
        # when a later step runs outside it.
        with torch.inference_mode(False):
            buffer = like.new_empty(*like.shape[:2], slots, *like.shape[3:])
        self.buffers[name] = buffer
        return buffer

    def _extend(self, name: str, current: torch.Tensor, block: torch.Tensor | float, length: int):
        """``current`` [B, H_kv, S, ...] followed by ``block`` (a tensor of ``length`` entries, or a
        fill value), as a prefix view of the named buffer."""
        size = current.shape[2]
        buffer = self._buffer_of(name, current)
        if buffer is None or buffer.shape[2] < size + length:
            buffer = self._new_buffer(name, current, size + length + self.spare_slots(size + length))
            buffer.narrow(2, 0, size).copy_(current)
        fresh = buffer.narrow(2, size, length)
        if isinstance(block, torch.Tensor):
            fresh.copy_(block)
        else:
            fresh.fill_(block)
        return buffer.narrow(2, 0, size + length)

    def _gather(self, name: str, current: torch.Tensor, index: torch.Tensor, kept: int, rows: dict) -> torch.Tensor:
        """current[index] along the entry axis (index [B, H_kv, N]) as the first ``kept`` slots of a
        new buffer of N. One index_select over flattened rows, not torch.gather, which on CPU walks
        an expanded index element by element (docs/performance.md has the figures)."""
        source = self._buffer_of(name, current)
        source = current.contiguous() if source is None else source  # [B, H_kv, C, ...]
        batch, kv_heads, slots = source.shape[:3]
        if slots not in rows:
            row_start = torch.arange(batch * kv_heads, device=index.device).view(batch, kv_heads, 1) * slots
            rows[slots] = (row_start + index).view(-1)
        buffer = self._new_buffer(name, source, index.shape[2])
        torch.index_select(source.view(-1, *source.shape[3:]), 0, rows[slots], out=buffer.view(-1, *source.shape[3:]))
        return buffer.narrow(2, 0, kept)

    # -- building a store from tensors -----------------------------------------------------
    @classmethod
    def from_entries(
        cls, layer_idx: int, tensors: dict[str, torch.Tensor], extra_fill: dict[str, float], *, seen: int,
        real_seen: torch.Tensor, binary: bool | None, headroom: int | None = None, shared: dict | None = None,
        buffers: dict[str, torch.Tensor] | None = None,
    ) -> "LayerStore":
        """A store holding copies of ``tensors`` (buffer name -> [B, H_kv, S, ...]: the four core
        tensors and one "extras.NAME" per key of ``extra_fill``), each the prefix of a buffer with
        spare slots: a stacked batch, a fork, a paged request's gathered slots.

        ``buffers``: name -> a contiguous [B, H_kv, S + spare, ...] tensor (not an inference tensor)
        whose prefix is that name's tensor: the store takes it as its buffer instead of copying."""
        store = cls(layer_idx, shared)
        store.headroom = headroom
        keys = tensors["keys"]
        store.dtype, store.device = keys.dtype, keys.device
        size = keys.shape[2]
        buffers = buffers or {}
        for name, tensor in tensors.items():
            if name in buffers and buffers[name].shape[2] == size + store.spare_slots(size):
                store.buffers[name] = buffers[name]
                store._tensors[name] = buffers[name].narrow(2, 0, size)
                continue
            buffer = store._new_buffer(name, tensor, size + store.spare_slots(size)).narrow(2, 0, size)
            store._tensors[name] = buffer.copy_(tensor)
        store._extra_fill = dict(extra_fill)
        store.seen, store.real_seen = seen, real_seen
        store._binary = binary
        store.is_initialized = True
        return store

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """{buffer name: tensor} of every per-entry tensor (a copy of the dict, not of the tensors)."""
        return dict(self._tensors)

    @staticmethod
    def check_stackable(layers: list["LayerStore"]) -> dict[str, str]:
        """Raise ValueError unless ``layers`` can be stacked; returns how each method state joins."""
        if not all(layer.is_initialized for layer in layers):
            raise ValueError("stack: every cache must have seen its prompt")
        for name in ("seen", "pending", "headroom", "interval"):
            if len({getattr(layer, name) for layer in layers}) > 1:
                raise ValueError(f"stack: the caches' layers differ in {name!r}: {[getattr(l, name) for l in layers]}")
        if len({(layer.budget is None, tuple(layer.extras)) for layer in layers}) > 1:
            raise ValueError("stack: the caches do not compress alike (budgets or per-entry extras differ)")
        return _state_joins([layer.state for layer in layers], [layer.keys.shape[0] for layer in layers])

    @classmethod
    def stack(cls, layers: list["LayerStore"], shared: dict | None = None) -> "LayerStore":
        """One layer whose rows are the rows of ``layers`` in order, each padded with empty slots to
        the largest; see :meth:`CompressedCache.stack`. Raises ValueError where they cannot join.
        ``shared``: the per-cache dict of the cache it joins."""
        joins = cls.check_stackable(layers)
        first = layers[0]
        slots = max(layer.size for layer in layers)
        fills = {"keys": 0.0, "values": 0.0, "bias": NEG_INF, "positions": -1}
        fills.update({f"extras.{name}": fill for name, fill in first.extra_fill.items()})

        def stacked(tensors: list[torch.Tensor], fill: float) -> torch.Tensor:
            padded = [tensor.new_full((*tensor.shape[:2], slots, *tensor.shape[3:]), fill) for tensor in tensors]
            for tensor, grown in zip(tensors, padded):
                grown.narrow(2, 0, tensor.shape[2]).copy_(tensor)
            return torch.cat(padded)

        buffers = None
        if all(layer.size == slots and set(layer.buffers) >= set(fills) for layer in layers) and all(
            len({layer.buffers[name].shape[1:] for layer in layers}) == 1 for name in fills
        ):  # one size and like buffers (a step's gathered layers): their buffers joined are the new one's
            with torch.inference_mode(False):  # a normal tensor, as _new_buffer's
                buffers = {name: torch.cat([layer.buffers[name] for layer in layers]) for name in fills}
            tensors = {name: buffer.narrow(2, 0, slots) for name, buffer in buffers.items()}
        else:
            tensors = {name: stacked([layer._tensors[name] for layer in layers], fill) for name, fill in fills.items()}
        out = cls.from_entries(
            first.layer_idx, tensors, dict(first.extra_fill), seen=first.seen,
            real_seen=torch.cat([layer.real_seen for layer in layers]),
            binary=(False if any(layer._binary is False for layer in layers)
                    else None if any(layer._binary is None for layer in layers) else True),
            headroom=first.headroom, shared=shared,
            buffers=buffers,
        )
        out.state = {
            name: torch.cat([layer.state[name] for layer in layers]) if how == "cat" else first.state[name]
            for name, how in joins.items()
        }
        out.pending = first.pending
        if any(layer.row_layers is not None or layer.layer_idx != first.layer_idx for layer in layers):
            out.row_layers = sum((layer.layers_of_rows() for layer in layers), ())
        if first.budget is not None:
            row_budgets = [layer.row_budget for layer in layers]
            frozen = [layer.frozen for layer in layers]
            whole = all(layer.frozen_held is layer.frozen for layer in layers)  # prompts held whole
            out.set_budget(
                torch.cat([layer.budget for layer in layers]),
                None if any(b is None for b in row_budgets) else torch.cat(row_budgets),
                None if any(f is None for f in frozen) else torch.cat(frozen), first.interval,
                None if whole or any(f is None for f in frozen) else torch.cat([layer.frozen_held for layer in layers]),
            )
        return out

    def split(self, counts: list[int]) -> list["LayerStore"]:
        """The inverse of :meth:`stack`: a store per part of ``counts`` rows (in order, summing to B),
        each viewing its rows of this store's buffers (no copy), with its rows of every per-row
        method state (first dimension B) and the other states as they are. Budgets are not set."""
        if sum(counts) != self.keys.shape[0]:
            raise ValueError(f"split: {counts} rows do not add up to the store's {self.keys.shape[0]}")
        rows, parts, start = self.keys.shape[0], [], 0
        for count in counts:
            part = LayerStore(self.layer_idx, self.shared)
            part.headroom, part.dtype, part.device = self.headroom, self.dtype, self.device
            part.buffers = {name: buffer.narrow(0, start, count) for name, buffer in self.buffers.items()}
            part._tensors = {name: tensor.narrow(0, start, count) for name, tensor in self._tensors.items()}
            part._extra_fill = dict(self._extra_fill)
            part.seen, part.real_seen = self.seen, self.real_seen.narrow(0, start, count)
            part._binary = self._binary
            part.is_initialized = True
            part.state = {name: value.narrow(0, start, count)
                          if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows else value
                          for name, value in self.state.items()}
            part.pending = self.pending
            if self.row_layers is not None:
                part.row_layers = self.row_layers[start: start + count]
                part.layer_idx = part.row_layers[0]
                if len(set(part.row_layers)) == 1:  # one layer's rows, as stacked
                    part.row_layers = None
            parts.append(part)
            start += count
        return parts

    def layers_of_rows(self) -> tuple[int, ...]:
        """[B] the model's layer of each row (``row_layers``, or ``layer_idx`` for every row)."""
        return self.row_layers if self.row_layers is not None else (self.layer_idx,) * self.keys.shape[0]

    # -- memory ----------------------------------------------------------------------------
    def entry_nbytes(self) -> int:
        """Bytes one entry of one row takes over the KV heads: keys, values, bias, positions, extras."""
        return sum(t[0, :, 0].numel() * t.element_size() for t in self._tensors.values())

    def nbytes(self) -> int:
        """Bytes held by this layer: the buffers behind its entries (spare slots included), bias,
        positions, per-entry and per-layer method state (tensors, and objects with an ``nbytes()``
        such as KVReviver's sketch; a host-side copy that declares ``in_cache = False`` is reported
        on its own)."""
        if not self.is_initialized:
            return 0
        tensors = [*self._tensors.values()]
        tensors += [value for value in self.state.values() if isinstance(value, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        owned = sum(
            value.nbytes()
            for value in self.state.values()
            if callable(getattr(value, "nbytes", None)) and getattr(value, "in_cache", True)
        )
        return owned + sum(storages.values())

    def row_nbytes(self) -> dict[str, torch.Tensor]:
        """[B] int64 bytes per row, in four parts that add up to ``nbytes()`` over the rows.

        ``entries``: the row's live entries (keys, values, bias, positions, extras);
        ``padding``: its empty slots below the layer's size S (left padding, or slots that
        another row or head of the batch fills); ``spare``: slots past S kept for the next
        appends; ``state``: per-layer method state (every such tensor is laid out per row, so
        each row holds an even share of it).
        """
        batch, kv_heads, size = self.bias.shape
        storages = {}  # storage -> bytes of one slot of one head, over the tensors it backs
        for tensor in self._tensors.values():
            storage = tensor.untyped_storage()
            storages.setdefault(storage.data_ptr(), [storage.nbytes(), 0])[1] += (
                tensor[0, 0, 0].numel() * tensor.element_size()
            )
        slot_bytes = sum(per_slot for _, per_slot in storages.values())
        buffer_bytes = sum(total for total, _ in storages.values())
        live = self.live_counts().sum(-1).cpu()  # [B] over the heads
        return {
            "entries": live * slot_bytes,
            "padding": (kv_heads * size - live) * slot_bytes,
            "spare": split_evenly(buffer_bytes - batch * kv_heads * size * slot_bytes, batch),
            "state": split_evenly(self.nbytes() - buffer_bytes, batch),
        }


def _state_joins(states: list[dict], rows: list[int]) -> dict[str, str]:
    """How a method's per-layer states of several caches join: "cat" for per-row tensors (first
    dimension the cache's rows, the rest alike), "same" for anything equal in all of them."""
    if len({tuple(sorted(state)) for state in states}) > 1:
        raise ValueError("stack: the caches' method states hold different entries")
    joins = {}
    for name in states[0]:
        values = [state[name] for state in states]
        tensors = all(isinstance(v, torch.Tensor) for v in values)
        if tensors and all(v.dim() > 0 and v.shape[0] == n for v, n in zip(values, rows)):
            if len({tuple(v.shape[1:]) for v in values}) > 1:
                raise ValueError(f"stack: the caches' method state {name!r} differs in shape")
            joins[name] = "cat"
        elif tensors and all(torch.equal(values[0], v) for v in values):
            joins[name] = "same"
        elif not any(isinstance(v, torch.Tensor) for v in values) and all(values[0] == v for v in values):
            joins[name] = "same"
        else:
            raise ValueError(f"stack: the caches' method state {name!r} cannot be joined")
    return joins
