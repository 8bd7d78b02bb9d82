"""A prompt read in chunks and compressed chunk by chunk (``Method.compresses_chunks``).

A selection that scores each entry alone (the learned one) keeps, after every chunk, the entries
the whole prompt's budget allows; the last chunk's compression then keeps what one compression
of the whole prompt keeps, wherever the layer's entries are the same (the first layer, whose
keys and values do not depend on attention, and every layer when the budget holds all but the
last chunk). Later chunks attend to the compressed earlier ones, so a deeper layer's entries,
and the greedy tokens, may differ from a whole prompt's.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import keepkv

from helpers import with_scorer
from conftest import fuzz_settings, random_batch, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::keepkv.KeepKVWarning")

# fp64: a chunk's keys come from a matmul of other shapes than the whole prompt's, and in fp32 the
# rounding can flip two entries whose predicted scores nearly tie
MODEL = tiny_model("llama-gqa", layers=3).double()
LENGTH = 40


def random_scorer(tmp_path=None, seed: int = 0) -> str:
    """A scorer file of random weights for MODEL (tests/helpers.with_scorer): an entry-local score like any trained one."""
    return with_scorer("snapkv+selection=learned", MODEL.config, seed).split("+scorer=")[1]


def kept_scores(cache, layer: int = 0) -> torch.Tensor:
    """[B, H_kv, budget] the predicted scores of what ``layer`` keeps, sorted: equal where two
    caches keep the same entries up to exact ties (a token repeated in the prompt has the same
    first-layer key norms and value, hence the same score, wherever it sits)."""
    store = cache.layers[layer]
    scores = cache.method.selection.scores(store).masked_fill(~store.live(), float("-inf"))
    return scores.sort(-1, descending=True).values


def kept(cache) -> list[list[list[int]]]:
    """Per layer, per row: the sorted positions each row's first KV head keeps."""
    return [[sorted(p for p in row if p >= 0) for row in layer.positions[:, 0].tolist()] for layer in cache.layers]


@torch.no_grad()
def prefill(method: str, budget, chunk: int | None, pad=(0, 9)):
    ids, mask = random_batch(batch=len(pad), length=LENGTH, pad=pad)
    keepkv.enable(MODEL)
    cache = keepkv.CompressedCache(MODEL.config, method, budget)
    if chunk is None:
        MODEL(input_ids=ids, attention_mask=mask, past_key_values=cache)
        return cache
    cache.start_prefill(mask)
    for start in range(0, LENGTH, chunk):
        MODEL(input_ids=ids[:, start : start + chunk], attention_mask=mask[:, : start + chunk], past_key_values=cache)
    return cache


@fuzz_settings()
@given(budget=st.one_of(st.integers(1, LENGTH + 5), st.floats(0.02, 1.0)), chunk=st.integers(1, LENGTH),
       pad=st.sampled_from([(0,), (0, 9), (13, 0, 30)]), seed=st.integers(0, 3))
def test_the_first_layer_keeps_the_whole_prompts_entries_at_any_budget_chunk_and_rows(tmp_path_factory, budget,
                                                                                        chunk, pad, seed):
    method = f"snapkv+selection=learned+budgets=uniform+scorer={random_scorer(tmp_path_factory.mktemp('s'), seed)}"
    whole, chunked = prefill(method, budget, None, pad), prefill(method, budget, chunk, pad)
    identity = isinstance(budget, float) and budget == 1.0
    assert chunked.compresses_chunks != identity and not whole.compresses_chunks
    torch.testing.assert_close(kept_scores(chunked), kept_scores(whole))


def test_a_chunked_prompt_never_holds_more_than_its_budget_and_one_chunk(tmp_path):
    """Budget 4 of a 40-token prompt read 5 at a time: after each chunk every layer is back at 4
    entries per row and head (+ the chunk while it is read); snapkv, which needs the whole prompt's
    attention, holds the whole prompt until its end."""
    seen, peaks = [], []
    keepkv.enable(MODEL)
    ids, mask = random_batch(batch=2, length=LENGTH, pad=(0, 9))
    for method in (f"snapkv+selection=learned+budgets=uniform+scorer={random_scorer(tmp_path)}", "snapkv"):
        cache = keepkv.CompressedCache(MODEL.config, method, 4)
        cache.start_prefill(mask)
        sizes = []
        with torch.no_grad():
            for start in range(0, LENGTH, 5):
                MODEL(input_ids=ids[:, start : start + 5], attention_mask=mask[:, : start + 5], past_key_values=cache)
                sizes.append(max(int(layer.live_counts().max()) for layer in cache.layers))
        seen.append(sizes)
        peaks.append(cache.prefill_peak_bytes)
    learned, snapkv = seen
    assert max(learned) <= 4 and learned[-1] == 4
    assert snapkv[-2] == 35  # every layer holds the prompt read so far until its end
    assert snapkv[-1] <= 4
    assert peaks[0] < 0.5 * peaks[1]  # the whole uncompressed prompt in every layer at once


