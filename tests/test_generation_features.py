"""Generation features a user expects from model.generate, with a CompressedCache: seeded sampling,
num_return_sequences, TextStreamer, stop strings, and generate() called twice on one cache."""

import pytest
import torch
from transformers import TextStreamer

import keepkv

from conftest import char_tokenizer, random_batch, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::keepkv.KeepKVWarning")
SAMPLING = dict(do_sample=True, temperature=0.8, top_p=0.9, top_k=0, pad_token_id=0)


def _generate(model, cache, input_ids, attention_mask, seed=None, **options):
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, **options)


@pytest.mark.parametrize("method", ["full", "h2o", "snapkv", "keepkv"])
def test_seeded_sampling_with_a_budget_that_covers_everything_equals_hf(method):
    """do_sample, temperature, top_p and num_return_sequences with a seed: the tokens of HF's own cache."""
    model = tiny_model("llama-gqa", layers=2)
    input_ids, attention_mask = random_batch(batch=2, length=16, pad=(0, 5))
    options = dict(SAMPLING, max_new_tokens=10, num_return_sequences=2)
    model.set_attn_implementation("sdpa")
    reference = _generate(model, None, input_ids, attention_mask, seed=3, **options)
    keepkv.enable(model)
    output = _generate(model, keepkv.CompressedCache(model.config, method, 1000), input_ids, attention_mask, 3, **options)
    assert torch.equal(output, reference)


@pytest.mark.parametrize("method", ["h2o", "snapkv", "keepkv", "kvreviver"])
def test_seeded_sampling_with_compression_is_repeatable_and_each_row_is_its_prompt_alone(method):
    """The same seed gives the same tokens; each row's logits along its sampled tokens are those of its
    prompt alone, fed the same tokens (the batch changes nothing but the random draws)."""
    model = tiny_model("llama-gqa", layers=2)
    input_ids, attention_mask = random_batch(batch=3, length=24, pad=(0, 6, 11))
    keepkv.enable(model)
    options = dict(SAMPLING, max_new_tokens=8, min_new_tokens=8, return_dict_in_generate=True, output_logits=True)
    runs = [
        _generate(model, keepkv.CompressedCache(model.config, method, 12), input_ids, attention_mask, 5, **options)
        for _ in range(2)
    ]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    new = runs[0].sequences[:, input_ids.shape[1] :]
    batch_logits = torch.stack(runs[0].logits, dim=1)  # [B, steps, V]
    for row in range(3):
        real = attention_mask[row].bool()
        alone = keepkv.CompressedCache(model.config, method, 12)
        with torch.no_grad():
            logits = [model(input_ids=input_ids[row : row + 1, real], past_key_values=alone).logits[:, -1]]
            for token in new[row, :-1]:
                logits.append(model(input_ids=token.view(1, 1), past_key_values=alone).logits[:, -1])
        torch.testing.assert_close(torch.cat(logits), batch_logits[row], atol=1e-4, rtol=1e-4)


def test_text_streamer_streams_what_generate_returns(capsys):
    model = tiny_model("llama-gqa", layers=2)
    tokenizer = char_tokenizer()
    inputs = tokenizer(["keepkv streams text"], return_tensors="pt")
    keepkv.enable(model)
    streamer = TextStreamer(tokenizer, skip_prompt=True)
    cache = keepkv.CompressedCache(model.config, "h2o", 8)
    output = _generate(model, cache, inputs["input_ids"], inputs["attention_mask"], streamer=streamer,
                       max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    text = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :])
    assert len(text) == 12 and capsys.readouterr().out == text + "\n"


@pytest.mark.parametrize("method", ["full", "h2o", "kvreviver"])
def test_stop_strings_stop_where_the_text_first_ends_with_one(method):
    model = tiny_model("llama-gqa", layers=2)
    tokenizer = char_tokenizer()
    inputs = tokenizer(["where does it stop?"], return_tensors="pt")
    keepkv.enable(model)
    options = dict(max_new_tokens=16, min_new_tokens=1, do_sample=False, pad_token_id=0)
    free = _generate(model, keepkv.CompressedCache(model.config, method, 8), **inputs, **options)
    free = free[0, inputs["input_ids"].shape[1] :].tolist()
    stop = tokenizer.decode(free[4:6])
    k = next(k for k in range(1, len(free) + 1) if tokenizer.decode(free[:k]).endswith(stop))
    stopped = _generate(model, keepkv.CompressedCache(model.config, method, 8), **inputs, **options,
                        stop_strings=[stop], tokenizer=tokenizer)
    assert stopped[0, inputs["input_ids"].shape[1] :].tolist() == free[:k]
    assert k < len(free)


@torch.no_grad()
def test_generate_twice_on_one_cache_continues_the_sequence_or_is_refused():
    """Documented behaviour: a second generate() on a cache continues its sequence (input_ids: the
    whole sequence so far plus new tokens); a new prompt on a used cache is refused in one line."""
    model = tiny_model("llama-gqa", layers=2)
    input_ids, attention_mask = random_batch(batch=2, length=16, pad=(0, 4))
    keepkv.enable(model)
    options = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    cache = keepkv.CompressedCache(model.config, "full")
    first = _generate(model, cache, input_ids, attention_mask, **options)
    more = torch.cat([first, torch.randint(3, 100, (2, 3), generator=torch.Generator().manual_seed(2))], dim=-1)
    more_mask = torch.cat([attention_mask, torch.ones(2, more.shape[1] - attention_mask.shape[1], dtype=torch.long)], -1)
    continued = _generate(model, cache, more, more_mask, **options)
    fresh = _generate(model, keepkv.CompressedCache(model.config, "full"), more, more_mask, **options)
    assert torch.equal(continued, fresh)
    for method in ("full", "h2o"):
        cache = keepkv.CompressedCache(model.config, method, 8)
        own = _generate(model, cache, input_ids, attention_mask, **options)
        with pytest.raises(ValueError, match="does not continue it") as error:
            _generate(model, cache, input_ids, attention_mask, **options)
        assert "\n" not in str(error.value)
        if not torch.equal(own, first):  # another cache's answer does not continue this one
            with pytest.raises(ValueError, match="other token ids"):
                _generate(model, cache, more, more_mask, **options)
        seen = cache.layers[0].seen
        own_more = torch.cat([own, more[:, first.shape[1]:]], dim=-1)
        _generate(model, cache, own_more, more_mask, **options)  # a compressed cache continues too
        assert cache.layers[0].seen == seen + more.shape[1] - first.shape[1] + 1 + 4
