"""Misuse refused in one line at the first call that can tell."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import keepkv

from conftest import random_batch, tiny_model


def one_line(error) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("other", [
    dict(kind="llama-mha"),  # other KV heads
    dict(kind="llama-gqa", layers=3),  # deeper
])
def test_a_cache_built_from_another_models_config_is_refused_at_its_first_forward(other):
    built_for = tiny_model("llama-gqa", layers=2)
    keepkv.enable(built_for)  # its config names keepkv's attention too: only the shapes differ
    model = tiny_model(other["kind"], layers=other.get("layers", 2))
    cache = keepkv.CompressedCache(built_for.config, "snapkv", 0.5)
    input_ids, attention_mask = random_batch()
    with keepkv.enabled(model), pytest.raises(ValueError, match="built from the config of a model with") as error:
        model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache)
    assert "CompressedCache(model.config" in one_line(error)


def test_enabled_refuses_an_unsupported_model_before_touching_it():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0))
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'") as error:
        with keepkv.enabled(model):
            pass
    one_line(error)
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        keepkv.enable(model)
    assert model.config._attn_implementation == before
    with pytest.raises(ValueError, match="must be a transformers causal LM"):
        keepkv.enable(torch.nn.Linear(2, 2))
