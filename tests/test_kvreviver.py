"""KVReviver (method ``kvreviver``): reversibility, exactness, swap-back, memory, batching.

The sketch's own statistics (unbiased values, median variance, delete-after-query) are in
test_sketch.py; every-method properties in test_all_methods.py.
"""

import warnings

import pytest
import torch

import keepkv
from keepkv.attention import Needs
from keepkv.methods.kvreviver import fisher_scores, swap_counts
from keepkv.sketch import proportional_budgets

from conftest import decode_loop, random_batch, run_generate, tiny_model
from helpers import buckets_of, memory_report

# The tests below were written for the paper's estimator; "mean" (the default) has its own cases.
UNIFORM = dict(allocation="uniform", estimate="sum")


@pytest.fixture(autouse=True)
def _quiet_single_thread():
    """Tiny models gain nothing from threads, and on a busy machine torch's thread pool
    stalls small ops (index_add_) for tens of milliseconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="kvreviver: no Fisher")
        yield
    torch.set_num_threads(threads)


def vague_count(layer) -> torch.Tensor:
    return (layer.state["vague_pos"] >= 0).sum(-1)


def token_sets(layer, row, head):
    stored = layer.positions[row, head][layer.live()[row, head]].tolist()
    vague = layer.state["vague_pos"][row, head]
    return sorted(stored), sorted(vague[vague >= 0].tolist())


def prefill(model, input_ids, attention_mask, method, budget, **params):
    keepkv.enable(model)
    cache = keepkv.CompressedCache(model.config, method, budget, **params)
    with torch.no_grad():
        model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache)
    return cache


# ------------------------------------------------------------------------ vague part off


def test_vague_share_zero_equals_h2o_eviction():
    """No sketch: KVReviver's Recent/Candidate selection is H2O's with the same split."""
    model = tiny_model("llama-gqa")
    input_ids, attention_mask = random_batch(length=30, pad=(0, 6))
    params = dict(vague_share=0.0, recent_share=0.5, candidate_share=0.5, **UNIFORM)
    ours, cache = run_generate(model, input_ids, attention_mask, "kvreviver", 10, new_tokens=24, **params)
    theirs, reference = run_generate(model, input_ids, attention_mask, "h2o", 10, new_tokens=24, recent_ratio=0.5)
    assert torch.equal(ours, theirs)
    for mine, other in zip(cache.layers, reference.layers):
        assert mine.state["sketch"] is None
        assert torch.equal(mine.positions, other.positions)


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("estimate", ["sum", "mean"])
def test_collision_free_sketch_is_exact_and_equals_full(estimate):
    """With b far above the number of vague tokens the rebuild is bit-exact, so the
    output equals the full cache's."""
    model = tiny_model("llama-gqa")
    input_ids, attention_mask = random_batch(length=24, pad=(0, 4))
    params = dict(buckets=4096, vague_share=0.0, recent_share=0.5, candidate_share=0.5, **{**UNIFORM, "estimate": estimate})
    # The reference prefill asks for column sums too, so its attention output comes from the same
    # explicit pass as KVReviver's (SDPA's differs in the last bits from the second layer on).
    keepkv.enable(model)
    full = keepkv.CompressedCache(model.config, "full", record=Needs(colsum=True))
    with torch.no_grad():
        model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=full)
    cache = prefill(model, input_ids, attention_mask, "kvreviver", 6, **params)
    for layer, reference in zip(cache.layers, full.layers):
        assert int(vague_count(layer).min()) > 0
        keys, values, bias = cache.method.attention_entries(layer)
        live = bias > float("-inf")
        positions = torch.cat([layer.state["vague_pos"].long(), layer.positions], dim=-1)
        for row in range(2):
            pad = int((attention_mask[row] == 0).sum())
            for head in range(keys.shape[1]):
                order = positions[row, head][live[row, head]].argsort()
                got_k = keys[row, head][live[row, head]][order]
                got_v = values[row, head][live[row, head]][order]
                assert torch.equal(got_k, reference.keys[row, head, pad:])
                assert torch.equal(got_v, reference.values[row, head, pad:])
    tokens, _ = run_generate(model, input_ids, attention_mask, "kvreviver", 6, new_tokens=16, **params)
    expected, _ = run_generate(model, input_ids, attention_mask, "full", new_tokens=16)
    assert torch.equal(tokens, expected)


