"""Merges that cannot corrupt an important entry: the value gate, the weight cap and protected
targets of ZIP-merging (zip_merge_rows' max_value_change and max_share, ZipMerge.protect)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import keepkv
from keepkv.merging import zip_merge_rows

from conftest import decode_loop, random_batch, tiny_model
from helpers import applied, gate_merges, zip_merge

SIZE, HEADS, DIM = 12, 2, 8


def random_plan(seed: int, evicted: int):
    """A layer [1, H, S, D] and a plan moving ``evicted`` slots into random kept ones."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, HEADS, SIZE, DIM, generator=g)
    values = torch.randn(1, HEADS, SIZE, DIM, generator=g) * torch.rand(1, HEADS, SIZE, 1, generator=g) * 3
    bias = torch.rand(1, HEADS, SIZE, generator=g).log1p()  # ln p, p in [1, 2)
    log_scores = torch.randn(1, HEADS, SIZE, generator=g) * 2
    order = torch.stack([torch.randperm(SIZE, generator=g) for _ in range(HEADS)])[None]
    src, kept = order[..., :evicted], order[..., evicted:]
    dst = kept.gather(-1, torch.randint(0, SIZE - evicted, (1, HEADS, evicted), generator=g))
    merge = torch.rand(1, HEADS, evicted, generator=g) < 0.8
    return keys, values, bias, log_scores, src, dst, merge


# A random plan (random_plan's seed and evicted count) and the gates' parameters.
PLANS_AND_GATES = dict(
    seed=st.integers(0, 10_000),
    evicted=st.integers(1, SIZE - 1),
    max_value_change=st.sampled_from([0.0, 0.05, 0.3, 1.0, math.inf]),
    max_share=st.sampled_from([0.0, 0.2, 0.5, 1.0]),
)


@settings(max_examples=60, deadline=None)
@given(**PLANS_AND_GATES)
def test_gate_bounds_what_every_target_takes(seed, evicted, max_value_change, max_share):
    keys, values, bias, log_scores, src, dst, merge = random_plan(seed, evicted)
    gated = gate_merges(values, bias, log_scores, src, dst, merge, max_value_change, max_share)
    assert not (gated & ~merge).any()  # the gate only removes merges
    _, merged_values, merged_bias = zip_merge(
        keys, values, bias, log_scores, src, dst, gated, key_rule="mean"
    )
    change = (merged_values - values).norm(dim=-1) / values.norm(dim=-1)
    assert (change <= max_value_change * (1 + 1e-5) + 1e-6).all(), change.max()
    # the incoming share of each target: 1 - w_t / Σ w, with w = p ŝ and Σ w read from the votes' logsumexp
    for head in range(HEADS):
        for target in dst[0, head][gated[0, head]].unique():
            into = gated[0, head] & (dst[0, head] == target)
            own = bias[0, head, target] + log_scores[0, head, target]
            incoming = (bias[0, head] + log_scores[0, head])[src[0, head][into]]
            share = 1 - torch.exp(own - torch.logsumexp(torch.cat([own[None], incoming]), 0))
            assert share <= max_share + 1e-5
    if math.isinf(max_value_change) and max_share == 1.0:
        assert torch.equal(gated, merge)  # no gate: every merge stays


@settings(max_examples=80, deadline=None)
@given(**PLANS_AND_GATES, key_rule=st.sampled_from(["projection", "mean", "paper"]))
def test_gated_merge_rows_equal_the_gate_then_the_merge(seed, evicted, max_value_change, max_share, key_rule):
    """zip_merge_rows with the gates (what KeepKV and ZipMerge run) writes bit for bit what the
    gated plan (gate_merges: the same gates under the "mean" key rule, with other keys) merged
    without them writes, and reports that plan as what merged, whatever the key rule; a dropped
    group's target keeps its own rows (its write is slot 0's own value)."""
    keys, values, bias, log_scores, src, dst, merge = random_plan(seed, evicted)
    query = torch.randn(1, HEADS, DIM, generator=torch.Generator().manual_seed(seed))
    options = dict(key_rule=key_rule, queries=query, scaling=DIM**-0.5)
    gated = gate_merges(values, bias, log_scores, src, dst, merge, max_value_change, max_share)
    rows = zip_merge_rows(keys, values, bias, log_scores, src, dst, merge, **options,
                          max_value_change=max_value_change, max_share=max_share)
    assert torch.equal(rows.merge, gated)
    expected = zip_merge(keys, values, bias, log_scores, src, dst, gated, **options)
    for got, want in zip(applied(rows, keys=keys, values=values, bias=bias), expected):
        assert torch.equal(got, want)


