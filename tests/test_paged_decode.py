"""keepkv's paged decode kernels against the torch reference (``paged_decode_reference``): the
Numba CPU kernel, and the Triton kernel on CUDA or in Triton's interpreter (``TRITON_INTERPRET=1``,
set by conftest.py before Triton is imported, and here again before each call).

Caches of random contents whose cells hold keys, values and ``WORDS`` fp32 words per slot
after them; every slot that no request reads is NaN (and so is a block the block tables name
past each request's blocks), so a kernel that reads past a length, or a wrong block, fails.
fp32 to ~1e-5, bf16 outputs to bf16 rounding (1e-2 absolute and relative); logits and
probabilities in fp32 in both. Each backend skips where it is not installed."""

import math

import pytest
import torch

from keepkv.kernels.paged import PagedGeometry, numba_available, paged_decode, paged_decode_reference

CUDA = torch.cuda.is_available()
BLOCK = 16
KV_HEADS = 2
WORDS, BIAS_WORD = 2, 1  # a slot's fp32 words: [position-like noise, bias]
LENGTHS = [1, 16, 17, 50, 0, 33]  # one entry, exactly a block, a block + 1, ragged, empty
MAX_LEN = 56  # not a whole number of blocks: the table holds 4


def triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


BACKENDS = [
    pytest.param("numba", marks=pytest.mark.skipif(not numba_available(), reason="numba is not installed")),
    pytest.param("triton", marks=pytest.mark.skipif(not triton_installed(), reason="triton is not installed")),
]


def device_for(backend: str, monkeypatch) -> str:
    """Where ``backend`` runs here: triton on CUDA, or in its interpreter on CPU."""
    if backend == "triton" and CUDA:
        return "cuda"
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return "cpu"


def geometry_for(dtype, head_dim, keys_by_dim, biased, block_size=BLOCK) -> PagedGeometry:
    """A cell of keys, then values (the other order than the keys'), then WORDS fp32 words per slot."""
    item = torch.finfo(dtype).bits // 8
    words_at = 2 * block_size * head_dim * item // 4
    cell = (words_at + block_size * WORDS) * 4 // item
    return PagedGeometry(block_size, KV_HEADS, head_dim, cell, keys_by_dim=keys_by_dim, values_by_dim=not keys_by_dim,
                         words_at=words_at, words=WORDS, bias_word=BIAS_WORD if biased else -1)


def planes(cache, geometry: PagedGeometry):
    """Views of the cache: keys, values [blocks, H_kv, block_size, D] and words [blocks, H_kv, block_size, WORDS]."""
    g = geometry
    cells = cache.view(-1, g.kv_heads, g.cell)
    plane = g.block_size * g.head_dim

    def at(offset, by_dim):
        entries = cells[..., offset : offset + plane]
        if by_dim:
            return entries.unflatten(-1, (g.head_dim, g.block_size)).transpose(-1, -2)
        return entries.unflatten(-1, (g.block_size, g.head_dim))

    words = cells.view(torch.float32)[..., g.words_at : g.words_at + g.block_size * g.words]
    return at(g.keys_at, g.keys_by_dim), at(g.values_at, g.values_by_dim), words.unflatten(-1, (g.block_size, g.words))


