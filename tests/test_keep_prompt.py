"""decoding="keep_prompt": the prompt is kept whole (never evicted, merged into or moved) and the
method keeps ``budget`` of the generated entries, so a long generation stays within prompt +
budget + interval entries per layer and head."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import keepkv
from keepkv import CompressedCache
from keepkv.budgets import capacity_bound, check_keep_prompt, KEEP_PROMPT_MERGES
from keepkv.methods import get_method

from conftest import prefill, random_batch, run_generate, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::keepkv.KeepKVWarning")

# Every selection a kept prompt can run with, with each merge it takes.
KEEP_PROMPT_METHODS = [
    "window", "streamingllm", "snapkv", "h2o", "pyramidkv", "keydiff", "keepkv",
    "snapkv+merge=zip", "h2o+merge=keepkv", "keepkv+selection=snapkv",
]
MODEL = tiny_model("llama-gqa")


def _prompt_entries(cache, layer, row, prompt):
    """The (position-sorted) keys, values and bias of a row's prompt entries in one layer."""
    store = cache.layers[layer]
    positions = store.positions[row]  # [H_kv, S]
    order = positions.masked_fill(positions < 0, 1 << 40).argsort(-1)[:, :prompt]
    take = order[..., None].expand(-1, -1, store.keys.shape[-1])
    return (store.keys[row].gather(1, take), store.values[row].gather(1, take),
            store.bias[row].gather(1, order), positions.gather(1, order))


@settings(max_examples=24, deadline=None)
@given(method=st.sampled_from(KEEP_PROMPT_METHODS), generated=st.integers(36, 48), steps=st.integers(1, 40),
       pad=st.tuples(st.integers(0, 12), st.integers(0, 12)))
@torch.no_grad()
def test_prompt_entries_never_change_and_the_cache_stays_within_its_bound(method, generated, steps, pad):
    """Rows of unequal prompts: after any number of decode steps each row still holds every prompt
    entry as its prefill left it, bit for bit, with one vote, and at most prompt + budget +
    interval entries."""
    input_ids, attention_mask = random_batch(batch=2, length=30, pad=pad, seed=3)
    cache = CompressedCache(MODEL.config, method, generated, decoding="keep_prompt")
    prompts = attention_mask.sum(-1).tolist()
    layers = range(MODEL.config.num_hidden_layers)
    logits = prefill(MODEL, cache, input_ids, attention_mask)
    after_prefill = {(layer, row): _prompt_entries(cache, layer, row, prompt)
                     for layer in layers for row, prompt in enumerate(prompts)}
    mask = attention_mask
    for _ in range(steps):
        token = logits.argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
        logits = MODEL(input_ids=token, attention_mask=mask, past_key_values=cache).logits[:, -1]
    interval = cache.method.interval
    for layer in layers:
        live = cache.layers[layer].live_counts()  # [B, H_kv]
        for row, prompt in enumerate(prompts):
            assert int(live[row].max()) <= prompt + generated + interval
            assert int(live[row].min()) >= min(prompt + steps, prompt + generated)
            kept = _prompt_entries(cache, layer, row, prompt)
            assert torch.equal(kept[3], torch.arange(prompt).expand_as(kept[3])), "a prompt entry left"
            for got, want in zip(kept, after_prefill[layer, row]):
                assert torch.equal(got, want)
            assert (kept[2] == 0).all()


@pytest.mark.parametrize("method", ["snapkv", "keepkv", "window"])
def test_a_budget_that_holds_every_generated_token_gives_the_full_cache_tokens(method):
    input_ids, attention_mask = random_batch(batch=2, length=24, pad=(0, 5))
    full, _ = run_generate(MODEL, input_ids, attention_mask, "full", 1.0, new_tokens=12)
    kept, cache = run_generate(MODEL, input_ids, attention_mask, method, 64, new_tokens=12, decoding="keep_prompt")
    assert torch.equal(kept, full)
    assert cache.layers[0].frozen.tolist() == attention_mask.sum(-1).tolist()


