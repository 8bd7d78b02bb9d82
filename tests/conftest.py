"""Tiny random-weight models built from configs, shared by the unit tests."""

import os

import pytest
import torch

# The Triton kernels' tests run in Triton's interpreter where there is no GPU. Triton reads this
# when it is imported (its own library functions are jitted then), so it is set before anything
# can import it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import keepkv
import keepkv.reconstruction

VOCAB = 128

# Property-based tests: hypothesis' default example count, derandomized in CI (a failure
# reproduces), and a deeper random search with ``pytest --hypothesis-profile=long``. The model
# fuzz (test_fuzz.py) runs FUZZ_EXAMPLES[profile] examples: a fixed, small budget in CI.
_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True, suppress_health_check=_HEALTH)
settings.register_profile("long", max_examples=1000, deadline=None, print_blob=True, suppress_health_check=_HEALTH)
settings.load_profile("ci")
FUZZ_EXAMPLES = {"ci": 50, "long": 2000}


def fuzz_settings(share: float = 1.0) -> settings:
    """Settings of a model fuzz test: ``share`` of the current profile's fuzz examples."""
    examples = FUZZ_EXAMPLES.get(settings.get_current_profile_name(), FUZZ_EXAMPLES["ci"])
    return settings(max_examples=max(1, round(examples * share)))
# Tiny tensors: thread fan-out costs far more than it saves, most of all on a busy 2-core machine.
torch.set_num_threads(1)


def tiny_model(kind: str = "llama-gqa", layers: int = 2, seed: int = 0):
    """A small random model; initializer_range 0.2 makes greedy choices robust to rounding."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=4096,
        initializer_range=0.2,
    )
    if kind == "llama-mha":
        model = LlamaForCausalLM(LlamaConfig(num_key_value_heads=4, **common))
    elif kind == "llama-gqa":
        model = LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, **common))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, **common))
    else:
        raise ValueError(kind)
    return model.eval()


class CharTokenizer:
    """One token per character, enough for keepkv.generate on a tiny model."""

    chat_template = None
    pad_token = eos_token = "<pad>"
    pad_token_id = 0
    padding_side = "left"

    def __call__(self, texts, return_tensors="pt", padding=True, add_special_tokens=True):
        rows = [[3 + ord(c) % (VOCAB - 3) for c in text] for text in texts]
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        return {"input_ids": ids, "attention_mask": mask}

    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(str(int(t)) for t in row) for row in ids]


@pytest.fixture(params=["llama-mha", "llama-gqa", "qwen2"])
def any_model(request):
    return tiny_model(request.param)


@pytest.fixture
def gqa_model():
    return tiny_model("llama-gqa")


@pytest.fixture
def mha_model():
    return tiny_model("llama-mha")


def random_batch(batch=2, length=24, pad=(0, 6), seed=1):
    """Left-padded random prompts: row i has pad[i] padding tokens."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (batch, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row, count in enumerate(pad[:batch]):
        attention_mask[row, :count] = 0
        input_ids[row, :count] = 0
    return input_ids, attention_mask


def char_tokenizer():
    """One token per character (ids 3..VOCAB-1), built in memory: enough for stop strings, streamers
    and the instruction of a reconstruction pass."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)]
    chars += [chr(c) for c in range(192, 192 + VOCAB - 3 - len(chars))]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: 3 + i for i, c in enumerate(chars)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left"
    )


@torch.no_grad()
def prefill(model, cache, input_ids, attention_mask, positions="slots"):
    """The prompt into ``cache``, compressed as its method says; its last logits [B, V]. A method
    with a reconstruction pass (KVzip) runs it (the instruction tokenized by :func:`char_tokenizer`).
    ``positions``: "slots", as a forward without ``position_ids`` numbers them (the tests' decode
    loops go on that way), or "real", as ``model.generate`` does."""
    keepkv.enable(model)
    if cache.defers_to_reconstruction:
        return keepkv.reconstruction.prefill(
            model, char_tokenizer(), cache, input_ids, attention_mask, chat=False, positions=positions
        )
    return model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache).logits[:, -1]


@torch.no_grad()
def run_generate(model, input_ids, attention_mask, method="full", budget=1.0, new_tokens=10, **params):
    """Greedy generate with a CompressedCache; returns (new token ids, cache). A method with a
    reconstruction pass gets its prompt prefilled by it, its first token from that prefill."""
    keepkv.enable(model)
    cache = keepkv.CompressedCache(model.config, method, budget, **params)
    first = input_ids[:, :0]
    if cache.defers_to_reconstruction:
        first = prefill(model, cache, input_ids, attention_mask, positions="real").argmax(-1, keepdim=True)
        input_ids = torch.cat([input_ids, first], dim=-1)
        attention_mask = torch.cat([attention_mask, torch.ones_like(first)], dim=-1)
        new_tokens -= 1
    output = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        past_key_values=cache,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return torch.cat([first, output[:, input_ids.shape[1]:]], dim=-1), cache


@torch.no_grad()
def decode_loop(model, input_ids, attention_mask, cache, steps):
    """Prefill then `steps` greedy decode steps with a plain forward loop; yields the cache after each step."""
    keepkv.enable(model)
    logits = prefill(model, cache, input_ids, attention_mask)[:, None]
    mask = attention_mask
    for _ in range(steps):
        token = logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
        logits = model(input_ids=token, attention_mask=mask, past_key_values=cache).logits
        yield cache


@torch.no_grad()
def greedy_decode(model, method, budget, steps=12, device="cpu", **cache_options):
    """Greedy decode of a left-padded batch of rows with 30, 21 and 10 real tokens on ``device``
    (the model's); (logits [steps, B, V], tokens [steps, B], cache)."""
    input_ids, attention_mask = (t.to(device) for t in random_batch(batch=3, length=30, pad=(0, 9, 20)))
    cache = keepkv.CompressedCache(model.config, method, budget, **cache_options)
    logits = prefill(model, cache, input_ids, attention_mask)
    mask, all_logits, tokens = attention_mask, [], []
    for _ in range(steps):
        token = logits.argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
        logits = model(input_ids=token, attention_mask=mask, past_key_values=cache).logits[:, -1]
        all_logits.append(logits)
        tokens.append(token[:, 0])
    return torch.stack(all_logits), torch.stack(tokens), cache
