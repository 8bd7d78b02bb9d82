"""keepkv.budgets: the one home of budget arithmetic, tied together by properties (no model runs)."""

import math
from types import SimpleNamespace

import torch
from hypothesis import given
from hypothesis import strategies as st

from keepkv.budgets import (
    budget_floor, capacity_bound, fit_to_prompt, held_entries, layer_budgets, row_budgets,
)
from keepkv.methods import METHODS, get_method

# Methods whose allocation is known before the model runs (D2O reads every layer's prefill).
PURE = sorted(name for name, cls in METHODS.items() if not cls.allocates_from_all_layers and name != "full")
budgets = st.one_of(st.integers(1, 300), st.floats(0.01, 1.0))
lengths = st.lists(st.integers(1, 2000), min_size=1, max_size=4)


@given(budget=budgets, prompts=lengths, floor=st.integers(0, 80))
def test_row_budgets_are_the_fraction_with_its_floor_or_the_count(budget, prompts, floor):
    per_row = row_budgets(budget, torch.tensor(prompts), floor)
    for length, entries in zip(prompts, per_row.tolist()):
        if isinstance(budget, float):
            assert entries == max(round(length * budget), floor, 1)
        else:
            assert entries == budget


@given(
    prompts=lengths, layers=st.integers(1, 12), share=st.floats(0.05, 1.0),
    spread=st.lists(st.floats(0.0, 3.0), min_size=12, max_size=12),
)
def test_fit_to_prompt_never_exceeds_the_prompt_and_keeps_the_total(prompts, layers, share, spread):
    lengths_t = torch.tensor(prompts)
    mean = (lengths_t * share).round().long().clamp(min=1)
    shape = torch.tensor(spread[:layers], dtype=torch.float64)
    raw = (mean[None, :].double() * shape[:, None] / shape.mean().clamp(min=1e-9)).round().long().clamp(min=1)
    fitted = fit_to_prompt(raw[:, :, None], mean, lengths_t)[:, :, 0]  # [L, B]
    for row in range(len(prompts)):
        if (raw[:, row] <= lengths_t[row]).all():  # it fits: untouched
            assert torch.equal(fitted[:, row], raw[:, row])
        else:
            assert (fitted[:, row] <= lengths_t[row]).all() and (fitted[:, row] >= 1).all()
            assert abs(int(fitted[:, row].sum()) - int(mean[row]) * layers) <= layers  # total kept (rounding)


@given(method=st.sampled_from(PURE), budget=budgets, prompts=lengths, layers=st.integers(1, 8))
def test_layer_budgets_fit_the_prompt_and_leave_fitting_rows_alone(method, budget, prompts, layers):
    method = get_method(method)
    lengths_t = torch.tensor(prompts)
    if method.name == "kvreviver" and int(row_budgets(budget, lengths_t, budget_floor(method)).min()) < method.min_budget():
        return  # refused in one line by the method (tests/test_kvreviver.py)
    result = layer_budgets(method, layers, 2, budget, lengths_t)
    per_row = row_budgets(budget, lengths_t, budget_floor(method))
    assert result.shape == (layers, len(prompts), 2)
    for row, (length, mean) in enumerate(zip(prompts, per_row.tolist())):
        if length <= mean:
            assert (result[:, row] == mean).all()  # nothing is compressed
        else:
            assert (result[:, row] <= length).all() and (result[:, row] >= 1).all()
            assert abs(result[:, row, 0].double().mean().item() - mean) <= 1.0  # per-layer rounding


@given(
    method=st.sampled_from(PURE), budget=budgets, prompt=st.integers(1, 2000), interval=st.integers(1, 6),
    steps=st.integers(0, 40),
)
def test_what_a_layer_holds_while_decoding_stays_under_capacity_bound(method, budget, prompt, interval, steps):
    """The decode schedule (held_entries: interval - 1 below the budget after each compression,
    then one entry a step, back every ``interval``) never holds more than the budget, and with the
    token being attended never exceeds what capacity_bound reserves (budget + 1), in any layer."""
    method = get_method(f"{method}+interval={interval}")
    config = SimpleNamespace(num_hidden_layers=4, num_key_value_heads=2)
    lengths_t = torch.tensor([prompt])
    if method.name == "kvreviver" and int(row_budgets(budget, lengths_t, budget_floor(method)).min()) < method.min_budget():
        return
    bound = capacity_bound(method, prompt, budget, config)
    per_layer = layer_budgets(method, 4, 2, budget, lengths_t)[:, 0, 0].tolist()
    for layer, kept in enumerate(per_layer):
        held = held_entries(kept, prompt, prompt + steps, interval)
        assert held + 1 <= bound[layer]
        assert held <= kept  # never above the budget
        assert held >= min(kept - interval + 1, prompt)
    assert max(bound) == max(per_layer) + 1


def test_capacity_bound_is_none_for_the_full_cache_and_math_agrees():
    config = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=1)
    assert capacity_bound("full", 100, 0.5, config) is None
    assert held_entries(10, 50, 50, 1) == 10 and held_entries(10, 5, 7, 1) == 7
    # every 4 steps: 3 below the budget after a compression, at the budget one step before the next
    assert [held_entries(10, 50, 50 + t, 4) for t in range(9)] == [7, 8, 9, 10, 7, 8, 9, 10, 7]
    assert math.isclose(row_budgets(0.5, torch.tensor([101]))[0].item(), 50)  # round half to even
