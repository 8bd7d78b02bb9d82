"""The command line shows its defaults, and a fractional budget has a floor."""

import argparse
import inspect
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import keepkv
from keepkv.budgets import MAX_BUDGET, SCORED_FLOOR, budget_floor, capacity_bound, layer_budgets, row_budgets
from keepkv.cli import build_parser
from keepkv.methods import METHODS, get_method
from keepkv.paged import SERVED_METHODS, PagedCompression

from conftest import CharTokenizer, tiny_model


def subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("name", sorted(subcommands()))
def test_help_shows_every_default(name):
    parser = subcommands()[name]
    text = " ".join(parser.format_help().split())  # argparse wraps lines
    for action in parser._actions:
        default = action.default
        if not action.option_strings or default is None or default is False or default in ([], "", argparse.SUPPRESS):
            continue
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        assert f"(default: {shown})" in text, f"keepkv {name} --help: {action.option_strings[0]} hides {shown!r}"


# ---------------------------------------------------------------------------------- the floor

METHOD_NAMES = sorted(METHODS)
lengths = st.integers(1, 5000)
fractions = st.floats(0.001, 1.0)


@settings(max_examples=300, deadline=None)
@given(length=lengths, fraction=fractions, method=st.sampled_from(METHOD_NAMES))
def test_a_fractional_budget_has_the_methods_floor(length, fraction, method):
    """round(f·P), but never below the method's protected tokens + SCORED_FLOOR; a prompt no longer
    than that is kept whole (not compressed), a longer one keeps at most its length."""
    floor = budget_floor(get_method(method))
    assert floor == get_method(method).protected_entries() + SCORED_FLOOR
    budget = int(row_budgets(fraction, torch.tensor([length]), floor)[0])
    assert budget >= floor
    assert min(budget, length) <= length  # what the prefill keeps never exceeds the prompt
    if length <= floor:
        assert budget >= length  # the row fits: untouched
    if fraction == 1.0:
        assert budget == MAX_BUDGET  # 1.0 bounds nothing: the prompt and every generated token stay
    elif round(length * fraction) >= floor:
        assert budget == round(length * fraction)  # above the floor the fraction is exact
    # an int budget is an exact count: no floor
    assert int(row_budgets(7, torch.tensor([length]), floor)[0]) == 7


@settings(max_examples=60, deadline=None)
@given(length=st.integers(1, 400), fraction=fractions, method=st.sampled_from([m for m in METHOD_NAMES if m != "full"]))
def test_layer_budgets_and_capacity_bound_use_the_floor(length, fraction, method):
    """Every path reads the one rule: the cache's layer budgets, capacity_bound, the paged adapter."""
    config = tiny_model("llama-gqa", layers=3).config
    instance = get_method(method)
    per_row = int(row_budgets(fraction, torch.tensor([length]), budget_floor(instance))[0])
    bound = capacity_bound(instance, length, fraction, config)
    if length <= per_row:  # a row that fits keeps its budget in every layer: nothing evicted at prefill
        assert bound == [per_row + instance.interval] * config.num_hidden_layers
    else:  # a compressed row: no layer holds more than its prompt
        assert max(bound) <= length + instance.interval
    if method in SERVED_METHODS:
        paged = PagedCompression(config, method, fraction)
        layers = config.num_hidden_layers
        expected = layer_budgets(instance, layers, config.num_key_value_heads, fraction, torch.tensor([length]))
        assert [paged.kept(length, layer) for layer in range(layers)] == expected[:, 0, 0].tolist()
        if method != "pyramidkv":  # one budget for every layer: the row's
            assert paged.kept(length) == per_row
        assert paged.capacity(length) == max(bound)


@pytest.mark.parametrize("method", ["keepkv", "h2o", "snapkv", "streamingllm"])
def test_a_short_prompt_at_a_small_fraction_answers_as_the_full_cache(method):
    """A prompt shorter than the floor is not compressed, and keeps up to the floor while it
    decodes: budget 0.1 answers as the full cache while prompt + answer fit the floor."""
    model = tiny_model("llama-gqa", layers=2)
    prompt = "capital of france?"  # 18 tokens: with 12 new ones, under every method's floor
    assert len(prompt) + 12 <= budget_floor(get_method(method))
    full = keepkv.generate(model, CharTokenizer(), prompt, method="full", max_new_tokens=12, chat=False)[0]
    small = keepkv.generate(model, CharTokenizer(), prompt, method=method, budget=0.1, max_new_tokens=12, chat=False)[0]
    assert small.answer == full.answer
    assert small.kept_entries == full.kept_entries


def test_cli_and_python_defaults_are_the_ones_the_readme_gives():
    """They differ on purpose (the README says why): the README states both, as the code has them."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    generate = inspect.signature(keepkv.generate).parameters
    cli = subcommands()["generate"]
    cli_defaults = {a.dest: a.default for a in cli._actions}
    python_line = f'method="{generate["method"].default}", budget={generate["budget"].default}'
    from keepkv.cli import DEFAULT_BUDGET

    assert cli_defaults["budget"] is None  # resolved once the method is known: 1.0 for full
    cli_line = f"--method {cli_defaults['method']} --budget {DEFAULT_BUDGET}"
    assert python_line in readme and cli_line in readme
    assert re.search(r"defaults differ", readme)


def test_generate_takes_threads_as_demo_does(monkeypatch):
    """`keepkv generate --threads N` sets torch's threads before the model loads, with demo's
    default (1: on a busy machine more threads wait for each other)."""
    from keepkv import cli

    commands = subcommands()
    defaults = {name: {a.dest: a.default for a in commands[name]._actions}["threads"] for name in ("generate", "demo")}
    assert defaults == {"generate": 1, "demo": 1}
    seen = []

    def load(args):
        seen.append(torch.get_num_threads())
        raise RuntimeError("stop before loading")

    monkeypatch.setattr(cli, "_load", load)
    before = torch.get_num_threads()
    try:
        for argv, threads in ((["--threads", "2"], 2), ([], 1)):
            torch.set_num_threads(3)
            assert cli.main(["generate", "Q", "--method", "snapkv", *argv]) == 2
            assert seen[-1] == threads
    finally:
        torch.set_num_threads(before)
