"""KeepKV: Theorems 2/3, Lemma 6, votes, GQA, numerics, refresh, memory, perturbation, bad input."""

import json
from dataclasses import dataclass
import math

import pytest
import torch

import keepkv
from keepkv.attention import StepStats
from keepkv.store import LayerStore
from keepkv.merging import convex_merge_rows, cosine_nearest, zip_rows_with_ema

from helpers import convex_merge, ema_scores, offload_report, zip_merge
from reference import attention_mass
from keepkv.methods.keepkv import EmaAttention, KeepKV, KeepKVMerge
from keepkv.offload import FullKVCopy
from keepkv.perturbation import _attend, builtin_document, format_perturbation, perturbation, recompute_logits

from conftest import decode_loop, greedy_decode, random_batch, tiny_model

# KeepKV with its own EMA selection and ungated merges (every kept entry may take merges, as in
# the paper): the theorems and the EMA are tested on it (the registered default selects with
# SnapKV and gates its merges; tests/test_zip_merging.py and test_merge_gates.py cover those).
EMA = "keepkv+selection=ema+protect=0+max_value_change=None+min_mass=0"


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: intra-op threads only add waits (tens of ms per op on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass(frozen=True)
class ConvexMerge(KeepKVMerge):
    """KeepKV's merge with a classic convex merge (no votes) in place of ZIP: Theorem 2's foil."""

    name = "convex-merge-test"

    def apply(self, layer, plan, stats):
        dst, similarity = cosine_nearest(layer.keys, plan.evict_idx, self.merge_candidates(layer, plan))
        merge = plan.evict_valid & (similarity >= self.threshold)  # no gates: every planned merge happens
        weights = torch.ones(merge.shape, device=merge.device)
        layer.merge_into(convex_merge_rows(layer.keys, layer.values, plan.evict_idx, dst, merge, weights))
        layer.keep(plan.kept, plan.slots)


def keepkv_ema(**merge_params):
    """KeepKV with its own selection (``ema``) and these parameters of its merge."""
    return keepkv.get_method("keepkv", selection="ema", **merge_params)


def votes(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, H_kv] votes on live entries, [B, H_kv] tokens evicted unmerged), both float64: their
    sum is the number of real tokens seen (vote conservation)."""
    return layer.bias.double().exp().sum(-1), layer.state["lost_votes"].double()


def prompt_ids(length=40, seed=3):
    ids, _ = random_batch(batch=1, length=length, pad=(0,), seed=seed)
    return ids


def merge_entries(method, layer, src, dst, merge, queries, scaling, exact):
    """ZIP-merge ``src`` into ``dst`` where ``merge`` in ``layer`` as KeepKV's merge does, ungated:
    weighed with the newest of ``queries``' exact logits (as at a prompt's end), or with the EMA."""
    stats = StepStats(query=queries, scaling=scaling, is_prefill=exact)
    merging = method.merging
    ema = merging.ranking_scores(layer)
    layer.merge_into(zip_rows_with_ema(
        layer.keys, layer.values, layer.bias, merging.ema_log_n(layer), src, dst, merge,
        merging.merge_weights(layer, ema, stats), ema.heads, queries[:, :, :, -1].contiguous(), scaling, merging.zip_key, 0.0,
    ))


def store_from(keys, values, queries, method, scaling):
    """A LayerStore holding keys/values [B, H_kv, S, D], observed as a prefill by ``method``."""
    layer = LayerStore(0)
    layer.lazy_initialization(keys, values)
    layer.append(keys, values, torch.ones(keys.shape[0], keys.shape[2], dtype=torch.bool))
    method.observe(layer, StepStats(query=queries, scaling=scaling, is_prefill=True))
    return layer


class Hook:
    """Wraps forward_layer. Per layer and step: ``errors``, the newest query's output recomputed
    on the store after the method compressed vs the output it got before; ``full_errors``, the
    same recomputation vs attention over every K/V appended so far."""

    def __init__(self, cache):
        self.cache, self.inner = cache, cache.forward_layer
        cache.forward_layer = self
        self.errors, self.full_errors, self.appended = [], [], {}

    def __call__(self, index, query, keys, values, mask, scaling):
        out = self.inner(index, query, keys, values, mask, scaling)
        self.appended.setdefault(index, []).append((keys.clone(), values.clone(), mask[:, 0, -1].clone()))
        layer = self.cache.layers[index]
        after = _attend(query[:, :, -1], layer.keys, layer.values, layer.bias, scaling)
        blocks = self.appended[index]
        real = torch.cat([b[2] for b in blocks], 1)
        full_bias = torch.zeros(real.shape).masked_fill(~real, float("-inf"))[:, None].expand(-1, keys.shape[1], -1)
        full_keys, full_values = torch.cat([b[0] for b in blocks], 2), torch.cat([b[1] for b in blocks], 2)
        full = _attend(query[:, :, -1], full_keys, full_values, full_bias, scaling)
        self.errors.append(relative(after, out[:, -1]))
        self.full_errors.append(relative(after, full))
        return out


def relative(approx, exact):
    exact = exact.float()
    return float(((approx.float() - exact).flatten(1).norm(dim=-1) / exact.flatten(1).norm(dim=-1)).max())


# -- Theorem 3 -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "zip_key,order",
    [("paper", "evict_first"), ("projection", "evict_first"), ("paper", "merge_first"), ("projection", "merge_first")],
)
@torch.no_grad()
def test_theorem3_prefill_merge_is_lossless_on_mha(zip_key, order):
    model = tiny_model("llama-mha")
    ids = prompt_ids()
    params = dict(threshold=-1.0, zip_key=zip_key, prefill_order=order, prefill_scores="exact")
    result = perturbation(model, None, ids, EMA, budget=12, steps=(), **params)
    assert max(result["layers"]) <= 1e-5, result["layers"]
    # next-token logits of the last prompt token recomputed on the compressed cache
    keepkv.enable(model)
    full = keepkv.CompressedCache(model.config, "full", 1.0)
    model(input_ids=ids, past_key_values=full)
    cache = keepkv.CompressedCache(model.config, EMA, 12, **params)
    model(input_ids=ids, past_key_values=cache)
    reference = recompute_logits(model, full, ids[:, -1:], ids.shape[1] - 1)
    compressed = recompute_logits(model, cache, ids[:, -1:], ids.shape[1] - 1)
    assert torch.allclose(compressed, reference, atol=1e-4, rtol=1e-4), (compressed - reference).abs().max()
    for layer in cache.layers:  # several many-to-one groups per head, nothing dropped
        votes = layer.bias.exp()
        assert ((votes >= 3).sum(-1) >= 2).all()
        assert torch.allclose(votes.sum(-1), torch.tensor(float(ids.shape[1])))
        assert int(layer.live_counts().max()) <= int(layer.budget.max())


@pytest.mark.parametrize("zip_key", ["paper", "projection"])
@torch.no_grad()
def test_theorem3_decode_merges_with_exact_scores_are_lossless(zip_key):
    model = tiny_model("llama-mha")
    ids = prompt_ids(30)
    cache = keepkv.CompressedCache(
        model.config, EMA, 10, threshold=-1.0, zip_key=zip_key, scores="exact", prefill_order="evict_first"
    )
    hook = Hook(cache)
    mask = torch.ones_like(ids)
    keepkv.enable(model)
    model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    token = ids[:, -1:]
    for step in range(6):
        hook.errors.clear()
        token = (token * 7 + step) % 100 + 3
        mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
        logits = model(input_ids=token, attention_mask=mask, past_key_values=cache).logits[:, -1].float()
        assert max(hook.errors) <= 1e-5, (step, hook.errors)
        again = recompute_logits(model, cache, token, int(cache.layers[0].real_seen[0]) - 1)
        assert torch.allclose(again, logits, atol=1e-4, rtol=1e-4)
        for layer in cache.layers:  # a merge did happen at this step
            assert int(layer.live_counts().max()) == int(layer.budget.max())
            assert torch.allclose(layer.bias.exp().sum(-1), layer.real_seen.float()[:, None])


def test_done_when_exact_keepkv_vs_eviction_and_convex_merge():
    model = tiny_model("llama-mha")
    ids = prompt_ids()
    exact = perturbation(model, None, ids, EMA, budget=12, steps=(), threshold=-1.0)
    assert max(exact["layers"]) <= 1e-5
    for method in ("h2o", "streamingllm", KeepKV(selection=EmaAttention(), merging=ConvexMerge(threshold=-1.0))):
        other = perturbation(model, None, ids, method, budget=12, steps=())
        assert min(other["layers"]) >= 1e-3, (method, other["layers"])


# -- Theorem 2 and Lemma 6 -----------------------------------------------------------------------
def test_theorem2_convex_merge_sags_zip_does_not():
    torch.manual_seed(0)
    keys, values = torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 16)
    query, scaling = torch.randn(1, 1, 16), 0.25
    bias = torch.zeros(1, 1, 8)
    src, dst = torch.tensor([[[5, 6, 7]]]), torch.tensor([[[0, 0, 1]]])
    merge = torch.ones(1, 1, 3, dtype=torch.bool)
    removed = torch.zeros(1, 1, 8).index_fill(-1, src[0, 0], float("-inf"))
    reference, weights = attention_mass(query, keys, values, bias, scaling)
    group_mass = weights[0, 0, [0, 5, 6]].sum()

    ck, cv = convex_merge(keys, values, src, dst, merge, torch.ones(1, 1, 3))
    convex_out, convex_w = attention_mass(query, ck, cv, bias + removed, scaling)
    sag = float(convex_w[0, 0, 0] / group_mass)
    convex_error = float((convex_out - reference).norm() / reference.norm())
    assert sag < 0.95 and convex_error > 1e-2, (sag, convex_error)

    logits = (keys @ query[..., None])[..., 0] * scaling
    zk, zv, zb = zip_merge(
        keys, values, bias, logits, src, dst, merge, key_rule="projection", queries=query, scaling=scaling
    )
    zip_out, zip_w = attention_mass(query, zk, zv, zb + removed, scaling)
    assert abs(float(zip_w[0, 0, 0] * zb.exp()[0, 0, 0] / group_mass) - 1) < 1e-5
    assert float((zip_out - reference).norm() / reference.norm()) < 1e-6


@pytest.mark.parametrize("zip_key", ["paper", "projection", "group"])
def test_lemma6_identical_entries_merge_without_error(zip_key):
    torch.manual_seed(1)
    batch, kv_heads, group, size, dim = 2, 2, 2, 10, 8
    keys, values = torch.randn(batch, kv_heads, size, dim), torch.randn(batch, kv_heads, size, dim)
    keys[:, :, 7], values[:, :, 7] = keys[:, :, 2], values[:, :, 2]
    method = keepkv_ema(zip_key=zip_key, window=3)  # rows at positions 7-9: both copies see the same queries
    window = torch.randn(batch, kv_heads, group, 3, dim)
    layer = store_from(keys, values, window, method, 0.35)
    before = (layer.keys.clone(), layer.values.clone(), layer.bias.clone())
    src, dst = torch.full((batch, kv_heads, 1), 7), torch.full((batch, kv_heads, 1), 2)
    merge_entries(method, layer, src, dst, torch.ones(batch, kv_heads, 1, dtype=torch.bool), window, 0.35, exact=False)
    layer.drop(torch.zeros_like(layer.live()).index_fill(-1, torch.tensor([7]), True))
    assert torch.allclose(layer.bias[:, :, 2].exp(), torch.tensor(2.0))
    for seed in range(5):  # any later query
        later = torch.randn(batch, kv_heads * group, dim, generator=torch.Generator().manual_seed(seed)) * 3
        assert torch.allclose(_attend(later, *layer_entries(layer), 0.35), _attend(later, *before, 0.35), atol=1e-6)


@pytest.mark.parametrize("score_norm", ["none", "row"])
def test_ema_initialisation_matches_eq8_by_hand(score_norm):
    """ln ŝ after prefill = ln(Σ_r w_r s_r / Σ_r w_r), w_r = (1-α)α^age over the window's rows
    (eq. 8); with score_norm="row" each s_r is first divided by its row's Σ_j s_rj, and the result
    read back on the newest row's logit scale. A loud row (logits x8) dominates only "none"."""
    torch.manual_seed(2)
    batch, kv_heads, group, size, dim, rows = 1, 1, 1, 9, 8, 3
    keys, values = torch.randn(batch, kv_heads, size, dim), torch.randn(batch, kv_heads, size, dim)
    window = torch.randn(batch, kv_heads, group, rows, dim)
    window[:, :, :, 0] *= 8.0  # the oldest row's logits are far larger than the others'
    method = keepkv_ema(window=rows, alpha=0.5, score_norm=score_norm)
    layer = store_from(keys, values, window, method, 0.35)
    logits = 0.35 * window[0, 0, 0] @ keys[0, 0].T  # [r, S]; causal: row r sees slots <= S - rows + r
    visible = torch.arange(size)[None] <= torch.arange(size - rows, size)[:, None]
    logits = logits.masked_fill(~visible, float("-inf"))
    log_z = torch.logsumexp(logits, dim=-1)
    scores = logits - log_z[:, None] if score_norm == "row" else logits
    weights = torch.tensor([0.25, 0.5, 1.0])[:, None] * visible  # (1-α)α^age, normalisation cancels
    expected = (scores.exp() * weights).sum(0) / weights.sum(0)
    expected = expected.log() + (log_z[-1] if score_norm == "row" else 0.0)
    got = ema_scores(method.merging, layer)[0, 0, 0]
    assert torch.allclose(got, expected, atol=1e-5), (got, expected)
    # ranking: "none" follows the loud row's own ranking of the slots it sees, "row" need not
    loud_order = logits[0, : size - rows + 1].argsort(descending=True)
    got_order = got[: size - rows + 1].argsort(descending=True)
    if score_norm == "none":
        assert torch.equal(got_order[:3], loud_order[:3])


