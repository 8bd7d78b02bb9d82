"""Tests for keepkv.sketch: KVReviver's Vague Part (Count Sketch) and Fisher layer budgets."""

import math

import pytest
import torch

from keepkv.sketch import (
    CountSketch,
    fisher_layer_scores,
    median_rows,
    proportional_budgets,
)

from helpers import buckets_of, signs_of


def _positions(B, H, N, *, gen, span=100_000):
    """Distinct random token positions per (batch row, head): [B, H, N] int64."""
    return torch.stack(
        [torch.randperm(span, generator=gen)[:N] for _ in range(B * H)]
    ).view(B, H, N)


def _copy(sk: CountSketch) -> CountSketch:
    return CountSketch(sk.keys.clone(), sk.values.clone(), sk.seed, sk.sign_keys)


# ------------------------------------------------------------------ statistics


def test_value_estimate_unbiased_and_median_reduces_variance():
    """Lemmas 1-3: the signed single-row value estimate is unbiased, the median of r=3
    rows has smaller variance. Values have mean 1, so an unsigned estimate would be
    biased by ~(N-1)/b ≈ 3.9: the unsigned keys show the test can fail."""
    seeds, N, b, D = 200, 64, 16, 16
    gen = torch.Generator().manual_seed(1234)
    val_err_row, val_err_med, key_err_row = [], [], []
    for seed in range(seeds):
        sk = CountSketch.empty(1, 1, 3, b, D, dtype=torch.float64, seed=seed)
        ids = torch.arange(N).view(1, 1, N) + 1000 * seed
        k = torch.randn(1, 1, N, D, generator=gen, dtype=torch.float64) + 1.0
        v = torch.randn(1, 1, N, D, generator=gen, dtype=torch.float64) + 1.0
        sk.insert(ids, k, v)
        kr, vr = sk.row_estimates(ids[..., :1])  # token 0: [1, 1, 1, r, D]
        _, vq = sk.query(ids[..., :1])
        val_err_row.append(vr[0, 0, 0, 0] - v[0, 0, 0])  # row 0, signed
        key_err_row.append(kr[0, 0, 0, 0] - k[0, 0, 0])
        val_err_med.append(vq[0, 0, 0] - v[0, 0, 0])
    e_row = torch.stack(val_err_row)  # [seeds, D]
    e_med = torch.stack(val_err_med)
    e_key = torch.stack(key_err_row)

    # Unbiasedness: per-seed mean over D is one sample; test the mean over seeds.
    per_seed = e_row.mean(dim=1)
    se = per_seed.std() / math.sqrt(seeds)
    assert abs(per_seed.mean()) < 3 * se, (per_seed.mean(), se)
    # The same test on the unsigned keys must fail: collisions add ~(N-1)/b * 1.
    per_seed_k = e_key.mean(dim=1)
    assert per_seed_k.mean() > 3 * per_seed_k.std() / math.sqrt(seeds)
    assert 2.0 < per_seed_k.mean() < 6.0
    # Single-row error variance ≈ (N-1)/b * Var(v) + (N-1)/b * E[v]^2 = 63/16 * 2 ≈ 7.9.
    var_row = e_row.pow(2).mean()
    assert 5.0 < var_row < 11.0, var_row
    # Lemma 1: the median of 3 rows has lower variance (≤ 3/4 for i.i.d. symmetric).
    var_med = e_med.pow(2).mean()
    assert var_med < var_row
    assert var_med < 0.75 * var_row, (var_med, var_row)


def test_median_rows_matches_torch_median():
    x = torch.randn(4, 5, 3, 7)
    torch.testing.assert_close(median_rows(x), torch.median(x, dim=-2).values, rtol=0, atol=0)
    x4 = torch.tensor([[4.0], [1.0], [3.0], [2.0]])
    assert median_rows(x4).item() == 2.0  # even r: the lower median
    x1 = torch.randn(2, 1, 3)
    assert torch.equal(median_rows(x1), x1[:, 0])


# ------------------------------------------------------------------ exactness


def _collision_free_setup(seed=7, N=32, b=4096, D=8, dtype=torch.float32):
    sk = CountSketch.empty(1, 1, 3, b, D, dtype=dtype, seed=seed)
    ids = torch.arange(N).view(1, 1, N) * 37 + 5
    bk = buckets_of(sk, ids)[0, 0]  # [N, r]
    for j in range(sk.rows):
        assert bk[:, j].unique().numel() == N, "test setup: pick another seed"
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, 1, N, D, generator=gen, dtype=dtype)
    v = torch.randn(1, 1, N, D, generator=gen, dtype=dtype)
    return sk, ids, k, v