def test_gate_drops_a_group_whole():
    """One harmless and one harmful entry into the same target: neither merges."""
    values = torch.tensor([[[[1.0, 0.0], [1.0, 0.01], [-1.0, 0.0]]]])  # target, near copy, opposite
    bias = torch.zeros(1, 1, 3)
    scores = torch.zeros(1, 1, 3)
    src, dst = torch.tensor([[[1, 2]]]), torch.tensor([[[0, 0]]])
    merge = torch.ones(1, 1, 2, dtype=torch.bool)
    assert not gate_merges(values, bias, scores, src, dst, merge, max_value_change=0.1).any()
    only_copy = gate_merges(values, bias, scores, src[..., :1], dst[..., :1], merge[..., :1], max_value_change=0.1)
    assert only_copy.all()


@torch.no_grad()
def compressed_prefill(method, budget, ids, **params):
    """(full cache, compressed cache) after one prefill of ``ids`` on a tiny MHA model."""
    model = tiny_model("llama-mha")
    keepkv.enable(model)
    full = keepkv.CompressedCache(model.config, "full", 1.0)
    model(input_ids=ids, past_key_values=full)
    cache = keepkv.CompressedCache(model.config, method, budget, **params)
    model(input_ids=ids, past_key_values=cache)
    return full, cache


def at_positions(full_tensor, positions):
    """The full cache's [B, H, S(, D)] entries at the stored ``positions`` [B, H, K]."""
    index = positions.clamp_min(0)
    if full_tensor.dim() == 4:
        index = index[..., None].expand(-1, -1, -1, full_tensor.shape[-1])
    return full_tensor.gather(2, index)


@pytest.mark.parametrize("method", ["keepkv", "snapkv+merge=zip"])
def test_protected_targets_stay_bit_identical(method):
    """protect=1: every entry the selection kept by its score is exactly the token it was; with
    protect=0 the same compression merges into some of them (so the test can fail)."""
    ids, _ = random_batch(batch=1, length=80, pad=(0,), seed=5)
    window = 32  # SnapKV's: the last 32 prompt tokens are kept whatever their scores
    for protect, expect_exact in ((1.0, True), (0.0, False)):
        full, cache = compressed_prefill(method, 44, ids, threshold=-1.0, protect=protect)
        exact_everywhere = True
        for full_layer, layer in zip(full.layers, cache.layers):
            scored = (layer.positions >= 0) & (layer.positions < ids.shape[1] - window)
            assert scored.any()
            same_values = (layer.values == at_positions(full_layer.values, layer.positions)).all(-1)
            same_keys = (layer.keys == at_positions(full_layer.keys, layer.positions)).all(-1)
            exact = same_values & same_keys & (layer.bias == 0)
            exact_everywhere &= bool(exact[scored].all())
        assert exact_everywhere == expect_exact, protect


@pytest.mark.parametrize("epsilon", [0.05, 0.2])
def test_value_gate_bounds_each_kept_entry_after_prefill(epsilon):
    ids, _ = random_batch(batch=1, length=80, pad=(0,), seed=6)
    moved = []
    for gate in (epsilon, None):
        full, cache = compressed_prefill("keepkv", 40, ids, threshold=-1.0, max_value_change=gate)
        for full_layer, layer in zip(full.layers, cache.layers):
            live = layer.bias > float("-inf")
            original = at_positions(full_layer.values, layer.positions).float()
            change = (layer.values.float() - original).norm(dim=-1) / original.norm(dim=-1)
            if gate is not None:
                assert (change[live] <= epsilon * (1 + 1e-4)).all(), change[live].max()
            moved.append(float(change[live].max()))
    assert max(moved) > epsilon  # ungated, some value moves further: the gate did something


@torch.no_grad()
def test_gates_keep_exact_budgets_and_rows_that_fit():
    ids, mask = random_batch(batch=2, length=80, pad=(0, 50), seed=7)
    model = tiny_model("llama-gqa")
    keepkv.enable(model)
    params = dict(threshold=-1.0, protect=0.5, max_value_change=0.1, max_share=0.5)
    cache = keepkv.CompressedCache(model.config, "keepkv", 36, **params)
    full = keepkv.CompressedCache(model.config, "full", 1.0)
    model(input_ids=ids, attention_mask=mask, past_key_values=full)
    model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    for full_layer, layer in zip(full.layers, cache.layers):
        counts = layer.live_counts()
        assert (counts[0] == 36).all() and (counts[1] == 30).all()  # row 1 has 30 tokens: fits
        short = layer.bias[1] > float("-inf")
        assert (layer.bias[1][short] == 0).all()
        real = full_layer.bias[1] > float("-inf")
        assert torch.equal(layer.values[1][short].view(2, -1, layer.values.shape[-1]),
                           full_layer.values[1][real].view(2, -1, layer.values.shape[-1]))


