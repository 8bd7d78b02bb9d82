"""Compress once, ask many: keepkv.compress() then questions on copies of the compressed context."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import keepkv
from keepkv.generation import context_and_question_ids

from conftest import tiny_model
from conftest import char_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::keepkv.KeepKVWarning")
METHODS = ["h2o", "snapkv", "keepkv", "streamingllm", "pyramidkv", "zeromerge", "kvreviver", "d2o", "cam"]
LETTERS = st.text(alphabet="abcdefghij klmnopqrstuvwxyz.", min_size=1)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama-gqa", layers=2)


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


def _state(cache) -> list[torch.Tensor]:
    """Every tensor of every layer (entries, buffers, extras, method state), and the lengths."""
    tensors = []
    for layer in cache.layers:
        tensors += [layer.keys, layer.values, layer.bias, layer.positions, layer.real_seen]
        tensors += [*layer.extras.values(), *layer.buffers.values()]
        tensors += [v for v in layer.state.values() if isinstance(v, torch.Tensor)]
        tensors.append(torch.tensor([layer.seen, layer.pending]))
    return [t.clone() for t in tensors]


@torch.no_grad()
def _compressed_at_context_end(model, tokenizer, context, question, method, budget, new_tokens):
    """The reference: ONE model.generate over context + question, the prefill announced as the
    context (start_prefill) and chunked at its end, so the cache compresses there and the question
    is its second chunk."""
    head, tail = context_and_question_ids(tokenizer, context, question, chat=True)
    input_ids = torch.tensor([head + tail])
    mask = torch.ones_like(input_ids)
    cache = keepkv.CompressedCache(model.config, method, budget)
    cache.start_prefill(mask[:, : len(head)])
    keepkv.enable(model)
    output = model.generate(
        input_ids=input_ids, attention_mask=mask, past_key_values=cache, prefill_chunk_size=len(head),
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
    )
    return tokenizer.batch_decode(output[:, input_ids.shape[1] :], skip_special_tokens=True)[0].strip()


@settings(max_examples=12)
@given(
    method=st.sampled_from(METHODS),
    budget=st.sampled_from([36, 48, 0.3, 0.5]),  # entry counts hold every method's protected tokens
    context_length=st.integers(40, 90),
    question=LETTERS.filter(lambda q: len(q) <= 20),
    seed=st.integers(0, 1000),
)
def test_a_question_on_the_compressed_context_equals_one_sequence_compressed_at_the_context_end(
    model, tokenizer, method, budget, context_length, question, seed
):
    generator = torch.Generator().manual_seed(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz ."
    context = "".join(alphabet[i] for i in torch.randint(len(alphabet), (context_length,), generator=generator))
    new_tokens = 6
    cache = keepkv.compress(model, tokenizer, context, method=method, budget=budget)
    [result] = keepkv.generate(model, tokenizer, question, max_new_tokens=new_tokens, past_key_values=cache)
    expected = _compressed_at_context_end(model, tokenizer, context, question, method, budget, new_tokens)
    assert result.answer == expected
    assert result.new_tokens == new_tokens


@pytest.mark.parametrize("method", ["keepkv", "h2o", "kvreviver"])
def test_questions_leave_the_compressed_context_untouched_and_do_not_see_each_other(model, tokenizer, method):
    context = "the quick brown fox jumps over the lazy dog. " * 3
    cache = keepkv.compress(model, tokenizer, context, method=method, budget=40)
    before = _state(cache)
    questions = ["what jumps?", "which dog is it?", "say it again"]
    together = keepkv.generate(model, tokenizer, questions, max_new_tokens=8, past_key_values=cache)
    after = _state(cache)
    assert len(before) == len(after)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    alone = [
        keepkv.generate(model, tokenizer, q, max_new_tokens=8,
                        past_key_values=keepkv.compress(model, tokenizer, context, method=method, budget=40))[0]
        for q in questions
    ]
    assert [r.answer for r in together] == [r.answer for r in alone]
    assert all(r.budget == 40 and r.method == method for r in together)


def test_a_copy_decodes_like_the_original(model, tokenizer):
    cache = keepkv.compress(model, tokenizer, "a b c d e f g h i j k l m n o p q r s t " * 3, method="keepkv", budget=40)
    first = keepkv.generate(model, tokenizer, "q?", max_new_tokens=5, past_key_values=cache.copy())
    second = keepkv.generate(model, tokenizer, "q?", max_new_tokens=5, past_key_values=cache)
    assert first[0].answer == second[0].answer


def test_the_full_cache_on_a_compressed_context_equals_plain_generation(model, tokenizer):
    """Nothing compressed: the split prompt gives the answer of the whole prompt in one prefill."""
    context, question = "hello there, this is the document.", "what is it?"
    cache = keepkv.compress(model, tokenizer, context, method="full")
    [asked] = keepkv.generate(model, tokenizer, question, max_new_tokens=6, past_key_values=cache)
    [whole] = keepkv.generate(model, tokenizer, context + "\n\n" + question, max_new_tokens=6)
    assert asked.answer == whole.answer
    assert asked.prompt_tokens == whole.prompt_tokens


def test_bad_uses_are_refused_in_one_line(model, tokenizer):
    cache = keepkv.compress(model, tokenizer, "some context here", method="h2o", budget=8)
    with pytest.raises(ValueError, match="the cache's"):
        keepkv.generate(model, tokenizer, "q", past_key_values=cache, method="snapkv")
    with pytest.raises(ValueError, match="keepkv.compress"):
        keepkv.generate(model, tokenizer, "q", past_key_values=keepkv.CompressedCache(model.config, "h2o", 8))
    with pytest.raises(ValueError, match="context"):
        keepkv.compress(model, tokenizer, "  ", method="h2o", budget=8)
