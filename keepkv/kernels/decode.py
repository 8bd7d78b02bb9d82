"""One-pass decode attention in Triton: each key and value is read once, in the model's dtype.

For one new query token per head, grouped-query attention over a layer's kept entries::

    z_s   = q·k_s·scaling + bias_s                     (bias: Electoral Votes' ln p, or -inf)
    p_s   = exp(z_s - max z) / Σ exp(z - max z)        (fp32)
    out   = Σ_s p_s v_s                                 (fp32 accumulation, stored in the model dtype)

One program per (batch row, KV head) loads the g query heads of its group once, then walks the
entries in blocks of ``BLOCK_S``: q·Kᵀ for the whole group in one ``tl.dot`` (model dtype in,
fp32 accumulation), an online softmax (running max and sum, as flash-decoding), and P·V
accumulated in fp32. The same pass hands the methods what they need: the logits q·k·scaling
(fp32, no bias: KeepKV's EMA) are stored as they are computed, and the probabilities (H2O,
SnapKV, D2O) are finished by a sweep over those stored fp32 logits after the max and sum are
known (S floats per head: the keys and values are not read again).

Ragged lengths: with ``lengths`` [B, H_kv], row b and KV head h read only their first
``lengths[b, h]`` entries; the rest count as absent (probability 0, logit -inf), and are never
loaded.

The torch path (``tests/reference.py:decode_attention_reference``, which is keepkv's
:func:`keepkv.attention.attend`) is the reference and the default; ``CompressedCache(kernel="triton")``
opts a cache's decode steps in (:func:`keepkv.attention.decode_kernel_for`). The kernel runs on
CUDA, or anywhere in Triton's interpreter (``TRITON_INTERPRET=1``), which the tests use on CPU.
"""

from __future__ import annotations

import functools
import os

import torch

try:  # the optional extra: pip install -e ".[gpu]"
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = tl = None


def triton_available() -> bool:
    """Whether Triton is installed (``pip install -e ".[gpu]"``)."""
    return triton is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


