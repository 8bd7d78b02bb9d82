"""The attention path: softmax(q·K^T·scaling + bias)·V over a layer's kept entries.

Registered with transformers' AttentionInterface as ``"keepkv"``, together with a mask
builder of the same name that builds the standard SDPA mask. The keepkv path uses only the
*new block's* columns of it, [B, 1, q, q] (causal, padded keys off): once a layer is
compressed, physical slots no longer line up with logical positions, so the stored entries
are masked by their bias. Without a CompressedCache the path is plain SDPA.

Grouped-query attention: the g = H / H_kv query heads of KV head h are heads h·g … h·g+g−1
(HF's ``repeat_kv`` order). They are viewed as [B, H_kv, g, q, D] so keys are never repeated.
"""

from __future__ import annotations

import contextvars
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .checks import check_architecture, check_model
from .continuation import unwatch_ids, watch_ids
from .kernels.kept import kept_softmax

NEG_INF = float("-inf")
# Floats in one chunk of prefill logits: bounds the workspace, never a full T×T matrix.
CHUNK_ELEMENTS = 1 << 24

# The attention function is not handed the cache: a cache's update(), which HF's attention module
# calls right before its attention function, names itself here with the key block it returned, as
# (cache, keys); keepkv_attention takes it (hand_over).
ACTIVE_CACHE: contextvars.ContextVar = contextvars.ContextVar("keepkv_active_cache", default=None)


def hand_over(cache, key_states: torch.Tensor, config=None) -> None:
    """Name ``cache`` for the attention call that receives ``key_states``; called by a cache's
    ``update()``, which HF's attention modules call right before their attention function.

    Off keepkv's attention path the cache would be silently wrong (SDPA would attend over the new
    block alone, since the cache appends in the attention call), so a cache whose model's config
    (``config``, the one the cache was built with: ``model.config``) names another attention
    implementation is refused. The keys tie the cache to that one call: a cache named but never
    consumed cannot leak into a later forward (:func:`keepkv_attention`).
    """
    implementation = getattr(config, "_attn_implementation", None)
    if isinstance(implementation, str) and implementation != "keepkv":
        raise ValueError(
            f"a {type(cache).__name__} needs the model on keepkv's attention path, but its attention is "
            f"{implementation!r}: call keepkv.enable(model) (or use keepkv.generate) first"
        )
    ACTIVE_CACHE.set((cache, key_states))


@dataclass(frozen=True)
class Reconstruction:
    """A context-reconstruction pass (KVzip, Kim et al. 2025, arXiv 2505.23416): after the prefill,
    the model reads a "repeat the previous context" instruction followed by the context's own
    tokens, teacher-forced, in blocks of ``chunk`` tokens, each block attending over the whole
    cached context and itself; its keys and values are then discarded. What it yields per entry is
    the largest attention probability any of its queries gave that entry (``StepStats.reconstructed``).

    ``share`` < 1 is a cheaper pass: it repeats runs of 16 of the context's tokens at an even
    stride, about that share of them, so it costs about that share of the full pass.
    """

    chunk: int = 2048
    share: float = 1.0


@dataclass(frozen=True)
class Needs:
    """What a method asks the attention path (and, for ``reconstruct``, the caller) to compute for it."""

    probs: bool = False  # attention probabilities of every query row (decode steps)
    colsum: bool = False  # column sums of the probabilities over all query rows (prefill)
    window: int = 0  # probabilities of the last `window` query rows (prefill)
    logits: bool = False  # q·K·scaling of every query row, fp32, no bias (decode steps)
    decays: tuple[float, ...] = ()  # Σ_i λ^(q-1-i) probs_i over query rows, per λ (prefill)
    colmax: bool = False  # max over the real query rows of the probabilities (a reconstruction's blocks)
    # Reconstruction passes to run over the prompt once it is prefilled, before it is compressed
    # (keepkv.reconstruction runs them; the prefill's statistics then hold their results).
    reconstruct: tuple[Reconstruction, ...] = ()

    @staticmethod
    def union(needs: list["Needs"]) -> "Needs":
        """Everything any of ``needs`` asks for."""
        return Needs(
            probs=any(n.probs for n in needs),
            colsum=any(n.colsum for n in needs),
            window=max((n.window for n in needs), default=0),
            logits=any(n.logits for n in needs),
            decays=tuple(sorted({decay for n in needs for decay in n.decays})),
            colmax=any(n.colmax for n in needs),
            reconstruct=tuple(dict.fromkeys(p for n in needs for p in n.reconstruct)),
        )

    def missing(self, other: "Needs") -> list[str]:
        """What ``other`` asks for that this does not compute (names of the fields)."""
        gaps = [
            name for name in ("probs", "colsum", "logits", "colmax") if getattr(other, name) and not getattr(self, name)
        ]
        if other.window > self.window:
            gaps.append(f"window={other.window}")
        gaps += [f"decay {decay}" for decay in other.decays if decay not in self.decays]
        gaps += [f"reconstruction {p}" for p in other.reconstruct if p not in self.reconstruct]
        return gaps


