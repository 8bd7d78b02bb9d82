"""The engine's kernel reads keepkv's blocks in place: entries with votes (a logit bias) attended
exactly by keepkv's paged kernel over the same planes, requests decoded through the kernels as
alone in a CompressedCache, and no decode step that does not compress copies a request's cache.

Every test runs with keepkv's reference kernel (plain torch) and, where vLLM's CPU build is
installed (the serving venv), with vLLM's own cache write and kernel."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig

from keepkv import CompressedCache
from keepkv.kernels.paged import paged_decode
from keepkv.paged import PagedCompression
from keepkv.paged_layout import PagedLayout, TorchPagedKernel

pytestmark = pytest.mark.filterwarnings("ignore::keepkv.KeepKVWarning")


def kernels():
    found = [pytest.param(TorchPagedKernel, id="torch")]
    try:
        from keepkv.vllm.backend import VllmCpuKernel
    except ImportError:
        found.append(pytest.param(None, id="vllm", marks=pytest.mark.skip(reason="vLLM's CPU build is not installed")))
    else:
        found.append(pytest.param(VllmCpuKernel, id="vllm"))
    return found


HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 64, 32  # sizes vLLM's CPU kernel takes
CONFIG = LlamaConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                     num_hidden_layers=2, intermediate_size=16, vocab_size=32)
SCALING = HEAD_DIM**-0.5
MERGING = "keepkv+threshold=-1.0+protect=0+max_value_change=None+min_mass=0"  # merges whatever it evicts: votes


@pytest.mark.parametrize("kernel_type", kernels())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entries_with_votes_attend_as_softmax_with_their_bias(kernel_type, dtype):
    """A biased layout keeps keys and values at the model's head size, as the engine's cache write
    packs them, and each entry's bias (ln p of its votes, -inf for an empty slot) in its fp32
    words; keepkv's paged kernel reads both in place through the layout's geometry: its output is
    softmax(q·k·scaling + bias)·v, to 1e-5 in fp32 (bf16: its rounding), and a slot costs one fp32
    word more than an unbiased one."""
    kernel = kernel_type()
    generator = torch.Generator().manual_seed(0)
    layout = PagedLayout(BLOCK, KV_HEADS, HEAD_DIM, 3, dtype, True)
    assert layout.cell_bytes == PagedLayout(BLOCK, KV_HEADS, HEAD_DIM, 2, dtype, False).cell_bytes + 4
    blocks, lengths = 9, [70, 5, 40]
    kv_cache = torch.randn(blocks, KV_HEADS, BLOCK, layout.cell // BLOCK, generator=generator).to(dtype)
    keys_plane, values_plane, words = layout.planes(kv_cache)
    tables = [[3, 7, 1], [5], [8, 2]]
    expected = []
    query = torch.randn(len(lengths), HEADS, HEAD_DIM, generator=generator).to(dtype)
    for row, length in enumerate(lengths):
        keys = torch.randn(length, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
        values = torch.randn(length, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
        bias = torch.rand(length, KV_HEADS, generator=generator).mul(6).log()  # ln p for p in (0, 6): some < 0
        bias[torch.rand(length, KV_HEADS, generator=generator) < 0.2] = float("-inf")  # empty slots, per head
        bias[-1] = 0.0  # the newest entry is live in every head
        slots = torch.tensor([tables[row][j // BLOCK] * BLOCK + j % BLOCK for j in range(length)])
        kernel.write(keys_plane, values_plane, keys, values, slots)
        index = layout.word_index((slots // BLOCK)[:, None], torch.arange(KV_HEADS)[None, :], (slots % BLOCK)[:, None])
        words[index + 1] = bias
        grouped = query[row].float().view(KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
        logits = torch.einsum("hgd,shd->hgs", grouped, keys.float()) * SCALING + bias.T[:, None]
        expected.append(torch.einsum("hgs,shd->hgd", logits.softmax(-1), values.float()).reshape(HEADS, HEAD_DIM))
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    geometry = layout.geometry(*kernel.orders(BLOCK, HEAD_DIM, dtype))
    out, _, _ = paged_decode(query, kv_cache, table, torch.tensor(lengths, dtype=torch.int32), SCALING, geometry,
                             max_len=max(lengths))
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), torch.stack(expected), rtol=tolerance, atol=tolerance)


class Engine:
    """A block pool and the paged cache (garbage where nothing was written), each request's block
    table capped at its capacity (its whole prompt while it is read in chunks)."""

    def __init__(self, paged: PagedCompression, dtype=torch.float32, blocks: int = 64):
        self.paged = paged
        generator = torch.Generator().manual_seed(0)
        size = torch.finfo(dtype).bits // 8
        cell = paged.content_bytes(HEAD_DIM, dtype, BLOCK) // size
        self.kv_cache = torch.randn(blocks, KV_HEADS, BLOCK, cell, generator=generator).to(dtype)
        self.free = torch.randperm(blocks - 1, generator=generator).add(1).tolist()
        self.tables, self.computed, self.prompt = {}, {}, {}

    def step(self, new: dict, prompts: dict | None = None) -> dict:
        for request, (query, _, _) in new.items():
            if request not in self.tables:
                self.tables[request], self.computed[request] = [], 0
                self.prompt[request] = (prompts or {}).get(request, len(query))
            tokens, prompt = self.computed[request] + len(query), self.prompt[request]
            held = tokens if self.paged.chunked and tokens <= prompt else min(tokens, self.paged.capacity(prompt))
            while len(self.tables[request]) < math.ceil(held / BLOCK):
                self.tables[request].append(self.free.pop())
        requests = list(new)
        width = max(len(self.tables[r]) for r in requests)
        table = torch.tensor([self.tables[r] + [0] * (width - len(self.tables[r])) for r in requests], dtype=torch.int32)
        starts = [0]
        for request in requests:
            starts.append(starts[-1] + len(new[request][0]))
        seq_lens = [self.computed[r] + len(new[r][0]) for r in requests]
        prefilling = [self.computed[r] < self.prompt[r] for r in requests] if self.paged.chunked else None
        batch = self.paged.batch(starts, seq_lens, table, prefilling)
        query, key, value = (torch.cat([new[r][i] for r in requests]) for i in range(3))
        output = self.paged.forward(self.kv_cache, query, key, value, batch, SCALING, 0)
        for request, length in zip(requests, batch.query_lengths):
            self.computed[request] += length
        return {r: output[starts[i] : starts[i + 1]] for i, r in enumerate(requests)}


def tokens(generator, length, dtype=torch.float32):
    return tuple(torch.randn(length, heads, HEAD_DIM, generator=generator).to(dtype)
                 for heads in (HEADS, KV_HEADS, KV_HEADS))


def alone(cache: CompressedCache, query, key, value) -> torch.Tensor:
    layer = cache.layers[0]
    if not layer.is_initialized:
        layer.lazy_initialization(key.transpose(0, 1)[None], value.transpose(0, 1)[None])
    mask = torch.ones(1, 1, len(query), len(query), dtype=torch.bool).tril()
    return cache.forward_layer(0, *(t.transpose(0, 1)[None] for t in (query, key, value)), mask, SCALING)[0]


@pytest.mark.parametrize("kernel_type", kernels())
@pytest.mark.parametrize("method,budget", [("snapkv", 24), ("h2o+interval=4", 20), ("keepkv", 0.5), (MERGING, 20),
                                           (f"{MERGING}+interval=3", 20), ("pyramidkv+window=4", 16)])
@pytest.mark.parametrize("chunked", [False, True])
def test_requests_decode_through_the_kernel_as_alone(kernel_type, method, budget, chunked):
    """Requests of unequal prompts (one joining mid-way, prompts in chunks or whole) attended by the
    engine's kernel over their blocks: each output equals its own CompressedCache's, in fp32."""
    generator = torch.Generator().manual_seed(1)
    paged = PagedCompression(CONFIG, method, budget, chunked=chunked, kernel=kernel_type())
    engine = Engine(paged)
    plans = {0: (37, 16), 1: (53, 53), 2: (13, 5), 3: (40, 40)}  # request: (prompt, chunk); 3 joins at step 3
    references = {r: CompressedCache(CONFIG, method, budget) for r in plans}
    fed = dict.fromkeys(plans, 0)
    merged = False
    for step in range(14):
        new = {}
        for request, (prompt, chunk) in plans.items():
            if request == 3 and step < 3:
                continue
            if not chunked:
                chunk = prompt
            length = min(chunk, prompt - fed[request]) if fed[request] < prompt else 1
            if fed[request] == 0 and chunked:
                references[request].start_prefill(torch.ones(1, prompt, dtype=torch.bool))
            new[request] = tokens(generator, length)
            fed[request] += length
        outputs = engine.step(new, prompts={r: plan[0] for r, plan in plans.items()})
        for request, chunk in new.items():
            torch.testing.assert_close(outputs[request], alone(references[request], *chunk), rtol=1e-5, atol=1e-5,
                                       msg=lambda m, s=step, r=request: f"step {s} request {r}: {m}")
            merged |= bool((references[request].layers[0].bias > 0).any())
    assert merged == method.startswith(MERGING)  # the forced merges did merge (random keys are rarely similar)


class CopiedBytes(TorchDispatchMode):
    """Bytes written by the ops that copy or gather tensors (outputs of index, gather, cat, clone,
    copies, index_select), outside the kernel's own attention (``paused``)."""

    COPIES = {"index_select", "index", "gather", "cat", "clone", "copy_", "_to_copy", "index_put_", "_index_put_impl_",
              "index_copy_", "masked_select", "take", "stack", "scatter", "scatter_"}

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused and func.__name__.split(".")[0] in self.COPIES:
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor):
                    self.bytes += tensor.numel() * tensor.element_size()
        return out


