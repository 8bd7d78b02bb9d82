"""The CPU backend of :func:`keepkv.kernels.paged.paged_decode`, in Numba (imported on first use).

One task per (request, KV head), spread over Numba's threads. A task keeps its g query heads'
logits for the request's S entries in one [g, S] fp32 row set (S floats per head, as the
Triton kernel's statistics):

1. **keys, once:** for each block, its key plane as fp32 (a view of an fp32 cache; a bf16 one
   widened into a tile), and z[i, s] = Σ_d q_i[d]·k_s[d]·scaling for the group (SIMD over slots
   when keys are packed dim-major, as vLLM's CPU kernel packs them; over dimensions otherwise),
   then the entry's bias from its fp32 word;
2. **softmax:** max, then exp through 2^n·p(u) (a degree-7 polynomial on |u| ≤ ln2 / 2, exact to
   fp32 rounding, in a loop the compiler vectorizes: Numba's scalar exp is not), sum;
3. **values, once:** acc[i, :] += p_i[s]·v_s, block by block.
"""

from __future__ import annotations

import os
import threading

import numba
import numpy as np
from numba.extending import overload


def _answer_vllms_module_scan() -> None:
    """vLLM's CPU worker (0.32) scans every loaded module's attributes when it starts, reading
    ``vars(value).get(...)``; llvmlite's library wrapper answers any attribute, ``__dict__`` too,
    with a function wrapper, so an engine started in a process that loaded Numba fails there
    (``'_lib_fn_wrapper' object has no attribute 'get'``). An empty namespace answers it."""
    try:
        from llvmlite.binding import ffi

        ffi.lib._fntab.setdefault("__dict__", {})
    except (ImportError, AttributeError):  # another llvmlite: nothing to answer
        pass


_answer_vllms_module_scan()

# Numba's own thread pool, never its OpenMP layer: in a vLLM worker (torch's OpenMP threads pinned
# to cores) Numba's "omp" layer made every torch op after the kernel's first call about twice as
# slow (docs/record/2026-11-29-paged-kernel.md). The workqueue pool runs one parallel call at a
# time: concurrent callers take turns (LOCK). NUMBA_THREADING_LAYER, when set, is the user's choice.
if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "workqueue"
LOCK = threading.Lock()


def set_threads(count: int) -> None:
    """Run the kernel on ``count`` threads (at most Numba's pool, ``NUMBA_NUM_THREADS``)."""
    numba.set_num_threads(max(1, min(count, numba.config.NUMBA_NUM_THREADS)))

LOG2E = np.float32(1.4426950408889634)
LN2 = np.float32(0.6931471805599453)


def _plane(cache, start, count, tile, bits):  # pragma: no cover - replaced by its overloads in compiled code
    raise NotImplementedError


@overload(_plane, inline="always")
def _plane_overload(cache, start, count, tile, bits):
    """``count`` elements of the cache from ``start`` as fp32: a view of an fp32 cache, or a bf16
    cache's bits (uint16) widened into ``tile`` (fp32, contiguous; ``bits``: its uint32 view,
    made once per task so that the loops over ``tile`` see a contiguous fp32 array)."""
    if cache.dtype == numba.types.uint16:
        def widen(cache, start, count, tile, bits):
            source = cache[start : start + count]
            for e in range(count):
                bits[e] = np.uint32(source[e]) << np.uint32(16)
            return tile
        return widen

    def view(cache, start, count, tile, bits):
        return cache[start : start + count]
    return view


@numba.njit(fastmath=True, inline="always", cache=True)
def _exp_sum(z, count, top, exponents):
    """z[:count] <- exp(z - top) (fp32, z - top <= 0; 0 below 2^-126, beside the max's 1); returns
    their sum. ``exponents``: int32 scratch of ``count``."""
    for s in range(count):
        t = max((z[s] - top) * LOG2E, np.float32(-126.0))  # -inf (an empty slot): 0 below
        n = np.floor(t + np.float32(0.5))
        u = (t - n) * LN2  # |u| <= ln2 / 2: Taylor to u^7 is exact to fp32 rounding
        z[s] = np.float32(1.0) + u * (np.float32(1.0) + u * (np.float32(1 / 2) + u * (np.float32(1 / 6) + u * (
            np.float32(1 / 24) + u * (np.float32(1 / 120) + u * (np.float32(1 / 720) + u * np.float32(1 / 5040)))))))
        exponents[s] = (np.int32(n) + np.int32(127)) << np.int32(23)
    powers = exponents[:count].view(np.float32)
    total = np.float32(0.0)
    for s in range(count):
        value = z[s] * powers[s] if powers[s] > np.float32(1.2e-38) else np.float32(0.0)
        z[s] = value
        total += value
    return total