@dataclass
class StepStats:
    """What one attention call saw, handed to the method.

    query        [B, H_kv, g, q, D]   the new queries, after RoPE
    probs        [B, H_kv, g, q, S]   attention probabilities (if asked)
    colsum       [B, H_kv, g, S]      Σ over query rows of the probabilities (if asked)
    window_probs [B, H_kv, g, w, S]   probabilities of the last w query rows (if asked)
    logits       [B, H_kv, g, q, S]   fp32 q·k·scaling without the bias (if asked, and at a paged
                                      prompt's end, of the rows in ``query``): the very logits
                                      the attention's probabilities come from
    decayed      {λ: [B, H_kv, g, S]} Σ_i λ^(q-1-i) probs_i over the q query rows (if asked):
                                      the newest row weighs 1
    colmax       [B, H_kv, g, S]      max over the real query rows of the probabilities (if asked)
    reconstructed {pass: [B, H_kv, g, S]} per reconstruction pass run after a prefill: the largest
                                      probability any of its queries gave each prompt entry
    rebuilt      bool                 the statistics of a layer a method just rebuilt (KeepKV's
                                      refresh), not of an attention call
    static_shapes bool or None        the decode step keeps static shapes and reads nothing back to
                                      the host (None: where a read would wait or break a compiled
                                      graph, :func:`static_shapes`)
    S is the layer's size after the new block was appended.
    """

    query: torch.Tensor
    scaling: float
    is_prefill: bool
    probs: torch.Tensor | None = None
    colsum: torch.Tensor | None = None
    window_probs: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    decayed: dict[float, torch.Tensor] = field(default_factory=dict)
    colmax: torch.Tensor | None = None
    reconstructed: dict[Reconstruction, torch.Tensor] = field(default_factory=dict)
    rebuilt: bool = False
    static_shapes: bool | None = None

    def rows(self, index: torch.Tensor) -> "StepStats":
        """Rows ``index`` [B'] of every per-row tensor (a prefill's, kept for a later chunk or a fork)."""
        picked = {
            name: value.index_select(0, index) if isinstance(value, torch.Tensor) else value
            for name, value in vars(self).items()
        }
        picked["decayed"] = {decay: total.index_select(0, index) for decay, total in self.decayed.items()}
        picked["reconstructed"] = {key: top.index_select(0, index) for key, top in self.reconstructed.items()}
        return StepStats(**picked)

    @staticmethod
    def join(parts: list["StepStats"]) -> "StepStats":
        """One StepStats whose rows are the rows of ``parts`` in order (each per-row tensor of one
        shape past its first dimension; anything else as the first part's)."""
        first = parts[0]
        joined = {name: torch.cat([getattr(part, name) for part in parts]) if isinstance(value, torch.Tensor) else value
                  for name, value in vars(first).items()}
        joined["decayed"] = {decay: torch.cat([part.decayed[decay] for part in parts]) for decay in first.decayed}
        joined["reconstructed"] = {key: torch.cat([part.reconstructed[key] for part in parts])
                                   for key in first.reconstructed}
        return StepStats(**joined)


