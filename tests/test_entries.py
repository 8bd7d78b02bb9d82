"""keepkv.entries against torch.gather / scatter_ / scatter_add with an expanded index, on every
layout a layer's tensors take: contiguous, a buffer's leading slots (spare slots after), several
trailing feature axes, a permuted view (the EMA's [B, H_kv, S, g] of a [B, H_kv, g, S] tensor),
and one with no feature axis."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from keepkv.entries import _rows, add_entries, gather_entries, write_entries_

LAYOUTS = ("contiguous", "buffer", "two_features", "permuted", "no_features", "batch_sliced")


def make(layout: str, batch: int, kv_heads: int, slots: int, dim: int, generator) -> torch.Tensor:
    """A [B, H_kv, S, *F] tensor in ``layout``."""
    if layout == "contiguous":
        return torch.randn(batch, kv_heads, slots, dim, generator=generator)
    if layout == "buffer":  # a store's tensor: the leading slots of a longer buffer
        return torch.randn(batch, kv_heads, slots + 5, dim, generator=generator).narrow(2, 0, slots)
    if layout == "two_features":
        return torch.randn(batch, kv_heads, slots + 2, 2, dim, generator=generator).narrow(2, 0, slots)
    if layout == "permuted":  # features before slots in memory: not rows of its memory
        return torch.randn(batch, kv_heads, dim, slots, generator=generator).permute(0, 1, 3, 2)
    if layout == "batch_sliced":  # every other row of a batch
        return torch.randn(2 * batch, kv_heads, slots, dim, generator=generator)[::2]
    return torch.randn(batch, kv_heads, slots, generator=generator)


def expanded(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return index.view(*index.shape, *(1,) * (like.dim() - 3)).expand(*index.shape, *like.shape[3:])


@settings(max_examples=60, deadline=None)
@given(layout=st.sampled_from(LAYOUTS), batch=st.integers(1, 3), kv_heads=st.integers(1, 3),
       slots=st.integers(1, 9), dim=st.integers(1, 5), count=st.integers(0, 9), seed=st.integers(0, 2**16))
def test_entries_equal_torch_gather_and_scatter(layout, batch, kv_heads, slots, dim, count, seed):
    generator = torch.Generator().manual_seed(seed)
    x = make(layout, batch, kv_heads, slots, dim, generator)
    # distinct slots per row and head for the write (as a store's writes), any slots for the rest
    index = torch.rand(batch, kv_heads, slots, generator=generator).argsort(-1)[..., : min(count, slots)]
    repeated = torch.randint(0, slots, (batch, kv_heads, count), generator=generator)

    assert torch.equal(gather_entries(x, repeated), x.gather(2, expanded(repeated, x)))

    entries = torch.randn(*index.shape, *x.shape[3:], generator=generator)
    reference = x.clone().scatter_(2, expanded(index, x), entries)
    written = x.clone() if layout != "buffer" else x  # a buffer's view: written in place, spare slots untouched
    spare = written.as_strided((written.untyped_storage().nbytes() // 4,), (1,), 0).clone()
    assert write_entries_(written, index, entries) is written
    assert torch.equal(written, reference)
    if layout == "buffer":  # nothing outside the view moved
        after = written.as_strided(spare.shape, (1,), 0)
        inside = torch.zeros_like(spare, dtype=torch.bool)
        inside.as_strided(written.shape, written.stride(), 0).fill_(True)
        assert torch.equal(after[~inside], spare[~inside])

    incoming = torch.randn(*repeated.shape, *x.shape[3:], generator=generator)
    added = add_entries(x, repeated, incoming)
    assert torch.allclose(added, x.scatter_add(2, expanded(repeated, x), incoming), atol=1e-6)
    assert added.data_ptr() != x.data_ptr()


def test_rows_refuse_layouts_whose_entries_are_not_rows():
    """The fallbacks are taken where they must be: features not contiguous, or (row, head) pairs whose
    slots would overlap as rows."""
    index = torch.zeros(2, 3, 1, dtype=torch.long)
    assert _rows(torch.randn(2, 3, 5, 4), index) is not None
    assert _rows(torch.randn(2, 3, 4, 5).permute(0, 1, 3, 2), index) is None
    assert _rows(torch.randn(1, 1, 5, 4).expand(2, 3, 5, 4), index) is None  # every (row, head) on the same memory
    assert _rows(torch.randn(2, 3, 5, 4, 2)[..., 0], index) is None  # features two words apart
