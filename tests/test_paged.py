"""The paged adapter (keepkv.paged): requests in a serving engine's blocks decode as alone in a
CompressedCache, hold what PagedCompression.stored says, and never write past capacity_bound."""

import functools
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig

import keepkv.paged as paged_module
import keepkv.paged_requests
from keepkv.paged_plan import StepPlan
from keepkv import CompressedCache
from keepkv.budgets import budget_floor, row_budgets
from keepkv.methods import SELECTIONS, get_method
from keepkv.paged import SERVED_METHODS, PagedBatch, PagedCompression, rank_config
from keepkv.paged_layout import TorchPagedKernel
from keepkv.step import LayerStep

from helpers import assert_equal_up_to_rounding, request_state, slot_positions, with_scorer

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 8, 4
CONFIG = LlamaConfig(
    hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, num_hidden_layers=3,
    intermediate_size=16, vocab_size=32,
)
SCALING = HEAD_DIM**-0.5
pytestmark = pytest.mark.filterwarnings("ignore::keepkv.KeepKVWarning")  # tiny budgets on purpose


class Engine:
    """A minimal engine: a block pool, each request's block table capped at its capacity, the
    paged cache filled with garbage so that a read of a stale slot shows."""

    def __init__(self, paged: PagedCompression, blocks: int = 64, seed: int = 0, dtype=torch.float32, device="cpu"):
        self.paged = paged
        generator = torch.Generator().manual_seed(seed)
        size = torch.finfo(dtype).bits // 8
        cell = paged.content_bytes(HEAD_DIM, dtype, BLOCK) // size  # a slot's key, value and fp32 words
        kv_heads = paged.config.num_key_value_heads  # the model's, or one tensor-parallel rank's
        self.kv_cache = torch.randn(blocks, kv_heads, BLOCK, cell, generator=generator).to(device, dtype)
        self.free = torch.randperm(blocks - 1, generator=generator).add(1).tolist()  # block 0: the null block
        self.tables: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}

    def step(self, new: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], layer: int = 0,
             prompts: dict[int, int] | None = None) -> dict[int, torch.Tensor]:
        """Feed request -> (query [q, H, D], key, value [q, H_kv, D]) to the model's layer ``layer``;
        returns request -> output [q, H, D]. ``prompts``: each new request's prompt length, as
        vLLM's scheduler knows it (a chunked engine's prompt may come in several steps; its
        blocks then hold the whole prompt until its first decode step has compressed it, and the
        surplus is freed, overwritten with garbage, after that step)."""
        requests = list(new)
        for request in requests:
            length = new[request][0].shape[0]
            if request not in self.tables:
                self.tables[request], self.computed[request] = [], 0
                self.prompt = getattr(self, "prompt", {}) | {request: (prompts or {}).get(request, length)}
            done, prompt = self.computed[request], self.prompt[request]
            tokens, capacity = done + length, self.paged.capacity(prompt)
            reading = self.paged.reading(prompt, done) + length  # a prompt compressed chunk by chunk holds its budget
            needed = math.ceil((reading if self.paged.chunked and tokens <= prompt else min(tokens, capacity)) / BLOCK)
            while len(self.tables[request]) < needed:
                self.tables[request].append(self.free.pop())
        outputs, batch = self.forward(new, layer)
        for request, length in zip(requests, batch.query_lengths):
            self.computed[request] += length
            done, prompt = self.computed[request], self.prompt[request]
            keep = math.ceil((self.paged.capacity(prompt) if done > prompt else self.paged.reading(prompt, done)) / BLOCK)
            if self.paged.chunked and done != prompt and len(self.tables[request]) > keep:
                surplus = self.tables[request][keep:]
                del self.tables[request][keep:]
                self.kv_cache[surplus] = torch.randn_like(self.kv_cache[surplus])  # a later read of them shows
                self.free.extend(surplus)
        return outputs

    def forward(self, new: dict, layer: int = 0) -> tuple[dict, PagedBatch]:
        """One step of the requests of ``new`` over their block tables as they stand: (request ->
        output [q, H, D], the step's batch)."""
        requests = list(new)
        width = max(len(self.tables[r]) for r in requests)
        table = torch.tensor([self.tables[r] + [0] * (width - len(self.tables[r])) for r in requests], dtype=torch.int32)
        starts = [0]
        for request in requests:
            starts.append(starts[-1] + new[request][0].shape[0])
        seq_lens = [self.computed[r] + new[r][0].shape[0] for r in requests]
        prefilling = [self.computed[r] < self.prompt[r] for r in requests]
        keep_prompt = {"block_size": BLOCK} if self.paged.keep_prompt else {}  # requests may share blocks
        batch = self.paged.batch(starts, seq_lens, table, prefilling if self.paged.chunked else None, **keep_prompt,
                                 ends=[self.prompt[r] for r in requests])  # vLLM's prefill ends
        query, key, value = (torch.cat([new[r][i] for r in requests]) for i in range(3))
        output = self.paged.forward(self.kv_cache, query, key, value, batch, SCALING, layer)
        return {r: output[starts[i] : starts[i + 1]] for i, r in enumerate(requests)}, batch


def tokens(generator, length):
    return (
        torch.randn(length, HEADS, HEAD_DIM, generator=generator),
        torch.randn(length, KV_HEADS, HEAD_DIM, generator=generator),
        torch.randn(length, KV_HEADS, HEAD_DIM, generator=generator),
    )


def alone(cache: CompressedCache, query, key, value, layer_idx: int = 0) -> torch.Tensor:
    """One attention call of one request's layer ``layer_idx`` in its own CompressedCache: output [q, H, D]."""
    q = query.shape[0]
    layer = cache.layers[layer_idx]
    if not layer.is_initialized:
        layer.lazy_initialization(key.transpose(0, 1)[None], value.transpose(0, 1)[None])
    mask = torch.ones(1, 1, q, q, dtype=torch.bool).tril()
    out = cache.forward_layer(
        layer_idx, query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None], mask, SCALING
    )
    return out[0]


PAPER_KEEPKV = "keepkv+selection=ema+prefill_order=merge_first+protect=0+max_value_change=None+min_mass=0"  # docs/keepkv.md


LEARNED = with_scorer("snapkv+selection=learned+budgets=uniform+sinks=1+selection.window=2", CONFIG)  # a scorer fitted to CONFIG


@pytest.mark.parametrize("method", [*SERVED_METHODS, "h2o+interval=3", "streamingllm+sinks=2", PAPER_KEEPKV, "keepkv+interval=3",
                                    LEARNED, LEARNED.replace("snapkv+", "keepkv+"), f"{LEARNED}+prompt_window=2"])
