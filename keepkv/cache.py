"""CompressedCache: the kept KV entries of every layer, and when to compress them.

One storage layout serves every method (DESIGN.md, "Storage"). Per layer, for B rows
and H_kv KV heads:

    keys, values : [B, H_kv, S, D]  the kept entries; S is the layer's size, the most any
                                    row or head keeps
    bias         : [B, H_kv, S]     fp32, added to every query's logit for that entry:
                                    0 plain token, log p for p Electoral Votes, -inf empty slot
    positions    : [B, H_kv, S]     int64 original position of the entry within its row
                                    (first real token = 0), -1 for an empty slot
    extras[name] : [B, H_kv, S,...] per-entry state of the method (scores, counts), kept
                                    aligned with the entries through every append and select

Each is the prefix view of a contiguous buffer with spare slots (an eighth of its length
while the layer is uncompressed, one compression interval's worth once it is compressed),
so a decode step appends in place, and a decode-time compression that sheds at most that
spare room moves the kept new entries into the freed slots (``LayerStore.keep``).
The tensors really shrink when a method compresses: nothing is masked in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention import Needs, StepStats, attend, hand_over, join_prefill_stats
from .diagnostics import warn_budget
from .fused import compiled
from .methods import Method, get_method
from .methods.base import slots_of
from .models import check_architecture, check_context, sliding_window

NEG_INF = float("-inf")
# An uncompressed layer's buffers grow by an eighth of their length, at least GROWTH_MIN slots:
# reallocations stay rare on long sequences and spare slots stay a small share of short ones.
# A compressed layer keeps room for one interval's appends instead (LayerStore.headroom).
GROWTH_MIN = 8
GROWTH_SHARE = 8


def _move(tensor: torch.Tensor, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Copy the entries at ``source`` [B, H_kv, n] onto ``target`` slots of tensor [B, H_kv, S, ...],
    in place (all sources are read before any target is written)."""
    shape = (*source.shape, *tensor.shape[3:])
    source = source.view(*source.shape, *(1,) * (tensor.dim() - 3)).expand(shape)
    target = target.view(*target.shape, *(1,) * (tensor.dim() - 3)).expand(shape)
    return tensor.scatter_(2, target, tensor.gather(2, source))


def split_evenly(total: int, rows: int) -> torch.Tensor:
    """[rows] int64 shares of ``total`` that differ by at most 1 and add up to it."""
    share, left = divmod(total, rows)
    return torch.full((rows,), share, dtype=torch.long) + (torch.arange(rows) < left).long()