def test_generated_entries_are_compressed_to_the_budget():
    """A generation longer than the budget evicts generated entries only, and ends at the budget."""
    input_ids, attention_mask = random_batch(batch=1, length=20, pad=(0,))
    _, cache = run_generate(MODEL, input_ids, attention_mask, "snapkv", 36, new_tokens=60, decoding="keep_prompt")
    layer = cache.layers[0]
    positions = layer.positions[0]  # [H_kv, S]
    live = positions >= 0
    assert int(live.sum(-1).max()) <= 20 + 36 + cache.method.interval
    assert (positions[:, :20] == torch.arange(20)).all(), "the prompt's entries stay in their slots"
    generated = (positions >= 20) & live
    assert int(generated.sum(-1).min()) >= 36 - cache.method.interval
    assert int(positions.max()) == 20 + 60 - 2  # the newest token is kept (its recent window)


def test_merges_never_write_into_the_prompt():
    """KeepKV's ZIP-merge takes only generated entries as targets: the prompt's votes stay 1."""
    input_ids, attention_mask = random_batch(batch=2, length=24, pad=(0, 3))
    _, cache = run_generate(MODEL, input_ids, attention_mask, "keepkv+threshold=-1", 36, new_tokens=50,
                            decoding="keep_prompt")
    for layer in cache.layers:
        frozen = layer.frozen_entries()
        assert frozen.any()
        assert (layer.bias[frozen] == 0).all()
        assert not layer.binary_bias(), "some generated entry took a merge"


@pytest.mark.parametrize("method, budget, message", [
    ("snapkv", 0.5, "give an int"),
    ("d2o", 40, "merge none, zip, keepkv"),
    ("full", 40, "merge none, zip, keepkv"),
    ("kvzip", 40, "reconstruction pass"),
    ("snapkv", 8, "protected"),
])
def test_refusals_are_one_line(method, budget, message):
    with pytest.raises(ValueError, match=message) as error:
        CompressedCache(MODEL.config, method, budget, decoding="keep_prompt")
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=message):
        capacity_bound(method, 100, budget, MODEL.config, keep_prompt=True)


@given(prompt=st.integers(1, 5000), generated=st.integers(40, 4096), method=st.sampled_from(KEEP_PROMPT_METHODS))
def test_capacity_bound_is_prompt_plus_budget_plus_interval(prompt, generated, method):
    bound = capacity_bound(method, prompt, generated, MODEL.config, keep_prompt=True)
    assert bound == [prompt + generated + get_method(method).interval] * MODEL.config.num_hidden_layers


def test_every_kept_prompt_method_is_accepted():
    for method in KEEP_PROMPT_METHODS:
        assert get_method(method).merging.name in KEEP_PROMPT_MERGES
        check_keep_prompt(get_method(method), 40)


def test_compress_refuses_keep_prompt():
    from conftest import char_tokenizer

    with pytest.raises(ValueError, match="keepkv.compress compresses the context") as error:
        keepkv.compress(MODEL, char_tokenizer(), "some context", method="snapkv", budget=64, decoding="keep_prompt")
    assert "\n" not in str(error.value)


def test_generate_keeps_the_prompt_and_answers():
    """keepkv.generate(decoding="keep_prompt") through the public API: the answer of a budget that
    holds every generated token is the full cache's."""
    from conftest import char_tokenizer

    tokenizer = char_tokenizer()
    full = keepkv.generate(MODEL, tokenizer, "a prompt of some length", method="full", max_new_tokens=16, chat=False)
    kept = keepkv.generate(MODEL, tokenizer, "a prompt of some length", method="snapkv", budget=64,
                           decoding="keep_prompt", max_new_tokens=16, chat=False)
    assert kept[0].answer == full[0].answer and kept[0].kept_entries == 23 + 15