@pytest.mark.parametrize("sign_keys", [False, True])
def test_query_exact_without_collisions(sign_keys):
    sk, ids, k, v = _collision_free_setup()
    sk.sign_keys = sign_keys
    sk.insert(ids, k, v)
    qk, qv = sk.query(ids)
    assert torch.equal(qk, k)
    assert torch.equal(qv, v)
    # Keys are stored unsigned (paper), values signed.
    g = signs_of(sk, ids)[0, 0]  # [N, r]
    bk = buckets_of(sk, ids)[0, 0]
    slot_v = sk.values[0, 0, 0, bk[:, 0]]
    slot_k = sk.keys[0, 0, 0, bk[:, 0]]
    assert torch.equal(slot_v, v[0, 0] * g[:, :1])
    assert torch.equal(slot_k, k[0, 0] * g[:, :1] if sign_keys else k[0, 0])
    # Every other slot is untouched (zero).
    assert int((sk.values.abs().sum(-1) != 0).sum()) == 3 * ids.shape[-1]


def test_delete_after_query_restores_sketch():
    sk, ids, k, v = _collision_free_setup()
    N = ids.shape[-1]
    t = 11
    without = torch.ones(1, 1, N, dtype=torch.bool)
    without[..., t] = False
    ref = CountSketch.empty(1, 1, 3, sk.buckets, sk.head_dim, dtype=sk.keys.dtype, seed=sk.seed)
    ref.insert(ids, k, v, mask=without)
    sk.insert(ids, k, v)
    assert not torch.equal(sk.values, ref.values)
    qk, qv = sk.query(ids[..., t : t + 1])
    sk.delete(ids[..., t : t + 1], qk, qv)
    assert torch.equal(sk.keys, ref.keys)
    assert torch.equal(sk.values, ref.values)


def test_masked_delete_of_the_estimates_deletes_only_selected():
    sk, ids, k, v = _collision_free_setup()
    sk.insert(ids, k, v)
    before = _copy(sk)
    sel = torch.zeros(1, 1, 4, dtype=torch.bool)
    sel[..., 1] = True
    qk, qv = sk.query(ids[..., :4])  # Algorithm 3: query, then delete the estimate
    sk.delete(ids[..., :4], qk, qv, sel)
    assert torch.equal(qk, k[..., :4, :]) and torch.equal(qv, v[..., :4, :])
    before.delete(ids[..., 1:2], k[..., 1:2, :], v[..., 1:2, :])
    assert torch.equal(sk.keys, before.keys) and torch.equal(sk.values, before.values)


def test_delete_inverts_insert_with_collisions():
    gen = torch.Generator().manual_seed(3)
    sk = CountSketch.empty(2, 2, 3, 4, 6, dtype=torch.float64, seed=9)
    ids = _positions(2, 2, 50, gen=gen)
    k = torch.randn(2, 2, 50, 6, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 2, 50, 6, generator=gen, dtype=torch.float64)
    sk.insert(ids, k, v)
    assert sk.values.abs().sum() > 0
    sk.delete(ids, k, v)
    torch.testing.assert_close(sk.keys, torch.zeros_like(sk.keys), rtol=0, atol=1e-12)
    torch.testing.assert_close(sk.values, torch.zeros_like(sk.values), rtol=0, atol=1e-12)


def test_mask_ignores_nonfinite_padding():
    sk = CountSketch.empty(1, 1, 3, 8, 4, dtype=torch.float32)
    ids = torch.arange(3).view(1, 1, 3)
    k = torch.randn(1, 1, 3, 4)
    v = torch.randn(1, 1, 3, 4)
    k[..., 2, :] = float("nan")
    v[..., 2, :] = float("inf")
    mask = torch.tensor([[[True, True, False]]])
    sk.insert(ids, k, v, mask=mask)
    assert torch.isfinite(sk.keys).all() and torch.isfinite(sk.values).all()
    ref = CountSketch.empty(1, 1, 3, 8, 4, dtype=torch.float32)
    ref.insert(ids[..., :2], k[..., :2, :], v[..., :2, :])
    assert torch.equal(sk.keys, ref.keys) and torch.equal(sk.values, ref.values)


