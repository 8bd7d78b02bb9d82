"""A CompressedCache is only right on keepkv's attention path: off it, it is refused in one line,
and a cache that update() named but no attention call consumed never reaches another forward."""

import pytest
import torch

import keepkv
from keepkv.attention import ACTIVE_CACHE

from conftest import random_batch, tiny_model


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("layers", [1, 2])
@torch.no_grad()
def test_compressed_cache_on_a_model_off_the_keepkv_path_is_refused(implementation, layers):
    model = tiny_model("llama-gqa", layers=layers)
    model.set_attn_implementation(implementation)
    input_ids, attention_mask = random_batch(batch=2, length=12, pad=(0, 3))
    cache = keepkv.CompressedCache(model.config, "h2o", 8)
    with pytest.raises(ValueError, match="keepkv.enable") as error:
        model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache)
    assert "\n" not in str(error.value) and repr(implementation) in str(error.value)
    assert ACTIVE_CACHE.get() is None
    with pytest.raises(ValueError, match="keepkv.enable"):
        model.generate(input_ids=input_ids, attention_mask=attention_mask, past_key_values=
                       keepkv.CompressedCache(model.config, "full"), max_new_tokens=2, do_sample=False, pad_token_id=0)


@torch.no_grad()
def test_a_stale_active_cache_never_reaches_an_unrelated_forward():
    """update() named a cache that no attention call consumed (here: called by hand); the next
    forward of a keepkv model without a CompressedCache is plain SDPA, and the stale cache is
    left untouched."""
    model = tiny_model("llama-gqa", layers=2)
    input_ids, attention_mask = random_batch(batch=2, length=12, pad=(0, 3))
    model.set_attn_implementation("sdpa")
    reference = model(input_ids=input_ids, attention_mask=attention_mask).logits
    keepkv.enable(model)
    stale = keepkv.CompressedCache(model.config, "full")
    keys = torch.randn(2, 2, 12, 16)
    stale.update(keys, keys, 0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    torch.testing.assert_close(logits, reference)
    assert stale.layers[0].seen == 0 and stale.layers[1].seen == 0
    # ... and a CompressedCache forward after it still works as usual.
    cache = keepkv.CompressedCache(model.config, "full")
    stale.update(keys, keys, 1)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache).logits
    real = attention_mask.bool()  # a padded query's output is free (keepkv lets it see itself)
    torch.testing.assert_close(logits[real], reference[real], atol=1e-5, rtol=1e-5)
    assert stale.layers[1].seen == 0 and cache.layers[1].seen == 12
