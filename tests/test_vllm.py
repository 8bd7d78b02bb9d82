"""keepkv.vllm on vLLM's CPU build with the embedded model (skipped where vLLM is not installed).

Run in the serving venv (README "Serving (vLLM)"): ``bash .ci/vllm``. Each engine starts in
30-40 s, so engines are shared per configuration. The engine runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the tests read the scheduler's block tables.
"""

import gc
import json
import math
import os
from dataclasses import dataclass

import pytest

vllm = pytest.importorskip("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read when an engine starts
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import keepkv  # noqa: E402
from keepkv.paged import SERVED_METHODS, PagedCompression, rank_config  # noqa: E402

NEW_TOKENS = 24
KEPT = "vllm_ranks.KeptEntries"  # tests/vllm_ranks.py: each worker's kept positions, through collective_rpc
PAPER_KEEPKV = "keepkv+selection=ema+prefill_order=merge_first+protect=0+max_value_change=None+min_mass=0"  # docs/keepkv.md
SERVED = ["window", "streamingllm", "snapkv", "h2o", "pyramidkv", "keepkv", "keydiff", PAPER_KEEPKV,
          "snapkv+selection=learned+budgets=uniform", "snapkv+selection=learned"]


@pytest.fixture(autouse=True)
def no_workers_outlive_their_test():
    """After each test, the tensor-parallel workers its engines spawned are gone: a test that failed
    in a hung step (vLLM's RPC timeout, or .ci/vllm's --timeout) leaves its engine referenced by the
    failure's traceback and its workers bound to this host's cores, which would slow every later
    test and .ci/vllm's one rerun of it. A test that closes its engines leaves none to stop."""
    yield
    import psutil

    workers = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.name().startswith("VLLM::") or "spawn_main" in " ".join(child.cmdline()):
                child.kill()
                workers.append(child)
        except psutil.NoSuchProcess:  # it ended while we looked
            pass
    psutil.wait_procs(workers, timeout=30)


def test_every_served_method_is_checked_against_the_hugging_face_path():
    """The tests parametrized by SERVED cover every method the engine serves."""
    assert set(SERVED_METHODS) <= set(SERVED), sorted(set(SERVED_METHODS) - set(SERVED))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The embedded model as a Hugging Face directory vLLM can load."""
    path = tmp_path_factory.mktemp("smollm2")
    model, tokenizer = keepkv.load_model()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def prompts(model_dir):
    """Three prompts of unequal length (token ids): a short one, and two from the stdlib's sources."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [
        "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is",
        open(os.__file__).read()[:2500],
        open(json.__file__).read()[:1200],
    ]
    return [tokenizer(text).input_ids for text in texts]