@pytest.mark.parametrize("score_norm", ["none", "row"])
def test_pooled_ema_is_eq8_of_each_querys_mean_score_over_its_group(score_norm):
    """ema_heads="pooled": one word per entry and KV head, the EMA (eq. 8) of each query row's mean
    score over the GQA group, ln((1/g) Σ_h s^h) ("row": of its shares s^h / Z^h, read back on the
    newest row's scale, the geometric mean of its heads' Z^h). With "none" that is the mean of the
    g per-head EMAs that ema_heads="each" keeps, so an entry's EMA reads no other entry."""
    torch.manual_seed(5)
    batch, kv_heads, group, size, dim, rows = 1, 1, 3, 9, 8, 3
    keys, values = torch.randn(batch, kv_heads, size, dim), torch.randn(batch, kv_heads, size, dim)
    window = torch.randn(batch, kv_heads, group, rows, dim) * 2
    pooled = keepkv_ema(window=rows, alpha=0.5, score_norm=score_norm, ema_heads="pooled")
    layer = store_from(keys, values, window, pooled, 0.35)
    assert layer.extras["ema_log_s"].shape == (batch, kv_heads, size, 1)
    logits = 0.35 * window[0, 0] @ keys[0, 0].T  # [g, r, S]
    visible = torch.arange(size)[None] <= torch.arange(size - rows, size)[:, None]  # [r, S]
    logits = logits.masked_fill(~visible, float("-inf"))
    log_z = torch.logsumexp(logits, dim=-1)  # [g, r]
    scores = logits - log_z[..., None] if score_norm == "row" else logits
    per_row = scores.exp().mean(0)  # [r, S]
    weights = torch.tensor([0.25, 0.5, 1.0])[:, None] * visible
    expected = ((per_row * weights).sum(0) / weights.sum(0)).log() + (log_z[:, -1].mean() if score_norm == "row" else 0.0)
    got = ema_scores(pooled.merging, layer)[0, 0, 0]
    assert torch.allclose(got, expected, atol=1e-5), (got, expected)
    each = keepkv_ema(window=rows, alpha=0.5, score_norm=score_norm, ema_heads="each")
    layer_each = store_from(keys, values, window, each, 0.35)
    assert layer_each.extras["ema_log_s"].shape == (batch, kv_heads, size, group)
    if score_norm == "none":  # EMA is linear: the mean of the heads' EMAs
        mean_of_heads = layer_each.extras["ema_log_s"].logsumexp(-1) - math.log(group)
        assert torch.allclose(layer.extras["ema_log_s"][..., 0], mean_of_heads, atol=1e-5)


