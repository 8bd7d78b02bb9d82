"""Tests of keepkv.merging: exactness theorems of KeepKV, attention sag, numerics, references."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from keepkv.merging import cosine_nearest

from helpers import convex_merge, momentum_merge, spread_values, zip_merge
from reference import attention_mass

B, H_KV, S, D = 2, 3, 20, 16
SCALING = 1.0 / math.sqrt(D)
# Sources per target in every (row, head): three many-to-one groups, then two padded plan entries.
GROUP_SIZES = (1, 2, 3)
NUM_PADDING = 2


def make_plan(generator, batch=B, heads=H_KV, slots=S):
    """Random many-to-one plan per (row, head), with padded entries (src = dst = -1) at the end."""
    num_sources = sum(GROUP_SIZES)
    num_entries = num_sources + NUM_PADDING
    src = torch.full((batch, heads, num_entries), -1, dtype=torch.int64)
    dst = torch.full((batch, heads, num_entries), -1, dtype=torch.int64)
    merge = torch.zeros(batch, heads, num_entries, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            order = torch.randperm(slots, generator=generator)
            sources, targets = order[:num_sources], order[num_sources : num_sources + len(GROUP_SIZES)]
            # entries in shuffled order so that a target's sources are not contiguous in the plan
            shuffle = torch.randperm(num_sources, generator=generator)
            src[b, h, :num_sources] = sources[shuffle]
            dst[b, h, :num_sources] = torch.repeat_interleave(targets, torch.tensor(GROUP_SIZES))[shuffle]
            merge[b, h, :num_sources] = True
    return src, dst, merge


def evicted_mask(src, merge, slots=S):
    count = torch.zeros(*src.shape[:-1], slots)
    return count.scatter_add(-1, src.clamp_min(0), merge.float()) > 0


def target_mask(dst, merge, slots=S):
    count = torch.zeros(*dst.shape[:-1], slots)
    return count.scatter_add(-1, dst.clamp_min(0), merge.float()) > 0


def keep_only(keys, values, bias, src, merge):
    """Gather the kept slots (all but the merged-away ones); every (row, head) evicts as many."""
    evicted = evicted_mask(src, merge, keys.shape[-2])
    num_kept = keys.shape[-2] - int(evicted[0, 0].sum())
    kept_idx = torch.argsort(evicted.int(), dim=-1, stable=True)[..., :num_kept]
    gather = kept_idx.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
    return keys.gather(-2, gather), values.gather(-2, gather), bias.gather(-1, kept_idx)


def random_cache(generator, dtype=torch.float32):
    keys = torch.randn(B, H_KV, S, D, generator=generator).to(dtype)
    values = torch.randn(B, H_KV, S, D, generator=generator).to(dtype)
    votes = torch.randint(1, 5, (B, H_KV, S), generator=generator).float()
    return keys, values, votes.log()


def logits(query, keys):
    """Exact q·k·scaling: query [B, H, D] -> [B, H, S], or [B, H, g, D] -> [B, H, g, S]."""
    q = query if query.dim() == 4 else query.unsqueeze(-2)
    out = (q.float() @ keys.float().transpose(-1, -2)) * SCALING
    return out if query.dim() == 4 else out.squeeze(-2)


def relative_error(actual, expected):
    return ((actual - expected).norm(dim=-1) / expected.norm(dim=-1)).max().item()


def groups_of(src, dst, merge, b, h):
    """{target: [members]} of one (row, head), target first."""
    groups = {}
    for e in range(src.shape[-1]):
        if merge[b, h, e]:
            c = int(dst[b, h, e])
            groups.setdefault(c, [c]).append(int(src[b, h, e]))
    return groups


def assert_untouched(before, after, is_target):
    """Every slot that is no merge target is bit-identical."""
    untouched = ~is_target
    assert torch.equal(before[untouched], after[untouched])


@pytest.mark.parametrize("key_rule", ["paper", "projection"])
def test_theorem3_zip_merge_is_perturbation_free(key_rule):
    gen = torch.Generator().manual_seed(0)
    keys, values, bias = random_cache(gen)
    query = torch.randn(B, H_KV, D, generator=gen)
    src, dst, merge = make_plan(gen)
    new_keys, new_values, new_bias = zip_merge(
        keys, values, bias, logits(query, keys), src, dst, merge, key_rule=key_rule, queries=query, scaling=SCALING
    )

    expected, _ = attention_mass(query, keys, values, bias, SCALING)
    actual, _ = attention_mass(query, *keep_only(new_keys, new_values, new_bias, src, merge), SCALING)
    assert relative_error(actual, expected) < 1e-5

    # votes add up (eq. 6), the target keeps the group's attention mass p_r s_r = Σ p_i s_i (eq. 22);
    # targets changed, everything else bit-identical
    _, scores = attention_mass(query, keys, values, bias, SCALING)
    _, new_scores = attention_mass(query, new_keys, new_values, new_bias, SCALING)
    is_target = target_mask(dst, merge)
    for b in range(B):
        for h in range(H_KV):
            for c, members in groups_of(src, dst, merge, b, h).items():
                assert new_bias[b, h, c].exp().item() == pytest.approx(bias[b, h, members].exp().sum().item(), rel=1e-6)
                group_mass = (scores[b, h, members] * bias[b, h, members].exp()).sum().item()
                assert (new_scores[b, h, c] * new_bias[b, h, c].exp()).item() == pytest.approx(group_mass, rel=1e-5)
    assert not torch.equal(new_keys[is_target], keys[is_target])
    for before, after in ((keys, new_keys), (values, new_values), (bias, new_bias)):
        assert_untouched(before, after, is_target)


def test_paper_key_matches_eq25_literally_and_is_exact_without_query():
    """Positive logits keep the eq. 25 gain in (0, 1]: no fallback, no query needed."""
    gen = torch.Generator().manual_seed(1)
    keys, values, bias = random_cache(gen)
    query = torch.randn(B, H_KV, D, generator=gen)
    # shift every key along its head's query so that the logits lie in [1, 3]
    raw = logits(query, keys)
    wanted = 1.0 + 2.0 * torch.rand(B, H_KV, S, generator=gen)
    unit_step = query / (SCALING * query.square().sum(-1, keepdim=True))
    keys = keys + (wanted - raw).unsqueeze(-1) * unit_step.unsqueeze(-2)
    log_scores = logits(query, keys)
    src, dst, merge = make_plan(gen)

    new_keys, new_values, new_bias = zip_merge(keys, values, bias, log_scores, src, dst, merge, key_rule="paper")

    expected, _ = attention_mass(query, keys, values, bias, SCALING)
    actual, _ = attention_mass(query, *keep_only(new_keys, new_values, new_bias, src, merge), SCALING)
    assert relative_error(actual, expected) < 1e-5

    for b in range(B):
        for h in range(H_KV):
            for c, members in groups_of(src, dst, merge, b, h).items():
                p = bias[b, h, members].double().exp()
                ln_s = log_scores[b, h, members].double()
                w = p * ln_s.exp()
                k = keys[b, h, members].double()
                eq25 = (w @ k) * torch.log(w.sum() / p.sum()) / (w * ln_s).sum()
                torch.testing.assert_close(new_keys[b, h, c].double(), eq25, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_query_heads", [3, 2])  # 2 != H_KV catches axis mix-ups
def test_group_rule_meets_key_condition_for_every_query_head(num_query_heads):
    gen = torch.Generator().manual_seed(2)
    keys, values, bias = random_cache(gen)
    queries = torch.randn(B, H_KV, num_query_heads, D, generator=gen)
    head_logits = logits(queries, keys)  # [B, H, g, S]
    pooled = head_logits.mean(-2)
    src, dst, merge = make_plan(gen)

    new_keys, _, new_bias = zip_merge(
        keys,
        values,
        bias,
        pooled,
        src,
        dst,
        merge,
        key_rule="group",
        queries=queries,
        scaling=SCALING,
        group_log_scores=head_logits,
    )

    merged_logits = logits(queries, new_keys)  # [B, H, g, S]
    for b in range(B):
        for h in range(H_KV):
            for c, members in groups_of(src, dst, merge, b, h).items():
                p = bias[b, h, members].double().exp()
                s = head_logits[b, h][:, members].double().exp()  # [g, n]
                target = torch.log((s * p).sum(-1) / p.sum())  # t_h per query head
                torch.testing.assert_close(merged_logits[b, h, :, c].double(), target, rtol=0, atol=1e-5)
                assert new_bias[b, h, c].item() == pytest.approx(torch.log(p.sum()).item(), rel=1e-6)


def test_theorem2_convex_merge_sags_attention_mass():
    gen = torch.Generator().manual_seed(3)
    keys, values, _ = random_cache(gen)
    no_votes = torch.zeros(B, H_KV, S)
    query = torch.randn(B, H_KV, D, generator=gen)
    src, dst, merge = make_plan(gen)
    # D2O-style weights exp(cos - 1) relative to the target's own weight
    cos = torch.nn.functional.cosine_similarity(
        keys.gather(-2, src.clamp_min(0).unsqueeze(-1).expand(-1, -1, -1, D)),
        keys.gather(-2, dst.clamp_min(0).unsqueeze(-1).expand(-1, -1, -1, D)),
        dim=-1,
    )
    new_keys, new_values = convex_merge(keys, values, src, dst, merge, (cos - 1).exp())

    _, original_mass = attention_mass(query, keys, values, no_votes, SCALING)
    _, merged_mass = attention_mass(query, new_keys, new_values, no_votes, SCALING)
    for b in range(B):
        for h in range(H_KV):
            for c, members in groups_of(src, dst, merge, b, h).items():
                assert merged_mass[b, h, c] < original_mass[b, h, members].sum()

    expected, _ = attention_mass(query, keys, values, no_votes, SCALING)
    actual, _ = attention_mass(query, *keep_only(new_keys, new_values, no_votes, src, merge), SCALING)
    assert (actual - expected).norm(dim=-1).max() > 1e-3

    is_target = target_mask(dst, merge)
    assert_untouched(keys, new_keys, is_target)
    assert_untouched(values, new_values, is_target)


def test_convex_merge_matches_normalised_weighted_sum():
    gen = torch.Generator().manual_seed(4)
    keys, values, _ = random_cache(gen)
    src, dst, merge = make_plan(gen)
    weights = torch.rand(B, H_KV, src.shape[-1], generator=gen)
    new_keys, new_values = convex_merge(keys, values, src, dst, merge, weights)
    for b in range(B):
        for h in range(H_KV):
            for c in groups_of(src, dst, merge, b, h):
                incoming = [e for e in range(src.shape[-1]) if merge[b, h, e] and dst[b, h, e] == c]
                members = [c] + src[b, h, incoming].tolist()
                a = torch.cat([torch.ones(1), weights[b, h, incoming]])
                a = a / a.sum()  # convex coefficients, target weight 1
                torch.testing.assert_close(new_keys[b, h, c], a @ keys[b, h, members])
                torch.testing.assert_close(new_values[b, h, c], a @ values[b, h, members])


@pytest.mark.parametrize("key_rule", ["paper", "projection", "group"])
def test_lemma6_identical_entries_double_votes_and_keep_any_output(key_rule):
    gen = torch.Generator().manual_seed(5)
    keys, values, bias = random_cache(gen)
    # slot 7 becomes a copy of slot 3 in every (row, head), with the same (arbitrary) scores
    keys[:, :, 7], values[:, :, 7] = keys[:, :, 3], values[:, :, 3]
    log_scores = 4 * torch.randn(B, H_KV, S, generator=gen)
    log_scores[:, :, 7] = log_scores[:, :, 3]
    head_log_scores = 4 * torch.randn(B, H_KV, 3, S, generator=gen)
    head_log_scores[..., 7] = head_log_scores[..., 3]
    queries = torch.randn(B, H_KV, *((3,) if key_rule == "group" else ()), D, generator=gen)
    src = torch.full((B, H_KV, 1), 7)
    dst = torch.full((B, H_KV, 1), 3)
    merge = torch.ones(B, H_KV, 1, dtype=torch.bool)

    new_keys, new_values, new_bias = zip_merge(
        keys,
        values,
        bias,
        log_scores,
        src,
        dst,
        merge,
        key_rule=key_rule,
        queries=queries,
        scaling=SCALING,
        group_log_scores=head_log_scores if key_rule == "group" else None,
    )

    torch.testing.assert_close(new_bias[:, :, 3].exp(), bias[:, :, 3].exp() + bias[:, :, 7].exp())
    new_query = torch.randn(B, H_KV, D, generator=gen)
    expected, _ = attention_mass(new_query, keys, values, bias, SCALING)
    actual, _ = attention_mass(new_query, *keep_only(new_keys, new_values, new_bias, src, merge), SCALING)
    assert relative_error(actual, expected) < 1e-5


def opposite_sign_pair(log_p_second):
    """One (row, head): slot 0 has logit +5 (1 vote), slot 1 logit -5 (exp(log_p_second) votes)."""
    gen = torch.Generator().manual_seed(6)
    query = torch.randn(1, 1, D, generator=gen)
    q = query[0, 0]
    unit_step = q / (SCALING * q.dot(q))
    noise = torch.randn(4, D, generator=gen)
    noise = noise - (noise @ q).unsqueeze(-1) * q / q.dot(q)  # orthogonal to q
    keys = noise.clone()
    keys[0] += 5.0 * unit_step
    keys[1] -= 5.0 * unit_step
    keys = keys[None, None]
    values = torch.randn(1, 1, 4, D, generator=gen)
    bias = torch.zeros(1, 1, 4)
    bias[0, 0, 1] = log_p_second
    plan = (torch.tensor([[[1]]]), torch.tensor([[[0]]]), torch.tensor([[[True]]]))
    return query, keys, values, bias, plan


def test_paper_rule_falls_back_when_eq25_denominator_vanishes():
    # w_0 ln s_0 + w_1 ln s_1 = e^5·5 + p_1 e^-5·(-5) = 0 for p_1 = e^10
    query, keys, values, bias, (src, dst, merge) = opposite_sign_pair(10.0)
    log_scores = logits(query, keys)
    torch.testing.assert_close(log_scores[0, 0, :2], torch.tensor([5.0, -5.0]), rtol=0, atol=1e-5)
    w = (bias + log_scores)[0, 0, :2].double().exp()
    mean_logit = (w * log_scores[0, 0, :2].double()).sum() / w.sum()
    target = torch.log(w.sum() / bias[0, 0, :2].double().exp().sum())
    assert abs(target / mean_logit) > 1e3  # raw eq. 25 would scale the key by more than 1000

    new_keys, new_values, new_bias = zip_merge(
        keys, values, bias, log_scores, src, dst, merge, key_rule="paper", queries=query, scaling=SCALING
    )
    assert torch.isfinite(new_keys).all()
    assert logits(query, new_keys)[0, 0, 0].item() == pytest.approx(target.item(), abs=1e-4)
    expected, _ = attention_mass(query, keys, values, bias, SCALING)
    actual, _ = attention_mass(query, *keep_only(new_keys, new_values, new_bias, src, merge), SCALING)
    assert relative_error(actual, expected) < 1e-5
    # the fallback key stays the size of the originals
    assert new_keys[0, 0, 0].norm() < keys[0, 0, :2].norm(dim=-1).max()

    # no query: the fallback is the weighted mean key, still finite
    mean_only, _, _ = zip_merge(keys, values, bias, log_scores, src, dst, merge, key_rule="paper")
    expected_mean = (w.float() @ keys[0, 0, :2]) / w.float().sum()
    torch.testing.assert_close(mean_only[0, 0, 0], expected_mean, rtol=1e-5, atol=1e-5)


def test_paper_rule_falls_back_instead_of_flipping_the_key():
    # equal votes, logits +5 and -5 scaled down: m̄ > 0 > t makes the eq. 25 gain negative
    query, keys, values, bias, (src, dst, merge) = opposite_sign_pair(0.0)
    keys[0, 0, 0] *= 0.3 / 5.0  # logits 0.3 and -0.9 after the next line
    keys[0, 0, 1] *= 0.9 / 5.0
    log_scores = logits(query, keys)
    w = log_scores[0, 0, :2].double().exp()
    mean_logit = (w * log_scores[0, 0, :2].double()).sum() / w.sum()
    target = torch.log(w.sum() / 2)
    assert mean_logit > 0 > target

    new_keys, _, _ = zip_merge(
        keys, values, bias, log_scores, src, dst, merge, key_rule="paper", queries=query, scaling=SCALING
    )
    assert logits(query, new_keys)[0, 0, 0].item() == pytest.approx(target.item(), abs=1e-5)
    mean_key = (w.float() @ keys[0, 0, :2]) / w.float().sum()
    assert torch.dot(new_keys[0, 0, 0], mean_key) > 0  # eq. 25 would give (t / m̄)·k̄, pointing away


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("key_rule", ["paper", "projection", "group"])
def test_low_precision_with_large_logits_stays_finite(dtype, key_rule):
    gen = torch.Generator().manual_seed(7)
    keys, values, bias = random_cache(gen)
    bias = bias + 3 * torch.rand(B, H_KV, S, generator=gen)  # up to ~80 votes
    queries = torch.randn(B, H_KV, *((3,) if key_rule == "group" else ()), D, generator=gen)
    head_log_scores = 30 * (2 * torch.rand(B, H_KV, 3, S, generator=gen) - 1)  # logits in [-30, 30]
    log_scores = head_log_scores[:, :, 0]
    src, dst, merge = make_plan(gen)
    new_keys, new_values, new_bias = zip_merge(
        keys.to(dtype),
        values.to(dtype),
        bias,
        log_scores,
        src,
        dst,
        merge,
        key_rule=key_rule,
        queries=queries.to(dtype),
        scaling=SCALING,
        group_log_scores=head_log_scores if key_rule == "group" else None,
    )
    assert new_keys.dtype == dtype and new_values.dtype == dtype and new_bias.dtype == torch.float32
    for tensor in (new_keys, new_values, new_bias):
        assert torch.isfinite(tensor).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_projection_keeps_theorem3_approximately(dtype):
    """Exact logits of up to ±30: the merge in fp32 then cast back loses only rounding."""
    gen = torch.Generator().manual_seed(8)
    keys, values, bias = random_cache(gen)
    query = torch.randn(B, H_KV, D, generator=gen)
    # scale keys so the logits span about ±30
    keys = keys * (30.0 / logits(query, keys).abs().amax(-1, keepdim=True)).unsqueeze(-1)
    keys, values = keys.to(dtype), values.to(dtype)
    src, dst, merge = make_plan(gen)
    new_keys, new_values, new_bias = zip_merge(
        keys, values, bias, logits(query, keys), src, dst, merge, queries=query.to(dtype), scaling=SCALING
    )
    expected, _ = attention_mass(query, keys, values, bias, SCALING)
    actual, _ = attention_mass(query, *keep_only(new_keys, new_values, new_bias, src, merge), SCALING)
    assert torch.isfinite(actual).all()
    # bf16 keeps 8 mantissa bits: a key of norm ~|logit|·√D/|q| rounds to ~0.1 logit error
    assert relative_error(actual, expected) < (0.05 if dtype == torch.float16 else 0.5)


def test_momentum_merge_matches_sequential_updates():
    gen = torch.Generator().manual_seed(9)
    keys, values, _ = random_cache(gen)
    counts = torch.randint(1, 4, (B, H_KV, S), generator=gen).float()
    src, dst, merge = make_plan(gen)
    merge[0, 0, 0] = False  # a dropped (not merged) eviction

    new_keys, new_values, new_counts = momentum_merge(keys, values, counts, src, dst, merge)

    ref_keys, ref_values, ref_counts = keys.double().clone(), values.double().clone(), counts.double().clone()
    for b in range(B):
        for h in range(H_KV):
            for e in range(src.shape[-1]):
                if merge[b, h, e]:
                    c, x = dst[b, h, e], src[b, h, e]
                    w = ref_counts[b, h, c]
                    ref_keys[b, h, c] = (w * ref_keys[b, h, c] + ref_keys[b, h, x]) / (w + 1)
                    ref_values[b, h, c] = (w * ref_values[b, h, c] + ref_values[b, h, x]) / (w + 1)
                    ref_counts[b, h, c] = w + 1
    torch.testing.assert_close(new_keys.double(), ref_keys, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new_values.double(), ref_values, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new_counts.double(), ref_counts)
    is_target = target_mask(dst, merge)
    for before, after in ((keys, new_keys), (values, new_values), (counts, new_counts)):
        assert_untouched(before, after, is_target)


def test_spread_values_adds_share_to_exactly_the_next_kept():
    gen = torch.Generator().manual_seed(10)
    _, values, _ = random_cache(gen)
    values = values.to(torch.bfloat16)
    m = 3
    src, _, merge = make_plan(gen)
    merge[1, 2, 1] = False  # a dropped eviction spreads nothing
    num_entries = src.shape[-1]
    kept_next_idx = torch.randint(0, S, (B, H_KV, num_entries, m), generator=gen)
    kept_next_idx[0, 1, 2, 1:] = -1  # fewer than m successors
    kept_next_idx[:, :, :, 0] = 5  # many entries spread into one slot

    spread = spread_values(values, src, merge, m, kept_next_idx)

    expected = values.double().clone()
    received = torch.zeros(B, H_KV, S, dtype=torch.bool)
    for b in range(B):
        for h in range(H_KV):
            for e in range(num_entries):
                if merge[b, h, e]:
                    for j in kept_next_idx[b, h, e].tolist():
                        if j >= 0:
                            expected[b, h, j] += values[b, h, src[b, h, e]].double() / m
                            received[b, h, j] = True
    torch.testing.assert_close(spread.double(), expected.to(torch.bfloat16).double(), rtol=1e-2, atol=1e-2)
    assert torch.equal(spread[~received], values[~received])
    assert not torch.equal(spread[received], values[received])


def test_zip_merge_rows_are_independent_and_rows_without_merges_identical():
    gen = torch.Generator().manual_seed(11)
    keys, values, bias = random_cache(gen, torch.bfloat16)
    query = torch.randn(B, H_KV, D, generator=gen)
    log_scores = logits(query, keys)
    src, dst, merge = make_plan(gen)
    full = zip_merge(keys, values, bias, log_scores, src, dst, merge, queries=query, scaling=SCALING)
    partial_merge = merge.clone()
    partial_merge[1] = False  # row 1 merges nothing
    partial_merge[0, 2] = False  # nor does head 2 of row 0
    partial = zip_merge(keys, values, bias, log_scores, src, dst, partial_merge, queries=query, scaling=SCALING)
    for before, merged_all, merged_some in zip((keys, values, bias), full, partial):
        assert torch.equal(merged_some[0, :2], merged_all[0, :2])
        assert torch.equal(merged_some[1], before[1])
        assert torch.equal(merged_some[0, 2], before[0, 2])
    none = zip_merge(keys, values, bias, log_scores, src, dst, torch.zeros_like(merge), key_rule="paper")
    for before, after in zip((keys, values, bias), none):
        assert torch.equal(before, after)


def test_cosine_nearest_matches_brute_force():
    gen = torch.Generator().manual_seed(12)
    keys, _, _ = random_cache(gen)
    src, _, _ = make_plan(gen)
    candidates = torch.rand(B, H_KV, S, generator=gen) < 0.5
    candidates[0, 0] = False
    candidates[0, 0, 4] = True  # a row with a single candidate
    best_idx, best_sim = cosine_nearest(keys, src, candidates)
    # Searching a compact index set that holds every candidate finds the same slots.
    from keepkv.methods.base import slots_of

    sparse = candidates & (torch.arange(S) % 3 == 1)  # row [0, 0] keeps its single candidate, slot 4
    holders = slots_of(sparse, int(sparse.sum(-1).max()))[0]
    assert 2 * holders.shape[-1] < S
    compact_idx, compact_sim = cosine_nearest(keys, src, sparse, holders)
    masked_idx, masked_sim = cosine_nearest(keys, src, sparse)
    assert torch.equal(compact_idx, masked_idx) and torch.allclose(compact_sim, masked_sim)
    assert torch.equal(compact_idx[0, 0], torch.full_like(compact_idx[0, 0], 4))
    for b in range(B):
        for h in range(H_KV):
            for e in range(src.shape[-1]):
                k = keys[b, h, max(int(src[b, h, e]), 0)]
                best, best_j = -math.inf, -1
                for j in range(S):
                    if candidates[b, h, j]:
                        sim = torch.nn.functional.cosine_similarity(k, keys[b, h, j], dim=0).item()
                        if sim > best:
                            best, best_j = sim, j
                assert int(best_idx[b, h, e]) == best_j
                assert best_sim[b, h, e].item() == pytest.approx(best, abs=1e-6)


def test_attention_mass_matches_softmax_for_query_groups():
    gen = torch.Generator().manual_seed(13)
    keys, values, bias = random_cache(gen)
    bias[:, :, -1] = -math.inf  # an empty slot
    queries = torch.randn(B, H_KV, 3, D, generator=gen)
    output, weights = attention_mass(queries, keys, values, bias, SCALING)
    scores = torch.einsum("bhgd,bhsd->bhgs", queries, keys) * SCALING
    probabilities = (scores + bias[:, :, None]).softmax(-1)
    torch.testing.assert_close(output, torch.einsum("bhgs,bhsd->bhgd", probabilities, values))
    assert (probabilities[..., -1] == 0).all()
    torch.testing.assert_close(weights, scores.exp())  # the score s, without the bias


def test_zip_merge_rejects_missing_inputs():
    gen = torch.Generator().manual_seed(14)
    keys, values, bias = random_cache(gen)
    src, dst, merge = make_plan(gen)
    with pytest.raises(ValueError):
        zip_merge(keys, values, bias, bias, src, dst, merge, key_rule="projection")
    with pytest.raises(ValueError):
        zip_merge(keys, values, bias, bias, src, dst, merge, key_rule="bogus")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), key_rule=st.sampled_from(["paper", "projection", "group", "mean"]),
       gate=st.sampled_from([(math.inf, 1.0), (1.0, 1.0), (0.3, 0.6)]))
def test_one_entry_plans_merge_as_the_sorted_plan_does(seed, key_rule, gate):
    """A decode step's plan, one entry per (row, head), takes the unsorted shortcut of the group
    arithmetic; padded with an unmerged entry it takes the general (sorted, scattered) path. Both
    give the same merged rows and gates, bit for bit, merged or not, on every key rule."""
    from keepkv.merging import convex_merge_rows
    from helpers import applied, gate_merges

    generator = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(2, B, H_KV, S, D, generator=generator)
    bias = torch.randn(B, H_KV, S, generator=generator).abs().log1p()
    log_scores = torch.randn(B, H_KV, S, generator=generator) * 3
    group_scores = torch.randn(B, H_KV, 2, S, generator=generator)
    queries = torch.randn(B, H_KV, 2, D, generator=generator)
    src = torch.randint(0, S, (B, H_KV, 1), generator=generator)
    dst = (src + torch.randint(1, S, (B, H_KV, 1), generator=generator)) % S
    merge = torch.rand(B, H_KV, 1, generator=generator) < 0.7

    def padded(x, fill):
        return torch.cat([x, torch.full_like(x, fill)], dim=-1)

    one = (src, dst, merge)
    two = (padded(src, 0), padded(dst, 0), padded(merge, False))
    options = dict(key_rule=key_rule, scaling=SCALING, queries=queries if key_rule == "group" else queries.mean(2),
                   group_log_scores=group_scores if key_rule == "group" else None)
    if key_rule == "mean":
        options.pop("queries"), options.pop("scaling")
    short = zip_merge(keys, values, bias, log_scores, *one, **options)
    full = zip_merge(keys, values, bias, log_scores, *two, **options)
    for a, b in zip(short, full):
        assert torch.equal(a, b)
    gated = gate_merges(values, bias, log_scores, *one, *gate)
    assert torch.equal(gated, gate_merges(values, bias, log_scores, *two, *gate)[..., :1])
    assert torch.equal(gated, merge & gated)
    weights = log_scores.exp()[..., :1]
    convex = applied(convex_merge_rows(keys, values, *one, weights), keys=keys, values=values)
    twice = applied(convex_merge_rows(keys, values, *two, padded(weights, 0.5)), keys=keys, values=values)
    for a, b in zip(convex, twice):
        assert torch.equal(a, b)
