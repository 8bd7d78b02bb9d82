"""Differential tests on CUDA, run by ``.ci/cuda`` (skipped where there is no GPU):

- a batch row equals its prompt alone, in bf16, for every registered method;
- a compressed cache equals a full cache with the dropped entries masked out, in bf16;
- Theorem 3 in fp32: KeepKV's ZIP merges with exact scores leave the newest query's output
  unchanged at every decode step.

``KEEPKV_CUDA_TESTS_ON=cpu`` runs them on the CPU instead (bf16 on a CPU is slow; this checks the
tests themselves, not CUDA).
"""

import os

import pytest
import torch

import keepkv
from keepkv.methods import METHODS
from keepkv.perturbation import _attend

from conftest import prefill, random_batch, tiny_model

DEVICE = "cuda" if torch.cuda.is_available() else os.environ.get("KEEPKV_CUDA_TESTS_ON")
pytestmark = [
    pytest.mark.skipif(DEVICE is None, reason="needs CUDA (or KEEPKV_CUDA_TESTS_ON=cpu)"),
    pytest.mark.filterwarnings("ignore::keepkv.KeepKVWarning"),
]
EMA = "keepkv+selection=ema+protect=0+max_value_change=None+min_mass=0"


def on_device(kind: str, dtype: torch.dtype, layers: int = 2):
    model = tiny_model(kind, layers=layers).to(device=DEVICE, dtype=dtype)
    keepkv.enable(model)
    return model


@torch.no_grad()
def greedy(model, input_ids, attention_mask, method, budget, new_tokens=8):
    """(tokens [B, n], fp32 scores [n, B, V]) of a greedy generate with a CompressedCache. A method
    with a reconstruction pass (KVzip) has its prompt prefilled by it, its first token from that
    prefill's logits, as ``keepkv.generate`` does."""
    cache = keepkv.CompressedCache(model.config, method, budget)
    input_ids, attention_mask = input_ids.to(DEVICE), attention_mask.to(DEVICE)
    first_scores = []
    if cache.defers_to_reconstruction:
        logits = prefill(model, cache, input_ids, attention_mask, positions="real")
        first = logits.argmax(-1, keepdim=True)
        input_ids = torch.cat([input_ids, first], dim=-1)
        attention_mask = torch.cat([attention_mask, torch.ones_like(first)], dim=-1)
        first_scores, new_tokens = [logits], new_tokens - 1
    out = model.generate(
        input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache,
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
        output_scores=True, return_dict_in_generate=True,
    )
    tokens = out.sequences[:, input_ids.shape[1] - len(first_scores):]
    return tokens.cpu(), torch.stack([*first_scores, *out.scores]).float().cpu()


def assert_same_greedy_tokens(batched, alone, scores):
    """Token by token, until the prompt-alone run meets a near tie: in bf16 a batch and a lone
    prompt may take different kernels (padding changes the GEMM and SDPA shapes), whose rounding
    can flip a choice whose top-2 margin is within it; past a flip the runs are no longer
    comparable. The first token must be clear of a tie and equal."""
    top2 = scores.topk(2, dim=-1).values
    margins = (top2[..., 0] - top2[..., 1]) / top2[..., 0].abs().clamp(min=1.0)
    assert margins[0] > 2e-2, "the first token is a near tie: choose another seed"
    for step in range(len(alone)):
        if margins[step] <= 2e-2:
            break
        assert batched[step] == alone[step], step


@pytest.mark.parametrize("method", sorted(METHODS))
def test_bf16_batch_row_equals_its_prompt_alone(method):
    model = on_device("llama-gqa", torch.bfloat16)
    input_ids, attention_mask = random_batch(length=40, pad=(0, 11))
    batched, _ = greedy(model, input_ids, attention_mask, method, 0.5)
    for row in range(2):
        real = attention_mask[row].bool()
        alone, scores = greedy(model, input_ids[row : row + 1, real], attention_mask[row : row + 1, real], method, 0.5)
        assert_same_greedy_tokens(batched[row], alone[0], scores[:, 0])


@pytest.mark.parametrize("method", ["h2o", "snapkv", "streamingllm"])
@pytest.mark.parametrize("kind", ["llama-mha", "llama-gqa"])
@torch.no_grad()
def test_bf16_compressed_equals_masked_full_cache(method, kind):
    model = on_device(kind, torch.bfloat16)
    input_ids, attention_mask = (t.to(DEVICE) for t in random_batch(length=40, pad=(0, 8)))
    compressed = keepkv.CompressedCache(model.config, method, 12, **({"window": 4} if method == "snapkv" else {}))
    model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=compressed)
    masked = keepkv.CompressedCache(model.config, "full")
    model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=masked)
    for small, big in zip(compressed.layers, masked.layers):
        assert small.size < big.size
        kept = (big.positions[..., :, None] == small.positions[..., None, :]) & small.live()[..., None, :]
        big.drop(~kept.any(-1))
    token = torch.randint(3, 100, (2, 1), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    mask = torch.cat([attention_mask, torch.ones_like(token)], dim=-1)
    logits = model(input_ids=token, attention_mask=mask, past_key_values=compressed).logits.float()
    reference = model(input_ids=token, attention_mask=mask, past_key_values=masked).logits.float()
    # The same attention over fewer slots: bf16 rounding of a different reduction, nothing more.
    torch.testing.assert_close(logits, reference, rtol=2e-2, atol=3e-2 * float(reference.abs().max()))


@pytest.mark.parametrize("zip_key", ["paper", "projection"])
@torch.no_grad()
def test_fp32_theorem3_decode_merges_are_lossless(zip_key):
    model = on_device("llama-mha", torch.float32)
    ids = random_batch(batch=1, length=30, pad=(0,), seed=3)[0].to(DEVICE)
    cache = keepkv.CompressedCache(
        model.config, EMA, 10, threshold=-1.0, zip_key=zip_key, scores="exact", prefill_order="evict_first"
    )
    errors, inner = [], cache.forward_layer

    def checked(index, query, keys, values, block_mask, scaling):
        out = inner(index, query, keys, values, block_mask, scaling)
        layer = cache.layers[index]
        after = _attend(query[:, :, -1], layer.keys, layer.values, layer.bias, scaling)
        exact = out[:, -1].float()
        errors.append(float(((after - exact).flatten(1).norm(dim=-1) / exact.flatten(1).norm(dim=-1)).max()))
        return out

    cache.forward_layer = checked
    mask = torch.ones_like(ids)
    model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    token = ids[:, -1:]
    for step in range(6):
        errors.clear()
        token = (token * 7 + step) % 100 + 3
        mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
        model(input_ids=token, attention_mask=mask, past_key_values=cache)
        assert max(errors) <= 1e-5, (step, errors)
        for layer in cache.layers:  # a merge happened at this step, and the votes add up
            assert int(layer.live_counts().max()) == int(layer.budget.max())
            votes = layer.bias.exp().sum(-1)
            torch.testing.assert_close(votes, layer.real_seen.float()[:, None].expand_as(votes))
