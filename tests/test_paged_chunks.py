"""The paged adapter with prompts compressed chunk by chunk (``chunk_blocks``): a request decodes as
its own CompressedCache(decoding="keep_prompt") fed with ``start_prefill(chunk_keep=(c · block,
block))``, whatever steps the engine cuts its prompt into, and a later request that starts on its
compressed chunks (an engine's prefix cache) decodes the same and never writes them."""

import math

import pytest
import torch

from keepkv import CompressedCache
from keepkv.paged import PagedCompression
from keepkv.paged_chunks import compact, compacted_table

from helpers import slot_positions
from test_paged import BLOCK, CONFIG, HEAD_DIM, LEARNED, Engine, alone, tokens

pytestmark = pytest.mark.filterwarnings("ignore::keepkv.KeepKVWarning")
CHUNK_BLOCKS = 3
CHUNK = CHUNK_BLOCKS * BLOCK  # tokens of a chunk; each keeps BLOCK entries per head
# A chunk keeps 4 entries: a window of 2 leaves 2 to the scores.
METHODS = ["snapkv+window=2", "keydiff", "streamingllm", "window", "snapkv+window=2+interval=3", LEARNED]


class ChunkEngine(Engine):
    """A block pool as vLLM's manager runs it for ``chunk_blocks``: a table by position, whose
    compressed chunks' first c - 1 blocks are freed (filled with garbage) and null (block 0) once
    the step that compressed them ran; a request may start on another's compressed chunks (a
    prefix-cache hit: nulls and each chunk's last block). Each step hands the adapter the prompt
    lengths; ``self.batch`` is the last step's."""

    def __init__(self, paged: PagedCompression, blocks: int = 128, seed: int = 0):
        super().__init__(paged, blocks, seed)
        self.prompt: dict[int, int] = {}

    def admit(self, request: int, prompt: int, shared_from: int | None = None, chunks: int = 0) -> int:
        """A new request of ``prompt`` tokens, its first ``chunks`` compressed chunks those of
        ``shared_from``. Returns the tokens it skips."""
        table = []
        for chunk in range(chunks):
            table += [0] * (CHUNK_BLOCKS - 1) + [self.tables[shared_from][(chunk + 1) * CHUNK_BLOCKS - 1]]
        self.tables[request], self.computed[request], self.prompt[request] = table, chunks * CHUNK, prompt
        return chunks * CHUNK

    def step(self, new: dict, layer: int = 0) -> dict:
        for request in new:
            held = min(self.computed[request] + new[request][0].shape[0], self.paged.capacity(self.prompt[request]))
            while len(self.tables[request]) < math.ceil(held / BLOCK):
                self.tables[request].append(self.free.pop())
        batch = PagedCompression.batch
        self.paged.batch = lambda *args, **kwargs: batch(self.paged, *args, **kwargs, prompts=[self.prompt[r] for r in new])
        try:
            outputs, self.batch = self.forward(new, layer)
        finally:
            del self.paged.batch
        for request, length in zip(new, [new[r][0].shape[0] for r in new]):
            self.computed[request] += length
            table, whole = self.tables[request], min(self.computed[request], self.prompt[request]) // CHUNK
            for chunk in range(whole):
                for index in range(chunk * CHUNK_BLOCKS, (chunk + 1) * CHUNK_BLOCKS - 1):
                    if table[index]:
                        self.kv_cache[table[index]] = torch.randn_like(self.kv_cache[table[index]])
                        self.free.append(table[index])
                        table[index] = 0
        return outputs


def reference(method, prompt_length):
    cache = CompressedCache(CONFIG, method, 8, decoding="keep_prompt")
    cache.start_prefill(torch.ones(1, prompt_length, dtype=torch.bool), chunk_keep=(CHUNK, BLOCK))
    return cache


def fed_in_chunks(cache, prompt):
    """The Hugging Face cache's outputs [P, H, D] of a prompt fed in blocks of CHUNK tokens."""
    return torch.cat([alone(cache, *(t[start : start + CHUNK] for t in prompt))
                      for start in range(0, prompt[0].shape[0], CHUNK)])


def test_compact_cuts_a_step_at_each_chunk_end_and_reads_slots_in_order():
    """A step of tokens 5..30 of a 32-token prompt (chunks of 12 tokens in 3 blocks of 4) is cut at
    12 and 24: three parts, each over the table its slots need, the first two ending a chunk."""
    table = torch.arange(10, 20)[None]  # blocks 10..19 by position
    rows = compact([0, 25], [30], table, [32], BLOCK, CHUNK_BLOCKS)
    assert rows.query_start == [0, 7, 19, 25]
    assert rows.seq_lens == [12, 4 + 12, 8 + 6] and rows.offsets == [0, 8, 16]
    assert rows.chunk_starts == [0, 4, -1] and rows.waves == [0, 1, 2] and rows.prompts == [32 - 16] * 3
    assert rows.block_table[1].tolist()[:4] == [12, 13, 14, 15]  # chunk 0's kept block, then chunk 1's blocks
    assert rows.after_tables[1].tolist()[:3] == [12, 15, 16]
    assert compacted_table(table[0], 2, CHUNK_BLOCKS).tolist()[:4] == [12, 15, 16, 17]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("step_tokens", [5, 11, 12, 40])
