"""The attention path's CUDA logic, checked where it runs on a CPU: a padded prefill never pairs a
mask with ``enable_gqa``, the keys are converted to fp32 once per attention call, not per row
chunk, half-precision logits come from one fp32-output GEMM where the device has one (the CUDA case
runs in the CUDA suite), a decode step's SDPA mask is [B, H_kv, 1, S], never the dense
[B, H_kv, g·q, S], and the Count Sketch accumulates deterministically."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from keepkv import attention
from keepkv.attention import NEG_INF, Needs, attend, logit_keys, scaled_logits

from test_attention_paths import block_causal_mask, random_layer, sdpa_calls  # noqa: F401 (fixture)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_padded_prefill_expands_kv_heads_instead_of_gqa_with_a_mask(sdpa_calls):  # noqa: F811
    query, keys, values, bias = random_layer(block=9, group=3)
    padding = torch.ones(2, 9, dtype=torch.long)
    padding[0, :5] = 0
    mask = block_causal_mask(2, 9, padding, "cpu")
    bias[0, :, :5] = NEG_INF
    output, _ = attend(query, keys, values, bias, mask, 0.25, Needs(), is_prefill=True)
    assert len(sdpa_calls) == 1 and sdpa_calls[0]["attn_mask"] is mask
    assert not sdpa_calls[0].get("enable_gqa", False)
    reference = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(output, reference.transpose(1, 2), rtol=1e-6, atol=1e-6)


def test_unpadded_prefill_keeps_gqa_inside_sdpa(sdpa_calls):  # noqa: F811
    query, keys, values, bias = random_layer(block=9, group=3)
    attend(query, keys, values, bias, block_causal_mask(2, 9, None, "cpu"), 0.25, Needs(), is_prefill=True)
    assert sdpa_calls == [dict(attn_mask=None, is_causal=True, scale=0.25, enable_gqa=True)]


class KeyConversions(TorchDispatchMode):
    """Shapes of every bf16 -> fp32 copy of a [B, H_kv, S', D] tensor with S' >= ``at_least``."""

    def __init__(self, at_least: int):
        super().__init__()
        self.at_least, self.shapes = at_least, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        source = args[0] if args else None
        if (
            func is torch.ops.aten._to_copy.default and isinstance(source, torch.Tensor)
            and source.dtype == torch.bfloat16 and kwargs.get("dtype") == torch.float32
            and source.dim() == 4 and source.shape[2] >= self.at_least
        ):
            self.shapes.append(tuple(source.shape))
        return func(*args, **kwargs)


@pytest.mark.parametrize("needs", [Needs(colsum=True), Needs(probs=True, window=4), Needs(decays=(0.9,))])
def test_prefill_explicit_pass_converts_the_keys_once(monkeypatch, needs):
    """A bf16 block of 48 rows in chunks of 2 rows over 100 stored entries: one fp32 copy of the
    keys for the whole call (not one per chunk), and the numbers of the reference path."""
    query, keys, values, bias = random_layer(block=48, stored=100, dtype=torch.bfloat16)
    mask = block_causal_mask(2, 48, None, "cpu")
    monkeypatch.setattr(attention, "CHUNK_ELEMENTS", 2 * 2 * 2 * 2 * 148)  # 2 rows per chunk
    with KeyConversions(at_least=100) as seen:
        output, stats = attend(query, keys, values, bias, mask, 0.25, needs, is_prefill=True)
    assert seen.shapes == [tuple(keys.shape)]
    monkeypatch.setattr(attention, "CHUNK_ELEMENTS", 1 << 24)  # one chunk: the reference
    whole, whole_stats = attend(query, keys, values, bias, mask, 0.25, needs, is_prefill=True)
    torch.testing.assert_close(output, whole, rtol=0, atol=0)
    for name in ("colsum", "probs", "window_probs"):
        if getattr(stats, name) is not None:
            torch.testing.assert_close(getattr(stats, name), getattr(whole_stats, name), rtol=1e-6, atol=1e-6)


def test_logit_keys_copies_only_what_the_device_cannot_read_as_is():
    keys = torch.randn(2, 2, 5, 8)
    assert logit_keys(keys) is keys
    half = keys.bfloat16()
    assert logit_keys(half).dtype == torch.float32  # CPU has no bf16 GEMM with fp32 output
    assert not attention.half_gemm_to_fp32("cpu")


@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 40), st.sampled_from([torch.float32, torch.bfloat16]))
def test_scaled_logits_on_cpu_equal_the_fp32_product(group, rows, size, dtype):
    """fp32 inputs keep their exact fp32 GEMM; half inputs are upcast (exact products) on CPU."""
    generator = torch.Generator().manual_seed(group * 100 + rows * 10 + size)
    query_g = torch.randn(2, 2, group, rows, 8, generator=generator).to(dtype)
    keys = torch.randn(2, 2, size, 8, generator=generator).to(dtype)
    expected = torch.matmul(query_g.float().reshape(2, 2, group * rows, 8), keys.float().transpose(-1, -2))
    got = scaled_logits(query_g, keys, 0.5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected.view(2, 2, group, rows, size) * 0.5, rtol=0, atol=0)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_logits_on_cuda_are_fp32_accurate(dtype):
    """The fp32-output GEMM in the model's dtype: as accurate as the upcast product (fix 3)."""
    query, keys, _, bias = random_layer(block=3, stored=300, dtype=dtype)
    query_g, keys = attention.group_queries(query * 8, 2).cuda(), keys.cuda()
    logits = scaled_logits(query_g, keys[:, :, :250], 0.25)  # a slice along S, as row chunks read it
    exact = torch.einsum("bhgqd,bhsd->bhgqs", query_g.double(), keys[:, :, :250].double()) * 0.25
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), exact, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("group", [1, 3])
def test_decode_sdpa_mask_is_per_kv_head_and_exact(sdpa_calls, binary, group):  # noqa: F811
    query, keys, values, bias = random_layer(block=1, stored=30, group=group)
    bias[0, 1, 3:9] = NEG_INF
    bias[1, :, -1] = NEG_INF  # a padded new entry still sees itself, as before
    if not binary:
        bias[0, 0, 4] = 1.3  # a merged entry's ln p
    mask = block_causal_mask(2, 1, None, "cpu")
    output, _ = attend(query, keys, values, bias, mask, 0.25, binary_bias=binary)
    (call,) = sdpa_calls
    assert call["attn_mask"].shape == (2, 2, 1, 31)  # [B, H_kv, 1, S]: broadcast over the g heads
    seen = bias.clone()
    seen[..., -1] = seen[..., -1].clamp(min=0.0) if not binary else 0.0
    seen[1, :, -1] = 0.0
    reference, _ = attend(query, keys, values, seen, mask, 0.25, Needs(probs=True))
    torch.testing.assert_close(output, reference, rtol=1e-6, atol=1e-6)


