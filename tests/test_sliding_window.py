"""Sliding-window models: keepkv does not mask entries that left a window, so a run whose context
exceeds the window is refused in one line before anything runs; a window it never exceeds
changes nothing."""

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

import keepkv
from keepkv.models import check_context, sliding_window

from conftest import VOCAB, CharTokenizer, random_batch

COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
)


def tiny_mistral(window):
    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(sliding_window=window, **COMMON)).eval()


@torch.no_grad()
def _decode(model, cache, input_ids, attention_mask, steps):
    """Logits [B, steps + 1, V] of the prefill's last token and of ``steps`` greedy steps."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache)
    cache, logits, mask = out.past_key_values, [out.logits[:, -1]], attention_mask
    for _ in range(steps):
        token = logits[-1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
        logits.append(model(input_ids=token, attention_mask=mask, past_key_values=cache).logits[:, -1])
    return torch.stack(logits, dim=1)


@pytest.mark.parametrize("method", ["full", "h2o"])
def test_mistral_whose_window_the_run_exceeds_is_refused(method):
    """8-token window, 24-token prompt: HF's own model attends over the last 8 tokens only."""
    model = tiny_mistral(window=8)
    input_ids, attention_mask = random_batch(batch=2, length=24, pad=(0, 5))
    keepkv.enable(model)
    cache = keepkv.CompressedCache(model.config, method, 1000)
    with pytest.raises(ValueError, match="sliding-window") as error:
        _decode(model, cache, input_ids, attention_mask, steps=4)
    assert "\n" not in str(error.value) and "8" in str(error.value)
    assert all(layer.seen == 0 for layer in cache.layers)  # refused before anything was stored


def test_a_window_the_run_never_exceeds_changes_nothing():
    """24-token prompt and 4 steps under a 64-token window: keepkv's logits are HF's."""
    model = tiny_mistral(window=64)
    input_ids, attention_mask = random_batch(batch=2, length=24, pad=(0, 5))
    model.set_attn_implementation("sdpa")
    reference = _decode(model, None, input_ids, attention_mask, steps=4)
    keepkv.enable(model)
    logits = _decode(model, keepkv.CompressedCache(model.config, "full"), input_ids, attention_mask, steps=4)
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)


def test_a_decode_step_that_would_leave_the_window_is_refused():
    model = tiny_mistral(window=26)
    input_ids, attention_mask = random_batch(batch=1, length=24, pad=(0,))
    keepkv.enable(model)
    cache = keepkv.CompressedCache(model.config, "full")
    _decode(model, cache, input_ids, attention_mask, steps=2)  # 26 tokens: the window is full
    with pytest.raises(ValueError, match="needs 27"):
        _decode(model, cache, input_ids[:, :1], torch.ones(1, 27, dtype=torch.long), steps=0)


def test_keepkv_generate_refuses_before_it_runs():
    model = tiny_mistral(window=16)
    with pytest.raises(ValueError, match="sliding-window.*16"):
        keepkv.generate(model, CharTokenizer(), "a prompt of twelve", method="full", max_new_tokens=4, chat=False)


def test_which_configs_slide():
    assert sliding_window(MistralConfig(sliding_window=4096, **COMMON)) == 4096
    assert sliding_window(MistralConfig(sliding_window=None, **COMMON)) is None
    assert sliding_window(Qwen2Config(**COMMON)) is None  # use_sliding_window is off by default
    qwen = Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=1, **COMMON)
    assert qwen.layer_types == ["full_attention", "sliding_attention"] and sliding_window(qwen) == 8
    check_context(qwen, 8)
    with pytest.raises(ValueError, match="qwen2 attends over the last 8 tokens and the run needs 9"):
        check_context(qwen, 9)


def test_qwen2_sliding_layers_are_refused_past_their_window():
    torch.manual_seed(0)
    config = Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=1, **COMMON)
    model = Qwen2ForCausalLM(config).eval()
    input_ids, attention_mask = random_batch(batch=1, length=12, pad=(0,))
    keepkv.enable(model)
    with pytest.raises(ValueError, match="sliding-window"):
        _decode(model, keepkv.CompressedCache(model.config, "full"), input_ids, attention_mask, steps=1)