class LayerStore(CacheLayerMixin):
    """The kept entries of one layer (shapes in the module docstring).

    Beside the tensors it tracks
    ``seen``: tokens fed so far, padding included (the logical length HF sees);
    ``real_seen`` [B]: real tokens fed so far per row;
    ``budget`` [B, H_kv]: entries each row and head may keep after compression (None: unlimited);
    ``pending``: tokens appended since the last compression;
    ``state``: the method's per-layer state that is not per entry.

    ``binary_bias()`` tells, without a host sync, that the bias still holds only 0 and -inf:
    true while only ``append``, ``select`` and ``keep`` wrote it. Any other write (a method assigning
    log-weights, in place or not) changes the bias tensor or its version counter, and the
    answer turns False for good: a merging method's bias then never reaches a bool mask. The
    buffers are normal tensors even under ``torch.inference_mode`` (whose tensors have no
    version counter), so that in-place writes show.
    """

    is_sliding = False

    def __init__(self, layer_idx: int, shared: dict | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        # The method's per-cache objects, one dict shared by every layer of a cache (KVReviver's
        # rebuild tracker): not per row, not per layer, and not counted as cache bytes.
        self.shared = {} if shared is None else shared
        self.bias: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.extras: dict[str, torch.Tensor] = {}
        self.extra_fill: dict[str, float] = {}
        self.state: dict = {}
        self.seen = 0
        self.real_seen: torch.Tensor | None = None
        self.budget: torch.Tensor | None = None
        self.capacity = 0
        self.min_budget = 0
        self.pending = 0
        self.prefill_stats: StepStats | None = None
        self.buffers: dict[str, torch.Tensor] = {}
        self.headroom: int | None = None  # spare slots of a compressed layer; None: grow in proportion
        self._binary_mark: tuple | None = None

    # -- CacheLayerMixin -------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, kv_heads, _, head_dim = key_states.shape
        device = key_states.device
        self.dtype, self.device = key_states.dtype, device
        self.keys = key_states.new_zeros(batch, kv_heads, 0, head_dim)
        self.values = value_states.new_zeros(batch, kv_heads, 0, value_states.shape[-1])
        with torch.inference_mode(False):  # a version counter for binary_bias()
            self.bias = torch.zeros(batch, kv_heads, 0, device=device)
        self.positions = torch.zeros(batch, kv_heads, 0, dtype=torch.long, device=device)
        self.real_seen = torch.zeros(batch, dtype=torch.long, device=device)
        self._binary_mark = self._bias_mark()
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        # The attention function appends (it needs the padding mask); see CompressedCache.update.
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
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

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` [B'] (int64, repeats allowed) of every per-row tensor, in that order:
        keys, values, bias, positions, extras (their buffers' spare slots too), ``real_seen`` and
        ``budget``. The method's per-layer state is the method's to move (``Method.select_rows``)."""
        if not self.is_initialized:
            return
        binary = self.binary_bias()
        index = index.to(self.device)

        def rows(name: str, current: torch.Tensor) -> torch.Tensor:
            buffer = self._buffer_of(name, current)
            with torch.inference_mode(False):  # a version counter for binary_bias()
                if buffer is None:
                    return current.index_select(0, index)
                self.buffers[name] = buffer.index_select(0, index)
            return self.buffers[name].narrow(2, 0, current.shape[2])

        self.keys, self.values = rows("keys", self.keys), rows("values", self.values)
        self.bias, self.positions = rows("bias", self.bias), rows("positions", self.positions)
        self.extras = {name: rows(f"extras.{name}", extra) for name, extra in self.extras.items()}
        self.real_seen = self.real_seen.index_select(0, index)
        if self.budget is not None:
            self.budget = self.budget.index_select(0, index)
            self.capacity, self.min_budget = int(self.budget.max()), int(self.budget.min())
        if self.prefill_stats is not None:
            self.prefill_stats = _stats_rows(self.prefill_stats, index)
        self._binary_mark = self._bias_mark() if binary else None

    # -- storage ---------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Physical capacity S."""
        return 0 if self.bias is None else self.bias.shape[-1]

    def _bias_mark(self) -> tuple | None:
        """What identifies the bias's current contents: storage, layout and version counter (None
        for an inference tensor, which has none: a method's own tensor)."""
        if self.bias.is_inference():
            return None
        return self.bias.data_ptr(), self.bias.shape, self.bias.stride(), self.bias._version

    def binary_bias(self) -> bool:
        """True if the bias holds only 0 and -inf (see the class docstring); no host sync."""
        return self._binary_mark is not None and self._binary_mark == self._bias_mark()

    def live(self) -> torch.Tensor:
        """[B, H_kv, S] bool: slots holding an entry."""
        return self.bias > NEG_INF

    def live_counts(self) -> torch.Tensor:
        """[B, H_kv] entries kept per row and head."""
        return self.live().sum(-1)

    def add_extra(self, name: str, fill: float = 0.0, dtype=torch.float32, trailing=()) -> None:
        """Register a per-entry tensor that follows the entries; new tokens get ``fill``."""
        if name in self.extras:
            return
        batch, kv_heads, size = self.bias.shape
        self.extras[name] = torch.full((batch, kv_heads, size, *trailing), fill, dtype=dtype, device=self.device)
        self.extra_fill[name] = fill

    def append(self, keys: torch.Tensor, values: torch.Tensor, is_real: torch.Tensor) -> None:
        """Append a block of q new tokens, in place when the buffers have room.

        keys, values: [B, H_kv, q, D]; is_real: [B, q] bool, False for left padding.
        """
        batch, kv_heads, block = keys.shape[:3]
        binary = self.binary_bias()
        block_pos = self.real_seen[:, None] + is_real.long().cumsum(-1) - 1
        block_pos = block_pos.masked_fill(~is_real, -1)
        block_bias = torch.zeros(batch, block, device=self.device).masked_fill(~is_real, NEG_INF)
        self.keys = self._extend("keys", self.keys, keys)
        self.values = self._extend("values", self.values, values)
        self.bias = self._extend("bias", self.bias, block_bias[:, None].expand(batch, kv_heads, block))
        self.positions = self._extend("positions", self.positions, block_pos[:, None].expand(batch, kv_heads, block))
        for name, extra in self.extras.items():
            self.extras[name] = self._extend(f"extras.{name}", extra, self.extra_fill[name], block)
        self.seen += block
        self.real_seen = self.real_seen + is_real.sum(-1)
        self.pending += block
        self._binary_mark = self._bias_mark() if binary else None

    def select(self, index: torch.Tensor, valid: torch.Tensor) -> None:
        """Keep only the entries at ``index`` [B, H_kv, K]; slots where ``valid`` is False become empty."""
        kept = index.shape[2]
        binary = self.binary_bias()
        # The spare slots copy any kept entry; appends overwrite them.
        index = torch.cat([index, index[..., :1].expand(-1, -1, self.spare_slots(kept))], dim=-1)
        rows = {}  # source slots -> flat row index, shared by the tensors whose buffers match
        self.keys = self._gather("keys", self.keys, index, kept, rows)
        self.values = self._gather("values", self.values, index, kept, rows)
        self.bias = self._gather("bias", self.bias, index, kept, rows).masked_fill_(~valid, NEG_INF)
        self.positions = self._gather("positions", self.positions, index, kept, rows).masked_fill_(~valid, -1)
        for name, extra in self.extras.items():
            self.extras[name] = self._gather(f"extras.{name}", extra, index, kept, rows)
        self._binary_mark = self._bias_mark() if binary else None

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
        binary = self.binary_bias()
        self.bias.masked_fill_(~kept, NEG_INF)
        self.positions.masked_fill_(~kept, -1)
        if tail > 0:
            # Pair the j-th kept entry of the tail with the j-th free slot below ``slots``: a prefix
            # that keeps at most ``slots`` entries has at least as many free slots as the tail has
            # kept entries (so at most min(tail, slots) move). Unpaired moves go from the tail to the
            # tail, where they are dropped.
            count = min(tail, slots)
            movers, moves = slots_of(kept[..., slots:], count)
            free = (~kept[..., :slots]).to(torch.uint8).topk(count, dim=-1).indices
            unpaired = slots + torch.arange(count, device=kept.device).expand_as(free)
            source, target = slots + movers, free.where(moves, unpaired)
            for name in ("keys", "values", "bias", "positions"):
                setattr(self, name, _move(getattr(self, name), source, target).narrow(2, 0, slots))
            for name, extra in self.extras.items():
                self.extras[name] = _move(extra, source, target).narrow(2, 0, slots)
        self._binary_mark = self._bias_mark() if binary else None

    def spare_slots(self, slots: int) -> int:
        """Spare slots a buffer of ``slots`` in-use slots gets when it is (re)allocated."""
        return self.headroom if self.headroom is not None else max(GROWTH_MIN, slots // GROWTH_SHARE)

    # Every per-entry tensor is the prefix [:, :, :S] of a contiguous buffer [B, H_kv, S + spare, ...],
    # so appends write in place instead of copying the layer (torch.cat) at every step. A method
    # may assign any tensor instead: the next append then moves it into a new buffer.
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
        with torch.inference_mode(False):  # a version counter for binary_bias()
            buffer = like.new_empty(*like.shape[:2], slots, *like.shape[3:])
        self.buffers[name] = buffer
        return buffer

    def _extend(self, name: str, current: torch.Tensor, block: torch.Tensor | float, length: int | None = None):
        """``current`` [B, H_kv, S, ...] followed by ``block`` (a tensor of q entries, or a fill value
        for ``length`` entries), as a prefix view of the named buffer."""
        size = current.shape[2]
        length = block.shape[2] if isinstance(block, torch.Tensor) else length
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
        new buffer of N. One index_select over flattened rows: several times faster than
        torch.gather on CPU, which walks an expanded index element by element."""
        source = self._buffer_of(name, current)
        source = current.contiguous() if source is None else source  # [B, H_kv, C, ...]
        batch, kv_heads, slots = source.shape[:3]
        if slots not in rows:
            row_start = torch.arange(batch * kv_heads, device=index.device).view(batch, kv_heads, 1) * slots
            rows[slots] = (row_start + index).view(-1)
        buffer = self._new_buffer(name, source, index.shape[2])
        torch.index_select(source.view(-1, *source.shape[3:]), 0, rows[slots], out=buffer.view(-1, *source.shape[3:]))
        return buffer.narrow(2, 0, kept)

    @staticmethod
    def check_stackable(layers: list["LayerStore"]) -> dict[str, str]:
        """Raise ValueError unless ``layers`` can be stacked; returns how each method state joins."""
        if not all(layer.is_initialized for layer in layers):
            raise ValueError("stack: every cache must have seen its prompt")
        for name in ("seen", "pending", "headroom"):
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
        out = cls(layers[0].layer_idx, shared)
        slots = max(layer.size for layer in layers)

        def stacked(tensors: list[torch.Tensor], fill: float) -> torch.Tensor:
            padded = [tensor.new_full((*tensor.shape[:2], slots, *tensor.shape[3:]), fill) for tensor in tensors]
            for tensor, grown in zip(tensors, padded):
                grown.narrow(2, 0, tensor.shape[2]).copy_(tensor)
            return torch.cat(padded)

        first = layers[0]
        out.dtype, out.device = first.dtype, first.device
        out.keys = stacked([layer.keys for layer in layers], 0.0)
        out.values = stacked([layer.values for layer in layers], 0.0)
        with torch.inference_mode(False):  # a version counter for binary_bias()
            out.bias = stacked([layer.bias for layer in layers], NEG_INF)
        out.positions = stacked([layer.positions for layer in layers], -1)
        out.extra_fill = dict(first.extra_fill)
        out.extras = {name: stacked([layer.extras[name] for layer in layers], fill) for name, fill in out.extra_fill.items()}
        out.state = {
            name: torch.cat([layer.state[name] for layer in layers]) if how == "cat" else first.state[name]
            for name, how in joins.items()
        }
        out.seen, out.pending, out.headroom = first.seen, first.pending, first.headroom
        out.real_seen = torch.cat([layer.real_seen for layer in layers])
        if first.budget is not None:
            out.budget = torch.cat([layer.budget for layer in layers])
            out.capacity, out.min_budget = int(out.budget.max()), int(out.budget.min())
        out.is_initialized = True
        out._binary_mark = out._bias_mark() if all(layer.binary_bias() for layer in layers) else None
        return out

    def entry_nbytes(self) -> int:
        """Bytes one entry of one row takes over the KV heads: keys, values, bias, positions, extras."""
        tensors = [self.keys, self.values, self.bias, self.positions, *self.extras.values()]
        return sum(t[0, :, 0].numel() * t.element_size() for t in tensors)

    def nbytes(self) -> int:
        """Bytes held by this layer: the buffers behind its entries (spare slots included), bias,
        positions, per-entry and per-layer method state (tensors, and objects with an ``nbytes()``
        such as KVReviver's sketch; a host-side copy that declares ``in_cache = False`` is reported
        on its own)."""
        if not self.is_initialized:
            return 0
        tensors = [self.keys, self.values, self.bias, self.positions, *self.extras.values()]
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
        for tensor in (self.keys, self.values, self.bias, self.positions, *self.extras.values()):
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


@dataclass
class CacheSummary:
    """Per-row memory of a CompressedCache (lists indexed by row).

    ``cache_bytes[r] == entry_bytes[r] + padding_bytes[r] + spare_bytes[r] + state_bytes[r]``,
    and ``sum(cache_bytes) == cache.nbytes()``: the rows' figures add up to the real bytes.
    """

    kept_entries: list[float]  # mean live entries per layer and KV head
    cache_bytes: list[int]  # what the row holds: the four parts below
    entry_bytes: list[int]  # its live entries: keys, values, bias, positions, per-entry method state
    padding_bytes: list[int]  # its empty slots below each layer's size (left padding, ragged rows/heads)
    spare_bytes: list[int]  # its slots past each layer's size, kept for the next appends
    state_bytes: list[int]  # its share of per-layer method state (e.g. KVReviver's sketch)
    full_cache_bytes: list[int]  # keys + values an uncompressed cache of the row's tokens would hold


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


def _stats_rows(stats: StepStats, index: torch.Tensor) -> StepStats:
    """Rows ``index`` of every per-row tensor of ``stats`` (a prefill's, kept for a later chunk or a fork)."""
    picked = {
        name: value.index_select(0, index) if isinstance(value, torch.Tensor) else value
        for name, value in vars(stats).items()
    }
    picked["decayed"] = {decay: total.index_select(0, index) for decay, total in stats.decayed.items()}
    return StepStats(**picked)


def validate_budget(budget) -> None:
    """Raise ValueError unless budget is a float in (0, 1] or an int >= 1."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"budget must be a float in (0, 1] or an int >= 1, got {budget!r}")
    if isinstance(budget, int) and budget < 1:
        raise ValueError(f"an integer budget is an entry count and must be >= 1, got {budget}")
    if isinstance(budget, float) and not 0.0 < budget <= 1.0:
        raise ValueError(f"a float budget is a fraction of the prompt and must be in (0, 1], got {budget}")


# The budget floor: a fractional budget keeps at least the method's protected tokens plus this
# many scored entries per layer and head. A fraction of a short prompt (a chat template around a
# one-line question is ~40 tokens) would otherwise leave fewer entries than the method always
# keeps (keepkv, snapkv, pyramidkv: 32), and the answer is garbage; with the floor, a prompt no
# longer than it is not compressed at all (as PyramidKV's code, which compresses only prompts
# longer than its capacity). An int budget is an exact entry count and has no floor.
SCORED_FLOOR = 32


def budget_floor(method: Method) -> int:
    """Fewest entries per layer and head a fractional budget gives a row (see ``SCORED_FLOOR``)."""
    return method.protected_entries() + SCORED_FLOOR


def row_budgets(budget: int | float, prompt_lengths: torch.Tensor, floor: int = 0) -> torch.Tensor:
    """[B] entries per layer and head each row may keep: a fraction of its prompt, but at least
    ``floor`` (:func:`budget_floor`) and 1; or a count. A row whose prompt is no longer than its
    budget is not compressed, and keeps up to its budget while it decodes. This is the one place
    where a budget becomes entry counts: the cache, ``capacity_bound`` and the paged adapter
    (``keepkv.paged``) all read it."""
    if isinstance(budget, float):
        return (prompt_lengths.double() * budget).round().long().clamp(min=max(1, floor))
    return torch.full_like(prompt_lengths, budget)


def layer_budgets(method: Method, cache, budget: int | float, prompt_lengths: torch.Tensor) -> torch.Tensor | None:
    """[L, B, H_kv] entries each layer, row and head keeps: the method's allocation, fitted to the
    prompt; None when the method never compresses. ``cache``: what ``method.allocate`` reads."""
    per_row = row_budgets(budget, prompt_lengths, budget_floor(method))
    budgets = method.allocate(cache, per_row)
    if budgets is None:
        return None
    budgets = fit_to_prompt(budgets, per_row, prompt_lengths)
    # A prompt that fits its mean budget is not compressed in any layer (as PyramidKV's code).
    fits = (prompt_lengths <= per_row)[None, :, None]
    return torch.where(fits, per_row[None, :, None], budgets)


def capacity_bound(method: str | Method, prompt_length: int, budget: int | float, config) -> list[int] | None:
    """The most entries each layer of one request holds per KV head while it decodes, known before
    the model runs: what a serving scheduler must reserve (``docs/serving.md``).

    A layer keeps its budget and takes ``interval`` new tokens before it compresses again:
    budget + interval at the attention call that triggers a compression. The prefill holds the
    layer's whole prompt once; that peak is the prefill's reservation, not this bound. Layer
    budgets drawn from the prompt's attention (D2O) are bounded by the prompt. None: the method
    never compresses (``full``), and the request grows with every token.

    config: the model's HF config (depth, KV heads; KVReviver reads the Fisher layer scores
    registered for it by ``method.prepare(model)``).
    """
    method = get_method(method) if isinstance(method, str) else method
    validate_budget(budget)
    if isinstance(prompt_length, bool) or not isinstance(prompt_length, int) or prompt_length < 1:
        raise ValueError(f"prompt_length must be an int >= 1, got {prompt_length!r}")
    num_layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    lengths = torch.tensor([prompt_length])
    if method.allocates_from_all_layers:
        per_row = row_budgets(budget, lengths, budget_floor(method))
        budgets = torch.maximum(per_row, lengths).expand(num_layers, 1, kv_heads)
    else:  # allocate() reads the depth, the heads, the config; KeepKV writes per-layer state
        stub_layers = [SimpleNamespace(keys=torch.empty(1, kv_heads, 0, 1), state={}) for _ in range(num_layers)]
        stub = SimpleNamespace(num_layers=num_layers, layers=stub_layers, prompt_lengths=lengths, config=config)
        budgets = layer_budgets(method, stub, budget, lengths)
        if budgets is None:
            return None
    return (budgets.amax(dim=(1, 2)) + method.interval).tolist()


def fit_to_prompt(budgets: torch.Tensor, mean_budget: torch.Tensor, prompt_lengths: torch.Tensor) -> torch.Tensor:
    """Layer budgets [L, B, H_kv] that never exceed their row's prompt, with the same mean.

    A budget above the prompt would keep nothing more than the whole prompt, and its excess would
    be lost (PyramidKV's largest layers, at high budgets). Each row's budgets are pulled towards
    its uniform ``mean_budget`` [B], b + λ (a - b), with the largest λ <= 1 that fits the prompt
    [B]: the shape of the allocation is kept, only flattened, and the mean stays b (KVCache-Factory
    instead falls back to uniform budgets when its pyramid does not fit). Cumulative rounding over
    layers keeps the total.
    """
    mean = mean_budget.double()[None, :, None]
    cap = prompt_lengths.double()[None, :, None]
    deviation = budgets.double() - mean
    room = torch.where(deviation > 0, (cap - mean).clamp(min=0) / deviation, torch.inf)
    shrink = room.amin(dim=(0, 2), keepdim=True).clamp(max=1.0)  # λ per row
    fitted = mean + shrink * deviation
    cumulative = fitted.cumsum(0).round()
    rounded = torch.diff(cumulative, dim=0, prepend=torch.zeros_like(cumulative[:1]))
    return torch.where(shrink < 1, rounded.clamp(min=1).minimum(cap), budgets.double()).long()


class CompressedCache(Cache):
    """A KV cache that keeps at most ``budget`` entries per layer and head, chosen by ``method``.

    Pass it as ``past_key_values`` to ``model.generate()`` or a forward loop of a model whose
    attention implementation is ``"keepkv"`` (``keepkv.enable(model)`` or ``with
    keepkv.enabled(model)`` sets it). At the end of the prefill it warns
    (:class:`keepkv.KeepKVWarning`) when a compressed row's budget is below the method's
    ``protected_entries()``, or when an int budget of 1 was likely meant as 1.0.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config (Llama, Mistral, Qwen2 or Qwen3).
    method : str or Method
        A registered method name (``keepkv methods``) or an instance.
    budget : float or int
        A float in (0, 1]: that fraction of each row's prompt length, but at least the method's
        protected tokens + ``SCORED_FLOOR`` (:func:`budget_floor`). An int >= 1: an entry count.
        Methods may split it unevenly over layers and heads; the mean stays at the budget.
    compile : bool
        Run the methods' decode-time math through ``torch.compile`` (see :mod:`keepkv.fused`):
        fewer, fused kernels per step, after a one-off compilation (tens of seconds on CPU);
        falls back to eager, with a warning, where compiling fails.
    **method_params
        Parameters of the method when it is given by name.

    One cache holds one sequence per row. A second ``model.generate`` on it continues that
    sequence: pass the whole sequence so far (prompt and generated tokens) plus any new tokens;
    a new prompt on a used cache is refused (``check_continuation``): use a new cache, or
    ``reset()``. Beam search and ``num_return_sequences`` are supported (every per-row tensor and
    the method's state follow ``reorder_cache``); ``crop`` (assisted decoding) is refused.

    A cache built with ``record=Needs(...)`` compresses nothing and keeps the prefill's
    statistics, so that ``fork()`` can start any number of methods from one prefill.

    Each layer is compressed as soon as its own prefill ends, so the whole uncompressed prompt
    never sits in memory at once (unless the method's ``allocates_from_all_layers``, as D2O's);
    ``prefill_peak_bytes`` is the largest ``nbytes()`` seen during the prefill.

    Chunked prefill: call ``start_prefill(attention_mask)`` with the prompt's 2-D mask, then feed
    the prompt in blocks (``keepkv.generate(prefill_chunk=N)`` does both). Each layer then
    attends chunk by chunk, sums the method's statistics over the chunks and compresses once
    its whole prompt is in, exactly as an unchunked prefill would: the attention workspace is
    bounded by one chunk, but every layer holds its uncompressed prompt until the last chunk
    reaches it, so the cache peaks at the full prompt cache of all layers.
    """

    def __init__(
        self, config, method: str | Method = "full", budget: int | float = 1.0, record: Needs | None = None,
        compile: bool = False, **method_params,
    ):
        check_architecture(config)
        validate_budget(budget)
        if not isinstance(compile, bool):
            raise ValueError(f"compile must be True or False, got {compile!r}")
        self.compile = compile
        if isinstance(method, Method):
            if method_params:
                raise ValueError("pass method parameters either to get_method() or here, not with an instance")
            self.method = method
        else:
            self.method = get_method(method, **method_params)
        self.budget = budget
        self.num_layers = config.num_hidden_layers
        self.config = config
        self.sliding_window = sliding_window(config)
        shared = {}
        super().__init__(layers=[LayerStore(i, shared) for i in range(self.num_layers)])
        self.prompt_lengths: torch.Tensor | None = None
        self.layer_budgets: torch.Tensor | None = None
        self.prefill_peak_bytes = 0
        self.prompt_mask: torch.Tensor | None = None
        self.record = record
        self.method.check_budget(self)

    # -- HF Cache API ------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        hand_over(self, key_states)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].seen

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def reset(self) -> None:
        """Forget every entry; the next forward is a new prefill."""
        super().reset()
        self.prompt_lengths = None
        self.layer_budgets = None
        self.prefill_peak_bytes = 0
        self.prompt_mask = None

    # -- row-reshaping hooks transformers calls ----------------------------------------------
    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: row r becomes old row ``beam_idx[r]`` [B], every per-row tensor included."""
        self.select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row repeated ``repeats`` times in place (row r becomes rows r·repeats … r·repeats+repeats−1)."""
        rows = self._rows()
        if rows:
            self.select_rows(torch.arange(rows).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only rows ``indices`` (int or bool [B])."""
        indices = torch.as_tensor(indices)
        if indices.dtype == torch.bool:
            indices = indices.nonzero().view(-1)
        self.select_rows(indices)

    def _rows(self) -> int:
        """Rows of the cache (0 before its first forward)."""
        first = self.layers[0]
        return first.keys.shape[0] if first.is_initialized else 0

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` [B'] (int64, repeats allowed), in that order, of every layer's store and
        method state and of the cache's own per-row figures. Raises ValueError, changing nothing,
        where the method's state cannot follow (see ``Method.select_rows``)."""
        index = torch.as_tensor(index).long().view(-1).cpu()
        rows = self._rows()
        if not rows:
            return
        if index.numel() == 0 or int(index.min()) < 0 or int(index.max()) >= rows:
            raise ValueError(f"row indices must be in [0, {rows}), got {index.tolist()}")
        states = [self.method.select_rows(layer, index.to(layer.device)) for layer in self.layers]
        for layer, state in zip(self.layers, states):  # every state moved before any layer changes
            layer.select_rows(index)
            layer.state = state
        if self.prompt_lengths is not None:
            self.prompt_lengths = self.prompt_lengths.index_select(0, index.to(self.prompt_lengths.device))
        if self.layer_budgets is not None:
            self.layer_budgets = self.layer_budgets.index_select(1, index.to(self.layer_budgets.device))
        if self.prompt_mask is not None:
            self.prompt_mask = self.prompt_mask.index_select(0, index.to(self.prompt_mask.device))

    @property
    def is_croppable(self) -> bool:
        """False: compressed entries cannot be put back (assisted decoding refuses before it drafts)."""
        return False

    def crop(self, tokens_to_remove: int) -> None:
        """Only ``crop(0)`` (nothing to remove) is accepted: entries a method merged or evicted cannot
        be restored, so rolling back tokens (assisted or speculative decoding) is refused."""
        if tokens_to_remove != 0:
            raise ValueError(
                f"crop({tokens_to_remove}): a CompressedCache cannot roll back tokens (assisted/speculative "
                "decoding); generate without assistant_model, or with a DynamicCache"
            )

    def check_continuation(self, layer_idx: int, position_ids: torch.Tensor, block_mask: torch.Tensor) -> None:
        """Raise ValueError unless a block of several tokens fed after the prefill continues the
        sequence this cache holds: its last token's position (position_ids [B or 1, q]) must be each
        row's real tokens so far plus the block's. A second ``model.generate`` on one cache continues
        it (input_ids: the whole sequence so far, then the new tokens); HF slices off as many tokens
        as the cache has seen, so a new prompt would otherwise be fed from the middle, silently.
        Checked on the first layer only: one host sync per multi-token continuation block."""
        layer = self.layers[layer_idx]
        if layer_idx != 0 or layer.seen == 0 or layer.seen < self.prefill_tokens:
            return
        due = layer.real_seen + block_mask[:, 0, -1, :].sum(-1) - 1
        got = position_ids[:, -1].to(due.device).expand_as(due)
        if not torch.equal(got, due):
            raise ValueError(
                f"this CompressedCache holds a sequence of {layer.seen} tokens and the new block does not continue it "
                f"(last position {got.tolist()}, due {due.tolist()}): to continue, pass the whole sequence so far plus "
                "the new tokens; for a new prompt, use a new CompressedCache (or cache.reset())"
            )

    def start_prefill(self, attention_mask: torch.Tensor) -> None:
        """Announce a prompt that will be fed in several blocks: attention_mask [B, T] (1 = real
        token, left padding), the whole prompt's. Its padding is read from here, since a block's
        mask cannot tell a block of padding from one real token (each query sees itself)."""
        self.prompt_mask = attention_mask.bool()

    @property
    def prefill_tokens(self) -> int:
        """Tokens of an announced chunked prompt (padding included); 0 when none was announced."""
        return 0 if self.prompt_mask is None else self.prompt_mask.shape[1]

    # -- one attention call --------------------------------------------------------------
    def forward_layer(self, layer_idx, query, keys, values, block_mask, scaling) -> torch.Tensor:
        """Append the new block, attend over the kept entries, let the method compress.

        query [B, H, q, D]; keys, values [B, H_kv, q, D]; block_mask [B, 1, q, q] bool
        (causal within the block, False for padded keys). Returns [B, q, H, D].
        """
        layer = self.layers[layer_idx]
        block = keys.shape[2]
        if self.sliding_window is not None:  # refused before anything changes (models.check_context)
            check_context(self.config, max(layer.seen + block, self.prefill_tokens))
        is_prefill = layer.seen == 0 or layer.seen < self.prefill_tokens
        if layer.seen == 0:
            self.method.setup_layer(layer)
            # A chunked prefill's buffers take the whole prompt at once, not a growth step per chunk.
            layer.headroom = self.prefill_tokens - block if self.prefill_tokens > block else None
        is_real = block_mask[:, 0, -1, :]
        if layer.seen < self.prefill_tokens:  # a block of an announced prompt may be all padding
            is_real = self.prompt_mask[:, layer.seen : layer.seen + block].to(is_real.device)
        layer.append(keys, values, is_real)
        needs = self.record if is_prefill and self.record else self.method.needs(is_prefill)
        entries = self.method.attention_entries(layer)
        binary_bias = entries[2] is layer.bias and layer.binary_bias()
        output, stats = attend(query, *entries, block_mask, scaling, needs, is_prefill, binary_bias)
        if is_prefill:
            if layer.prefill_stats is not None:  # an earlier chunk of this prompt
                stats = join_prefill_stats(layer.prefill_stats, stats, needs.window)
            layer.prefill_stats = stats
            if layer.seen < self.prefill_tokens:
                return output
        if is_prefill:
            self.method.observe(layer, stats)
            if not self.method.allocates_from_all_layers:
                self._end_prefill([layer])
            elif layer_idx == self.num_layers - 1:
                self._end_prefill(self.layers)
            return output
        with compiled(self.compile):  # decode shapes are stable: compile once, not per prompt
            self.method.observe(layer, stats)
            if layer.budget is not None and layer.pending >= self.method.interval:
                self.method.compress(layer, stats)
                layer.pending = 0
        return output

    def _end_prefill(self, layers: list[LayerStore]) -> None:
        """Compress ``layers`` as their prefill ends (each layer at once, so the uncompressed prompt
        is held for one layer at a time); the first call fixes every layer's budget."""
        self.prefill_peak_bytes = max(self.prefill_peak_bytes, self.nbytes())
        if self.prompt_lengths is None:
            self.prompt_lengths = layers[0].real_seen.clone()
            self.layer_budgets = self._allocate()
        for layer in layers:
            layer.headroom = None
            if self.layer_budgets is not None:
                layer.budget = self.layer_budgets[layer.layer_idx]
                layer.capacity = int(layer.budget.max())
                layer.min_budget = int(layer.budget.min())
                layer.headroom = self.method.interval
                self.method.compress(layer, layer.prefill_stats)
            if self.record is None:
                layer.prefill_stats = None
            layer.pending = 0

    def _allocate(self) -> torch.Tensor | None:
        """[L, B, H_kv] budgets from the method, or None when it never compresses."""
        budgets = layer_budgets(self.method, self, self.budget, self.prompt_lengths)
        if budgets is not None:
            self._warn_budget(row_budgets(self.budget, self.prompt_lengths, budget_floor(self.method)))
        return budgets

    def _warn_budget(self, per_row: torch.Tensor) -> None:
        """Warn (once per prefill, one host sync) about the compressed row that keeps the fewest entries."""
        lengths, kept = self.prompt_lengths.tolist(), per_row.tolist()
        compressed = [(entries, length) for entries, length in zip(kept, lengths) if length > entries]
        if compressed:
            entries, length = min(compressed)
            warn_budget(self.method, self.budget, length, entries)

    @classmethod
    def stack(cls, caches: list["CompressedCache"]) -> "CompressedCache":
        """One cache whose rows are the rows of ``caches``, in order: a decode batch of requests
        prefilled apart, as a serving engine admits them.

        Each request's layers were compressed as its own prefill ended, so at most one prompt is
        held uncompressed at a time, and a memory cap then buys a batch of compressed rows. The
        caches must run the same method and budget, have ended their prefills and have seen as
        many tokens (pad prompts of unequal length on the left); their layers are padded with
        empty slots to the largest. Decoding the stacked cache gives each row what decoding its
        own cache would. The rows move: each given cache is left empty, one layer at a time, so
        the stack never holds more than one layer twice. Raises ValueError naming what differs.
        """
        if not caches:
            raise ValueError("stack needs at least one cache")
        first = caches[0]
        for cache in caches:
            if cache.record is not None or cache.prompt_lengths is None:
                raise ValueError("stack: every cache must have ended its prefill (and record nothing)")
            if (cache.method, cache.budget, cache.num_layers, cache.compile) != (
                first.method, first.budget, first.num_layers, first.compile
            ):
                raise ValueError("stack: the caches differ in method, budget, depth or compile")
        for i in range(first.num_layers):  # everything checked before the first layer moves
            LayerStore.check_stackable([cache.layers[i] for cache in caches])
        out = cls(first.config, first.method, first.budget, compile=first.compile)
        for i in range(first.num_layers):
            out.layers[i] = LayerStore.stack([cache.layers[i] for cache in caches], out.layers[i].shared)
            for cache in caches:
                cache.layers[i] = LayerStore(i, cache.layers[i].shared)
        out.prompt_lengths = torch.cat([cache.prompt_lengths for cache in caches])
        if first.layer_budgets is not None:
            out.layer_budgets = torch.cat([cache.layer_budgets for cache in caches], dim=1)
        out.prefill_peak_bytes = max(cache.prefill_peak_bytes for cache in caches)
        return out

    def fork(self, method: str | Method, budget: int | float = 1.0, **method_params) -> "CompressedCache":
        """A new cache for ``method`` that starts from this recorded prefill, without a forward pass.

        What running ``method`` from the start would give, since prefill attention never depends
        on the method: only the statistics it asked for, which were recorded. Exactly, up to
        rounding: a prefill that computes column sums or probabilities takes its output from the
        same explicit pass, SDPA's output differs from it in the last bits.
        """
        if self.record is None or self.prompt_lengths is None:
            raise ValueError("fork() needs a cache built with record=Needs(...) that has seen a prefill")
        cache = CompressedCache(self.config, method, budget, compile=self.compile, **method_params)
        missing = self.record.missing(cache.method.needs(True))
        if missing:
            raise ValueError(
                f"fork({cache.method.name!r}): the recorded prefill lacks {', '.join(missing)}; record "
                f"Needs.union([method.needs(True) for method in the methods to fork])"
            )
        for source, layer in zip(self.layers, cache.layers):
            layer.lazy_initialization(source.keys, source.values)
            layer.keys, layer.values = source.keys.clone(), source.values.clone()
            layer.bias, layer.positions = source.bias.clone(), source.positions.clone()
            layer.seen, layer.real_seen, layer.pending = source.seen, source.real_seen.clone(), source.pending
            cache.method.setup_layer(layer)
            cache.method.observe(layer, source.prefill_stats)
            layer.prefill_stats = source.prefill_stats
        cache._end_prefill(cache.layers)
        return cache

    def copy(self) -> "CompressedCache":
        """An independent deep copy: every layer's tensors, buffers and method state, so that
        decoding the copy (a question on a compressed context, ``keepkv.compress``) leaves this
        cache untouched. The model config is shared, not copied."""
        import copy as _copy

        with torch.inference_mode(False):  # the bias keeps a version counter (binary_bias)
            clone = _copy.deepcopy(self, memo={id(self.config): self.config})
        for source, layer in zip(self.layers, clone.layers):
            if source.is_initialized:  # the mark names the copy's own bias tensor
                layer._binary_mark = layer._bias_mark() if source.binary_bias() else None
        return clone

    # -- reporting -------------------------------------------------------------------------
    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def summary(self) -> CacheSummary:
        """Kept entries and bytes per row, next to what an uncompressed cache would hold."""
        first = self.layers[0]
        _, kv_heads, _, head_dim = first.keys.shape
        kept = torch.stack([layer.live_counts().double().mean(-1) for layer in self.layers]).mean(0)
        per_entry = 2 * head_dim * first.keys.element_size() * kv_heads * self.num_layers
        rows = [layer.row_nbytes() for layer in self.layers]
        parts = {part: sum(row[part] for row in rows).tolist() for part in ("entries", "padding", "spare", "state")}
        return CacheSummary(
            kept_entries=[round(float(k), 2) for k in kept],
            cache_bytes=[sum(row) for row in zip(*parts.values())],
            entry_bytes=parts["entries"],
            padding_bytes=parts["padding"],
            spare_bytes=parts["spare"],
            state_bytes=parts["state"],
            full_cache_bytes=[int(t) * per_entry for t in first.real_seen],
        )