def test_rebuild_matches_sketch_query_with_collisions():
    model = tiny_model("llama-gqa")
    input_ids, attention_mask = random_batch(length=40, pad=(0, 5))
    cache = prefill(model, input_ids, attention_mask, "kvreviver", 16, **UNIFORM)
    layer = cache.layers[1]
    state = layer.state
    assert int(state["buckets"].max()) == 1  # 30+ tokens in one bucket per row: all collide
    keys, values, bias = cache.method.attention_entries(layer)
    expected_k, expected_v = state["sketch"].query(state["vague_pos"])
    count = state["vague_pos"].shape[-1]
    filled = state["vague_pos"] >= 0  # empty slots (the padded row's) are masked, their content unused
    assert not filled.all() and bool((bias[:, :, :count][~filled] == float("-inf")).all())
    assert torch.equal(keys[:, :, :count][filled], expected_k[filled])
    assert torch.equal(values[:, :, :count][filled], expected_v[filled])
    assert torch.equal(keys[:, :, count:], layer.keys)


# ------------------------------------------------------------------------------ swap-back


def test_swap_counts_match_sequential_algorithm_3():
    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        n_c, n_v = torch.randint(1, 8, (2,), generator=generator).tolist()
        cand = torch.rand(n_c, generator=generator) * 2
        vague = torch.rand(n_v, generator=generator) * 3
        if trial % 3 == 0:
            vague[0] = cand.min()  # ties and exact multiples
        # The paper's loop, one swap at a time.
        c, v, swaps = cand.tolist(), vague.tolist(), 0
        while c and v and min(c) * 1.1 < max(v):
            low, high = c.index(min(c)), v.index(max(v))
            c[low], v[high] = v[high], c[low]
            swaps += 1
        width = max(n_c, n_v)
        c_sorted = torch.full((width,), float("inf"))
        v_sorted = torch.full((width,), float("-inf"))
        c_sorted[:n_c] = cand.sort().values
        v_sorted[:n_v] = vague.sort(descending=True).values
        assert int(swap_counts(c_sorted, v_sorted, 1.1).sum()) == swaps


def test_swap_back_moves_a_token_that_rises_above_replace_rate():
    model = tiny_model("llama-gqa")
    input_ids, attention_mask = random_batch(length=24, pad=(0, 4))
    params = dict(buckets=4096, replace_rate=1.1, **UNIFORM)
    full = prefill(model, input_ids, attention_mask, "full", 1.0)
    cache = prefill(model, input_ids, attention_mask, "kvreviver", 10, **params)
    method, layer = cache.method, cache.layers[0]
    row, head = 0, 1
    candidates = layer.live() & ~method.protected(layer)
    scores = layer.extras["score"].masked_fill(~candidates, float("inf"))
    lowest, slot = scores[row, head].min(0)
    leaving = int(layer.positions[row, head, slot])
    state = layer.state

    # 1.05 x the candidate minimum: below ReplaceRate, nothing moves.
    state["vague_score"][row, head, 0] = 1.05 * lowest
    before = token_sets(layer, row, head)
    method.compress(layer, None)
    assert token_sets(layer, row, head) == before

    # 1.2 x: the token comes back, the lowest candidate goes to the sketch in its place.
    rising = int(state["vague_pos"][row, head, 0])
    state["vague_score"][row, head, 0] = 1.2 * lowest
    method.compress(layer, None)
    stored, vague = token_sets(layer, row, head)
    assert rising in stored and rising not in vague
    assert leaving in vague and leaving not in stored
    assert layer.state["swaps"].tolist() == [int(b == row) for b in range(layer.state["swaps"].shape[0])]
    # The revived token's vectors are the (collision-free, hence exact) sketch estimates,
    # its score followed it; the evicted one is recoverable from the sketch.
    where = (layer.positions[row, head] == rising).nonzero().item()
    assert torch.equal(layer.keys[row, head, where], full.layers[0].keys[row, head, rising])
    assert torch.equal(layer.values[row, head, where], full.layers[0].values[row, head, rising])
    assert torch.isclose(layer.extras["score"][row, head, where], 1.2 * lowest)
    sketch = state["sketch"]
    ids = torch.full((2, 2, 1), leaving)
    keys, values = sketch.query(ids)
    assert torch.equal(keys[row, head, 0], full.layers[0].keys[row, head, leaving])
    assert torch.equal(values[row, head, 0], full.layers[0].values[row, head, leaving])
    # Every token is still somewhere, once.
    stored, vague = token_sets(layer, row, head)
    assert sorted(stored + vague) == list(range(24))


