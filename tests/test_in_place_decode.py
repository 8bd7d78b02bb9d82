"""Steady-state decode without a layer copy (LayerStore.keep).

A decode step that sheds at most the layer's spare room moves the kept new entries into the
freed slots in place; a larger shrink gathers the kept entries into a new buffer. Both must
give the same outputs and keep the same entries.
"""

import pytest
import torch

import keepkv
from keepkv.store import LayerStore
from keepkv.methods import METHODS
from keepkv.methods.base import slots_of

from conftest import greedy_decode as decode, random_batch, tiny_model

METHODS_AND_VARIANTS = sorted(set(METHODS) - {"full"}) + [
    "keepkv+selection=ema",
    "keepkv+interval=3",
    "snapkv+merge=zip+threshold=-1.0",
    "h2o+interval=4",
    "kvreviver+interval=2",
]


def always_gather(self, kept, slots):
    self.select(*slots_of(kept, slots))


def entries(cache):
    """Per layer, the live (position, key) pairs of every row and head, sorted by position."""
    out = []
    for layer in cache.layers:
        live = layer.live()
        for row in range(live.shape[0]):
            for head in range(live.shape[1]):
                slots = live[row, head].nonzero()[:, 0]
                pos = layer.positions[row, head, slots]
                order = pos.argsort()
                out.append((pos[order], layer.keys[row, head, slots[order]], layer.bias[row, head, slots[order]]))
    return out


@pytest.mark.parametrize("budget", [12, 0.5])
@pytest.mark.parametrize("method", METHODS_AND_VARIANTS)
def test_in_place_and_gathered_decode_agree(method, budget, monkeypatch):
    model = tiny_model("llama-gqa", layers=2)
    in_place = decode(model, method, budget)
    with monkeypatch.context() as patch:
        patch.setattr(LayerStore, "keep", always_gather)
        gathered = decode(model, method, budget)
    assert torch.equal(in_place[1], gathered[1])
    torch.testing.assert_close(in_place[0], gathered[0], atol=1e-5, rtol=1e-5)
    for (pos_a, key_a, bias_a), (pos_b, key_b, bias_b) in zip(entries(in_place[2]), entries(gathered[2])):
        assert torch.equal(pos_a, pos_b)
        torch.testing.assert_close(key_a, key_b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(bias_a, bias_b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["h2o", "snapkv", "keepkv", "streamingllm"])
@torch.no_grad()
def test_steady_decode_writes_into_the_same_buffers(method):
    """At interval 1 every decode step sheds one slot: no step allocates a new key buffer."""
    model = tiny_model("llama-gqa", layers=2)
    input_ids, attention_mask = random_batch(batch=2, length=40, pad=(0, 5))
    cache = keepkv.CompressedCache(model.config, method, 8 if method != "snapkv" else 36)
    keepkv.enable(model)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache).logits[:, -1]
    mask, pointers = attention_mask, []
    for _ in range(10):
        token = logits.argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
        logits = model(input_ids=token, attention_mask=mask, past_key_values=cache).logits[:, -1]
        pointers.append([(layer.keys.data_ptr(), layer.values.data_ptr(), layer.size) for layer in cache.layers])
    assert all(step == pointers[0] for step in pointers), pointers


def test_keep_moves_kept_tail_entries_into_freed_slots():
    """One row, one head, 5 slots of which 4 stay: the kept tail entry fills the dropped slot 1."""
    layer = LayerStore(0)
    keys = torch.arange(5.0).view(1, 1, 5, 1)
    layer.lazy_initialization(keys, keys)
    layer.append(keys, keys * 10, torch.ones(1, 5, dtype=torch.bool))
    layer.headroom = 1
    pointer = layer.keys.data_ptr()
    layer.keep(torch.tensor([[[True, False, True, True, True]]]), slots=4)
    assert layer.keys.data_ptr() == pointer
    assert layer.keys.flatten().tolist() == [0.0, 4.0, 2.0, 3.0]
    assert layer.values.flatten().tolist() == [0.0, 40.0, 20.0, 30.0]
    assert layer.positions.flatten().tolist() == [0, 4, 2, 3]
    assert layer.bias.flatten().tolist() == [0.0, 0.0, 0.0, 0.0]


def test_keep_sheds_a_tail_longer_than_the_kept_slots():
    """Interval 3, budget 1: four slots shrink to one, and the one kept entry is in the tail."""
    layer = LayerStore(0)
    keys = torch.arange(4.0).view(1, 1, 4, 1)
    layer.lazy_initialization(keys, keys)
    layer.append(keys, keys, torch.ones(1, 4, dtype=torch.bool))
    layer.headroom = 3
    layer.keep(torch.tensor([[[False, False, False, True]]]), slots=1)
    assert layer.keys.flatten().tolist() == [3.0] and layer.positions.flatten().tolist() == [3]