def static_shapes(stats: StepStats, tensor: torch.Tensor) -> bool:
    """Whether a decode step over ``tensor`` keeps static shapes and reads nothing back to the host:
    ``stats.static_shapes`` if set (``CompressedCache(static_shapes=...)``), else where a host read
    waits for the device or breaks a graph: off the CPU, or inside ``torch.compile``. On CPU a
    read costs no wait, and a step may size its work by what it reads (KeepKV's merge)."""
    if stats.static_shapes is not None:
        return stats.static_shapes
    return tensor.device.type != "cpu" or torch.compiler.is_compiling()


def group_queries(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, q, D] -> [B, H_kv, g, q, D]."""
    batch, heads, length, head_dim = query.shape
    return query.view(batch, kv_heads, heads // kv_heads, length, head_dim)


def half_gemm_to_fp32(device) -> bool:
    """Whether a bf16/fp16 batched GEMM on ``device`` can write fp32 results (``torch.bmm(...,
    out_dtype=torch.float32)``: CUDA, torch >= 2.8). Elsewhere the keys are upcast once per call."""
    return torch.device(device).type == "cuda" and hasattr(torch.ops.aten.bmm, "dtype")


def logit_keys(keys: torch.Tensor) -> torch.Tensor:
    """The keys as :func:`scaled_logits` reads them: unchanged where the GEMM takes them as they
    are (fp32, or bf16/fp16 with an fp32-output GEMM), else one fp32 copy, made once per
    attention call and sliced by every row chunk (never converted again per chunk)."""
    if keys.dtype == torch.float32 or half_gemm_to_fp32(keys.device):
        return keys
    return keys.float()


def scaled_logits(query_g, keys, scaling) -> torch.Tensor:
    """fp32 q·k·scaling [B, H_kv, g, r, S] of query_g [B, H_kv, g, r, D] against keys [B, H_kv, S, D]."""
    # Fold the group into the rows: a broadcast over g would copy the keys g times. The logits are
    # fp32 (a bf16/fp16 result would round them before the methods' fp32 scores see them). Half
    # inputs on CUDA: a tensor-core GEMM in their dtype with fp32 accumulation and fp32 output (the
    # product of two bf16/fp16 numbers is exact in fp32, so this equals the upcast GEMM up to the
    # order of the fp32 sums); elsewhere both operands are fp32 (already, for logit_keys()' keys).
    batch, kv_heads, group, rows, head_dim = query_g.shape
    flat = query_g.reshape(batch, kv_heads, group * rows, head_dim)
    if keys.dtype != torch.float32 and flat.dtype == keys.dtype and half_gemm_to_fp32(keys.device):
        # B and H_kv merge into one batch dim without a copy, also for a slice along S.
        logits = torch.bmm(
            flat.reshape(batch * kv_heads, group * rows, head_dim),
            keys.reshape(batch * kv_heads, -1, head_dim).transpose(1, 2), out_dtype=torch.float32,
        )
    else:
        logits = torch.matmul(flat.float(), keys.float().transpose(-1, -2))
    return logits.view(batch, kv_heads, group, rows, -1).mul_(scaling)


def entry_logits(query_g, keys, bias, scaling, block_mask_rows=None, scaled=None) -> torch.Tensor:
    """Logits q·k·scaling + bias, fp32 [B, H_kv, g, r, S].

    query_g [B, H_kv, g, r, D]; keys [B, H_kv, S, D]; bias [B, H_kv, S];
    block_mask_rows [B, r, q] masks the last q columns (the new block), if given;
    scaled: these rows' q·k·scaling if already computed (left unchanged).
    """
    if scaled is None:
        logits = scaled_logits(query_g, keys, scaling).add_(bias[:, :, None, None, :])  # one [r, S] buffer
    else:
        logits = scaled + bias[:, :, None, None, :]
    if block_mask_rows is not None:
        block = block_mask_rows.shape[-1]
        logits[..., -block:].masked_fill_(~block_mask_rows[:, None, None], NEG_INF)
    return logits


def softmax_probs(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over entries; rows with no visible entry (padded queries) get zeros."""
    return torch.softmax(logits, dim=-1).nan_to_num_(0.0)