def case(dtype, head_dim, group, keys_by_dim, biased, seed, lengths=LENGTHS, max_len=MAX_LEN, query_dtype=None):
    """(query [R, H, D], kv_cache, block_table [R, blocks] int32, seq_lens [R], geometry): each
    request's blocks drawn from a shuffled pool (non-contiguous, out of order), its table's spare
    columns naming an all-NaN block, every slot past its length NaN; bias words ln U(0, 6]."""
    generator = torch.Generator().manual_seed(seed)
    geometry = geometry_for(dtype, head_dim, keys_by_dim, biased)
    needs = [math.ceil(length / BLOCK) for length in lengths]
    width = math.ceil(max_len / BLOCK)
    pool = torch.randperm(sum(needs) + 1, generator=generator)  # the last one stays NaN
    poison = int(pool[-1])
    cache = torch.full((sum(needs) + 1, KV_HEADS, geometry.cell), float("nan"), dtype=dtype)
    keys, values, words = planes(cache, geometry)
    table = torch.full((len(lengths), width), poison, dtype=torch.int32)
    taken = 0
    for row, (length, need) in enumerate(zip(lengths, needs)):
        table[row, :need] = pool[taken : taken + need]
        taken += need
        entries = torch.arange(length)
        blocks, slots = table[row, entries // BLOCK].long(), entries % BLOCK
        shape = (length, KV_HEADS)
        keys[blocks, :, slots] = torch.randn(*shape, head_dim, generator=generator).to(dtype)
        values[blocks, :, slots] = torch.randn(*shape, head_dim, generator=generator).to(dtype)
        slot_words = torch.randn(*shape, WORDS, generator=generator)
        slot_words[..., BIAS_WORD] = (1 - torch.rand(*shape, generator=generator)).mul(6).log()  # finite, some < 0
        words[blocks, :, slots] = slot_words
    query = torch.randn(len(lengths), KV_HEADS * group, head_dim, generator=generator).to(query_dtype or dtype)
    return query, cache, table, torch.tensor(lengths), geometry


def run(backend, device, query, cache, table, seq_lens, geometry, max_len=MAX_LEN):
    on = [t.to(device) for t in (query, cache, table, seq_lens)]
    got = paged_decode(*on, 1 / math.sqrt(geometry.head_dim), geometry, max_len=max_len, logits=True, probs=True,
                       backend=backend)
    return tuple(t.cpu() for t in got)


def reference(query, cache, table, seq_lens, geometry, max_len=MAX_LEN):
    return paged_decode_reference(query, cache, table, seq_lens, 1 / math.sqrt(geometry.head_dim), geometry,
                                  max_len=max_len, logits=True, probs=True)


def differences(got, want):
    """The largest |got - want| of out, probs and the finite logits."""
    finite = torch.isfinite(want[2])
    return ((got[0].float() - want[0].float()).abs().max().item(), (got[1] - want[1]).abs().max().item(),
            (got[2][finite] - want[2][finite]).abs().max().item())


def assert_matches(got, want, dtype):
    out, probs, logits = got
    ref_out, ref_probs, ref_logits = want
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    assert probs.shape == ref_probs.shape == logits.shape == ref_logits.shape
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: its rounding of outputs of a few units
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(probs, ref_probs, rtol=0, atol=1e-5)  # fp32 in both dtypes, 0 past a length
    assert torch.equal(torch.isinf(logits), torch.isinf(ref_logits)), "logits: -inf exactly past each length"
    finite = torch.isfinite(ref_logits)
    scale = ref_logits[finite].abs().max().item()
    torch.testing.assert_close(logits[finite], ref_logits[finite], rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("keys_by_dim", [True, False], ids=["keys-dim-major", "keys-slot-major"])
@pytest.mark.parametrize("biased", [True, False], ids=["bias", "no-bias"])
def test_kernel_matches_the_reference(backend, dtype, head_dim, group, keys_by_dim, biased, monkeypatch):
    device = device_for(backend, monkeypatch)
    inputs = case(dtype, head_dim, group, keys_by_dim, biased, seed=head_dim + group)
    got = run(backend, device, *inputs)
    want = reference(*inputs)
    assert not torch.isnan(want[0]).any(), "the reference reads no NaN slot"
    assert_matches(got, want, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_query_in_another_dtype_is_not_rounded_to_the_cache(backend, monkeypatch):
    """fp32 query over a bf16 cache: fp32 logits (to 1e-5), an fp32 out within bf16 rounding."""
    device = device_for(backend, monkeypatch)
    inputs = case(torch.bfloat16, 64, 3, True, True, seed=7, query_dtype=torch.float32)
    got, want = run(backend, device, *inputs), reference(*inputs)
    assert got[0].dtype == torch.float32
    assert_matches(got, want, torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_comparison_fails_on_a_wrong_bias_or_a_wrong_block(backend, dtype, monkeypatch):
    """The tolerances above catch a bias off by 1 on one slot (in the output alone, too) and two
    blocks of a request swapped: the kernel on the altered cache or table against the reference
    on the true one."""
    device = device_for(backend, monkeypatch)
    query, cache, table, seq_lens, geometry = case(dtype, 64, 3, True, True, seed=11, lengths=[5, 40])
    want = reference(query, cache, table, seq_lens, geometry)
    assert_matches(run(backend, device, query, cache, table, seq_lens, geometry), want, dtype)  # as is: equal

    shifted = cache.clone()
    words = planes(shifted, geometry)[2]
    words[table[0, 0].long(), 0, 3, BIAS_WORD] += 1.0  # request 0, KV head 0, entry 3
    got = run(backend, device, query, shifted, table, seq_lens, geometry)
    with pytest.raises(AssertionError):
        assert_matches(got, want, dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got[0].float(), want[0].float(), rtol=tolerance, atol=tolerance)

    swapped = table.clone()
    swapped[1, [0, 1]] = table[1, [1, 0]]
    with pytest.raises(AssertionError):
        assert_matches(run(backend, device, query, cache, swapped, seq_lens, geometry), want, dtype)


def assert_refused(error_type, match, *args, **kwargs):
    with pytest.raises(error_type, match=match) as caught:
        paged_decode(*args, **kwargs)
    assert "\n" not in str(caught.value), "refused in one line"


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_is_refused_in_one_line(backend, monkeypatch):
    device = device_for(backend, monkeypatch)
    query, cache, table, seq_lens, geometry = [t.to(device) if torch.is_tensor(t) else t
                                               for t in case(torch.float32, 64, 3, True, True, seed=0)]
    scaling = 0.125
    assert_refused(ValueError, "multiple of 2 KV heads", query[:, :5], cache, table, seq_lens, scaling, geometry,
                   max_len=MAX_LEN, backend=backend)
    assert_refused(ValueError, "more than a block table of 4 blocks holds", query, cache, table, seq_lens, scaling,
                   geometry, max_len=4 * BLOCK + 1, backend=backend)
    assert_refused(ValueError, "block_table .* must match", query, cache, table[:2], seq_lens, scaling, geometry,
                   max_len=MAX_LEN, backend=backend)


@pytest.mark.skipif(not triton_installed(), reason="triton is not installed")
def test_the_triton_backend_refuses_what_it_cannot_run_in_one_line(monkeypatch):
    from keepkv.kernels import paged_triton

    device = device_for("triton", monkeypatch)
    query, cache, table, seq_lens, _ = [t.to(device) if torch.is_tensor(t) else t
                                        for t in case(torch.float32, 64, 1, True, True, seed=0)]
    odd = geometry_for(torch.float32, 64, True, True, block_size=24)
    assert_refused(ValueError, "power of 2 >= 16", query, torch.zeros(4, KV_HEADS, odd.cell, device=device),
                   table[:, :3], seq_lens.clamp(max=72), 0.125, odd, max_len=72, backend="triton")
    geometry = geometry_for(torch.float32, 64, True, True)
    if not CUDA:
        monkeypatch.delenv("TRITON_INTERPRET")
        assert_refused(RuntimeError, "runs on CUDA", query, cache, table, seq_lens, 0.125, geometry, max_len=MAX_LEN,
                       backend="triton")
    monkeypatch.setattr(paged_triton, "triton", None)
    assert_refused(ImportError, r"needs Triton: pip install", query, cache, table, seq_lens, 0.125, geometry,
                   max_len=MAX_LEN, backend="triton")