class Engine:
    """A vLLM engine stepped by hand: outputs per request, and the block-cap check at every step."""

    def __init__(self, model_dir, config=None, **overrides):
        args = dict(
            model=model_dir, dtype="float32", max_model_len=2048, enforce_eager=True, enable_prefix_caching=False,
            enable_chunked_prefill=False, max_num_batched_tokens=2048, seed=0,
        )
        if config is not None:
            args["additional_config"] = {"keepkv": config}
        self.llm = vllm.LLM(**(args | overrides))
        self.config = config
        self.cached_tokens: dict[str, int] = {}

    def managers(self):
        """The scheduler's block managers, one per KV cache group (layers grouped by budget)."""
        core = self.llm.llm_engine.engine_core.engine_core
        return core.scheduler.kv_cache_manager.coordinator.single_type_managers

    def manager(self):
        return self.managers()[0]

    def run(self, prompts, new_tokens=NEW_TOKENS, kept=False, logprobs=None):
        """Greedy outputs (token ids) of ``prompts``, all in flight at once, and the most blocks each
        held (read from the scheduler after every step). ``kept`` (an engine built with
        ``worker_extension_cls=KEPT``): after every step, each request's kept positions, read from
        every rank, into ``self.kept`` {(request index, tokens generated): [L] int32 [H_kv, S_l], the
        ranks' heads in rank order, the model's head order}, and (one rank) the ranking of every
        compression into ``self.priorities`` {(layer, newest position): ([H_kv, S] positions,
        priorities)}; ``logprobs``: the top ones of every step into ``self.logprobs``
        [request][step] (highest first)."""
        if kept:
            self.llm.collective_rpc("keepkv_record", args=(True,))
        engine = self.llm.llm_engine
        params = vllm.SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=logprobs)
        names = [f"r{i}" for i in range(len(prompts))]
        internal = [engine.add_request(name, {"prompt_token_ids": p}, params) for name, p in zip(names, prompts)]
        outputs, peak_blocks, last_blocks, generated = {}, {}, {}, {}
        self.kept, self.logprobs, self.group_peaks = {}, {}, {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                generated[output.request_id] = list(output.outputs[0].token_ids)
                if logprobs:
                    self.logprobs[output.request_id] = [sorted((entry.logprob for entry in step.values()), reverse=True)
                                                        for step in output.outputs[0].logprobs]
                if output.finished:
                    outputs[output.request_id] = list(output.outputs[0].token_ids)
                    self.cached_tokens[output.request_id] = output.num_cached_tokens  # vLLM's prefix-cache hits
            step_held = {}
            for group, manager in enumerate(self.managers()):
                for request_id, blocks in manager.req_to_blocks.items():
                    held = sum(not block.is_null for block in blocks)
                    peaks = self.group_peaks.setdefault(request_id, {})
                    peaks[group] = max(peaks.get(group, 0), held)
                    step_held[request_id] = max(step_held.get(request_id, 0), held)
            for request_id, held in step_held.items():  # its largest group's (every layer's, ungrouped)
                peak_blocks[request_id] = max(peak_blocks.get(request_id, 0), held)
                last_blocks[request_id] = held
            if kept:
                self._read_kept(prompts, names, internal, generated)
        self.last_blocks = [last_blocks[request_id] for request_id in internal]  # held at their last step
        self.group_peaks = [self.group_peaks[request_id] for request_id in internal]  # {group: most blocks held}
        from vllm.model_executor.models.utils import extract_layer_index

        core = engine.engine_core.engine_core
        # Each KV cache group's layers (one group of every layer unless layers are grouped by budget).
        self.groups = [tuple(sorted(extract_layer_index(name) for name in group.layer_names))
                       for group in core.scheduler.kv_cache_config.kv_cache_groups]
        self.logprobs = [self.logprobs.get(name) for name in names]
        if kept:
            self.priorities = self.llm.collective_rpc("keepkv_record", args=(False,))[0]
        return [outputs[name] for name in names], [peak_blocks[request_id] for request_id in internal]

    def _read_kept(self, prompts, names, internal, generated):
        asked = {request_id: (len(prompt), len(prompt) + len(generated[name]) - 1)
                 for prompt, name, request_id in zip(prompts, names, internal) if name in generated}
        ranks = sorted(self.llm.collective_rpc("keepkv_kept", args=(asked,)), key=lambda answer: answer["rank"])
        self.ranks = [(answer["rank"], answer["kv_heads"]) for answer in ranks]
        for index, (name, request_id) in enumerate(zip(names, internal)):
            if all(request_id in answer["kept"] for answer in ranks) and name in generated:
                layers = zip(*(answer["kept"][request_id] for answer in ranks))
                self.kept[index, len(generated[name])] = [torch.cat(heads).int() for heads in layers]

    def close(self):
        engine_core = self.llm.llm_engine.engine_core
        del self.llm
        engine_core.shutdown()  # a parallel engine's workers stop here
        gc.collect()


def served(method: str) -> str:
    """The variant an engine serves for ``method`` (its serving interval, unless it names one)."""
    from keepkv.vllm import check

    return method if method == "full" else check({"method": method, "budget": 100})["method"]


def hf_greedy(model, prompt, method, budget, new_tokens=NEW_TOKENS, chunks=None, decoding="compress"):
    """keepkv's Hugging Face path: greedy tokens of one prompt alone in a CompressedCache of the
    variant an engine serves for ``method``; ``chunks``: the prompt's pieces, in tokens, fed as a
    chunked prefill (``start_prefill``)."""
    cache = keepkv.CompressedCache(model.config, served(method), budget, decoding=decoding)
    tokens, step = [], torch.tensor([prompt])
    with torch.no_grad(), keepkv.enabled(model):
        if chunks:
            # a learned selection's prompt is compressed chunk by chunk on both paths, any other at its end
            cache.start_prefill(torch.ones(1, len(prompt), dtype=torch.bool))
            ends = torch.tensor(chunks).cumsum(0).tolist()
            for start, end in zip([0, *ends[:-1]], ends[:-1]):
                model(input_ids=step[:, start:end], past_key_values=cache, use_cache=True)
            step = step[:, ends[-2] if len(ends) > 1 else 0 :]
        for _ in range(new_tokens):
            logits = model(input_ids=step, past_key_values=cache, use_cache=True).logits[0, -1]
            tokens.append(int(logits.argmax()))
            step = torch.tensor([[tokens[-1]]])
    return tokens


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def stock(model_dir, prompts):
    """Stock vLLM's greedy tokens and blocks (the plugin installed, keepkv not configured)."""
    engine = Engine(model_dir)
    outputs = engine.run(prompts)
    engine.close()
    return outputs


def test_budget_covering_everything_is_stock_vllm(model_dir, prompts, stock):
    engine = Engine(model_dir, {"method": "snapkv", "budget": 100_000})
    tokens, blocks = engine.run(prompts)
    engine.close()
    assert tokens == stock[0]
    assert blocks == stock[1]


QUESTIONS = [
    "What is 2 + 2?", "Name a primary colour.", "What is the capital of France?", "Who wrote Hamlet?",
    "What is water made of?", "How many legs has a spider?", "What colour is the sky?", "Name a planet.",
    "What is 3 times 3?", "Say hello.", "What is ice?", "Name a fruit.", "What do bees make?", "Is fire hot?",
    "What is a cat?", "Count to three.", "Name a month.", "What is the sun?", "Name an ocean.", "What is rain?",
    "Spell dog.", "What is 10 - 4?", "Name a bird.", "What is milk?", "Name a tree.", "What is a day?",
    "Name a colour.", "What is snow?", "Who was Newton?", "What is a car?", "Name a river.", "Is ice cold?",
]


@pytest.fixture(scope="module")
def chat_prompts(model_dir):
    """The 32 questions in the chat template (token ids): 30-40 tokens each, under the budget floor."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                    tokenize=False), add_special_tokens=False).input_ids
            for q in QUESTIONS]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_uncompressed_requests_answer_as_stock_vllm(model_dir, prompts, chat_prompts, hf_model, dtype, monkeypatch):
    """32 chat prompts under keepkv's budget floor at 0.1, batched with two long prompts that are
    compressed: each short one gets stock vLLM's greedy tokens for the same batch, in the served
    dtype (their attention runs through vLLM's own kernel), while the long ones are compressed.
    vLLM's warning for each weight it casts (the fp32 checkpoint served in bf16) shows once."""
    import logging

    from keepkv.vllm import CAST_LOGGER, _OncePerCast

    new_tokens = 16
    batch = [prompts[1], *chat_prompts, prompts[2]]
    paged = PagedCompression(hf_model.config, "keepkv", 0.1)
    assert all(len(p) + new_tokens <= paged.kept(len(p)) for p in chat_prompts)  # never compressed
    assert all(paged.kept(len(p)) < len(p) for p in (prompts[1], prompts[2]))  # compressed
    for once in logging.getLogger(CAST_LOGGER).filters:  # the plugin's: as in a new process
        if isinstance(once, _OncePerCast):
            once.seen.clear()
    verdicts = []  # (let through, the message) of every record the plugin's filter sees
    keep = _OncePerCast.filter
    monkeypatch.setattr(_OncePerCast, "filter",
                        lambda self, record: verdicts.append((keep(self, record), record.getMessage())) or verdicts[-1][0])
    # stock on the kernel keepkv's engines run (vLLM's "vec" where it would take "amx": bf16 on a
    # CPU with AMX, whose key tiles keepkv's kernel does not read); the engine runs in this process
    from vllm.v1.attention.backends import cpu_attn

    from keepkv.vllm.backend import engine_isa

    with monkeypatch.context() as same_kernel:
        same_kernel.setattr(cpu_attn, "_get_attn_isa", engine_isa)
        stock = Engine(model_dir, dtype=dtype)
        stock_tokens, stock_blocks = stock.run(batch, new_tokens)
        stock.close()
    keepkv_engine = Engine(model_dir, {"method": "keepkv", "budget": 0.1}, dtype=dtype)
    tokens, blocks = keepkv_engine.run(batch, new_tokens)
    keepkv_engine.close()
    assert tokens[1:-1] == stock_tokens[1:-1]
    assert blocks[0] < stock_blocks[0]  # the long prompt is compressed
    shown = [message for kept, message in verdicts if kept and "weight" in message]
    dropped = [message for kept, message in verdicts if not kept]
    if dtype == "bfloat16":  # one line in a process, not one per weight (122 per engine)
        assert shown == ["Casting the checkpoint's torch.float32 weights to torch.bfloat16 as they load "
                         "(shown once, not per weight)"]
        assert len(dropped) > 200 and all(message.startswith("Attempted to load weight") for message in dropped)
    else:
        assert shown == dropped == []


CHUNK_TOKENS = 128  # tokens a step of a chunked engine reads: the longer prompts come in several chunks


def chunking(chunked: bool) -> dict:
    """An engine's overrides: chunked prefill of CHUNK_TOKENS a step, or each prompt in one step."""
    return {"enable_chunked_prefill": True, "max_num_batched_tokens": CHUNK_TOKENS} if chunked else {}


@dataclass
class Run:
    """One engine's run of the three prompts (:meth:`Engine.run` with ``kept`` and ``logprobs``)."""

    tokens: list
    blocks: list
    block_size: int
    kept: dict
    logprobs: list
    ranks: list
    priorities: dict
    groups: list  # each KV cache group's layers
    group_peaks: list  # [request] {group: the most blocks it held}


@pytest.fixture(scope="module")
def single_process(model_dir, prompts):
    """keepkv's single-process engine (TP=1, fp32) of a method at budget 0.3 over the three prompts,
    run once per module, whichever test asks first: ``single_process(method)`` -> :class:`Run`;
    ``single_process(method, chunked=True)``: with chunked prefill, :data:`CHUNK_TOKENS` a step."""
    runs = {}

    def run(method, chunked=False):
        if (method, chunked) not in runs:
            engine = Engine(model_dir, {"method": method, "budget": 0.3}, worker_extension_cls=KEPT, **chunking(chunked))
            tokens, blocks = engine.run(prompts, kept=True, logprobs=2)
            runs[method, chunked] = Run(tokens, blocks, engine.manager().block_size, engine.kept, engine.logprobs,
                                        engine.ranks, engine.priorities, engine.groups, engine.group_peaks)
            engine.close()
        return runs[method, chunked]

    return run


@pytest.mark.parametrize("method", SERVED)
def test_matches_hf_path_and_caps_blocks(model_dir, prompts, stock, hf_model, single_process, method):
    """Three unequal prompts in one batch: each request's greedy tokens are keepkv's Hugging Face
    path's for that prompt alone, and it never holds more blocks than its capacity bound, in each
    group of layers (layers whose budgets differ, PyramidKV's and the learned selection's trained
    split, are grouped with blocks of their own), and holds less than stock vLLM for the long
    prompts (blocks times the layers they serve)."""
    budget = 0.3
    run = single_process(method)
    tokens, block_size = run.tokens, run.block_size
    assert tokens != stock[0]  # the compression is real: stock vLLM answers otherwise
    paged = PagedCompression(hf_model.config, served(method), budget)
    layers = hf_model.config.num_hidden_layers
    assert sorted(layer for group in run.groups for layer in group) == list(range(layers))
    for prompt, got, peaks, stock_held in zip(prompts, tokens, run.group_peaks, stock[1]):
        assert got == hf_greedy(hf_model, prompt, method, budget)
        for group, held in peaks.items():
            assert held <= math.ceil(paged.capacity(len(prompt), run.groups[group]) / block_size)
        if len(prompt) > 2 * block_size:
            assert sum(held * len(run.groups[group]) for group, held in peaks.items()) < stock_held * layers


@pytest.mark.parametrize("method", ["pyramidkv", "snapkv+selection=learned"])
def test_layers_of_different_budgets_hold_blocks_of_their_own(hf_model, prompts, single_process, method):
    """PyramidKV's layer budgets and the learned selection's trained split: the engine groups the
    layers by budget (groups of one size, vLLM's rule), each group with a block table of its own, so
    the long prompt holds fewer block-layers than one table sized by its largest layer would."""
    budget = 0.3
    run = single_process(method)
    layers = hf_model.config.num_hidden_layers
    assert len(run.groups) > 1 and len({len(group) for group in run.groups}) == 1
    paged = PagedCompression(hf_model.config, served(method), budget)
    long = max(range(len(prompts)), key=lambda index: len(prompts[index]))
    one_table = math.ceil(paged.capacity(len(prompts[long])) / run.block_size) * layers
    assert sum(held * len(run.groups[group]) for group, held in run.group_peaks[long].items()) < one_table


def test_layer_groups_share_a_steps_due_compressions(model_dir, prompts, hf_model, monkeypatch):
    """The learned selection's trained split, its layers in groups with blocks of their own: every
    group's batch of a step holds the step's one list of due compressions, which the model's last
    layer empties (keepkv.paged_compress: the groups' compressions run as one batch)."""
    made = []
    batch = PagedCompression.batch

    def recording(self, *args, **kwargs):
        out = batch(self, *args, **kwargs)
        made.append((self, out))
        return out

    monkeypatch.setattr(PagedCompression, "batch", recording)
    engine = Engine(model_dir, {"method": "snapkv+selection=learned", "budget": 0.3})
    engine.run(prompts, new_tokens=40)
    groups = len(engine.groups)
    engine.close()
    assert groups > 1
    steps: dict = {}  # the step's list -> the compressions (groups) whose batch held it
    for paged, step in made:
        assert step.due == [] and step.layers == hf_model.config.num_hidden_layers  # the last layer ran them
        steps.setdefault(id(step.due), set()).add(id(paged))
    assert len(steps) * groups == len(made) and all(len(held) == groups for held in steps.values())


@pytest.mark.parametrize("method", SERVED)
def test_chunked_prefill_matches_hf_paths_chunked_prefill_and_frees_the_prompts_blocks(
    model_dir, prompts, hf_model, method, monkeypatch
):
    """vLLM's chunked prefill on, 128 tokens a step: the prompts come in pieces (the engine
    decides where), are compressed at their first decode step, and each request's greedy tokens
    are the Hugging Face path's for that prompt fed in the same pieces; a long prompt's blocks,
    held whole while it is read, are freed down to its capacity once it is compressed. The
    learned selection compresses each piece but the last to the prompt's budget (the Hugging
    Face path's ``start_prefill``): its blocks grow only to that budget plus one piece."""
    budget = 0.3
    pieces = {}  # first block -> the prompt's pieces, in tokens
    batch = PagedCompression.batch

    def recording(self, *args, **kwargs):
        made = batch(self, *args, **kwargs)
        for first, done, new, phase in zip(made.first_block, made.computed, made.query_lengths, made.phases):
            if phase == "chunk":
                pieces[first] = [*(pieces.get(first, []) if done else []), new]
        return made

    monkeypatch.setattr(PagedCompression, "batch", recording)
    engine = Engine(model_dir, {"method": method, "budget": budget}, enable_chunked_prefill=True, max_num_batched_tokens=128)
    tokens, blocks = engine.run(prompts)
    block_size = engine.manager().block_size
    engine.close()
    by_length = {sum(chunks): chunks for chunks in pieces.values()}
    paged = PagedCompression(hf_model.config, served(method), budget, chunked=True)
    smaller, layers = [], hf_model.config.num_hidden_layers
    for prompt, got, peak, last, peaks in zip(prompts, tokens, blocks, engine.last_blocks, engine.group_peaks):
        chunks = by_length[len(prompt)]
        assert got == hf_greedy(hf_model, prompt, method, budget, chunks=chunks)
        whole, capacity = math.ceil(len(prompt) / block_size), math.ceil(paged.capacity(len(prompt) + 1) / block_size)
        starts = [sum(chunks[:index]) for index in range(len(chunks))]
        reading = max(math.ceil((paged.reading(len(prompt), done) + new) / block_size) for done, new in zip(starts, chunks))
        assert reading == whole or paged.compresses_chunks  # the whole prompt while it is read, unless compressed
        assert peak <= max(reading, capacity) and (whole <= peak or paged.compresses_chunks)
        assert last <= capacity  # then its capacity
        # the most blocks each group of layers held (layers grouped by budget: each group's own)
        smaller.append(sum(held * len(engine.groups[group]) for group, held in peaks.items()) < whole * layers)
    assert max(len(chunks) for chunks in by_length.values()) > 2
    assert any(smaller) == paged.compresses_chunks  # a long prompt read chunk by chunk held fewer block-layers


@pytest.mark.parametrize("method", ["h2o", "keepkv"])
def test_keep_prompt_shares_prompt_blocks_and_matches_the_hf_path(model_dir, prompts, hf_model, method):
    """Prefix caching and chunked prefill on, prompts kept whole, 32 generated entries kept: a request's prompt blocks
    are reused by two later requests on the same 512-token prefix (vLLM's prefix-cache hit count),
    each request's 80 greedy tokens are the Hugging Face path's (decoding="keep_prompt") for its
    whole prompt, and none holds more blocks than prompt + budget + interval slots."""
    prefix = prompts[1][:512]
    asked = [prefix + prompts[2][:40], prefix + prompts[2][40:100], prefix + prompts[0]]
    engine = Engine(model_dir, {"method": method, "budget": 32, "keep_prompt": True}, enable_prefix_caching=True,
                    enable_chunked_prefill=True)  # vLLM's defaults
    first, first_blocks = engine.run(asked[:1], new_tokens=80)
    later, later_blocks = engine.run(asked[1:], new_tokens=80)
    block_size = engine.manager().block_size
    hits = dict(engine.cached_tokens)
    engine.close()
    for later_request in ("r0", "r1"):  # the second run's: on the first run's full prefix blocks
        assert hits[later_request] >= 512 // block_size * block_size
    paged = PagedCompression(hf_model.config, served(method), 32, keep_prompt=True)
    for prompt, got, held in zip(asked, first + later, first_blocks + later_blocks):
        assert got == hf_greedy(hf_model, prompt, method, 32, new_tokens=80, decoding="keep_prompt")
        assert held <= math.ceil(paged.capacity(len(prompt)) / block_size)


@pytest.fixture
def bound_threads(monkeypatch):
    """Three CPU workers' thread binding on this host (vLLM's default needs a NUMA node per worker)."""
    from keepkv.vllm.settings import BIND, thread_binding

    monkeypatch.setenv(BIND, thread_binding(3) or "auto")


@pytest.mark.parametrize("method, chunked", [
    *((method, False) for method in [*SERVED_METHODS, "snapkv+selection=learned+budgets=uniform",
                                     "snapkv+selection=learned"]),
    ("snapkv+selection=learned", True)])
def test_tensor_parallel_ranks_keep_their_heads_entries_as_one_process(model_dir, prompts, single_process, method,
                                                                       chunked, bound_threads):
    """TP=3 in fp32, one KV head and its three query heads per rank, no communication but vLLM's own
    (``chunked``: both engines read prompts in chunks, the learned selection's compressed chunk by chunk):
    after every step, the positions each rank holds in each layer, slot by slot, are the
    single-process engine's for that KV head, and the requests hold its blocks. TP=3 sums the heads'
    outputs in another order, so two runs may part at a rounding tie: the greedy tokens are the
    single process's, or the first that differs has its top two logits within 1e-4 there (and only
    the steps before it compare); a layer's head may keep other entries only where the single
    process ranked each entry that differs within 1e-4 of the others, at the compression of that
    step (from then on that head's entries are its own); the learned selection ranks its scores
    rounded to SCORE_STEP, so two scores within 1e-4 may round one step apart."""
    from keepkv.methods.learned import SCORE_STEP

    engine = Engine(model_dir, {"method": method, "budget": 0.3}, tensor_parallel_size=3,
                    worker_extension_cls=KEPT, **chunking(chunked))
    tokens, blocks = engine.run(prompts, kept=True)
    kept, ranks = engine.kept, engine.ranks
    engine.close()
    one = single_process(method, chunked)
    assert ranks == [(0, 1), (1, 1), (2, 1)] and one.ranks == [(0, 3)]
    assert blocks == one.blocks
    compared, ties = 0, []
    for index, (prompt, got, expected) in enumerate(zip(prompts, tokens, one.tokens)):
        first = next((step for step, (a, b) in enumerate(zip(got, expected)) if a != b), None)
        if first is not None:
            top, second = one.logprobs[index][first][:2]
            assert top - second < 1e-4, f"request {index} differs at token {first}: {got} against {expected}"
        parted = set()  # (layer, head) that kept other entries at a tie
        for generated in range(1, NEW_TOKENS + 1 if first is None else first + 2):  # the tokens before a step agree
            for layer, (mine, theirs) in enumerate(zip(kept[index, generated], one.kept[index, generated])):
                for head in range(len(theirs)):
                    if (layer, head) in parted or torch.equal(mine[head], theirs[head]):
                        compared += (layer, head) not in parted
                        continue
                    where = f"request {index}, {generated} tokens, layer {layer}, head {head}"
                    only_mine = set(mine[head].tolist()) - set(theirs[head].tolist())
                    only_theirs = set(theirs[head].tolist()) - set(mine[head].tolist())
                    assert only_mine and only_theirs, f"{where}: the same entries in other slots"
                    positions, priorities = one.priorities[layer, len(prompt) + generated - 2]  # this step's compression
                    rank = dict(zip(positions[head].tolist(), priorities[head].tolist()))
                    swapped = [rank[position] for position in only_mine | only_theirs]
                    rounding = SCORE_STEP if "selection=learned" in method else 0.0
                    assert max(swapped) - min(swapped) <= 1e-4 * max(1.0, abs(max(swapped))) + rounding, (
                        f"{where}: kept {sorted(only_mine)} for {sorted(only_theirs)}, ranked {swapped} in one process")
                    parted.add((layer, head))
                    ties.append(where)
    assert compared >= 2 * NEW_TOKENS * len(one.kept[0, 1]) * 3
    assert len(ties) <= 3, ties  # rare: a few of the 270 (request, layer, head) of a run


@pytest.mark.parametrize("chunked", [False, True])
def test_preempted_requests_finish_within_their_blocks(model_dir, prompts, monkeypatch, chunked):
    """KV memory for two grown requests and six in flight: the scheduler preempts (a resumed
    request is recomputed as a new prompt, on both sides; with chunked prefill its replay comes
    in pieces too), every request still finishes, and none ever holds more than its capacity's
    blocks."""
    from vllm.v1.core.sched.scheduler import Scheduler

    preemptions = []
    preempt = Scheduler._preempt_request
    monkeypatch.setattr(Scheduler, "_preempt_request", lambda self, *a, **k: preemptions.append(1) or preempt(self, *a, **k))
    short = [prompt[:100] for prompt in prompts[1:]] * 3  # 6 requests of 100 tokens
    engine = Engine(model_dir, {"method": "h2o", "budget": 300}, num_gpu_blocks_override=8, max_model_len=600,
                    max_num_batched_tokens=128 if chunked else 600, enable_chunked_prefill=chunked)
    tokens, blocks = engine.run(short, new_tokens=160)
    block_size = engine.manager().block_size
    engine.close()
    assert preemptions
    assert [len(answer) for answer in tokens] == [160] * 6
    assert max(blocks) <= math.ceil((300 + 1) / block_size)  # capacity_bound: the budget + the step's token


def test_preempted_requests_keeping_their_prompts_finish_within_their_blocks(model_dir, prompts, monkeypatch):
    """Prompts kept whole, prefix caching on, 6 requests of 100 prompt tokens (pairs of equal
    prompts: they share blocks) growing in 8 blocks: the scheduler preempts, and a resumed request
    recomputes its prompt and its generated tokens in one step. The worker keeps exactly the 100
    prompt tokens of every request as its prompt, a resumed one's too (its replayed generated
    tokens are compressed with the later ones); every request finishes, and none holds more than
    its capacity's blocks (the scheduler caps a resumed request at its replay's)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    preemptions = []
    preempt = Scheduler._preempt_request
    monkeypatch.setattr(Scheduler, "_preempt_request", lambda self, *a, **k: preemptions.append(1) or preempt(self, *a, **k))
    rows = []  # (phase, prompt, tokens held at the close) of every row the worker decodes
    batch = PagedCompression.batch

    def recorded(self, *args, **kwargs):
        made = batch(self, *args, **kwargs)
        rows.extend(row for row in zip(made.phases, made.prompt, made.closed) if row[0] != "chunk")
        return made

    monkeypatch.setattr(PagedCompression, "batch", recorded)  # the worker runs in this process
    short = [prompt[:100] for prompt in prompts[1:]] * 3
    engine = Engine(model_dir, {"method": "h2o", "budget": 64, "keep_prompt": True}, num_gpu_blocks_override=8,
                    max_model_len=600, max_num_batched_tokens=600, enable_prefix_caching=True)
    tokens, blocks = engine.run(short, new_tokens=160)
    block_size = engine.manager().block_size
    engine.close()
    assert preemptions
    assert {prompt for _, prompt, _ in rows} == {100}
    assert [closed for phase, _, closed in rows if phase == "close" and closed > 100], "no replay took generated tokens"
    assert [len(answer) for answer in tokens] == [160] * 6
    assert max(blocks) <= math.ceil((100 + 160 + 64 + 1) / block_size)


FAULT_NEW_TOKENS = 64


SHARED_METHODS = ["snapkv", "keydiff", "streamingllm", "window"]  # what share_prefix serves


@pytest.mark.parametrize("method, mode", [(method, mode) for mode in ("compressed", "kept-prompt") for method in SERVED_METHODS]
                         + [(method, "shared") for method in SHARED_METHODS])
def test_a_server_under_faults_stays_up_frees_its_blocks_and_answers_as_a_quiet_run(model_dir, prompts, monkeypatch,
                                                                                   hf_model, method, mode):
    """Eight requests of 60-420 prompt tokens at once on 6 blocks of 128 slots, prompts read in
    chunks of 64 (prefix caching on and a shared 256-token prefix when prompts are kept whole, or
    compressed chunk by chunk in chunks of 2 blocks, "shared"): the
    scheduler preempts; one request is aborted mid-prompt, one mid-answer. The engine stays up,
    every other request gets all its tokens, the KV cache is empty once they end, and each request
    never preempted answers as it does alone on the same engine afterwards. (A preempted request
    is recomputed from its tokens and compressed anew, so its answer may differ from a quiet
    run's: docs/serving.md.) Where the layers are grouped by budget (PyramidKV) a block holds one
    group's layers: the engine gets as many more blocks, the same bytes."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from keepkv.vllm.spec import engine_layer_groups

    preempted = set()
    preempt = Scheduler._preempt_request
    monkeypatch.setattr(Scheduler, "_preempt_request",
                        lambda self, request, *a, **k: preempted.add(request.request_id) or preempt(self, request, *a, **k))
    source = prompts[1]
    keep_prompt = mode != "compressed"
    if keep_prompt:  # the shared prefix, then each request's own tokens
        own = [source[300 + 20 * i: 300 + 20 * i + length] for i, length in enumerate((8, 160, 120, 16, 80, 40, 24, 60))]
        texts = [source[:256] + part for part in own]
        # 47 generated entries (+1 at a compressing step): what 32 + an interval of 16 held before
        # compressions kept interval - 1 below the budget, enough to make the scheduler preempt
        config = {"method": method, "budget": 47, "keep_prompt": True} | ({"share_prefix": 2} if mode == "shared" else {})
    else:
        texts = [source[17 * i: 17 * i + length] for i, length in enumerate((60, 420, 140, 300, 90, 260, 180, 120))]
        config = {"method": method, "budget": 200}  # requests grow past a block before they are compressed
    mid_prompt, mid_answer = "f1", "f2"  # f1: 420 tokens, or 160 past the shared prefix; 64 a step
    paged = PagedCompression(hf_model.config, served(method), config["budget"], keep_prompt=keep_prompt)
    groups = engine_layer_groups(paged, 600, 128)
    blocks = 6 * (len(groups) if groups else 1)  # 6 blocks of every layer's bytes
    engine = Engine(model_dir, config, num_gpu_blocks_override=blocks, max_model_len=600, enable_chunked_prefill=True,
                    max_num_batched_tokens=64, enable_prefix_caching=keep_prompt)
    try:
        llm_engine, core = engine.llm.llm_engine, engine.llm.llm_engine.engine_core.engine_core
        params = vllm.SamplingParams(temperature=0.0, max_tokens=FAULT_NEW_TOKENS, ignore_eos=True)
        names = [f"f{i}" for i in range(len(texts))]
        internal = {name: llm_engine.add_request(name, {"prompt_token_ids": text}, params)
                    for name, text in zip(names, texts)}
        aborted, outputs = set(), {}
        while llm_engine.has_unfinished_requests():
            for output in llm_engine.step():
                if output.finished:
                    outputs[output.request_id] = list(output.outputs[0].token_ids)
                elif output.request_id == mid_answer and len(output.outputs[0].token_ids) >= 5:
                    llm_engine.abort_request([mid_answer])
                    aborted.add(mid_answer)
            request = core.scheduler.requests.get(internal[mid_prompt])
            if request is not None and 0 < request.num_computed_tokens < request.num_prompt_tokens:
                llm_engine.abort_request([mid_prompt])
                aborted.add(mid_prompt)
        assert aborted == {mid_prompt, mid_answer}
        assert preempted, "the scheduler never preempted: the test no longer loads the engine"
        answered = [name for name in names if name not in aborted]
        assert {name: len(outputs.get(name, ())) for name in answered} == {name: FAULT_NEW_TOKENS for name in answered}
        assert core.scheduler.kv_cache_manager.usage == 0 and not any(m.req_to_blocks for m in engine.managers())
        quiet = [name for name in answered if internal[name] not in preempted]
        assert len(quiet) >= 2, (quiet, preempted)
        for name in quiet:  # the engine still serves: each request alone
            alone, _ = engine.run([texts[names.index(name)]], new_tokens=FAULT_NEW_TOKENS)
            assert outputs[name] == alone[0], name
        assert core.scheduler.kv_cache_manager.usage == 0
    finally:
        engine.close()


@pytest.fixture
def no_engine_core(monkeypatch):
    """Records every EngineCore started (in this process: multiprocessing is off here)."""
    from vllm.v1.engine.core import EngineCore

    started = []
    init = EngineCore.__init__
    monkeypatch.setattr(EngineCore, "__init__", lambda self, *a, **k: started.append(1) or init(self, *a, **k))
    return started


@pytest.mark.parametrize("overrides, message", [
    ({"enable_prefix_caching": True}, r"does not support prefix caching: a block shared .* \(--no-enable-prefix-caching"),
    ({"config": {"method": "cam", "budget": 0.3}}, "serves h2o, keepkv, keydiff, pyramidkv, snapkv, streamingllm, window"),
    ({"config": {"method": "snapkv", "budget": 0.0}}, "budget"),
    ({"config": {"method": "keepkv", "budget": 2}}, "budget 2 keeps 2 per layer and head, fewer than keepkv's 32"),
    ({"config": {"method": "snapkv", "budgett": 0.3}}, 'takes "method", "budget", "keep_prompt" and "share_prefix"'),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}},
     "does not support speculative decoding"),
    ({"tensor_parallel_size": 9}, r"does not support KV heads replicated over ranks: .* all-reduce of their scores"),
    ({"pipeline_parallel_size": 2}, r"does not support pipeline parallelism > 1: .*intermediate_tensors is not None"),
    ({"tensor_parallel_size": 3, "unbound": True}, r"3 CPU workers on 1 NUMA node\(s\): .* set VLLM_CPU_OMP_THREADS_BIND="),
    ({"enable_lora": True}, "does not support LoRA"),
    ({"kv_cache_dtype": "fp8"}, "does not support an fp8 KV cache"),
])
def test_rejects_unsupported_settings_before_any_worker_starts(model_dir, no_engine_core, overrides, message,
                                                               monkeypatch):
    """Refused where the engine's config is built, in one line (not inside a worker's traceback),
    naming the servable methods or the flag that turns a setting off; tensor parallelism on a host
    with fewer NUMA nodes than workers, while VLLM_CPU_OMP_THREADS_BIND is unset, names it."""
    from keepkv.vllm import SettingError, settings

    overrides = dict(overrides)
    if overrides.pop("unbound", False):
        monkeypatch.delenv(settings.BIND, raising=False)
        monkeypatch.setattr(settings, "memory_nodes", lambda: 1)
    config = overrides.pop("config", {"method": "snapkv", "budget": 0.3})
    with pytest.raises(SettingError, match=message) as raised:
        Engine(model_dir, config, **overrides)
    assert "\n" not in str(raised.value)
    assert not no_engine_core


