"""The cache and attention path: equality with HF, masking reference, budgets, bytes, bad input."""

from dataclasses import dataclass, field

import pytest
import torch
from transformers import GPT2Config

import keepkv
from keepkv.methods.base import ComposedMethod, ScoredSelection, Selection

from conftest import random_batch, run_generate, tiny_model


@pytest.mark.parametrize("kind", ["llama-mha", "llama-gqa", "qwen2"])
def test_full_equals_hf_generate(kind):
    model = tiny_model(kind)
    input_ids, attention_mask = random_batch(length=20, pad=(0, 6))
    model.set_attn_implementation("sdpa")
    reference = model.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=15, min_new_tokens=15,
        do_sample=False, pad_token_id=0,
    )[:, 20:]
    tokens, _ = run_generate(model, input_ids, attention_mask, "full", new_tokens=15)
    assert torch.equal(tokens, reference)


@pytest.mark.parametrize("method", ["h2o", "snapkv", "streamingllm"])
@pytest.mark.parametrize("kind", ["llama-mha", "llama-gqa"])
@torch.no_grad()
def test_compressed_logits_equal_masked_full_cache(method, kind):
    """Keeping entries physically must equal keeping all and masking the others out."""
    model = tiny_model(kind)
    keepkv.enable(model)
    input_ids, attention_mask = random_batch(length=40, pad=(0, 8))
    compressed = keepkv.CompressedCache(model.config, method, 12, **({"window": 4} if method == "snapkv" else {}))
    model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=compressed)
    masked = keepkv.CompressedCache(model.config, "full")
    model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=masked)
    for small, big in zip(compressed.layers, masked.layers):
        assert small.size < big.size
        kept = (big.positions[..., :, None] == small.positions[..., None, :]) & small.live()[..., None, :]
        big.drop(~kept.any(-1))
    token = torch.randint(3, 100, (2, 1), generator=torch.Generator().manual_seed(5))
    mask = torch.cat([attention_mask, torch.ones_like(token)], dim=-1)
    logits = model(input_ids=token, attention_mask=mask, past_key_values=compressed).logits
    reference = model(input_ids=token, attention_mask=mask, past_key_values=masked).logits
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)


@dataclass(frozen=True)
class _HeadSplitSelection(ScoredSelection):
    """Test selection: head h of layer l keeps budget·(1 + h)/H_kv + l entries (ragged), the newest."""

    name = "_head_split"
    scored = True

    def allocate(self, layers, kv_heads, row_budget, prompt_lengths, scores=None):
        heads = torch.arange(1, kv_heads + 1)
        per_head = row_budget[None, :, None] * heads[None, None, :] // kv_heads
        return per_head + torch.arange(layers)[:, None, None]

    def observe(self, layer, stats):
        layer.overwrite(score=layer.positions.float())


@dataclass
class _HeadSplit(ComposedMethod):
    name = "_head_split"
    selection: Selection = field(default_factory=_HeadSplitSelection)


@torch.no_grad()
def test_per_layer_and_per_head_budgets_and_real_bytes(gqa_model):
    keepkv.enable(gqa_model)
    input_ids, attention_mask = random_batch(length=40, pad=(0, 0))
    cache = keepkv.CompressedCache(gqa_model.config, _HeadSplit(), 12)
    gqa_model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache)
    for layer in cache.layers:
        expected = torch.tensor([6, 12]) + layer.layer_idx
        assert torch.equal(layer.live_counts(), expected.expand(2, 2))
        assert layer.size == int(expected.max())  # tensors shrank to the largest head's budget
    # Each per-entry tensor's buffer holds the kept slots plus one interval of spare slots.
    real_bytes = sum(
        t.numel() * t.element_size() * (layer.size + layer.interval) // layer.size
        for layer in cache.layers
        for t in (layer.keys, layer.values, layer.bias, layer.positions, *layer.extras.values())
    )
    assert cache.nbytes() == real_bytes
    summary = cache.summary()
    assert summary.kept_entries == [9.5, 9.5]
    head_dim, kv_heads = 16, 2
    assert summary.full_cache_bytes[0] == 40 * 2 * head_dim * 4 * kv_heads * 2