@torch.no_grad()
def test_ema_heads_are_one_method_on_mha():
    """On an MHA model (g = 1) the pooled EMA is the per-head one: the same logits, bit for bit."""
    model = tiny_model("llama-mha", layers=2)
    runs = [greedy_decode(model, f"keepkv+ema_heads={heads}", 16, steps=12) for heads in ("pooled", "each")]
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][2].layers[0].extras["ema_log_s"].shape[-1] == 1


def test_group_key_rule_needs_each_heads_ema():
    with pytest.raises(ValueError, match="^zip_key='group' weighs each query head by its own EMA: use it with ema_heads='each'$"):
        keepkv.get_method("keepkv+zip_key=group+ema_heads=pooled")
    assert keepkv.get_method("keepkv+zip_key=group+ema_heads=each").merging.zip_key == "group"


@torch.no_grad()
@pytest.mark.parametrize("steps", [0, 1, 5])
def test_ema_normaliser_is_the_ema_of_one_over_the_queries_that_saw_each_entry(steps):
    """ln N, derived from positions (not stored), equals eq. 8's EMA of a constant 1 folded query by
    query: Σ (1-α) α^age over the prefill window's real rows and every decode query at or after the
    entry's position, for left-padded rows of unequal length."""
    model = tiny_model("llama-gqa", layers=1)
    ids, mask = random_batch(batch=3, length=30, pad=(0, 7, 25))
    cache = keepkv.CompressedCache(model.config, EMA + "+window=8+alpha=0.7", 64)
    for _ in decode_loop(model, ids, mask, cache, steps=steps):
        pass
    layer = cache.layers[0]
    got = cache.method.merging.ema_log_n(layer)
    alpha = 0.7
    for row, real in enumerate(mask.sum(-1).tolist()):
        window_rows = [pos for pos in range(real - 8, real) if pos >= 0]  # the last 8 slots: real rows
        queries = window_rows + list(range(real, real + steps))
        newest = queries[-1]
        for slot, pos in enumerate(layer.positions[row, 0].tolist()):
            if pos < 0:
                continue
            n = sum((1 - alpha) * alpha ** (newest - q) for q in queries if q >= pos)
            expected = math.log(n) if n > 0 else float("-inf")
            assert torch.allclose(got[row, :, slot], torch.tensor(expected), atol=1e-5), (row, pos, got[row, :, slot], expected)