@pytest.mark.parametrize("length", [31, 24])
def test_a_prompt_compressed_chunk_by_chunk_decodes_as_the_hf_cache(method, step_tokens, length):
    """A prompt of two chunks of 12 and a tail of 7 (31 tokens) or none (24), read in steps of
    ``step_tokens`` (steps that end inside a chunk, on a chunk's end, and across both), then 30
    decode steps: every output equals the Hugging Face cache's with chunk_keep=(12, 4) fed in
    chunks, the prompt holds 4 + 4 slots and its tail once read (each chunk's from its own
    positions, the tail's in order), and the request never holds more blocks than its capacity's."""
    generator = torch.Generator().manual_seed(7)
    paged = PagedCompression(CONFIG, method, 8, keep_prompt=True, chunk_blocks=CHUNK_BLOCKS)
    engine = ChunkEngine(paged)
    engine.admit(0, length)
    prompt = tokens(generator, length)
    expected = fed_in_chunks(ref := reference(method, length), prompt)
    got = torch.cat([engine.step({0: tuple(t[start : start + step_tokens] for t in prompt)})[0]
                     for start in range(0, length, step_tokens)])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    held_prompt = 8 + length - 24
    for step in range(30):
        new = tokens(generator, 1)
        torch.testing.assert_close(engine.step({0: new})[0], alone(ref, *new), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, s=step: f"decode step {s}: {m}")
        assert engine.batch.prompt == [held_prompt]
    held = paged.stored(held_prompt, engine.computed[0] - 16, closed=held_prompt)
    positions = slot_positions(paged, engine.kv_cache, torch.tensor([b for b in engine.tables[0] if b]), held, HEAD_DIM)
    assert bool((positions[:, :4] < 12).all() and (positions[:, 4:8] >= 12).all() and (positions[:, 4:8] < 24).all())
    assert torch.equal(positions[:, 8:held_prompt], torch.arange(24, length).expand(positions.shape[0], -1))
    assert len(engine.tables[0]) <= math.ceil(paged.capacity(length) / BLOCK)


@pytest.mark.parametrize("method", METHODS)
def test_a_request_on_cached_chunks_decodes_as_one_that_read_them_and_never_writes_them(method):
    """Request 0 reads a 30-token document and a question of 6; request 1 starts on its two compressed
    chunks (24 tokens it never reads) and reads the last 6 document tokens and its own question of
    5; both decode 20 tokens. Request 1's outputs equal those of a fresh engine's request that reads
    its whole prompt, and the blocks it shares keep request 0's bytes."""
    generator = torch.Generator().manual_seed(8)
    document, questions = tokens(generator, 30), [tokens(generator, 6), tokens(generator, 5)]
    decoded = [tokens(generator, 1) for _ in range(20)]
    prompts = [tuple(torch.cat([d, q]) for d, q in zip(document, question)) for question in questions]
    paged = PagedCompression(CONFIG, method, 8, keep_prompt=True, chunk_blocks=CHUNK_BLOCKS)
    engine = ChunkEngine(paged)
    engine.admit(0, 36)
    for start in range(0, 36, 10):
        engine.step({0: tuple(t[start : start + 10] for t in prompts[0])})
    shared = [engine.tables[0][CHUNK_BLOCKS - 1], engine.tables[0][2 * CHUNK_BLOCKS - 1]]
    written = engine.kv_cache[shared].clone()
    skipped = engine.admit(1, 35, shared_from=0, chunks=2)
    got = [engine.step({1: tuple(t[skipped:] for t in prompts[1]), 0: decoded[0]})[1]]
    got += [engine.step({0: token, 1: token})[1] for token in decoded]
    assert torch.equal(engine.kv_cache[shared], written), "a shared chunk's block was written"
    fresh = ChunkEngine(PagedCompression(CONFIG, method, 8, keep_prompt=True, chunk_blocks=CHUNK_BLOCKS), seed=1)
    fresh.admit(0, 35)
    alone_outputs = [torch.cat([fresh.step({0: tuple(t[start : start + 10] for t in prompts[1])})[0]
                                for start in range(0, 35, 10)])[skipped:]]
    alone_outputs += [fresh.step({0: token})[0] for token in decoded]
    for step, (mine, theirs) in enumerate(zip(got, alone_outputs)):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5, msg=lambda m, s=step: f"step {s}: {m}")


def test_documents_sharing_a_first_chunk_share_only_its_entries():
    """Two prompts that share their first 12 tokens (one chunk) and differ after: their first
    chunks' kept entries are equal, bit for bit, and their second chunks' are not."""
    generator = torch.Generator().manual_seed(9)
    common, tails = tokens(generator, 12), [tokens(generator, 14), tokens(generator, 14)]
    paged = PagedCompression(CONFIG, "snapkv+window=2", 8, keep_prompt=True, chunk_blocks=CHUNK_BLOCKS)
    engine = ChunkEngine(paged)
    for request, tail in enumerate(tails):
        engine.admit(request, 26)
        prompt = tuple(torch.cat([c, t]) for c, t in zip(common, tail))
        engine.step({request: tuple(t[:9] for t in prompt)})
        engine.step({request: tuple(t[9:] for t in prompt)})
    kept = [[engine.kv_cache[engine.tables[r][k * CHUNK_BLOCKS - 1]] for k in (1, 2)] for r in (0, 1)]
    assert torch.equal(kept[0][0], kept[1][0])
    assert not torch.equal(kept[0][1], kept[1][1])


def test_refusals():
    with pytest.raises(ValueError, match="keep_prompt=True"):
        PagedCompression(CONFIG, "snapkv", 0.1, chunk_blocks=2)
    for bad in (1, -1, True, 2.0):
        with pytest.raises(ValueError, match="chunk_blocks is 0"):
            PagedCompression(CONFIG, "snapkv+window=4", 8, keep_prompt=True, chunk_blocks=bad)
    for method, reason in (("keepkv", "votes"), ("pyramidkv", "budgets of their own"),
                           ("h2o", "every query row")):
        with pytest.raises(ValueError, match=reason):
            PagedCompression(CONFIG, method, 64, keep_prompt=True, chunk_blocks=2)
