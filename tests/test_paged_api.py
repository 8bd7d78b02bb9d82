"""What the paged adapter may touch (docs/architecture.md, "The paged adapter"): a method's declared
per-entry extras are the ones a cache's layers get; the adapter writes no field of a cache or store
(only their public methods do); the methods it uses refuse what they cannot take."""

import math
import sys
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import keepkv
import keepkv.paged as paged_module
import keepkv.reconstruction
from keepkv import CompressedCache
from keepkv.attention import StepStats
from keepkv.methods import MERGES, METHODS, SELECTIONS
from keepkv.methods.base import Extra
from keepkv.paged import SERVED_METHODS, PagedCompression
from keepkv.store import LayerStore

from helpers import with_scorer
from conftest import char_tokenizer
from test_paged import CONFIG, Engine, tokens


def builds(spec: str) -> bool:
    """Whether ``spec`` is a method (test_contract checks the pairs that are refused)."""
    try:
        return bool(keepkv.get_method(spec))
    except ValueError:
        return False


VARIANTS = [
    *METHODS, *(spec for s in SELECTIONS for m in MERGES if builds(spec := f"keepkv+selection={s}+merge={m}")),
    "snapkv+merge=zip", "snapkv+merge=keepkv", "h2o+interval=3", "keepkv+interval=3",
    "keepkv+selection=ema+prefill_order=merge_first+protect=0+max_value_change=None+min_mass=0",
]


@pytest.fixture(scope="module")
def model():
    """Two layers, 6 query heads over 2 KV heads: a GQA group (3) unlike the KV head count."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, initializer_range=0.2)
    return LlamaForCausalLM(config).eval()


def added_extras(model, method) -> list[dict[str, Extra]]:
    """Each layer's per-entry extras after a prefill (with the reconstruction passes a method asks
    for) and two decode steps of a CompressedCache: name -> Extra(fill, dtype, trailing), in order."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 40), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    cache = CompressedCache(model.config, method, 8)
    with keepkv.enabled(model), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a tiny budget on purpose
        keepkv.reconstruction.prefill(model, char_tokenizer(), cache, ids, mask, chat=False)
        for _ in range(2):
            mask = torch.cat([mask, mask[:, -1:]], -1)
            positions = mask.sum(-1, keepdim=True) - 1
            model(input_ids=ids[:, -1:], attention_mask=mask, position_ids=positions, past_key_values=cache)
    return [{name: Extra(layer.extra_fill[name], tensor.dtype, tuple(tensor.shape[3:]))
             for name, tensor in layer.extras.items()} for layer in cache.layers]


@pytest.mark.parametrize("spec", VARIANTS)
def test_declared_extras_are_those_a_cache_adds(model, spec):
    method = keepkv.get_method(with_scorer(spec, model.config))
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    declared = method.entry_extras(group)
    for layer in added_extras(model, method):
        assert list(layer.items()) == list(declared.items()), spec


@pytest.mark.parametrize("spec", [*SERVED_METHODS, "snapkv+merge=keepkv"])
def test_the_paged_layout_is_the_declared_one(spec):
    paged = PagedCompression(CONFIG, spec, 0.5)
    declared = paged.method.entry_extras(CONFIG.num_attention_heads // CONFIG.num_key_value_heads)
    assert paged.extras == {name: extra.trailing for name, extra in declared.items()}
    assert paged.extra_fill == {name: extra.fill for name, extra in declared.items()}
    assert paged.meta_words == 1 + paged.biased + sum(math.prod(extra.trailing) for extra in declared.values())
    assert paged.biased == (paged.method.merging.name != "none")  # a merge's votes: the bias word and key words


class _Watched:
    """Mutations of a cache's layer list or a store's state dict, noted when keepkv.paged makes them."""

    def _note(self, what):
        module = sys._getframe(2).f_globals.get("__name__", "")
        if module.startswith("keepkv.paged"):
            self.writes.append(f"keepkv.paged {what}")


def watched(base):
    methods = ("__setitem__", "__delitem__", "append", "extend", "insert", "pop", "clear", "update", "setdefault")

    def wrap(name):
        def method(self, *args, **kwargs):
            self._note(f"calls {base.__name__}.{name}")
            return getattr(base, name)(self, *args, **kwargs)
        return method

    return type(f"Watched{base.__name__}", (_Watched, base), {n: wrap(n) for n in methods if hasattr(base, n)})


@pytest.fixture
def paged_writes(monkeypatch):
    """The fields of a cache, a store or a step's statistics that keepkv.paged assigns or mutates."""
    writes = []
    kinds = {list: watched(list), dict: watched(dict)}

    def guard(cls, containers):
        plain = cls.__setattr__

        def guarded(self, name, value):
            module = sys._getframe(1).f_globals.get("__name__", "")
            if module.startswith("keepkv.paged"):  # the adapter and its parts (paged_slots, paged_requests, ...)
                writes.append(f"keepkv.paged assigns {cls.__name__}.{name}")
            if name in containers and type(value) in kinds:  # watch the container for item writes
                value = kinds[type(value)](value)
                value.writes = writes
            plain(self, name, value)

        monkeypatch.setattr(cls, "__setattr__", guarded)

    guard(CompressedCache, ("layers",))
    guard(LayerStore, ("state",))
    guard(StepStats, ())
    return writes


def test_the_guard_sees_a_write_from_the_adapter(paged_writes):
    store = LayerStore(0)
    cache = CompressedCache(CONFIG, "snapkv", 4)
    scope = vars(paged_module) | {"store": store, "cache": cache}
    exec("store.pending = 1\nstore.state.update(x=1)\ncache.layers[0] = store", scope)
    assert paged_writes == ["keepkv.paged assigns LayerStore.pending", "keepkv.paged calls dict.update",
                            "keepkv.paged calls list.__setitem__"]


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("method", ["snapkv", "keepkv", "keepkv+interval=3"])
def test_the_adapter_writes_no_field_of_a_cache_or_store(paged_writes, method, chunked):
    """Prompts (in one step, or in chunks closed at the first decode step) and decode steps,
    compressing and not, with method state filed per request: only public methods write."""
    generator = torch.Generator().manual_seed(0)
    paged = PagedCompression(CONFIG, method, 0.5, chunked=chunked)
    engine = Engine(paged)
    prompts = {0: tokens(generator, 11), 1: tokens(generator, 7)}
    if chunked:
        engine.step({0: tuple(t[:6] for t in prompts[0])}, prompts={0: 11})
        engine.step({0: tuple(t[6:] for t in prompts[0]), 1: prompts[1]}, prompts={1: 7})
    else:
        engine.step(prompts)
    for _ in range(4):
        engine.step({0: tokens(generator, 1), 1: tokens(generator, 1)})
    assert not paged_writes, paged_writes


def test_a_store_resumes_a_request_s_state_and_pending_count():
    keys = torch.randn(1, CONFIG.num_key_value_heads, 3, 8)
    core = {"keys": keys, "values": keys, "bias": torch.zeros(keys.shape[:3]),
            "positions": torch.arange(3).expand(keys.shape[:3])}
    store = LayerStore.from_entries(1, core, {}, seen=3, real_seen=torch.tensor([3]), binary=True)
    store.resume(state={"steps": 2}, pending=1)
    store.resume(state=None)  # None leaves a field as it is
    assert (store.state, store.pending) == ({"steps": 2}, 1)