def layer_entries(layer):
    return layer.keys, layer.values, layer.bias


# -- votes, GQA, numerics -----------------------------------------------------------------------
@torch.no_grad()
def test_votes_are_conserved_over_500_decode_steps():
    model = tiny_model("llama-gqa", layers=1)
    ids, mask = random_batch(batch=2, length=30, pad=(0, 6))
    cache = keepkv.CompressedCache(model.config, EMA, 12, threshold=0.3)
    merged = dropped = False
    for step, cache in enumerate(decode_loop(model, ids, mask, cache, steps=500)):
        for layer in cache.layers:
            live, lost = votes(layer)
            seen = layer.real_seen.double()[:, None]
            assert torch.allclose(live + lost, seen.expand_as(live), rtol=1e-5, atol=1e-3), (step, live + lost, seen)
            merged |= bool((layer.bias > 0.5).any())
            dropped |= bool((lost > 0).any())
    assert merged and dropped


@torch.no_grad()
def test_gqa_group_key_keeps_every_heads_attention_mass():
    model = tiny_model("llama-gqa")
    ids = prompt_ids()
    captured = {}
    errors = {}
    for zip_key in ("group", "projection"):
        cache = keepkv.CompressedCache(model.config, EMA, 12, threshold=-1.0, zip_key=zip_key)
        inner = cache.forward_layer

        def hook(index, query, keys, values, mask, scaling, inner=inner):
            captured[index] = (query[:, :, -1], keys, scaling)
            return inner(index, query, keys, values, mask, scaling)

        cache.forward_layer = hook
        keepkv.enable(model)
        model(input_ids=ids, past_key_values=cache)
        worst = 0.0
        for layer in cache.layers:
            query, keys, scaling = captured[layer.layer_idx]
            q = query.view(1, keys.shape[1], -1, keys.shape[-1])  # [B, H_kv, g, D]
            full_mass = torch.logsumexp(q @ keys.transpose(-1, -2) * scaling, -1)
            kept_mass = torch.logsumexp(q @ layer.keys.transpose(-1, -2) * scaling + layer.bias[:, :, None], -1)
            worst = max(worst, float((kept_mass - full_mass).abs().max()))  # |ln Z' - ln Z| ≈ relative error
        errors[zip_key] = worst
    assert errors["group"] <= 1e-5, errors
    assert errors["projection"] > 1e-4, errors  # the single-direction key cannot satisfy every head


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_low_precision_with_large_logits_stays_finite(dtype):
    model = tiny_model("llama-gqa")
    with torch.no_grad():
        for block in model.model.layers:
            block.self_attn.q_proj.weight.mul_(4.0)
            block.self_attn.k_proj.weight.mul_(4.0)
    model = model.to(dtype)
    ids, mask = random_batch(batch=2, length=30, pad=(0, 5))
    largest = []
    for zip_key in ("paper", "projection", "group"):
        cache = keepkv.CompressedCache(model.config, EMA, 8, threshold=0.0, zip_key=zip_key)
        inner = cache.forward_layer

        def hook(index, query, keys, values, block_mask, scaling, inner=inner):
            layer = cache.layers[index]
            stored = torch.cat([layer.keys, keys], dim=2) if layer.keys is not None else keys
            q = query.float().view(query.shape[0], keys.shape[1], -1, query.shape[2], query.shape[3])
            largest.append(float((q @ stored.float()[:, :, None].transpose(-1, -2)).abs().max() * scaling))
            return inner(index, query, keys, values, block_mask, scaling)

        cache.forward_layer = hook
        keepkv.enable(model)
        logits = model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits
        assert torch.isfinite(logits).all()
        token = logits[:, -1:].argmax(-1)
        for _ in range(12):
            mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
            logits = model(input_ids=token, attention_mask=mask, past_key_values=cache).logits
            assert torch.isfinite(logits).all(), zip_key
            token = logits[:, -1:].argmax(-1)
        for layer in cache.layers:
            live = layer.live()
            assert torch.isfinite(layer.keys[live]).all() and torch.isfinite(layer.values[live]).all()
            assert torch.isfinite(layer.bias[live]).all()
        mask = mask[:, : ids.shape[1]]
    assert max(largest) >= 30, max(largest)