def test_a_budget_that_holds_every_chunk_compresses_nothing_before_the_last(tmp_path):
    """Budget 1.0, or a budget of at least the prompt: no row is touched, chunked or not."""
    method = f"snapkv+selection=learned+budgets=uniform+scorer={random_scorer(tmp_path)}"
    for budget in (1.0, LENGTH, LENGTH + 3):
        whole, chunked = prefill(method, budget, None), prefill(method, budget, 7)
        assert kept(chunked) == kept(whole)
        for layer in chunked.layers:
            counts = layer.live_counts()[:, 0].tolist()
            assert counts == [LENGTH, LENGTH - 9]


def test_methods_that_read_the_whole_prompt_are_not_compressed_chunk_by_chunk(tmp_path):
    scorer = random_scorer(tmp_path)
    for method in ("snapkv", "h2o", "keepkv", "streamingllm", "window", "pyramidkv", f"keepkv+selection=learned+budgets=uniform+scorer={scorer}",
                   f"snapkv+selection=learned+budgets=uniform+merge=zip+scorer={scorer}"):
        cache = keepkv.CompressedCache(MODEL.config, method, 8)
        cache.start_prefill(torch.ones(1, LENGTH, dtype=torch.bool))
        assert not cache.compresses_chunks, method


@pytest.mark.parametrize("budget", [1, 5, 12, 0.3])
@pytest.mark.parametrize("chunk", [3, 8, 16])
def test_a_learned_scorer_keeps_the_whole_prompts_entries_where_its_entries_are_the_same(tmp_path, budget, chunk):
    """The first layer's keys and values do not depend on attention: it keeps the whole prompt's
    entries at any budget. Deeper layers read chunks that attended to compressed earlier ones,
    so their entries (and hence what they keep) may differ; a budget that holds every chunk but
    the last changes nothing before the last chunk, so every layer keeps the same."""
    method = f"snapkv+selection=learned+budgets=uniform+scorer={random_scorer(tmp_path)}"
    whole, chunked = prefill(method, budget, None), prefill(method, budget, chunk)
    assert chunked.compresses_chunks
    torch.testing.assert_close(kept_scores(chunked), kept_scores(whole))
    if budget == 12:  # the scorer's choice, not just the sinks and the oldest
        assert kept(whole)[0] != [list(range(12)), list(range(12))]
    roomy = LENGTH - (LENGTH - 1) % chunk - 1  # the prompt less its last chunk, at least
    whole, chunked = prefill(method, roomy, None), prefill(method, roomy, chunk)
    assert kept(chunked) == kept(whole)


@pytest.mark.parametrize("budget", [1, 5, 12, 0.3])
def test_trained_layer_shares_compress_chunk_by_chunk_and_keep_the_whole_prompts_first_layer(tmp_path, budget):
    """budgets='trained' sizes the layers from the prompt's length alone (the scorer's layer shares):
    a prompt read in chunks is compressed chunk by chunk, each layer to its own share, and the first
    layer keeps the whole prompt's entries."""
    method = f"snapkv+selection=learned+budgets=trained+scorer={random_scorer(tmp_path)}"
    whole, chunked = prefill(method, budget, None), prefill(method, budget, 8)
    assert chunked.compresses_chunks
    assert torch.equal(chunked.layer_budgets, whole.layer_budgets)
    assert (whole.layer_budgets[0] >= whole.layer_budgets[-1]).all()  # the helper's shares: 1.5 down to 0.5
    torch.testing.assert_close(kept_scores(chunked), kept_scores(whole))


def test_learned_with_a_split_over_layers_is_compressed_at_the_prompts_end(tmp_path):
    """budgets='layers' sizes the layers from every layer's scores: no chunk can be compressed early."""
    method = f"snapkv+selection=learned+budgets=layers+scorer={random_scorer(tmp_path)}"
    cache = keepkv.CompressedCache(MODEL.config, method, 8)
    cache.start_prefill(torch.ones(1, LENGTH, dtype=torch.bool))
    assert not cache.compresses_chunks


def test_compress_chunks_false_compresses_at_the_prompts_end(tmp_path):
    """start_prefill(compress_chunks=False): the prompt's end compresses, as every other method
    and as keepkv.vllm serves; the layers hold the whole prompt until then."""
    ids, mask = random_batch(batch=1, length=LENGTH, pad=(0,))
    keepkv.enable(MODEL)
    cache = keepkv.CompressedCache(MODEL.config, f"snapkv+selection=learned+budgets=uniform+scorer={random_scorer(tmp_path)}", 4)
    cache.start_prefill(mask, compress_chunks=False)
    assert not cache.compresses_chunks
    with torch.no_grad():
        for start in range(0, LENGTH - 8, 8):
            MODEL(input_ids=ids[:, start : start + 8], attention_mask=mask[:, : start + 8], past_key_values=cache)
    assert all(int(layer.live_counts().max()) == LENGTH - 8 for layer in cache.layers)
