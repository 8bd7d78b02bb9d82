"""What a cache continues: a running hash of the token ids each row has seen, and the hook through
which ``model.generate`` hands a cache the ids of every step.

The attention call sees keys, values and positions, never token ids, and ``model.generate`` feeds
a used cache only the tokens past the ones it has seen: a new prompt as long as the old
conversation or longer lines up by position and would be answered as its continuation. So the
ids are taken where the whole sequence is still in hand, ``prepare_inputs_for_generation``, and
given to the cache (``CompressedCache.see_ids``), which compares them with its record.
"""

from __future__ import annotations

import types

import torch

# Hash of a row: sum over its real tokens of (id + 1)·(k + 1) mod P, k the token's index among the
# row's real tokens. Every term and sum fits int64 (P < 2**31), on any device, without a host sync;
# one changed or two swapped ids always change it (P is prime, k + 1 and id + 1 are nonzero mod P).
P = 2**31 - 1


def ids_hash(ids: torch.Tensor, mask: torch.Tensor, before: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hash [B], count [B]) of the real tokens of ``ids`` [B, T] (``mask`` [B, T] bool, True = real)
    that follow ``before`` [B] real tokens in their rows: added (mod P) to the hash of those."""
    mask = mask.to(ids.device)
    index = before.to(ids.device)[:, None] + mask.long().cumsum(-1) - 1
    terms = (ids.long() % P + 1) * (index % (P - 1) + 1) % P
    return (terms * mask).sum(-1) % P, mask.sum(-1)


def _prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
    """The model class's own ``prepare_inputs_for_generation``, after which a cache that takes ids
    (``see_ids``) is handed the step's: ``input_ids`` is the whole sequence so far, of which the
    model is fed the last columns (a chunked prefill's chunk: only those), with the 2-D attention
    mask when ``generate`` kept one. The ids are compared with the cache's record at the first
    step of a call only (``is_first_iteration``; every step on a transformers without it)."""
    inputs = type(self).prepare_inputs_for_generation(self, input_ids, *args, **kwargs)
    cache = inputs.get("cache", inputs.get("past_key_values"))
    see_ids = getattr(cache, "see_ids", None)
    fed = inputs.get("input_ids")
    if see_ids is not None and fed is not None and input_ids is not None:
        mask = kwargs.get("attention_mask")
        mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        see_ids(input_ids, fed.shape[1], mask, check=kwargs.get("is_first_iteration", True) is not False)
    return inputs


def watch_ids(model) -> None:
    """Hand a cache that takes ids (``see_ids``) the ids of each ``model.generate`` step; a model
    whose ``prepare_inputs_for_generation`` is already replaced on the instance is left as it is."""
    if "prepare_inputs_for_generation" not in vars(model) and hasattr(model, "prepare_inputs_for_generation"):
        model.prepare_inputs_for_generation = types.MethodType(_prepare_inputs_for_generation, model)


def unwatch_ids(model) -> None:
    """Undo :func:`watch_ids`."""
    installed = vars(model).get("prepare_inputs_for_generation")
    if getattr(installed, "__func__", None) is _prepare_inputs_for_generation:
        del model.prepare_inputs_for_generation
