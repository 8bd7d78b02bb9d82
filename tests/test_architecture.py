"""docs/architecture.md: the one-file method it shows is the file docs/examples/knorm.py, and it works."""

import importlib.util
import re
from pathlib import Path

import pytest
import torch

import keepkv
from keepkv.methods import METHODS, SELECTIONS

from conftest import random_batch, tiny_model

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "knorm.py"


@pytest.fixture
def registry():
    """The registry as it was: the example's registration must not leak into other tests."""
    saved = dict(METHODS), dict(SELECTIONS)
    yield
    for registry, before in zip((METHODS, SELECTIONS), saved):
        registry.clear()
        registry.update(before)


def load_example():
    spec = importlib.util.spec_from_file_location("knorm_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_show_the_example_file_verbatim():
    text = (ROOT / "docs" / "architecture.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert EXAMPLE.read_text() in blocks


@torch.no_grad()
def test_the_one_file_method_keeps_the_sinks_and_the_smallest_keys(registry):
    load_example()
    model = tiny_model("llama-gqa")
    input_ids, attention_mask = random_batch(length=40, pad=(0, 6))
    budget = 12
    compressed = keepkv.CompressedCache(model.config, "knorm", budget)
    full = keepkv.CompressedCache(model.config, "full")
    with keepkv.enabled(model):
        model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=compressed)
        model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=full)
    for small, big in zip(compressed.layers, full.layers):
        assert (small.live_counts() == budget).all()
        norms = big.keys.float().norm(dim=-1).masked_fill(~big.live(), float("inf"))
        norms = norms.masked_fill((big.positions >= 0) & (big.positions < 4), float("-inf"))  # the sinks
        expected = big.positions.gather(-1, norms.topk(budget, largest=False).indices).sort(-1).values
        got = small.positions.masked_fill(~small.live(), -1).sort(-1).values[..., -budget:]
        assert torch.equal(got, expected)
    tokens = keepkv.get_method("knorm+sinks=0")
    assert tokens.selection.sinks == 0 and tokens.name == "knorm"
    paired = keepkv.get_method("keepkv+selection=knorm")  # the new selection pairs with another merge
    assert paired.selection.name == "knorm" and paired.merging.name == "keepkv"
