"""Overlapping keepkv.generate calls on one model (a server's threads) with staggered starts."""

import functools
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import keepkv

from conftest import CharTokenizer, tiny_model

PROMPTS = {"h2o": "abcdefghijklmnopqrstuvwxyz0123", "keepkv": "the quick brown fox jumps over it"}
NEW_TOKENS = {"h2o": 3, "keepkv": 12}
MODEL = tiny_model("llama-gqa")
TOKENIZER = CharTokenizer()


def answer(method: str) -> str:
    return keepkv.generate(MODEL, TOKENIZER, PROMPTS[method], method=method, budget=0.5,
                           max_new_tokens=NEW_TOKENS[method], chat=False)[0].answer


@functools.cache
def alone() -> dict:
    """Each call's answer when it runs by itself."""
    return {method: answer(method) for method in PROMPTS}


def overlap(first: str, second: str, pause_first: int, pause_second: int, crossed: bool) -> dict:
    """Run ``first`` in a thread; at its ``pause_first``-th forward call it waits until ``second``,
    started then in another thread, reaches its ``pause_second``-th forward call. Crossed: the
    first call then finishes while the second waits (a server's staggered requests: the earlier
    one ends first). Otherwise the second finishes first, inside the first."""
    results, errors = {}, []
    first_paused, second_paused = threading.Event(), threading.Event()
    first_go, second_go = threading.Event(), threading.Event()
    calls = {"first": 0, "second": 0}

    def hook(module, args):
        name = threading.current_thread().name
        if name not in calls:
            return
        calls[name] += 1
        if name == "first" and calls[name] == pause_first:
            first_paused.set()
            first_go.wait(timeout=60)
        if name == "second" and calls[name] == pause_second:
            second_paused.set()
            second_go.wait(timeout=60)

    def run(method):
        try:
            results[method] = answer(method)
        except Exception as error:  # noqa: BLE001 - the test reports it below
            errors.append(f"{method}: {type(error).__name__}: {error}")

    handle = MODEL.register_forward_pre_hook(hook)
    one = threading.Thread(target=run, args=(first,), name="first")
    two = threading.Thread(target=run, args=(second,), name="second")
    try:
        one.start()
        first_paused.wait(timeout=60)
        two.start()
        second_paused.wait(timeout=60)
        order = [(first_go, one), (second_go, two)] if crossed else [(second_go, two), (first_go, one)]
        for go, thread in order:
            go.set()
            thread.join(timeout=60)
    finally:
        first_go.set()
        second_go.set()
        handle.remove()
    assert not errors, errors
    return results


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(order=st.sampled_from([("keepkv", "h2o"), ("h2o", "keepkv")]), pause_first=st.integers(1, 3),
       pause_second=st.integers(1, 3), crossed=st.booleans())
def test_staggered_overlapping_calls_answer_as_alone_and_restore_the_model(order, pause_first, pause_second, crossed):
    """The second call starts while the first is inside the model (its prefill or a decode step);
    either may finish first. Both answer as they do alone, and the model is left as found."""
    MODEL.set_attn_implementation("sdpa")
    expected = alone()
    first, second = order
    results = overlap(first, second, pause_first, pause_second, crossed)
    assert results == expected
    assert MODEL.config._attn_implementation == "sdpa"


def test_enabled_is_reference_counted():
    model = tiny_model("llama-gqa")
    model.set_attn_implementation("eager")
    with keepkv.enabled(model):
        with keepkv.enabled(model):
            assert model.config._attn_implementation == "keepkv"
        assert model.config._attn_implementation == "keepkv"  # the outer block still runs
    assert model.config._attn_implementation == "eager"
    with pytest.raises(RuntimeError):
        with keepkv.enabled(model):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "eager"
