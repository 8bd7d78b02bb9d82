"""CompressedCache(compile=True): the methods' decode math through torch.compile, eager as fallback."""

import warnings

import pytest
import torch

import keepkv
import keepkv.fused as fused
from keepkv.merging import cosine_nearest

from conftest import greedy_decode, tiny_model


def test_compiled_decode_matches_eager(monkeypatch):
    """KeepKV's EMA scores, merged EMA, similarity search and ZIP merge: compiled, the same outputs."""
    model = tiny_model("llama-gqa", layers=2)
    eager_logits, eager_tokens, _ = greedy_decode(model, "keepkv+threshold=-1.0", 12, steps=6)  # every eviction merges
    compile, compiled = torch.compile, []
    monkeypatch.setattr(fused.torch, "compile", lambda fn, **kw: compiled.append(fn.__name__) or compile(fn, **kw))
    compiled_logits, compiled_tokens, _ = greedy_decode(model, "keepkv+threshold=-1.0", 12, steps=6, compile=True)
    assert set(compiled) == {"ema_log_scores", "merged_ema", "cosine_nearest", "zip_merge_rows"}
    assert torch.equal(eager_tokens, compiled_tokens)
    torch.testing.assert_close(compiled_logits, eager_logits, rtol=1e-4, atol=1e-4)


def failing_compile(fn, **kwargs):
    def compiled_fn(*args, **kw):
        raise torch._dynamo.exc.TorchDynamoException("no compiler")

    return compiled_fn


def search_inputs():
    keys = torch.randn(2, 3, 10, 8, generator=torch.Generator().manual_seed(0))
    src = torch.tensor([0, 1]).expand(2, 3, 2)
    candidates = torch.ones(2, 3, 10, dtype=torch.bool)
    candidates[..., :2] = False
    return keys, src, candidates


def test_compile_failure_warns_once_and_runs_eagerly(monkeypatch):
    monkeypatch.setattr(fused.torch, "compile", failing_compile)
    marked = fused.fusable(cosine_nearest.eager)
    expected = cosine_nearest.eager(*search_inputs())
    with fused.compiled(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = marked(*search_inputs()), marked(*search_inputs())
    assert [str(w.message) for w in caught] == [
        "torch.compile of cosine_nearest failed (TorchDynamoException); it runs eagerly"
    ]
    for got in (first, second):
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_nothing_compiles_outside_the_block(monkeypatch):
    calls = []
    monkeypatch.setattr(fused.torch, "compile", lambda fn, **kw: calls.append(fn) or fn)
    marked = fused.fusable(cosine_nearest.eager)
    marked(*search_inputs())
    with fused.compiled(False):
        marked(*search_inputs())
    assert calls == []
    with fused.compiled():
        marked(*search_inputs())
    assert calls == [cosine_nearest.eager]


def test_compile_flag_is_checked():
    with pytest.raises(ValueError, match="compile must be True or False"):
        keepkv.CompressedCache(tiny_model().config, "keepkv", 0.5, compile="yes")
