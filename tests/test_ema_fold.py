"""KeepKV's EMA fold (keepkv/kernels/ema.py): the C++ pass against the torch reference, on random
shapes (pooled and per head, one row and many, padding rows, entries no row sees, empty slots,
the store's strided EMA view), its narrower builds where the CPU runs them, and KeepKV's decode on
either backend. Skipped where no compiler (or ninja) is there."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from keepkv.kernels import ema
from keepkv.kernels.ema import ema_fold, ema_fold_reference
from keepkv.kernels.paged_cpp import cpp_available, isa

pytestmark = pytest.mark.skipif(not cpp_available(), reason="no C++ compiler or ninja: the cpp backend cannot build")

NEG_INF = float("-inf")


def fold_case(batch, kv_heads, group, rows, size, pool, seed, spare=3):
    """Scores with -inf columns (empty slots), an EMA state as the store holds it (a view into a
    buffer with ``spare`` slots more, some -inf: never scored), positions with -1 (empty), query
    rows at consecutive positions with a padding row (-1) in the first request."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, kv_heads, group, rows, size, generator=generator) * 4
    empty = torch.rand(batch, kv_heads, size, generator=generator) < 0.2
    scores = scores.masked_fill(empty[:, :, None, None], NEG_INF)
    words = 1 if pool or group == 1 else group
    buffer = torch.randn(batch, kv_heads, size + spare, words, generator=generator) - 3
    buffer = buffer.masked_fill(torch.rand(buffer.shape, generator=generator) < 0.2, NEG_INF)
    old = buffer[:, :, :size]  # the store's [B, H_kv, S, g'] view: not contiguous
    positions = torch.randint(-1, size + rows, (batch, kv_heads, size), generator=generator)
    start = torch.randint(0, size, (batch, 1), generator=generator)
    query_pos = start + torch.arange(rows)
    query_pos[0, 0] = -1  # padding: sees nothing
    return scores, old, positions, query_pos


def assert_folds_agree(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype == torch.float32
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)), "the same entries are -inf"
    assert torch.equal(got[~finite], want[~finite])
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 3), kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 3, 8]),
       rows=st.integers(1, 17), size=st.integers(1, 70), pool=st.booleans(), causal=st.booleans(),
       alpha=st.floats(0.05, 0.99), seed=st.integers(0, 2**16))
def test_the_cpp_fold_matches_the_reference(batch, kv_heads, group, rows, size, pool, causal, alpha, seed):
    scores, old, positions, query_pos = fold_case(batch, kv_heads, group, rows, size, pool, seed)
    positions = positions if causal else None
    want = ema_fold(scores, old, positions, query_pos, alpha, pool, backend="torch")
    got = ema_fold(scores, old, positions, query_pos, alpha, pool, backend="cpp")
    assert_folds_agree(got, want)


def test_the_comparison_fails_on_a_wrong_fold():
    """The check above can fail: a fold with the wrong decay, or one that reads every row as seeing
    every entry, is caught."""
    scores, old, positions, query_pos = fold_case(2, 3, 3, 16, 40, True, seed=1)
    want = ema_fold(scores, old, positions, query_pos, 0.94, True, backend="torch")
    with pytest.raises(AssertionError):
        assert_folds_agree(ema_fold(scores, old, positions, query_pos, 0.9, True, backend="cpp"), want)
    with pytest.raises(AssertionError):
        assert_folds_agree(ema_fold(scores, old, None, query_pos, 0.94, True, backend="cpp"), want)


def test_a_row_folds_as_the_equation_says():
    """One entry, two query heads (pooled), two rows of which the second alone sees it: ln S after is
    ln(α² S + (1 - α)(s_0 + s_1)/2) with the newest row's scores, against eq. 8 by hand."""
    alpha = 0.9
    scores = torch.tensor([[[[[math.log(2.0)], [math.log(6.0)]], [[math.log(4.0)], [math.log(10.0)]]]]])  # [1,1,2,2,1]
    old = torch.tensor([[[[math.log(3.0)]]]])
    positions = torch.tensor([[[7]]])
    query_pos = torch.tensor([[6, 7]])  # row 0 (position 6) does not see the entry at 7
    want = math.log(alpha**2 * 3.0 + (1 - alpha) * (6.0 + 10.0) / 2)
    for backend in ("torch", "cpp"):
        got = ema_fold(scores, old, positions, query_pos, alpha, True, backend=backend)
        assert got.shape == (1, 1, 1, 1)
        assert got.item() == pytest.approx(want, rel=1e-6), backend


@pytest.mark.parametrize("target", ["avx2", "generic"])
def test_the_narrower_builds_fold_alike(target, monkeypatch):
    order = ["generic", "avx2", "avx512"]
    if order.index(target) > order.index(isa()):
        pytest.skip(f"this CPU runs {isa()} at most")
    monkeypatch.setenv("KEEPKV_CPP_ISA", target)
    scores, old, positions, query_pos = fold_case(3, 2, 3, 16, 45, True, seed=2)
    want = ema_fold_reference(scores, old, positions, query_pos, 0.94, True)
    assert_folds_agree(ema_fold(scores, old, positions, query_pos, 0.94, True, backend="cpp"), want)


def test_auto_takes_cpp_for_fp32_on_cpu_and_torch_elsewhere(monkeypatch):
    scores, old, positions, query_pos = fold_case(1, 1, 3, 4, 9, True, seed=3)
    assert ema._cpp_takes(scores, old)
    assert not ema._cpp_takes(scores.double(), old)
    with pytest.raises(ValueError, match="backend must be"):
        ema_fold(scores, old, positions, query_pos, 0.94, True, backend="numba")
    with pytest.raises(ValueError, match=r"\[B, H_kv, S, 1\]"):
        ema_fold(scores, old[..., :0], positions, query_pos, 0.94, True, backend="cpp")


@pytest.mark.parametrize("spec", ["keepkv", "keepkv+score_norm=row", "keepkv+zip_key=group", "keepkv+interval=8"])
@torch.no_grad()
def test_keepkv_decodes_alike_on_either_fold(spec, monkeypatch):
    """KeepKV's whole decode (every step's fold, ranking and merges) over a padded batch, on the C++
    fold and on the torch one: the same greedy tokens, logits within fp32 rounding, and the EMA
    states alike."""
    from conftest import greedy_decode, tiny_model

    runs = []
    for cpp in (True, False):
        monkeypatch.setattr(ema, "_cpp_takes", lambda scores, old, cpp=cpp: cpp)
        runs.append(greedy_decode(tiny_model("llama-gqa"), spec, 12, steps=20))
    (logits_cpp, tokens_cpp, cache_cpp), (logits_torch, tokens_torch, cache_torch) = runs
    assert torch.equal(tokens_cpp, tokens_torch)
    torch.testing.assert_close(logits_cpp, logits_torch, rtol=1e-4, atol=1e-4)
    for a, b in zip(cache_cpp.layers, cache_torch.layers):
        live = a.live()
        assert torch.equal(live, b.live())
        ema_a, ema_b = a.extras["ema_log_s"][live], b.extras["ema_log_s"][live]
        assert torch.equal(torch.isfinite(ema_a), torch.isfinite(ema_b))
        torch.testing.assert_close(ema_a[torch.isfinite(ema_a)], ema_b[torch.isfinite(ema_b)], rtol=1e-4, atol=1e-4)