def kept_query_stats(query_g, keys, bias, positions, query_positions, scaling: float, needs: Needs) -> StepStats:
    """The statistics of the decoding queries a cache kept since its last compression, computed at
    that compression over its entries (the paged adapter's; the Hugging Face cache computes them
    at each step, in :func:`attend`).

    query_g [B, H_kv, g, N, D], oldest first; keys [B, H_kv, S, D]; bias, positions [B, H_kv, S];
    query_positions [B, N]. Each query sees the entries held at its position (positions up to its
    own), with their bias: nothing was evicted or merged between compressions, so these are the
    probabilities it had (:func:`keepkv.kernels.kept.kept_softmax`). Logits [B, H_kv, g, N, S]
    where ``needs`` asks for them.
    """
    logits = scaled_logits(query_g, keys, scaling)
    probs = kept_softmax(logits, bias, positions, query_positions) if needs.probs else None
    return StepStats(query=query_g, scaling=scaling, is_prefill=False, probs=probs,
                     logits=logits if needs.logits else None)


def prompt_window_stats(query_g, keys, bias, positions, scaling: float, window: int) -> StepStats:
    """A prompt's end statistics for a method that reads only its newest query rows, which were
    attended already (the paged adapter's: its kernel attended them in place), so no output:
    the probabilities of the last ``window`` rows, causal among them, as :func:`attend` gives them
    (``window_probs``), and the logits of every row (fp32, no bias), which a method that folds the
    rows reads instead of computing them again (KeepKV's EMA).

    query_g [B, H_kv, g, w, D], the rows of the last w entries of keys [B, H_kv, S, D]; bias,
    positions [B, H_kv, S]."""
    rows = query_g.shape[3]
    stats = kept_query_stats(query_g, keys, bias, positions, positions[:, 0, -rows:], scaling,
                             Needs(probs=window > 0, logits=True))
    return StepStats(query=query_g, scaling=scaling, is_prefill=True, logits=stats.logits,
                     window_probs=None if window == 0 else stats.probs[:, :, :, -window:])


