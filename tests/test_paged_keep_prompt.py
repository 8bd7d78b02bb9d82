"""The paged adapter with keep_prompt: requests whose prompts share leading blocks (an engine's
prefix caching) decode as their own CompressedCache(decoding="keep_prompt"), never write a
prompt's slots after the prompt's own step, and hold at most prompt + budget + interval slots."""

import functools
import math

import pytest
import torch

from keepkv import CompressedCache
from keepkv.paged import PagedCompression
from keepkv.paged_prompt import PagedPrompts

from helpers import slot_positions
from test_paged import BLOCK, CONFIG, HEAD_DIM, Engine, alone, tokens

pytestmark = pytest.mark.filterwarnings("ignore::keepkv.KeepKVWarning")
# Served methods with observation windows that a budget of 8 generated entries holds.
METHODS = ["snapkv+window=4", "keepkv+selection.window=4", "h2o+interval=3", "window", "streamingllm",
           "pyramidkv+window=4", "keydiff", "keepkv+selection.window=4+interval=3"]


class SharingEngine(Engine):
    """A block pool whose requests may start on another request's full prompt blocks (a prefix
    cache hit): they then skip those tokens, as vLLM does. Unused slots hold garbage. Each step
    hands the adapter every request's prompt length, as vLLM's runner does; ``self.batch`` is the
    last step's."""

    def __init__(self, paged: PagedCompression, blocks: int = 96, seed: int = 0):
        super().__init__(paged, blocks, seed)
        self.prompt: dict[int, int] = {}
        self.prefill_end: dict[int, int] = {}

    def admit(self, request: int, prompt: int, shared_from: int | None = None, shared_blocks: int = 0,
              replayed: int = 0) -> int:
        """A new request of ``prompt`` tokens; its first ``shared_blocks`` blocks are those of request
        ``shared_from``; ``replayed``: the tokens a request resumed after a preemption recomputes
        before it decodes (vLLM's scheduler then caps its blocks at its prefill end's capacity).
        Returns the tokens already computed (the shared prefix)."""
        self.tables[request] = list(self.tables[shared_from][:shared_blocks]) if shared_blocks else []
        self.computed[request] = shared_blocks * BLOCK
        self.prompt[request] = prompt
        self.prefill_end[request] = max(prompt, replayed)
        return self.computed[request]

    def preempt(self, request: int) -> None:
        """Free a request's blocks (filled with garbage), as vLLM's scheduler does when it preempts it."""
        blocks = self.tables.pop(request)
        self.kv_cache[blocks] = torch.randn_like(self.kv_cache[blocks])
        self.free.extend(blocks)

    def step(self, new: dict, layer: int = 0) -> dict:
        for request in new:
            capacity = self.paged.capacity(self.prefill_end[request])
            held = min(self.computed[request] + new[request][0].shape[0], capacity)
            while len(self.tables[request]) < math.ceil(held / BLOCK):
                self.tables[request].append(self.free.pop())
        self.paged.batch = functools.partial(PagedCompression.batch, self.paged, prompts=[self.prompt[r] for r in new])
        try:
            outputs, self.batch = self.forward(new, layer)
        finally:
            del self.paged.batch
        for request, length in zip(new, self.batch.query_lengths):
            self.computed[request] += length
        return outputs


def _feed(cache, chunk):
    query, key, value = chunk
    return alone(cache, query, key, value)