def test_a_learned_scorer_of_another_model_is_refused_before_any_worker_starts(model_dir, no_engine_core, tmp_path):
    """The learned selection's scorer must have been trained on the served model: one line, naming
    what differs and how to train one, where the engine's config is built."""
    from transformers import LlamaConfig

    from keepkv.scorer import FEATURES, Scorer, config_key
    from keepkv.vllm import SettingError

    other = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=32)
    width = FEATURES["values+pairs"](16)
    tensors = {"mean": torch.zeros(2, 2, width), "std": torch.ones(2, 2, width), "weight": torch.zeros(2, 2, width),
               "bias": torch.zeros(2, 2)}
    path = Scorer("linear", "values+pairs", config_key(other), tensors).save(tmp_path / "other.pt")
    with pytest.raises(SettingError, match="trained on another model .*keepkv train-scorer") as raised:
        Engine(model_dir, {"method": f"snapkv+selection=learned+budgets=uniform+scorer={path}", "budget": 0.3})
    assert "\n" not in str(raised.value)
    assert not no_engine_core


def test_refuses_keepkv_settings_off_cpu(model_dir, no_engine_core, monkeypatch):
    """On another platform than CPU (CUDA: not built), keepkv settings are refused, not ignored."""
    from vllm.platforms import current_platform

    from keepkv.vllm import SettingError
    from keepkv.vllm.settings import engine_settings

    engine = type("Config", (), {"additional_config": {"keepkv": {"method": "snapkv", "budget": 0.3}}})()
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    with pytest.raises(SettingError, match="CPU build only.*CUDA design"):
        engine_settings(engine)
    assert engine_settings(type("Config", (), {"additional_config": {}})()) is None  # stock: untouched


