"""Which kernel each attention call takes, and that every route gives the same numbers.

SDPA routes (no-mask causal prefill, bool-mask half-precision decode) are checked against the
explicit pass; the explicit pass computes its logits in fp32 and its column sums from the same
probabilities as its output; chunked prefill equals an unchunked one for every method.
"""

import pytest
import torch
import torch.nn.functional as F

import keepkv
import keepkv.reconstruction
from keepkv import attention, merging
from keepkv.attention import NEG_INF, Needs, attend, entry_logits
from keepkv.methods import METHODS
from keepkv.offload import time_major_copies

from conftest import char_tokenizer, random_batch, run_generate, tiny_model

ALL = sorted(METHODS)


def block_causal_mask(batch: int, block: int, padding_2d, device) -> torch.Tensor:
    """[B, 1, q, q] bool, the block mask attend() receives: causal within the new block, padded
    keys off (``padding_2d``: HF's 2-D mask, 1 = real), a padded query still sees itself."""
    mask = torch.ones(block, block, dtype=torch.bool, device=device).tril().expand(batch, 1, block, block)
    if padding_2d is not None:
        key_is_real = padding_2d[:, -block:].to(device=device, dtype=torch.bool)
        mask = (mask & key_is_real[:, None, None, :]) | torch.eye(block, dtype=torch.bool, device=device)
    return mask


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Records the keyword arguments of every SDPA call the attention path makes."""
    calls = []
    real = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording)
    return calls


def random_layer(batch=2, kv_heads=2, group=2, block=7, stored=0, dtype=torch.float32, seed=0):
    """query [B, H, q, D], keys/values [B, H_kv, S, D], bias [B, H_kv, S] (binary) for one call."""
    generator = torch.Generator().manual_seed(seed)
    size = stored + block
    query = torch.randn(batch, kv_heads * group, block, 16, generator=generator).to(dtype)
    keys = torch.randn(batch, kv_heads, size, 16, generator=generator).to(dtype)
    values = torch.randn(batch, kv_heads, size, 16, generator=generator).to(dtype)
    bias = torch.zeros(batch, kv_heads, size)
    return query, keys, values, bias


def test_unpadded_prefill_runs_causal_sdpa_without_a_mask(sdpa_calls):
    query, keys, values, bias = random_layer(block=9)
    mask = block_causal_mask(2, 9, None, "cpu")
    output, _ = attend(query, keys, values, bias, mask, 0.25, Needs(), is_prefill=True)
    assert sdpa_calls == [dict(attn_mask=None, is_causal=True, scale=0.25, enable_gqa=True)]
    explicit, _ = attend(query, keys, values, bias, mask, 0.25, Needs(probs=True), is_prefill=True)
    torch.testing.assert_close(output, explicit, rtol=1e-5, atol=1e-5)


def test_padded_prefill_keeps_its_mask(sdpa_calls):
    query, keys, values, bias = random_layer(block=9)
    padding = torch.ones(2, 9, dtype=torch.long)
    padding[1, :4] = 0
    mask = block_causal_mask(2, 9, padding, "cpu")
    bias[1, :, :4] = NEG_INF
    output, _ = attend(query, keys, values, bias, mask, 0.25, Needs(), is_prefill=True)
    assert sdpa_calls[0]["attn_mask"] is mask and sdpa_calls[0]["is_causal"] is False
    explicit, _ = attend(query, keys, values, bias, mask, 0.25, Needs(probs=True), is_prefill=True)
    # Padded queries' outputs are never read (the explicit pass gives them zeros).
    torch.testing.assert_close(output[0], explicit[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(output[1, 4:], explicit[1, 4:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_decode_with_a_binary_bias_runs_sdpa(sdpa_calls, dtype):
    query, keys, values, bias = random_layer(block=1, stored=20, dtype=dtype)
    bias[0, 1, 3:9] = NEG_INF  # evicted slots
    mask = block_causal_mask(2, 1, None, "cpu")
    output, _ = attend(query, keys, values, bias, mask, 0.25, binary_bias=True)
    assert len(sdpa_calls) == 1 and sdpa_calls[0]["attn_mask"].dtype == torch.bool
    reference, _ = attend(query.float(), keys.float(), values.float(), bias, mask, 0.25, Needs(probs=True))
    torch.testing.assert_close(output.float(), reference, rtol=2e-2, atol=2e-2)


def test_half_decode_with_log_weights_stays_explicit(sdpa_calls):
    query, keys, values, bias = random_layer(block=1, stored=20, dtype=torch.bfloat16)
    bias[:, :, 5] = 1.7  # a merged entry's ln p: a bf16 mask would round it
    mask = block_causal_mask(2, 1, None, "cpu")
    output, _ = attend(query, keys, values, bias, mask, 0.25, binary_bias=False)
    assert sdpa_calls == []
    reference, _ = attend(query.float(), keys.float(), values.float(), bias, mask, 0.25)
    torch.testing.assert_close(output.float(), reference, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("binary", [True, False])
def test_prefill_block_after_stored_entries_sdpa_equals_explicit(sdpa_calls, binary):
    query, keys, values, bias = random_layer(block=6, stored=11)
    bias[1, 0, 2:5] = NEG_INF
    bias[0, :, 11:13] = NEG_INF
    if not binary:
        bias[0, 1, 7] = 0.9
    padding = torch.ones(2, 17, dtype=torch.long)
    padding[0, 11:13] = 0  # padded new keys are off for the queries after them
    mask = block_causal_mask(2, 6, padding, "cpu")
    output, _ = attend(query, keys, values, bias, mask, 0.25, binary_bias=binary)
    assert len(sdpa_calls) == 1
    explicit, _ = attend(query, keys, values, bias, mask, 0.25, Needs(probs=True))
    torch.testing.assert_close(output[1], explicit[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(output[0, 2:], explicit[0, 2:], rtol=1e-5, atol=1e-5)  # padded queries aside


def test_logits_are_fp32_products_of_the_half_inputs():
    query, keys, _, bias = random_layer(block=3, stored=40, dtype=torch.bfloat16)
    query_g = attention.group_queries(query * 8, 2)  # large logits: bf16 rounding shows
    logits = entry_logits(query_g, keys, bias, 0.25)
    exact = torch.einsum("bhgqd,bhsd->bhgqs", query_g.double(), keys.double()) * 0.25
    torch.testing.assert_close(logits.double(), exact, rtol=1e-6, atol=1e-5)
    rounded = torch.einsum("bhgqd,bhsd->bhgqs", query_g, keys).float() * 0.25
    assert (rounded.double() - exact).abs().max() > 1e-2  # what the upcast-after-matmul gave


@pytest.mark.parametrize("chunk_elements", [1 << 24, 300])
def test_colsum_comes_from_the_output_pass(monkeypatch, chunk_elements):
    monkeypatch.setattr(attention, "CHUNK_ELEMENTS", chunk_elements)
    query, keys, values, bias = random_layer(block=13)
    padding = torch.ones(2, 13, dtype=torch.long)
    padding[1, :3] = 0
    bias[1, :, :3] = NEG_INF
    mask = block_causal_mask(2, 13, padding, "cpu")
    plain, _ = attend(query, keys, values, bias, mask, 0.25, Needs(), is_prefill=True)
    output, stats = attend(query, keys, values, bias, mask, 0.25, Needs(probs=True, colsum=True), is_prefill=True)
    torch.testing.assert_close(output[0], plain[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(output[1, 3:], plain[1, 3:], rtol=1e-5, atol=1e-5)  # padded queries aside
    torch.testing.assert_close(stats.colsum, stats.probs.sum(3), rtol=1e-5, atol=1e-5)
    # Each real query row's probabilities sum to one (a padded row's are zeros).
    real_rows = torch.tensor([13.0, 10.0])[:, None, None].expand(2, 2, 2)
    torch.testing.assert_close(stats.colsum.sum(-1), real_rows, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])  # keepkv.generate: inference_mode
def test_bias_stays_binary_until_a_method_writes_weights(mode):
    model = tiny_model("llama-gqa")
    input_ids, attention_mask = random_batch(length=30, pad=(0, 5))
    with mode():
        _, cache = run_generate(model, input_ids, attention_mask, "h2o", budget=8, new_tokens=6)
        assert all(layer.binary_bias() for layer in cache.layers)
        layer = cache.layers[0]
        layer.write(torch.zeros(2, 2, 1, dtype=torch.long), bias=torch.full((2, 2, 1), 0.5))  # votes, in place
        assert not layer.binary_bias()
        layer.append(layer.keys[:, :, :1], layer.values[:, :, :1], torch.ones(2, 1, dtype=torch.bool))
        assert not layer.binary_bias()  # for good
        for method in ("keepkv", "h2o+merge=zip", "zeromerge"):
            _, cache = run_generate(model, input_ids, attention_mask, method, budget=8, new_tokens=6)
            assert not any(layer.binary_bias() for layer in cache.layers), method


def test_group_key_rule_solves_without_linalg_solve(monkeypatch):
    def no_solve(*args, **kwargs):
        raise AssertionError("torch.linalg.solve syncs with the host on CUDA; use solve_ex")

    monkeypatch.setattr(merging.torch.linalg, "solve", no_solve)
    model = tiny_model("llama-gqa")
    input_ids, attention_mask = random_batch(length=30)
    tokens, _ = run_generate(model, input_ids, attention_mask, "keepkv", budget=8, new_tokens=6, zip_key="group")
    assert tokens.shape == (2, 6)


def test_offload_sources_never_alias_the_caller():
    keys, values = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)  # B = H_kv = q = 1: contiguous() is a view
    is_real = torch.ones(1, 1, dtype=torch.bool)
    copies = time_major_copies(keys, values, is_real)
    for copy, source in zip(copies, (keys, values, is_real)):
        assert copy.is_contiguous()
        assert copy.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
    keys.add_(1.0)  # an in-place merge into the newest slot
    assert not torch.equal(copies[0], keys.permute(2, 0, 1, 3))


@torch.no_grad()
def chunked_generate(model, input_ids, attention_mask, method, budget, chunk, new_tokens):
    """run_generate with the prompt fed in blocks of ``chunk`` tokens."""
    keepkv.enable(model)
    cache = keepkv.CompressedCache(model.config, method, budget)
    first = input_ids[:, :0]
    if cache.defers_to_reconstruction:  # the prompt in blocks, then its reconstruction pass (as run_generate)
        logits = keepkv.reconstruction.prefill(
            model, char_tokenizer(), cache, input_ids, attention_mask, chat=False, prefill_chunk=chunk
        )
        first = logits.argmax(-1, keepdim=True)
        input_ids = torch.cat([input_ids, first], dim=-1)
        attention_mask = torch.cat([attention_mask, torch.ones_like(first)], dim=-1)
        new_tokens -= 1
    else:
        cache.start_prefill(attention_mask)
    output = model.generate(
        input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, prefill_chunk_size=chunk,
    )
    return torch.cat([first, output[:, input_ids.shape[1]:]], dim=-1), cache


@pytest.mark.parametrize("method", ALL)
def test_chunked_prefill_equals_unchunked(method):
    model = tiny_model("llama-gqa")
    input_ids, attention_mask = random_batch(length=30, pad=(0, 9))
    reference, ref_cache = run_generate(model, input_ids, attention_mask, method, budget=0.3, new_tokens=8)
    for chunk in (1, 7, 16):
        tokens, cache = chunked_generate(model, input_ids, attention_mask, method, 0.3, chunk, 8)
        assert torch.equal(tokens, reference), chunk
        for layer, ref in zip(cache.layers, ref_cache.layers):
            assert torch.equal(layer.positions, ref.positions), (chunk, layer.layer_idx)
            torch.testing.assert_close(layer.keys, ref.keys, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(layer.bias, ref.bias, rtol=1e-4, atol=1e-4)


def test_chunked_prefill_holds_every_layers_prompt_at_its_peak():
    model = tiny_model("llama-gqa", layers=4)
    input_ids, attention_mask = random_batch(length=40, pad=(0, 0))
    _, unchunked = run_generate(model, input_ids, attention_mask, "h2o", budget=0.2, new_tokens=1)
    _, chunked = chunked_generate(model, input_ids, attention_mask, "h2o", 0.2, 8, 1)
    per_layer = unchunked.layers[0].entry_nbytes() * 2 * 40  # one layer's uncompressed prompt
    # Unchunked, one layer is uncompressed at a time; chunked, every layer waits for the last chunk.
    assert chunked.prefill_peak_bytes >= 4 * per_layer > unchunked.prefill_peak_bytes


def test_prefill_chunk_is_validated_at_the_boundary():
    with pytest.raises(ValueError, match="prefill_chunk must be an int >= 1"):
        keepkv.generate(None, None, "a prompt", prefill_chunk=0)
    from keepkv.bench import run_bench

    with pytest.raises(ValueError, match="prefill_chunk must be an int >= 1"):
        run_bench(config="smollm2-135m", prefill_chunk=-3, progress=False)


def test_bench_run_feeds_the_prompt_in_chunks():
    from keepkv.bench.runner import run_once

    model = tiny_model("llama-gqa", layers=3)
    whole = run_once(model, "h2o", 0.2, prompt_len=48, gen_len=2)
    chunked = run_once(model, "h2o", 0.2, prompt_len=48, gen_len=2, prefill_chunk=16)
    assert chunked["kept_entries"] == whole["kept_entries"]
    assert chunked["cache_bytes_prefill"] > whole["cache_bytes_prefill"]  # every layer's prompt at once


def test_decode_logits_are_the_ones_the_probabilities_come_from():
    query, keys, values, bias = random_layer(block=1, stored=40)
    bias[0, 1, 5] = 1.5  # a merged entry's ln p
    mask = block_causal_mask(2, 1, None, "cpu")
    output, stats = attend(query, keys, values, bias, mask, 0.25, Needs(probs=True, logits=True))
    query_g = attention.group_queries(query, 2)
    exact = torch.einsum("bhgqd,bhsd->bhgqs", query_g.double(), keys.double()) * 0.25
    torch.testing.assert_close(stats.logits.double(), exact, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stats.probs, torch.softmax(stats.logits + bias[:, :, None, None], -1))
    plain, _ = attend(query, keys, values, bias, mask, 0.25, Needs(probs=True))
    torch.testing.assert_close(output, plain)


@pytest.mark.parametrize("method", ["keepkv", "keepkv+selection=ema", "snapkv+merge=zip+threshold=-1.0"])
@torch.no_grad()
def test_merging_methods_compute_no_logits_of_their_own_while_decoding(method, monkeypatch):
    """The decode step's q·K is computed once, by the attention, and shared with the method."""
    from keepkv.methods import keepkv as keepkv_module

    model = tiny_model("llama-gqa", layers=2)
    input_ids, attention_mask = random_batch(batch=2, length=30, pad=(0, 7))
    cache = keepkv.CompressedCache(model.config, method, 12)
    keepkv.enable(model)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache).logits[:, -1]

    def refuse(*args, **kwargs):
        raise AssertionError("a method computed its own decode logits")

    monkeypatch.setattr(keepkv_module, "scaled_logits", refuse)
    mask = attention_mask
    for _ in range(4):
        token = logits.argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
        logits = model(input_ids=token, attention_mask=mask, past_key_values=cache).logits[:, -1]