@pytest.mark.parametrize("kernel_type", kernels())
@pytest.mark.parametrize("method", ["snapkv+interval=8", "keepkv+interval=8", "h2o+interval=8"])
def test_a_decode_step_that_does_not_compress_copies_nothing_that_grows_with_the_request(kernel_type, method):
    """Between compressions a decode step writes its token and reads the cache only through the
    kernel: the bytes its copies and gathers move are the same for a 40-token request as for a
    400-token one (a compression, every ``interval`` steps, reads a request's slots once)."""
    moved = {}
    for prompt in (40, 400):
        generator = torch.Generator().manual_seed(2)
        paged = PagedCompression(CONFIG, method, 24, kernel=kernel_type())
        engine = Engine(paged, blocks=40)
        engine.step({0: tokens(generator, prompt)})
        counter = CopiedBytes()
        attend = paged.kernel.attend

        def opaque(*args, counter=counter, attend=attend):
            counter.paused = True
            try:
                return attend(*args)
            finally:
                counter.paused = False

        paged.kernel.attend = opaque
        steps = []
        for step in range(1, 9):
            counter.bytes = 0
            with counter:
                engine.step({0: tokens(generator, 1)})
            steps.append((step % 8 == 0, counter.bytes))
        moved[prompt] = steps
    for (compressing, small), (_, large) in zip(moved[40], moved[400]):
        if not compressing:
            assert small == large, moved
    assert all(not compressing for compressing, _ in moved[40][:-1]) and moved[40][-1][0]
