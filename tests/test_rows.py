"""Row-reshaping hooks transformers calls on a cache: beam search's ``reorder_cache``,
``batch_repeat_interleave``, ``batch_select_indices`` and ``crop``.

Every per-row tensor (entries, bias, positions, extras, counts, budgets, the method's state)
must follow the rows; what cannot be done correctly is refused in one line.
"""

import copy

import pytest
import torch

import keepkv
from keepkv.methods import METHODS

from conftest import prefill, random_batch, tiny_model

MERGING_VARIANTS = ["keepkv+threshold=-1.0", "keepkv+selection=ema+refresh_interval=3", "snapkv+merge=zip+threshold=-1.0", "h2o+merge=zip+zip_key=group"]
COMPRESSING = [m for m in sorted(METHODS) if m != "full"] + MERGING_VARIANTS
# Rows of 30, 21 and 10 real tokens.
PADS = (0, 9, 20)


@torch.no_grad()
def _prefill_and_decode(model, cache, input_ids, attention_mask, steps):
    """Prefill, then ``steps`` greedy steps; returns (next tokens [B, 1], mask)."""
    logits = prefill(model, cache, input_ids, attention_mask)[:, None]
    mask = attention_mask
    for _ in range(steps):
        token = logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
        logits = model(input_ids=token, attention_mask=mask, past_key_values=cache).logits
    return logits[:, -1:].argmax(-1), mask


@torch.no_grad()
def _continue(model, cache, tokens, mask, steps):
    """Feed ``tokens`` [B, steps] one at a time; logits [B, steps, V]."""
    out = []
    for step in range(steps):
        token = tokens[:, step : step + 1]
        mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
        out.append(model(input_ids=token, attention_mask=mask, past_key_values=cache).logits[:, -1])
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("hook", ["reorder_cache", "batch_select_indices", "batch_repeat_interleave"])
@pytest.mark.parametrize("method", COMPRESSING)
def test_reshaped_rows_decode_as_their_source_rows(method, hook):
    """After a hook picks rows ``index`` of a compressed batch, decoding the same tokens gives row r
    the logits its source row index[r] gets in the untouched batch: every piece of per-row state
    moved with the row (bias, positions, counts, budgets, scores, the method's state)."""
    model = tiny_model("llama-gqa", layers=2)
    input_ids, attention_mask = random_batch(batch=3, length=30, pad=PADS)
    cache = keepkv.CompressedCache(model.config, f"{method}+interval=2", 8)
    _, mask = _prefill_and_decode(model, cache, input_ids, attention_mask, steps=5)
    reshaped = copy.deepcopy(cache)
    if hook == "reorder_cache":
        index = torch.tensor([2, 0, 0])
        reshaped.reorder_cache(index)
    elif hook == "batch_select_indices":
        index = torch.tensor([2, 1])
        reshaped.batch_select_indices(index)
    else:
        index = torch.tensor([0, 0, 1, 1, 2, 2])
        reshaped.batch_repeat_interleave(2)
    tokens = torch.randint(3, 100, (3, 6), generator=torch.Generator().manual_seed(7))
    reference = _continue(model, cache, tokens, mask, 6)
    logits = _continue(model, reshaped, tokens[index], mask[index], 6)
    torch.testing.assert_close(logits, reference[index], atol=1e-4, rtol=1e-4)
    for source, layer in zip(cache.layers, reshaped.layers):
        assert torch.equal(layer.real_seen, source.real_seen[index])
        assert torch.equal(layer.budget, source.budget[index])
        assert torch.equal(layer.live_counts(), source.live_counts()[index])


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2"])
@pytest.mark.parametrize("method", ["full", "h2o", "keepkv", "kvreviver"])
def test_beam_search_with_a_budget_that_covers_everything_equals_hf(kind, method):
    model = tiny_model(kind, layers=2)
    input_ids, attention_mask = random_batch(batch=2, length=20, pad=(0, 7))
    options = dict(num_beams=3, num_return_sequences=2, max_new_tokens=8, do_sample=False, pad_token_id=0)
    model.set_attn_implementation("sdpa")
    reference = model.generate(input_ids=input_ids, attention_mask=attention_mask, **options)
    keepkv.enable(model)
    cache = keepkv.CompressedCache(model.config, method, 1000)
    output = model.generate(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, **options)
    assert torch.equal(output, reference)


