"""The Triton decode-attention kernel against keepkv's torch path, in Triton's interpreter on CPU
(``TRITON_INTERPRET=1``, set by conftest.py before Triton is imported; natively on CUDA): fp32 to 1e-5, bf16/fp16 to their rounding. Skipped
where Triton is not installed (``pip install -e ".[gpu]"``)."""

import pytest
import torch

import keepkv
from hypothesis import given, settings, strategies as st

pytest.importorskip("triton")

from keepkv import attention  # noqa: E402
from keepkv.kernels import decode  # noqa: E402
from keepkv.kernels import decode_attention  # noqa: E402
from reference import decode_attention_reference  # noqa: E402

from conftest import greedy_decode as conftest_greedy_decode  # noqa: E402
from conftest import tiny_model  # noqa: E402


def greedy_decode(model, method, budget, steps, **cache_options):
    """conftest's greedy_decode on DEVICE."""
    with torch.no_grad():
        return conftest_greedy_decode(model, method, budget, steps, device=DEVICE, **cache_options)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (1e-3, 1e-3)}


def case(batch, kv_heads, group, size, head_dim, dtype, seed, capacity_extra=5):
    """Inputs of one call: keys a slice of a larger buffer (read in place), a bias with evicted
    slots (-inf) and merged entries (ln p > 0), ragged lengths including an empty row."""
    generator = torch.Generator().manual_seed(seed)
    query_g = torch.randn(batch, kv_heads, group, head_dim, generator=generator)
    buffer = torch.randn(batch, kv_heads, size + capacity_extra, head_dim, generator=generator)
    values = torch.randn(batch, kv_heads, size, head_dim, generator=generator)
    bias = torch.rand(batch, kv_heads, size, generator=generator).mul(2.0).log1p()
    bias[torch.rand(batch, kv_heads, size, generator=generator) < 0.2] = float("-inf")
    bias[..., -1] = 0.0  # the new entry, always visible
    lengths = torch.randint(0, size + 1, (batch, kv_heads), generator=generator)
    lengths[0, 0] = size
    to = dict(device=DEVICE, dtype=dtype)
    return query_g.to(**to), buffer.to(**to)[:, :, :size], values.to(**to), bias.to(DEVICE), lengths.to(DEVICE)


def assert_matches(got, want, dtype, lengths=None):
    rtol, atol = TOLERANCE[dtype]
    out, probs, logits = got
    ref_out, ref_probs, ref_logits = want
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=rtol, atol=atol)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-5, atol=1e-6 if dtype == torch.float32 else 1e-5)
    assert torch.equal(torch.isinf(logits), torch.isinf(ref_logits))
    finite = torch.isfinite(ref_logits)
    torch.testing.assert_close(logits[finite], ref_logits[finite], rtol=1e-5, atol=1e-5)


