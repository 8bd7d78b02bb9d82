"""Exact budgets for every registered method (new methods are picked up automatically).

After every compression, each row and KV head of each layer holds exactly
min(its layer budget, its real tokens) entries (interval - 1 fewer with a compression every
``interval`` steps, so that it never holds more than its budget between steps); a row whose
tokens fit its budget is never touched, alone or beside longer rows.
"""

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import keepkv
from keepkv.budgets import budget_floor, capacity_bound, row_budgets
from keepkv.methods import METHODS

from conftest import decode_loop, prefill, random_batch, run_generate, tiny_model

# Variants that merge whatever they evict (threshold -1) make a merge that breaks a budget show.
MERGING_VARIANTS = [
    "keepkv+threshold=-1.0",
    "keepkv+selection=snapkv+threshold=-1.0",
    "snapkv+merge=zip+threshold=-1.0",
    "h2o+merge=zip+zip_key=group",
    "streamingllm+merge=zip+threshold=-1.0",
]
ALL = sorted(METHODS) + MERGING_VARIANTS
COMPRESSING = [m for m in ALL if m != "full"]
# Rows of 30, 21 and 10 real tokens in one left-padded batch.
PADS = (0, 9, 20)


def expected_entries(layer) -> torch.Tensor:
    """[B, H_kv] min(what a compression keeps + the tokens pending since, real tokens) of a
    compressed layer.

    KVReviver charges its sketch to the budget: a row that outgrew it at its last compression
    stores its exact part; a row that fitted was left whole, and holds its tokens since too.
    """
    if layer.budget is None:  # budget 1.0: nothing compressed, prompt and generated tokens alike
        return layer.real_seen[:, None].expand(-1, layer.keys.shape[1])
    budget = layer.budget
    if "exact" in layer.state:
        fitted = (layer.real_seen - layer.pending)[:, None] <= budget  # what it held at its last compression
        budget = torch.where(fitted, budget, layer.state["exact"])
    return torch.minimum(budget + layer.pending, layer.real_seen[:, None])


@functools.cache
def _model():
    return tiny_model("llama-gqa", layers=3)


@given(method=st.sampled_from(COMPRESSING), interval=st.integers(1, 6),
       budget=st.one_of(st.integers(1, 40), st.sampled_from([0.05, 0.1, 0.3, 0.5, 0.9, 1.0])))
