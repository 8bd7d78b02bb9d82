"""plan_eviction (keepkv.methods.base): which entries leave, per row and head.

Its top-k is bounded by the tokens appended since the last compression where the layer's own
budgets apply, so a ragged batch (rows of unequal budgets) plans one entry per decode step, not
S - min(budget). The plan must not depend on that bound, on ties, or on the other rows.
"""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from keepkv.methods.base import plan_eviction, protected
from keepkv.store import LayerStore


def ragged_layer(seed: int, batch: int, kv_heads: int, size: int, pending: int) -> LayerStore:
    """A layer whose rows hold 1..size live entries between empty slots, each row at most
    ``pending`` over its budget [B, H_kv] (as after a compression followed by ``pending`` appends)."""
    gen = torch.Generator().manual_seed(seed)
    is_real = torch.rand(batch, size, generator=gen) < torch.rand(batch, 1, generator=gen)  # [B, S]
    is_real[:, 0] = True
    lengths = is_real.sum(-1)
    keys = torch.randn(batch, kv_heads, size, 2, generator=gen)
    layer = LayerStore(0)
    layer.lazy_initialization(keys, keys)
    layer.append(keys, keys, is_real)
    over = torch.randint(0, pending + 1, (batch, kv_heads), generator=gen)
    layer.set_budget((lengths[:, None] - over).clamp(min=1), lengths.float())
    layer.pending = pending
    return layer


@settings(max_examples=400)  # no model: 400 plans take ~2 s
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 4),
    kv_heads=st.integers(1, 3),
    size=st.integers(1, 40),
    pending=st.integers(1, 8),
    levels=st.integers(1, 4),
)
def test_the_bounded_plan_is_the_full_plan(seed, batch, kv_heads, size, pending, levels):
    """Priorities of few levels (many ties, some +inf as protected entries): the plan bounded by
    ``pending`` equals the plan over S - min(budget), and keeps the budget's highest-ranked
    entries, equal priorities kept in slot order."""
    layer = ragged_layer(seed, batch, kv_heads, size, pending)
    gen = torch.Generator().manual_seed(seed + 1)
    priority = torch.randint(0, levels + 1, (batch, kv_heads, size), generator=gen).float()
    priority = priority.masked_fill(priority == levels, float("inf"))
    bounded = plan_eviction(layer, priority)
    unbounded = plan_eviction(layer, priority, (layer.budget, layer.capacity, layer.min_budget))
    assert torch.equal(bounded.kept, unbounded.kept)
    evicted = [set(i[v].tolist()) for i, v in zip(bounded.evict_idx.flatten(0, 1), bounded.evict_valid.flatten(0, 1))]
    assert evicted == [set(i[v].tolist()) for i, v in zip(unbounded.evict_idx.flatten(0, 1), unbounded.evict_valid.flatten(0, 1))]

    live = layer.live()
    assert torch.equal(bounded.kept.sum(-1), torch.minimum(live.sum(-1), layer.budget))
    assert not (bounded.kept & ~live).any()
    # A stable descending sort by priority over the live slots keeps its first `budget`.
    for b in range(batch):
        for h in range(kv_heads):
            slots = live[b, h].nonzero().flatten().tolist()
            ranked = sorted(slots, key=lambda s: -priority[b, h, s].item())  # stable: slot order in ties
            expected = set(ranked[: int(layer.budget[b, h])])
            assert set(bounded.kept[b, h].nonzero().flatten().tolist()) == expected
            assert evicted[b * kv_heads + h] == set(slots) - expected


@settings(max_examples=200)
@given(
    seed=st.integers(0, 2**31 - 1),
    size=st.integers(1, 30),
    sinks=st.integers(0, 6),
    recent=st.integers(0, 10),
)
def test_protected_entries_are_the_first_sinks_and_the_newest_recent(seed, size, sinks, recent):
    """protected(): per row and head, the live entries among the first min(sinks, budget) tokens
    and the newest min(recent, budget - those) ones; empty slots (padding) never."""
    layer = ragged_layer(seed, 3, 2, size, 2)
    got = protected(layer, sinks, torch.full_like(layer.budget, recent))
    live = layer.live()
    for b in range(3):
        for h in range(2):
            budget = int(layer.budget[b, h])
            first, newest = min(sinks, budget), min(recent, budget - min(sinks, budget))
            seen = int(layer.real_seen[b])
            positions = layer.positions[b, h].tolist()
            want = [bool(live[b, h, s]) and (0 <= p < first or p >= seen - newest) for s, p in enumerate(positions)]
            assert got[b, h].tolist() == want