@pytest.mark.parametrize("method, budget, keep_prompt", [("keepkv", 0.1, False), ("snapkv", 0.1, False),
                                                        ("snapkv", 256, True), ("keepkv", 64, True)])
def test_the_start_up_line_counts_slots_and_requests_against_stock(method, budget, keep_prompt):
    """What keepkv buys, from the spec vLLM builds: its slots, stock's tokens in the same bytes, and
    requests of each counted shape that fit at once (each capped at its capacity, in whole blocks),
    against stock's; a shape that gains nothing is named."""
    from keepkv.vllm.backend import VllmCpuKernel
    from keepkv.vllm.spec import KeepKVSpec

    from transformers import LlamaConfig

    smollm2 = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30)
    method = served(method)
    paged = PagedCompression(smollm2, method, budget, keep_prompt=keep_prompt, kernel=VllmCpuKernel())
    content = paged.content_bytes(64, torch.bfloat16)
    spec = KeepKVSpec(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.bfloat16, state_content_bytes=content,
                      method=method, budget=budget, num_layers=30, max_model_len=8192, keep_prompt=keep_prompt)
    line = spec.capacity_line(num_blocks=329)
    stock_tokens = 329 * 128 * content // 256  # vLLM's figures count its null block
    assert f"KV cache of {329 * 128:,} slots (stock vLLM would hold {stock_tokens:,} tokens" in line
    assert f"each slot also holds {content - 256} bytes" in line and "\n" not in line
    gains = []
    for prompt, generated in ((7680, 512), (1024, 1024)):
        held = min(prompt + generated, paged.capacity(prompt))
        mine, theirs = 328 // math.ceil(held / 128), stock_tokens / (prompt + generated)
        assert f"{mine:,} of a {prompt:,}-token prompt generating {generated:,} (stock {theirs:.2f})" in line
        gains.append(mine > theirs)
        assert (f"{prompt:,} + {generated:,}" in line.split("no gain for")[-1]) == (mine <= theirs)
    assert gains[1]  # a chat turn: more requests at once than stock in every mode
    assert gains[0] == (not keep_prompt)  # a long document's answer gains only when its prompt is compressed