# ------------------------------------------------------------------ batching


def test_batched_equals_per_row_head():
    B, H, N, r, b, D = 2, 3, 40, 3, 8, 5
    gen = torch.Generator().manual_seed(11)
    ids = _positions(B, H, N, gen=gen)
    k = torch.randn(B, H, N, D, generator=gen)
    v = torch.randn(B, H, N, D, generator=gen)
    mask = torch.rand(B, H, N, generator=gen) < 0.7
    sk = CountSketch.empty(B, H, r, b, D, dtype=torch.float32, seed=5)
    sk.insert(ids, k, v, mask=mask)
    q_ids = ids[..., ::3]
    qk, qv = sk.query(q_ids)
    for bi in range(B):
        for h in range(H):
            one = CountSketch.empty(1, 1, r, b, D, dtype=torch.float32, seed=5)
            sl = (slice(bi, bi + 1), slice(h, h + 1))
            one.insert(ids[sl], k[sl], v[sl], mask=mask[sl])
            torch.testing.assert_close(one.keys[0, 0], sk.keys[bi, h], rtol=0, atol=1e-6)
            torch.testing.assert_close(one.values[0, 0], sk.values[bi, h], rtol=0, atol=1e-6)
            ok, ov = one.query(q_ids[sl])
            torch.testing.assert_close(ok[0, 0], qk[bi, h], rtol=0, atol=1e-6)
            torch.testing.assert_close(ov[0, 0], qv[bi, h], rtol=0, atol=1e-6)


def test_token_ids_broadcast_over_heads():
    B, H, N, D = 2, 3, 10, 4
    gen = torch.Generator().manual_seed(2)
    ids = _positions(B, 1, N, gen=gen)
    k = torch.randn(B, H, N, D, generator=gen)
    v = torch.randn(B, H, N, D, generator=gen)
    a = CountSketch.empty(B, H, 3, 8, D)
    c = CountSketch.empty(B, H, 3, 8, D)
    a.insert(ids, k, v)
    c.insert(ids.expand(B, H, N), k, v)
    assert torch.equal(a.keys, c.keys) and torch.equal(a.values, c.values)


# ------------------------------------------------------------------ hashing


def test_hash_deterministic_and_seeded():
    ids = torch.arange(2000).view(1, 1, -1)
    a = CountSketch.empty(1, 1, 3, 64, 4, seed=42)
    a2 = CountSketch.empty(2, 5, 3, 64, 8, seed=42)
    c = CountSketch.empty(1, 1, 3, 64, 4, seed=43)
    assert torch.equal(buckets_of(a, ids), buckets_of(a2, ids))
    assert torch.equal(signs_of(a, ids), signs_of(a2, ids))
    assert torch.equal(buckets_of(a, ids), buckets_of(a, ids.clone()))
    assert (buckets_of(a, ids) != buckets_of(c, ids)).float().mean() > 0.9
    assert (signs_of(a, ids) != signs_of(c, ids)).float().mean() > 0.4
    # Pinned values: the hash is part of the on-disk/cross-run contract.
    assert buckets_of(a, torch.tensor([0, 1, 123456789]))[:, 0].tolist() == _PINNED_BUCKETS
    # Large and negative positions hash fine and stay in range.
    big = torch.tensor([2**40 + 3, -7, 2**62])
    bb = buckets_of(a, big)
    assert ((bb >= 0) & (bb < 64)).all()
    assert set(signs_of(a, big).unique().tolist()) <= {-1.0, 1.0}


_PINNED_BUCKETS = [4, 27, 47]  # seed 42, b = 64, row 0, positions 0, 1, 123456789


def test_hash_quality():
    sk = CountSketch.empty(1, 1, 4, 16, 2, seed=0)
    ids = torch.arange(16_000)
    bk = buckets_of(sk, ids)  # [n, r]
    g = signs_of(sk, ids)
    assert bk.shape == (16_000, 4) and g.shape == (16_000, 4)
    assert bk.min() >= 0 and bk.max() < 16
    # Bucket occupancy ≈ uniform (expected 1000 per bucket, sd ≈ 31).
    for j in range(4):
        counts = torch.bincount(bk[:, j], minlength=16)
        assert (counts - 1000).abs().max() < 160, counts
    # Signs balanced, independent of buckets, and rows independent of each other.
    assert abs(g.mean()) < 0.03
    assert (bk[:, 0] == bk[:, 1]).float().mean() < 1 / 16 + 0.02
    assert abs((g[:, 0] * g[:, 1]).mean()) < 0.03
    assert abs((g[:, 0] * (bk[:, 0] % 2 * 2 - 1)).mean()) < 0.03
    # Consecutive tokens do not land in consecutive buckets.
    assert ((bk[1:, 0] - bk[:-1, 0]) % 16 == 1).float().mean() < 0.1


