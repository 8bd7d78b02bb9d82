"""KVzip's and KeyDiff's decoding window: compressing while decoding keeps the newest generated
tokens (their decode-time scores cannot compete with the prompt's), and the prompt's own
compression is the paper's, window or not."""

import pytest
import torch

import keepkv

from conftest import char_tokenizer, tiny_model

CONTEXT = "the quick brown fox jumps over the lazy dog. " * 4
GENERATED = 12


@pytest.fixture(scope="module")
def model():
    model = tiny_model("llama-gqa", layers=2)
    keepkv.enable(model)
    return model


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@torch.no_grad()
def decoded(model, tokenizer, method, budget=24):
    """The cache of ``CONTEXT`` compressed at ``budget``, then GENERATED greedy tokens decoded
    with a compression at every step."""
    cache = keepkv.compress(model, tokenizer, CONTEXT, method=method, budget=budget, decoding="compress")
    seen = cache.layers[0].seen
    ids = torch.tensor([[5]])
    for _ in range(GENERATED):
        out = model(input_ids=ids, attention_mask=torch.ones(1, seen + 1, dtype=torch.long), past_key_values=cache)
        seen += 1
        ids = out.logits[:, -1:].argmax(-1)
    return cache


def newest_missing(cache, window: int, sinks: int) -> list[tuple]:
    """(layer, head, position) of each of the newest min(window, generated, budget - sinks) tokens
    a head does not hold."""
    missing = []
    for layer in cache.layers:
        seen = int(layer.real_seen[0])
        for head, (positions, budget) in enumerate(zip(layer.positions[0], layer.budget[0].tolist())):
            held = set(positions[positions >= 0].tolist())
            count = min(window, GENERATED, budget - min(sinks, budget))
            missing += [(layer.layer_idx, head, p) for p in range(seen - count, seen) if p not in held]
    return missing


@pytest.mark.parametrize("method", ["kvzip", "keydiff"])
def test_decoding_under_the_budget_keeps_the_newest_generated_tokens(model, tokenizer, method):
    selection = keepkv.get_method(method).selection
    cache = decoded(model, tokenizer, method)
    assert all(int(layer.live_counts().max()) <= int(layer.budget.max()) for layer in cache.layers)
    assert newest_missing(cache, selection.window, selection.sinks) == []


@pytest.mark.parametrize("method", ["kvzip", "keydiff"])
def test_without_the_window_a_generated_token_is_evicted_at_once(model, tokenizer, method):
    """The paper's rule (window=0): some head has lost one of its newest tokens already."""
    cache = decoded(model, tokenizer, f"{method}+window=0")
    assert newest_missing(cache, 16, keepkv.get_method(method).selection.sinks) != []


@pytest.mark.parametrize("method", ["kvzip", "keydiff"])
def test_the_window_leaves_the_prompts_compression_as_it_was(model, tokenizer, method):
    caches = [keepkv.compress(model, tokenizer, CONTEXT, method=spec, budget=24) for spec in (method, f"{method}+window=0")]
    for with_window, without in zip(*(cache.layers for cache in caches)):
        assert torch.equal(with_window.positions, without.positions)
        assert torch.equal(with_window.keys, without.keys)