@pytest.mark.parametrize("method", ["pyramidkv", "snapkv+selection=learned", "snapkv", "snapkv+selection=learned+budgets=uniform"])
@pytest.mark.parametrize("budget", [0.05, 0.1, 0.3, 64])
@pytest.mark.parametrize("block_size", [16, 128])
def test_layers_are_grouped_by_budget_in_groups_of_one_size(hf_model, method, budget, block_size):
    """Layers whose budgets differ are cut into groups of one size (vLLM pads groups to one size),
    every layer in one group, each group's layers of neighbouring budgets: the fewest groups whose
    blocks per request (each group holds its largest layer's, in whole blocks) are within
    GROUP_SLACK of a group per layer's. A method whose layers keep one budget stays in one group
    (())."""
    from keepkv.vllm.spec import GROUP_SLACK, layer_groups

    paged = PagedCompression(hf_model.config, served(method), budget)
    layers, prompt = hf_model.config.num_hidden_layers, 1024
    needed = [paged.capacity(prompt, (layer,)) for layer in range(layers)]
    groups = layer_groups(paged, prompt, block_size)
    if len(set(needed)) == 1:
        assert groups == ()
        return

    def blocks(cut):
        return sum(len(group) * math.ceil(max(needed[layer] for layer in group) / block_size) for group in cut)

    fewest = blocks([[layer] for layer in range(layers)])
    cut = groups or (tuple(range(layers)),)
    assert sorted(layer for group in cut for layer in group) == list(range(layers))
    assert len({len(group) for group in cut}) == 1 and blocks(cut) <= (1 + GROUP_SLACK) * fewest
    ranges = sorted((min(needed[layer] for layer in group), max(needed[layer] for layer in group)) for group in cut)
    assert all(high <= low for (_, high), (low, _) in zip(ranges, ranges[1:]))  # neighbouring budgets
    order = sorted(range(layers), key=lambda layer: (needed[layer], layer))
    for count in [count for count in range(1, len(cut)) if layers % count == 0]:  # fewer groups hold more
        size = layers // count
        assert blocks([order[start: start + size] for start in range(0, layers, size)]) > (1 + GROUP_SLACK) * fewest


