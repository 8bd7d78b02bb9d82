"""The merge target search in C++ (keepkv/kernels/nearest.py, the decode-time path of
``keepkv.merging.cosine_nearest``) against the torch code: random shapes and dtypes, rows and heads
that allow no slot, padded evicted slots, head sizes that are not a whole number of vectors, the
narrower builds where the CPU runs them, and which searches it serves. Skipped where no compiler
(or ninja) is there."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from keepkv import merging
from keepkv.kernels import nearest
from keepkv.kernels.nearest import MAX_EVICTED, cpp_takes, nearest_cpp
from keepkv.kernels.paged_cpp import cpp_available, isa

pytestmark = pytest.mark.skipif(not cpp_available(), reason="no C++ compiler or ninja: the cpp backend cannot build")


def torch_nearest(keys, src, allowed, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(nearest, "cpp_takes", lambda keys, src: False)
        return merging.cosine_nearest(keys, src, allowed)


def search_case(batch, kv_heads, size, dim, evicted, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, kv_heads, size + 2, dim, generator=generator).to(dtype)[:, :, :size]  # a view, as a store's
    src = torch.randint(-1, size, (batch, kv_heads, evicted), generator=generator)  # -1: a padded plan slot
    allowed = torch.rand(batch, kv_heads, size, generator=generator) < 0.6
    allowed[0, 0] = False  # a row and head with no candidate
    return keys, src, allowed


def assert_same_targets(got, want, dtype):
    (idx, sim), (want_idx, want_sim) = got, want
    assert idx.dtype == torch.int64 and sim.dtype == torch.float32 and idx.shape == want_idx.shape
    none = torch.isinf(want_sim)
    assert torch.equal(torch.isinf(sim), none)
    # where no slot is allowed both give -inf and slot 0; elsewhere the same slot (random keys: no
    # two candidates within rounding of each other) and its similarity
    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(sim[~none], want_sim[~none], rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 1e-3)


@settings(max_examples=50, deadline=None)
@given(batch=st.integers(1, 3), kv_heads=st.integers(1, 3), size=st.integers(1, 90),
       dim=st.sampled_from([8, 24, 64, 80, 128]), evicted=st.integers(0, MAX_EVICTED),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 2**16))
def test_the_cpp_search_finds_the_torch_codes_targets(batch, kv_heads, size, dim, evicted, dtype, seed):
    keys, src, allowed = search_case(batch, kv_heads, size, dim, evicted, dtype, seed)
    with pytest.MonkeyPatch.context() as monkeypatch:
        want = torch_nearest(keys, src, allowed, monkeypatch)
    assert_same_targets(nearest_cpp(keys, src, allowed), want, dtype)


def test_the_comparison_fails_on_a_wrong_target(monkeypatch):
    """The check can fail: the targets of the wrong evicted entries (each read one slot on) are caught."""
    keys, src, allowed = search_case(2, 2, 40, 64, 8, torch.float32, seed=1)
    want = torch_nearest(keys, src, allowed, monkeypatch)
    with pytest.raises(AssertionError):
        assert_same_targets(nearest_cpp(keys, (src + 1) % 40, allowed), want, torch.float32)


def test_the_first_of_equal_candidates_wins(monkeypatch):
    """Two allowed slots with the same key: both searches name the first."""
    keys = torch.randn(1, 1, 6, 16)
    keys[0, 0, 4] = keys[0, 0, 2]
    src = torch.tensor([[[2, 4]]])
    allowed = torch.ones(1, 1, 6, dtype=torch.bool)
    idx, _ = nearest_cpp(keys, torch.tensor([[[5]]]), allowed)
    want_idx, _ = torch_nearest(keys, torch.tensor([[[5]]]), allowed, monkeypatch)
    assert torch.equal(idx, want_idx)
    idx, sim = nearest_cpp(keys, src, allowed)
    assert torch.equal(idx, torch_nearest(keys, src, allowed, monkeypatch)[0])
    assert idx.tolist() == [[[2, 2]]] and sim[0, 0].tolist() == pytest.approx([1.0, 1.0])


@pytest.mark.parametrize("target", ["avx2", "generic"])
def test_the_narrower_builds_search_alike(target, monkeypatch):
    order = ["generic", "avx2", "avx512"]
    if order.index(target) > order.index(isa()):
        pytest.skip(f"this CPU runs {isa()} at most")
    keys, src, allowed = search_case(3, 2, 50, 80, 16, torch.bfloat16, seed=2)
    want = torch_nearest(keys, src, allowed, monkeypatch)
    monkeypatch.setenv("KEEPKV_CPP_ISA", target)
    assert_same_targets(nearest_cpp(keys, src, allowed), want, torch.bfloat16)


def test_it_serves_a_decode_steps_search_and_leaves_a_prompts_to_torch():
    keys = torch.randn(1, 1, 300, 64)
    assert cpp_takes(keys, torch.zeros(1, 1, MAX_EVICTED, dtype=torch.long))
    assert not cpp_takes(keys, torch.zeros(1, 1, MAX_EVICTED + 1, dtype=torch.long))  # a prompt's end: torch's GEMM
    assert not cpp_takes(keys.double(), torch.zeros(1, 1, 4, dtype=torch.long))
