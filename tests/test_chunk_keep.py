"""A prompt whose chunks are compressed alone as they arrive (``start_prefill(chunk_keep=(N, K))``).

Each whole chunk of N tokens keeps K entries per layer and head, chosen among its own by the
method's selection (and merged by its merge), and the entries before it are never touched again.
A compressed document is then the same prefix whatever follows it: what a prefix cache of
compressed documents needs (issue "Compress once, serve many").
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import keepkv

from conftest import fuzz_settings, random_batch, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::keepkv.KeepKVWarning")

# fp64: a later prompt is fed in the same blocks, but its rows are computed beside other rows
MODEL = tiny_model("llama-gqa", layers=3).double()
METHODS = ["snapkv", "h2o", "keepkv", "streamingllm", "window", "pyramidkv"]
CHUNK = 16


@torch.no_grad()
def prefill(method: str, ids, mask, kept: int, budget: int = 40, decode: int = 0):
    """A keep_prompt cache fed ``ids`` [B, T] in blocks of CHUNK (chunk_keep=(CHUNK, kept)), then
    ``decode`` greedy tokens one at a time."""
    keepkv.enable(MODEL)
    cache = keepkv.CompressedCache(MODEL.config, method, budget, decoding="keep_prompt")
    cache.start_prefill(mask, chunk_keep=(CHUNK, kept))
    length = ids.shape[1]
    for start in range(0, length, CHUNK):
        out = MODEL(input_ids=ids[:, start : start + CHUNK], attention_mask=mask[:, : start + CHUNK],
                    past_key_values=cache)
    for _ in range(decode):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        out = MODEL(input_ids=token, attention_mask=mask, past_key_values=cache)
    return cache


def entries_below(cache, row: int, position: int) -> list[dict]:
    """Per layer: row ``row``'s entries of positions below ``position``, in position order per head
    (keys, values, bias and positions)."""
    found = []
    for layer in cache.layers:
        positions = layer.positions[row]  # [H_kv, S]
        heads = []
        for head in range(positions.shape[0]):
            where = ((positions[head] >= 0) & (positions[head] < position)).nonzero().flatten()
            where = where[positions[head, where].argsort()]
            heads.append({name: getattr(layer, name)[row, head, where] for name in ("keys", "values", "bias", "positions")})
        found.append(heads)
    return found


def assert_same(a: list[dict], b: list[dict]) -> None:
    for layer_a, layer_b in zip(a, b):
        for head_a, head_b in zip(layer_a, layer_b):
            for name in head_a:
                assert torch.equal(head_a[name], head_b[name]), name


@fuzz_settings()
@given(method=st.sampled_from(METHODS), kept=st.integers(1, CHUNK - 1), chunks=st.integers(1, 3),
       tail=st.integers(0, 2 * CHUNK + 5), seed=st.integers(0, 3))
def test_a_compressed_chunk_is_the_same_whatever_follows_it(method, kept, chunks, tail, seed):
    """A document of whole chunks keeps the same entries (keys, values, votes, positions), bit for
    bit, whether the prompt ends with it or goes on with other tokens; each of its chunks keeps
    exactly ``kept`` entries per layer and head."""
    document = chunks * CHUNK
    ids, mask = random_batch(batch=1, length=document + tail, pad=(0,), seed=seed)
    other, _ = random_batch(batch=1, length=document + tail, pad=(0,), seed=seed + 100)
    alone = prefill(method, ids[:, :document], mask[:, :document], kept)
    followed = prefill(method, ids, mask, kept)
    other_ids = torch.cat([ids[:, :document], other[:, document:]], dim=1)
    followed_otherwise = prefill(method, other_ids, mask, kept)
    reference = entries_below(alone, 0, document)
    assert_same(entries_below(followed, 0, document), reference)
    assert_same(entries_below(followed_otherwise, 0, document), reference)
    for layer in reference:
        for head in layer:
            assert head["positions"].numel() == chunks * kept
    # the tail past the last whole chunk is kept whole
    whole_tail = tail % CHUNK
    for layer in followed.layers:
        counts = ((layer.positions[0] >= 0) & (layer.positions[0] < document + tail)).sum(-1)
        assert counts.tolist() == [(chunks + tail // CHUNK) * kept + whole_tail] * counts.numel()


def test_two_documents_sharing_a_first_chunk_share_only_its_entries():
    ids, mask = random_batch(batch=1, length=2 * CHUNK, pad=(0,), seed=5)
    second, _ = random_batch(batch=1, length=2 * CHUNK, pad=(0,), seed=6)
    other = torch.cat([ids[:, :CHUNK], second[:, CHUNK:]], dim=1)
    a, b = prefill("snapkv", ids, mask, 4), prefill("snapkv", other, mask, 4)
    assert_same(entries_below(a, 0, CHUNK), entries_below(b, 0, CHUNK))
    assert not torch.equal(entries_below(a, 0, 2 * CHUNK)[0][0]["keys"], entries_below(b, 0, 2 * CHUNK)[0][0]["keys"])


@pytest.mark.parametrize("method", ["snapkv", "keepkv"])
def test_the_compressed_prompt_stays_while_generated_entries_keep_their_budget(method):
    """Unequal rows (left padding): decoding past the budget of generated entries never changes a
    prompt entry, and each row and head holds its compressed prompt plus at most its budget (and
    the interval's appends)."""
    ids, mask = random_batch(batch=2, length=3 * CHUNK + 5, pad=(0, 9), seed=1)
    cache = prefill(method, ids, mask, 4, budget=32)
    prompt = [entries_below(cache, row, int(mask[row].sum())) for row in range(2)]
    cache = prefill(method, ids, mask, 4, budget=32, decode=40)
    for row in range(2):
        assert_same(entries_below(cache, row, int(mask[row].sum())), prompt[row])
    held = [len(prompt[row][0][0]["positions"]) for row in range(2)]
    for layer in cache.layers:
        live = layer.live().sum(-1)  # [B, H_kv]
        for row in range(2):
            assert (live[row] <= held[row] + 32 + layer.interval - 1).all()
            assert (live[row] > held[row]).all()


def test_chunk_keep_is_refused_in_one_line_before_anything_changes():
    _, mask = random_batch(batch=1, length=2 * CHUNK, pad=(0,))
    compressing = keepkv.CompressedCache(MODEL.config, "snapkv", 0.5)
    with pytest.raises(ValueError, match="decoding='keep_prompt'"):
        compressing.start_prefill(mask, chunk_keep=(CHUNK, 4))
    assert compressing.prompt_mask is None
    cache = keepkv.CompressedCache(MODEL.config, "snapkv", 40, decoding="keep_prompt")
    for bad in [(CHUNK, 0), (CHUNK, CHUNK), (4,), [CHUNK, 4], (CHUNK, 2.0), (True, 1)]:
        with pytest.raises(ValueError, match="chunk_keep must be"):
            cache.start_prefill(mask, chunk_keep=bad)
    cache.start_prefill(mask, chunk_keep=(CHUNK, 4))
    ids, _ = random_batch(batch=1, length=2 * CHUNK, pad=(0,))
    keepkv.enable(MODEL)
    with torch.no_grad(), pytest.raises(ValueError, match="blocks of 16"):
        MODEL(input_ids=ids[:, :10], attention_mask=mask[:, :10], past_key_values=cache)
    assert cache.get_seq_length() == 0  # refused before the block changed anything
    with torch.no_grad():  # the right blocks then go through
        for start in (0, CHUNK):
            MODEL(input_ids=ids[:, start : start + CHUNK], attention_mask=mask[:, : start + CHUNK], past_key_values=cache)
    assert cache.layers[0].live().sum(-1).tolist() == [[8] * cache.layers[0].bias.shape[1]]
