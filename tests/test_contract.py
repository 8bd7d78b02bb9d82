"""The method contract (docs/architecture.md): every method's outputs equal its recorded reference,
and no method writes a store field.

The reference logits (tests/fixtures/contract/, one file per variant) are compared on any torch,
CPU and device (the CPU always; CUDA too where there is one, as ``.ci/cuda`` runs it): the greedy
tokens exactly, the logits within :func:`tolerance`, a bound of fp32 rounding, far below what a
changed decision moves. A greedy token may differ only where the reference's top two logits are
tied within that bound; the row's later steps then follow another token and are not compared.
"""

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

from keepkv.methods import MERGES, SELECTIONS

from fixtures import contract_golden as golden


# fp32 rounding differs between CPUs, BLAS builds, thread counts and devices: summation order and
# vector width change each dot product and softmax by a few units in the last place, compounded
# over 3 layers and 10 decode steps. Measured against the recording host: up to 1.4e-5 on a fresh
# host with the same torch and CPU kind (~20 ulps of the largest logit, about 6), 1.9e-5 on an
# AVX2 host. 256 ulps of the largest logit (~2e-4) leaves a margin of 10x; one entry kept in place
# of another moves the next logits by 0.5 or more on these models (budget 24 against 25).
ULPS = 256
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def tolerance(expected: torch.Tensor) -> float:
    """Absolute tolerance of logits [T, B, V] recorded as ``expected``: ULPS of its largest in fp32."""
    return ULPS * torch.finfo(torch.float32).eps * expected.abs().max().item()


def compare_to_reference(got: torch.Tensor, expected: torch.Tensor, where: str) -> list[str]:
    """Assert that logits [T, B, V] ``got`` equal ``expected``: the greedy tokens exactly, the logits
    within :func:`tolerance`. A row whose greedy token differs at a step where the reference's top
    two are within the tolerance (a rounding tie) is compared up to that step; the tied steps are
    returned, every other difference fails."""
    assert got.shape == expected.shape, where
    atol = tolerance(expected)
    top2 = expected.topk(2, dim=-1).values  # [T, B, 2]
    tied = (top2[..., 0] - top2[..., 1]) <= 2 * atol  # [T, B]
    differs = got.argmax(-1) != expected.argmax(-1)  # [T, B]
    ties = []
    for row in range(got.shape[1]):
        steps = differs[:, row].nonzero().flatten().tolist()
        end = steps[0] if steps else got.shape[0]
        if steps:
            assert tied[end, row], f"{where} row {row}: greedy token differs at step {end}, away from a tie"
            ties.append(f"{where} row {row} step {end}")
        torch.testing.assert_close(got[: end + 1, row], expected[: end + 1, row], rtol=0, atol=atol,
                                   msg=lambda text: f"{where} row {row}: {text}")
    return ties


def test_every_reference_is_a_listed_variant_with_every_cell():
    recorded = sorted(file.stem for file in golden.FOLDER.glob("*.json"))
    assert set(recorded) <= set(golden.VARIANTS), f"references of no listed variant: {set(recorded) - set(golden.VARIANTS)}"
    cells = {golden.cell(kind, budget) for kind in golden.MODELS for budget in golden.BUDGETS}
    for spec in recorded:
        assert set(golden.load(spec)["logits"]) == cells, spec


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", golden.MODELS)
@pytest.mark.parametrize("spec", golden.VARIANTS)
def test_logits_equal_the_reference(kind, spec, device):
    from conftest import tiny_model

    reference = golden.load(spec)
    if reference is None:
        pytest.skip(f"{spec} has no reference yet: record it with python tests/fixtures/contract_golden.py --add-missing")
    model = tiny_model(kind, layers=3).to(device)
    for budget in golden.BUDGETS:
        compare_to_reference(golden.run(model, spec, budget), reference["logits"][golden.cell(kind, budget)],
                             f"{kind} {spec} budget={budget} on {device}")