# --------------------------------------------------------------------------------- memory


def test_peak_rebuild_memory_is_one_layer():
    model = tiny_model("llama-gqa", layers=4)
    input_ids, attention_mask = random_batch(length=40, pad=(0, 7))
    _, cache = run_generate(model, input_ids, attention_mask, "kvreviver", 10, new_tokens=20, **UNIFORM)
    report = memory_report(cache)
    per_layer = [layer.state["peak_rebuilt_bytes"] for layer in cache.layers]
    # Never more than one layer's rebuilt cache (plus its query buffers) alive at once...
    assert report["peak_rebuilt_bytes"] == max(per_layer)
    assert report["rebuilt_bytes_alive"] == 0
    # ...and one layer's rebuilt cache holds every token of that layer.
    layer = cache.layers[-1]
    batch, kv_heads, _, head_dim = layer.keys.shape
    one_layer_kv = 2 * batch * kv_heads * int(layer.real_seen.max()) * head_dim * layer.keys.element_size()
    assert one_layer_kv <= layer.state["rebuilt_bytes"] < 2 * one_layer_kv
    assert report["peak_rebuilt_bytes"] < 2 * one_layer_kv
    # What is stored stays far below the full cache.
    assert report["stored_bytes"] < 0.45 * report["full_cache_bytes"]  # 10 of 40 entries + sketch + scalars
    assert report["sketch_bytes"] > 0


def test_budget_and_reversibility_over_decoding():
    """Stored entries + sketch within the budget (19), compressing every 4 steps to 3 below it (16);
    no token is ever lost. (test_all_methods runs 300 steps against the stored entries' budget.)"""
    model = tiny_model("llama-gqa")
    input_ids, attention_mask = random_batch(length=40, pad=(0, 7))
    cache = keepkv.CompressedCache(model.config, "kvreviver", 19, interval=4, **UNIFORM)
    for step, cache in enumerate(decode_loop(model, input_ids, attention_mask, cache, steps=160)):
        for layer in cache.layers:
            state = layer.state
            sketch_entries = state["sketch"].rows * state["buckets"]
            assert (layer.live_counts() + sketch_entries <= 19).all(), step
            assert torch.equal(layer.bound, cache.layer_budgets[layer.layer_idx]) and layer.interval == 4
            assert torch.equal(layer.live_counts() + vague_count(layer), layer.real_seen[:, None].expand(-1, 2))
    for layer in cache.layers:
        for row in range(2):
            for head in range(2):
                stored, vague = token_sets(layer, row, head)
                assert sorted(stored + vague) == list(range(int(layer.real_seen[row])))
    assert sum(int(layer.state["swaps"].sum()) for layer in cache.layers if "swaps" in layer.state) > 0