@pytest.mark.parametrize("method", METHODS)
def test_requests_sharing_a_prefix_decode_as_alone_and_never_write_it(method):
    """Request 0 reads a 13-token prompt; request 1 starts on its first 3 blocks (12 tokens) and reads
    5 more; request 2 reads its own 6. Each decodes 30 tokens, past its budget of 8 generated
    entries: every output equals its own CompressedCache(decoding="keep_prompt") fed its whole
    prompt, the shared blocks keep the bytes request 0's prompt step wrote, and no request holds
    more blocks than its capacity."""
    generator = torch.Generator().manual_seed(3)
    paged = PagedCompression(CONFIG, method, 8, keep_prompt=True)
    engine = SharingEngine(paged)
    references = {r: CompressedCache(CONFIG, method, 8, decoding="keep_prompt") for r in range(3)}
    prompt0 = tokens(generator, 13)
    for request, prompt in ((0, 13), (2, 6)):
        engine.admit(request, prompt)
    own1 = tokens(generator, 5)
    prompts = {0: prompt0, 2: tokens(generator, 6)}
    outputs = engine.step(prompts)
    for request in (0, 2):
        torch.testing.assert_close(outputs[request], _feed(references[request], prompts[request]), rtol=1e-5, atol=1e-5)
    shared = engine.tables[0][:3]
    written = engine.kv_cache[shared].clone()
    engine.admit(1, 17, shared_from=0, shared_blocks=3)
    references[1].start_prefill(torch.ones(1, 17, dtype=torch.bool))  # a prompt fed in two blocks
    _feed(references[1], tuple(t[:12] for t in prompt0))  # the prefix, as request 0 wrote it
    for step in range(31):
        new = {r: tokens(generator, 1) for r in (0, 2)}
        new[1] = own1 if step == 0 else tokens(generator, 1)
        outputs = engine.step(new)
        for request, chunk in new.items():
            torch.testing.assert_close(outputs[request], _feed(references[request], chunk), rtol=1e-5, atol=1e-5,
                                       msg=lambda m, s=step, r=request: f"step {s} request {r}: {m}")
        assert torch.equal(engine.kv_cache[shared], written), "a shared prompt block was written"
    for request in range(3):
        prompt = engine.prompt[request]
        live = references[request].layers[0].live_counts()
        assert int(live.max()) == paged.stored(prompt, engine.computed[request]) <= prompt + 8 + paged.method.interval
        assert len(engine.tables[request]) <= math.ceil(paged.capacity(prompt) / BLOCK)


@pytest.mark.parametrize("method", METHODS)
def test_prompts_ending_together_close_as_one_store_and_decode_as_alone(method, monkeypatch):
    """Requests 0 and 1 read 11-token prompts in one step, request 2 a 7-token one: at their first
    decode step the two of one length close as one store, request 2 alone, and each of the three
    decodes 30 tokens as its own CompressedCache(decoding="keep_prompt")."""
    generator = torch.Generator().manual_seed(6)
    paged = PagedCompression(CONFIG, method, 8, keep_prompt=True)
    closed = []
    close = PagedPrompts.close
    monkeypatch.setattr(PagedPrompts, "close",
                        lambda self, slots, plan, rows, *args, **kwargs: (closed.append(list(rows)),
                                                                          close(self, slots, plan, rows, *args, **kwargs)))
    engine = SharingEngine(paged)
    references = {r: CompressedCache(CONFIG, method, 8, decoding="keep_prompt") for r in range(3)}
    prompts = {0: tokens(generator, 11), 1: tokens(generator, 11), 2: tokens(generator, 7)}
    for request, chunk in prompts.items():
        engine.admit(request, chunk[0].shape[0])
        references[request].start_prefill(torch.ones(1, chunk[0].shape[0], dtype=torch.bool))
    for request, chunk in zip(prompts, engine.step(prompts).values()):
        torch.testing.assert_close(chunk, _feed(references[request], prompts[request]), rtol=1e-5, atol=1e-5)
    for step in range(30):
        new = {r: tokens(generator, 1) for r in prompts}
        outputs = engine.step(new)
        for request, chunk in new.items():
            torch.testing.assert_close(outputs[request], _feed(references[request], chunk), rtol=1e-5, atol=1e-5,
                                       msg=lambda m, s=step, r=request: f"step {s} request {r}: {m}")
    assert sorted(closed) == [[0, 1], [2]], closed


