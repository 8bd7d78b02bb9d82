"""The kept queries' masked softmax (keepkv/kernels/kept.py): the C++ pass against the torch
reference on random shapes (padding rows, entries no row sees, empty slots, positions out of
slot order, a strided bias, positions past 2^24), a row by hand, its narrower builds, and the
dispatch. Skipped where no compiler (or ninja) is there."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from keepkv.kernels import kept
from keepkv.kernels.kept import kept_softmax, kept_softmax_reference
from keepkv.kernels.paged_cpp import cpp_available, isa

pytestmark = pytest.mark.skipif(not cpp_available(), reason="no C++ compiler or ninja: the cpp backend cannot build")

NEG_INF = float("-inf")


def softmax_case(batch, kv_heads, group, rows, size, seed, offset=0, spare=2):
    """Logits, a bias (merged entries' votes, -inf on empty slots) as a view of a wider buffer,
    positions shuffled (a compression moves entries into emptied slots) with -1 on some, and
    query rows at consecutive positions with a padding row (-1) in the first request; every
    position shifted by ``offset``."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, kv_heads, group, rows, size, generator=generator) * 4
    buffer = torch.randn(batch, kv_heads, size + spare, generator=generator).clamp(max=0) * 3
    buffer = buffer.masked_fill(torch.rand(buffer.shape, generator=generator) < 0.4, 0.0)
    buffer = buffer.masked_fill(torch.rand(buffer.shape, generator=generator) < 0.15, NEG_INF)
    bias = buffer[:, :, :size]
    positions = torch.stack([torch.randperm(size, generator=generator) for _ in range(batch * kv_heads)])
    positions = positions.view(batch, kv_heads, size) + offset
    positions = positions.masked_fill(torch.rand(positions.shape, generator=generator) < 0.1, -1)
    start = torch.randint(0, size, (batch, 1), generator=generator)
    query_pos = start + offset + torch.arange(rows)
    query_pos[0, 0] = -1  # padding: sees nothing
    return logits, bias, positions, query_pos


def assert_softmaxes_agree(probs, want):
    assert probs.shape == want.shape and probs.dtype == torch.float32
    assert torch.equal(probs == 0, want == 0), "the same entries are unseen"
    torch.testing.assert_close(probs, want, rtol=1e-5, atol=1e-7)


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 3), kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 3, 8]),
       rows=st.integers(1, 17), size=st.integers(1, 70), far=st.booleans(), seed=st.integers(0, 2**16))
def test_the_cpp_softmax_matches_the_reference(batch, kv_heads, group, rows, size, far, seed):
    logits, bias, positions, query_pos = softmax_case(batch, kv_heads, group, rows, size, seed,
                                                      offset=(1 << 24) - size // 2 if far else 0)
    want = kept_softmax_reference(logits, bias, positions, query_pos)
    assert_softmaxes_agree(kept_softmax(logits, bias, positions, query_pos, backend="cpp"), want)


def test_the_comparison_fails_on_a_wrong_softmax():
    """The check above can fail: a softmax that lets each row see every entry, or one without the
    bias, is caught."""
    logits, bias, positions, query_pos = softmax_case(2, 3, 3, 16, 40, seed=1)
    want = kept_softmax_reference(logits, bias, positions, query_pos)
    everything = torch.full_like(query_pos, 1 << 40)
    with pytest.raises(AssertionError):
        assert_softmaxes_agree(kept_softmax(logits, bias, positions, everything, backend="cpp"), want)
    with pytest.raises(AssertionError):
        assert_softmaxes_agree(kept_softmax(logits, bias.clamp(min=-1.0), positions, query_pos, backend="cpp"), want)


def test_a_row_is_the_softmax_by_hand():
    """Three entries, one query head, two rows: the first (position 5) sees the entries at 4 and 5
    (one with a vote of ln 2), the second (padding) none."""
    logits = torch.tensor([[[[[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]]]])  # [1, 1, 1, 2, 3]
    bias = torch.tensor([[[math.log(2.0), 0.0, 0.0]]])
    positions = torch.tensor([[[4, 5, 6]]])
    query_pos = torch.tensor([[5, -1]])
    weights = [2 * math.e, math.e**2]
    total = sum(weights)
    for backend in ("cpp", "torch"):
        probs = kept_softmax(logits, bias, positions, query_pos, backend=backend)
        assert probs[0, 0, 0, 0].tolist() == pytest.approx([weights[0] / total, weights[1] / total, 0.0], rel=1e-6)
        assert probs[0, 0, 0, 1].tolist() == [0.0, 0.0, 0.0], backend


@pytest.mark.parametrize("target", ["avx2", "generic"])
def test_the_narrower_builds_agree(target, monkeypatch):
    order = ["generic", "avx2", "avx512"]
    if order.index(target) > order.index(isa()):
        pytest.skip(f"this CPU runs {isa()} at most")
    monkeypatch.setenv("KEEPKV_CPP_ISA", target)
    logits, bias, positions, query_pos = softmax_case(3, 2, 3, 16, 45, seed=2)
    want = kept_softmax_reference(logits, bias, positions, query_pos)
    assert_softmaxes_agree(kept_softmax(logits, bias, positions, query_pos, backend="cpp"), want)


def test_auto_takes_cpp_for_fp32_on_cpu_and_torch_elsewhere():
    logits, bias, positions, query_pos = softmax_case(1, 2, 3, 4, 9, seed=3)
    assert kept.cpp_takes(logits, bias)
    assert not kept.cpp_takes(logits.double(), bias)
    assert not kept.cpp_takes(logits, bias.double())
    with pytest.raises(ValueError, match="backend must be"):
        kept_softmax(logits, bias, positions, query_pos, backend="numba")
    with pytest.raises(ValueError, match=r"query_pos \[B, N\]"):
        kept_softmax(logits, bias, positions, query_pos[:, :2], backend="cpp")