def attend(
    query, keys, values, bias, block_mask, scaling: float, needs: Needs = Needs(), is_prefill: bool = False,
    binary_bias: bool = False, decode_kernel=None,
):
    """Attend the new queries over the entries, whose last q are the new block.

    query [B, H, q, D]; keys, values [B, H_kv, S, D]; bias [B, H_kv, S];
    block_mask [B, 1, q, q] bool. ``binary_bias`` promises that the bias holds only 0 and -inf
    (no merged entry's ln p), so a bool mask carries it exactly. Returns the output [B, q, H, D]
    and the StepStats that ``needs`` asked for.

    Probabilities and column sums come from one explicit pass over row chunks, which computes the
    output from the same probabilities; otherwise SDPA does the work. ``decode_kernel``: a one-pass
    decode kernel (:func:`decode_kernel_for`) that a decode step needing probabilities or logits
    runs instead (the torch path stays the reference).
    """
    kv_heads = keys.shape[1]
    query_g = group_queries(query, kv_heads)
    batch, _, group, block, head_dim = query_g.shape
    size = keys.shape[2]
    stats = StepStats(query=query_g, scaling=scaling, is_prefill=is_prefill)
    if block == 1 and (needs.probs or needs.logits) and not (needs.colsum or needs.decays or needs.window):
        if decode_kernel is not None:  # one pass over the entries: output, probabilities and logits
            output, probs, logits = decode_kernel(query_g[:, :, :, 0], keys, values, bias, scaling,
                                                  probs=needs.probs, logits=needs.logits)
            stats.probs = None if probs is None else probs[:, :, :, None]
            stats.logits = None if logits is None else logits[:, :, :, None]
            return output.reshape(batch, 1, kv_heads * group, head_dim), stats
    if needs.logits:  # a decode step: one product serves the attention and the method
        stats.logits = scaled_logits(query_g, keys, scaling)
    rows_per_chunk = max(1, CHUNK_ELEMENTS // max(1, batch * kv_heads * group * size))
    keys_for_logits = None  # made on the first row chunk that needs it, then sliced by the others

    def row_probs(start: int, stop: int) -> torch.Tensor:
        """[B, H_kv, g, stop-start, S'] probabilities of query rows start..stop over the first
        S' = S - q + stop entries: the later block columns are causally masked for these rows."""
        visible = size - block + stop
        rows = query_g[:, :, :, start:stop]
        # A one-token block's only column is the query itself, which the block mask always shows
        # (new_block_mask): no mask to apply, two operations fewer per decode step.
        block_rows = None if block == 1 else block_mask[:, 0, start:stop, :stop]
        nonlocal keys_for_logits
        scaled = None if stats.logits is None else stats.logits[:, :, :, start:stop, :visible]
        if scaled is None and keys_for_logits is None:
            keys_for_logits = logit_keys(keys)
        visible_keys = None if scaled is not None else keys_for_logits[:, :, :visible]
        return softmax_probs(entry_logits(rows, visible_keys, bias[:, :, :visible], scaling, block_rows, scaled))

    if needs.probs or needs.colsum or needs.decays or needs.logits or needs.colmax or not (
        size == block or binary_bias or query.dtype == torch.float32
    ):
        # The block's real query rows: its last row sees every real column (left padding).
        query_real = block_mask[:, 0, -1] if needs.colmax else None
        output, stats.probs, stats.colsum, stats.decayed, stats.colmax = explicit_pass(
            row_probs, values, query_g.shape, block, rows_per_chunk, needs, query_real
        )
    elif size == block:
        # Nothing stored before this block, so the bias only marks padding, which the mask holds;
        # without padding the mask is plain causal and SDPA needs none (a mask forces a slower kernel).
        unpadded = bool(block_mask[:, 0, -1].all())
        output = prefill_sdpa(query, keys, values, None if unpadded else block_mask, scaling).transpose(1, 2)
    else:
        output = grouped_sdpa(query_g, keys, values, bias, block_mask, scaling, binary_bias)
    if needs.window:
        stats.window_probs = row_probs(max(0, block - needs.window), block)
    return output.contiguous(), stats


def prefill_sdpa(query, keys, values, mask, scaling: float) -> torch.Tensor:
    """Causal SDPA of a first block, [B, H, q, D]; ``mask`` [B, 1, q, q] bool or None (causal).

    As HF's ``use_gqa_in_sdpa``: GQA inside SDPA only without a mask (and head dim <= 256). CUDA
    has no fused kernel for a mask together with ``enable_gqa``, so that pair would fall back to
    the math kernel and materialise [B, H, q, q] logits; with a mask the KV heads are expanded to
    the query heads instead (HF's ``repeat_kv``: a prefill-only copy of [B, H, q, D])."""
    kv_heads, heads = keys.shape[1], query.shape[1]
    if mask is None and keys.shape[-1] <= 256:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=None, is_causal=True, scale=scaling,
                                              enable_gqa=True)
    if heads != kv_heads:
        keys, values = (
            x[:, :, None].expand(-1, -1, heads // kv_heads, -1, -1).reshape(x.shape[0], heads, *x.shape[2:])
            for x in (keys, values)
        )
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=mask is None, scale=scaling)