@settings(max_examples=12, deadline=None)
@given(
    batch=st.integers(1, 2), kv_heads=st.integers(1, 2), group=st.sampled_from([1, 3, 4]),
    size=st.integers(1, 150), head_dim=st.sampled_from([16, 24, 64]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), ragged=st.booleans(), seed=st.integers(0, 99),
)
def test_kernel_equals_the_torch_path(batch, kv_heads, group, size, head_dim, dtype, ragged, seed):
    query_g, keys, values, bias, lengths = case(batch, kv_heads, group, size, head_dim, dtype, seed)
    lengths = lengths if ragged else None
    got = decode_attention(query_g, keys, values, bias, 0.3, lengths=lengths, probs=True, logits=True, block_s=32)
    want = decode_attention_reference(query_g, keys, values, bias, 0.3, lengths=lengths, probs=True, logits=True)
    assert_matches(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entries_past_a_length_are_never_read(dtype):
    """NaN past each length (unwritten buffer space) changes nothing."""
    query_g, keys, values, bias, lengths = case(2, 2, 3, 70, 16, dtype, seed=3)
    lengths = torch.tensor([[70, 41], [9, 0]], device=DEVICE)
    poisoned_keys, poisoned_values = keys.clone(), values.clone()
    for b in range(2):
        for h in range(2):
            poisoned_keys[b, h, lengths[b, h]:] = float("nan")
            poisoned_values[b, h, lengths[b, h]:] = float("nan")
    got = decode_attention(query_g, poisoned_keys, poisoned_values, bias, 0.3, lengths=lengths, probs=True, logits=True)
    want = decode_attention_reference(query_g, keys, values, bias, 0.3, lengths=lengths, probs=True, logits=True)
    assert_matches(got, want, dtype)
    assert torch.equal(got[0][1, 1], torch.zeros_like(got[0][1, 1]))  # no entry: zeros, as the torch path


def test_kernel_output_feeds_attend_shapes_and_optional_outputs():
    query_g, keys, values, bias, _ = case(1, 2, 2, 20, 16, torch.float32, seed=5)
    out, probs, logits = decode_attention(query_g, keys, values, bias, 0.25)
    assert probs is None and logits is None and out.shape == query_g.shape
    reference, _ = attention.attend(
        query_g.reshape(1, 4, 1, 16), keys, values, bias, torch.ones(1, 1, 1, 1, dtype=torch.bool, device=DEVICE), 0.25
    )
    torch.testing.assert_close(out.reshape(1, 1, 4, 16), reference, rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused_in_one_line(monkeypatch):
    query_g, keys, values, bias, _ = case(1, 1, 1, 8, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="bias must be float32"):
        decode_attention(query_g, keys, values, bias.double(), 0.3)
    with pytest.raises(ValueError, match="share one of"):
        decode_attention(query_g, keys.bfloat16(), values, bias, 0.3)
    with pytest.raises(ValueError, match="block_s must be"):
        decode_attention(query_g, keys, values, bias, 0.3, block_s=24)
    with pytest.raises(ValueError, match="lengths must be"):
        decode_attention(query_g, keys, values, bias, 0.3, lengths=torch.ones(2, dtype=torch.long))
    if DEVICE == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(RuntimeError, match="runs on CUDA"):
            decode_attention(query_g, keys, values, bias, 0.3)
    monkeypatch.setattr(decode, "triton", None)
    with pytest.raises(ImportError, match=r"\.\[gpu\]"):
        decode_attention(query_g, keys, values, bias, 0.3)


def test_dispatch_point_names_the_kernel_only_where_it_runs(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert attention.decode_kernel_for("triton", "cpu") is decode_attention  # in the interpreter
    assert attention.decode_kernel_for("torch", "cpu") is None  # the torch path stays the default
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="needs Triton .* and a CUDA device"):
        attention.decode_kernel_for("triton", "cpu")
    if torch.cuda.is_available():
        assert attention.decode_kernel_for("triton", "cuda") is decode_attention
    monkeypatch.setattr(decode, "triton", None)
    with pytest.raises(ValueError, match="needs Triton"):
        attention.decode_kernel_for("triton", "cuda")


@pytest.mark.parametrize("method", ["h2o", "keepkv", "d2o"])
def test_opted_in_kernel_decodes_as_the_torch_path(method, monkeypatch):
    """CompressedCache(kernel="triton"): every decode step that needs probabilities or logits goes
    through the kernel (counted), and a greedy decode gives the torch path's logits (fp32)."""
    model = tiny_model("llama-gqa").to(DEVICE)
    reference, ref_tokens, _ = greedy_decode(model, method, 0.5, steps=6)
    calls = []
    counting = lambda *args, **kwargs: calls.append(1) or decode_attention(*args, **kwargs)  # noqa: E731
    monkeypatch.setattr(decode, "decode_attention", counting)
    logits, tokens, _ = greedy_decode(model, method, 0.5, steps=6, kernel="triton")
    assert len(calls) == 6 * model.config.num_hidden_layers
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, ref_tokens)


def test_opting_in_where_the_kernel_cannot_run_is_refused(monkeypatch):
    model = tiny_model("llama-gqa")
    with pytest.raises(ValueError, match="kernel must be one of 'torch', 'triton'"):
        keepkv.CompressedCache(model.config, "h2o", 0.5, kernel="cuda-please")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if not torch.cuda.is_available():  # refused at construction, before any work
        with pytest.raises(ValueError, match="needs Triton .* and a CUDA device"):
            keepkv.CompressedCache(model.config, "h2o", 0.5, kernel="triton")
