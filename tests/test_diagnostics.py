"""Warnings where the output will be poor: one KeepKVWarning each, none where all is well."""

import warnings

import pytest
import torch

import keepkv

from conftest import CharTokenizer

PROMPT = "x" * 31  # 31 tokens with CharTokenizer (no chat template)


def generate_warnings(model, prompts=PROMPT, method="keepkv+selection=ema", budget=0.1, max_new_tokens=1) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        keepkv.generate(model, CharTokenizer(), prompts, method, budget, max_new_tokens=max_new_tokens)
    return [str(w.message) for w in caught if issubclass(w.category, keepkv.KeepKVWarning)]


def cache_warnings(model, prompts=PROMPT, method="keepkv+selection=ema", budget=0.1) -> list[str]:
    """The warnings of a prefill into a CompressedCache built by hand (which takes any budget)."""
    batch = CharTokenizer()([prompts] if isinstance(prompts, str) else prompts)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad(), keepkv.enabled(model):
        warnings.simplefilter("always")
        model(**batch, past_key_values=keepkv.CompressedCache(model.config, method, budget), use_cache=True)
    return [str(w.message) for w in caught if issubclass(w.category, keepkv.KeepKVWarning)]


@pytest.mark.parametrize("method, protected", [("keepkv+selection=ema", 4), ("snapkv", 32), ("streamingllm", 4)])
def test_a_budget_below_the_protected_tokens_is_refused_in_one_line(gqa_model, method, protected):
    """keepkv.generate, keepkv.compress and the command line refuse it before any work (the
    answers would be garbage); the budget that holds them runs."""
    for run in (lambda budget: generate_warnings(gqa_model, method=method, budget=budget),
                lambda budget: keepkv.compress(gqa_model, CharTokenizer(), PROMPT, method=method, budget=budget)):
        with pytest.raises(ValueError, match=f"budget {protected - 1} .* fewer than .*'s {protected} protected") as raised:
            run(protected - 1)
        assert "\n" not in str(raised.value)
        run(protected)


def test_a_cache_built_by_hand_below_the_protected_tokens_warns_once(gqa_model):
    # keepkv with its EMA selection protects 4 sinks; an entry budget of 3 keeps 3.
    (message,) = cache_warnings(gqa_model, budget=3)
    assert "keeps 3 entries" in message and "31-token" in message and "4 protected" in message
    assert "\n" not in message
    assert cache_warnings(gqa_model, budget=4) == []
    # snapkv protects its observation window.
    (message,) = cache_warnings(gqa_model, method="snapkv", budget=16)
    assert "32 protected" in message


@pytest.mark.parametrize("method", ["keepkv", "keepkv+selection=ema", "snapkv", "streamingllm", "h2o"])
def test_a_fraction_never_keeps_fewer_than_the_protected_tokens(gqa_model, method):
    """The budget floor: a fraction keeps at least the protected tokens plus 32, so a fraction of
    a short prompt (here a tenth of 31, and of 200, tokens) never warns."""
    assert generate_warnings(gqa_model, method=method, budget=0.1) == []
    assert generate_warnings(gqa_model, ["y" * 200], method=method, budget=0.1) == []


def test_fewest_kept_compressed_row_is_named_and_fitting_rows_are_not(gqa_model):
    (message,) = cache_warnings(gqa_model, [PROMPT, "y" * 200], budget=3)
    assert "keeps 3 entries" in message and "31-token" in message
    # A row that fits its budget is never touched, so a short prompt under an entry budget is fine.
    assert cache_warnings(gqa_model, ["abc"], budget=3) == []


def test_int_budget_one_warns(gqa_model):
    (message,) = generate_warnings(gqa_model, method="h2o", budget=1)
    assert "1.0" in message and "entry count" in message
    with pytest.raises(ValueError, match=r"budget 1 \(an int budget is an entry count; 1.0 compresses nothing\)"):
        generate_warnings(gqa_model, method="keepkv", budget=1)
    (message,) = cache_warnings(gqa_model, method="keepkv", budget=1)
    assert "1.0" in message and "protected" in message
    assert generate_warnings(gqa_model, method="h2o", budget=1.0) == []


def test_full_refuses_a_budget_in_one_line(gqa_model):
    """The full cache keeps every entry: a budget other than 1.0 would be ignored without a word
    (keepkv.generate, keepkv.compress and the CLI refuse it; a CompressedCache built by hand, the
    building block of the benches and tests, takes it)."""
    for budget in (1, 0.1, 64):
        with pytest.raises(ValueError, match=r"^method 'full' keeps every entry and takes no budget") as error:
            generate_warnings(gqa_model, method="full", budget=budget)
        assert "\n" not in str(error.value)
    assert generate_warnings(gqa_model, method="full", budget=1.0) == []


def test_context_length_warning(gqa_model):
    gqa_model.config.max_position_embeddings = 32
    (message,) = generate_warnings(gqa_model, method="full", budget=1.0, max_new_tokens=2)
    assert "31 tokens" in message and "2 new tokens" in message and "max_position_embeddings (32)" in message
    assert generate_warnings(gqa_model, method="full", budget=1.0, max_new_tokens=1) == []


@pytest.mark.parametrize("method", ["full", "snapkv", "kvzip"])
def test_prompt_longer_than_the_context_is_refused_in_one_line(gqa_model, method):
    """Refused before its prefill, for generate and compress alike."""
    gqa_model.config.max_position_embeddings = 30
    budget = 1.0 if method == "full" else 0.5
    with pytest.raises(ValueError, match=r"^the prompt has 31 tokens, more than the model's context of 30") as error:
        keepkv.generate(gqa_model, CharTokenizer(), PROMPT, method, budget, max_new_tokens=1)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"more than the model's context of 30"):
        keepkv.compress(gqa_model, CharTokenizer(), "z" * 31, method=method, budget=budget, chat=False)


def test_warnings_can_be_filtered(gqa_model):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=keepkv.KeepKVWarning)
        keepkv.generate(gqa_model, CharTokenizer(), PROMPT, "h2o", 1, max_new_tokens=1)
    with pytest.warns(keepkv.KeepKVWarning):
        keepkv.generate(gqa_model, CharTokenizer(), PROMPT, "h2o", 1, max_new_tokens=1)
