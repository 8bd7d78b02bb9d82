"""The method contract (docs/architecture.md): every method's outputs equal its recorded reference,
and no method writes a store field.

The reference logits (tests/fixtures/contract/, one file per variant) are exact (1e-6) on the kind
of CPU that recorded them. Elsewhere torch's kernels use other vector widths and their float sums
round differently (within 1.9e-5 between an AVX512 and an AVX2 host, every greedy token the same),
so there the logits are compared to 1e-4 and the greedy tokens exactly: a changed decision still
fails."""

import functools
import inspect
import sys
import traceback
import warnings
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import keepkv
import keepkv.reconstruction

from fixtures import contract_golden as golden


def tolerance(reference) -> float:
    """Absolute tolerance of the logits: exact where this CPU is of the recording's kind."""
    return 1e-6 if reference["cpu_capability"] == golden.cpu_capability() else 1e-4


def test_every_reference_is_a_listed_variant_with_every_cell():
    recorded = sorted(file.stem for file in golden.FOLDER.glob("*.json"))
    assert set(recorded) <= set(golden.VARIANTS), f"references of no listed variant: {set(recorded) - set(golden.VARIANTS)}"
    cells = {golden.cell(kind, budget) for kind in golden.MODELS for budget in golden.BUDGETS}
    for spec in recorded:
        assert set(golden.load(spec)["logits"]) == cells, spec


@pytest.mark.parametrize("kind", golden.MODELS)
@pytest.mark.parametrize("spec", golden.VARIANTS)
def test_logits_equal_the_reference(kind, spec):
    from conftest import tiny_model

    reference = golden.load(spec)
    if reference is None:
        pytest.skip(f"{spec} has no reference yet: record it with python tests/fixtures/contract_golden.py --add-missing")
    if reference["torch"] != str(torch.__version__):
        pytest.skip(f"{spec}'s reference was made with torch {reference['torch']}, this is {torch.__version__}")
    model = tiny_model(kind, layers=3)
    for budget in golden.BUDGETS:
        expected = reference["logits"][golden.cell(kind, budget)]
        got = golden.run(model, spec, budget)
        assert got.shape == expected.shape
        assert torch.equal(got.argmax(-1), expected.argmax(-1)), f"{kind} {spec} budget={budget}: greedy tokens"
        torch.testing.assert_close(got, expected, rtol=0, atol=tolerance(reference), msg=f"{kind} {spec} budget={budget}")


def test_a_variant_without_a_reference_is_skipped_not_failed(tmp_path, monkeypatch):
    monkeypatch.setattr(golden, "FOLDER", tmp_path)
    with pytest.raises(pytest.skip.Exception, match="contract_golden.py --add-missing"):
        test_logits_equal_the_reference("llama-gqa", "h2o")


def test_the_store_tensors_are_read_only(gqa_model):
    cache = keepkv.CompressedCache(gqa_model.config, "h2o", 8)
    with keepkv.enabled(gqa_model), torch.no_grad():
        gqa_model(torch.randint(3, 100, (1, 20)), past_key_values=cache)
    layer = cache.layers[0]
    for name in ("keys", "values", "bias", "positions", "extras", "extra_fill"):
        with pytest.raises(AttributeError):
            setattr(layer, name, getattr(layer, name))
    with pytest.raises(TypeError):
        layer.extras["score"] = torch.zeros_like(layer.bias)


class StoreGuard(TorchDispatchMode):
    """Fails on what a method may not do to a store: assign one of its attributes (from a method's or
    the merge arithmetic's code), or write one of its tensors in place from anywhere but the store's
    own methods (``LayerStore.keep``, ``merge_into``, ``overwrite``, ...). A write is an operation
    whose schema marks an argument as written (``add_``, ``copy_``, ``scatter_``, ``out=``) and
    whose storage is one of a live store's tensors or buffers."""

    def __init__(self, monkeypatch):
        super().__init__()
        from keepkv.store import LayerStore

        self.stores, self.inside, self.found = weakref.WeakSet(), 0, []
        guard = self
        plain = object.__setattr__

        def assign(store, name, value):
            module = sys._getframe(1).f_globals.get("__name__", "")
            if module.startswith(("keepkv.methods", "keepkv.merging")):
                guard.found.append(f"{module} assigns layer.{name}")
            plain(store, name, value)

        def register(init):
            def registered(store, *args, **kwargs):
                guard.stores.add(store)
                return init(store, *args, **kwargs)
            return registered

        def trusted(method):
            @functools.wraps(method)
            def run(*args, **kwargs):
                guard.inside += 1
                try:
                    return method(*args, **kwargs)
                finally:
                    guard.inside -= 1
            return run

        for name, member in list(vars(LayerStore).items()):
            if name in ("__setattr__", "__init__") or not callable(getattr(member, "__func__", member)):
                continue
            if isinstance(member, (classmethod, staticmethod)):
                monkeypatch.setattr(LayerStore, name, type(member)(trusted(member.__func__)))
            elif inspect.isfunction(member):
                monkeypatch.setattr(LayerStore, name, trusted(member))
        monkeypatch.setattr(LayerStore, "__init__", register(trusted(LayerStore.__init__)))
        monkeypatch.setattr(LayerStore, "__setattr__", assign)

    def _store_storages(self) -> set[int]:
        return {tensor.untyped_storage().data_ptr() for store in list(self.stores)
                for tensor in (*store._tensors.values(), *store.buffers.values())}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.inside:
            written = []
            for index, argument in enumerate(func._schema.arguments):
                if argument.alias_info is not None and argument.alias_info.is_write:
                    value = args[index] if index < len(args) else kwargs.get(argument.name)
                    written += value if isinstance(value, (list, tuple)) else [value]
            written = [t for t in written if isinstance(t, torch.Tensor)]
            if written and {t.untyped_storage().data_ptr() for t in written} & self._store_storages():
                where = next((f"{frame.filename}:{frame.lineno}" for frame in reversed(traceback.extract_stack())
                              if "/keepkv/" in frame.filename), "?")
                self.found.append(f"{func} writes a store tensor at {where}")
        return func(*args, **kwargs)