@numba.njit(parallel=True, fastmath=True, nogil=True, cache=True)
def paged_decode_numba(q, cache, words, table, seq_lens, out, stat_logits, stat_probs, scaling, kv_heads, head_dim,
                       block_size, cell, keys_at, values_at, keys_by_dim, values_by_dim, words_at, word_count,
                       bias_word, cell_words, want_logits, want_probs):
    """q [R, H, D] fp32; cache: the flat cache (fp32, or bf16 bits as uint16); words: its flat fp32
    view (or an empty array when ``bias_word`` < 0); table [R, blocks] int32; seq_lens [R] int32;
    out [R, H, D] fp32; stat_logits, stat_probs [R, H_kv, g, max_len] fp32 (filled only when wanted)."""
    rows = q.shape[0]
    group = q.shape[1] // kv_heads
    plane = block_size * head_dim
    for task in numba.prange(rows * kv_heads):
        r = task // kv_heads
        h = task % kv_heads
        length = seq_lens[r]
        z = np.zeros((group, max(length, 1)), np.float32)
        tile = np.empty(plane, np.float32)
        bits = tile.view(np.uint32)
        exponents = np.empty(max(length, 1), np.int32)
        qg = np.empty((group, head_dim), np.float32)
        for i in range(group):
            for d in range(head_dim):
                qg[i, d] = q[r, h * group + i, d] * scaling
        blocks = (length + block_size - 1) // block_size
        # 1. logits: each block's keys read once
        for b in range(blocks):
            cell_at = (np.int64(table[r, b]) * kv_heads + h) * cell
            keys = _plane(cache, cell_at + keys_at, plane, tile, bits)
            first = b * block_size
            count = min(block_size, length - first)
            if keys_by_dim:  # four dimensions per sweep over the slots: a quarter of z's loads and stores
                quad = head_dim - head_dim % 4
                for d in range(0, quad, 4):
                    r0 = keys[d * block_size : d * block_size + count]
                    r1 = keys[(d + 1) * block_size : (d + 1) * block_size + count]
                    r2 = keys[(d + 2) * block_size : (d + 2) * block_size + count]
                    r3 = keys[(d + 3) * block_size : (d + 3) * block_size + count]
                    for i in range(group):
                        w0, w1, w2, w3 = qg[i, d], qg[i, d + 1], qg[i, d + 2], qg[i, d + 3]
                        zi = z[i, first : first + count]
                        for s in range(count):
                            zi[s] += w0 * r0[s] + w1 * r1[s] + w2 * r2[s] + w3 * r3[s]
                for d in range(quad, head_dim):
                    row = keys[d * block_size : d * block_size + count]
                    for i in range(group):
                        weight = qg[i, d]
                        zi = z[i, first : first + count]
                        for s in range(count):
                            zi[s] += weight * row[s]
            else:
                for s in range(count):
                    key = keys[s * head_dim : (s + 1) * head_dim]
                    for i in range(group):
                        acc = np.float32(0.0)
                        for d in range(head_dim):
                            acc += qg[i, d] * key[d]
                        z[i, first + s] = acc
            if want_logits:
                for i in range(group):
                    for s in range(count):
                        stat_logits[r, h, i, first + s] = z[i, first + s]
            if bias_word >= 0:
                word = (np.int64(table[r, b]) * kv_heads + h) * cell_words + words_at + bias_word
                for s in range(count):
                    bias = words[word + s * word_count]
                    for i in range(group):
                        z[i, first + s] += bias
        # 2. softmax per query head
        inverse = np.empty(group, np.float32)
        for i in range(group):
            zi = z[i, :length]
            top = np.float32(-np.inf)
            for s in range(length):
                top = max(top, zi[s])
            if top == -np.inf:  # nothing visible: zeros, as the reference's 0 / 0 is taken to be
                zi[:] = 0.0
                inverse[i] = 0.0
                continue
            total = _exp_sum(zi, length, top, exponents)
            inverse[i] = np.float32(1.0) / total if total > 0 else np.float32(0.0)
            if want_probs:
                for s in range(length):
                    stat_probs[r, h, i, s] = zi[s] * inverse[i]
        # 3. values: each block read once
        acc = np.zeros((group, head_dim), np.float32)
        for b in range(blocks):
            cell_at = (np.int64(table[r, b]) * kv_heads + h) * cell
            values = _plane(cache, cell_at + values_at, plane, tile, bits)
            first = b * block_size
            count = min(block_size, length - first)
            if values_by_dim:
                for i in range(group):
                    for d in range(head_dim):
                        row = values[d * block_size : d * block_size + count]
                        total = np.float32(0.0)
                        for s in range(count):
                            total += z[i, first + s] * row[s]
                        acc[i, d] += total
            else:  # four slots per sweep over the dimensions: a quarter of acc's loads and stores
                quad = count - count % 4
                for s in range(0, quad, 4):
                    v0 = values[s * head_dim : (s + 1) * head_dim]
                    v1 = values[(s + 1) * head_dim : (s + 2) * head_dim]
                    v2 = values[(s + 2) * head_dim : (s + 3) * head_dim]
                    v3 = values[(s + 3) * head_dim : (s + 4) * head_dim]
                    for i in range(group):
                        p0, p1 = z[i, first + s], z[i, first + s + 1]
                        p2, p3 = z[i, first + s + 2], z[i, first + s + 3]
                        ai = acc[i]
                        for d in range(head_dim):
                            ai[d] += p0 * v0[d] + p1 * v1[d] + p2 * v2[d] + p3 * v3[d]
                for s in range(quad, count):
                    value = values[s * head_dim : (s + 1) * head_dim]
                    for i in range(group):
                        weight = z[i, first + s]
                        ai = acc[i]
                        for d in range(head_dim):
                            ai[d] += weight * value[d]
        for i in range(group):
            for d in range(head_dim):
                out[r, h * group + i, d] = acc[i, d] * inverse[i]
