"""Named model shapes for speed benchmarks, built as HF configs with random weights.

Random weights give the right FLOPs and bytes, not meaningful text: use them for speed only.

Construction is cheap: the model is allocated directly on the target device in the target
dtype (``torch.device(device)`` context, ``dtype=`` to ``from_config``), HF's weight
initialisation is skipped (``no_init_weights``), and the weights are then filled in place
with a seeded uniform distribution (std 0.02; norms 1, biases 0). A 7B shape in bf16 on a
GPU builds in seconds; on CPU a 7B shape is 14 GB in bf16 and 28 GB in fp32, so shrink it
with ``layers=`` (``--layers N``) for a smoke run: per-layer costs scale linearly.
"""

from __future__ import annotations

import math

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config


def _shape(vocab, hidden, intermediate, layers, heads, kv_heads, positions, eps, theta, tied=False, **extra) -> dict:
    """The HF config kwargs of one decoder shape."""
    return dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=positions,
        rms_norm_eps=eps, rope_theta=theta, tie_word_embeddings=tied, **extra,
    )


# name -> (config class, kwargs). The public shapes of each model family, with the architecture
# their hub configs name (a learned scorer is keyed to it: keepkv.scorer.config_key).
LLAMA, MISTRAL, QWEN2 = (dict(architectures=[name]) for name in ("LlamaForCausalLM", "MistralForCausalLM",
                                                                   "Qwen2ForCausalLM"))
CONFIGS: dict[str, tuple[type, dict]] = {
    #                              vocab   hidden inter  layers heads kv  positions eps    rope theta
    "llama2-7b": (LlamaConfig, _shape(32000, 4096, 11008, 32, 32, 32, 4096, 1e-5, 10000.0, **LLAMA)),
    "llama3-8b": (LlamaConfig, _shape(128256, 4096, 14336, 32, 32, 8, 8192, 1e-5, 500000.0, **LLAMA)),
    # v0.2 shape: no sliding window
    "mistral-7b": (MistralConfig, _shape(32000, 4096, 14336, 32, 32, 8, 32768, 1e-5, 1000000.0, sliding_window=None,
                                         **MISTRAL)),
    "qwen2-7b": (Qwen2Config, _shape(152064, 3584, 18944, 28, 28, 4, 32768, 1e-6, 1000000.0, use_sliding_window=False,
                                     **QWEN2)),
    "smollm2-135m": (LlamaConfig, _shape(49152, 576, 1536, 30, 9, 3, 8192, 1e-5, 100000.0, tied=True, **LLAMA)),
}


def build_config(name: str, layers: int | None = None, **overrides):
    """The HF config of a named shape; ``layers`` overrides the depth (smoke runs).

    Raises ValueError for an unknown name or a non-positive ``layers``.
    """
    if name not in CONFIGS:
        raise ValueError(f"unknown config {name!r}; choose one of: {', '.join(sorted(CONFIGS))}")
    cls, kwargs = CONFIGS[name]
    kwargs = {**kwargs, **overrides}
    if layers is not None:
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(f"layers must be an int >= 1, got {layers!r}")
        kwargs["num_hidden_layers"] = layers
    return cls(**kwargs)


def param_bytes(config, dtype: torch.dtype) -> int:
    """Bytes the weights of ``config`` take in ``dtype`` (checked before allocating)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    attn = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
    per_layer = attn + 3 * hidden * inter + 2 * hidden
    embed = config.vocab_size * hidden * (1 if config.tie_word_embeddings else 2)
    count = config.num_hidden_layers * per_layer + embed + hidden
    itemsize = torch.empty((), dtype=dtype).element_size()
    return count * itemsize


@torch.no_grad()
def random_model(config, dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0):
    """A causal LM of ``config`` with seeded random weights, built directly on ``device`` in ``dtype``."""
    from transformers.initialization import no_init_weights

    with torch.device(device), no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    generator = torch.Generator(device=device).manual_seed(seed)
    bound = 0.02 * math.sqrt(3.0)
    seen = set()
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        if name.endswith("bias"):
            param.zero_()
        elif param.dim() == 1:  # RMSNorm weights
            param.fill_(1.0)
        else:
            param.uniform_(-bound, bound, generator=generator)
    return model.eval()