# ------------------------------------------------------------------ memory


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nbytes_fixed(dtype):
    B, H, r, b, D = 2, 3, 3, 10, 8
    sk = CountSketch.empty(B, H, r, b, D, dtype=dtype)
    expected = r * b * D * 2 * B * H * torch.empty((), dtype=dtype).element_size()
    assert sk.nbytes() == expected
    gen = torch.Generator().manual_seed(0)
    for n in (5, 500):
        ids = _positions(B, H, n, gen=gen)
        sk.insert(ids, torch.randn(B, H, n, D).to(dtype), torch.randn(B, H, n, D).to(dtype))
        assert sk.nbytes() == expected
        assert sk.keys.shape == (B, H, r, b, D)


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize("rows,buckets", [(0, 4), (3, 0), (-1, 4), (3, -2)])
def test_empty_rejects_bad_sizes(rows, buckets):
    with pytest.raises(ValueError, match=">= 1"):
        CountSketch.empty(1, 1, rows, buckets, 4, dtype=torch.float32)


def test_constructor_and_call_validation():
    with pytest.raises(ValueError, match="rows"):
        CountSketch(torch.zeros(1, 1, 0, 4, 2), torch.zeros(1, 1, 0, 4, 2))
    with pytest.raises(ValueError, match="shape"):
        CountSketch(torch.zeros(1, 3, 4, 2), torch.zeros(1, 3, 4, 2))
    with pytest.raises(ValueError):
        CountSketch(torch.zeros(1, 1, 3, 4, 2), torch.zeros(1, 1, 3, 5, 2))
    sk = CountSketch.empty(2, 2, 3, 4, 2)
    with pytest.raises(ValueError):
        sk.insert(torch.zeros(2, 2, 3, dtype=torch.long), torch.zeros(2, 2, 3, 5), torch.zeros(2, 2, 3, 5))
    with pytest.raises(ValueError):
        sk.insert(torch.zeros(2, 2, 4, dtype=torch.long), torch.zeros(2, 2, 3, 2), torch.zeros(2, 2, 3, 2))
    with pytest.raises(ValueError):
        sk.query(torch.zeros(3, 2, 4, dtype=torch.long))


# ------------------------------------------------------------------ Fisher budgets