def test_a_spec_of_another_layer_group_never_merges_and_the_line_counts_every_group():
    """Specs of two layer groups: merging them raises AssertionError (vLLM's sign for "a group of its
    own") and they are not one type; a group's capacity is its largest layer's; the start-up line
    (the first group's manager logs it) counts a request's blocks in every group, and stock's tokens
    in the bytes of one group's layers."""
    from keepkv.vllm.backend import VllmCpuKernel
    from keepkv.vllm.spec import KeepKVSpec, layer_groups

    from transformers import LlamaConfig

    smollm2 = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30)
    method = served("pyramidkv")
    paged = PagedCompression(smollm2, method, 0.1, kernel=VllmCpuKernel())
    groups = layer_groups(paged, 4096)
    assert len(groups) > 1
    content = paged.content_bytes(64, torch.bfloat16)
    specs = [KeepKVSpec(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.bfloat16, state_content_bytes=content,
                        method=method, budget=0.1, num_layers=30, max_model_len=8192, layer_groups=groups, group=group)
             for group in range(len(groups))]
    with pytest.raises(AssertionError):
        KeepKVSpec.merge(specs[:2])
    assert KeepKVSpec.merge([specs[1], specs[1]]) == specs[1]
    assert not specs[0].is_uniform_with_collection({"a": specs[0], "b": specs[1]})
    assert specs[0].is_uniform_with_collection({"a": specs[0], "b": specs[0]})
    for spec, group in zip(specs, groups):
        assert spec.capacity_tokens(4096) == max(paged.capacity(4096, (layer,)) for layer in group) <= paged.capacity(4096)
    assert min(spec.capacity_tokens(4096) for spec in specs) < paged.capacity(4096)
    line = specs[0].capacity_line(num_blocks=329)
    size = len(groups[0])
    stock_tokens = 329 * 128 * content * size // (256 * 30)
    assert f"layers in {len(groups)} groups of {size} with blocks of their own" in line
    assert f"KV cache of {329 * 128:,} slots, each of one group's {size} layers (" in line
    assert f"(stock vLLM would hold {stock_tokens:,} tokens" in line
    for prompt, generated in ((7680, 512), (1024, 1024)):
        blocks = sum(math.ceil(min(prompt + generated, paged.capacity(prompt, group)) / 128) for group in groups)
        assert f"{328 // blocks:,} of a {prompt:,}-token prompt generating {generated:,}" in line