# -- the Count Sketch accumulates deterministically, and fp32 tables take half inputs -------------

from keepkv.sketch import CountSketch  # noqa: E402
from helpers import buckets_of, signs_of  # noqa: E402


class Accumulations(TorchDispatchMode):
    """Names of the scatter-adds dispatched, with their ``accumulate`` flag."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if "index_add" in name or "index_put" in name or "scatter_add" in name:
            self.calls.append((name, bool(args[3] if len(args) > 3 else kwargs.get("accumulate", False))))
        return func(*args, **kwargs)


def test_sketch_accumulates_with_sorted_index_put_never_index_add():
    sketch = CountSketch.empty(2, 2, 3, 4, 8)
    ids = torch.arange(40).view(1, 1, 40)
    keys = torch.randn(2, 2, 40, 8)
    with Accumulations() as seen:
        sketch.insert(ids, keys, keys)
        estimates = sketch.query(ids[..., :5])
        sketch.delete(ids[..., :5], *estimates)
    assert seen.calls and all(call == ("aten::index_put_", True) for call in seen.calls)


@given(st.integers(1, 5), st.integers(1, 60), st.integers(0, 2**31))
def test_sketch_insert_sums_colliding_tokens_exactly_as_a_dense_sum(buckets, tokens, seed):
    generator = torch.Generator().manual_seed(seed)
    sketch = CountSketch.empty(2, 1, 3, buckets, 4, seed=seed % 7)
    ids = torch.randint(0, 10_000, (2, 1, tokens), generator=generator)
    keys, values = torch.randn(2, 2, 1, tokens, 4, generator=generator)
    sketch.insert(ids, keys, values)
    slot = torch.nn.functional.one_hot(buckets_of(sketch, ids), buckets).double()  # [B, 1, N, r, b]
    signs = signs_of(sketch, ids).double()[..., None]  # [B, 1, N, r, 1]
    expected_keys = torch.einsum("bhnrs,bhnd->bhrsd", slot, keys.double())
    expected_values = torch.einsum("bhnrs,bhnd->bhrsd", slot * signs, values.double())
    torch.testing.assert_close(sketch.keys.double(), expected_keys, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(sketch.values.double(), expected_values, rtol=1e-6, atol=1e-5)


def test_fp32_tables_take_bf16_tokens_and_delete_them_to_rounding():
    """300 bf16 keys in one bucket, deleted one by one: an fp32 table returns to ~0, a bf16
    table keeps an error about the size of a key."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.arange(300).view(1, 1, 300)
    keys = (torch.randn(1, 1, 300, 16, generator=generator) + 3.0).bfloat16()
    residual = {}
    for dtype in (torch.float32, torch.bfloat16):
        sketch = CountSketch.empty(1, 1, 1, 1, 16, dtype=dtype)
        sketch.insert(ids, keys, keys)
        for t in range(300):
            sketch.delete(ids[..., t : t + 1], keys[..., t : t + 1, :], keys[..., t : t + 1, :])
        residual[dtype] = sketch.keys.abs().max().item()
    assert residual[torch.float32] < 1e-3
    assert residual[torch.bfloat16] > 100 * residual[torch.float32]