def _layers(scales, out=12, inp=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ks = [s * torch.randn(out, inp, generator=gen) for s in scales]
    vs = [s * torch.randn(out, inp, generator=gen) for s in scales]
    return ks, vs


def test_fisher_budgets_sum_min_and_order():
    scales = [1.0, 3.0, 1e-3, 0.5, 2.0]
    ks, vs = _layers(scales)
    scores = fisher_layer_scores(ks, vs)
    for total, mn in [(100, 1), (37, 4), (5, 1), (1000, 0), (20, 4)]:
        out = proportional_budgets(scores, torch.tensor([total]), mn)[:, 0].tolist()
        assert sum(out) == total
        assert all(x >= mn for x in out)
        # Larger weights never get less than smaller ones.
        order = sorted(range(len(scales)), key=lambda i: scales[i])
        assert all(out[order[i]] <= out[order[i + 1]] for i in range(len(order) - 1)), out
    out = proportional_budgets(scores, torch.tensor([100]), 2)[:, 0].tolist()
    assert out[2] == 2  # tiny weights → pinned at the minimum
    assert out[1] > out[0]
    # Proportional to ||W_k||_F^2 + ||W_v||_F^2 (largest-remainder rounding).
    scores = fisher_layer_scores(ks, vs)
    expected = [(k.double().pow(2).sum() + v.double().pow(2).sum()).item() for k, v in zip(ks, vs)]
    torch.testing.assert_close(scores, torch.tensor(expected, dtype=torch.float64))
    out = proportional_budgets(scores, torch.tensor([1000]), 0)[:, 0].tolist()
    share = scores / scores.sum() * 1000
    assert all(abs(o - s) < 1.0 for o, s in zip(out, share.tolist()))


def test_fisher_budgets_with_supplied_fisher():
    ks, vs = _layers([1.0, 1.0, 1.0])
    kf = [torch.full((12, 16), 1.0), torch.full((12, 16), 3.0), torch.full((12, 16), 0.0)]
    vf = [torch.full((12, 16), 1.0), torch.full((12, 16), 3.0), torch.full((12, 16), 0.0)]
    scores = fisher_layer_scores(ks, vs, k_fisher=kf, v_fisher=vf)
    assert proportional_budgets(scores, torch.tensor([40]), 0)[:, 0].tolist() == [10, 30, 0]
    assert proportional_budgets(scores, torch.tensor([40]), 2)[:, 0].tolist() == [9, 29, 2]  # 9.5 : 28.5, tie → larger score
    with pytest.raises(ValueError):
        fisher_layer_scores(ks, vs, k_fisher=kf)


def test_proportional_budgets_edges():
    def budgets(scores, total, minimum):
        return proportional_budgets(torch.tensor(scores, dtype=torch.float64), torch.tensor([total]), minimum)[:, 0].tolist()

    assert budgets([0.0, 0.0, 0.0], 10, 1) == [4, 3, 3]
    assert budgets([1.0, 1.0], 7, 3) == [4, 3]
    assert budgets([5.0], 9, 1) == [9]
    assert budgets([1.0, 2.0, 3.0, 4.0], 4, 1) == [1, 1, 1, 1]
    big = budgets(torch.rand(30, generator=torch.Generator().manual_seed(1)).tolist(), 123_457, 10)
    assert sum(big) == 123_457 and min(big) >= 10
    with pytest.raises(ValueError):
        fisher_layer_scores([torch.ones(2, 2)], [])


# ------------------------------------------------------------------ devices


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_cpu(dtype):
    B, H, N, D = 2, 3, 64, 16
    gen = torch.Generator().manual_seed(4)
    ids = _positions(B, H, N, gen=gen)
    k = torch.randn(B, H, N, D, generator=gen).to(dtype)
    v = torch.randn(B, H, N, D, generator=gen).to(dtype)
    cpu = CountSketch.empty(B, H, 3, 16, D, dtype=torch.float32, seed=3)
    gpu = CountSketch.empty(B, H, 3, 16, D, dtype=torch.float32, device="cuda", seed=3)
    assert torch.equal(buckets_of(cpu, ids), buckets_of(gpu, ids.cuda()).cpu())
    assert torch.equal(signs_of(cpu, ids), signs_of(gpu, ids.cuda()).cpu())
    cpu.insert(ids, k, v)
    gpu.insert(ids.cuda(), k.cuda(), v.cuda())
    torch.testing.assert_close(gpu.values.cpu(), cpu.values, rtol=1e-5, atol=1e-5)
    qk_c, qv_c = cpu.query(ids)
    qk_g, qv_g = gpu.query(ids.cuda())
    torch.testing.assert_close(qk_g.cpu(), qk_c, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(qv_g.cpu(), qv_c, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sign_keys", [False, True])
def test_a_position_bound_reads_the_same_hashes_from_the_table(sign_keys):
    """insert/delete with ``limit`` (positions below it, or masked out) take their hashes from the
    position table: the sketch ends bit-identical to the one hashed position by position."""
    gen = torch.Generator().manual_seed(7)
    B, H, N, D, limit = 2, 3, 40, 8, 3000
    hashed = CountSketch.empty(B, H, 3, 16, D, seed=11, sign_keys=sign_keys)
    tabled = _copy(hashed)
    for step in range(3):
        pos = _positions(B, H, N, gen=gen, span=limit)
        pos[0, 0, :5] = -1  # empty slots, masked
        keys, values = torch.randn(2, B, H, N, D, generator=gen)
        mask = (torch.rand(B, H, N, generator=gen) < 0.8) & (pos >= 0)
        update = "delete" if step == 2 else "insert"
        getattr(hashed, update)(pos, keys, values, mask=mask)
        getattr(tabled, update)(pos, keys, values, mask=mask, limit=limit)
        assert torch.equal(hashed.keys, tabled.keys) and torch.equal(hashed.values, tabled.values)
    assert hashed.keys.abs().sum() > 0