def test_the_start_up_line_gives_each_ranks_figures_and_the_total():
    """Under tensor parallelism every rank holds the same blocks for its own KV heads: the line says
    how many ranks, the heads each holds, each rank's KV bytes and all ranks' together, then the
    slots and requests at once that every rank's blocks give."""
    from keepkv.vllm.backend import VllmCpuKernel
    from keepkv.vllm.spec import KeepKVSpec

    from transformers import LlamaConfig

    smollm2 = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30)
    paged = PagedCompression(rank_config(smollm2, 3, 1), served("snapkv"), 0.1, kernel=VllmCpuKernel())
    content = paged.content_bytes(64, torch.bfloat16)
    spec = KeepKVSpec(block_size=128, num_kv_heads=1, head_size=64, dtype=torch.bfloat16, state_content_bytes=content,
                      method=served("snapkv"), budget=0.1, num_layers=30, max_model_len=8192, tensor_parallel_size=3)
    rank_bytes = 329 * 30 * 128 * content  # blocks x layers x a block's slots of one KV head
    line = spec.capacity_line(num_blocks=329)
    assert (f"keepkv: snapkv+interval=16 at budget 0.1, tensor parallel over 3 ranks, each holding 1 of the model's "
            f"3 KV heads in {rank_bytes / 2**20:,.1f} MiB of KV cache ({3 * rank_bytes / 2**20:,.1f} MiB on all 3); "
            f"on every rank: KV cache of {329 * 128:,} slots") in line
    single = KeepKVSpec(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.bfloat16, state_content_bytes=content,
                        method=served("snapkv"), budget=0.1, num_layers=30, max_model_len=8192)
    assert line.split("requests at once: ")[1] == single.capacity_line(num_blocks=329).split("requests at once: ")[1]


