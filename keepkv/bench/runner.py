"""The measurements behind ``keepkv.bench.run_bench``: one timed prefill + greedy decode run,
the method-time proxies, the profiler, the byte accounting and the capacity search.

A run never calls ``model.generate``: it is a manual loop (prefill, then one forward per
new token with a :class:`keepkv.CompressedCache`) so that every decode step is timed on its
own. On CUDA a step is timed with CUDA events (no host sync inside the loop); on CPU with
``time.perf_counter`` (CPU ops are synchronous).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import platform
import resource
import statistics
import sys
import threading
import time
from typing import Callable

import torch
from tqdm.auto import tqdm

from .. import reconstruction
from ..attention import enable
from ..budgets import budget_for
from ..cache import CompressedCache
from ..models import CACHE_KWARG
from .setup import stand_in_tokenizer

# Method code timed by the overhead proxies (bound methods of the method instance).
METHOD_PARTS = ("observe", "refresh", "compress", "attention_entries")


# -- devices and memory ---------------------------------------------------------------------
def is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def synchronize(device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def device_name(device) -> str:
    if is_cuda(device):
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def process_peak_rss() -> int:
    """The process's lifetime peak RSS in bytes (``resource.getrusage``; never goes down)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def current_rss() -> int:
    """Resident bytes now (``/proc/self/statm``), or the lifetime peak where /proc is missing."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return process_peak_rss()


def release_freed_heap() -> None:
    """Hand freed heap pages back to the OS (glibc's ``malloc_trim``; a no-op elsewhere), so that
    an RSS delta counts this run's allocations rather than reusing memory an earlier run freed."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Peak memory over a ``with`` block.

    CUDA: ``torch.cuda.max_memory_allocated`` after resetting the peak stats (``kind`` =
    ``"cuda_max_allocated"``). CPU: the peak of the process RSS sampled every ``interval``
    seconds by a thread (``kind`` = ``"process_rss_sampled"``), since ``getrusage``'s peak is
    process-wide and cannot be reset between methods; freed heap is released first, or a run
    would reuse what the previous one freed and show no growth. ``start`` is the reading at entry.
    """

    def __init__(self, device, interval: float = 0.002):
        self.device, self.interval = device, interval
        self.cuda = is_cuda(device)
        self.kind = "cuda_max_allocated" if self.cuda else "process_rss_sampled"
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self):
        if self.cuda:
            synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = self.peak = torch.cuda.memory_allocated(self.device)
        else:
            release_freed_heap()
            self.start = self.peak = current_rss()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, current_rss())

    def __exit__(self, *exc):
        if self.cuda:
            synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, current_rss())
        return False


# -- timing -----------------------------------------------------------------------------------
class StepClock:
    """Times a sequence of steps: CUDA events on GPU (read after one final sync), perf_counter on CPU."""

    def __init__(self, device):
        self.device = device
        self.cuda = is_cuda(device)
        self._events: list = []
        self._times: list[float] = []
        self._t0 = 0.0
        self._start = None

    def start(self):
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self):
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._start, end))
        else:
            self._times.append(time.perf_counter() - self._t0)

    def seconds(self) -> list[float]:
        if self.cuda:
            synchronize(self.device)
            return [start.elapsed_time(end) / 1000.0 for start, end in self._events]
        return list(self._times)


class MethodTimer:
    """Time a cache's method code and KV path per decode step, without editing core files.

    ``install(cache)`` shadows, on the *instances* only, the method's bound ``observe``,
    ``compress`` and ``attention_entries``, every layer's ``append`` and the cache's
    ``forward_layer`` with proxies that time each call and open a ``torch.profiler``
    ``record_function`` range ``keepkv::<name>``. With ``compile=True`` the cache's compiled
    step is timed whole, as ``compress``, instead of ``observe`` and ``compress`` (a proxy inside
    the graph would stop it compiling). ``uninstall()`` deletes the proxies, putting back what
    was an instance attribute, so the originals are visible again.
    """

    PARTS = (*METHOD_PARTS, "append", "forward_layer")

    def __init__(self, device):
        self.device = device
        self.cuda = is_cuda(device)
        self.step: dict[str, float] = dict.fromkeys(self.PARTS, 0.0)
        self.events: dict[str, list] = {name: [] for name in self.PARTS}
        self._installed: list[tuple[object, str]] = []

    def _wrap(self, name: str, fn: Callable) -> Callable:
        label = f"keepkv::{name}"

        def timed(*args, **kwargs):
            with torch.profiler.record_function(label):
                if self.cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    out = fn(*args, **kwargs)
                    end.record()
                    self.events[name].append((start, end))
                else:
                    t0 = time.perf_counter()
                    out = fn(*args, **kwargs)
                    self.step[name] += time.perf_counter() - t0
            return out

        return timed

    def _shadow(self, obj, name: str, part: str) -> None:
        own = obj.__dict__.get(name)  # an instance attribute is put back, a class one uncovered
        setattr(obj, name, self._wrap(part, getattr(obj, name)))
        self._installed.append((obj, name, own))

    def install(self, cache) -> None:
        for part in METHOD_PARTS:
            if cache.compile and part in ("observe", "refresh", "compress"):
                continue  # traced into the compiled step: a timer there would stop it compiling
            self._shadow(cache.method, part, part)
        if cache.compile:
            self._shadow(cache.step, "_method_step", "compress")  # observe, refresh and compress: one compiled graph
        for layer in cache.layers:
            self._shadow(layer, "append", "append")
        self._shadow(cache, "forward_layer", "forward_layer")

    def uninstall(self) -> None:
        for obj, name, own in self._installed:
            if own is not None:
                setattr(obj, name, own)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(obj, name)
        self._installed.clear()

    def take_step(self) -> dict[str, float]:
        """Seconds per part since the last call (syncs on CUDA)."""
        if self.cuda:
            synchronize(self.device)
            out = {
                name: sum(start.elapsed_time(end) for start, end in pairs) / 1000.0
                for name, pairs in self.events.items()
            }
            self.events = {name: [] for name in self.PARTS}
        else:
            out = dict(self.step)
        self.step = dict.fromkeys(self.PARTS, 0.0)
        return out


# -- statistics -------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


# -- capacity search --------------------------------------------------------------------------
def max_batch(capacity_bytes: int, bytes_for_batch: Callable[[int], int], limit: int = 1 << 20) -> int:
    """Largest batch b >= 1 with ``bytes_for_batch(b) <= capacity_bytes``; 0 if batch 1 does not fit.

    ``bytes_for_batch`` must be non-decreasing. Doubling finds a batch that does not fit,
    then a binary search the boundary, so the answer fits and answer + 1 does not (up to
    ``limit``, returned if even that fits).
    """
    if bytes_for_batch(1) > capacity_bytes:
        return 0
    fits, over = 1, 2
    while bytes_for_batch(over) <= capacity_bytes:
        fits = over
        if over >= limit:
            return limit
        over = min(over * 2, limit)
    while over - fits > 1:
        mid = (fits + over) // 2
        if bytes_for_batch(mid) <= capacity_bytes:
            fits = mid
        else:
            over = mid
    return fits


# -- model ------------------------------------------------------------------------------------
def weights_bytes(model) -> int:
    """Bytes of the model's parameters and buffers (tied tensors counted once)."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total


def _forward(model, input_ids, attention_mask, cache):
    return model(
        input_ids=input_ids, attention_mask=attention_mask, **{CACHE_KWARG: cache}, use_cache=True, logits_to_keep=1
    ).logits


def _profile_rows(prof, cuda: bool, steps: int, top: int) -> tuple[str, list[dict]]:
    """Top ops by self time, per decode step."""
    averages = prof.key_averages()
    sort_key = "self_device_time_total" if cuda else "self_cpu_time_total"
    total_self = sum(getattr(e, sort_key, 0.0) for e in averages) or 1.0
    rows = []
    for event in sorted(averages, key=lambda e: getattr(e, sort_key, 0.0), reverse=True):
        if len(rows) >= top:
            break
        self_us = getattr(event, sort_key, 0.0)
        total_us = event.device_time_total if cuda else event.cpu_time_total
        rows.append(
            {
                "name": event.key,
                "calls": int(event.count) // max(1, steps),
                "self_ms_per_step": self_us / 1000.0 / steps,
                "total_ms_per_step": total_us / 1000.0 / steps,
                "self_pct": 100.0 * self_us / total_self,
            }
        )
    # The keepkv:: ranges: their total time is the time inside that code (children included).
    for event in averages:
        if event.key.startswith("keepkv::") and all(row["name"] != event.key for row in rows):
            total_us = event.device_time_total if cuda else event.cpu_time_total
            rows.append(
                {
                    "name": event.key,
                    "calls": int(event.count) // max(1, steps),
                    "self_ms_per_step": getattr(event, sort_key, 0.0) / 1000.0 / steps,
                    "total_ms_per_step": total_us / 1000.0 / steps,
                    "self_pct": 100.0 * getattr(event, sort_key, 0.0) / total_self,
                }
            )
    return sort_key, rows


@torch.inference_mode()
def run_once(
    model,
    method: str,
    budget,
    method_params: dict | None = None,
    prompt_len: int = 128,
    gen_len: int = 16,
    batch: int = 1,
    seed: int = 0,
    overhead_steps: int = 0,
    profile_steps: int = 0,
    profile_top: int = 20,
    progress: bool = False,
    prefill_chunk: int | None = None,
    prefill_rows: int | None = None,
    compile: bool = False,
    kernel: str = "torch",
) -> dict:
    """One prefill of ``batch`` random prompts of ``prompt_len`` tokens (in blocks of
    ``prefill_chunk`` tokens if given; ``prefill_rows`` rows at a time if given, each group's
    cache compressed before the next group starts, then stacked into one decode batch, as a
    serving engine admits requests), then ``gen_len`` timed greedy decode steps (each feeds
    one token per row and returns the next).

    After the timed steps, ``overhead_steps`` more steps run with the :class:`MethodTimer`
    proxies and ``profile_steps`` more under ``torch.profiler``; neither touches the timed
    numbers. Returns raw measurements (seconds and bytes), see ``run_bench`` for the fields.
    """
    device = next(model.parameters()).device
    cuda = is_cuda(device)
    enable(model)
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=generator).to(device)
    total = prompt_len + gen_len + overhead_steps + profile_steps
    mask = torch.ones(batch, total, dtype=torch.long, device=device)
    out: dict = {"method": method, "batch": batch, "prompt_len": prompt_len, "gen_len": gen_len}

    with PeakMemory(device) as memory:
        synchronize(device)
        t0 = time.perf_counter()
        chunk = prefill_chunk or prompt_len
        rows = prefill_rows or batch
        groups, tokens, held, cache_peak = [], [], 0, 0
        for first in range(0, batch, rows):
            last = min(first + rows, batch)
            group = CompressedCache(model.config, method, budget_for(method, budget), compile=compile, kernel=kernel,
                                    **(method_params or {}))
            group.method.prepare(model)
            if group.defers_to_reconstruction:  # KVzip: its pass is part of its prefill's time
                logits = reconstruction.prefill(
                    model, stand_in_tokenizer(model.config.vocab_size), group, input_ids[first:last],
                    mask[first:last, :prompt_len], chat=False, prefill_chunk=prefill_chunk, positions="slots",
                )[:, None]
            else:
                if chunk < prompt_len:
                    group.start_prefill(mask[first:last, :prompt_len])
                for start in range(0, prompt_len, chunk):
                    stop = min(start + chunk, prompt_len)
                    logits = _forward(model, input_ids[first:last, start:stop], mask[first:last, :stop], group)
            tokens.append(logits[:, -1:].argmax(-1))
            cache_peak = max(cache_peak, held + group.prefill_peak_bytes)  # the earlier groups, compressed
            held += group.nbytes()
            groups.append(group)
        cache = groups[0] if len(groups) == 1 else CompressedCache.stack(groups)
        if len(groups) > 1:  # the stack moves one layer at a time: the groups, and one layer twice
            cache_peak = max(cache_peak, held + math.ceil(cache.nbytes() / cache.num_layers))
        del groups, group
        token = torch.cat(tokens)
        synchronize(device)
        out["prefill_s"] = time.perf_counter() - t0
        out["cache_bytes_prefill"] = cache_peak
        cache_peak = max(cache_peak, cache.nbytes())

        clock = StepClock(device)
        bar = tqdm(total=gen_len, desc=f"{method} b={batch}", unit="step", leave=False, disable=not progress)
        length = prompt_len
        t0 = time.perf_counter()
        for _ in range(gen_len):
            clock.start()
            length += 1
            logits = _forward(model, token, mask[:, :length], cache)
            token = logits[:, -1:].argmax(-1)
            clock.stop()
            cache_peak = max(cache_peak, cache.nbytes())
            bar.update(1)
        synchronize(device)
        out["decode_s"] = time.perf_counter() - t0
        bar.close()
    out["step_s"] = clock.seconds()
    out["peak_memory_bytes"] = memory.peak
    out["peak_memory_delta_bytes"] = max(0, memory.peak - memory.start)
    out["peak_memory_kind"] = memory.kind
    out["process_peak_rss_bytes"] = process_peak_rss()
    out["cache_bytes"] = cache.nbytes()
    out["cache_bytes_peak"] = cache_peak
    out["kept_entries"] = float(torch.stack([layer.live_counts().double().mean() for layer in cache.layers]).mean())
    first = cache.layers[0]
    per_entry = 2 * first.keys.shape[-1] * first.keys.element_size() * first.keys.shape[1] * cache.num_layers
    out["full_cache_bytes"] = int(first.real_seen.sum()) * per_entry
    out["entry_bytes"] = first.entry_nbytes()
    out["interval"] = cache.method.interval
    out["compresses"] = any(layer.budget is not None for layer in cache.layers)
    out["layer_entries"] = [layer.size for layer in cache.layers]
    out["layer_capacity"] = [layer.capacity if layer.budget is not None else layer.size for layer in cache.layers]
    out["layer_entries_prefill"] = [prompt_len] * cache.num_layers

    if overhead_steps:
        timer = MethodTimer(device)
        timer.install(cache)
        steps = []
        try:
            for _ in range(overhead_steps):
                synchronize(device)
                timer.take_step()
                t0 = time.perf_counter()
                length += 1
                logits = _forward(model, token, mask[:, :length], cache)
                token = logits[:, -1:].argmax(-1)
                synchronize(device)
                step = time.perf_counter() - t0
                steps.append({"step": step, **timer.take_step()})
        finally:
            timer.uninstall()
        out["overhead"] = summarise_overhead(steps)

    if profile_steps:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        timer = MethodTimer(device)  # for the keepkv:: ranges only
        timer.install(cache)
        try:
            synchronize(device)
            with profile(activities=activities) as prof:
                for _ in range(profile_steps):
                    length += 1
                    logits = _forward(model, token, mask[:, :length], cache)
                    token = logits[:, -1:].argmax(-1)
                synchronize(device)
        finally:
            timer.uninstall()
        sort_key, rows = _profile_rows(prof, cuda, profile_steps, profile_top)
        out["profile"] = {"steps": profile_steps, "sort_by": sort_key, "ops": rows}
    return out


