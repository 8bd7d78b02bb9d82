"""Reference computations the tests compare keepkv with (not used by the library)."""

import torch

from keepkv.attention import Needs, attend


def attention_mass(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention softmax(q·k·scaling + bias)·V and the per-entry scores s = exp(q·k·scaling).

    Computed in fp32, or fp64 when ``query`` is fp64.

    Parameters
    ----------
    query : [B, H_kv, D] (one query per KV head) or [B, H_kv, g, D] (a GQA group).
    keys, values : [B, H_kv, S, D].
    bias : [B, H_kv, S], -inf removes an entry from the output.
    scaling : attention scale (1/√D).

    Returns
    -------
    output : [B, H_kv, D] or [B, H_kv, g, D].
    weights : [B, H_kv, S] or [B, H_kv, g, S], the unnormalised score s_i = exp(q·k_i·scaling)
        of KeepKV eq. 3, *without* the bias: multiply by exp(bias) for the attention mass with
        votes, p_i s_i (eq. 6). May overflow past a logit of ~88 in fp32.
    """
    dtype = torch.promote_types(query.dtype, torch.float32)
    one_query = query.dim() == 3
    q = query.to(dtype).unsqueeze(-2) if one_query else query.to(dtype)  # [B, H_kv, g, D]
    logits = (q @ keys.to(dtype).transpose(-1, -2)) * scaling  # [B, H_kv, g, S]
    output = (logits + bias.to(dtype).unsqueeze(-2)).softmax(dim=-1) @ values.to(dtype)  # [B, H_kv, g, D]
    weights = logits.exp()
    if one_query:
        return output.squeeze(-2), weights.squeeze(-2)
    return output, weights


def decode_attention_reference(query_g, keys, values, bias, scaling: float, lengths=None, probs: bool = False,
                               logits: bool = False):
    """The same as :func:`decode_attention`, by keepkv's torch path (:func:`keepkv.attention.attend`'s
    explicit pass, a length folded into the bias as -inf): the reference the kernel is tested against."""
    batch, kv_heads, group, head_dim = query_g.shape
    size = keys.shape[2]
    absent = None
    if lengths is not None:
        absent = torch.arange(size, device=keys.device) >= lengths.to(keys.device)[..., None]  # [B, H_kv, S]
        bias = bias.masked_fill(absent, float("-inf"))
    query = query_g.reshape(batch, kv_heads * group, 1, head_dim)
    block_mask = torch.ones(batch, 1, 1, 1, dtype=torch.bool, device=keys.device)
    output, stats = attend(query, keys, values, bias, block_mask, scaling, Needs(probs=True, logits=True))
    out = output.reshape(batch, kv_heads, group, head_dim)
    stats_logits = stats.logits[:, :, :, 0]
    if absent is not None:
        stats_logits = stats_logits.masked_fill(absent[:, :, None], float("-inf"))
    return out, stats.probs[:, :, :, 0] if probs else None, stats_logits if logits else None