def test_the_reference_compares_under_any_torch_version(monkeypatch):
    """A reference recorded with another torch (here: a version string no build has) is compared,
    not skipped: a changed output still fails."""
    monkeypatch.setattr(torch, "__version__", "0.0.0+elsewhere")
    saved = golden.load("h2o")
    assert saved["torch"] != torch.__version__
    test_logits_equal_the_reference("llama-gqa", "h2o", "cpu")
    monkeypatch.setattr(golden, "load", lambda spec: {**saved, "logits": {
        key: value + 10 * tolerance(value) for key, value in saved["logits"].items()}})
    with pytest.raises(AssertionError, match="row 0"):
        test_logits_equal_the_reference("llama-gqa", "h2o", "cpu")


def test_a_greedy_token_may_differ_only_at_a_tie():
    """The comparison's rule on greedy tokens, on hand-made logits [T=3, B=1, V=3]."""
    expected = torch.tensor([[[2.0, 1.0, 0.0]], [[1.0, 1.0 - 1e-6, 0.0]], [[0.0, 3.0, 0.0]]])
    assert compare_to_reference(expected.clone(), expected, "same") == []
    flipped = expected.clone()
    flipped[1, 0, 1] += 2e-6  # the tied step's token changes by less than the tolerance
    flipped[2] = torch.tensor([[5.0, 0.0, 0.0]])  # the row follows another token after it: not compared
    assert compare_to_reference(flipped, expected, "tie") == ["tie row 0 step 1"]
    away = expected.clone()
    away[0, 0, 1] += 1.5  # a token with a margin of 1.0 changes: a changed decision
    with pytest.raises(AssertionError, match="away from a tie"):
        compare_to_reference(away, expected, "away")
    drift = expected.clone()
    drift[0, 0, 2] += 10 * tolerance(expected)  # same tokens, logits beyond rounding
    with pytest.raises(AssertionError):
        compare_to_reference(drift, expected, "drift")


def test_a_variant_without_a_reference_is_skipped_not_failed(tmp_path, monkeypatch):
    monkeypatch.setattr(golden, "FOLDER", tmp_path)
    with pytest.raises(pytest.skip.Exception, match="contract_golden.py --add-missing"):
        test_logits_equal_the_reference("llama-gqa", "h2o", "cpu")


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


# Each merge made to merge whatever it can, so that a decode step's compression exercises it.
EAGER = {"zip": "+threshold=-1.0", "keepkv": "+threshold=-1.0+protect=0+max_value_change=None+min_mass=0", "pivot": "+threshold=-1.0"}


def serving_rule_breaks(spec: str) -> list[str]:
    """Where decoding ``spec`` breaks the serving rule (``Merge``'s docstring): an entry that a
    decode step's compression keeps in place (same row, head and position) but whose key or value
    changed while its votes (bias) did not."""
    from conftest import tiny_model

    model = tiny_model("llama-gqa", layers=2)
    ids, mask = golden.prompts(model.config.vocab_size)
    cache = keepkv.CompressedCache(model.config, spec, 24)
    compress, breaks = cache.method.compress, []

    def entries(layer) -> dict:
        live = layer.live().nonzero().tolist()
        return {(b, h, int(layer.positions[b, h, s])): (layer.keys[b, h, s].clone(), layer.values[b, h, s].clone(),
                                                        float(layer.bias[b, h, s])) for b, h, s in live}

    def checked(layer, stats):
        if stats.is_prefill:
            return compress(layer, stats)
        before = entries(layer)
        compress(layer, stats)
        for entry, (key, value, bias) in entries(layer).items():
            if entry in before and bias == before[entry][2] and not (
                    torch.equal(key, before[entry][0]) and torch.equal(value, before[entry][1])):
                breaks.append(f"layer {layer.layer_idx} entry {entry}")

    cache.method.compress = checked
    with keepkv.enabled(model), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=8, min_new_tokens=8,
                       do_sample=False, pad_token_id=0)
    return breaks


