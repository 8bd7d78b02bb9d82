"""Whole-layer copies per decode step, per method: how many new buffers the store allocates for
a layer while decoding (each a copy of one per-entry tensor of the whole layer: keys, values,
bias, positions or a method's extra), and how many of them are keys or values.

    python benchmarks/contract/layer_copies.py

Tiny random Llama (GQA, 4 layers), 2 rows of 256-token prompts, budget 64, 32 greedy steps.
Counts the ``LayerStore`` buffer allocations after the prefill ended, per layer and step.
"""

import json
import sys
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import keepkv
from keepkv.store import LayerStore
from keepkv.methods import METHODS

STEPS, LAYERS = 32, 4


def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return LlamaForCausalLM(config).eval()


def copies(net, spec: str) -> dict:
    counted = {"on": False, "n": 0, "kv": 0}
    original = LayerStore._new_buffer

    def counting(self, name, like, slots):
        if counted["on"]:
            counted["n"] += 1
            counted["kv"] += name in ("keys", "values")
        return original(self, name, like, slots)

    LayerStore._new_buffer = counting
    try:
        cache = keepkv.CompressedCache(net.config, spec, 64)
        ids = torch.randint(3, 128, (2, 256), generator=torch.Generator().manual_seed(1))
        with keepkv.enabled(net), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = net(ids, past_key_values=cache)
            counted["on"] = True
            token = out.logits[:, -1:].argmax(-1)
            for _ in range(STEPS):
                token = net(token, past_key_values=cache).logits[:, -1:].argmax(-1)
    finally:
        LayerStore._new_buffer = original
    steps = STEPS * LAYERS
    return {"buffers": round(counted["n"] / steps, 3), "keys+values": round(counted["kv"] / steps, 3)}


if __name__ == "__main__":
    torch.set_num_threads(1)
    net = model()
    specs = sys.argv[1:] or sorted(METHODS)
    print(json.dumps({spec: copies(net, spec) for spec in specs}, indent=1))