@cuda
def test_sketch_on_cuda_is_deterministic_and_matches_cpu():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50_000, (2, 2, 2000), generator=generator)
    keys, values = torch.randn(2, 2, 2, 2000, 64, generator=generator)
    tables = []
    for _ in range(2):
        sketch = CountSketch.empty(2, 2, 3, 16, 64, device="cuda")  # ~40 tokens per slot
        sketch.insert(ids.cuda(), keys.cuda(), values.cuda())
        tables.append((sketch.keys.cpu(), sketch.values.cpu()))
    assert all(torch.equal(a, b) for a, b in zip(*tables))
    cpu = CountSketch.empty(2, 2, 3, 16, 64)
    cpu.insert(ids, keys, values)
    torch.testing.assert_close(tables[0][0], cpu.keys, rtol=1e-5, atol=1e-4)


# -- fewer launches in a decode step's explicit pass ---------------------------------------------


class OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._schema.name.removeprefix("aten::"))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("needs", [Needs(probs=True), Needs(probs=True, logits=True)])
def test_decode_explicit_pass_copies_nothing_it_does_not_need(needs, monkeypatch):
    """One query row, one chunk: no block mask to apply (the query always sees itself), no
    concatenation or padding of a single chunk, no decay weights; the same numbers as a pass
    that splits the same call into chunks of the group's rows."""
    query, keys, values, bias = random_layer(block=1, stored=30, group=3)
    bias[0, 1, 3:9] = NEG_INF
    mask = block_causal_mask(2, 1, None, "cpu")
    with OpNames() as seen:
        output, stats = attend(query, keys, values, bias, mask, 0.25, needs)
    assert not {"cat", "constant_pad_nd", "arange", "masked_fill_", "bitwise_not"} & set(seen.names), seen.names
    explicit = torch.softmax(
        torch.einsum("bhgd,bhsd->bhgs", attention.group_queries(query, 2)[:, :, :, 0], keys) * 0.25 + bias[:, :, None], -1
    )
    torch.testing.assert_close(stats.probs[:, :, :, 0], explicit, rtol=1e-6, atol=1e-6)
    reference = torch.einsum("bhgs,bhsd->bhgd", explicit, values).reshape(2, 1, 6, 16)
    torch.testing.assert_close(output, reference, rtol=1e-5, atol=1e-6)