@torch.no_grad()
def test_prefill_peak_is_one_uncompressed_layer():
    """Each layer is compressed as its prefill ends, so the prompt cache never exists in full;
    D2O, which allocates from every layer's statistics, holds it all until the last layer."""
    model = tiny_model("llama-gqa", layers=6)
    keepkv.enable(model)
    input_ids, attention_mask = random_batch(length=200, pad=(0, 0))
    peaks = {}
    for method in ("full", "h2o", "d2o"):
        cache = keepkv.CompressedCache(model.config, method, 0.1)
        model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache)
        peaks[method] = cache.prefill_peak_bytes
        assert cache.prefill_peak_bytes >= cache.nbytes() > 0
    one_layer = peaks["full"] / 6
    assert peaks["h2o"] < 2 * one_layer  # one whole layer, five at 10%, plus scores
    assert peaks["d2o"] > peaks["full"]  # every layer, plus scores


@pytest.mark.parametrize("budget", [0, -3, 0.0, 1.5, -0.1, "10", None, True])
def test_bad_budget(gqa_model, budget):
    with pytest.raises(ValueError, match="budget"):
        keepkv.CompressedCache(gqa_model.config, "h2o", budget)


def test_unknown_method_and_parameter(gqa_model):
    with pytest.raises(ValueError, match="choose one of"):
        keepkv.CompressedCache(gqa_model.config, "nope", 0.1)
    with pytest.raises(ValueError, match="recent_ratio"):
        keepkv.get_method("h2o", bogus=1)
    with pytest.raises(ValueError, match=r"\[0.0, 1.0\]"):
        keepkv.get_method("h2o", recent_ratio=2.0)
    with pytest.raises(ValueError, match="interval"):
        keepkv.get_method("window", interval=0)


def test_method_variants():
    variant = keepkv.get_method("keepkv+interval=8+zip_key=group")
    assert (variant.name, variant.interval, variant.merging.zip_key) == ("keepkv", 8, "group")
    assert keepkv.get_method("h2o+recent_ratio=0.25", interval=3).selection.recent_ratio == 0.25
    with pytest.raises(ValueError, match="NAME\\+KEY=VALUE"):
        keepkv.get_method("h2o+interval")
    with pytest.raises(ValueError, match="recent_ratio"):
        keepkv.get_method("h2o+bogus=1")


def test_unsupported_architecture():
    with pytest.raises(ValueError, match="llama"):
        keepkv.CompressedCache(GPT2Config(), "full")


class _Tokenizer:
    """Just enough tokenizer for the validation paths."""

    chat_template = None
    pad_token = eos_token = "<eos>"
    pad_token_id = 0


def test_bad_prompts_and_lengths(gqa_model):
    for prompts in ["", "   ", [], ["ok", ""]]:
        with pytest.raises(ValueError, match="non-empty"):
            keepkv.generate(gqa_model, _Tokenizer(), prompts)
    with pytest.raises(ValueError, match="max_new_tokens"):
        keepkv.generate(gqa_model, _Tokenizer(), "hello", max_new_tokens=-1)


@torch.no_grad()
def test_true_rope_positions_after_compression(gqa_model):
    """New tokens get the number of tokens seen as position, not the physical cache length."""
    keepkv.enable(gqa_model)
    input_ids, attention_mask = random_batch(length=30, pad=(0, 4))
    cache = keepkv.CompressedCache(gqa_model.config, "window", 8)
    gqa_model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache)
    assert cache.get_seq_length() == 30
    assert cache.layers[0].size == 8
    assert cache.layers[0].positions[:, 0].max(-1).values.tolist() == [29, 25]


def test_decode_attention_paths_agree():
    """A decode step without probabilities goes through SDPA with the bias as a float mask; it
    matches the explicit softmax path (which also returns the probabilities) on votes and holes."""
    from keepkv.attention import Needs, attend

    torch.manual_seed(0)
    batch, heads, kv_heads, size, dim = 3, 6, 2, 37, 16
    query = torch.randn(batch, heads, 1, dim)
    keys, values = torch.randn(batch, kv_heads, size, dim), torch.randn(batch, kv_heads, size, dim)
    bias = torch.randn(batch, kv_heads, size).abs().log1p()  # ln p for p >= 1 votes
    bias[:, :, 5:9] = float("-inf")  # empty slots
    block_mask = torch.ones(batch, 1, 1, 1, dtype=torch.bool)
    fast, _ = attend(query, keys, values, bias, block_mask, 0.3)
    explicit, stats = attend(query, keys, values, bias, block_mask, 0.3, Needs(probs=True))
    assert torch.allclose(fast, explicit, atol=1e-6)
    assert stats.probs[..., 5:9].abs().max() == 0  # the explicit path ran, holes get no weight