def summarise_overhead(steps: list[dict]) -> dict:
    """Mean ms per step of each part; ``method_ms`` = observe + refresh + compress + attention_entries.

    ``attend_ms`` is the rest of ``forward_layer`` (the attention itself), ``model_ms`` the
    rest of the step (projections, MLP, norms, logits, argmax).
    """
    count = len(steps)

    def mean_ms(key):
        return 1000.0 * sum(s[key] for s in steps) / count

    parts = {f"{name}_ms": mean_ms(name) for name in MethodTimer.PARTS}
    step_ms = mean_ms("step")
    method_ms = sum(parts[f"{name}_ms"] for name in METHOD_PARTS)
    return {
        "steps": count,
        "step_ms": step_ms,
        "method_ms": method_ms,
        "method_share": method_ms / step_ms if step_ms else 0.0,
        "rest_ms": step_ms - method_ms,
        "observe_ms": parts["observe_ms"],
        "refresh_ms": parts["refresh_ms"],
        "compress_ms": parts["compress_ms"],
        "attention_entries_ms": parts["attention_entries_ms"],
        "append_ms": parts["append_ms"],
        "attend_ms": parts["forward_layer_ms"] - parts["append_ms"] - method_ms,
        "model_ms": step_ms - parts["forward_layer_ms"],
    }


# -- byte accounting for the memory cap -------------------------------------------------------
def cache_bytes_per_row(probe: dict, prompt_len: int, gen_len: int) -> dict:
    """Predicted cache bytes of one row at its peak, from a batch-1 probe run at ``prompt_len``.

    The prefill peak is the probe's own reading (each layer holds the whole prompt only until
    its prefill ends, unless the method allocates from every layer). A cache that does not
    compress then grows by ``gen_len`` entries per layer; one that compresses stays at the size
    the probe measured after its decode steps plus ``interval`` new entries per layer between
    compressions. The peak is the larger of prefill and decode.
    """
    layers = len(probe["layer_entries_prefill"])
    entry_bytes = probe["entry_bytes"]  # one entry of one row and layer, all heads
    prefill = probe["cache_bytes_prefill"]
    if probe["compresses"]:
        decode = probe["cache_bytes"] + layers * probe["interval"] * entry_bytes
    else:
        decode = prefill + layers * gen_len * entry_bytes
    return {
        "entry_bytes": entry_bytes,
        "prefill_bytes": int(math.ceil(prefill)),
        "decode_bytes": int(math.ceil(decode)),
        "peak_bytes": int(math.ceil(max(prefill, decode))),
    }
