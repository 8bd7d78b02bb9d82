"""The full-precision copy of a layer's KV kept outside the compressed cache (KeepKV's refresh).

KeepKV's "periodic lossless" compression rebuilds the compressed cache from a copy of every
key and value ever appended. :class:`FullKVCopy` is that copy for one layer: host (CPU) memory,
appended at every step, bit-exact (the same dtype, copied, never recomputed or compressed).
On CUDA the host buffers are pinned and each append is a non-blocking device-to-host copy on a
side stream, so decoding does not wait for it; :meth:`FullKVCopy.load` waits for the pending
copies before reading.

Buffers are time-major ([T, B, H_kv, D]) so that every append writes one contiguous block, and
grow by doubling (amortised O(1) per token).
"""

from __future__ import annotations

import copy
import time

import torch


def time_major_copies(keys, values, is_real) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys [T, B, H_kv, D], values [T, B, H_kv, Dv] and is_real [T, B] in new memory.

    Time-major and contiguous so each destination slice is one contiguous block; always a copy
    (``.contiguous()`` returns a view when B = H_kv = 1), since the side-stream copy reads them
    while the caller may merge into the newest slot in place.
    """
    return tuple(
        tensor.clone(memory_format=torch.contiguous_format)
        for tensor in (keys.permute(2, 0, 1, 3), values.permute(2, 0, 1, 3), is_real.transpose(0, 1))
    )


class FullKVCopy:
    """Bit-exact host copy of every K/V appended to one layer.

    Parameters
    ----------
    keys, values : torch.Tensor
        [B, H_kv, *, D] tensors of the layer (only their batch, heads, head size, dtype and
        device are used).
    capacity : int
        Initial number of token slots (grows by doubling).

    Attributes
    ----------
    length : int
        Tokens held (padding slots of the prompt included).
    bytes_to_host, bytes_to_device : int
        Bytes copied into the copy (every append) and out of it (every load).
    appends, loads : int
    """

    in_cache = False  # host memory: reported by report(), not in the cache's bytes

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int = 256):
        batch, kv_heads = keys.shape[:2]
        self.shape = (batch, kv_heads)
        self.key_dim, self.value_dim = keys.shape[-1], values.shape[-1]
        self.dtype = keys.dtype
        self.source_device = keys.device
        self.cuda = keys.device.type == "cuda"
        self.pin = self.cuda and torch.cuda.is_available()
        self.length = 0
        self.appends = self.loads = 0
        self.bytes_to_host = self.bytes_to_device = 0
        self._host_seconds = 0.0  # CPU: wall time of the copies; CUDA: host time spent issuing them
        self._device_seconds = 0.0  # CUDA: measured copy time on the side stream
        self._load_seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.stream = torch.cuda.Stream(device=keys.device) if self.cuda else None
        self._allocate(max(1, capacity))

    # -- storage -----------------------------------------------------------------------------
    def _buffer(self, capacity: int, *trailing, dtype=None) -> torch.Tensor:
        return torch.empty(capacity, *self.shape[:1], *trailing, dtype=dtype or self.dtype, pin_memory=self.pin)

    def _allocate(self, capacity: int) -> None:
        batch, kv_heads = self.shape
        keys = self._buffer(capacity, kv_heads, self.key_dim)
        values = self._buffer(capacity, kv_heads, self.value_dim)
        is_real = self._buffer(capacity, dtype=torch.bool)
        if self.length:
            self.synchronize()
            keys[: self.length].copy_(self.keys[: self.length])
            values[: self.length].copy_(self.values[: self.length])
            is_real[: self.length].copy_(self.is_real[: self.length])
        self.keys, self.values, self.is_real = keys, values, is_real

    @property
    def capacity(self) -> int:
        return self.keys.shape[0]

    def append(self, keys: torch.Tensor, values: torch.Tensor, is_real: torch.Tensor) -> None:
        """Append a block: keys [B, H_kv, q, D], values [B, H_kv, q, Dv], is_real [B, q] bool."""
        block = keys.shape[2]
        if self.length + block > self.capacity:
            self._allocate(max(2 * self.capacity, self.length + block))
        start, stop = self.length, self.length + block
        sources = time_major_copies(keys, values, is_real)
        targets = (self.keys, self.values, self.is_real)
        began = time.perf_counter()
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.source_device))
            with torch.cuda.stream(self.stream):
                start_event, stop_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start_event.record(self.stream)
                for source, target in zip(sources, targets):
                    target[start:stop].copy_(source, non_blocking=True)
                    source.record_stream(self.stream)
                stop_event.record(self.stream)
            self._events.append((start_event, stop_event))
            if len(self._events) >= 256:
                self._collect_events()
        else:
            for source, target in zip(sources, targets):
                target[start:stop].copy_(source)
        self._host_seconds += time.perf_counter() - began
        self.length = stop
        self.appends += 1
        self.bytes_to_host += sum(s.numel() * s.element_size() for s in sources)

    def _collect_events(self) -> None:
        if not self._events:
            return
        self.stream.synchronize()
        self._device_seconds += sum(a.elapsed_time(b) for a, b in self._events) / 1000.0
        self._events.clear()

    def synchronize(self) -> None:
        """Wait for the pending asynchronous copies (no-op on CPU)."""
        if self.cuda:
            self._collect_events()

    def load(self, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Everything appended so far: keys [B, H_kv, T, D], values, is_real [B, T], on ``device``."""
        device = self.source_device if device is None else torch.device(device)
        self.synchronize()
        began = time.perf_counter()
        parts = [buffer[: self.length] for buffer in (self.keys, self.values, self.is_real)]
        if device.type == "cpu":  # always a copy: the result must never alias the buffers
            moved = [part.clone() for part in parts]
        else:
            moved = [part.to(device, non_blocking=self.pin) for part in parts]
        keys = moved[0].permute(1, 2, 0, 3).contiguous()
        values = moved[1].permute(1, 2, 0, 3).contiguous()
        is_real = moved[2].transpose(0, 1).contiguous()
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        self._load_seconds += time.perf_counter() - began
        self.loads += 1
        self.bytes_to_device += sum(p.numel() * p.element_size() for p in parts)
        return keys, values, is_real

    def select_rows(self, index: torch.Tensor) -> "FullKVCopy":
        """A copy holding batch rows ``index`` [B'] (repeats allowed), in that order; this one is unchanged."""
        self.synchronize()
        index = index.cpu()
        picked = copy.copy(self)
        picked.shape = (index.numel(), self.shape[1])
        picked._events = []
        for name in ("keys", "values", "is_real"):
            buffer = getattr(self, name)
            selected = picked._buffer(buffer.shape[0], *buffer.shape[2:], dtype=buffer.dtype)
            torch.index_select(buffer, 1, index, out=selected)
            setattr(picked, name, selected)
        return picked

    # -- reporting ---------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of the tokens held (keys, values and the padding mask)."""
        batch, kv_heads = self.shape
        per_token = batch * (kv_heads * (self.key_dim + self.value_dim) * self.keys.element_size() + 1)
        return self.length * per_token

    def reserved_bytes(self) -> int:
        """Bytes allocated (capacity, grown by doubling)."""
        return sum(b.numel() * b.element_size() for b in (self.keys, self.values, self.is_real))

    def report(self) -> dict:
        """Memory and transfer cost of this copy; waits for pending copies to time them."""
        self.synchronize()
        return {
            "tokens": self.length,
            "bytes": self.nbytes(),
            "reserved_bytes": self.reserved_bytes(),
            "pinned": self.pin,
            "appends": self.appends,
            "bytes_to_host": self.bytes_to_host,
            "seconds_to_host": self._device_seconds if self.cuda else self._host_seconds,
            "host_seconds_issuing": self._host_seconds,
            "loads": self.loads,
            "bytes_to_device": self.bytes_to_device,
            "seconds_to_device": self._load_seconds,
        }

