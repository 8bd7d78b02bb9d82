"""keepkv's C++ paged decode kernel (``backend="cpp"``, keepkv/kernels/paged_cpu.cpp) against the
torch reference (``paged_decode_reference``), on the grid and the caches of test_paged_decode.py
(every slot no request reads is NaN, blocks shuffled, a poisoned block past each request's), plus
what the C++ kernel adds: fp16 caches, blocks of other sizes and head sizes that are not a whole
number of vectors, its narrower builds (AVX2, plain C++) where the CPU runs them, and its own
checks of lengths, blocks and geometry. Skipped where no compiler (or ninja) is there: the first
test builds the kernel into the cache (seconds), later runs import it."""

import math

import pytest
import torch
from test_paged_decode import (BIAS_WORD, KV_HEADS, MAX_LEN, WORDS, assert_matches, assert_refused, case, planes,
                               reference, run)

from keepkv.kernels.paged import PagedGeometry, paged_decode, paged_decode_reference
from keepkv.kernels.paged_cpp import cpp_available

pytestmark = pytest.mark.skipif(not cpp_available(), reason="no C++ compiler or ninja: the cpp backend cannot build")


def tolerance_of(dtype):
    return 1e-5 if dtype == torch.float32 else 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("keys_by_dim", [True, False], ids=["keys-dim-major", "keys-slot-major"])