@pytest.mark.parametrize("method", ["h2o", "keepkv", "kvreviver", "zeromerge", "d2o"])
def test_beam_search_with_compression_reorders_every_row(method):
    """Each reorder_cache call of a compressed beam search leaves row r equal to the old row
    beam_idx[r], field by field (a reorder done by hand)."""
    model = tiny_model("llama-gqa", layers=2)
    input_ids, attention_mask = random_batch(batch=2, length=24, pad=(0, 7))
    keepkv.enable(model)
    checked = []

    class Checked(keepkv.CompressedCache):
        def reorder_cache(self, beam_idx):
            before = copy.deepcopy(self)
            super().reorder_cache(beam_idx)
            for old, new in zip(before.layers, self.layers):
                _assert_rows(old, new, beam_idx)
            checked.append(beam_idx.tolist())

    cache = Checked(model.config, method, 10)
    model.generate(
        input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, num_beams=3, max_new_tokens=8,
        do_sample=False, pad_token_id=0,
    )
    assert checked and any(index != sorted(index) or len(set(index)) < len(index) for index in checked)


def _assert_rows(old, new, index):
    """Row r of layer ``new`` holds what row index[r] of ``old`` held (live entries by position)."""
    assert torch.equal(new.real_seen, old.real_seen[index])
    assert torch.equal(new.budget, old.budget[index])
    for r, source in enumerate(index.tolist()):
        for name in ("keys", "values", "bias", "positions"):
            assert torch.equal(getattr(new, name)[r], getattr(old, name)[source]), name
        for name, extra in old.extras.items():
            assert torch.equal(new.extras[name][r], extra[source]), name
        for name, value in old.state.items():
            if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == old.keys.shape[0]:
                assert torch.equal(new.state[name][r], value[source]), name


@torch.no_grad()
def test_crop_is_refused_in_one_line_and_crop_zero_changes_nothing():
    model = tiny_model("llama-gqa", layers=2)
    input_ids, attention_mask = random_batch(batch=2, length=20, pad=(0, 5))
    cache = keepkv.CompressedCache(model.config, "h2o", 8)
    _prefill_and_decode(model, cache, input_ids, attention_mask, steps=2)
    before = copy.deepcopy(cache)
    cache.crop(0)
    for old, new in zip(before.layers, cache.layers):
        assert torch.equal(old.keys, new.keys) and torch.equal(old.bias, new.bias)
    with pytest.raises(ValueError, match="crop") as error:
        cache.crop(-1)
    assert "\n" not in str(error.value)
    assert cache.layers[0].seen == before.layers[0].seen  # nothing lost
    assert not cache.is_croppable  # assisted decoding refuses before it drafts


def test_assisted_decoding_is_refused():
    model = tiny_model("llama-gqa", layers=2)
    assistant = tiny_model("llama-gqa", layers=1, seed=1)
    input_ids, attention_mask = random_batch(batch=1, length=12, pad=(0,))
    keepkv.enable(model)
    cache = keepkv.CompressedCache(model.config, "h2o", 8)
    with pytest.raises(ValueError, match="crop"):
        model.generate(
            input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, assistant_model=assistant,
            max_new_tokens=4, do_sample=False, pad_token_id=0,
        )


@torch.no_grad()
def test_state_that_cannot_follow_its_rows_is_refused_and_nothing_moves():
    model = tiny_model("llama-gqa", layers=2)
    input_ids, attention_mask = random_batch(batch=2, length=20, pad=(0, 5))
    cache = keepkv.CompressedCache(model.config, "h2o", 8)
    _prefill_and_decode(model, cache, input_ids, attention_mask, steps=2)
    cache.layers[1].state["opaque"] = object()  # e.g. a third-party method's handle
    before = copy.deepcopy(cache.layers[0].bias)
    with pytest.raises(ValueError, match="'opaque'.*cannot be reordered") as error:
        cache.reorder_cache(torch.tensor([1, 1]))
    assert "\n" not in str(error.value)
    assert torch.equal(cache.layers[0].bias, before)  # layer 0 untouched: every state is checked first
    with pytest.raises(ValueError, match=r"row indices must be in \[0, 2\)"):
        cache.reorder_cache(torch.tensor([0, 2]))
