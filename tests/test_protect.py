"""KeepKV's ``protect`` gate (keepkv/kernels/protect.py): the C++ partial selection against the
torch argsort on random shapes, ties (few priority levels, ±0.0), unscored entries (±inf, NaN),
strided views, every share from 0 to 1; which calls it serves; and KeepKV's decode on either
backend. Skipped where no compiler (or ninja) is there."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from keepkv.kernels import protect
from keepkv.kernels.paged_cpp import cpp_available
from keepkv.kernels.protect import open_to_merges, open_to_merges_reference

pytestmark = pytest.mark.skipif(not cpp_available(), reason="no C++ compiler or ninja: the cpp backend cannot build")


def gate_case(batch, kv_heads, size, levels, seed, strided):
    """(kept, priority) [B, H_kv, S]: priorities on ``levels`` levels (ties), some -0.0, +inf (a
    selection's sinks and window), -inf and NaN; the priority a strided view when ``strided``."""
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, kv_heads, size)
    priority = torch.randint(-levels, levels, shape, generator=generator).float() / 7
    draw = torch.rand(shape, generator=generator)
    priority = torch.where(draw < 0.1, -0.0, priority)
    priority = priority.masked_fill((draw >= 0.1) & (draw < 0.2), float("inf"))
    priority = priority.masked_fill((draw >= 0.2) & (draw < 0.23), float("-inf"))
    priority = priority.masked_fill((draw >= 0.23) & (draw < 0.25), float("nan"))
    if strided:  # as a plan's view into a wider tensor: heads and rows not packed
        wide = torch.full((batch, kv_heads + 1, size + 5), 99.0)
        wide[:, :kv_heads, :size] = priority
        priority = wide[:, :kv_heads, :size]
    kept = torch.rand(shape, generator=generator) < 0.7
    return kept, priority


@settings(max_examples=80, deadline=None)
@given(batch=st.integers(1, 3), kv_heads=st.integers(1, 4), size=st.integers(1, 300),
       levels=st.sampled_from([2, 5, 1000]), share=st.one_of(st.sampled_from([0.0, 0.25, 0.75, 1.0]), st.floats(0.0, 1.0)),
       strided=st.booleans(), seed=st.integers(0, 2**16))
def test_the_cpp_gate_is_the_argsorts_mask(batch, kv_heads, size, levels, share, strided, seed):
    kept, priority = gate_case(batch, kv_heads, size, levels, seed, strided)
    got = open_to_merges(kept, priority, share, backend="cpp")
    assert got.dtype == torch.bool and got.shape == kept.shape
    assert torch.equal(got, open_to_merges_reference(kept, priority, share))


def test_the_comparison_fails_on_a_wrong_cut():
    """The check can fail: a share one entry off (on 200 scored entries) gives another mask."""
    kept, priority = gate_case(2, 3, 200, 1000, seed=4, strided=False)
    assert not torch.equal(open_to_merges(kept, priority, 0.75, backend="cpp"),
                           open_to_merges_reference(kept, priority, 0.75 - 1 / 200))


def test_a_row_protects_its_top_share_ties_in_slot_order():
    """By hand: 6 kept entries, one +inf (unscored, open), 5 scored; ceil(0.5 · 5) = 3 protected:
    9.0, then the first two of the three 1.0s (slots 1 and 3); the third 1.0 (slot 5) and -2.0 open."""
    priority = torch.tensor([[[9.0, 1.0, float("inf"), 1.0, -2.0, 1.0, 5.0]]])
    kept = torch.tensor([[[True, True, True, True, True, True, False]]])
    for backend in ("cpp", "torch"):
        got = open_to_merges(kept, priority, 0.5, backend=backend)
        assert got[0, 0].tolist() == [False, False, True, False, True, True, False], backend


def test_auto_takes_cpp_for_fp32_on_cpu_and_torch_elsewhere():
    kept, priority = gate_case(1, 2, 20, 5, seed=1, strided=False)
    assert protect.cpp_takes(kept, priority)
    assert not protect.cpp_takes(kept, priority.double())
    assert not protect.cpp_takes(kept[:, :, :5], priority)
    assert torch.equal(open_to_merges(kept, priority.double(), 0.5), open_to_merges_reference(kept, priority, 0.5))
    with pytest.raises(ValueError, match="backend must be"):
        open_to_merges(kept, priority, 0.5, backend="numba")
    with pytest.raises(ValueError, match="fp32 priority"):
        open_to_merges(kept, priority.double(), 0.5, backend="cpp")


@pytest.mark.parametrize("spec", ["keepkv", "keepkv+interval=8+protect=0.5", "snapkv+merge=zip+protect=0.9"])
@torch.no_grad()
def test_keepkv_decodes_alike_on_either_gate(spec, monkeypatch):
    """A merging method's whole decode over a padded batch, the gate on C++ and on torch: the same
    mask, so the same greedy tokens, logits and stores, bit for bit."""
    from conftest import greedy_decode, tiny_model

    calls = []
    runs = []
    for cpp in (True, False):
        monkeypatch.setattr(protect, "cpp_takes", lambda kept, priority, cpp=cpp: calls.append(cpp) or cpp)
        runs.append(greedy_decode(tiny_model("llama-gqa"), spec, 12, steps=20))
    assert True in calls and False in calls  # the gate ran on each backend
    (logits_cpp, tokens_cpp, cache_cpp), (logits_torch, tokens_torch, cache_torch) = runs
    assert torch.equal(tokens_cpp, tokens_torch)
    assert torch.equal(logits_cpp, logits_torch)
    for a, b in zip(cache_cpp.layers, cache_torch.layers):
        assert torch.equal(a.live(), b.live())
        assert torch.equal(a.keys, b.keys) and torch.equal(a.bias, b.bias)