@pytest.mark.parametrize("biased", [True, False], ids=["bias", "no-bias"])
def test_kernel_matches_the_reference(dtype, head_dim, group, keys_by_dim, biased):
    inputs = case(dtype, head_dim, group, keys_by_dim, biased, seed=head_dim + group)
    got = run("cpp", "cpu", *inputs)
    want = reference(*inputs)
    assert not torch.isnan(want[0]).any(), "the reference reads no NaN slot"
    assert_matches(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("keys_by_dim", [True, False], ids=["keys-dim-major", "keys-slot-major"])
def test_without_statistics_the_output_is_the_same(dtype, keys_by_dim):
    """No probabilities asked for: the softmax runs unnormalised in scratch, out scaled at the end."""
    query, cache, table, seq_lens, geometry = case(dtype, 64, 3, keys_by_dim, True, seed=5)
    want = reference(query, cache, table, seq_lens, geometry)
    out, probs, logits = paged_decode(query, cache, table, seq_lens, 1 / math.sqrt(64), geometry, max_len=MAX_LEN,
                                      backend="cpp")
    assert probs is None and logits is None
    torch.testing.assert_close(out.float(), want[0].float(), rtol=tolerance_of(dtype), atol=tolerance_of(dtype))


def test_a_query_in_another_dtype_is_not_rounded_to_the_cache():
    """fp32 query over a bf16 cache: fp32 logits (to 1e-5), an fp32 out within bf16 rounding."""
    inputs = case(torch.bfloat16, 64, 3, True, True, seed=7, query_dtype=torch.float32)
    got, want = run("cpp", "cpu", *inputs), reference(*inputs)
    assert got[0].dtype == torch.float32
    assert_matches(got, want, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_comparison_fails_on_a_wrong_bias_or_a_wrong_block(dtype):
    """A bias off by 1 on one slot changes the output beyond the tolerance (the bias is read, and
    from the right word); two blocks of a request swapped change the statistics."""
    query, cache, table, seq_lens, geometry = case(dtype, 64, 3, True, True, seed=11, lengths=[5, 40])
    want = reference(query, cache, table, seq_lens, geometry)
    assert_matches(run("cpp", "cpu", query, cache, table, seq_lens, geometry), want, dtype)  # as is: equal

    shifted = cache.clone()
    planes(shifted, geometry)[2][table[0, 0].long(), 0, 3, BIAS_WORD] += 1.0  # request 0, KV head 0, entry 3
    got = run("cpp", "cpu", query, shifted, table, seq_lens, geometry)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got[0].float(), want[0].float(), rtol=tolerance_of(dtype), atol=tolerance_of(dtype))
    # ... and the kernel agrees with the reference on the shifted cache: it is the input that differs
    assert_matches(got, reference(query, shifted, table, seq_lens, geometry), dtype)

    other_word = cache.clone()
    planes(other_word, geometry)[2][table[0, 0].long(), 0, 3, 1 - BIAS_WORD] += 1.0  # the slot's other word
    assert_matches(run("cpp", "cpu", query, other_word, table, seq_lens, geometry), want, dtype)

    swapped = table.clone()
    swapped[1, [0, 1]] = table[1, [1, 0]]
    with pytest.raises(AssertionError):
        assert_matches(run("cpp", "cpu", query, cache, swapped, seq_lens, geometry), want, dtype)


def ragged_case(dtype, head_dim, group, block_size, lengths, keys_by_dim, values_by_dim, seed, kv_heads=KV_HEADS):
    """As test_paged_decode.case, for any block size and head size: (query, cache, table, seq_lens,
    geometry, max_len), blocks shuffled, every slot no request reads NaN."""
    generator = torch.Generator().manual_seed(seed)
    item = torch.finfo(dtype).bits // 8
    words_at = 2 * block_size * head_dim * item // 4
    cell = (words_at + block_size * WORDS) * 4 // item
    geometry = PagedGeometry(block_size, kv_heads, head_dim, cell, keys_by_dim=keys_by_dim,
                             values_by_dim=values_by_dim, words_at=words_at, words=WORDS, bias_word=BIAS_WORD)
    needs = [math.ceil(length / block_size) for length in lengths]
    max_len = max(lengths + [1]) + 3
    width = math.ceil(max_len / block_size)  # a poisoned column or more past the longest
    pool = torch.randperm(sum(needs) + 1, generator=generator)
    cache = torch.full((sum(needs) + 1, kv_heads, cell), float("nan"), dtype=dtype)
    cells = cache.view(-1, kv_heads, cell)
    plane = block_size * head_dim

    def entries(offset, by_dim):
        view = cells[..., offset : offset + plane]
        return (view.unflatten(-1, (head_dim, block_size)).transpose(-1, -2) if by_dim
                else view.unflatten(-1, (block_size, head_dim)))

    keys, values = entries(0, keys_by_dim), entries(plane, values_by_dim)
    words = cells.view(torch.float32)[..., words_at : words_at + block_size * WORDS].unflatten(-1, (block_size, WORDS))
    table = torch.full((len(lengths), width), int(pool[-1]), dtype=torch.int32)
    taken = 0
    for row, (length, need) in enumerate(zip(lengths, needs)):
        table[row, :need] = pool[taken : taken + need]
        taken += need
        at = torch.arange(length)
        blocks, slots = table[row, at // block_size].long(), at % block_size
        keys[blocks, :, slots] = torch.randn(length, kv_heads, head_dim, generator=generator).to(dtype)
        values[blocks, :, slots] = torch.randn(length, kv_heads, head_dim, generator=generator).to(dtype)
        slot_words = torch.randn(length, kv_heads, WORDS, generator=generator)
        slot_words[..., BIAS_WORD] = (1 - torch.rand(length, kv_heads, generator=generator)).mul(6).log()
        words[blocks, :, slots] = slot_words
    query = torch.randn(len(lengths), kv_heads * group, head_dim, generator=generator).to(dtype)
    return query, cache, table, torch.tensor(lengths), geometry, max_len


SHAPES = [  # block size, head size, lengths: vector tails in slots and in dimensions, many blocks
    (128, 64, [1, 127, 128, 129, 300, 0, 1120]),
    (24, 40, [1, 23, 24, 25, 70, 0]),
    (16, 72, [5, 16, 33, 90]),
    (32, 8, [3, 31, 64, 65]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"block{s[0]}-d{s[1]}")
@pytest.mark.parametrize("orders", [(True, False), (False, True), (True, True), (False, False)],
                         ids=["vllm-vec", "values-dim-major", "both-dim-major", "both-slot-major"])
@pytest.mark.parametrize("group", [1, 3, 5])
def test_block_and_head_sizes_that_are_not_whole_vectors(dtype, shape, orders, group):
    block_size, head_dim, lengths = shape
    query, cache, table, seq_lens, geometry, max_len = ragged_case(dtype, head_dim, group, block_size, lengths,
                                                                   *orders, seed=block_size + head_dim + group)
    got = run("cpp", "cpu", query, cache, table, seq_lens, geometry, max_len=max_len)
    want = reference(query, cache, table, seq_lens, geometry, max_len=max_len)
    assert not torch.isnan(want[0]).any()
    assert_matches(got, want, dtype)


def test_one_thread_and_two_give_the_same_answer():
    """The tasks (request, KV head) are independent: the thread count changes nothing, bit for bit."""
    query, cache, table, seq_lens, geometry, max_len = ragged_case(torch.float32, 64, 3, 128,
                                                                   [1120, 5, 700, 0, 129, 300, 64, 1000], True, False,
                                                                   seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run("cpp", "cpu", query, cache, table, seq_lens, geometry, max_len=max_len)
        torch.set_num_threads(2)
        two = run("cpp", "cpu", query, cache, table, seq_lens, geometry, max_len=max_len)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two):
        assert torch.equal(a, b)
    assert_matches(two, reference(query, cache, table, seq_lens, geometry, max_len=max_len), torch.float32)


def test_a_request_with_nothing_visible_attends_to_nothing():
    """Every bias -inf: zeros (out and probabilities), as the Numba kernel takes 0 / 0; logits still q.k."""
    query, cache, table, seq_lens, geometry = case(torch.float32, 64, 3, True, True, seed=2, lengths=[7, 20])
    hidden = cache.clone()
    words = planes(hidden, geometry)[2]
    words[table[0, 0].long(), :, :7, BIAS_WORD] = float("-inf")
    out, probs, logits = run("cpp", "cpu", query, hidden, table, seq_lens, geometry)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(probs[0], torch.zeros_like(probs[0]))
    assert torch.isfinite(logits[0, ..., :7]).all() and torch.isinf(logits[0, ..., 7:]).all()
    want = reference(query, hidden, table, seq_lens, geometry)
    torch.testing.assert_close(out[1], want[0][1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("target", ["avx2", "generic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_the_narrower_builds_match_too(target, dtype, monkeypatch):
    """KEEPKV_CPP_ISA builds the AVX2 or plain C++ kernel (each one build, then cached)."""
    from keepkv.kernels import paged_cpp

    if target == "avx2" and paged_cpp.isa() not in ("avx512", "avx2"):
        pytest.skip("this CPU does not run AVX2")
    monkeypatch.setenv("KEEPKV_CPP_ISA", target)
    assert paged_cpp.extension().isa() == target
    for orders in [(True, False), (False, True)]:
        query, cache, table, seq_lens, geometry, max_len = ragged_case(dtype, 40, 3, 24, [1, 23, 25, 70, 0], *orders,
                                                                       seed=9)
        got = run("cpp", "cpu", query, cache, table, seq_lens, geometry, max_len=max_len)
        assert_matches(got, reference(query, cache, table, seq_lens, geometry, max_len=max_len), dtype)


def test_bad_input_is_refused_in_one_line():
    query, cache, table, seq_lens, geometry = case(torch.float32, 64, 3, True, True, seed=0)
    scaling = 0.125
    assert_refused(ValueError, "multiple of 2 KV heads", query[:, :5], cache, table, seq_lens, scaling, geometry,
                   max_len=MAX_LEN, backend="cpp")
    assert_refused(ValueError, "more than a block table of 4 blocks holds", query, cache, table, seq_lens, scaling,
                   geometry, max_len=4 * 16 + 1, backend="cpp")
    assert_refused(ValueError, "block_table .* must match", query, cache, table[:2], seq_lens, scaling, geometry,
                   max_len=MAX_LEN, backend="cpp")
    assert_refused(ValueError, "a request of 50 entries is longer than max_len 40", query, cache, table, seq_lens,
                   scaling, geometry, max_len=40, backend="cpp")
    outside = table.clone()
    outside[3, 1] = cache.shape[0]  # request 3 (50 entries) reads its block 1
    assert_refused(ValueError, "request 3's block table names a block outside the cache", query, cache, outside,
                   seq_lens, scaling, geometry, max_len=MAX_LEN, backend="cpp")
    odd = PagedGeometry(geometry.block_size, geometry.kv_heads, geometry.head_dim, geometry.cell,
                        words_at=geometry.words_at + 8, words=WORDS, bias_word=BIAS_WORD)
    assert_refused(ValueError, "outside a cell", query, cache, table, seq_lens, scaling, odd, max_len=MAX_LEN,
                   backend="cpp")
    assert_refused(ValueError, "backend must be", query, cache, table, seq_lens, scaling, geometry, max_len=MAX_LEN,
                   backend="c++")


def test_a_build_that_fails_says_so_in_one_line(monkeypatch, tmp_path):
    from keepkv.kernels import paged_cpp

    broken = tmp_path / "paged_cpu.cpp"
    broken.write_text("this is not C++;\n")
    monkeypatch.setattr(paged_cpp, "SOURCE", broken)
    monkeypatch.setenv("KEEPKV_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ImportError, match="did not build") as caught:
        paged_cpp._extension.__wrapped__("generic")
    assert "\n" not in str(caught.value)


def test_auto_takes_the_cpp_kernel_on_cpu_and_numba_where_it_does_not_build(monkeypatch):
    from keepkv.kernels import paged, paged_cpp

    query, cache, table, seq_lens, geometry = case(torch.float32, 64, 3, True, True, seed=4)
    monkeypatch.setattr(paged, "_CPU_BACKEND", [])
    assert paged.cpu_backend() == "cpp"
    got = paged_decode(query, cache, table, seq_lens, 0.125, geometry, max_len=MAX_LEN, probs=True)
    want = paged_decode(query, cache, table, seq_lens, 0.125, geometry, max_len=MAX_LEN, probs=True, backend="cpp")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    def broken(target=None):
        raise ImportError("keepkv's C++ paged kernel did not build (test)")

    monkeypatch.setattr(paged, "_CPU_BACKEND", [])
    monkeypatch.setattr(paged_cpp, "extension", broken)
    assert paged.cpu_backend() == "numba"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("orders", [(True, False), (False, True)], ids=["vllm-vec", "values-dim-major"])
@pytest.mark.parametrize("stats", [True, False], ids=["stats", "out-only"])
def test_long_requests_split_over_blocks_match_too(dtype, orders, stats):
    """Fewer (request, KV head) tasks than twice the threads: each long request runs in pieces of
    whole blocks on both threads, combined after (a piece whose every bias is -inf weighs 0)."""
    query, cache, table, seq_lens, geometry, max_len = ragged_case(dtype, 64, 4, 128, [1500, 200], *orders, seed=8,
                                                                   kv_heads=1)
    words = planes(cache, geometry)[2]
    words[table[0, 2:4].long(), :, :, BIAS_WORD] = float("-inf")  # entries 256..511 of request 0: one piece
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        got = paged_decode(query, cache, table, seq_lens, 0.125, geometry, max_len=max_len, logits=stats,
                           probs=stats, backend="cpp")
    finally:
        torch.set_num_threads(threads)
    want = paged_decode_reference(query, cache, table, seq_lens, 0.125, geometry, max_len=max_len, logits=True,
                                  probs=True)
    if stats:
        assert_matches(got, want, dtype)
        assert torch.equal(got[1][0, ..., 256:512], torch.zeros_like(got[1][0, ..., 256:512]))
    else:
        torch.testing.assert_close(got[0].float(), want[0].float(), rtol=tolerance_of(dtype), atol=tolerance_of(dtype))


def test_views_and_other_integer_types_are_read_as_they_are():
    """A block table that is a column slice of a wider one (its row stride kept), int64 tables and
    lengths, a query that is a strided view in bf16: the same answer as contiguous int32 inputs."""
    query, cache, table, seq_lens, geometry = case(torch.float32, 64, 3, True, True, seed=6)
    want = run("cpp", "cpu", query, cache, table, seq_lens, geometry)
    wide = torch.full((table.shape[0], table.shape[1] + 3), -1, dtype=torch.int32)
    wide[:, : table.shape[1]] = table
    assert_matches(run("cpp", "cpu", query, cache, wide[:, : table.shape[1]], seq_lens.int(), geometry), want,
                   torch.float32)
    assert_matches(run("cpp", "cpu", query, cache, table.long(), seq_lens.long(), geometry), want, torch.float32)
    strided = query.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    assert_matches(run("cpp", "cpu", strided, cache, table, seq_lens, geometry), want, torch.float32)


def test_concurrent_callers_get_their_own_answers():
    """The kernel runs without the GIL, its scratch per thread: callers on two Python threads at once."""
    from concurrent.futures import ThreadPoolExecutor

    inputs = [ragged_case(torch.float32, 64, 3, 128, [700, 300, 5], True, False, seed=seed) for seed in (21, 22)]
    alone = [run("cpp", "cpu", *i[:5], max_len=i[5]) for i in inputs]
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda i: [run("cpp", "cpu", *i[:5], max_len=i[5]) for _ in range(20)], inputs))
    for answers, want in zip(together, alone):
        for got in answers:
            assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("lengths", [[1, 300, 0, 129], [1500]], ids=["whole", "split"])
def test_a_half_query_is_read_and_its_output_rounded_as_torch_rounds(dtype, lengths):
    """A bf16 / fp16 query is widened in the kernel (exactly) and a bf16 out narrowed there: bit for
    bit torch's rounding of the fp32 output of the same query in fp32, whole requests or split."""
    query, cache, table, seq_lens, geometry, max_len = ragged_case(dtype, 64, 3, 128, lengths, True, False, seed=12,
                                                                   kv_heads=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        half = paged_decode(query, cache, table, seq_lens, 0.125, geometry, max_len=max_len, backend="cpp")[0]
        wide = paged_decode(query.float(), cache, table, seq_lens, 0.125, geometry, max_len=max_len, backend="cpp")[0]
    finally:
        torch.set_num_threads(threads)
    assert half.dtype == dtype and wide.dtype == torch.float32
    assert torch.equal(half, wide.to(dtype))
