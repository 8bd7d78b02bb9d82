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
def _compressed_at_context_end(model, tokenizer, context, question, method, budget, new_tokens, decoding):
    """The reference: ONE model.generate over context + question, the prefill announced as the
    context (start_prefill) and chunked at its end, so the cache compresses there and the question
    is its second chunk."""
    head, tail = context_and_question_ids(tokenizer, context, question, chat=True)
    input_ids = torch.tensor([head + tail])
    mask = torch.ones_like(input_ids)
    cache = keepkv.CompressedCache(model.config, method, budget, decoding=decoding)
    cache.start_prefill(mask[:, : len(head)])
    keepkv.enable(model)
    output = model.generate(
        input_ids=input_ids, attention_mask=mask, past_key_values=cache, prefill_chunk_size=len(head),
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
    )
    new = output[:, input_ids.shape[1] :]
    return tokenizer.batch_decode(new, skip_special_tokens=True)[0].strip(), int((new != tokenizer.pad_token_id).sum())


@settings(max_examples=12)
@given(
    method=st.sampled_from(METHODS),
    budget=st.sampled_from([36, 48, 0.3, 0.5]),  # entry counts hold every method's protected tokens
    context_length=st.integers(40, 90),
    question=LETTERS.filter(lambda q: len(q) <= 20 and q.strip()),
    seed=st.integers(0, 1000),
    decoding=st.sampled_from(["append", "compress"]),
)
def test_a_question_on_the_compressed_context_equals_one_sequence_compressed_at_the_context_end(
    model, tokenizer, method, budget, context_length, question, seed, decoding
):
    generator = torch.Generator().manual_seed(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz ."
    context = "".join(alphabet[i] for i in torch.randint(len(alphabet), (context_length,), generator=generator))
    new_tokens = 6
    cache = keepkv.compress(model, tokenizer, context, method=method, budget=budget, decoding=decoding)
    [result] = keepkv.generate(model, tokenizer, question, max_new_tokens=new_tokens, past_key_values=cache)
    expected, count = _compressed_at_context_end(model, tokenizer, context, question, method, budget, new_tokens, decoding)
    assert result.answer == expected
    assert result.new_tokens == count  # the tokens it generated (a random model may emit the pad id)


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


@pytest.mark.parametrize("method", ["kvzip", "keepkv+selection=kvzip", "snapkv"])
def test_decoding_append_lets_the_question_in_and_evicts_nothing_of_the_context(model, tokenizer, method):
    """decoding="append": every entry the compression kept is still there once the question is
    appended, which is appended whole; "compress" keeps the budget while it comes in."""
    context = "the quick brown fox jumps over the lazy dog and runs away. " * 3
    for decoding in ("append", "compress"):
        cache = keepkv.compress(model, tokenizer, context, method=method, budget=40, decoding=decoding)
        before = [set(layer.positions[0, 0][layer.live()[0, 0]].tolist()) for layer in cache.layers]
        _, tail = context_and_question_ids(tokenizer, "", "what runs?", True)
        ids = torch.tensor([cache.context_ids + tail])
        asked = cache.copy()
        with keepkv.enabled(model), torch.no_grad():
            model(input_ids=ids[:, len(cache.context_ids):], attention_mask=torch.ones_like(ids), past_key_values=asked)
        after = [set(layer.positions[0, 0][layer.live()[0, 0]].tolist()) for layer in asked.layers]
        if decoding == "append":
            assert all(b <= a and len(a) == len(b) + len(tail) for b, a in zip(before, after))
        else:
            assert all(len(a) <= int(layer.budget.max()) for a, layer in zip(after, asked.layers))
            assert any(not b <= a for b, a in zip(before, after))  # context entries made room
        [result] = keepkv.generate(model, tokenizer, "what runs?", max_new_tokens=4, past_key_values=cache)
        # append: the question and every answer token but the last (generate feeds it no more) join the 40
        assert result.kept_entries == (40 + len(tail) + result.new_tokens - 1 if decoding == "append" else 40)


def test_keepkv_runs_on_the_best_selection_of_each_setting(model, tokenizer):
    """keepkv.compress (a context compressed before its question) runs KeepKV's merge on KVzip's
    selection; CompressedCache and keepkv.generate (the question inside the prompt, a long
    generation) on SnapKV's; a named selection wins in both; other methods are what they are."""
    context = "the quick brown fox jumps over the lazy dog and runs away. " * 3
    once = keepkv.compress(model, tokenizer, context, method="keepkv", budget=40)
    assert (once.method.selection.name, once.method.merging.name) == ("kvzip", "keepkv")
    assert once.method_spec == "keepkv"
    named = keepkv.compress(model, tokenizer, context, method="keepkv+selection=snapkv", budget=40)
    assert named.method.selection.name == "snapkv"
    assert keepkv.compress(model, tokenizer, context, method="keepkv", budget=40, threshold=0.9).method.merging.threshold == 0.9
    assert keepkv.CompressedCache(model.config, "keepkv", 40).method.selection.name == "snapkv"
    assert keepkv.get_method("keepkv").selection.name == "snapkv"
    assert keepkv.get_method("snapkv", compress_once=True) == keepkv.get_method("snapkv")
    [result] = keepkv.generate(model, tokenizer, context, method="keepkv", budget=40, max_new_tokens=4)
    [snap] = keepkv.generate(model, tokenizer, context, method="keepkv+selection=snapkv", budget=40, max_new_tokens=4)
    assert result.method == "keepkv" and (result.answer, result.kept_entries) == (snap.answer, snap.kept_entries)
