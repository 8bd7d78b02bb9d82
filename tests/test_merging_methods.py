"""The merging baselines D2O, ZeroMerge, CaM and KVMerger (the properties every method shares are
in test_all_methods.py)."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import keepkv
from keepkv.attention import Needs, StepStats, attend
from keepkv.budgets import budget_floor, row_budgets
from helpers import applied, momentum_merge
from reference import attention_mass
from keepkv.methods.d2o import d2o_merge_rows
from keepkv.methods.kvmerger import KVMerger, kvmerger_merge_rows
from keepkv.methods.zeromerge import ZeroMerge, slot_bias

from conftest import VOCAB, decode_loop, random_batch, run_generate, tiny_model


@torch.no_grad()
def prefill(model, input_ids, attention_mask, method, budget, **params):
    """Run the prompt through a fresh CompressedCache and return the cache (compressed)."""
    keepkv.enable(model)
    cache = keepkv.CompressedCache(model.config, method, budget, **params)
    model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache)
    return cache


# -- D2O ---------------------------------------------------------------------------------------
def test_d2o_threshold_is_reset_between_sequences():
    model = tiny_model("llama-gqa")
    first, first_mask = random_batch(batch=1, length=30, pad=(0,), seed=3)
    second, second_mask = random_batch(batch=1, length=26, pad=(0,), seed=4)
    method = keepkv.get_method("d2o")  # one instance serves both sequences, as in a benchmark loop
    _, cache_first = run_generate(model, first, first_mask, method, budget=10, new_tokens=8)
    _, cache_second = run_generate(model, second, second_mask, method, budget=10, new_tokens=8)
    _, alone = run_generate(model, second, second_mask, "d2o", budget=10, new_tokens=8)
    for layer_first, layer_second, layer_alone in zip(cache_first.layers, cache_second.layers, alone.layers):
        assert not layer_second.state["tau"].isnan().any()
        assert torch.equal(layer_second.state["tau"], layer_alone.state["tau"])
    assert any(not torch.equal(a.state["tau"], b.state["tau"]) for a, b in zip(cache_first.layers, cache_second.layers))

    # A prefill on a store that holds a threshold (a reused cache) starts it over.
    layer = cache_second.layers[0]
    batch, kv_heads, size = layer.bias.shape
    stats = StepStats(query=torch.zeros(batch, kv_heads, 2, size, 16), scaling=0.25, is_prefill=True)
    stats.colsum = torch.rand(batch, kv_heads, 2, size)
    method.observe(layer, stats)
    assert layer.state["tau"] is None


def test_d2o_threshold_moves_during_decoding():
    model = tiny_model("llama-gqa")
    input_ids, attention_mask = random_batch(batch=1, length=30, pad=(0,))
    cache = keepkv.CompressedCache(model.config, "d2o", 10)
    steps = decode_loop(model, input_ids, attention_mask, cache, 6)
    history = [[layer.state["tau"].clone() for layer in c.layers] for c in steps]
    assert not torch.equal(history[0][1], history[-1][1])


def test_d2o_layer_budgets_sum_to_total():
    model = tiny_model("llama-gqa", layers=4)
    # 100 and 92 tokens: half of either is above the budget floor, and within the prompt in every layer
    input_ids, attention_mask = random_batch(length=100, pad=(0, 8))
    probe = prefill(model, input_ids, attention_mask, "d2o", 0.5, gate=math.inf)
    variance = torch.stack([layer.state["variance_paper"] for layer in probe.layers])  # [L, B]
    gate = float(variance[:, 0].median())  # two layers of row 0 above the gate, two below

    cache = prefill(model, input_ids, attention_mask, "d2o", 0.5, gate=gate, alpha=3.0)
    total = 4 * row_budgets(0.5, cache.prompt_lengths, budget_floor(cache.method))
    budgets = torch.stack([layer.budget for layer in cache.layers])  # [L, B, H_kv]
    assert (budgets == budgets[..., :1]).all()  # one budget per layer and row
    assert torch.equal(budgets[..., 0].sum(0), total)
    high = variance[:, 0] > gate
    assert budgets[high, 0, 0].max() < budgets[~high, 0, 0].min()
    for layer in cache.layers:
        assert (layer.live_counts() <= layer.budget).all()

    code = prefill(model, input_ids, attention_mask, "d2o", 0.5, allocation="code")
    code_budgets = torch.stack([layer.budget[:, 0] for layer in code.layers])
    assert ((code_budgets.sum(0) - total).abs() <= 4).all()  # floor of each of the 4 layers


# -- ZeroMerge --------------------------------------------------------------------------------
@pytest.mark.parametrize("slots", [1, 0])
def test_zeromerge_fusion_counts_account_for_every_token(slots):
    model = tiny_model("llama-gqa")
    input_ids, attention_mask = random_batch(length=30, pad=(0, 6))
    cache = keepkv.CompressedCache(model.config, "zeromerge", 10, merge_slots=slots)
    for cache in decode_loop(model, input_ids, attention_mask, cache, 25):
        for layer in cache.layers:
            counted = (layer.extras["count"] * layer.live()).sum(-1).round().long() + layer.state["dropped"]
            assert torch.equal(counted, layer.real_seen[:, None].expand_as(counted))
    layer = cache.layers[-1]
    if slots:
        assert (layer.extras["count"][layer.live()] > 1).any() and (layer.state["dropped"] == 0).all()
    else:
        assert (layer.state["dropped"] > 0).all() and (layer.bias[layer.live()] == 0).all()


def test_zeromerge_slot_weight_shows_in_attention():
    model = tiny_model("llama-gqa")
    input_ids, attention_mask = random_batch(batch=1, length=19, pad=(0,))
    # Budget 16 = 13 context + 1 slot + 2 recent: 4 of the 19 prompt tokens fuse into the slot.
    cache = prefill(model, input_ids, attention_mask, "zeromerge", 16, alpha=1.0)
    layer = cache.layers[0]
    slot = layer.extras["slot"] & layer.live()
    assert slot.sum(-1).eq(1).all()
    assert (layer.extras["count"][slot] == 4).all()
    assert torch.allclose(layer.bias[slot], torch.tensor(math.log(4.0)))

    # Attend over the store plus a plain copy (bias 0) of each head's slot entry.
    batch, kv_heads, size, head_dim = layer.keys.shape
    where = slot.float().argmax(-1)  # [B, H_kv]
    pick = where[..., None, None].expand(batch, kv_heads, 1, head_dim)
    keys = torch.cat([layer.keys, layer.keys.gather(2, pick)], dim=2)
    values = torch.cat([layer.values, layer.values.gather(2, pick)], dim=2)
    bias = torch.cat([layer.bias, torch.zeros(batch, kv_heads, 1)], dim=-1)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(batch, model.config.num_attention_heads, 1, head_dim, generator=generator)
    block_mask = torch.ones(batch, 1, 1, 1, dtype=torch.bool)
    _, stats = attend(query, keys, values, bias, block_mask, head_dim**-0.5, Needs(probs=True))
    probs = stats.probs[:, :, :, 0]  # [B, H_kv, g, S + 1]
    slot_probs = probs.gather(-1, where[:, :, None, None].expand(*probs.shape[:3], 1))[..., 0]
    torch.testing.assert_close(slot_probs / probs[..., -1], torch.full_like(slot_probs, 4.0), rtol=1e-5, atol=0)


# -- CaM --------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefill_merge", [False, True])
def test_cam_never_modifies_keys(prefill_merge):
    model = tiny_model("llama-gqa")
    keepkv.enable(model)
    input_ids, attention_mask = random_batch(batch=1, length=40, pad=(0,))
    forced = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    full = keepkv.CompressedCache(model.config, "full")
    cam = keepkv.CompressedCache(model.config, "cam", 12, prefill_merge=prefill_merge)

    def gather_full(layer_full, layer_cam, name):
        index = layer_cam.positions.clamp_min(0)[..., None].expand_as(layer_cam.keys)
        return getattr(layer_full, name).gather(2, index)

    def keys_match(layer_pairs):
        for layer_full, layer_cam in layer_pairs:
            live = layer_cam.live()
            assert torch.equal(layer_cam.keys[live], gather_full(layer_full, layer_cam, "keys")[live])

    with torch.no_grad():
        for cache in (full, cam):
            model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache)
        keys_match(zip(full.layers, cam.layers))  # every layer: the prompt's keys existed before compression
        merged = [not torch.equal(c.values, gather_full(f, c, "values")) for f, c in zip(full.layers, cam.layers)]
        assert any(merged) == prefill_merge

        mask = attention_mask
        for step in range(forced.shape[1]):
            mask = torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype)], dim=-1)
            for cache in (full, cam):
                model(input_ids=forced[:, step : step + 1], attention_mask=mask, past_key_values=cache)
            keys_match([(full.layers[0], cam.layers[0])])  # layer 0's keys and values depend on the token only
        # Decode-time merges: layer 0's values differ from the full cache's only by merging.
        assert not torch.equal(cam.layers[0].values, gather_full(full.layers[0], cam.layers[0], "values"))


def test_cam_seed_makes_draws_reproducible():
    model = tiny_model("llama-gqa")
    input_ids, attention_mask = random_batch(length=40, pad=(0, 5))
    runs = [prefill(model, input_ids, attention_mask, "cam", 12, seed=seed, prefill_merge=True) for seed in (7, 7, 8)]
    same = all(torch.equal(a.values, b.values) for a, b in zip(runs[0].layers, runs[1].layers))
    other = all(torch.equal(a.values, b.values) for a, b in zip(runs[0].layers, runs[2].layers))
    assert same and not other


# -- KVMerger ---------------------------------------------------------------------------------
def test_kvmerger_pivots_are_kept_members_of_adjacent_similar_runs():
    basis = torch.eye(4)
    # Slots 0-2 share a direction, 3 is alone, 4-5 share another; slot 6 is empty.
    keys = torch.stack([basis[0], 2 * basis[0], basis[0], basis[1], basis[2], basis[2], basis[3]])[None, None]
    bias = torch.zeros(1, 1, 7)
    bias[..., 6] = -math.inf
    layer = SimpleNamespace(keys=keys, bias=bias, extras={"score": torch.tensor([[[5.0, 1, 3, 9, 2, 0, 0]]])})
    layer.live = lambda: layer.bias > -math.inf
    kept = torch.tensor([[[False, True, True, False, True, False, False]]])
    pivot, has_pivot = keepkv.get_method("kvmerger", threshold=0.9).merging.pivots(layer, kept)
    assert has_pivot[0, 0].tolist() == [True, True, True, False, True, True, False]
    assert pivot[0, 0, [0, 1, 2, 4, 5]].tolist() == [2, 2, 2, 4, 4]  # highest-scoring kept member


def test_kvmerger_merges_without_votes():
    model = tiny_model("llama-gqa")
    input_ids, attention_mask = random_batch(length=30, pad=(0, 4))
    plain = prefill(model, input_ids, attention_mask, "h2o", 10)
    merged = prefill(model, input_ids, attention_mask, "kvmerger", 10, threshold=-1.0)
    for layer_plain, layer_merged in zip(plain.layers, merged.layers):
        assert torch.equal(layer_plain.positions, layer_merged.positions)  # same eviction as H2O
        assert (layer_merged.bias[layer_merged.live()] == 0).all()
    assert any(not torch.equal(a.keys, b.keys) for a, b in zip(plain.layers, merged.layers))
    assert any(not torch.equal(a.values, b.values) for a, b in zip(plain.layers, merged.layers))


# -- Theorem 2 (KeepKV): every convex merge loses attention mass -------------------------------
def test_convex_merges_sag_attention():
    generator = torch.Generator().manual_seed(0)
    batch, kv_heads, size, head_dim, group = 2, 3, 6, 8, 4
    keys = torch.randn(batch, kv_heads, size, head_dim, generator=generator)
    values = torch.randn(batch, kv_heads, size, head_dim, generator=generator)
    queries = torch.randn(batch, kv_heads, group, head_dim, generator=generator)
    scaling = head_dim**-0.5
    src = torch.tensor([1, 2, 3]).expand(batch, kv_heads, 3)  # entries 1-3 merge into entry 0
    dst = torch.zeros_like(src)
    merge = torch.ones_like(src, dtype=torch.bool)
    bias = torch.zeros(batch, kv_heads, size)
    _, before = attention_mass(queries, keys, values, bias, scaling)  # [B, H_kv, g, S]
    parts = before[..., :4].sum(-1)

    similarity = (F.normalize(keys[..., 1:4, :], dim=-1) * F.normalize(keys[..., :1, :], dim=-1)).sum(-1)
    merges = {
        "d2o": (*applied(d2o_merge_rows(keys, values, src, dst, merge, similarity, "paper"), keys=keys, values=values), bias),
        "kvmerger": (
            *applied(kvmerger_merge_rows(keys, values, src, dst, merge, keys.norm(dim=-1).mean(-1)), keys=keys, values=values),
            bias,
        ),
    }
    counts = torch.ones(batch, kv_heads, size)
    zm_keys, zm_values, zm_counts = momentum_merge(keys, values, counts, src, dst, merge)
    merges["zeromerge (alpha=0.6)"] = (zm_keys, zm_values, slot_bias(zm_counts, 0.6))
    for name, (merged_keys, merged_values, merged_bias) in merges.items():
        _, after = attention_mass(queries, merged_keys, merged_values, merged_bias, scaling)
        assert (after[..., 0] < parts).all(), name
        assert torch.equal(after[..., 4:], before[..., 4:]), name  # untouched entries keep their weight


# -- parameters ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, params",
    [
        ("d2o", {"beta": 1.5}),
        ("d2o", {"allocation": "uniform"}),
        ("d2o", {"merge_rule": "mean"}),
        ("d2o", {"alpha": 0.0}),
        ("zeromerge", {"alpha": 2.0}),
        ("zeromerge", {"decay": 0.0}),
        ("zeromerge", {"merge_slots": -1}),
        ("cam", {"start_ratio": 1.5}),
        ("cam", {"merge_count": 0}),
        ("cam", {"prefill_merge": 1}),
        ("kvmerger", {"threshold": 2.0}),
        ("kvmerger", {"sigma": 0.0}),
    ],
)
def test_bad_parameters_name_the_valid_range(name, params):
    with pytest.raises(ValueError, match="must be"):
        keepkv.get_method(name, **params)


@torch.no_grad()
def test_zeromerge_prefill_scores_are_the_decayed_sum_of_the_recorded_pass():
    """Σ_i λ^(T-1-i) a_i comes from the prefill's own attention pass (``Needs.decays``): by hand
    from the recorded probabilities, the same in every fork, equal to ZeroMerge run alone, and a
    fork from a record without that λ is refused."""
    model = tiny_model("llama-gqa", layers=3)
    input_ids, attention_mask = random_batch(batch=2, length=30, pad=(0, 6))
    keepkv.enable(model)
    record = keepkv.CompressedCache(model.config, "full", record=Needs(probs=True, decays=(0.98,)))
    model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=record)
    for layer in record.layers:
        probs = layer.prefill_stats.probs  # [B, H_kv, g, T, S]
        rows = probs.shape[3]
        weights = 0.98 ** torch.arange(rows - 1, -1, -1, dtype=torch.float32)
        by_hand = (probs * weights[:, None]).sum(3)
        torch.testing.assert_close(layer.prefill_stats.decayed[0.98], by_hand)
    forks = [record.fork("zeromerge", budget) for budget in (8, 16, 0.5)]
    alone = keepkv.CompressedCache(model.config, "zeromerge", 16)
    model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=alone)
    for forked, direct in zip(forks[1].layers, alone.layers):
        torch.testing.assert_close(forked.extras["score"], direct.extras["score"])
    with pytest.raises(ValueError, match="lacks decay 0.9"):
        record.fork("zeromerge", 16, decay=0.9)