@pytest.mark.parametrize("budget", [0.5, 3, 1, 1.0, 10_000])
def test_paged_requests_decode_as_alone(method, budget):
    """Requests of unequal prompts, one joining mid-way (a step mixing a prefill with decodes), give
    the outputs of their own CompressedCache, step by step."""
    generator = torch.Generator().manual_seed(1)
    paged = PagedCompression(CONFIG, method, budget)
    engine = Engine(paged)
    prompts = {0: 7, 1: 13, 2: 3}
    references = {r: CompressedCache(CONFIG, method, budget) for r in (0, 1, 2, 3)}
    null_block = engine.kv_cache[0].clone()
    for step in range(8):
        new = {r: tokens(generator, prompts[r] if step == 0 else 1) for r in prompts}
        if step == 3:
            new[3] = tokens(generator, 9)
        outputs = engine.step(new)
        for request, (query, key, value) in new.items():
            expected = alone(references[request], query, key, value)
            torch.testing.assert_close(outputs[request], expected, rtol=1e-5, atol=1e-5)
            layer = references[request].layers[0]
            assert int(layer.live_counts().max()) == paged.stored(engine.prompt[request], engine.computed[request])
    assert torch.equal(engine.kv_cache[0], null_block)  # nothing written past a request's blocks



class TiledKernel(TorchPagedKernel):
    """The reference kernel with keys packed two slots side by side (as AMX tiles pack them): a
    packing keepkv's paged kernel does not read."""

    @functools.lru_cache(maxsize=8)
    def orders(self, block_size: int, head_dim: int, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
        slot, dim = torch.arange(block_size)[:, None], torch.arange(head_dim)[None, :]
        return (slot // 2) * (2 * head_dim) + 2 * dim + slot % 2, slot * head_dim + dim


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("method", ["snapkv+window=2", "streamingllm", "h2o+interval=3"])
def test_an_eviction_methods_compressed_requests_go_to_keepkvs_kernel_where_it_reads_the_packing(method, tiled,
                                                                                                  monkeypatch):
    """With keepkv's kernel in OUR_DECODE_BACKENDS, an eviction method's compressed requests are
    attended by it, its requests under their budget by the engine's kernel; on an engine whose
    packing keepkv's kernel does not read, every request by the engine's. Outputs are those of
    each request's own CompressedCache either way."""
    monkeypatch.setattr(paged_module, "OUR_DECODE_BACKENDS", (paged_module._decode_backend(torch.device("cpu")),))
    decode, attended = paged_module.paged_decode, []
    monkeypatch.setattr(paged_module, "paged_decode", lambda *a, **k: attended.append(a[3].tolist()) or decode(*a, **k))
    generator = torch.Generator().manual_seed(2)
    paged = PagedCompression(CONFIG, method, 6, kernel=TiledKernel() if tiled else None)
    engine = Engine(paged)
    prompts = {0: 11, 1: 4}  # request 0 over its budget of 6, request 1 under it for its first steps
    references = {r: CompressedCache(CONFIG, method, 6) for r in prompts}
    for step in range(6):
        new = {r: tokens(generator, prompts[r] if step == 0 else 1) for r in prompts}
        outputs = engine.step(new)
        for request, (query, key, value) in new.items():
            torch.testing.assert_close(outputs[request], alone(references[request], query, key, value), rtol=1e-5,
                                       atol=1e-5)
    if tiled:
        assert attended == []
    else:  # request 0 alone at first; both once request 1 outgrew its budget
        assert attended and all(len(lengths) in (1, 2) for lengths in attended) and [len(a) for a in attended][-1] == 2


@pytest.mark.parametrize("method", [*SERVED_METHODS, PAPER_KEEPKV, "keepkv+interval=3", LEARNED])
@pytest.mark.parametrize("budget", [0.5, 3])
def test_tensor_parallel_ranks_compress_their_own_heads_as_the_whole_model(method, budget):
    """Two tensor-parallel ranks, each holding one KV head and its query group (``rank_config``),
    fed their heads' slices of the same requests (unequal prompts, one joining mid-way), with no
    communication: every step each rank's output and the positions each of its slots holds are the
    whole model's for those heads, in the model's last layer (PyramidKV's smallest budget; the
    learned selection scores each rank's head with the scorer's weights of that head). The
    outputs agree up to fp32 rounding (a head slice may take another matmul kernel than all the
    heads), the kept positions exactly: the random inputs leave no score within rounding of a tie."""
    generator = torch.Generator().manual_seed(3)
    layer = CONFIG.num_hidden_layers - 1
    whole = Engine(PagedCompression(CONFIG, method, budget))
    ranks = [Engine(PagedCompression(rank_config(CONFIG, HEADS // KV_HEADS, 1, rank=rank), method, budget))
             for rank in range(KV_HEADS)]
    group = HEADS // KV_HEADS
    prompts = {0: 9, 1: 14}
    for step in range(10):
        new = {r: tokens(generator, prompts[r] if step == 0 else 1) for r in prompts}
        if step == 4:
            new[2] = tokens(generator, 11)
        outputs = whole.step(new, layer)
        for rank, engine in enumerate(ranks):
            mine = {r: (q[:, rank * group : (rank + 1) * group], k[:, rank : rank + 1], v[:, rank : rank + 1])
                    for r, (q, k, v) in new.items()}
            got = engine.step(mine, layer)
            for request in new:
                assert_equal_up_to_rounding(got[request], outputs[request][:, rank * group : (rank + 1) * group],
                                            msg=f"step {step} rank {rank} request {request}")
                held = whole.paged.stored(whole.prompt[request], whole.computed[request], layer)
                expected = slot_positions(whole.paged, whole.kv_cache, torch.tensor(whole.tables[request]), held, HEAD_DIM)
                positions = slot_positions(engine.paged, engine.kv_cache, torch.tensor(engine.tables[request]), held,
                                           HEAD_DIM)
                assert torch.equal(positions, expected[rank : rank + 1])


class LayeredEngine(Engine):
    """An engine whose every step runs all the model's layers over one batch, as vLLM's does, each
    layer with its own KV cache; a request's tokens are (query [q, L, H, D], key, value [q, L, H_kv, D]).
    ``layers``: what the batch says of them (:attr:`PagedBatch.layers`; None: each layer alone)."""

    def __init__(self, paged: PagedCompression, layers: int | None):
        super().__init__(paged)
        self.caches = [self.kv_cache.clone() for _ in range(CONFIG.num_hidden_layers)]
        self.layers = layers

    def forward(self, new: dict, layer: int = 0) -> tuple[dict, PagedBatch]:
        requests = list(new)
        width = max(len(self.tables[r]) for r in requests)
        table = torch.tensor([self.tables[r] + [0] * (width - len(self.tables[r])) for r in requests], dtype=torch.int32)
        starts = [0]
        for request in requests:
            starts.append(starts[-1] + new[request][0].shape[0])
        seq_lens = [self.computed[r] + new[r][0].shape[0] for r in requests]
        prefilling = [self.computed[r] < self.prompt[r] for r in requests]
        batch = self.paged.batch(starts, seq_lens, table, prefilling if self.paged.chunked else None,
                                 layers=self.layers)
        outputs = {r: [] for r in requests}
        for layer, kv_cache in enumerate(self.caches):
            query, key, value = (torch.cat([new[r][i][:, layer] for r in requests]) for i in range(3))
            output = self.paged.forward(kv_cache, query, key, value, batch, SCALING, layer)
            for i, r in enumerate(requests):
                outputs[r].append(output[starts[i] : starts[i + 1]])
        return {r: torch.stack(out, 1) for r, out in outputs.items()}, batch


class GroupedEngine(LayeredEngine):
    """A LayeredEngine whose layers are in ``groups``, each group served by a PagedCompression of its
    own (``make()``), as an engine's layer groups with blocks of their own are; the groups' batches
    share one list of due compressions (:attr:`PagedBatch.due`), which the model's last layer runs."""

    def __init__(self, make, groups: tuple[tuple[int, ...], ...]):
        super().__init__(make(), CONFIG.num_hidden_layers)
        self.group_of = {layer: index for index, group in enumerate(groups) for layer in group}
        self.compressions = [make() for _ in groups]
        self.due: list = []

    def forward(self, new: dict, layer: int = 0) -> tuple[dict, PagedBatch]:
        requests = list(new)
        width = max(len(self.tables[r]) for r in requests)
        table = torch.tensor([self.tables[r] + [0] * (width - len(self.tables[r])) for r in requests], dtype=torch.int32)
        starts = [0]
        for request in requests:
            starts.append(starts[-1] + new[request][0].shape[0])
        seq_lens = [self.computed[r] + new[r][0].shape[0] for r in requests]
        self.due = []
        batches = [paged.batch(starts, seq_lens, table, layers=self.layers, due=self.due) for paged in self.compressions]
        outputs = {r: [] for r in requests}
        for layer, kv_cache in enumerate(self.caches):
            group = self.group_of[layer]
            query, key, value = (torch.cat([new[r][i][:, layer] for r in requests]) for i in range(3))
            output = self.compressions[group].forward(kv_cache, query, key, value, batches[group], SCALING, layer)
            for i, r in enumerate(requests):
                outputs[r].append(output[starts[i] : starts[i + 1]])
        return {r: torch.stack(out, 1) for r, out in outputs.items()}, batches[0]


@pytest.mark.parametrize("method", ["snapkv", "keepkv", "pyramidkv+window=2+kernel=1+interval=8",
                                    LEARNED.replace("+budgets=uniform", "+interval=8"), LEARNED])
@pytest.mark.parametrize("budget", [0.5, 3])
def test_layer_groups_compress_as_one_batch(method, budget, monkeypatch):
    """Layer groups, each a PagedCompression of its own whose batch shares the step's list of due
    compressions, run every group's due rows at the model's last layer, stacked across groups where
    rows and sizes agree (no more method calls than the groups alone, fewer for a uniform budget),
    and every layer's outputs and kept positions are those of each layer compressed alone."""
    layers = CONFIG.num_hidden_layers
    calls = {}
    decode = LayerStep.decode

    def counted(self, layer, stats):
        calls[key] = calls.get(key, 0) + 1
        return decode(self, layer, stats)

    monkeypatch.setattr(LayerStep, "decode", counted)
    groups = ((0, layers - 1), tuple(range(1, layers - 1)))  # the last layer's group holds the first too
    engines = {"alone": LayeredEngine(PagedCompression(CONFIG, method, budget), None),
               "groups": GroupedEngine(lambda: PagedCompression(CONFIG, method, budget), groups)}
    generator = torch.Generator().manual_seed(11)
    prompts = {0: 70, 1: 90}
    for step in range(36):
        new = {r: tuple(torch.randn(prompts[r] if step == 0 else 1, layers, heads, HEAD_DIM, generator=generator)
                        for heads in (HEADS, KV_HEADS, KV_HEADS)) for r in prompts}
        if step == 4:
            new[2] = tuple(torch.randn(60, layers, heads, HEAD_DIM, generator=generator)
                           for heads in (HEADS, KV_HEADS, KV_HEADS))
        outputs = {}
        for key, engine in engines.items():
            outputs[key] = engine.step(new)
        alone, grouped = engines["alone"], engines["groups"]
        assert grouped.due == []  # the last layer ran every group's
        for request in new:
            assert_equal_up_to_rounding(outputs["groups"][request], outputs["alone"][request], msg=f"step {step}")
            for layer in range(layers):
                held = alone.paged.stored(alone.prompt[request], alone.computed[request], layer)
                table = torch.tensor(alone.tables[request])
                assert torch.equal(slot_positions(grouped.paged, grouped.caches[layer], table, held, HEAD_DIM),
                                   slot_positions(alone.paged, alone.caches[layer], table, held, HEAD_DIM))
    assert 0 < calls["groups"] <= calls["alone"]
    if not alone.paged.method.selection.layered:
        assert calls["groups"] * layers == calls["alone"]


@pytest.mark.parametrize("method", [*SERVED_METHODS, PAPER_KEEPKV, "keepkv+interval=3", "h2o+interval=3", LEARNED,
                                    "pyramidkv+window=2+kernel=1+interval=8",
                                    LEARNED.replace("+budgets=uniform", "+interval=8")])
@pytest.mark.parametrize("budget", [0.5, 3])
def test_a_steps_layers_compress_as_one_batch(method, budget, monkeypatch):
    """A step whose batch says every layer runs it (``layers``) compresses its layers' due rows at
    the last layer, in one store per group of rows (one call of the method where each layer would
    make one, unless the method reads its store's layer as one, or its layers hold unequal entries,
    as PyramidKV's and the learned selection's trained split's may; the learned scorer reads each
    row's layer), and
    every layer's outputs and kept positions are those of each layer compressed alone, step after
    step, for requests of unequal prompts, one joining mid-way."""
    layers = CONFIG.num_hidden_layers
    calls = {}
    decode = LayerStep.decode

    def counted(self, layer, stats):
        calls[key] = calls.get(key, 0) + 1
        return decode(self, layer, stats)

    monkeypatch.setattr(LayerStep, "decode", counted)
    engines = {mode: LayeredEngine(PagedCompression(CONFIG, method, budget), mode) for mode in (None, layers)}
    generator = torch.Generator().manual_seed(7)
    prompts = {0: 70, 1: 90}  # budget 0.5: over the methods' floors
    for step in range(36):  # two compressions of the default interval (16)
        new = {r: tuple(torch.randn(prompts[r] if step == 0 else 1, layers, heads, HEAD_DIM, generator=generator)
                        for heads in (HEADS, KV_HEADS, KV_HEADS)) for r in prompts}
        if step == 4:
            new[2] = tuple(torch.randn(60, layers, heads, HEAD_DIM, generator=generator)
                           for heads in (HEADS, KV_HEADS, KV_HEADS))
        outputs = {}
        for key, engine in engines.items():
            outputs[key] = engine.step(new)
        alone, batched = engines[None], engines[layers]
        for request in new:
            assert_equal_up_to_rounding(outputs[layers][request], outputs[None][request], msg=f"step {step}")
            for layer in range(layers):
                held = alone.paged.stored(alone.prompt[request], alone.computed[request], layer)
                table = torch.tensor(alone.tables[request])
                assert torch.equal(slot_positions(batched.paged, batched.caches[layer], table, held, HEAD_DIM),
                                   slot_positions(alone.paged, alone.caches[layer], table, held, HEAD_DIM))
    assert calls[None] > 0
    method = alone.paged.method
    if method.per_layer:
        assert calls[layers] == calls[None]
    elif method.selection.layered:  # layers of unequal budgets hold unequal entries: stacked where equal
        assert calls[None] / layers <= calls[layers] <= calls[None]
    else:
        assert calls[layers] * layers == calls[None]


def test_a_batch_refuses_a_due_list_that_is_not_a_list():
    """``due`` (the step's list of compressions an engine's layer groups share) is checked where the
    batch is built, in one line, before the step is counted."""
    paged = PagedCompression(CONFIG, "snapkv", 3)
    with pytest.raises(ValueError, match="due must be a list .* got tuple") as raised:
        paged.batch([0, 4], [4], torch.tensor([[1]], dtype=torch.int32), due=())
    assert "\n" not in str(raised.value) and paged.requests.steps == 0


@pytest.mark.parametrize("layers", [0, -1, 1.5, "3", True])
def test_a_batch_refuses_a_layer_count_that_is_not_a_positive_int(layers):
    """``layers`` is checked where the batch is built, in one line, before any step is planned."""
    paged = PagedCompression(CONFIG, "snapkv", 3)
    before = paged.requests.steps
    with pytest.raises(ValueError, match="layers must be an int >= 1 \\(or None\\)") as raised:
        paged.batch([0, 4], [4], torch.tensor([[1]], dtype=torch.int32), layers=layers)
    assert "\n" not in str(raised.value) and paged.requests.steps == before


def test_a_batch_refuses_a_prompt_end_before_the_tokens_read():
    """``ends`` (where each prompt read in chunks ends) before the tokens a reading row has read is
    refused in one line, before any request's phase is filed; a decoding row's is not read."""
    paged = PagedCompression(CONFIG, LEARNED, 0.3, chunked=True)
    table = torch.tensor([[1], [2]], dtype=torch.int32)
    with pytest.raises(ValueError, match="must end at or after the tokens read so far") as raised:
        paged.batch([0, 4, 8], [4, 4], table, [True, True], ends=[10, 3])
    assert "\n" not in str(raised.value) and paged.requests.steps == 0 and not paged.requests._prompts
    batch = paged.batch([0, 4, 8], [4, 4], table, [True, True], ends=[10, 4])
    assert batch.ends == [10, 4] and batch.phases == ["chunk", "chunk"]


def test_a_rank_holds_whole_query_groups():
    """A rank's query heads are whole groups of its KV heads: a KV head replicated over ranks (each
    holding part of its group) is refused in one line."""
    assert vars(rank_config(CONFIG, 2, 1, rank=1)) == {"num_hidden_layers": 3, "num_attention_heads": 2,
                                                       "num_key_value_heads": 1, "first_kv_head": 1}
    for heads, kv_heads in ((1, 1), (2, 2), (4, 0)):
        with pytest.raises(ValueError, match="does not hold whole groups of the model's 2 query heads per KV head") as raised:
            rank_config(CONFIG, heads, kv_heads)
        assert "\n" not in str(raised.value)


@pytest.mark.parametrize("method", ["snapkv", "keepkv", "h2o+interval=3"])
def test_a_bfloat16_cache_decodes_as_alone(method):
    """A bf16 engine cache (each fp32 metadata word in two bf16 elements of a slot) gives the
    outputs of a bf16 CompressedCache per request, to bf16's rounding."""
    generator = torch.Generator().manual_seed(5)
    paged = PagedCompression(CONFIG, method, 6)
    engine = Engine(paged, dtype=torch.bfloat16)
    prompts = {0: 9, 1: 20}
    references = {r: CompressedCache(CONFIG, method, 6) for r in prompts}
    for step in range(6):
        new = {r: tuple(t.to(torch.bfloat16) for t in tokens(generator, prompts[r] if step == 0 else 1)) for r in prompts}
        outputs = engine.step(new)
        for request, (query, key, value) in new.items():
            expected = alone(references[request], query, key, value)
            torch.testing.assert_close(outputs[request], expected, rtol=2e-2, atol=2e-2)
            held = held_slots(engine, request)[2][..., 0].sort(-1).values  # [H_kv, S] each slot's position word
            live = references[request].layers[0].positions[0]
            assert torch.equal(held, live[live >= 0].view(KV_HEADS, -1).sort(-1).values.float())


def chunked_step(generator, plans: dict, fed: dict, step: int) -> dict:
    """One step's new tokens of requests ``plans`` {request: (prompt, chunk)}: each prompt's next
    chunk, then a token a step; request 3 joins at step 2. ``fed`` counts what each was fed."""
    new = {}
    for request, (prompt, chunk) in plans.items():
        if request == 3 and step < 2:
            continue
        length = min(chunk, prompt - fed[request]) if fed[request] < prompt else 1
        new[request] = tokens(generator, length)
        fed[request] += length
    return new


@pytest.mark.parametrize("method", [*SERVED_METHODS, "h2o+interval=3", PAPER_KEEPKV, "keepkv+interval=3",
                                    "keepkv+prefill_scores=ema"])
@pytest.mark.parametrize("budget", [0.5, 3, 1.0])
def test_prompts_read_in_chunks_decode_as_the_hf_paths_chunked_prefill(method, budget):
    """A chunked engine (vLLM's chunked prefill) feeds prompts in pieces, the last one of a single
    token too, and one prompt whole: each output equals the request's own CompressedCache fed the
    same chunks (``start_prefill``), which compresses once the prompt is whole; the request holds
    every prompt token until then, and what ``stored`` says after; its surplus blocks, freed and
    overwritten after its first decode step, are never read again."""
    generator = torch.Generator().manual_seed(7)
    paged = PagedCompression(CONFIG, method, budget, chunked=True)
    engine = Engine(paged)
    plans = {0: (22, 7), 1: (9, 9), 2: (40, 16), 3: (13, 5)}  # request: (prompt, chunk); 3 joins at step 2
    references = {r: CompressedCache(CONFIG, method, budget) for r in plans}
    for request, (prompt, _) in plans.items():  # compressed at its end, as the engine compresses
        references[request].start_prefill(torch.ones(1, prompt, dtype=torch.bool), compress_chunks=False)
    null_block = engine.kv_cache[0].clone()
    fed = dict.fromkeys(plans, 0)
    for step in range(12):
        new = chunked_step(generator, plans, fed, step)
        outputs = engine.step(new, prompts={r: plan[0] for r, plan in plans.items()})
        for request, (query, key, value) in new.items():
            expected = alone(references[request], query, key, value)
            torch.testing.assert_close(outputs[request], expected, rtol=1e-5, atol=1e-5)
            prompt, done = plans[request][0], engine.computed[request]
            held = int(references[request].layers[0].live_counts().max())
            assert held == (done if done < prompt else paged.stored(prompt, done))
    assert all(fed[r] > plans[r][0] + 3 for r in plans)  # every request decoded past its close step
    assert not paged.requests.chunks  # nothing of a prompt's statistics kept past its compression
    assert torch.equal(engine.kv_cache[0], null_block)  # nothing written past a request's blocks


@pytest.mark.parametrize("method", [LEARNED, LEARNED.replace("+budgets=uniform", ""),
                                    f"{LEARNED.replace('+budgets=uniform', '')}+prompt_window=2+interval=3"])
@pytest.mark.parametrize("budget", [0.3, 5, 1])
def test_prompts_compressed_chunk_by_chunk_decode_as_the_hf_paths_chunked_prefill(method, budget):
    """A method that scores each entry alone and only evicts (the learned selection, uniform and
    trained budgets) compresses a prompt read in chunks after each chunk but its last, to its whole
    prompt's budget, as ``CompressedCache.start_prefill`` does: in every layer each output equals the
    request's own CompressedCache fed the same chunks, and the layer holds what ``reading`` says
    while the prompt is read (then what ``stored`` says). The engine holds blocks for that plus
    one chunk, the rest freed and overwritten, so a read of a slot past it would show."""
    for layer in range(CONFIG.num_hidden_layers):
        generator = torch.Generator().manual_seed(11 + layer)
        paged = PagedCompression(CONFIG, method, budget, chunked=True)
        assert paged.compresses_chunks
        engine = Engine(paged, blocks=128)
        plans = {0: (90, 25), 1: (9, 9), 2: (130, 40), 3: (60, 50)}  # request: (prompt, chunk); 3 joins at step 2
        references = {r: CompressedCache(CONFIG, method, budget) for r in plans}
        for request, (prompt, _) in plans.items():  # compressed chunk by chunk (the default)
            references[request].start_prefill(torch.ones(1, prompt, dtype=torch.bool))
        fed, shrank = dict.fromkeys(plans, 0), False
        for step in range(10):
            new = chunked_step(generator, plans, fed, step)
            outputs = engine.step(new, layer, prompts={r: plan[0] for r, plan in plans.items()})
            for request, (query, key, value) in new.items():
                expected = alone(references[request], query, key, value, layer)
                torch.testing.assert_close(outputs[request], expected, rtol=1e-5, atol=1e-5)
                prompt, done = plans[request][0], engine.computed[request]
                held = int(references[request].layers[layer].live_counts().max())
                if done < prompt:  # read so far, each chunk compressed to the whole prompt's budget
                    assert held == paged.reading(prompt, done, (layer,)) == min(done, paged.kept(prompt, layer))
                    shrank |= len(engine.tables[request]) < math.ceil(done / BLOCK)
                elif done > prompt:  # closed at its first decode step (the Hugging Face cache at its last chunk)
                    assert held == paged.stored(prompt, done, layer)
        assert all(fed[r] > plans[r][0] + 3 for r in plans)  # every request decoded past its close step
        assert shrank  # some prompt held fewer blocks than it had read
        assert not paged.requests.chunks  # nothing of a prompt's chunks kept past its close


def decode_beside_alone(paged, method, budget, layer, seed, steps):
    """Three requests of unequal prompts (40, 25, 60 tokens), then one token each per step, through
    one layer of ``paged``; each output is checked against that request decoded alone. Yields
    (engine, request, its prompt length, its own CompressedCache) after each check."""
    generator = torch.Generator().manual_seed(seed)
    engine = Engine(paged)
    prompts = {0: 40, 1: 25, 2: 60}
    references = {r: CompressedCache(CONFIG, method, budget) for r in prompts}
    for step in range(steps):
        new = {r: tokens(generator, prompts[r] if step == 0 else 1) for r in prompts}
        outputs = engine.step(new, layer)
        for request, (query, key, value) in new.items():
            expected = alone(references[request], query, key, value, layer)
            torch.testing.assert_close(outputs[request], expected, rtol=1e-5, atol=1e-5)
            yield engine, request, prompts[request], references[request]


class CacheWrites:
    """The slots whose keys and values the kernel's cache write is handed, per call."""

    def __init__(self, paged: PagedCompression):
        self.slots: list[int] = []
        write = paged.kernel.write

        def counted(keys_plane, values_plane, keys, values, slots):
            self.slots.append(len(slots))
            return write(keys_plane, values_plane, keys, values, slots)

        paged.kernel.write = counted


def held_slots(engine, request, computed: int | None = None):
    """(keys, values [H_kv, S, D], words [H_kv, S, M]) of the slots a request holds now (S: what
    ``stored`` says), unpacked from the engine's planes."""
    paged = engine.paged
    done = engine.computed[request] if computed is None else computed
    held = paged.stored(engine.prompt[request], done)
    layout = paged.layout(BLOCK, KV_HEADS, HEAD_DIM, engine.kv_cache.dtype)
    keys_plane, values_plane, words = layout.planes(engine.kv_cache)
    key_order, value_order = paged.kernel.orders(BLOCK, layout.head_dim, layout.dtype)
    slot = torch.arange(held)
    blocks = torch.tensor(engine.tables[request])[slot // BLOCK]
    heads = torch.arange(KV_HEADS)[:, None]
    keys = keys_plane[blocks[None, :, None], heads[..., None], key_order[slot % BLOCK][None]][..., :HEAD_DIM]
    values = values_plane[blocks[None, :, None], heads[..., None], value_order[slot % BLOCK][None]][..., :HEAD_DIM]
    index = layout.word_index(blocks[None], heads, slot % BLOCK)
    return keys, values, words[index[..., None] + torch.arange(layout.words)]


@pytest.mark.parametrize("method", ["window", "streamingllm", "snapkv", "h2o", "keepkv", "h2o+interval=3"])
@pytest.mark.parametrize("budget", [12, 0.5])
def test_an_uncompressed_request_holds_what_stock_vllm_holds(method, budget):
    """Until a request outgrows its budget, each of its tokens is in the slot of its position, its
    key and value exactly as the engine's own cache write of that token puts them: the engine's
    kernel reads it as it reads stock vLLM's (bit for bit). Once compressed, it holds what
    ``stored`` says, in its leading slots."""
    generator = torch.Generator().manual_seed(3)
    paged = PagedCompression(CONFIG, method, budget)
    engine = Engine(paged)
    stock = Engine(PagedCompression(CONFIG, "window", 10_000))  # every token in the slot of its position
    prompts = {0: 5, 1: 20, 2: 9}
    fed = {r: [] for r in prompts}
    seen = set()
    for step in range(26):
        new = {r: tokens(generator, prompts[r] if step == 0 else 1) for r in prompts}
        for request, chunk in new.items():
            fed[request].append(chunk)
        engine.step(new)
        for request in prompts:
            done = engine.computed[request]
            whole = paged.stored(prompts[request], done) == done
            keys, values, words = held_slots(engine, request)
            if whole:
                assert torch.equal(words[..., 0], torch.arange(done).float().expand(KV_HEADS, -1))
                everything = [torch.cat([c[i] for c in fed[request]]) for i in (1, 2)]  # [T, H_kv, D]
                assert torch.equal(keys, everything[0].transpose(0, 1)) and torch.equal(values, everything[1].transpose(0, 1))
            else:
                assert keys.shape[1] == paged.stored(prompts[request], done) < done
            seen.add((request, whole))
    assert (0, True) in seen
    if isinstance(budget, int):  # it outgrew its budget of 12; the 20-token prompt was compressed at once
        assert {(0, False), (1, False)} <= seen
    del stock


@pytest.mark.parametrize("method", ["snapkv", "h2o", "keepkv", "keepkv+threshold=-1.0+protect=0+max_value_change=None+min_mass=0",
                                    "snapkv+window=2+interval=4", "keepkv+selection.window=2+interval=4"])
def test_a_decode_step_moves_only_what_changed(method):
    """A decode step writes the key and value of its new token only (one slot per request); a step
    that compresses also writes the slots whose entry or votes changed, a few per request. An
    entry that stays keeps its slot, with its key and value bytes as they were unless its votes
    changed (a merge into it). A short prompt beside longer ones fills its own slots in order."""
    generator = torch.Generator().manual_seed(3)
    paged = PagedCompression(CONFIG, method, 10)  # interval 4 (at most half of 10 less a window of 2)
    engine = Engine(paged)
    prompts = {0: 3, 1: 25, 2: 60}
    engine.step({r: tokens(generator, n) for r, n in prompts.items()})
    writes = CacheWrites(paged)
    interval = paged.interval(60)
    assert interval == paged.method.interval
    for step in range(9):
        before = {r: held_slots(engine, r) for r in prompts}
        writes.slots.clear()
        engine.step({r: tokens(generator, 1) for r in prompts})
        compressing = [r for r in prompts if (engine.computed[r] - prompts[r]) % interval == 0]
        assert writes.slots[0] == len(prompts)  # the new tokens, one slot each
        assert sum(writes.slots[1:]) <= 2 * interval * KV_HEADS * len(compressing)  # moved entries, merge targets, per head
        for request, (old_keys, _, old_words) in before.items():
            new_keys, _, new_words = held_slots(engine, request)
            both = min(old_words.shape[1], new_words.shape[1])
            old_position, new_position = old_words[:, :both, 0], new_words[:, :both, 0]
            still_held = (old_words[..., None, 0] == new_words[:, None, :, 0]).any(-1)[:, :both]  # [H_kv, S]
            assert torch.equal(still_held, old_position == new_position), (step, request)
            same = old_position == new_position
            if paged.biased:
                same &= old_words[:, :both, 1] == new_words[:, :both, 1]
            assert torch.equal(old_keys[:, :both][same], new_keys[:, :both][same])


@pytest.mark.parametrize("method", ["pyramidkv+window=2+kernel=1", "pyramidkv+window=2+kernel=1+interval=3",
                                    "pyramidkv+window=2+kernel=1+interval=8", LEARNED.replace("+budgets=uniform", ""),
                                    LEARNED.replace("+budgets=uniform", "+interval=8")])
@pytest.mark.parametrize("budget", [6, 0.3])
def test_per_layer_budgets_decode_as_alone_in_every_layer(method, budget):
    """PyramidKV's layers keep budgets of their own (larger below), as the learned selection's
    trained split (its scorer's shares, larger below here): each layer of paged requests gives that
    layer's output in a CompressedCache of its own, and holds what ``stored`` says for it. Each
    layer compresses at its own interval (interval=8 at budget 6: every 4, 2 and 1 steps for
    PyramidKV's layers of 10, 6 and 2 entries, at most half of what each holds beyond its 2
    protected ones), as the Hugging Face cache's layers do.

    kernel=1: SnapKV's max-pooling gives random keys' neighbours equal scores, and a batch may
    then keep the other of two tied entries (the Hugging Face path's batches too)."""
    paged = PagedCompression(CONFIG, method, budget)
    kept = [paged.kept(40, layer) for layer in range(CONFIG.num_hidden_layers)]
    assert kept == sorted(kept, reverse=True) and kept[0] > kept[-1]  # a pyramid, for a 40-token prompt
    layers = range(CONFIG.num_hidden_layers)
    intervals = [paged.interval(40, layer) for layer in layers]
    protected = paged.method.protected_entries()
    assert intervals == [max(1, min(paged.method.interval, (each - protected) // 2)) for each in kept]
    for layer in layers:
        for engine, request, _, reference in decode_beside_alone(paged, method, budget, layer, layer, 7 + max(intervals)):
            assert reference.layers[layer].interval == paged.interval(engine.prompt[request], layer)
            held = int(reference.layers[layer].live_counts().max())
            assert held == paged.stored(engine.prompt[request], engine.computed[request], layer)
            assert held <= paged.capacity(engine.prompt[request])


@pytest.mark.parametrize("method", ["keepkv", PAPER_KEEPKV, "keepkv+selection=ema+interval=3"])
def test_keepkv_merges_and_keeps_its_state_per_request(method):
    """KeepKV served: requests of unequal prompts merge (votes in the bias word, the EMA in the
    slots' extra words), each layer decodes as that layer alone, and each request's per-layer
    state (its lost votes) is its own cache's, filed apart per request."""
    paged = PagedCompression(CONFIG, method, 6)
    # position, bias and the EMA's one word per KV head, + the score of a selection that keeps one (SnapKV's)
    assert paged.meta_words == 3 + ("score" in paged.extras)
    merged = False
    for layer in range(CONFIG.num_hidden_layers):
        for engine, request, prompt, cache in decode_beside_alone(paged, method, 6, layer, 10 + layer, 6):
            reference = cache.layers[layer]
            assert int(reference.live_counts().max()) == paged.stored(prompt, engine.computed[request], layer)
            state = request_state(paged, engine.tables[request][0], layer)
            torch.testing.assert_close(state["lost_votes"], reference.state["lost_votes"])
            merged |= bool((reference.bias > 0).any())  # votes above 1: a merge happened
    assert merged


@pytest.mark.parametrize("cpp", [True, False])
@pytest.mark.parametrize("method", ["snapkv+window=2+interval=3", "keepkv+selection.window=2+interval=3", "h2o+interval=3"])
def test_compressions_read_the_kept_queries_softmax_on_either_backend(method, cpp, monkeypatch):
    """A compression's kept queries get their softmax from keepkv's C++ pass where it builds, else
    from torch's (keepkv.kernels.kept): either way every request decodes as alone."""
    import keepkv.kernels.kept
    from keepkv.kernels.paged_cpp import cpp_available

    if cpp and not cpp_available():
        pytest.skip("no C++ compiler or ninja: the cpp backend cannot build")
    monkeypatch.setattr(keepkv.kernels.kept, "cpp_takes", lambda logits, bias: cpp)
    calls = []
    in_cpp = keepkv.kernels.kept._kept_cpp
    monkeypatch.setattr(keepkv.kernels.kept, "_kept_cpp", lambda *args: calls.append(args[0].shape) or in_cpp(*args))
    paged = PagedCompression(CONFIG, method, 8)  # interval 3 (at most half of 8 less a window of 2)
    assert paged.interval(60) == 3
    for _ in decode_beside_alone(paged, method, 8, 1, 7, 8):
        pass
    assert bool(calls) == cpp
    assert all(shape[3] == 3 for shape in calls)  # the interval's kept queries


@pytest.mark.parametrize("method", SERVED_METHODS)
@pytest.mark.parametrize("prompt", [1, 5, 40])
@pytest.mark.parametrize("budget", [0.1, 0.5, 2, 64])
def test_stored_entries_never_exceed_capacity(method, prompt, budget):
    """What a request holds after each of its first steps fits the capacity its blocks are sized by."""
    paged = PagedCompression(CONFIG, method, budget)
    capacity = paged.capacity(prompt)
    for layer in range(CONFIG.num_hidden_layers):
        sizes = [paged.stored(prompt, prompt + t, layer) for t in range(50)]
        assert max(sizes) <= capacity
        assert sizes[0] == min(prompt, paged.kept(prompt, layer))


@pytest.mark.parametrize("budget", [0.1, 0.25, 0.5, 1.0, 7])
def test_kept_is_the_caches_row_budget(budget):
    paged = PagedCompression(CONFIG, "snapkv", budget)
    lengths = torch.arange(1, 400)
    floor = budget_floor(paged.method)
    assert [paged.kept(int(n)) for n in lengths] == row_budgets(budget, lengths, floor).tolist()


@pytest.mark.parametrize("method", SERVED_METHODS)
@pytest.mark.parametrize("keep_prompt", [False, True])
def test_a_schedulers_config_of_depth_and_kv_heads_sizes_requests_as_the_models(method, keep_prompt):
    """The scheduler builds its adapter from the model's depth and KV heads alone
    (``keepkv.vllm.spec``): every size it reads is the one the whole config gives."""
    from types import SimpleNamespace

    budget = 48 if keep_prompt else 0.25
    scheduler = PagedCompression(SimpleNamespace(num_hidden_layers=3, num_key_value_heads=KV_HEADS), method, budget,
                                 keep_prompt=keep_prompt)
    worker = PagedCompression(CONFIG, method, budget, keep_prompt=keep_prompt)
    for prompt in (1, 9, 40, 333):
        assert scheduler.capacity(prompt) == worker.capacity(prompt)
        assert [scheduler.stored(prompt, prompt + t) for t in range(0, 40, 7)] == \
            [worker.stored(prompt, prompt + t) for t in range(0, 40, 7)]


def test_rejects_what_it_cannot_serve():
    for method in ("cam", "d2o", "kvmerger", "snapkv+merge=zip", "keepkv+selection=kvzip"):
        with pytest.raises(ValueError, match=f"serves {', '.join(SERVED_METHODS)} .*merge keepkv or none"):
            PagedCompression(CONFIG, method, 0.5)
    with pytest.raises(ValueError, match="does not serve kvzip: its reconstruction pass"):
        PagedCompression(CONFIG, "kvzip", 0.5)
    with pytest.raises(ValueError, match="refresh_interval"):
        PagedCompression(CONFIG, "keepkv+selection=ema+refresh_interval=4", 0.5)
    with pytest.raises(ValueError, match="budget"):
        PagedCompression(CONFIG, "snapkv", 0.0)
    paged = PagedCompression(CONFIG, "snapkv", 0.5)
    with pytest.raises(ValueError, match="one token per decode step .*chunked prefill"):
        paged.batch([0, 5], [9], torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="prefilling flag"):
        PagedCompression(CONFIG, "snapkv", 0.5, chunked=True).batch([0, 5], [5], torch.ones(1, 2, dtype=torch.int32))


@pytest.mark.parametrize("name", sorted(SELECTIONS))
def test_a_selection_not_declared_layered_gives_every_layer_the_rows_budget(name):
    """The paged adapter sizes a request once for every layer unless its selection declares
    ``layered`` budgets: an undeclared one's allocate gives each layer the row's budget, and the
    served ones that declare it do give layers budgets of their own."""
    selection = SELECTIONS[name]()
    if name == "learned":  # its default split reads its scorer's layer shares, one per layer of the model
        config = LlamaConfig(num_hidden_layers=6, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
        selection = get_method(with_scorer("snapkv+selection=learned", config)).selection
    row_budget, prompts = torch.tensor([40, 97, 300]), torch.tensor([400, 500, 900])
    if selection.allocates_from_all_layers:  # D2O: every layer's prompt statistics
        assert selection.layered
        return
    budgets = selection.allocate(6, 2, row_budget, prompts)
    uniform = bool((budgets == budgets[:1]).all())
    if not selection.layered:
        assert uniform and bool((budgets[0] == row_budget[:, None]).all())
    elif selection.served:
        assert not uniform


@pytest.mark.parametrize("every", [True, False])
@pytest.mark.parametrize("method", ["snapkv", "pyramidkv+window=2", "keepkv"])
def test_a_step_builds_its_plan_once_for_every_layer(method, every, monkeypatch):
    """One engine step over every layer of the model: the step's plan (its rows by phase, slots,
    kernel shapes) is built at its first layer and read by every layer, with one kernel call
    shape per distinct sizes (one for every layer but PyramidKV's, whose layers keep different
    budgets). ``every``: keepkv's paged kernel attends every method's compressed requests (its
    backend is one of OUR_DECODE_BACKENDS), else only a biased method's."""
    backend = paged_module._decode_backend(torch.device("cpu"))
    monkeypatch.setattr(paged_module, "OUR_DECODE_BACKENDS", (backend,) if every else ())
    generator = torch.Generator().manual_seed(5)
    paged = PagedCompression(CONFIG, method, 16)
    caches = [Engine(paged) for _ in range(CONFIG.num_hidden_layers)]  # one KV cache per layer, same tables
    prompts = {0: tokens(generator, 39), 1: tokens(generator, 6)}
    for layer, engine in enumerate(caches):
        engine.step(prompts, layer)
    built, plans = [], []
    original_build = StepPlan.build.__func__
    monkeypatch.setattr(StepPlan, "build", classmethod(lambda cls, *a: built.append(a[2]) or original_build(cls, *a)))
    plan = paged.kernel.plan
    monkeypatch.setattr(paged.kernel, "plan", lambda start, lens, *a: plans.append(tuple(lens.tolist())) or plan(start, lens, *a))
    decode, calls = paged_module.paged_decode, []  # keepkv's decoding rows: keepkv's paged kernel
    monkeypatch.setattr(paged_module, "paged_decode", lambda *a, **k: calls.append(a[3]) or decode(*a, **k))
    engine = caches[0]
    new = {0: tokens(generator, 1), 1: tokens(generator, 1)}
    width = max(len(engine.tables[r]) for r in (0, 1))
    table = torch.tensor([engine.tables[r] + [0] * (width - len(engine.tables[r])) for r in (0, 1)], dtype=torch.int32)
    batch = paged.batch([0, 1, 2], [40, 7], table)
    query, key, value = (torch.cat([new[r][i] for r in (0, 1)]) for i in range(3))
    for layer, each in enumerate(caches):
        each.paged.forward(each.kv_cache, query, key, value, batch, SCALING, layer)
    assert built == [batch]  # one plan, built once
    sizes = {tuple(paged.stored(p, c, layer) + 1 for p, c in ((39, 39), (6, 6))) for layer in range(3)}
    if every or paged.biased:  # the compressed request goes to keepkv's kernel, the other (6 tokens, under its
        # budget) to the engine's: each call built once, per distinct sizes
        assert sorted(plans) == [(7,)] and len(calls) == CONFIG.num_hidden_layers
        assert {tuple(lens.tolist()) for lens in calls} == {size[:1] for size in sizes}
        assert len({id(lens) for lens in calls}) == len(sizes)
    else:
        assert sorted(plans) == sorted(sizes)  # one kernel shape per distinct sizes
    assert (len(sizes) > 1) == method.startswith("pyramidkv")


def test_compressions_run_on_one_thread_prompts_on_the_engines_and_the_count_is_back(monkeypatch):
    """A decode step's compression (many small ops) runs on STEP_THREADS intra-op threads, a
    prompt's close on the engine's (PROMPT_THREADS 0); the caller's count is back afterwards, also
    when the step raises."""
    paged = PagedCompression(CONFIG, "snapkv", 4)
    engine = Engine(paged)
    seen = []
    decode, close = LayerStep.decode, LayerStep.close_prompt
    monkeypatch.setattr(LayerStep, "decode", lambda *a: seen.append(("decode", torch.get_num_threads())) or decode(*a))
    monkeypatch.setattr(LayerStep, "close_prompt",
                        lambda *a: seen.append(("prompt", torch.get_num_threads())) or close(*a))
    before = torch.get_num_threads()
    torch._C.set_num_threads(2)  # torch.set_num_threads may be vLLM's no-op (its in-process worker replaces it)
    try:
        generator = torch.Generator().manual_seed(6)
        engine.step({0: tokens(generator, 7)})
        engine.step({0: tokens(generator, 1)})
        assert seen == [("prompt", 2), ("decode", 1)] and torch.get_num_threads() == 2
        monkeypatch.setattr(LayerStep, "decode", lambda *a: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            engine.step({0: tokens(generator, 1)})
        assert torch.get_num_threads() == 2
    finally:
        torch._C.set_num_threads(before)


def test_requests_admitted_over_many_steps_keep_their_own_keepkv_state():
    """Twelve requests, two admitted per step while the others decode (the state slabs grow
    past their first rows): every output equals the request alone, and each request's filed
    lost votes are its own cache's."""
    paged = PagedCompression(CONFIG, "keepkv", 6)
    engine = Engine(paged, blocks=96)
    generator = torch.Generator().manual_seed(3)
    references, merged = {}, False
    for step in range(9):
        new = {r: tokens(generator, 1) for r in references}
        for r in range(2 * step, min(2 * step + 2, 12)):
            references[r] = CompressedCache(CONFIG, "keepkv", 6)
            new[r] = tokens(generator, 20 + 3 * r)
        outputs = engine.step(new, 0)
        for request, (query, key, value) in new.items():
            torch.testing.assert_close(outputs[request], alone(references[request], query, key, value), atol=1e-5, rtol=1e-5)
            reference = references[request].layers[0]
            state = request_state(paged, engine.tables[request][0], 0)
            torch.testing.assert_close(state["lost_votes"], reference.state["lost_votes"])
            merged |= bool((reference.bias > 0).any())
    assert len(references) == 12 and merged


def test_a_prompt_aborted_mid_way_leaves_nothing_behind_for_long(monkeypatch):
    """An engine aborts a request between two chunks of its prompt (a client gone): what its chunks
    filed for its close is dropped once it went unseen for STALE_STEPS steps, while a request
    still reading its prompt keeps its own."""
    monkeypatch.setattr(keepkv.paged_requests, "STALE_STEPS", 4)
    generator = torch.Generator().manual_seed(8)
    paged = PagedCompression(CONFIG, "snapkv", 0.5, chunked=True)
    engine = Engine(paged)
    engine.step({0: tokens(generator, 6)}, prompts={0: 12})  # request 0: half its prompt, then aborted
    assert len(paged.requests.chunks) == 1
    engine.step({1: tokens(generator, 5)}, prompts={1: 40})
    for _ in range(6):  # request 1 reads its prompt on, 5 tokens a step
        engine.step({1: tokens(generator, 5)})
    filed = {key for key, _ in paged.requests.chunks}
    assert len(paged.requests.chunks) == 1 and filed == {engine.tables[1][0]}  # request 1's own, request 0's gone


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (32, 8), (8, 8)])
def test_a_keepkv_slot_costs_snapkvs_plus_its_bias_and_ema_words(head_dim, dtype, heads, kv_heads):
    """keepkv's keys and values are as wide as snapkv's whatever the head size (its votes are read
    from one fp32 word by keepkv's paged kernel, not carried in wider keys): its slot costs snapkv's
    plus 8 bytes, the bias word and one EMA word per KV head (ln S pooled over the group; its
    normaliser ln N follows from the position), which the Hugging Face cache keeps too; with
    ``ema_heads="each"``, g EMA words."""
    config = rank_config(LlamaConfig(num_hidden_layers=2, hidden_size=heads * head_dim, num_attention_heads=heads,
                                     num_key_value_heads=kv_heads),
                         heads, kv_heads)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    snapkv = PagedCompression(config, "snapkv", 64).content_bytes(head_dim, dtype)
    keepkv = PagedCompression(config, "keepkv", 64).content_bytes(head_dim, dtype)
    assert snapkv == 2 * head_dim * itemsize + 4 * 2  # key, value, position and score
    assert keepkv - snapkv == 8
    each = PagedCompression(config, "keepkv+ema_heads=each", 64).content_bytes(head_dim, dtype)
    assert each - snapkv == 4 * (1 + heads // kv_heads)