@pytest.mark.parametrize("estimate", ["sum", "mean"])
def test_batched_equals_single_with_fisher_budgets_and_swaps(estimate):
    model = tiny_model("llama-gqa", layers=3)
    input_ids, attention_mask = random_batch(length=36, pad=(0, 11))
    # Layer scores under which this prompt makes swaps happen (asserted below): the swap path runs.
    params = dict(layer_scores=(1.0, 2.0, 3.0), interval=2, replace_rate=1.0, estimate=estimate)
    batched, cache = run_generate(model, input_ids, attention_mask, "kvreviver", 12, new_tokens=40, **params)
    assert memory_report(cache)["swaps"] > 0
    if estimate == "mean":  # slot occupancy follows every insert, swap and delete
        for layer in cache.layers:
            state = layer.state
            valid = state["vague_pos"] >= 0
            buckets = buckets_of(state["sketch"], state["vague_pos"].long())  # [B, H, n, r]
            expected = torch.zeros_like(state["slot_counts"])
            expected.scatter_add_(-1, buckets.permute(0, 1, 3, 2), valid[:, :, None].float().expand(-1, -1, 3, -1))
            assert torch.equal(state["slot_counts"], expected)
    budgets = torch.stack([layer.budget[:, 0] for layer in cache.layers])  # [L, B]
    assert budgets[2, 0] > budgets[1, 0] > budgets[0, 0]  # ordered as the layer scores
    for row in range(2):
        real = attention_mask[row].bool()
        alone, single = run_generate(
            model, input_ids[row : row + 1, real], attention_mask[row : row + 1, real], "kvreviver", 12, 40, **params
        )
        assert torch.equal(batched[row], alone[0]), row
        for layer, other in zip(cache.layers, single.layers):
            assert token_sets(layer, row, 0) == token_sets(other, 0, 0)


# ---------------------------------------------------------------------------------- Fisher


def test_fisher_scores_of_the_prepared_model_are_used_by_allocate():
    model = tiny_model("llama-gqa", layers=3)
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight.mul_(3.0)
    scores = fisher_scores(model)
    assert scores.argmax() == 1
    input_ids, attention_mask = random_batch(length=40, pad=(0, 0))
    method = keepkv.get_method("kvreviver")
    method.prepare(model)  # the scores live on the method, not in a registry keyed by the config
    cache = prefill(model, input_ids, attention_mask, method, 12)
    budgets = [int(layer.budget[0, 0]) for layer in cache.layers]
    assert sum(budgets) == 3 * 12 and budgets[1] == max(budgets)
    uniform = prefill(model, input_ids, attention_mask, "kvreviver", 12, **UNIFORM)
    assert [int(layer.budget[0, 0]) for layer in uniform.layers] == [12, 12, 12]
    # Empirical Fisher from gradients on calibration tokens (Palu's estimator).
    calibrated = fisher_scores(model, calibration_ids=input_ids[:1, :16])
    assert calibrated.shape == (3,) and (calibrated > 0).all()
    assert model.config._attn_implementation == "keepkv"


def test_proportional_budgets_sum_and_minimum():
    scores = torch.tensor([1.0, 0.0, 10.0, 5.0])
    budgets = proportional_budgets(scores, torch.tensor([32, 120]), minimum=5)
    assert budgets.sum(0).tolist() == [32, 120]
    assert (budgets >= 5).all()
    assert budgets[2, 1] >= budgets[3, 1] >= budgets[0, 1]


# ------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "params, match",
    [
        (dict(recent_share=0.5, candidate_share=0.5, vague_share=0.1), "sum to 1"),
        (dict(rows=0), "rows"),
        (dict(buckets=0), "buckets"),
        (dict(replace_rate=0.9), "replace_rate"),
        (dict(allocation="pyramid"), "allocation"),
        (dict(estimate="median"), "estimate"),
        (dict(vague_share=1.0, recent_share=0.0, candidate_share=0.0), "vague_share"),
        (dict(layer_scores=(1.0, -2.0)), "layer_scores"),
    ],
)
def test_bad_parameters(params, match):
    with pytest.raises(ValueError, match=match):
        keepkv.get_method("kvreviver", **params)


