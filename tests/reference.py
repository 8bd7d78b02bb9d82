"""Reference computations the tests compare keepkv with (not used by the library)."""

import torch


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