def test_opposite_sign_logits_give_finite_keys():
    """Σ w ln s = 0 (eq. 25's denominator) with logits of opposite sign: the key stays finite."""
    dim, scaling = 8, 1.0
    query = torch.zeros(1, 1, 1, 1, dim)
    query[..., 0] = 1.0
    keys = torch.zeros(1, 1, 6, dim)
    keys[0, 0, :, 1] = torch.arange(6.0)  # orthogonal to the query: logit 0
    keys[0, 0, 4, 0], keys[0, 0, 5, 0] = 0.5, -2.0  # logits +0.5 and -2
    values = torch.randn(1, 1, 6, dim)
    for zip_key in ("paper", "projection", "group"):
        method = keepkv_ema(zip_key=zip_key, window=1)
        layer = store_from(keys, values, query, method, scaling)
        # votes that make p4 s4 ln s4 + p5 s5 ln s5 = 0
        layer.bias[0, 0, 5] = math.log(0.5 * math.exp(0.5) / (2 * math.exp(-2.0)))
        reference = _attend(query[:, :, :, 0].reshape(1, 1, dim), layer.keys, layer.values, layer.bias, scaling)
        src, dst = torch.tensor([[[4]]]), torch.tensor([[[5]]])
        merge_entries(method, layer, src, dst, torch.ones(1, 1, 1, dtype=torch.bool), query, scaling, exact=True)
        merged = layer.keys[0, 0, 5]
        assert torch.isfinite(merged).all() and merged.norm() < 10 * keys.norm(dim=-1).max(), (zip_key, merged)
        layer.bias[0, 0, 4] = float("-inf")
        after = _attend(query[:, :, :, 0].reshape(1, 1, dim), layer.keys, layer.values, layer.bias, scaling)
        assert torch.allclose(after, reference, atol=1e-5)