def test_budget_too_small_for_sinks_and_one_recent_token():
    model = tiny_model("llama-gqa")
    # 3 buckets' worth of sketch (r=3, b>=1) + 4 sinks + 1 recent token need 8 entries.
    with pytest.raises(ValueError, match="at least 8"):
        keepkv.CompressedCache(model.config, "kvreviver", 7, sinks=4)
    keepkv.CompressedCache(model.config, "kvreviver", 8, sinks=4)
    # A fractional budget is checked once the prompt lengths are known (its floor, 32 entries, is
    # too small for 40 sinks).
    input_ids, attention_mask = random_batch(length=24, pad=(0, 0))
    with pytest.raises(ValueError, match="at least 46"):
        prefill(model, input_ids, attention_mask, "kvreviver", 0.1, sinks=40, **UNIFORM)
    with pytest.raises(ValueError, match="layer_scores has 3"):
        prefill(model, input_ids, attention_mask, "kvreviver", 12, layer_scores=(1.0, 2.0, 3.0))


@torch.no_grad()
def test_cache_grows_by_the_vague_scalars_only():
    """Past its budget a row's stored entries and sketch stay constant; every generated token adds one
    vague token per layer and KV head, i.e. its int32 position and fp32 score: 8 x H_kv x L bytes."""
    model = tiny_model("llama-gqa", layers=2)
    input_ids, attention_mask = random_batch(batch=1, length=60, pad=(0,))
    cache = keepkv.CompressedCache(model.config, "kvreviver", 16, **UNIFORM)
    sizes = []
    for cache in decode_loop(model, input_ids, attention_mask, cache, steps=12):
        summary, report = cache.summary(), memory_report(cache)
        assert report["stored_bytes"] == cache.nbytes() == summary.cache_bytes[0]
        assert report["entry_bytes"] + report["sketch_bytes"] + report["vague_scalar_bytes"] <= report["stored_bytes"]
        sizes.append((cache.nbytes(), summary.entry_bytes[0], report["sketch_bytes"]))
    kv_heads, layers = model.config.num_key_value_heads, model.config.num_hidden_layers
    assert all(after[0] - before[0] == 8 * kv_heads * layers for before, after in zip(sizes, sizes[1:]))
    assert len({entries for _, entries, _ in sizes}) == 1 and len({sketch for _, _, sketch in sizes}) == 1


def test_memory_report_of_caches_that_share_one_method_instance_stays_apart():
    """The rebuild tracker belongs to the cache, not to the method instance: a bigger run of another
    cache with the same KVReviver does not leak into this cache's peak."""
    model = tiny_model("llama-gqa", layers=2)
    small_ids, small_mask = random_batch(batch=1, length=24, pad=(0,))
    big_ids, big_mask = random_batch(batch=3, length=60, pad=(0, 0, 0), seed=2)
    alone = keepkv.CompressedCache(model.config, "kvreviver", 0.25, **UNIFORM)
    for _ in decode_loop(model, small_ids, small_mask, alone, steps=6):
        pass
    shared = keepkv.get_method("kvreviver", **UNIFORM)
    small = keepkv.CompressedCache(model.config, shared, 0.25)
    big = keepkv.CompressedCache(model.config, shared, 0.25)
    for _ in decode_loop(model, small_ids, small_mask, small, steps=6):
        pass
    for _ in decode_loop(model, big_ids, big_mask, big, steps=6):
        pass
    expected = memory_report(alone)
    assert memory_report(small) == expected
    assert memory_report(big)["peak_rebuilt_bytes"] > expected["peak_rebuilt_bytes"]
