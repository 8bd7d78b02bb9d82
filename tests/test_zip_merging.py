"""Selection and merging compose: any scored eviction method can ZIP-merge what it evicts, and
KeepKV can run with any of their selection rules."""

import pytest
import torch

import keepkv
from keepkv.perturbation import perturbation

from conftest import decode_loop, random_batch, tiny_model

EVICTION = ["h2o", "snapkv", "pyramidkv", "streamingllm", "window"]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("method", EVICTION)
@torch.no_grad()
def test_zip_merged_eviction_is_lossless_for_the_last_prompt_query_on_mha(method):
    """Theorem 3 with exact logits: merging every evicted entry keeps the step's output."""
    model = tiny_model("llama-mha")
    ids, _ = random_batch(batch=1, length=40, pad=(0,), seed=3)
    merged = perturbation(model, None, ids, f"{method}+merge=zip+threshold=-1.0", budget=12, steps=())
    evicted = perturbation(model, None, ids, method, budget=12, steps=())
    assert max(merged["layers"]) <= 1e-5, merged["layers"]
    assert min(evicted["layers"]) > 1e-3  # eviction alone does change the output


@pytest.mark.parametrize("method", EVICTION)
@torch.no_grad()
def test_zip_merged_eviction_conserves_votes_while_decoding(method):
    model = tiny_model("llama-gqa")
    input_ids, attention_mask = random_batch(batch=2, length=30, pad=(0, 8))
    cache = keepkv.CompressedCache(model.config, f"{method}+merge=zip+threshold=-1.0", 10)
    for cache in decode_loop(model, input_ids, attention_mask, cache, steps=5):
        for layer in cache.layers:
            votes = layer.bias.exp().sum(-1)  # empty slots: exp(-inf) = 0
            assert torch.allclose(votes, layer.real_seen.float()[:, None], rtol=1e-5)
            assert (layer.live_counts() == 10).all()


@pytest.mark.parametrize("selection", ["snapkv", "h2o", "pyramidkv", "streamingllm"])
@torch.no_grad()
def test_keepkv_with_a_selection_and_no_merge_keeps_exactly_what_that_method_keeps(selection):
    model = tiny_model("llama-gqa", layers=3)
    input_ids, attention_mask = random_batch(batch=2, length=60, pad=(0, 15))
    caches = [
        keepkv.CompressedCache(model.config, spec, 0.3) for spec in (selection, f"keepkv+selection={selection}+merge=none")
    ]
    loops = [decode_loop(model, input_ids, attention_mask, cache, steps=6) for cache in caches]
    for reference, variant in zip(*loops):
        for ref_layer, layer in zip(reference.layers, variant.layers):
            assert torch.equal(ref_layer.budget, layer.budget)
            assert torch.equal(ref_layer.positions, layer.positions)


def test_keepkv_selection_changes_what_is_kept():
    model = tiny_model("llama-gqa", layers=2)
    input_ids, attention_mask = random_batch(batch=1, length=60, pad=(0,))
    kept = []
    for spec in ("keepkv+selection=ema", "keepkv+selection=snapkv"):
        cache = keepkv.CompressedCache(model.config, spec, 0.3)
        next(decode_loop(model, input_ids, attention_mask, cache, steps=1))
        kept.append(cache.layers[1].positions)
    assert not torch.equal(*kept)


@pytest.mark.parametrize(
    "spec,message",
    [
        ("snapkv+merge=sum", "merge must be one of"),
        ("h2o+merge=zip+threshold=2", "threshold must be in"),
        ("window+merge=zip+zip_key=cosine", "zip_key must be one of"),
        ("keepkv+selection=kvpress", "selection must be one of"),
        ("keepkv+selection=ema+merge=none", "selection 'ema' ranks by the EMA that merge 'keepkv' keeps"),
        ("window+merge=pivot", "merge 'pivot' picks each set's pivot by the selection's scores"),
        ("keepkv+selection=snapkv+refresh_interval=4", "refresh_interval re-ranks"),
        ("keepkv+selection=ema+kernel=4", "kernel must be an odd int"),
        ("keepkv+window=4", "write selection.window or merge.window"),
    ],
)
def test_bad_merge_and_selection_parameters_raise_one_line_errors(spec, message):
    with pytest.raises(ValueError, match=message) as error:
        keepkv.get_method(spec)
    assert "\n" not in str(error.value)
