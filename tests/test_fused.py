"""CompressedCache(compile=True): each layer's decode-time method step as one torch.compile graph, eager as fallback."""

import warnings

import pytest
import torch

import keepkv
import keepkv.fused as fused

from conftest import greedy_decode, tiny_model


@pytest.mark.parametrize("method", ["keepkv+threshold=-1.0", "h2o"])
def test_compiled_step_matches_eager(method):
    """The whole decode step compiled (KeepKV with every eviction merging, through its gates; H2O):
    the eager tokens and logits, with no fallback and no recompilation per step."""
    model = tiny_model("llama-gqa", layers=2)
    eager_logits, eager_tokens, _ = greedy_decode(model, method, 12, steps=6)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled_logits, compiled_tokens, cache = greedy_decode(model, method, 12, steps=6, compile=True)
    assert cache._method_step.failed is None
    # at most two graphs (the store's binary-bias flag flips once), however many steps and layers
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs <= 2
    assert torch.equal(eager_tokens, compiled_tokens)
    torch.testing.assert_close(compiled_logits, eager_logits, rtol=1e-5, atol=1e-5)


def test_compile_failure_warns_once_and_runs_eagerly(monkeypatch):
    """A step that cannot compile runs eagerly (once per step, not twice), after one warning."""

    def failing_compile(fn, **kwargs):
        def compiled_fn(*args, **kw):
            raise torch._dynamo.exc.Unsupported("no compiler")

        return compiled_fn

    model = tiny_model("llama-gqa", layers=2)
    eager_logits, eager_tokens, _ = greedy_decode(model, "keepkv", 12, steps=4)
    monkeypatch.setattr(fused.torch, "compile", failing_compile)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits, tokens, cache = greedy_decode(model, "keepkv", 12, steps=4, compile=True)
    messages = [str(w.message) for w in caught if "torch.compile" in str(w.message)]
    assert messages == ["keepkv: torch.compile of the decode step failed (Unsupported: no compiler); it runs eagerly"]
    assert torch.equal(tokens, eager_tokens) and torch.equal(logits, eager_logits)


def test_eager_cache_never_compiles(monkeypatch):
    calls = []
    monkeypatch.setattr(fused.torch, "compile", lambda fn, **kw: calls.append(fn) or fn)
    greedy_decode(tiny_model("llama-gqa", layers=2), "keepkv", 12, steps=2)
    assert calls == []


def test_compile_flag_is_checked():
    with pytest.raises(ValueError, match="compile must be True or False"):
        keepkv.CompressedCache(tiny_model().config, "keepkv", 0.5, compile="yes")