def test_a_prompt_read_in_chunks_then_shared():
    """A prompt read in three chunks closes at its first decode step; a later request on its blocks
    decodes as alone."""
    generator = torch.Generator().manual_seed(4)
    paged = PagedCompression(CONFIG, "snapkv+window=4", 8, keep_prompt=True)
    engine = SharingEngine(paged)
    reference = CompressedCache(CONFIG, "snapkv+window=4", 8, decoding="keep_prompt")
    reference.start_prefill(torch.ones(1, 14, dtype=torch.bool))
    engine.admit(0, 14)
    chunks = [tokens(generator, n) for n in (5, 5, 4)]
    for chunk in chunks:
        out = engine.step({0: chunk})[0]
        torch.testing.assert_close(out, _feed(reference, chunk), rtol=1e-5, atol=1e-5)
    for _ in range(12):
        chunk = tokens(generator, 1)
        torch.testing.assert_close(engine.step({0: chunk})[0], _feed(reference, chunk), rtol=1e-5, atol=1e-5)
    assert paged.stored(14, engine.computed[0]) == int(reference.layers[0].live_counts().max())


@pytest.mark.parametrize("method", METHODS)
def test_a_replay_after_a_preemption_keeps_only_its_prompt_whole(method):
    """A request of a 13-token prompt decodes 17 tokens and is preempted; resumed, it recomputes
    its 30 tokens in chunks of 8 (one spans the prompt's end, as vLLM's chunked prefill may cut a
    replay), then decodes 30 more. Every step from its close on, the adapter keeps exactly the
    13 prompt tokens the engine hands it as prompt, never the 30 replayed: the prompt's slots
    hold positions 0-12 as the replay wrote them, and the replayed generated entries are
    compressed with the later ones, so that the request ends within a 13-token prompt's capacity."""
    generator = torch.Generator().manual_seed(5)
    paged = PagedCompression(CONFIG, method, 8, keep_prompt=True)
    engine = SharingEngine(paged)
    engine.admit(0, 13)
    fed = [tokens(generator, 13)] + [tokens(generator, 1) for _ in range(17)]
    for chunk in fed:
        engine.step({0: chunk})
    engine.preempt(0)
    engine.admit(0, 13, replayed=30)
    replay = [torch.cat(parts) for parts in zip(*fed)]  # query, key, value [30, ...]
    for start in range(0, 30, 8):
        engine.step({0: tuple(t[start : start + 8] for t in replay)})
        assert engine.batch.phases == ["chunk"]
    prompt_blocks = torch.tensor(engine.tables[0][: 13 // BLOCK])
    written = engine.kv_cache[prompt_blocks].clone()
    for step in range(30):
        engine.step({0: tokens(generator, 1)})
        batch = engine.batch
        assert (batch.phases, batch.prompt, batch.closed) == (["close" if step == 0 else "decode"], [13], [30])
        held = paged.stored(13, engine.computed[0], closed=30)
        positions = slot_positions(paged, engine.kv_cache, torch.tensor(engine.tables[0]), held, HEAD_DIM)
        assert torch.equal(positions[:, :13], torch.arange(13).expand(positions.shape[0], -1)), f"step {step}"
        generated = positions[:, 13:].sort().values
        assert bool((generated[:, 1:] > generated[:, :-1]).all() and (generated >= 13).all()), f"step {step}"
        assert torch.equal(engine.kv_cache[prompt_blocks], written), "a prompt block was written"
    assert 13 < held <= paged.capacity(13) < 30


def test_refusals():
    with pytest.raises(ValueError, match="give an int"):
        PagedCompression(CONFIG, "snapkv", 0.1, keep_prompt=True)
    paged = PagedCompression(CONFIG, "snapkv+window=4", 8, keep_prompt=True)
    with pytest.raises(ValueError, match="block_size and each request's prompt length"):
        paged.batch([0, 3], [3], torch.ones(1, 1, dtype=torch.int32), prompts=[3])
    with pytest.raises(ValueError, match="block_size and each request's prompt length"):
        paged.batch([0, 3], [3], torch.ones(1, 1, dtype=torch.int32), [True], block_size=BLOCK)
    with pytest.raises(ValueError, match="never read"):
        paged.batch([0, 1], [9], torch.ones(1, 3, dtype=torch.int32), block_size=BLOCK, prompts=[8])