def explicit_pass(
    row_probs, values, query_shape, block: int, rows_per_chunk: int, needs: Needs, query_real=None
):
    """Output [B, q, H, D], probabilities [B, H_kv, g, q, S] (if ``needs.probs``), column sums
    [B, H_kv, g, S] (if ``needs.colsum``), decayed column sums {λ: [B, H_kv, g, S]} (one per
    ``needs.decays``) and column maxima [B, H_kv, g, S] over the rows where ``query_real`` [B, q]
    (if ``needs.colmax``), all from one pass of ``row_probs(start, stop)`` over chunks of query
    rows: the workspace is one chunk's logits, never [q, S] at once."""
    batch, kv_heads, group = query_shape[:3]
    size = values.shape[2]
    output_chunks, prob_chunks = [], []
    colsum = values.new_zeros(batch, kv_heads, group, size, dtype=torch.float32) if needs.colsum else None
    colmax = values.new_zeros(batch, kv_heads, group, size, dtype=torch.float32) if needs.colmax else None
    decayed = {decay: values.new_zeros(batch, kv_heads, group, size, dtype=torch.float32) for decay in needs.decays}
    if needs.decays:
        age = torch.arange(block - 1, -1, -1, device=values.device, dtype=torch.float32)  # rows after each row
    for start in range(0, block, rows_per_chunk):
        probs = row_probs(start, min(block, start + rows_per_chunk))
        rows, visible = probs.shape[3:]
        flat = probs.to(values.dtype).reshape(batch, kv_heads, group * rows, visible)
        output_chunks.append(torch.matmul(flat, values[:, :, :visible]).view(batch, kv_heads, group, rows, -1))
        if needs.probs:
            prob_chunks.append(probs if visible == size else F.pad(probs, (0, size - visible)))
        if needs.colsum:
            colsum[..., :visible] += probs.sum(3)
        if needs.colmax:  # a padded query row attends over the stored entries too: left out
            real = query_real[:, None, None, start : start + rows, None]
            colmax[..., :visible] = torch.maximum(colmax[..., :visible], probs.masked_fill(~real, 0.0).amax(3))
        for decay, total in decayed.items():
            weights = decay ** age[start : start + rows]
            total[..., :visible] += (probs * weights[:, None]).sum(3)

    def joined(chunks: list[torch.Tensor]) -> torch.Tensor:  # one chunk (every decode step): no copy
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=3)

    output = joined(output_chunks).reshape(batch, kv_heads * group, block, -1).transpose(1, 2)
    return output, joined(prob_chunks) if needs.probs else None, colsum, decayed, colmax


def grouped_sdpa(query_g, keys, values, bias, block_mask, scaling: float, binary_bias: bool) -> torch.Tensor:
    """SDPA over stored entries plus the new block, the group folded into query rows (K/V never
    repeated). The bias goes in as a bool mask when ``binary_bias``, else as a float mask, which
    needs fp32 queries: a bf16/fp16 mask would round ln p of merged entries.

    A decode step (q = 1) passes a [B, H_kv, 1, S] mask that SDPA broadcasts over the g heads of
    each group: no dense [B, H_kv, g·q, S] mask is built. A longer block needs its causal rows,
    so its mask is [B, H_kv, g·q, S].

    query_g [B, H_kv, g, q, D]; keys, values [B, H_kv, S, D]; bias [B, H_kv, S];
    block_mask [B, 1, q, q] bool. Returns [B, q, H, D].
    """
    batch, kv_heads, group, block, head_dim = query_g.shape
    if block == 1:
        # The new entry always sees itself (as below), so no row is empty.
        if binary_bias:
            mask = bias > NEG_INF
            mask[..., -1] = True
        else:
            mask = bias.clone()
            mask[..., -1:].nan_to_num_(neginf=0.0)
        output = F.scaled_dot_product_attention(
            query_g.reshape(batch, kv_heads, group, head_dim), keys, values, attn_mask=mask[:, :, None], scale=scaling,
        )
        return output.reshape(batch, 1, kv_heads * group, head_dim)
    stored = (bias > NEG_INF if binary_bias else bias)[:, :, None, None, :]  # [B, H_kv, 1, 1, S]
    mask = stored.expand(-1, -1, 1, block, -1).clone()  # [B, H_kv, 1, q, S], the same for the g heads
    # Within the new block: causal, and every query sees itself even when it is padding (as in a
    # first block's SDPA), so no row is empty: an empty row's NaN would reach real rows through
    # the next layer's keys and values.
    causal = block_mask[:, :, None]  # [B, 1, 1, q, q]
    itself = torch.eye(block, dtype=torch.bool, device=bias.device)
    tail = mask[..., -block:]
    if binary_bias:
        mask[..., -block:] = tail & causal | itself
    else:
        mask[..., -block:] = tail.masked_fill(~causal, NEG_INF).masked_fill(itself & (tail == NEG_INF), 0.0)
    output = F.scaled_dot_product_attention(
        query_g.reshape(batch, kv_heads, group * block, head_dim), keys, values,
        attn_mask=mask.expand(-1, -1, group, -1, -1).reshape(batch, kv_heads, group * block, -1), scale=scaling,
    )
    return output.reshape(batch, kv_heads * group, block, -1).transpose(1, 2)