def test_a_layer_never_holds_more_than_its_budget_whatever_its_interval(method, interval, budget):
    """Rows of 30, 21 and 10 real tokens, 10 decode steps: between steps no row and head of any
    layer holds more than its budget, and each holds exactly what its last compression kept plus
    the tokens since (at the budget one step before each compression, interval - 1 below it
    right after)."""
    model = _model()
    input_ids, attention_mask = random_batch(batch=3, length=30, pad=PADS)
    try:
        cache = keepkv.CompressedCache(model.config, f"{method}+interval={interval}", budget)
        for step, cache in enumerate(decode_loop(model, input_ids, attention_mask, cache, steps=10)):
            for layer in cache.layers:
                kept = layer.live_counts()
                if cache.layer_budgets is not None:
                    assert (kept <= cache.layer_budgets[layer.layer_idx]).all(), (step, layer.layer_idx, kept)
                    # each layer its own (a small budget elsewhere does not shorten it), at most half
                    # of what its budget holds beyond the method's protected entries
                    scored = int(cache.layer_budgets[layer.layer_idx].min()) - cache.method.protected_entries()
                    assert layer.interval == max(1, min(interval, scored // 2))
                assert torch.equal(kept, expected_entries(layer)), (step, layer.layer_idx, kept, layer.budget)
    except ValueError as error:  # KVReviver's sketch needs a few entries of the budget: a clear refusal
        assert method == "kvreviver" and "needs a budget of at least" in str(error)


@pytest.mark.parametrize("budget", [1, 3, 12, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("method", COMPRESSING)
def test_every_row_and_head_keeps_exactly_its_budget(method, budget):
    model = tiny_model("llama-gqa", layers=3)
    input_ids, attention_mask = random_batch(batch=3, length=30, pad=PADS)
    try:
        cache = keepkv.CompressedCache(model.config, method, budget)
        assert cache.method.interval == 1  # compresses at every step: no slack to allow for
        for step, cache in enumerate(decode_loop(model, input_ids, attention_mask, cache, steps=8)):
            for layer in cache.layers:
                kept = layer.live_counts()
                assert torch.equal(kept, expected_entries(layer)), (step, layer.layer_idx, kept, layer.budget)
    except ValueError as error:  # KVReviver's sketch needs a few entries of the budget: a clear refusal
        assert method == "kvreviver" and "needs a budget of at least" in str(error)


@pytest.mark.parametrize("budget", [0.5, 0.8, 0.95])
@pytest.mark.parametrize("method", COMPRESSING)
def test_layer_budgets_average_the_budget_and_never_exceed_the_prompt(method, budget):
    """Prompts of 120, 80 and 40 tokens: PyramidKV's lowest layers would want more than that."""
    model = tiny_model("llama-gqa", layers=6)
    input_ids, attention_mask = random_batch(batch=3, length=120, pad=(0, 40, 80))
    cache = keepkv.CompressedCache(model.config, method, budget)
    next(decode_loop(model, input_ids, attention_mask, cache, steps=1))
    budgets = torch.stack([layer.budget for layer in cache.layers]).double()  # [L, B, H_kv]
    prompt = cache.prompt_lengths
    wanted = row_budgets(budget, prompt, budget_floor(cache.method)).double()  # the fraction, or the floor
    compressed = prompt > wanted
    assert (budgets[:, compressed] <= prompt[None, compressed, None]).all()
    # a row that fits its budget keeps it in every layer: nothing is evicted at prefill
    assert (budgets[:, ~compressed] == wanted[None, ~compressed, None]).all()
    # D2O's layer ratios are clamped to [0.01, 1] of the prompt by design: its mean may fall short.
    if method != "d2o":
        assert torch.allclose(budgets.mean((0, 2)), wanted, atol=0.5), (budgets.mean((0, 2)), wanted)


@pytest.mark.parametrize("method", ALL)
def test_row_that_fits_its_budget_equals_the_full_cache_beside_longer_rows(method):
    """Budget 16: the 10-token row fits for its 6 new tokens; the others are compressed."""
    model = tiny_model("llama-gqa", layers=3)
    input_ids, attention_mask = random_batch(batch=3, length=30, pad=PADS)
    batched, _ = run_generate(model, input_ids, attention_mask, method, budget=16, new_tokens=6)
    real = attention_mask[2].bool()
    alone_ids, alone_mask = input_ids[2:3, real], attention_mask[2:3, real]
    full, _ = run_generate(model, alone_ids, alone_mask, "full", new_tokens=6)
    assert torch.equal(batched[2], full[0])
    logits_full = _last_logits(model, alone_ids, alone_mask, "full", 1.0)
    logits_batched = _last_logits(model, input_ids, attention_mask, method, 16)[2:3]
    torch.testing.assert_close(logits_batched, logits_full, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def _last_logits(model, input_ids, attention_mask, method, budget, steps=4):
    """Logits of the last of ``steps`` greedy decode steps."""
    cache = keepkv.CompressedCache(model.config, method, budget)
    logits = prefill(model, cache, input_ids, attention_mask)[:, None]
    mask = attention_mask
    for _ in range(steps):
        token = logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
        logits = model(input_ids=token, attention_mask=mask, past_key_values=cache).logits
    return logits[:, -1]


@pytest.mark.parametrize("interval", [1, 3])
@pytest.mark.parametrize("budget", [4, 0.5])
@pytest.mark.parametrize("method", COMPRESSING)
def test_capacity_bound_known_before_the_model_runs_holds(method, budget, interval):
    """What a scheduler reserves per layer (capacity_bound, from the prompt length alone) is never
    exceeded while decoding, and is reached, less the new token, unless the bound is loose by
    design (D2O and KVzip's global budgets: the prompt; KVReviver: its sketch takes part of the budget)."""
    model = tiny_model("llama-gqa", layers=3)
    input_ids, attention_mask = random_batch(batch=3, length=30, pad=PADS)
    try:
        cache = keepkv.CompressedCache(model.config, f"{method}+interval={interval}", budget)
    except ValueError as error:
        assert method == "kvreviver" and "needs a budget of at least" in str(error)
        return
    bounds = torch.tensor(
        [capacity_bound(cache.method, length, budget, model.config) for length in attention_mask.sum(-1).tolist()]
    )  # [B, L]
    most = torch.zeros_like(bounds)
    for cache in decode_loop(model, input_ids, attention_mask, cache, steps=8):
        held = torch.stack([layer.live_counts().amax(-1) for layer in cache.layers], dim=-1)  # [B, L]
        assert (held < bounds).all(), (held, bounds)  # the new token makes it bound at the attention call
        most = torch.maximum(most, held)
    # the 30-token row fills its budget within the 8 steps unless the budget floor exceeds 38
    fills = 30 + 8 >= int(row_budgets(budget, torch.tensor([30]), budget_floor(cache.method))[0])
    # loose by design: a method that allocates from every layer's prompt scores (D2O, KVzip's global
    # budgets) is bounded by the prompt; KVReviver's sketch takes part of the budget
    if not cache.method.allocates_from_all_layers and method.split("+")[0] != "kvreviver" and fills:
        assert (most[0] == bounds[0] - 1).all(), (most, bounds)


def test_capacity_bound_of_full_and_bad_input():
    config = tiny_model("llama-gqa", layers=3).config
    assert capacity_bound("full", 100, 0.5, config) is None  # grows with every token
    # the budget plus the token being attended, whatever the interval
    assert capacity_bound("window+interval=4", 400, 0.25, config) == [101, 101, 101]
    assert capacity_bound("window+interval=4", 100, 0.25, config) == [33, 33, 33]  # the floor: 32 entries
    with pytest.raises(ValueError, match="prompt_length must be an int >= 1"):
        capacity_bound("h2o", 0, 0.5, config)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        capacity_bound("h2o", 100, 1.5, config)