# -- periodic refresh -------------------------------------------------------------------------------
@torch.no_grad()
def test_refresh_equals_rebuild_and_full_copy_is_bit_exact():
    model = tiny_model("llama-mha")
    ids, mask = random_batch(batch=2, length=24, pad=(0, 5))
    cache = keepkv.CompressedCache(model.config, EMA, 8, threshold=-1.0, refresh_interval=4, window=6)
    hook = Hook(cache)
    refreshed = 0
    for step, cache in enumerate(decode_loop(model, ids, mask, cache, steps=9)):
        layer = cache.layers[-1]
        if layer.state["refreshes"] == refreshed:
            continue
        refreshed = layer.state["refreshes"]
        assert (step + 1) % 4 == 0
        assert max(hook.full_errors[-cache.num_layers:]) <= 1e-5  # the refresh step is lossless (MHA)
        for layer in cache.layers:
            copy = layer.state["offload"]
            keys, values, is_real = copy.load()
            blocks = hook.appended[layer.layer_idx]
            assert torch.equal(keys, torch.cat([b[0] for b in blocks], 2))
            assert torch.equal(values, torch.cat([b[1] for b in blocks], 2))
            assert torch.equal(is_real, torch.cat([mask, torch.ones(2, step + 1, dtype=mask.dtype)], 1).bool())
            fresh = LayerStore(layer.layer_idx)
            fresh.lazy_initialization(keys, values)
            fresh.append(keys, values, is_real)
            fresh.set_budget(layer.budget, layer.row_budget)
            window = StepStats(query=layer.state["query_window"], scaling=layer.state["scaling"], is_prefill=True)
            cache.method.observe(fresh, window)
            cache.method.compress(fresh, window)
            for name in ("keys", "values", "bias", "positions"):
                assert torch.equal(getattr(fresh, name), getattr(layer, name)), name
            for name, extra in layer.extras.items():
                assert torch.equal(fresh.extras[name], extra), name
    assert refreshed == 2
    report = offload_report(cache)
    tokens = ids.shape[1] + 9
    assert report["tokens"] == tokens and report["refreshes"] == 2 * cache.num_layers
    per_token = 2 * (4 * 2 * 16 * 4 + 1)  # rows · (heads · (k + v) · head_dim · fp32 + mask byte)
    assert report["bytes"] == cache.num_layers * tokens * per_token
    assert report["bytes_to_host"] == report["bytes"] and report["bytes_to_device"] > 0
    assert report["seconds_to_host"] >= 0 and json.dumps(report)


