"""Per-row memory figures, buffer growth and generate()'s progress bars."""

import pytest
import torch

import keepkv
from keepkv.store import GROWTH_MIN, GROWTH_SHARE
from keepkv.cli import memory_line
from keepkv.methods import METHODS

from conftest import decode_loop, random_batch, run_generate, tiny_model

PARTS = ("entry_bytes", "padding_bytes", "spare_bytes", "state_bytes")


def slot_bytes(layer) -> int:
    """Bytes of one slot of one KV head over every per-entry tensor of the layer."""
    tensors = (layer.keys, layer.values, layer.bias, layer.positions, *layer.extras.values())
    return sum(t[0, 0, 0].numel() * t.element_size() for t in tensors)


@pytest.mark.filterwarnings("ignore:kvreviver")
@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("budget", [0.3, 1.0])
def test_row_figures_add_up_to_the_cache_bytes(method, budget):
    """A 31-token row beside a 150-token row: each row's parts add up to what it holds, the rows add up
    to nbytes(), and its entries are exactly its live slots (not the batch's padded tensor)."""
    model = tiny_model("llama-gqa")
    input_ids, attention_mask = random_batch(batch=2, length=150, pad=(0, 119))
    _, cache = run_generate(model, input_ids, attention_mask, method, budget, new_tokens=5)
    summary = cache.summary()
    assert sum(summary.cache_bytes) == cache.nbytes()
    for row in range(2):
        assert summary.cache_bytes[row] == sum(getattr(summary, part)[row] for part in PARTS)
        live = sum(int(layer.live_counts()[row].sum()) * slot_bytes(layer) for layer in cache.layers)
        assert summary.entry_bytes[row] == live
        assert min(getattr(summary, part)[row] for part in PARTS) >= 0
        assert summary.spare_bytes[row] > 0  # every layer keeps room for the next append
    # the short row holds what it keeps; the slots the long row fills beside it are its padding
    assert summary.padding_bytes[1] > summary.padding_bytes[0]
    # methods that keep no per-row state beside their entries count none
    if method in ("full", "h2o", "snapkv", "window", "streamingllm"):
        assert summary.state_bytes == [0, 0]
    if method == "full":
        kv_bytes = 2 * cache.layers[0].keys.shape[-1] * 4  # one token of one head, keys + values, fp32
        share = slot_bytes(cache.layers[0]) / kv_bytes  # bias and position ride along each entry
        for row, tokens in enumerate((154, 35)):  # the last generated token is never fed back
            assert summary.entry_bytes[row] == tokens * 2 * 2 * slot_bytes(cache.layers[0])  # layers x heads
            assert summary.entry_bytes[row] == pytest.approx(share * summary.full_cache_bytes[row])
            assert summary.state_bytes[row] == 0


@torch.no_grad()
def test_uncompressed_buffers_grow_in_proportion_to_their_length():
    """Spare slots stay within an eighth of the length (at least GROWTH_MIN), and each reallocation
    grows the buffer by at least that share, so appends copy O(1) entries each on average."""
    model = tiny_model("llama-gqa", layers=1)
    input_ids, attention_mask = random_batch(batch=1, length=40, pad=(0,))
    cache = keepkv.CompressedCache(model.config, "full")
    capacities = []
    for cache in decode_loop(model, input_ids, attention_mask, cache, steps=400):
        layer = cache.layers[0]
        capacity = layer.buffers["keys"].shape[2]
        assert 0 <= capacity - layer.size <= max(GROWTH_MIN, layer.size // GROWTH_SHARE)
        if not capacities or capacities[-1] != capacity:
            capacities.append(capacity)
    assert layer.size == 440
    for before, after in zip(capacities, capacities[1:]):
        assert after - before >= max(GROWTH_MIN, before // GROWTH_SHARE)


class _Tokenizer:
    """Characters as token ids: enough tokenizer for generate() on a tiny model."""

    chat_template = None
    pad_token = eos_token = "<eos>"
    pad_token_id = 0

    def __call__(self, texts, return_tensors, padding, add_special_tokens):
        ids = [[3 + ord(c) % 100 for c in text] for text in texts]
        width = max(map(len, ids))
        return {
            "input_ids": torch.tensor([[0] * (width - len(i)) + i for i in ids]),
            "attention_mask": torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids]),
        }

    def batch_decode(self, ids, skip_special_tokens):
        return [" ".join(map(str, row.tolist())) for row in ids]


@pytest.mark.parametrize("new_tokens", [0, 4])
def test_progress_shows_the_prefill_and_names_the_method(capsys, new_tokens):
    model = tiny_model("llama-gqa")
    prompts = ["a long enough prompt for the cache to compress", "short one"]
    keepkv.generate(model, _Tokenizer(), prompts, "h2o", 0.5, max_new_tokens=new_tokens, progress=True)
    shown = capsys.readouterr().err
    assert "h2o: prefill" in shown and "layer" in shown
    assert ("h2o: generating" in shown) == (new_tokens > 0)
    assert all(not layer._forward_hooks for layer in model.get_decoder().layers)  # counting hooks removed
    keepkv.generate(model, _Tokenizer(), prompts, "h2o", 0.5, max_new_tokens=new_tokens, progress=False)
    assert capsys.readouterr().err == ""


def test_full_reports_no_budget_and_its_parts():
    model = tiny_model("llama-gqa")
    prompts = ["a prompt of some length, to keep", "another"]
    full = keepkv.generate(model, _Tokenizer(), prompts, "full", 1.0, max_new_tokens=3)
    h2o = keepkv.generate(model, _Tokenizer(), prompts, "h2o", 0.5, max_new_tokens=3)
    assert [r.budget for r in full] == [None, None] and [r.budget for r in h2o] == [0.5, 0.5]
    for result in full + h2o:
        assert result.cache_bytes == sum(getattr(result, part) for part in PARTS)
    line = memory_line(full[0])
    assert line.startswith("[full] ") and "budget" not in line and "spare slots" in line
    assert memory_line(h2o[0]).startswith("[h2o budget=0.5] ")