def join_prefill_stats(earlier: StepStats, later: StepStats, window: int) -> StepStats:
    """The statistics of two consecutive prefill blocks, as one block of both would have given them.

    ``later`` saw ``earlier``'s entries plus its own block, so each of ``earlier``'s tensors is
    padded with zero probability for the later columns; ``window`` is the rows window_probs keeps.
    """

    def padded(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return F.pad(tensor, (0, like.shape[-1] - tensor.shape[-1]))

    joined = StepStats(query=torch.cat([earlier.query, later.query], dim=3), scaling=later.scaling, is_prefill=True)
    if later.probs is not None:
        joined.probs = torch.cat([padded(earlier.probs, later.probs), later.probs], dim=3)
    if later.colsum is not None:
        joined.colsum = padded(earlier.colsum, later.colsum) + later.colsum
    if later.colmax is not None:
        joined.colmax = torch.maximum(padded(earlier.colmax, later.colmax), later.colmax)
    later_rows = later.query.shape[3]  # each earlier row is this much older at the end of `later`
    joined.decayed = {
        decay: padded(earlier.decayed[decay], total) * decay**later_rows + total
        for decay, total in later.decayed.items()
    }
    if later.window_probs is not None:
        rows = torch.cat([padded(earlier.window_probs, later.window_probs), later.window_probs], dim=3)
        joined.window_probs = rows[:, :, :, -window:]
    return joined


DECODE_KERNELS = ("torch", "triton")


def decode_kernel_for(choice: str, device):
    """The decode kernel a cache's ``kernel`` names for ``device``: None for "torch" (the reference
    path of :func:`attend`), the one-pass Triton kernel (:func:`keepkv.kernels.decode_attention`)
    for "triton". Refused in one line where Triton cannot run it (not installed: ``pip install -e
    ".[gpu]"``; not CUDA, unless Triton's interpreter is on: ``TRITON_INTERPRET=1``)."""
    if choice == "torch":
        return None
    if choice != "triton":
        raise ValueError(f"kernel must be one of {', '.join(map(repr, DECODE_KERNELS))}, got {choice!r}")
    from .kernels import decode

    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if not decode.triton_available() or (torch.device(device).type != "cuda" and not interpreted):
        raise ValueError(
            f"kernel='triton' needs Triton (pip install -e \".[gpu]\") and a CUDA device (or TRITON_INTERPRET=1); "
            f"this cache runs on {torch.device(device)}"
        )
    return decode.decode_attention


class LayerAttention(Protocol):
    """What a cache that names itself with :func:`hand_over` gives the attention path: one call per
    layer and forward (``CompressedCache``; the eval's ``JointCache``, which splits a batch over
    several caches).

    ``forward_layer(layer_idx, query [B, H, q, D], keys, values [B, H_kv, q, D], block_mask
    [B, 1, q, q] bool, scaling) -> [B, q, H, D]``: append the new block, attend over the kept
    entries, compress. ``check_continuation(layer_idx, position_ids [B or 1, q], block_mask)``
    (optional): raise ValueError unless a block of several tokens continues what the cache holds.
    """

    def forward_layer(self, layer_idx: int, query, keys, values, block_mask, scaling: float) -> torch.Tensor: ...


def keepkv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The function transformers calls for ``attn_implementation="keepkv"``.

    With a cache that named itself for this call (:func:`hand_over`, a :class:`LayerAttention`),
    the cache attends over its kept entries. Without one (``use_cache=False``, a DynamicCache,
    plain ``model.generate``) this is the standard SDPA path with the standard mask, so a model
    left on ``"keepkv"`` still works as before.
    """
    active = ACTIVE_CACHE.get()
    if active is not None:
        ACTIVE_CACHE.set(None)
    if active is None or active[1] is not key:  # no cache, or a stale one that another call named
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    cache: LayerAttention = active[0]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    block_mask = new_block_mask(attention_mask, query.shape[0], query.shape[2], query.device)
    check = getattr(cache, "check_continuation", None)  # optional: see LayerAttention
    if check is not None and query.shape[2] > 1 and kwargs.get("position_ids") is not None:
        check(module.layer_idx, kwargs["position_ids"], block_mask)
    return cache.forward_layer(module.layer_idx, query, key, value, block_mask, scaling), None


def new_block_mask(attention_mask, batch: int, block: int, device) -> torch.Tensor:
    """[B, 1, q, q] bool: the new block's columns of the standard mask, causal with padded keys off.

    ``attention_mask`` is what :func:`keepkv_mask` built, [B, 1, q, kv] bool over the logical
    sequence (its last q columns are the new block), or None for a plain causal mask. A padded
    query still sees itself, so no row is empty (an empty row would turn its output into NaN,
    which would reach the real rows through the stored values).
    """
    if attention_mask is None:
        return torch.ones(block, block, dtype=torch.bool, device=device).tril().expand(batch, 1, block, block)
    return attention_mask[..., -block:] | torch.eye(block, dtype=torch.bool, device=device)


def keepkv_mask(*args, **kwargs):
    """Mask builder registered for ``"keepkv"``: the standard SDPA mask [B, 1, q, kv] (or None for
    a plain causal one). The keepkv path reads only its last q columns (see module doc).

    For a one-token block the mask is always built: HF would otherwise test the padding mask on
    the host (``fast_all``) to skip it, a host sync in every decode step; a [B, 1, 1, kv] mask
    costs one small kernel and gives the same attention."""
    cache_position = kwargs.get("cache_position")
    q_length = kwargs.get("q_length", None if cache_position is None else cache_position.shape[0])
    if q_length == 1:
        kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register("keepkv", keepkv_attention)
AttentionMaskInterface.register("keepkv", keepkv_mask)


def enable(model) -> None:
    """Switch ``model`` to keepkv's attention path (works for any Llama-family model).

    The model keeps working without a CompressedCache: that path is then the standard SDPA one.
    :func:`enabled` switches back when it is done. ``model.generate`` then also hands a cache the
    token ids of each step (:mod:`keepkv.continuation`), so that a new prompt on a used cache is refused.
    """
    check_model(model)
    check_architecture(model.config)  # refused here, not at the first forward
    if model.config._attn_implementation != "keepkv":
        model.set_attn_implementation("keepkv")
    watch_ids(model)


@dataclass
class _Switch:
    """A model's keepkv switch while ``enabled`` blocks run on it: how many are inside, and the
    implementation the last one to leave restores. It lives on the model (its lifetime, its
    identity), never in a table keyed by ``id``."""

    blocks: int
    restore: str | None


# Overlapping enabled() blocks on one model (threads of a server): the first to enter saves the
# model's implementation and switches it, the last to leave restores it. Per-call save/restore
# would let the first call to finish switch the model back under the others.
_SWITCH_LOCK = threading.Lock()
_SWITCH = "_keepkv_switch"  # the attribute of the model that holds its _Switch


@contextmanager
def enabled(model):
    """``with keepkv.enabled(model): ...`` runs the block on keepkv's attention path and restores
    the model's previous attention implementation afterwards, even on error.

    Thread-safe and reference-counted per model: overlapping blocks (any stagger) all run on the
    keepkv path, and the implementation found by the first is restored when the last one ends."""
    with _SWITCH_LOCK:
        switch = vars(model).get(_SWITCH)
        if switch is None:
            check_model(model)
            check_architecture(model.config)  # refused before the model is touched
            switch = _Switch(0, model.config._attn_implementation)
            object.__setattr__(model, _SWITCH, switch)  # a plain attribute, not a submodule
            enable(model)
        switch.blocks += 1
    try:
        yield model
    finally:
        with _SWITCH_LOCK:
            switch.blocks -= 1
            if switch.blocks == 0:
                object.__delattr__(model, _SWITCH)
                if switch.restore != "keepkv":  # enable() before the block keeps the hook too
                    unwatch_ids(model)
                if model.config._attn_implementation != switch.restore:
                    model.set_attn_implementation(switch.restore)