def test_keepkv_serve_knows_the_flags_it_reads():
    """The vLLM flags keepkv serve refuses, adds or reads (keepkv.vllm.serve) are vLLM's server's."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from keepkv.vllm import serve

    known = set(make_arg_parser(FlexibleArgumentParser())._option_string_actions)
    read = [*serve.SPECULATIVE, *serve.PARALLEL, *serve.COMPILATION, *serve.OFF_BY_DEFAULT, "--enable-lora",
            "--kv-cache-dtype", "--served-model-name", "--enable-prefix-caching", "--enable-chunked-prefill",
            "--additional-config", "--host", "--port", "--model"]
    assert [flag for flag in read if flag not in known] == []


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _stop(process) -> None:
    """Stop a process started in its own session, and its children, by its PID."""
    import signal
    import subprocess

    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


class Server:
    """`keepkv serve` on 127.0.0.1 with ``flags`` (vLLM's multiprocessing on, no VLLM_CPU_KVCACHE_SPACE
    given, and neither are the environment's names in ``unset``), its output in ``log``: a context
    that waits until it answers (``deadline`` s) and stops it, children included."""

    def __init__(self, model_dir, flags, log, unset=(), deadline=300):
        self.model_dir, self.flags, self.log_path, self.deadline = model_dir, flags, log, deadline
        self.unset = {"VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING", *unset}
        self.port = _free_port()

    def __enter__(self):
        import subprocess
        import sys
        import time
        import urllib.request

        env = {name: value for name, value in os.environ.items() if name not in self.unset}
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "keepkv.cli", "serve", "--model", self.model_dir, *self.flags,
             "--host", "127.0.0.1", "--port", str(self.port)],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.started = time.monotonic()
        try:
            while True:
                assert self.process.poll() is None, self.log_path.read_text()[-3000:]
                assert time.monotonic() < self.started + self.deadline, f"server did not start in {self.deadline} s"
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5)
                    break
                except OSError:
                    time.sleep(2)
        except BaseException:
            self.__exit__()
            raise
        self.start_seconds = time.monotonic() - self.started
        return self

    def chat(self, messages, max_tokens, **extra) -> dict:
        """The server's greedy reply (JSON) to a chat request of ``messages``."""
        import urllib.request

        body = json.dumps({"model": os.path.basename(self.model_dir), "messages": messages, "max_tokens": max_tokens,
                           "temperature": 0, "ignore_eos": True, **extra}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        return json.load(urllib.request.urlopen(request, timeout=300))

    def __exit__(self, *error):
        import time

        time.sleep(1)  # the relay's "ready" line follows the server's own
        _stop(self.process)
        self.log.close()
        self.logged = self.log_path.read_text()


def test_keepkv_serve_answers_a_chat_request_as_stock(model_dir, hf_model, tmp_path):
    """`keepkv serve` on 127.0.0.1 (vLLM's CPU build, multiprocessing on, no VLLM_CPU_KVCACHE_SPACE
    given, eager by keepkv serve's default): one chat request to the model's name, greedy, answered
    with the tokens of the full cache: a short chat prompt is under snapkv's budget floor at 0.1, so
    it is not compressed (README "Serving"). The log says what the cache holds and when the
    server is ready."""
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with Server(model_dir, ["--method", "snapkv", "--budget", "0.1", "--dtype", "float32", "--max-model-len", "1024"],
                tmp_path / "server.log") as server:
        reply = server.chat(messages, 12)
    logged = server.logged
    assert "--enforce-eager" in logged.splitlines()[0]  # keepkv serve's command line
    assert "keepkv: snapkv+interval=16 at budget 0.1: KV cache of " in logged and "requests at once: " in logged
    assert "keepkv serve: ready after " in logged
    text = reply["choices"][0]["message"]["content"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(rendered, add_special_tokens=False).input_ids  # as vLLM's chat endpoint does
    assert PagedCompression(hf_model.config, "snapkv", 0.1).kept(len(prompt)) >= len(prompt)  # under the floor
    stock = hf_greedy(hf_model, prompt, "full", 1.0, new_tokens=12)
    assert text == tokenizer.decode(stock, skip_special_tokens=True)
    assert "Paris" in text


TENSOR_PARALLEL_QUESTIONS = 6  # chat prompts asked of both engines at TP=3


def served_bf16_as_stock() -> str:
    """"bfloat16" where keepkv's engines run vLLM's own bf16 kernel (keepkv.vllm.backend.engine_isa),
    else (a CPU with AMX: stock takes "amx", keepkv "vec") "float32", so that keepkv and a stock
    engine in other processes compare on one kernel."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return "bfloat16" if _get_attn_isa(torch.bfloat16, 128, 64) != "amx" else "float32"


def test_keepkv_serve_tensor_parallel_answers_under_the_floor_as_stock(model_dir, chat_prompts, prompts, tmp_path,
                                                                       bound_threads, monkeypatch):
    """`keepkv serve --tensor-parallel-size 3` in bf16 on this one-node host, VLLM_CPU_OMP_THREADS_BIND
    unset (keepkv serve sets a binding that starts three workers): its start-up line gives the
    per-rank and total figures, a long prompt (compressed) is answered, and chat prompts under
    keepkv's budget floor at 0.1, each asked alone, get the greedy tokens of stock vLLM at TP=3 for
    that prompt alone in bf16 (TP=3 sums the heads in another order than TP=1: judged at the same TP;
    fp32 on a CPU with AMX, where stock's workers run vLLM's "amx" kernel in bf16 and keepkv's "vec")."""
    from transformers import AutoTokenizer

    from keepkv.vllm.settings import BIND

    new_tokens = 16
    asked = chat_prompts[:TENSOR_PARALLEL_QUESTIONS]
    dtype = served_bf16_as_stock()
    stock = Engine(model_dir, dtype=dtype, tensor_parallel_size=3, max_model_len=1024, enable_chunked_prefill=True,
                   max_num_batched_tokens=None)  # keepkv serve's defaults
    expected = [stock.run([prompt], new_tokens)[0][0] for prompt in asked]
    stock.close()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    long = tokenizer.decode(prompts[1], skip_special_tokens=True)
    with Server(model_dir, ["--method", "keepkv", "--budget", "0.1", "--dtype", dtype, "--max-model-len", "1024",
                            "--tensor-parallel-size", "3"], tmp_path / "server.log", unset=[BIND], deadline=600) as server:
        compressed = server.chat([{"role": "user", "content": long}], new_tokens, return_token_ids=True)
        replies = [server.chat([{"role": "user", "content": question}], new_tokens, return_token_ids=True)
                   for question in QUESTIONS[:TENSOR_PARALLEL_QUESTIONS]]
    logged = server.logged
    assert f"{BIND}=" in logged.splitlines()[0]  # keepkv serve's command line: the binding it set
    assert ("tensor parallel over 3 ranks, each holding 1 of the model's 3 KV heads in " in logged
            and " MiB on all 3); on every rank: KV cache of " in logged)
    assert len(compressed["choices"][0]["token_ids"]) == new_tokens
    assert [reply["prompt_token_ids"] for reply in replies] == asked
    assert [reply["choices"][0]["token_ids"] for reply in replies] == expected


def test_readme_serving_block_runs_as_a_script(tmp_path):
    """docs/serving.md "How to run"'s Python block, saved as a script and run as one, with vLLM's
    multiprocessing on (its engine runs in a spawned process: the block needs its __main__ guard)."""
    import subprocess
    import sys

    readme = open(os.path.join(os.path.dirname(__file__), "..", "docs", "serving.md")).read()
    block = next(part.split("```")[0] for part in readme.split("```python\n") if "from vllm" in part.split("```")[0])
    assert 'if __name__ == "__main__":' in block
    (tmp_path / "serve_readme.py").write_text(block)
    env = {name: value for name, value in os.environ.items() if name != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    done = subprocess.run([sys.executable, "serve_readme.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip()


def test_the_serving_bench_counts_the_prompt_tokens_an_engine_computes(model_dir, prompts):
    """python -m keepkv.vllm.bench's count of prompt tokens computed, on real engines: with prefix
    caching on it is every prompt token less vLLM's own prefix-cache hits (no preemption here), and
    a method compressing prompts (prefix caching off) computes every prompt token."""
    from keepkv.vllm.bench import run_engine

    document = prompts[1][:384]
    asked = [document + prompts[2][i * 20 : (i + 1) * 20] for i in range(3)]
    total = sum(map(len, asked))
    stock = run_engine(model_dir, asked, 4, 16, None, prefix_caching=True)
    assert stock["prefix_cache_hit_tokens"] >= 2 * 256  # the later two found the document's full blocks
    assert stock["prompt_tokens_computed"] == total - stock["prefix_cache_hit_tokens"]
    assert len(asked[0]) <= stock["prompt_tokens_computed"] <= total
    compressing = run_engine(model_dir, asked, 4, 16, {"method": "snapkv", "budget": 0.5})
    assert compressing["prompt_tokens_computed"] == total
    # --repeats: the same workload again on the same engine, its prefix cache reset in between
    again = run_engine(model_dir, asked, 4, 16, None, prefix_caching=True, repeats=3)
    assert [run["prompt_tokens_computed"] for run in again["repeats"]] == [stock["prompt_tokens_computed"]] * 3
    assert [run["steps"] for run in again["repeats"]] == [stock["steps"]] * 3
    assert again["tokens_per_s"] == sorted(run["tokens_per_s"] for run in again["repeats"])[1]


SHARE = 2  # blocks of a chunk: 256 tokens, compressed to 128 entries per layer and head


def shared_document_engine(model_dir, **overrides):
    return Engine(model_dir, {"method": "snapkv", "budget": 64, "share_prefix": SHARE}, enable_prefix_caching=True,
                  enable_chunked_prefill=True, max_num_batched_tokens=200, **overrides)


def free_blocks(engine) -> int:
    return engine.llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def test_a_shared_document_is_compressed_once_and_read_from_the_prefix_cache(model_dir, prompts):
    """share_prefix=2, prompts read in steps of 200 tokens (steps that cross chunk ends): a request on
    a 600-token document (two whole chunks of 256 tokens, then a tail of 88 and its question)
    leaves the chunks in the prefix cache; two later requests on the same document skip both
    chunks' 512 tokens (vLLM's hit count) and hold fewer blocks than stock vLLM would for their
    prompt; each answers as a fresh engine's request on its prompt alone; a document sharing only
    its first chunk finds only that one; and every block is free once they end."""
    document, other = prompts[1][:600], prompts[1][:256] + prompts[2][:344]
    asked = [document + prompts[2][i * 30 : (i + 1) * 30] for i in range(3)] + [other + prompts[0]]
    engine = shared_document_engine(model_dir)
    total = free_blocks(engine)
    first, _ = engine.run(asked[:1], new_tokens=40)
    later, later_blocks = engine.run(asked[1:3], new_tokens=40)
    later_hits = dict(engine.cached_tokens)
    another, _ = engine.run(asked[3:], new_tokens=40)
    block_size = engine.manager().block_size
    assert free_blocks(engine) == total and not engine.manager().req_to_blocks
    assert engine.cached_tokens["r0"] == 256  # the other document shares the first chunk only
    engine.close()
    assert later_hits == {"r0": 512, "r1": 512}
    for held, prompt in zip(later_blocks, asked[1:3]):
        assert held < math.ceil(len(prompt) / block_size)
    fresh = shared_document_engine(model_dir)
    for prompt, got in zip(asked, first + later + another):
        alone, _ = fresh.run([prompt], new_tokens=40)
        assert got == alone[0]
    fresh.close()


def test_the_later_requests_skip_the_documents_chunks(model_dir, prompts):
    """Two runs on the same two documents of two whole chunks, each request's hits counted by vLLM:
    the second run's requests read no document token (512 of 512 from the prefix cache), also
    where the chunks were compressed in the first run's last steps (its requests end at their
    first token)."""
    documents = [prompts[1][:512], prompts[1][150:662]]  # 727 tokens: two documents from token 0 and 150
    asked = [document + prompts[2][:20] for document in documents]
    engine = shared_document_engine(model_dir)
    engine.run(asked, new_tokens=1)
    engine.run(asked, new_tokens=8)
    hits = dict(engine.cached_tokens)
    engine.close()
    assert hits == {"r0": len(documents[0]), "r1": len(documents[1])} == {"r0": 512, "r1": 512}


def test_a_document_evicted_from_the_prefix_cache_is_recomputed(model_dir, prompts):
    """Six blocks of KV cache: a request on a second document evicts the first document's chunks,
    and a request on the first document again reads it anew (fewer hits than its chunks) and answers
    as a fresh engine's request."""
    documents = [prompts[1][:560], prompts[1][150:710]]
    asked = [documents[0] + prompts[2][:20], documents[1] + prompts[2][:20], documents[0] + prompts[2][20:40]]
    engine = shared_document_engine(model_dir, num_gpu_blocks_override=6, max_model_len=640)
    answers = [engine.run([prompt], new_tokens=16)[0][0] for prompt in asked]
    hits = engine.cached_tokens["r0"]
    engine.close()
    assert hits < 512
    fresh = shared_document_engine(model_dir)
    assert fresh.run(asked[2:], new_tokens=16)[0][0] == answers[2]
    fresh.close()


def test_tensor_parallel_ranks_share_compressed_chunks_as_one_process(model_dir, prompts, bound_threads):
    """TP=3 (one KV head per rank) with share_prefix: each rank compresses its head's chunks into the
    scheduler's one block table, a second request on the document skips both chunks, and both
    requests' greedy tokens are the single process's, or part from them only at a near tie (top two
    logits within 1e-4 in one process: TP sums the heads' outputs in another order)."""
    document = prompts[1][:600]
    asked = [document + prompts[2][i * 30 : (i + 1) * 30] for i in range(2)]
    runs = {}
    for ranks in (1, 3):
        engine = shared_document_engine(model_dir, tensor_parallel_size=ranks)
        tokens, logprobs = [], []
        for prompt in asked:
            tokens += engine.run([prompt], new_tokens=24, logprobs=2)[0]
            logprobs += engine.logprobs
        runs[ranks] = (tokens, logprobs, engine.cached_tokens["r0"])
        engine.close()
    assert runs[1][2] == runs[3][2] == 512
    for request, (got, expected) in enumerate(zip(runs[3][0], runs[1][0])):
        first = next((step for step, (a, b) in enumerate(zip(got, expected)) if a != b), None)
        if first is not None:
            top, second = runs[1][1][request][first][:2]
            assert top - second < 1e-4, f"request {request} differs at token {first}: {got} against {expected}"