@pytest.mark.parametrize(
    "params", [{"protect": 1.5}, {"protect": "top"}, {"max_value_change": -0.1}, {"max_share": 2.0},
               {"max_value_change": True}]
)
def test_bad_gate_parameters_raise_one_line(params):
    with pytest.raises(ValueError, match=next(iter(params))):
        keepkv.get_method("keepkv", **params)


def _top_kept_by_sort(kept, priority, share):
    """[B, H_kv, S] the first ceil(share · n) of a stable descending sort of the n kept entries the
    selection scored (protected ones, priority +inf, not counted): what ``protect`` keeps from merges."""
    scored = kept & torch.isfinite(priority)
    order = priority.masked_fill(~scored, float("-inf")).argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1]).expand_as(order))
    return scored & (rank < (scored.sum(-1, keepdim=True) * share).ceil())


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), size=st.integers(1, 40), share=st.floats(0.0, 1.0),
       levels=st.sampled_from([3, 1000]))
def test_open_to_merges_is_the_kept_outside_the_stable_sorts_top_share(seed, size, share, levels):
    """ZIP's merge candidates (``protect``): the kept entries less the first ceil(share·n) of a stable
    descending sort of the n scored ones; ties (few levels, ±0.0) in slot order, +inf kept open."""
    from keepkv.methods.keepkv import open_to_merges

    generator = torch.Generator().manual_seed(seed)
    priority = torch.randint(-levels, levels, (2, 3, size), generator=generator).float() / 7
    priority = torch.where(torch.rand(2, 3, size, generator=generator) < 0.1, -0.0, priority)
    priority = priority.masked_fill(torch.rand(2, 3, size, generator=generator) < 0.1, float("inf"))
    kept = torch.rand(2, 3, size, generator=generator) < 0.7
    assert torch.equal(open_to_merges(kept, priority, share), kept & ~_top_kept_by_sort(kept, priority, share))


@pytest.mark.parametrize("method", ["keepkv", "snapkv+merge=zip"])
def test_protect_window_keeps_every_kept_entry_outside_the_merge_slots_exact(method):
    """protect_window=True: the selection's window (and sinks) take no merges either, so only the
    lowest-ranked 1 - protect of the scored kept entries change; without it the window takes some
    (so the test can fail)."""
    ids, _ = random_batch(batch=1, length=80, pad=(0,), seed=5)
    window = 32
    for protect_window in (True, False):
        full, cache = compressed_prefill(method, 44, ids, threshold=-1.0, protect=0.5, protect_window=protect_window)
        window_exact, changed = True, 0
        for full_layer, layer in zip(full.layers, cache.layers):
            same = ((layer.values == at_positions(full_layer.values, layer.positions)).all(-1)
                    & (layer.keys == at_positions(full_layer.keys, layer.positions)).all(-1) & (layer.bias == 0))
            in_window = layer.positions >= ids.shape[1] - window
            window_exact &= bool(same[in_window].all())
            scored = (layer.positions >= 0) & ~in_window
            changed += int((~same & scored).sum())
            # at most the lowest-ranked half of the scored kept entries took merges
            assert (~same & scored).sum(-1).le(scored.sum(-1) - (scored.sum(-1) * 0.5).ceil()).all()
        assert window_exact == protect_window
        assert changed > 0  # the merge slots took merges


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), evicted=st.integers(1, SIZE - 1))
def test_key_value_similarity_picks_the_target_alike_in_key_and_value(seed, evicted):
    """similarity="key_value": each evicted entry's target is the candidate of the largest mean of
    key and value cosine, and the similarity it reports is that mean."""
    from types import SimpleNamespace

    from keepkv.methods.keepkv import ZipMerge

    keys, values, _, _, src, _, _ = random_plan(seed, evicted)
    candidates = torch.ones(1, HEADS, SIZE, dtype=torch.bool).scatter(-1, src, False)
    layer = SimpleNamespace(keys=keys, values=values)
    plan = SimpleNamespace(evict_idx=src, candidate_idx=lambda: None)
    dst, similarity = ZipMerge(similarity="key_value").nearest(layer, plan, candidates)
    unit = lambda x: torch.nn.functional.normalize(x, dim=-1)  # noqa: E731
    mean_cos = (unit(keys) @ unit(keys).transpose(-1, -2) + unit(values) @ unit(values).transpose(-1, -2)) / 2
    mean_cos = mean_cos.gather(2, src[..., None].expand(-1, -1, -1, SIZE)).masked_fill(~candidates[:, :, None], -2)
    best, _ = mean_cos.max(-1)
    torch.testing.assert_close(similarity, best, atol=1e-5, rtol=0)
    torch.testing.assert_close(mean_cos.gather(-1, dst[..., None])[..., 0], best, atol=1e-5, rtol=0)