def test_full_copy_grows_and_loads_exactly():
    keys = torch.randn(2, 3, 5, 4, dtype=torch.bfloat16)
    copy = FullKVCopy(keys, keys, capacity=2)
    blocks = [torch.randn(2, 3, n, 4, dtype=torch.bfloat16) for n in (5, 1, 1, 7)]
    for block in blocks:
        copy.append(block, -block, torch.ones(2, block.shape[2], dtype=torch.bool))
    loaded, values, is_real = copy.load()
    assert torch.equal(loaded, torch.cat(blocks, 2)) and torch.equal(values, -torch.cat(blocks, 2))
    assert is_real.all() and copy.capacity >= 14 and copy.report()["tokens"] == 14


# -- memory, allocation, diagnostics, bad input ---------------------------------------------------------
@torch.no_grad()
def test_2000_step_decode_stays_within_budget():
    model = tiny_model("llama-gqa", layers=1)
    ids, mask = random_batch(batch=2, length=20, pad=(0, 4))
    cache = keepkv.CompressedCache(model.config, EMA, 16)
    for cache in decode_loop(model, ids, mask, cache, steps=2000):
        layer = cache.layers[0]
        assert (layer.live_counts() <= layer.budget).all() and layer.size <= layer.capacity
    assert int(cache.layers[0].real_seen.min()) == 2016 and cache.layers[0].size == 16


