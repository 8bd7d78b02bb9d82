"""CompressedCache.stack: requests prefilled apart join one decode batch, each row as if alone."""

import pytest
import torch

import keepkv

from conftest import tiny_model

STACKABLE = ["full", "h2o", "snapkv", "pyramidkv", "window", "streamingllm", "keepkv", "keepkv+selection=ema",
             "snapkv+merge=zip+threshold=-1.0", "cam", "d2o", "zeromerge", "kvmerger"]


@torch.no_grad()
def prefill(model, ids, method, budget):
    cache = keepkv.CompressedCache(model.config, method, budget)
    keepkv.enable(model)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache).logits[:, -1]
    return cache, logits


@torch.no_grad()
def decode(model, cache, logits, length, steps=6):
    out = []
    for _ in range(steps):
        token = logits.argmax(-1, keepdim=True)
        length += 1
        mask = torch.ones(token.shape[0], length, dtype=torch.long)
        logits = model(input_ids=token, attention_mask=mask, past_key_values=cache).logits[:, -1]
        out.append(logits)
    return torch.stack(out, 1)  # [B, steps, V]


@pytest.mark.parametrize("budget", [0.3, 10])
@pytest.mark.parametrize("method", STACKABLE)
def test_stacked_rows_decode_as_they_would_alone(method, budget):
    model = tiny_model("llama-gqa", layers=2)
    ids = torch.randint(3, 100, (3, 28), generator=torch.Generator().manual_seed(2))
    alone = []
    caches, first_logits = [], []
    for row in range(3):
        cache, logits = prefill(model, ids[row : row + 1], method, budget)
        caches.append(cache)
        first_logits.append(logits)
        own_cache, own_logits = prefill(model, ids[row : row + 1], method, budget)
        alone.append(decode(model, own_cache, own_logits, ids.shape[1]))
    stacked = keepkv.CompressedCache.stack(caches)
    assert stacked.layers[0].keys.shape[0] == 3
    assert all(not layer.is_initialized for cache in caches for layer in cache.layers)  # the rows moved
    together = decode(model, stacked, torch.cat(first_logits), ids.shape[1])
    torch.testing.assert_close(together, torch.cat(alone), rtol=1e-4, atol=1e-4)


def test_stack_refuses_what_cannot_join():
    model = tiny_model("llama-gqa", layers=2)
    ids = torch.randint(3, 100, (1, 20), generator=torch.Generator().manual_seed(3))
    h2o, _ = prefill(model, ids, "h2o", 0.5)
    snap, _ = prefill(model, ids, "snapkv", 0.5)
    shorter, _ = prefill(model, ids[:, :15], "h2o", 0.5)
    with pytest.raises(ValueError, match="differ in method"):
        keepkv.CompressedCache.stack([h2o, snap])
    with pytest.raises(ValueError, match="differ in 'seen'"):
        keepkv.CompressedCache.stack([h2o, shorter])
    with pytest.raises(ValueError, match="ended its prefill"):
        keepkv.CompressedCache.stack([h2o, keepkv.CompressedCache(model.config, "h2o", 0.5)])
    with pytest.raises(ValueError, match="at least one"):
        keepkv.CompressedCache.stack([])


@pytest.mark.parametrize("method, state", [("kvreviver", "sketch"), ("keepkv+selection=ema+refresh_interval=4", "offload")])
def test_stack_names_the_state_it_cannot_join(method, state):
    model = tiny_model("llama-gqa", layers=2)
    ids = torch.randint(3, 100, (2, 28), generator=torch.Generator().manual_seed(2))
    caches = [prefill(model, ids[row : row + 1], method, 12)[0] for row in range(2)]
    with pytest.raises(ValueError, match=f"method state '{state}' cannot be joined"):
        keepkv.CompressedCache.stack(caches)
    assert all(layer.is_initialized for cache in caches for layer in cache.layers)  # nothing lost