def test_key_value_similarity_merges_fewer_than_key_alone():
    """At the same T, a target must be alike in value too: fewer entries take merges than by key
    alone on the same prefill."""
    ids, _ = random_batch(batch=1, length=80, pad=(0,), seed=8)
    merged = {}
    for similarity in ("key_value", "key"):
        _, cache = compressed_prefill("keepkv", 40, ids, threshold=0.3, protect=0.0, max_value_change=None,
                                      similarity=similarity)
        merged[similarity] = sum(int((layer.bias > 0).sum()) for layer in cache.layers)
    assert merged["key"] > merged["key_value"] > 0


def test_min_mass_merges_only_entries_worth_their_mass():
    """min_mass=1: no evicted entry carries all of its row's mass, so nothing merges (every kept
    entry keeps one vote) where min_mass=0 merges some."""
    ids, _ = random_batch(batch=1, length=80, pad=(0,), seed=9)
    votes = {}
    for min_mass in (1.0, 1e-6, 0.0):
        _, cache = compressed_prefill("keepkv", 40, ids, threshold=-1.0, protect=0.0, max_value_change=None,
                                      min_mass=min_mass)
        votes[min_mass] = sum(int((layer.bias > 0).sum()) for layer in cache.layers)
    assert votes[1.0] == 0 and votes[0.0] > 0
    assert 0 < votes[1e-6] <= votes[0.0]


@pytest.mark.parametrize("params", [{"similarity": "value"}, {"similarity": 3}, {"min_mass": 1.5}, {"min_mass": -0.1},
                                    {"min_mass": "x"}, {"protect_window": "yes"}])
def test_bad_candidate_parameters_raise_one_line(params):
    with pytest.raises(ValueError, match=next(iter(params))):
        keepkv.get_method("keepkv", **params)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), spec=st.sampled_from([
    "keepkv", "keepkv+interval=4", "keepkv+selection=ema+min_mass=0+threshold=-1.0",
    "keepkv+min_mass=0.001+threshold=0.0+protect=0", "keepkv+selection=snapkv+threshold=-1.0+max_value_change=None",
]), budget=st.sampled_from([1, 9, 0.3, 1.0]), arch=st.sampled_from(["llama-mha", "llama-gqa"]))
def test_a_decoding_merge_of_only_the_entries_that_merge_equals_the_merge_of_all(seed, spec, budget, arch):
    """On CPU a decoding ZIP merge compares and merges only the evicted entries that pass the mass
    and similarity gates (one host read, free there); the cache is the same, bit for bit, as the
    static path's (``static_shapes=True``: what an accelerator and compile run), which runs every
    evicted entry through the merge."""
    from unittest import mock

    import keepkv.methods.keepkv as keepkv_methods

    model = tiny_model(arch, layers=2)
    ids, mask = random_batch(batch=3, length=24, pad=(0, 5, 13), seed=seed)
    caches, counted = {}, []
    for static in (True, False):
        with mock.patch.object(keepkv_methods, "_counted", wraps=keepkv_methods._counted) as spy:
            cache = keepkv.CompressedCache(model.config, spec, budget, static_shapes=static)
            for cache in decode_loop(model, ids, mask, cache, steps=10):
                pass
        caches[static], _ = cache, counted.append(spy.call_count)
    assert counted[0] <= counted[1]  # the compact path counts at every compression, the static one at a prompt's end
    if budget == 9 and spec.startswith("keepkv+selection"):  # 9 entries, every evicted one may merge
        assert counted[0] < counted[1]
    for static, compact in zip(caches[True].layers, caches[False].layers):
        for name in ("keys", "values", "bias", "positions"):
            assert torch.equal(getattr(static, name), getattr(compact, name)), name