@pytest.mark.parametrize("spec", golden.VARIANTS)
def test_no_method_writes_the_store_but_through_its_methods(spec, monkeypatch):
    """Every method and variant runs under :class:`StoreGuard`: no attribute of a store assigned from
    a method's code, no store tensor written in place outside the store's methods."""
    from conftest import tiny_model

    model = tiny_model("llama-gqa", layers=2)
    with StoreGuard(monkeypatch) as guard:
        golden.run(model, spec, 24)
    assert not guard.found, sorted(set(guard.found))


def test_the_store_guard_sees_an_in_place_write(monkeypatch):
    """The guard can fail: a merge that copies into a view of the store's keys."""
    from conftest import tiny_model
    from keepkv.methods.base import Merge

    def copies(self, layer, plan, stats):
        layer.keys[:, :, :1].copy_(layer.keys[:, :, 1:2])
        layer.keep(plan.kept, plan.slots)

    monkeypatch.setattr(Merge, "apply", copies)
    with StoreGuard(monkeypatch) as guard:
        golden.run(tiny_model("llama-gqa", layers=2), "h2o", 24)
    assert any("aten.copy_" in found for found in guard.found), guard.found


def test_a_method_is_a_selection_plus_a_merge():
    from keepkv.methods import MERGES, SELECTIONS
    from keepkv.methods.base import ComposedMethod, Merge
    from keepkv.methods.keepkv import KeepKV, KeepKVMerge
    from keepkv.methods.keepkv import ZipMerge

    assert keepkv.get_method("snapkv").merging == Merge()
    zipped = keepkv.get_method("snapkv+merge=zip+threshold=0.5+protect=0.25")
    assert zipped.merging == ZipMerge(threshold=0.5, protect=0.25)
    assert zipped.selection == keepkv.get_method("snapkv").selection
    assert zipped.needs(False).logits and not keepkv.get_method("snapkv").needs(False).logits
    assert zipped.needs(True).window == 32  # the selection's own needs stay
    assert isinstance(keepkv.get_method("keepkv").merging, KeepKVMerge)
    # KeepKV is a selection plus its merge: no compression of its own
    assert "compress" not in vars(KeepKV) and issubclass(KeepKV, ComposedMethod)
    with pytest.raises(ValueError, match="threshold must be in"):
        keepkv.get_method("h2o+merge=zip+threshold=2.0")
    with pytest.raises(ValueError, match="unknown parameter"):
        keepkv.get_method("h2o+threshold=0.5")  # evicting takes no threshold


@pytest.mark.parametrize("selection", ["window", "streamingllm", "h2o", "snapkv", "pyramidkv", "kvzip", "keydiff", "d2o", "cam", "ema"])
@pytest.mark.parametrize("merge", ["none", "zip", "keepkv", "d2o", "pivot", "spread"])
def test_every_selection_pairs_with_every_merge_or_is_refused_in_one_line(selection, merge):
    from keepkv.methods import MERGES, SELECTIONS

    try:
        method = keepkv.get_method(f"keepkv+selection={selection}+merge={merge}")
    except ValueError as error:
        assert "\n" not in str(error) and (selection in str(error) or merge in str(error)), error
        refusals = {("ema", m) for m in MERGES if m != "keepkv"} | {(s, "pivot") for s in ("window", "streamingllm", "keydiff", "cam", "ema")}
        assert (selection, merge) in refusals, f"{selection}+{merge} refused: {error}"
        return
    assert type(method.selection) is SELECTIONS[selection] and type(method.merging) is MERGES[merge]
    # The pair runs end to end and keeps the budget: every layer, row and head within its own
    # budget, and the budgets average 24.
    from conftest import tiny_model
    from conftest import char_tokenizer

    model = tiny_model("llama-gqa", layers=2)
    ids, mask = golden.prompts(model.config.vocab_size)
    cache = keepkv.CompressedCache(model.config, method, 24)
    with keepkv.enabled(model), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        keepkv.reconstruction.prefill(model, char_tokenizer(), cache, ids, mask, chat=False)
        model(input_ids=ids[:, -1:], attention_mask=torch.cat([mask, mask[:, -1:]], -1), past_key_values=cache)
    for layer in cache.layers:
        assert bool((layer.live_counts() <= layer.budget).all()) and int(layer.live_counts().min()) >= 1
    assert torch.equal(cache.layer_budgets.double().mean((0, 2)), torch.full((2,), 24.0, dtype=torch.float64))
