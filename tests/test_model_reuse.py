"""keepkv leaves the model usable: plain forward and generate after keepkv equal SDPA's."""

import pytest
import torch
from transformers import DynamicCache

import keepkv

from conftest import CharTokenizer, random_batch, run_generate, tiny_model


@torch.no_grad()
def plain_generate(model, input_ids, attention_mask, **kwargs):
    return model.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=8, min_new_tokens=8,
        do_sample=False, pad_token_id=0, **kwargs,
    )


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2"])
def test_plain_generate_unchanged_by_keepkv_calls(kind):
    model = tiny_model(kind)
    model.set_attn_implementation("sdpa")
    input_ids, attention_mask = random_batch(length=20, pad=(0, 5))
    before = plain_generate(model, input_ids, attention_mask)
    keepkv.generate(model, CharTokenizer(), ["a longer prompt for the cache", "short"], "snapkv", 6,
                    max_new_tokens=4, window=2)
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(plain_generate(model, input_ids, attention_mask), before)
    # Left on keepkv's path (keepkv.enable), the model still generates as SDPA does, with or without a cache.
    run_generate(model, input_ids, attention_mask, "h2o", 6)
    assert model.config._attn_implementation == "keepkv"
    assert torch.equal(plain_generate(model, input_ids, attention_mask), before)
    assert torch.equal(plain_generate(model, input_ids, attention_mask, use_cache=False), before)


@torch.no_grad()
def test_keepkv_path_without_compressed_cache_is_sdpa(gqa_model):
    input_ids, attention_mask = random_batch(length=16, pad=(0, 3))
    gqa_model.set_attn_implementation("sdpa")
    reference = gqa_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    keepkv.enable(gqa_model)
    for cache in (None, DynamicCache(config=gqa_model.config)):
        logits = gqa_model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache,
                           use_cache=cache is not None).logits
        assert torch.equal(logits, reference)


def test_enabled_restores_the_implementation_even_on_error(gqa_model):
    gqa_model.set_attn_implementation("eager")
    with keepkv.enabled(gqa_model) as model:
        assert model.config._attn_implementation == "keepkv"
    assert gqa_model.config._attn_implementation == "eager"
    with pytest.raises(ZeroDivisionError), keepkv.enabled(gqa_model):
        1 / 0
    assert gqa_model.config._attn_implementation == "eager"