if triton is not None:  # the kernel's annotations need triton.language

    def _decode_kernel(
        Q, K, V, Bias, Lengths, Out, Logits, Probs,
        scaling,
        stride_qb, stride_qh, stride_qg, stride_qd,
        stride_kb, stride_kh, stride_ks, stride_kd,
        stride_vb, stride_vh, stride_vs, stride_vd,
        stride_bb, stride_bh, stride_bs,
        stride_ob, stride_oh, stride_og, stride_od,
        stride_pb, stride_ph, stride_pg, stride_ps,
        H_KV, G, S, D,
        HAS_LENGTHS: tl.constexpr, WANT_LOGITS: tl.constexpr, WANT_PROBS: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
    ):
        """One program per (batch row, KV head): see the module docstring."""
        pid = tl.program_id(0)
        b = pid // H_KV
        h = pid % H_KV
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_s0 = tl.arange(0, BLOCK_S)
        g_mask = offs_g < G
        d_mask = offs_d < D
        q = tl.load(
            Q + b * stride_qb + h * stride_qh + offs_g[:, None] * stride_qg + offs_d[None, :] * stride_qd,
            mask=g_mask[:, None] & d_mask[None, :], other=0.0,
        )
        length = S
        if HAS_LENGTHS:
            length = tl.minimum(tl.load(Lengths + pid), S)
        k_base = K + b * stride_kb + h * stride_kh
        v_base = V + b * stride_vb + h * stride_vh
        bias_base = Bias + b * stride_bb + h * stride_bh
        p_off = b * stride_pb + h * stride_ph + offs_g[:, None] * stride_pg
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for start in range(0, S, BLOCK_S):
            offs_s = start + offs_s0
            in_range = offs_s < S
            live = offs_s < length
            k = tl.load(k_base + offs_s[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                        mask=live[:, None] & d_mask[None, :], other=0.0)
            if UPCAST_DOT:  # exact bf16 products, fp32 sums: what the GPU's bf16 dot computes
                logits = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scaling
            else:
                logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scaling  # [G, S] fp32
            logits = tl.where(live[None, :], logits, float("-inf"))
            store_mask = g_mask[:, None] & in_range[None, :]
            if WANT_LOGITS:
                tl.store(Logits + p_off + offs_s[None, :] * stride_ps, logits, mask=store_mask)
            bias = tl.load(bias_base + offs_s * stride_bs, mask=live, other=float("-inf"))
            z = logits + bias[None, :]
            if WANT_PROBS:  # finished below, once the max and the sum are known
                tl.store(Probs + p_off + offs_s[None, :] * stride_ps, z, mask=store_mask)
            m_new = tl.maximum(m, tl.max(z, 1))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible entry yet: exp(-inf) = 0
            alpha = tl.exp(m - base)
            p = tl.exp(z - base[:, None])
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_base + offs_s[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                        mask=live[:, None] & d_mask[None, :], other=0.0)
            if UPCAST_DOT:
                pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv
            m = m_new
        inverse = tl.where(total > 0, 1.0 / total, 0.0)  # a row with no visible entry gives zeros
        out = acc * inverse[:, None]
        tl.store(Out + b * stride_ob + h * stride_oh + offs_g[:, None] * stride_og + offs_d[None, :] * stride_od,
                 out.to(Out.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
        if WANT_PROBS:
            tl.debug_barrier()
            base = tl.where(m == float("-inf"), 0.0, m)
            for start in range(0, S, BLOCK_S):
                offs_s = start + offs_s0
                mask = g_mask[:, None] & (offs_s < S)[None, :]
                z = tl.load(Probs + p_off + offs_s[None, :] * stride_ps, mask=mask, other=float("-inf"))
                tl.store(Probs + p_off + offs_s[None, :] * stride_ps, tl.exp(z - base[:, None]) * inverse[:, None], mask=mask)


@functools.lru_cache(maxsize=2)
def _compiled(interpret: bool):
    """The jitted kernel; Triton picks the interpreter when it decorates, so one per mode."""
    return triton.jit(_decode_kernel)


def _next_power_of_2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << max(0, (n - 1).bit_length()))


def _check(query_g, keys, values, bias, lengths) -> None:
    if query_g.dim() != 4 or keys.dim() != 4 or values.shape != keys.shape:
        raise ValueError(
            f"decode_attention needs query_g [B, H_kv, g, D] and keys, values [B, H_kv, S, D]; got "
            f"{tuple(query_g.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}"
        )
    batch, kv_heads, size, head_dim = keys.shape
    if query_g.shape[:2] != (batch, kv_heads) or query_g.shape[3] != head_dim:
        raise ValueError(f"query_g {tuple(query_g.shape)} does not match keys {tuple(keys.shape)}")
    if bias.shape != (batch, kv_heads, size) or bias.dtype != torch.float32:
        raise ValueError(f"bias must be float32 [B, H_kv, S] = {(batch, kv_heads, size)}; got {bias.dtype} {tuple(bias.shape)}")
    if not (query_g.dtype == keys.dtype == values.dtype) or keys.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"query, keys and values must share one of float32/bfloat16/float16; got "
                         f"{query_g.dtype}, {keys.dtype}, {values.dtype}")
    if lengths is not None and tuple(lengths.shape) != (batch, kv_heads):
        raise ValueError(f"lengths must be [B, H_kv] = {(batch, kv_heads)}; got {tuple(lengths.shape)}")
    if len({t.device for t in (query_g, keys, values, bias)}) != 1:
        raise ValueError("query, keys, values and bias must be on one device")


def decode_attention(query_g, keys, values, bias, scaling: float, lengths=None, probs: bool = False,
                     logits: bool = False, block_s: int = 64):
    """Decode-step attention in one pass over the entries (Triton).

    query_g [B, H_kv, g, D] (the new token's queries, grouped as keepkv groups them);
    keys, values [B, H_kv, S, D] in the same dtype (any strides: a slice of a larger buffer is
    read in place); bias [B, H_kv, S] float32; lengths [B, H_kv] int (optional): entries at or
    past a row and head's length are absent. Returns ``(out, probs, logits)``: out [B, H_kv, g, D]
    in the query's dtype; probs [B, H_kv, g, S] float32 (or None); logits [B, H_kv, g, S]
    float32, q·k·scaling without the bias, -inf past a length (or None).

    Raises ImportError without Triton, ValueError on mismatched shapes or dtypes, and
    RuntimeError off CUDA unless ``TRITON_INTERPRET=1``.
    """
    if triton is None:
        raise ImportError('decode_attention needs Triton: pip install -e ".[gpu]"')
    _check(query_g, keys, values, bias, lengths)
    if isinstance(block_s, bool) or not isinstance(block_s, int) or block_s < 16 or block_s & (block_s - 1):
        raise ValueError(f"block_s must be a power of 2 >= 16 (tl.dot's smallest tile), got {block_s!r}")
    interpret = _interpreting()
    if query_g.device.type != "cuda" and not interpret:
        raise RuntimeError(f"decode_attention runs on CUDA (or with TRITON_INTERPRET=1); got {query_g.device}")
    batch, kv_heads, group, head_dim = query_g.shape
    size = keys.shape[2]
    out = torch.empty_like(query_g, memory_format=torch.contiguous_format)
    want = probs or logits
    stats_shape = (batch, kv_heads, group, size)
    probs_out = torch.empty(stats_shape, dtype=torch.float32, device=query_g.device) if probs else None
    logits_out = torch.empty(stats_shape, dtype=torch.float32, device=query_g.device) if logits else None
    strides_of = probs_out if probs_out is not None else logits_out
    stat_strides = strides_of.stride() if want else (0, 0, 0, 0)
    lengths_arg = (
        lengths.to(device=query_g.device, dtype=torch.int32).contiguous() if lengths is not None else out
    )
    precision = "ieee" if query_g.dtype == torch.float32 else "tf32"  # fp32 inputs: no TF32 rounding
    _compiled(interpret)[(batch * kv_heads,)](
        query_g, keys, values, bias, lengths_arg, out,
        logits_out if logits_out is not None else out, probs_out if probs_out is not None else out,
        float(scaling),
        *query_g.stride(), *keys.stride(), *values.stride(), *bias.stride(), *out.stride(), *stat_strides,
        kv_heads, group, size, head_dim,
        HAS_LENGTHS=lengths is not None, WANT_LOGITS=logits, WANT_PROBS=probs,
        BLOCK_G=_next_power_of_2(group), BLOCK_S=block_s, BLOCK_D=_next_power_of_2(head_dim), PRECISION=precision,
        # Triton's interpreter mis-evaluates a bf16 tl.dot (seen with triton 3.9): there the bf16
        # operands are upcast first, which gives the same exact products and fp32 sums.
        UPCAST_DOT=interpret and query_g.dtype == torch.bfloat16,
    )
    return out, probs_out, logits_out