def pairing_refusal(selection: str, merge: str) -> str | None:
    """Why ``selection`` and ``merge`` cannot pair, or None."""
    try:
        keepkv.get_method(f"keepkv+selection={selection}+merge={merge}")
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize("merge", sorted(MERGES))
def test_every_served_merge_keeps_the_serving_rule(merge):
    """Every registered merge, after the first selection it takes (H2O's for those here): a merge
    that breaks the serving rule is not served (a serving engine would keep stale keys and values
    in its blocks)."""
    selection = next(name for name in ("h2o", *SELECTIONS) if not pairing_refusal(name, merge))
    breaks = serving_rule_breaks(f"keepkv+selection={selection}+merge={merge}{EAGER.get(merge, '')}")
    assert not (MERGES[merge].served and breaks), breaks[:3]


def test_the_serving_rule_check_sees_a_merge_without_votes():
    """D2O's merge moves a kept entry's key and value and leaves its bias: the check sees it."""
    assert serving_rule_breaks("h2o+merge=d2o")


# Reads of a declared hook with getattr and a default, allowed where listed (none left).
GETATTR_READS_LEFT: set = set()


PARTS = {"method": "method", "selection": "selection", "merging": "merge"}  # a receiver's name -> what it is


def framework_reads(source: str, file: str) -> list[tuple[str, str, str, int, str]]:
    """(file, part, attribute, line, how) of every attribute ``source`` reads from a method, a
    selection or a merge, found with ast: ``X.attr`` (how "attribute") where X is named ``method``,
    ``selection`` or ``merging`` (``self.method``, ``cache.method.merging``, ...), and ``getattr`` or
    ``hasattr`` of such an X with a literal name (how "getattr")."""
    import ast

    def part(node) -> str | None:
        return PARTS.get(node.id if isinstance(node, ast.Name) else getattr(node, "attr", None))

    reads = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and part(node.value):
            reads.append((file, part(node.value), node.attr, node.lineno, "attribute"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and part(node.args[0])):
            reads.append((file, part(node.args[0]), node.args[1].value, node.lineno, "getattr"))
    return reads


def unkept_reads(reads) -> list[str]:
    """The reads of a hook no part declares, and the reads with getattr beyond GETATTR_READS_LEFT."""
    from keepkv.methods.base import Merge, Method, Selection

    declared_on = {"method": Method, "selection": Selection, "merge": Merge}
    return [f"{file}:{line} reads {part}.{attr}" + (" with getattr" if how == "getattr" else "")
            for file, part, attr, line, how in reads
            if not hasattr(declared_on[part], attr) or (how == "getattr" and (file, part, attr) not in GETATTR_READS_LEFT)]


def test_every_hook_the_library_reads_is_declared():
    """What the library reads of a method, a selection or a merge is declared on Method, Selection or
    Merge (a hook, a ClassVar or a field, with its default), never a name no class declares; and it
    is read as an attribute, not with getattr's default."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    reads = [read for path in sorted((root / "keepkv").rglob("*.py"))
             for read in framework_reads(path.read_text(), path.relative_to(root).as_posix())]
    assert len({(part, attr) for _, part, attr, _, _ in reads}) > 40  # the scan sees the library's reads
    assert not unkept_reads(reads), unkept_reads(reads)


def test_the_hook_scan_sees_an_undeclared_read_and_a_getattr():
    source = "def f(cache, merging):\n    cache.method.slack\n    getattr(merging, 'window', 0)\n"
    assert unkept_reads(framework_reads(source, "x.py")) == ["x.py:2 reads method.slack", "x.py:3 reads merge.window with getattr"]


def test_no_dispatch_on_a_method_class_outside_the_registry():
    """No isinstance or issubclass against a particular method, selection or merge class: what a
    part can do is declared on it. The contract's own classes (Method, Selection, Merge,
    ComposedMethod) may be checked, as the registry and the cache check their input."""
    import ast
    from pathlib import Path

    from keepkv.methods import METHODS
    from keepkv.methods.base import ComposedMethod, Merge, Method, Selection

    def subclasses(cls):
        return {cls, *(sub for child in cls.__subclasses__() for sub in subclasses(child))}

    particular = {cls.__name__ for base in (Method, Selection, Merge) for cls in subclasses(base)}
    particular -= {"Method", "Selection", "Merge", "ComposedMethod"}
    assert {"KeepKVMerge", "EmaAttention", "ScoredSelection"} <= particular and METHODS
    root = Path(__file__).resolve().parents[1]
    found = []
    for path in sorted((root / "keepkv").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "issubclass"):
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} if len(node.args) > 1 else set()
                if names & particular:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.func.id}(..., {', '.join(sorted(names))})")
    assert not found, found


def test_what_is_served_is_declared_on_the_parts():
    """What the paged adapter serves, read from the declarations (``serving_refusal``): seven methods,
    their selections and the learned one (its trained layer split too: an engine gives layers of
    different budgets blocks of their own), merges none and keepkv, a variant only with served
    parts, not a full copy (refresh_interval) nor layer budgets from every layer's scores, and KVzip
    in its own words."""
    from keepkv.methods.base import served_names, serving_refusal

    methods, selections, merges = served_names()
    assert sorted(methods) == sorted(["window", "streamingllm", "snapkv", "h2o", "pyramidkv", "keydiff", "keepkv"])
    assert sorted(selections) == sorted(["window", "streamingllm", "snapkv", "h2o", "pyramidkv", "keydiff", "ema", "learned"])
    assert merges == ["none", "keepkv"]
    for spec in (*methods, "snapkv+merge=keepkv", "keepkv+merge=none", "keepkv+selection=ema+kernel=3",
                 "snapkv+selection=learned+budgets=uniform", "snapkv+selection=learned"):
        assert serving_refusal(keepkv.get_method(spec)) is None, spec
        assert serving_refusal(keepkv.get_method(spec), keep_prompt=True) is None, spec
    for spec in ("cam", "d2o", "kvmerger", "kvmerger+merge=none", "snapkv+merge=zip", "keepkv+selection=kvzip", "full",
                 "zeromerge", "kvreviver", "snapkv+selection=learned+budgets=layers"):
        reason = serving_refusal(keepkv.get_method(spec))
        assert reason and "\n" not in reason and reason.startswith(spec.split("+")[0]), (spec, reason)
    assert serving_refusal(keepkv.get_method("kvzip")).startswith("kvzip: its reconstruction pass is a second prefill")
    assert serving_refusal(keepkv.get_method("keepkv+selection=ema+refresh_interval=4")) == (
        "refresh_interval (it keeps a full copy of the cache)")


def test_a_selection_keeps_a_score_only_when_it_declares_one(gqa_model):
    """``scored`` is False unless a selection says so: one that writes a score without declaring it
    fails at its first write, and one that declares none adds no per-entry word."""
    from dataclasses import dataclass

    from keepkv.methods.base import ComposedMethod, ScoredSelection
    from keepkv.methods.h2o import AccumulatedAttention

    @dataclass(frozen=True)
    class Undeclared(ScoredSelection):
        name = "_undeclared"

        def observe(self, layer, stats):
            layer.add_to("score", torch.ones_like(layer.bias))

    @dataclass
    class Pair(ComposedMethod):
        name = "_undeclared"

    assert not ScoredSelection.scored and AccumulatedAttention.scored
    assert Pair(selection=Undeclared()).entry_extras(2) == {}
    cache = keepkv.CompressedCache(gqa_model.config, Pair(selection=Undeclared()), 8)
    with keepkv.enabled(gqa_model), torch.no_grad(), pytest.raises(KeyError, match="no tensor 'score'"):
        gqa_model(torch.randint(3, 100, (1, 20)), past_key_values=cache)
