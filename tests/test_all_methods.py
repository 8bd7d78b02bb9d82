"""Properties every registered method must have (new methods are picked up automatically)."""

import pytest
import torch

import keepkv
from keepkv.methods import METHODS

from conftest import decode_loop, random_batch, run_generate, tiny_model

ALL = sorted(METHODS)


@pytest.mark.parametrize("method", ALL)
def test_budget_covering_sequence_equals_full(method):
    model = tiny_model("llama-gqa")
    input_ids, attention_mask = random_batch(pad=(0, 5))
    reference, _ = run_generate(model, input_ids, attention_mask, "full", new_tokens=12)
    tokens, cache = run_generate(model, input_ids, attention_mask, method, budget=64, new_tokens=12)
    assert torch.equal(tokens, reference)


@pytest.mark.parametrize("method", [m for m in ALL if m != "full"])
def test_memory_stays_within_budget_over_300_steps(method):
    model = tiny_model("llama-gqa")
    input_ids, attention_mask = random_batch(length=40, pad=(0, 7))
    budget = 16
    cache = keepkv.CompressedCache(model.config, method, budget)
    for step, cache in enumerate(decode_loop(model, input_ids, attention_mask, cache, steps=300)):
        for layer in cache.layers:
            assert int(layer.live_counts().max()) <= int(layer.bound.max()), (step, layer.layer_idx)
            assert (layer.live_counts() <= layer.bound).all()
    assert sum(layer.size for layer in cache.layers) <= cache.num_layers * (budget * 3 + 1)


@pytest.mark.parametrize("method", ALL)
def test_batch_row_equals_single_prompt(method):
    model = tiny_model("llama-gqa")
    input_ids, attention_mask = random_batch(length=30, pad=(0, 9))
    batched, _ = run_generate(model, input_ids, attention_mask, method, budget=0.5, new_tokens=16)
    for row in range(2):
        real = attention_mask[row].bool()
        alone, _ = run_generate(model, input_ids[row : row + 1, real], attention_mask[row : row + 1, real], method, 0.5, 16)
        assert torch.equal(batched[row], alone[0]), row


@pytest.mark.parametrize("method", ALL)
def test_runs_are_deterministic(method):
    model = tiny_model("llama-mha")
    input_ids, attention_mask = random_batch(length=30)
    first, _ = run_generate(model, input_ids, attention_mask, method, budget=10, new_tokens=20)
    second, _ = run_generate(model, input_ids, attention_mask, method, budget=10, new_tokens=20)
    assert torch.equal(first, second)


@pytest.mark.parametrize("method", ALL)
def test_listed_with_parameters(method):
    described = {entry["name"]: entry for entry in keepkv.describe_methods()}
    assert "interval" in described[method]["params"]
    assert keepkv.get_method(method).name == method
