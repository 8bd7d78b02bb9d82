"""The Triton backend of :func:`keepkv.kernels.paged.paged_decode` (imported on first use).

One program per (request, KV head) loads the g query heads of its group once (padded to
``BLOCK_G`` >= 16 rows: tl.dot's smallest tile), then walks the request's first ``seq_lens[r]``
entries in tiles of ``BLOCK_S`` slots (a power of two dividing ``block_size``, so a tile never
straddles two blocks): the tile's block id from the block table, its keys read in place from the
flat cache (slot-major or dim-major: the geometry's strides), q·Kᵀ for the whole group in one
``tl.dot`` (fp32 accumulation), the bias from the cache's fp32 words, an online softmax, and P·V
accumulated in fp32, as :mod:`keepkv.kernels.decode`. The logits (q·k·scaling, no bias) are
stored as computed; the probabilities are finished by a second sweep over the stored fp32
logits + bias once the max and the sum are known (the keys and values are not read again).

Offsets within the flat cache (elements of its dtype), for slot s of block ``b`` = the table's
entry, KV head h::

    cell  = (b * H_kv + h) * geometry.cell
    key   = cell + keys_at + s * D + d            (dim-major: + d * block_size + s)
    value = cell + values_at + ...                (likewise)
    bias  = fp32 word (b * H_kv + h) * cell_words + words_at + s * words + bias_word

Runs on CUDA, or anywhere in Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
import os

import torch

from .paged_geometry import PagedGeometry, check_call

try:  # the optional extra: pip install -e ".[gpu]"
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = tl = None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


if triton is not None:  # the kernel's annotations need triton.language

    def _paged_decode_kernel(
        Q, Cache, Words, Table, SeqLens, Out, Logits, Probs,
        scaling,
        stride_qr, stride_qh, stride_qd,
        stride_or, stride_oh, stride_od,
        stride_tr, stride_tb, stride_l,
        stride_ks, stride_kd, stride_vs, stride_vd,
        H_KV, G, D, max_len, cell, keys_at, values_at, cell_words, words_at, word_count, bias_word,
        BLOCK_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, WANT_LOGITS: tl.constexpr, WANT_PROBS: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
    ):
        """One program per (request, KV head): see the module docstring."""
        pid = tl.program_id(0)
        r = pid // H_KV
        h = pid % H_KV
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_s0 = tl.arange(0, BLOCK_S)
        g_mask = offs_g < G
        d_mask = offs_d < D
        heads = h * G + offs_g
        q = tl.load(Q + r * stride_qr + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        length = tl.minimum(tl.load(SeqLens + r * stride_l), max_len)  # the block table holds max_len
        stat_off = (pid * G + offs_g[:, None]).to(tl.int64) * max_len  # Logits, Probs [R, H_kv, g, max_len]
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for start in range(0, length, BLOCK_S):
            block = tl.load(Table + r * stride_tr + (start // BLOCK_SIZE) * stride_tb).to(tl.int64)
            base = block * H_KV + h  # the (block, KV head) cell
            slots = start % BLOCK_SIZE + offs_s0  # within the block
            offs_s = start + offs_s0  # within the request
            live = offs_s < length
            tile_mask = live[:, None] & d_mask[None, :]
            k = tl.load(Cache + base * cell + keys_at + slots[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                        mask=tile_mask, other=0.0)
            if UPCAST_DOT:  # exact products, fp32 sums: what the GPU's bf16 dot computes
                logits = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scaling
            else:
                logits = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=PRECISION) * scaling  # [G, S] fp32
            logits = tl.where(live[None, :], logits, float("-inf"))
            store_mask = g_mask[:, None] & live[None, :]
            if WANT_LOGITS:
                tl.store(Logits + stat_off + offs_s[None, :], logits, mask=store_mask)
            z = logits
            if HAS_BIAS:
                word = base * cell_words + words_at + slots * word_count + bias_word
                bias = tl.load(Words + word, mask=live, other=0.0)
                z = logits + bias[None, :]
            if WANT_PROBS:  # finished below, once the max and the sum are known
                tl.store(Probs + stat_off + offs_s[None, :], z, mask=store_mask)
            m_new = tl.maximum(m, tl.max(z, 1))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible entry yet: exp(-inf) = 0
            alpha = tl.exp(m - shift)
            p = tl.exp(z - shift[:, None])
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(Cache + base * cell + values_at + slots[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                        mask=tile_mask, other=0.0)
            if UPCAST_DOT:
                pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv
            m = m_new
        inverse = tl.where(total > 0, 1.0 / tl.where(total > 0, total, 1.0), 0.0)  # an empty request: zeros
        tl.store(Out + r * stride_or + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 (acc * inverse[:, None]).to(Out.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
        if WANT_PROBS:
            tl.debug_barrier()
            shift = tl.where(m == float("-inf"), 0.0, m)
            for start in range(0, length, BLOCK_S):
                offs_s = start + offs_s0
                mask = g_mask[:, None] & (offs_s < length)[None, :]
                z = tl.load(Probs + stat_off + offs_s[None, :], mask=mask, other=float("-inf"))
                tl.store(Probs + stat_off + offs_s[None, :], tl.exp(z - shift[:, None]) * inverse[:, None], mask=mask)


@functools.lru_cache(maxsize=2)
def _compiled(interpret: bool):
    """The jitted kernel; Triton picks the interpreter when it decorates, so one per mode."""
    return triton.jit(_paged_decode_kernel)


def _next_power_of_2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << max(0, (n - 1).bit_length()))


def triton_paged_decode(query, kv_cache, block_table, seq_lens, scaling: float, geometry: PagedGeometry, *,
                        max_len: int, logits: bool = False, probs: bool = False, block_s: int = 64):
    """:func:`keepkv.kernels.paged.paged_decode` in Triton (same arguments, same results).

    query [R, H, D]; kv_cache [blocks, H_kv, ...] contiguous, cells as ``geometry`` says
    (``block_size`` a power of two >= 16); block_table [R, max_blocks] int; seq_lens [R] int, each
    ≤ ``max_len`` (a longer one is read as ``max_len``). Returns ``(out, probs, logits)``: out
    [R, H, D] in the query's dtype; probs and logits [R, H_kv, g, max_len] fp32 (0 and -inf past
    a request's length), or None. ``block_s``: slots per tile (capped at ``block_size``).

    Raises ImportError without Triton, ValueError on mismatched shapes, and RuntimeError off
    CUDA unless ``TRITON_INTERPRET=1``.
    """
    if triton is None:
        raise ImportError('keepkv\'s paged Triton kernel needs Triton: pip install -e ".[gpu]"')
    check_call(query, kv_cache, block_table, seq_lens, geometry, max_len)
    size = geometry.block_size
    if size < 16 or size & (size - 1):
        raise ValueError(f"the triton backend needs block_size a power of 2 >= 16 (tl.dot's smallest tile); got {size}")
    if block_s < 16 or block_s & (block_s - 1):
        raise ValueError(f"block_s must be a power of 2 >= 16 (tl.dot's smallest tile); got {block_s!r}")
    if geometry.biased and geometry.cell * kv_cache.element_size() % 4:
        raise ValueError(f"a biased cell must be whole fp32 words; got {geometry.cell} {kv_cache.dtype} elements")
    if len({t.device for t in (query, kv_cache, block_table, seq_lens)}) != 1:
        raise ValueError("query, kv_cache, block_table and seq_lens must be on one device")
    interpret = _interpreting()
    if query.device.type != "cuda" and not interpret:
        raise RuntimeError(f"the paged Triton kernel runs on CUDA (or with TRITON_INTERPRET=1); got {query.device}")
    rows, heads, head_dim = query.shape
    group = heads // geometry.kv_heads
    device = query.device
    out = torch.empty(rows, heads, head_dim, dtype=query.dtype, device=device)
    stats_shape = (rows, geometry.kv_heads, group, max_len)
    probs_out = torch.zeros(stats_shape, device=device) if probs else None
    logits_out = torch.full(stats_shape, float("-inf"), device=device) if logits else None
    flat = kv_cache.view(-1)
    words = flat.view(torch.float32) if geometry.biased else flat
    key_strides = (1, size) if geometry.keys_by_dim else (head_dim, 1)  # (slot, dim)
    value_strides = (1, size) if geometry.values_by_dim else (head_dim, 1)
    same_dtype = query.dtype == kv_cache.dtype
    _compiled(interpret)[(rows * geometry.kv_heads,)](
        query, flat, words, block_table, seq_lens, out,
        logits_out if logits else out, probs_out if probs else out,
        float(scaling),
        *query.stride(), *out.stride(), *block_table.stride(), seq_lens.stride(0),
        *key_strides, *value_strides,
        geometry.kv_heads, group, head_dim, max_len, geometry.cell, geometry.keys_at, geometry.values_at,
        geometry.cell * kv_cache.element_size() // 4, geometry.words_at, geometry.words, geometry.bias_word,
        BLOCK_SIZE=size, HAS_BIAS=geometry.biased, WANT_LOGITS=logits, WANT_PROBS=probs,
        BLOCK_G=_next_power_of_2(group), BLOCK_S=min(block_s, size), BLOCK_D=_next_power_of_2(head_dim),
        PRECISION="ieee" if kv_cache.dtype == torch.float32 else "tf32",  # fp32 caches: no TF32 rounding
        # Triton's interpreter mis-evaluates a bf16 tl.dot (seen with triton 3.9): there the bf16
        # operands are upcast first, which gives the same exact products and fp32 sums. A query
        # in another dtype than the cache's is not rounded to it: fp32 operands.
        UPCAST_DOT=(interpret and kv_cache.dtype == torch.bfloat16) or not same_dtype,
    )
    return out, probs_out, logits_out
