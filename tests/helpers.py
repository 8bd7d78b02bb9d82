"""Views of keepkv that only the tests need (not used by the library): the merges' pure forms and
the merge gates alone."""

import math

import torch

from keepkv.merging import MergedRows, convex_merge_rows, momentum_merge_rows, spread_values_rows, zip_merge_rows


# -- merges, applied -------------------------------------------------------------------------
def applied(rows: MergedRows, **tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Copies of ``tensors`` (name -> [B, H_kv, S(, D)]) with ``rows``' merged rows written, in order;
    slots that receive no merge are bit-identical to the input."""
    return tuple(rows.write_into(x.clone(), name) for name, x in tensors.items())


def zip_merge(keys, values, bias, log_scores, src, dst, merge, **options) -> tuple[torch.Tensor, ...]:
    """:func:`keepkv.merging.zip_merge_rows` applied: merged copies of keys, values [B, H_kv, S, D]
    and bias [B, H_kv, S]."""
    rows = zip_merge_rows(keys, values, bias, log_scores, src, dst, merge, **options)
    return applied(rows, keys=keys, values=values, bias=bias)


def convex_merge(keys, values, src, dst, merge, weights) -> tuple[torch.Tensor, ...]:
    """:func:`keepkv.merging.convex_merge_rows` applied: merged copies of keys, values."""
    return applied(convex_merge_rows(keys, values, src, dst, merge, weights), keys=keys, values=values)


def momentum_merge(keys, values, counts, src, dst, merge) -> tuple[torch.Tensor, ...]:
    """:func:`keepkv.merging.momentum_merge_rows` applied: merged copies of keys, values and counts."""
    rows = momentum_merge_rows(keys, values, counts, src, dst, merge)
    return applied(rows, keys=keys, values=values, count=counts)


def spread_values(values, src, merge, m, kept_next_idx) -> torch.Tensor:
    """:func:`keepkv.merging.spread_values_rows` applied: the merged values [B, H_kv, S, D]."""
    return applied(spread_values_rows(values, src, merge, m, kept_next_idx), values=values)[0]


def gate_merges(values, bias, log_scores, src, dst, merge, max_value_change=math.inf, max_share=1.0) -> torch.Tensor:
    """The merges of a plan that pass ZIP-merging's gates (``max_value_change`` ε, ``max_share`` δ):
    ``merge`` [B, H_kv, E] with every group that would move its target's value by more than ε
    relative, or bring it more than δ of the merged weight, dropped whole. The gates do not depend
    on the key rule: this is what :func:`keepkv.merging.zip_merge_rows` reports as merged."""
    keys = torch.zeros_like(values)  # the "mean" key rule: the keys do not enter the gates
    return zip_merge_rows(keys, values, bias, log_scores, src, dst, merge, key_rule="mean",
                          max_value_change=max_value_change, max_share=max_share).merge