def test_layer_budgets_follow_cosine_decay_with_mean_budget():
    method = keepkv_ema()
    row_budget = torch.tensor([100, 37])
    budgets = method.allocate(6, 2, row_budget, row_budget * 10)[:, :, 0]
    assert budgets.sum(0).tolist() == [600, 6 * 37]
    assert budgets[0, 0] > budgets[-1, 0]
    heavy = budgets[:, 0] - 4 - 19  # sinks 4, recent round(0.2 · 96) = 19
    assert abs(float(heavy[-1] / heavy[0]) - 0.8) < 0.03
    assert method.selection.recent_count(row_budget).tolist() == [19, 7]


def test_perturbation_result_is_json_and_formats():
    model = tiny_model("llama-gqa")
    result = perturbation(model, None, prompt_ids(), EMA, budget=0.3, steps=(1, 3))
    text = json.dumps(result)
    assert set(json.loads(text)) >= {"overall", "layers", "later", "logits_error"}
    assert len(result["layers"]) == 2 and set(result["later"]) == {1, 3}
    # the output moves further from the full cache's as the budget of the 40-token prompt shrinks
    smaller = [perturbation(model, None, prompt_ids(), EMA, budget=budget, steps=(3,)) for budget in (36, 24, 12)]
    overall = [run["overall"] for run in smaller]
    isolated = [run["later"][3]["isolated"]["overall"] for run in smaller]
    assert 0 < overall[0] < overall[1] < overall[2] and 0 < isolated[0] < isolated[1] < isolated[2], (overall, isolated)
    table = format_perturbation(result)
    assert "overall" in table and "+3" in table
    document = builtin_document()
    assert document == builtin_document() and "4817-AZURE" in document and 3000 < len(document) < 4400


@pytest.mark.parametrize(
    "params",
    [
        {"threshold": 1.5},
        {"threshold": -1.01},
        {"alpha": 0.0},
        {"alpha": 1.0},
        {"window": 0},
        {"refresh_interval": 0},
        {"zip_key": "cosine"},
        {"scores": "oracle"},
        {"prefill_order": "random"},
        {"score_norm": "softmax"},
        {"recent_ratio": 1.2},
    ],
)
def test_bad_parameters_raise_value_error(params):
    with pytest.raises(ValueError, match=next(iter(params))):
        keepkv.get_method("keepkv", **params)


def test_perturbation_bad_input():
    model = tiny_model("llama-gqa")
    with pytest.raises(ValueError):
        perturbation(model, None, None)
    with pytest.raises(ValueError):
        perturbation(model, None, prompt_ids(), steps=(0,))


@pytest.mark.parametrize("spec", ["keepkv", "keepkv+scores=exact", "keepkv+selection=ema+interval=2"])
@torch.no_grad()
def test_the_state_carries_no_step_scratch_after_a_compression(gqa_model, spec):
    """The newest query and its exact logits ([B, H_kv, g, S] over one step's slots) are read from
    the step's statistics, never kept in the layer's state: no stale [.., S_prompt] tensor counted
    as method state."""
    cache = keepkv.CompressedCache(gqa_model.config, spec, 0.25)
    ids = torch.randint(3, 100, (2, 120))
    with keepkv.enabled(gqa_model):
        out = gqa_model(ids, past_key_values=cache)
        for _ in range(4):  # the last step compresses at interval 1 and 2
            out = gqa_model(out.logits[:, -1:].argmax(-1), past_key_values=cache)
    for layer in cache.layers:
        assert layer.pending == 0  # compressed at the last step
        assert "exact_logits" not in layer.state and "query" not in layer.state
        assert layer.live_counts().max() <= int(layer.budget.max()) + 1
