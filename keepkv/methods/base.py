"""What every compression method is: a selection and a merge, or a compression of its own.

A method never touches the model. The cache hands it a layer's store (keepkv/store.py has the
shapes) and the StepStats of each attention call; the method scores entries in ``observe`` and
compresses in ``compress`` with tensor operations over all rows and heads at once, writing only
through the store's methods. docs/architecture.md describes the contract.

Most methods are a :class:`Selection` (which entries stay: scores, their ranking, protected
entries, layer budgets) and a :class:`Merge` (what becomes of the entries the selection evicts),
paired by a :class:`ComposedMethod`: the selection ranks, :func:`plan_eviction` keeps the budget's
highest-ranked entries, and the merge rewrites the store from that plan. Any registered selection
pairs with any registered merge (``snapkv+merge=d2o``, ``kvzip+merge=zip``,
``keepkv+selection=kvzip``); a pair that cannot run is refused in one line. ZeroMerge, KVReviver
and the full cache compress their own way (:class:`Method`).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import torch

from ..attention import Needs, StepStats
from ..checks import MAX_COUNT, is_int, shown
from ..merging import gathers_candidates
from ..store import slots_of

METHODS: dict[str, type["Method"]] = {}
SELECTIONS: dict[str, type["Selection"]] = {}
MERGES: dict[str, type["Merge"]] = {}


def register(cls):
    """Class decorator: make a method reachable by ``get_method(cls.name)``."""
    METHODS[cls.name] = cls
    return cls


def register_selection(cls):
    """Class decorator: make a selection reachable as ``selection=cls.name`` in a method variant."""
    SELECTIONS[cls.name] = cls
    return cls


def register_merge(cls):
    """Class decorator: make a merge reachable as ``merge=cls.name`` in a method variant."""
    MERGES[cls.name] = cls
    return cls


def parse_value(text: str):
    """A parameter value typed on a command line: a Python or JSON literal, else the text itself."""
    for parse in (ast.literal_eval, json.loads):
        try:
            return parse(text)
        except (ValueError, SyntaxError):
            pass
    return text


def parse_method_spec(spec: str) -> tuple[str, dict]:
    """``"keepkv+interval=8+zip_key=group"`` -> ``("keepkv", {"interval": 8, "zip_key": "group"})``.

    A method variant, named the way eval suites are (``name+key=value+...``), so that one run can
    compare a method with itself under other parameters.
    """
    name, *items = spec.split("+")
    params = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"method variant {spec!r}: write NAME+KEY=VALUE[+KEY=VALUE...], got {item!r}")
        if key.strip() in params:
            raise ValueError(f"method variant {spec!r} gives {key.strip()} twice: give each parameter once")
        params[key.strip()] = parse_value(text.strip())
    return name.strip(), params


def get_method(name: str, *, compress_once: bool = False, **params) -> "Method":
    """Return the method registered as ``name`` (or a variant ``name+key=value+...``), built with
    ``params``.

    ``compress_once``: the method will compress a context before any question is seen
    (:func:`keepkv.compress`, the eval's question-agnostic setting). A composed method that names
    a selection for that setting (``compress_once_selection``, KeepKV's: kvzip) then runs on it,
    unless ``selection=NAME`` is given.

    For a method that pairs a selection with a merge, ``selection=NAME`` and ``merge=NAME`` swap
    either part for a registered one (``keepkv methods`` shows each method's parts and parameters),
    and every other parameter goes to the part that declares it (``selection.KEY`` or ``merge.KEY``
    where both do). Raises ValueError naming the valid methods or parameters.
    """
    if not isinstance(name, str):
        raise ValueError(f"method must be a method name or variant (a str such as 'snapkv' or 'snapkv+window=16'; "
                         f"`keepkv methods` lists them), got {shown(name)}")
    name, spec_params = parse_method_spec(name)
    params = {**spec_params, **params}
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of: {', '.join(sorted(METHODS))}")
    cls = METHODS[name]
    if issubclass(cls, ComposedMethod):
        if compress_once and cls.compress_once_selection is not None:
            params.setdefault("selection", cls.compress_once_selection)
        return cls.compose(**params)
    valid = [field.name for field in dataclasses.fields(cls)]
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {', '.join(unknown)} for method {name!r}; valid: {', '.join(valid) or 'none'}"
        )
    return cls(**params)


def accepted_params(name: str) -> set[str]:
    """The parameter names a registered method (a name, not a variant) takes: a composed method's
    own, its default selection's and its default merge's (``selection`` and ``merge`` swap them)."""
    cls = METHODS[name]
    if issubclass(cls, ComposedMethod):
        return set(cls.default_params())
    return {field_.name for field_ in dataclasses.fields(cls)}


def describe_methods() -> list[dict]:
    """Name, paper, parameters and defaults of every registered method (a selection and a merge
    are named by ``selection`` and ``merge``, their parameters beside them)."""
    return [
        {"name": name, "paper": cls.paper, "params": cls.default_params()} for name, cls in sorted(METHODS.items())
    ]


def check_range(name: str, value, low, high, *, low_open=False, high_open=False) -> None:
    """Raise ValueError unless low <(=) value <(=) high; the message names the range."""
    below = value <= low if low_open else value < low
    above = value >= high if high_open else value > high
    if below or above:
        left, right = "(" if low_open else "[", ")" if high_open else "]"
        raise ValueError(f"{name} must be in {left}{low}, {high}{right}, got {value!r}")


def check_choice(name: str, value, allowed) -> None:
    """Raise ValueError unless ``value`` is one of ``allowed``; the message names them."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


_KINDS = {  # a field's declared type -> (accepted values, how the error names them)
    "int": (is_int, "an int"),
    "float": (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool) and v == v, "a number"),
    "bool": (lambda v: isinstance(v, bool), "True or False"),
    "str": (lambda v: isinstance(v, str), "a string"),
}


def check_field_types(part) -> None:
    """Raise ValueError (one line) when a parameter has the wrong type for its declared one (int,
    float, bool, str, or one of them | None): a float ``window`` would otherwise fail deep inside a
    tensor op. Ranges are each part's own checks."""
    for field_ in dataclasses.fields(part):
        declared = field_.type if isinstance(field_.type, str) else getattr(field_.type, "__name__", "")
        optional = declared.endswith(" | None")
        kind = _KINDS.get(declared.removesuffix(" | None"))
        value = getattr(part, field_.name)
        if kind is None or (optional and value is None):
            continue
        accepts, wanted = kind
        if not accepts(value):
            wanted += " or None" if optional else ""
            raise ValueError(f"{part.name}: {field_.name} must be {wanted}, got {shown(value)}")
        if is_int(value) and abs(int(value)) > MAX_COUNT:  # past what int64 tensor arithmetic holds
            raise ValueError(f"{part.name}: {field_.name} must be an int in [-2**48, 2**48], got {shown(value)}")
        if type(value).__module__ == "numpy":  # a numpy scalar, as the Python number it stands for
            object.__setattr__(part, field_.name, value.item())  # parts are frozen dataclasses


def part_params(part) -> dict:
    """A selection's or merge's parameters, by name."""
    return {field_.name: getattr(part, field_.name) for field_ in dataclasses.fields(part)}


class Extra(NamedTuple):
    """A per-entry extra a method adds to a layer (``layer.add_extra(name, *extra)``): a tensor
    [B, H_kv, S, *trailing] of ``dtype`` whose new entries start at ``fill``."""

    fill: float = 0.0
    dtype: torch.dtype = torch.float32
    trailing: tuple[int, ...] = ()


@dataclass
class Method:
    """Base class of every method. Subclasses are small dataclasses registered with ``@register``.

    A method that pairs a selection with a merge is a :class:`ComposedMethod`; this base is also
    the contract of the methods that compress their own way (ZeroMerge, KVReviver, the full cache),
    which override ``observe`` and ``compress``.

    Parameters
    ----------
    interval : int
        During decoding, compress once every ``interval`` new tokens, each time to
        ``interval - 1`` below the budget, so that a layer never holds more than its budget
        between steps (:meth:`keepkv.step.LayerStep.set_budget`).
    """

    name: ClassVar[str] = ""
    """The registered name (``get_method(name)``)."""
    paper: ClassVar[str] = ""
    """The paper it follows, for ``keepkv methods``."""
    allocates_from_all_layers: ClassVar[bool] = False
    """True when ``allocate`` reads every layer's prefill (D2O): no layer is then compressed before
    the last one has seen the prompt, so the whole prompt cache peaks at once."""
    served: ClassVar[bool] = False
    """Whether a serving engine's paged adapter (``keepkv.paged``) runs it (:func:`serving_refusal`)."""
    not_served: ClassVar[str] = ""
    """Why a serving engine cannot run it, in its own words (KVzip: its reconstruction pass), or ""."""
    per_model_head: ClassVar[bool] = False
    """Whether it ranks with parameters of each KV head of the whole model (``Selection.per_model_head``)."""
    per_layer: ClassVar[bool] = True
    """Whether a store must hold one layer's rows only (``Selection.per_layer``); a composed method
    asks its parts."""
    compresses_chunks: ClassVar[bool] = False
    """Whether a prompt read in chunks may be compressed after each chunk, to the budget its whole
    prompt will have, with the same kept entries as one compression at its end (each entry scored
    alone, nothing merged): :meth:`keepkv.step.LayerStep.compress_chunk`."""
    selection: ClassVar[None] = None
    """A ComposedMethod's selection; none for a method of its own."""
    merging: ClassVar[None] = None
    """A ComposedMethod's merge; none for a method of its own."""
    interval: int = 1

    def __post_init__(self):
        check_field_types(self)
        check_range("interval", self.interval, 1, math.inf)

    @classmethod
    def default_params(cls) -> dict:
        """The registered defaults of every parameter (``keepkv methods``)."""
        return {field_.name: field_.default for field_ in dataclasses.fields(cls)}

    def params(self) -> dict:
        """This method's parameters (a selection and a merge by name, with theirs): what an eval
        records of a cell."""
        return {field_.name: getattr(self, field_.name) for field_ in dataclasses.fields(self)}

    def needs(self, is_prefill: bool) -> Needs:
        """Statistics the attention path must compute for this method."""
        return Needs()

    def prefill_query_rows(self) -> int:
        """The newest query rows of a prompt that ``observe`` and ``compress`` read at its end: what
        a prompt read in chunks keeps of its queries until then."""
        return max(1, self.needs(True).window)

    @property
    def reads_every_entry(self) -> bool:
        """Whether what it computes for an entry reads the layer's other entries beyond the
        attention's probabilities (``Selection.reads_every_entry``): a kept prompt's entries then
        change the generated ones', so the paged adapter compresses them with the prompt in the store."""
        return True

    def prepare(self, model) -> None:
        """Derive model-specific constants once, before generation (KVReviver's Fisher layer
        scores read the K/V projection weights). The only hook that sees the model."""

    def protected_entries(self) -> int:
        """Entries a compressed row keeps whatever their scores (leading sinks plus a fixed recent
        window), per layer and head. A smaller budget cannot hold them: the cache warns."""
        return 0

    def check_budget(self, cache) -> None:
        """Raise ValueError if the cache's budget cannot work for this method."""

    def check_model(self, config) -> None:
        """Raise ValueError, in one line, if this method cannot run on a model of ``config`` (its
        transformers config): the caches call it where they are built, before any work."""

    def for_heads(self, first_kv_head: int) -> "Method":
        """This method for a cache whose KV head 0 is the model's ``first_kv_head`` (a tensor-parallel
        rank's): itself, unless it has parameters per KV head of the model (``per_model_head``)."""
        return self

    def setup_layer(self, layer) -> None:
        """Register per-entry extras on a layer before its first token."""

    def entry_extras(self, group: int) -> dict[str, Extra]:
        """The per-entry extras this method adds to a layer by its first decode step (in
        ``setup_layer`` or ``observe``), in the order it adds them, for ``group`` query heads per
        KV head: what a serving engine stores per slot, known before any token runs
        (``keepkv.paged``). ``tests/test_paged_api.py`` checks it against a cache's layers."""
        return {}

    def attention_entries(self, layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys, values, bias) the new queries attend over; the new block must come last.

        The stored entries by default. KVReviver prepends tokens rebuilt from its sketch;
        they live only for this call.
        """
        return layer.keys, layer.values, layer.bias

    def observe(self, layer, stats: StepStats) -> None:
        """Update scores after every attention call."""

    def refresh(self, layer, stats: StepStats) -> StepStats | None:
        """After ``observe`` at every decode step: when a refresh is due (KeepKV's
        ``refresh_interval``), rebuild the layer's entries and return the statistics its compression
        reads, which takes the place of the step's; else None."""
        return None

    def allocation_scores(self, layer) -> torch.Tensor | None:
        """What ``allocate`` reads of one layer once its prefill is observed (KVzip's scores
        [B, H_kv, S], D2O's attention variance [B]), or None. Asked of every layer when the method
        ``allocates_from_all_layers``."""
        return None

    def allocate(
        self, layers: int, kv_heads: int, row_budget: torch.Tensor, prompt_lengths: torch.Tensor,
        scores: list | None = None,
    ) -> torch.Tensor | None:
        """Budgets [L, B, H_kv] from each row's mean per-layer budget [B]; None = never compress.

        Pure: it reads its arguments only (``scores``: each layer's ``allocation_scores``, None
        when budgets are asked before the model runs, as ``capacity_bound`` does)."""
        return uniform_budgets(layers, kv_heads, row_budget)

    def compress(self, layer, stats: StepStats) -> None:
        """Bring every row and head of ``layer`` to at most its budget."""
        raise NotImplementedError

    def select_rows(self, layer, index: torch.Tensor) -> dict:
        """The layer's method state for rows ``index`` [B'] of its B rows (beam search and the other
        row-reshaping hooks), as a new dict; the layer is left unchanged.

        By default: a tensor laid out per row (first dimension B) takes those rows; an object with a
        ``select_rows(index)`` (a sketch, a host copy) returns its own; a plain Python value (a step
        count, a scaling) is shared by every row and kept. Anything else raises ValueError: a state
        that cannot follow its rows is refused rather than left in the old order. A method whose
        scalars are derived from its rows (KVReviver's largest exact share) recomputes them here.
        """
        return select_state_rows(layer.state, index, layer.keys.shape[0], self.name)


def uniform_budgets(layers: int, kv_heads: int, row_budget: torch.Tensor) -> torch.Tensor:
    """[L, B, H_kv]: each row's budget [B] in every layer and head."""
    return row_budget[None, :, None].expand(layers, -1, kv_heads).clone()


def select_state_rows(state: dict, index: torch.Tensor, rows: int, owner: str) -> dict:
    """``state`` with rows ``index`` of each per-row value (see ``Method.select_rows``)."""
    picked = {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 or value.shape[0] != rows:
                raise ValueError(
                    f"{owner}: its state {name!r} of shape {tuple(value.shape)} is not laid out per row, so its "
                    "rows cannot be reordered (beam search, num_return_sequences)"
                )
            picked[name] = value.index_select(0, index.to(value.device))
        elif callable(getattr(value, "select_rows", None)):
            picked[name] = value.select_rows(index)
        elif value is None or isinstance(value, (bool, int, float, str)):
            picked[name] = value
        else:
            raise ValueError(
                f"{owner}: its state {name!r} ({type(value).__name__}) cannot be reordered by row (beam search, "
                "num_return_sequences); use num_beams=1"
            )
    return picked


def _declared_per_class(cls, flags: tuple[str, ...]) -> None:
    """Set each of ``flags`` that the class body of ``cls`` does not declare to False: what a part
    can do is declared by each part itself, never inherited from the one it extends."""
    for flag in flags:
        if flag not in cls.__dict__:
            setattr(cls, flag, False)


@dataclass(frozen=True)
class Selection:
    """Which entries a compression keeps: each entry's score, the ranking made from it
    (``priority``), the entries kept whatever their scores (``protected_entries``), the layer
    budgets (``allocate``) and what the attention path must compute for the scores (``needs``).

    A small frozen dataclass registered with ``@register_selection``; its parameters are checked
    where it is built. Per-layer scores live in the layer's store (per-entry extras), never here.
    """

    name: ClassVar[str] = ""
    """The registered name (``selection=NAME``)."""
    allocates_from_all_layers: ClassVar[bool] = False
    """True when ``allocate`` reads every layer's prefill (``allocation_scores``): no layer is then
    compressed before the last one has seen the prompt."""
    scored: ClassVar[bool] = False
    """Whether it keeps a per-entry ``"score"`` extra, accumulated in ``observe`` (a selection that
    writes one without declaring it fails at its first write)."""
    served: ClassVar[bool] = False
    """Whether the paged adapter runs it: its scores need no pass beyond the prompt's own attention
    and its layer budgets follow from the prompt's length alone. Declared by each class itself."""
    ranks_by_merge_scores: ClassVar[bool] = False
    """Whether ``priority`` ranks by the merge's ``ranking_scores`` (KeepKV's ``ema``): it then pairs
    only with a merge that ``keeps_scores``."""
    layered: ClassVar[bool] = False
    """Whether ``allocate`` may give the layers budgets of their own (PyramidKV, ``ema``, KVzip's
    allocations); otherwise every layer keeps the row's budget. Declared by a class that overrides
    ``allocate``."""
    per_model_head: ClassVar[bool] = False
    """Whether it ranks a KV head's entries with parameters of that head of the whole model (the
    learned selection's scorer): a cache holding some of the model's heads (a tensor-parallel
    rank's) gives it the first of them (:meth:`for_heads`)."""
    per_layer: ClassVar[bool] = False
    """Whether its ranking reads the store's own layer (``layer.layer_idx``) as one layer. Otherwise a
    store may hold the rows of several layers at once (the paged step compresses a step's layers as
    one batch), each ranked as in a store of its own; a ranking with per-layer parameters reads
    each row's layer (``layer.row_layers``: the learned selection's scorer)."""
    scores_alone: ClassVar[bool] = False
    """Whether an entry's priority is a function of that entry alone (its key, value and position,
    not the other entries nor any query), and ``observe`` at a prefill reads nothing but the tokens
    seen so far: a prompt's chunks can then be compressed as they arrive and keep, at each layer,
    the entries one compression of the whole prompt keeps (see ``Method.compresses_chunks``).
    Each chunk is observed as a prompt's end, so newest tokens protected only while decoding
    (``generated_recent_count``) are none at a chunk's compression, as at the prompt's."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _declared_per_class(cls, ("served",))

    def __post_init__(self):
        check_field_types(self)

    @property
    def keeps_order(self) -> bool:
        """Whether the ranking compares neighbouring slots, so the kept entries must stay in position
        order (a plan then keeps them with ``layer.select``, not by moving the newest into freed slots)."""
        return False

    def needs(self, is_prefill: bool) -> Needs:
        """Statistics the scores read."""
        return Needs()

    def setup_layer(self, layer) -> None:
        """Register per-entry extras (the scores) on a layer before its first token."""

    def entry_extras(self, group: int) -> dict[str, Extra]:
        """The extras ``setup_layer`` and ``observe`` add (see ``Method.entry_extras``)."""
        return {}

    def observe(self, layer, stats: StepStats) -> None:
        """Fold one attention call's statistics into the scores."""

    def protected_entries(self) -> int:
        """Entries a compressed row keeps whatever their scores, per layer and head."""
        return 0

    def allocation_scores(self, layer) -> torch.Tensor | None:
        """What ``allocate`` reads of one layer (see ``Method.allocation_scores``)."""
        return None

    def allocate(self, layers, kv_heads, row_budget, prompt_lengths, scores=None) -> torch.Tensor:
        """Budgets [L, B, H_kv] from each row's mean budget [B] (see ``Method.allocate``)."""
        return uniform_budgets(layers, kv_heads, row_budget)

    def priority(self, layer, merge_scores=None) -> torch.Tensor:
        """[B, H_kv, S] the ranking: the lowest-ranked entries leave (+inf: always kept).
        ``merge_scores``: the merge's ``ranking_scores`` of this plan (None when it keeps none),
        which a selection that ``ranks_by_merge_scores`` ranks by."""
        raise NotImplementedError

    def refusal(self, merging: "Merge") -> str | None:
        """Why this selection cannot run with ``merging`` (one line), or None."""
        return None

    def check_model(self, config) -> None:
        """Raise ValueError, in one line, if it cannot rank the entries of a model of ``config``
        (the learned selection: no scorer trained on that model)."""

    def serving_refusal(self) -> str | None:
        """Why an engine should not serve this selection's configuration, in one line, or None (the
        learned selection's trained layer split: an engine's blocks serve every layer)."""
        return None

    def for_heads(self, first_kv_head: int) -> "Selection":
        """This selection for a cache whose KV head 0 is the model's ``first_kv_head``: itself, unless
        it ranks with parameters per KV head of the model (``per_model_head``)."""
        return self

    @property
    def reads_every_entry(self) -> bool:
        """Whether an entry's rank reads the layer's other entries (KeyDiff's mean key), beyond what
        the attention's probabilities already weigh: a kept prompt's entries then change the ranks
        of the generated ones, so the paged adapter compresses them with the prompt in the store."""
        return False


@dataclass(frozen=True)
class Merge:
    """What becomes of the entries a selection's plan evicts. This base evicts them: it keeps the
    plan's entries and nothing else (``layer.keep``). A merging rule (``ZipMerge``) first folds
    the evicted entries into kept ones through ``layer.merge_into``.

    A merge never calls its selection: it is handed the plan (:class:`EvictionPlan`: the kept and
    evicted entries, the ranking, the protected entries). **The serving rule:** a merge that a
    serving engine runs (``served``) changes a slot's key or value only together with its entry
    (position) or its votes (bias), since the engine rewrites the key and value only of such slots
    (``tests/test_contract.py`` checks every registered merge).
    """

    name: ClassVar[str] = "none"
    """The registered name (``merge=NAME``)."""
    served: ClassVar[bool] = True
    """Whether the paged adapter runs it (it keeps the serving rule). Declared by each class itself."""
    keeps_prompt: ClassVar[bool] = True
    """Whether it can keep a prompt whole (``decoding="keep_prompt"``): it merges nothing into a kept
    prompt's entries. Declared by each class itself."""
    keeps_scores: ClassVar[bool] = False
    """Whether ``ranking_scores`` gives per-entry scores a selection may rank by (KeepKV's EMA)."""
    window: ClassVar[int] = 0
    """Query rows of a prompt's end the merge reads (KeepKV: those its EMA starts from)."""
    refresh_interval: ClassVar[int | None] = None
    """Decode steps between two rebuilds of a layer from a full copy of its entries (KeepKV's
    periodic refresh: a kept prompt cannot stay whole through one); None: never."""
    per_layer: ClassVar[bool] = False
    """Whether it reads the store's own layer (``layer.layer_idx``: CaM's keyed draws); see
    :attr:`Selection.per_layer`."""
    writes_bias: ClassVar[bool] = False
    """Whether it writes entries' bias (votes, ln p): a store's bias is then no longer 0 or -inf, and
    the paged adapter gives each slot a bias word and keys wide enough to carry it to the kernel."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _declared_per_class(cls, ("served", "keeps_prompt"))

    def __post_init__(self):
        check_field_types(self)

    def needs(self, is_prefill: bool) -> Needs:
        """Statistics the merge reads from the attention call (beyond the selection's)."""
        return Needs()

    def setup_layer(self, layer) -> None:
        """Register per-entry extras the merge keeps (KeepKV's EMA adds its own at the prefill)."""

    def entry_extras(self, group: int) -> dict[str, Extra]:
        """The extras the merge adds, after the selection's (see ``Method.entry_extras``)."""
        return {}

    def observe(self, layer, stats: StepStats) -> None:
        """Fold one attention call's statistics into what the merge keeps (KeepKV's EMA), after
        the selection observed it."""

    def refresh(self, layer, stats: StepStats) -> StepStats | None:
        """When a refresh is due (``refresh_interval``), rebuild the layer's entries from the merge's
        full copy and return the statistics its compression reads (as a prompt's end); else None."""
        return None

    def ranking_scores(self, layer):
        """The per-entry scores this merge keeps, computed once per plan: handed to the selection's
        ``priority`` and back to ``apply`` in the plan (``EvictionPlan.merge_scores``); None."""
        return None

    def merge_before_eviction(self, layer, plan: "EvictionPlan", stats: StepStats) -> StepStats | None:
        """Merges made before any eviction (KeepKV's merge-first prefill), from ``plan``'s ranking;
        when they changed the layer, the statistics its eviction reads (it is planned anew), else None."""
        return None

    def apply(self, layer, plan: "EvictionPlan", stats: StepStats) -> None:
        """Rewrite the layer's store from ``plan``."""
        layer.keep(plan.kept, plan.slots)

    def refusal(self, selection: Selection) -> str | None:
        """Why this merge cannot run with ``selection`` (one line), or None."""
        return None

    @property
    def reads_every_entry(self) -> bool:
        """Whether what it keeps of an entry reads the layer's other entries beyond the attention's
        probabilities (see ``Selection.reads_every_entry``)."""
        return False


register_merge(Merge)
EVICT = Merge()


@dataclass
class ComposedMethod(Method):
    """A selection and a merge: the selection's plan (:func:`plan_eviction` over its
    ``priority``), then the merge's rewrite of the store. Subclasses name their parts' defaults
    (``selection`` and ``merging`` fields with a default factory) and document them; ``compose``
    builds a variant from flat parameters."""

    selection: Selection = field(default_factory=Selection)
    merging: Merge = field(default_factory=Merge)
    compress_once_selection: ClassVar[str | None] = None
    """The selection it runs on when it compresses a context before any question is seen and no
    selection is named (:func:`get_method`'s ``compress_once``); None: its default selection."""

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.selection, Selection) or not isinstance(self.merging, Merge):
            raise ValueError(f"{self.name or type(self).__name__}: selection must be a Selection and merging a Merge")
        reason = self.merging.refusal(self.selection) or self.selection.refusal(self.merging)
        if reason:
            raise ValueError(f"{self.name}: {reason}")

    @classmethod
    def default_part(cls, part: str) -> type:
        """The class of the default selection or merge (``part``: "selection" or "merging")."""
        return cls.__dataclass_fields__[part].default_factory

    @classmethod
    def compose(cls, **params) -> "ComposedMethod":
        """This method with flat parameters: ``selection=NAME`` / ``merge=NAME`` (or a Selection /
        Merge) swap a part, ``interval`` is the method's, and every other parameter goes to the part
        that declares it, or to ``selection.KEY`` / ``merge.KEY`` where both do."""
        parts = {"selection": cls._part_type("selection", params.pop("selection", None), SELECTIONS),
                 "merge": cls._part_type("merging", params.pop("merge", None), MERGES)}
        own = {key: params.pop(key) for key in [key for key in params if key in ("interval",)]}
        routed = {"selection": {}, "merge": {}}
        declared = {
            part: set() if not isinstance(kind, type) else {f.name for f in dataclasses.fields(kind)}
            for part, kind in parts.items()
        }
        for key, value in params.items():
            part, _, leaf = key.rpartition(".")
            if part:
                if part not in declared or leaf not in declared[part]:
                    raise ValueError(f"{cls.name}: unknown parameter {key!r}; {cls._valid(declared)}")
                routed[part][leaf] = value
                continue
            owners = [part for part, names in declared.items() if key in names]
            if not owners:
                raise ValueError(f"unknown parameter(s) {key} for method {cls.name!r}; {cls._valid(declared)}")
            if len(owners) > 1:
                raise ValueError(f"{cls.name}: {key!r} is a parameter of its selection and of its merge: "
                                 f"write selection.{key} or merge.{key}")
            routed[owners[0]][key] = value
        built = {}
        for part, kind in parts.items():
            if not isinstance(kind, type):  # an instance given in Python
                if routed[part]:
                    raise ValueError(f"{cls.name}: pass the {part}'s parameters to the {part} object itself")
                built[part] = kind
            else:
                built[part] = kind(**routed[part])
        return cls(selection=built["selection"], merging=built["merge"], **own)

    @classmethod
    def _part_type(cls, part: str, choice, registry: dict):
        if choice is None:
            return cls.default_part(part)
        if isinstance(choice, (Selection, Merge)):
            return choice
        if not isinstance(choice, str) or choice not in registry:
            label = "selection" if part == "selection" else "merge"
            raise ValueError(f"{cls.name}: {label} must be one of {', '.join(sorted(registry))}, got {choice!r}")
        return registry[choice]

    @classmethod
    def _valid(cls, declared: dict) -> str:
        names = ["selection", "merge", "interval", *sorted(declared["selection"]), *sorted(declared["merge"])]
        return f"valid: {', '.join(dict.fromkeys(names))}"

    @classmethod
    def default_params(cls) -> dict:
        selection, merging = cls.default_part("selection")(), cls.default_part("merging")()
        return {"selection": selection.name, **part_params(selection), "merge": merging.name,
                **part_params(merging), "interval": 1}

    def params(self) -> dict:
        return {"selection": self.selection.name, **part_params(self.selection), "merge": self.merging.name,
                **part_params(self.merging), "interval": self.interval}

    @property
    def allocates_from_all_layers(self) -> bool:
        return self.selection.allocates_from_all_layers

    @property
    def compresses_chunks(self) -> bool:
        """A selection that scores each entry alone (``Selection.scores_alone``) and a merge that
        only evicts (``merge=none``; a merge reads its targets' neighbours and the prompt's last
        queries), with layer budgets from the prompt's length alone."""
        return (self.selection.scores_alone and self.merging.name == "none"
                and not self.selection.allocates_from_all_layers)

    def check_model(self, config) -> None:
        self.selection.check_model(config)

    def for_heads(self, first_kv_head: int) -> "ComposedMethod":
        """This method for a cache whose KV head 0 is the model's ``first_kv_head`` (a tensor-parallel
        rank's; see ``Selection.for_heads``)."""
        selection = self.selection.for_heads(first_kv_head)
        return self if selection is self.selection else dataclasses.replace(self, selection=selection)

    @property
    def per_model_head(self) -> bool:
        return self.selection.per_model_head

    @property
    def per_layer(self) -> bool:
        """Whether a store must hold one layer's rows only (:attr:`Selection.per_layer`)."""
        return self.selection.per_layer or self.merging.per_layer

    @property
    def served(self) -> bool:
        """Whether the paged adapter runs the parts this method is registered with (a variant that
        swaps in others is served only when they are too: :func:`serving_refusal`)."""
        return self.default_part("selection").served and self.default_part("merging").served

    def needs(self, is_prefill: bool) -> Needs:
        return Needs.union([self.selection.needs(is_prefill), self.merging.needs(is_prefill)])

    def protected_entries(self) -> int:
        return self.selection.protected_entries()

    @property
    def reads_every_entry(self) -> bool:
        """Whether either part reads the layer's other entries (``Selection.reads_every_entry``)."""
        return self.selection.reads_every_entry or self.merging.reads_every_entry

    def setup_layer(self, layer) -> None:
        self.selection.setup_layer(layer)
        self.merging.setup_layer(layer)

    def entry_extras(self, group: int) -> dict[str, Extra]:
        return {**self.selection.entry_extras(group), **self.merging.entry_extras(group)}

    def prefill_query_rows(self) -> int:
        return max(1, self.needs(True).window, self.merging.window)

    def observe(self, layer, stats: StepStats) -> None:
        self.selection.observe(layer, stats)
        self.merging.observe(layer, stats)

    def refresh(self, layer, stats: StepStats) -> StepStats | None:
        return self.merging.refresh(layer, stats)

    def allocation_scores(self, layer) -> torch.Tensor | None:
        return self.selection.allocation_scores(layer)

    def allocate(self, layers, kv_heads, row_budget, prompt_lengths, scores=None):
        return self.selection.allocate(layers, kv_heads, row_budget, prompt_lengths, scores)

    def plan(self, layer) -> "EvictionPlan":
        """The selection's plan for ``layer``: its ranking, made from the merge's ``ranking_scores``
        where it reads them, which the plan hands back to the merge."""
        scores = self.merging.ranking_scores(layer)
        ranking = self.selection.priority(layer, scores)
        return plan_eviction(layer, ranking, merge_scores=scores, keeps_order=self.selection.keeps_order)

    def compress(self, layer, stats: StepStats) -> None:
        """The selection's plan, then the merge's rewrite of the store from it. A merge that merges
        before it evicts (KeepKV's merge-first prefill) hands on the statistics of the layer it
        changed, which is then planned anew."""
        if layer.size <= layer.min_budget:
            return
        plan = self.plan(layer)
        changed = self.merging.merge_before_eviction(layer, plan, stats)
        if changed is not None:
            plan, stats = self.plan(layer), changed
        self.merging.apply(layer, plan, stats)


@dataclass
class EvictionPlan:
    """Which entries stay and which leave, per row and head.

    kept [B, H_kv, S] bool; slots: the layer's size once the plan is applied (the most any row
    and head keeps); evict_idx [B, H_kv, E]: the evicted slots in position order, then others
    (evict_valid False). keep_idx [B, H_kv, slots]: the kept slots in position order, then others
    (keep_valid False); computed only when asked for (a sort over every slot). priority
    [B, H_kv, S]: the ranking the plan was made from (+inf: protected by the selection, see
    ``protected``). merge_scores: the merge's ``ranking_scores`` the ranking read, handed back to
    the merge; keeps_order: the kept entries must stay in position order (``Selection.keeps_order``).
    """

    kept: torch.Tensor
    slots: int
    evict_idx: torch.Tensor
    evict_valid: torch.Tensor
    priority: torch.Tensor | None = None
    merge_scores: object = None
    keeps_order: bool = False

    @property
    def protected(self) -> torch.Tensor:
        """[B, H_kv, S] bool: the entries the selection keeps whatever their scores (priority +inf)."""
        return self.priority == math.inf

    @functools.cached_property
    def _keep_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        return slots_of(self.kept, self.slots)

    @property
    def keep_idx(self) -> torch.Tensor:
        return self._keep_slots[0]

    @property
    def keep_valid(self) -> torch.Tensor:
        return self._keep_slots[1]

    def candidate_idx(self) -> torch.Tensor | None:
        """``keep_idx`` where :func:`keepkv.merging.cosine_nearest` would search only the kept slots of
        the planned layer (a prefill compression), else None: a decode step skips the sort."""
        return self.keep_idx if gathers_candidates(self.slots, self.kept.shape[-1]) else None



def rank_keys(priority: torch.Tensor) -> torch.Tensor:
    """[..., S] int64 keys, distinct along the last axis, whose ascending order is the reverse of
    a stable descending sort of the float32 ``priority`` [..., S] (finite where it matters):
    lower priority first, and among equal priorities the later slot first.

    The float's bits, flipped for negative values, order as the float does (-0.0 is first made
    +0.0, which it equals); the slot breaks ties in the low 32 bits.
    """
    bits = (priority.float() + 0.0).view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    size = priority.shape[-1]
    return ordered * 2**32 + torch.arange(size - 1, -1, -1, device=priority.device)


def plan_eviction(
    layer, priority: torch.Tensor, budget: tuple[torch.Tensor, int, int] | None = None, *, merge_scores=None,
    keeps_order: bool = False,
) -> EvictionPlan:
    """Keep the ``layer.budget`` live entries of highest ``priority`` [B, H_kv, S] per row and head.

    Each row and head drops its live - budget lowest live entries: one top-k of the few that
    leave rather than of the many that stay, whose indices are the evicted slots. Equal
    priorities leave in a fixed order (the later slot first, :func:`rank_keys`), so the plan does
    not depend on the top-k's size or on the other rows. Applied with :meth:`LayerStore.keep`, a
    budget that keeps everything changes nothing, bit for bit.

    No host sync: the top-k's size comes from the layer's host-side counters: S - min(budget),
    or, with the layer's own budgets, at most the tokens appended since its last compression
    (each compression leaves every row at its budget or under it, so none is further over it).
    That keeps a ragged batch's decode step (rows of unequal budgets) at the one entry a step
    adds instead of S - min(budget). A kept prompt's entries (``layer.frozen_entries()``) rank
    +inf: they always stay. ``budget``: (budget [B, H_kv], its max, its min) to use
    instead of the layer's (KVReviver's exact share). ``merge_scores`` and ``keeps_order`` go into
    the plan as they are (:class:`EvictionPlan`).
    """
    own = budget is None
    budget, capacity, min_budget = budget or (layer.budget, layer.capacity, layer.min_budget)
    frozen = layer.frozen_entries()
    if frozen is not None:  # a kept prompt: its entries always stay (its row's budget counts them)
        priority = priority.masked_fill(frozen, float("inf"))
    live = layer.live()
    size = live.shape[-1]
    most_dropped = max(0, size - min_budget)
    if own and layer.pending > 0:  # pending 0: a reload (KeepKV's refresh) or a gathered prompt
        most_dropped = min(most_dropped, layer.pending)
    if most_dropped == 1:  # a decode step: the lowest live entry, the later slot among equals (as rank_keys)
        finite = priority.float().clamp(max=torch.finfo(torch.float32).max)  # a protected entry ranks below an empty slot
        last_lowest = finite.masked_fill(~live, float("inf")).flip(-1).argmin(dim=-1, keepdim=True)  # argmin: the first
        lowest = (size - 1) - last_lowest
    else:
        keys = rank_keys(priority).masked_fill(~live, torch.iinfo(torch.int64).max)  # empty slots never leave
        lowest = keys.topk(most_dropped, dim=-1, largest=False).indices
    over = live.sum(-1) - budget  # [B, H_kv] entries each row and head must drop
    drops = (over > 0)[..., None] if most_dropped == 1 else torch.arange(most_dropped, device=live.device) < over[..., None]
    kept = live & ~torch.zeros_like(live).scatter_(-1, lowest, drops)  # top-k indices are distinct
    if most_dropped == 1:  # one entry per row and head (a decode step's plan): already in order
        # a row that drops one has a live entry, and the argmin prefers any live one to an empty slot
        evict_idx, evict_valid = lowest, drops
    else:
        evicted = drops & live.gather(-1, lowest)
        order = (lowest + (~evicted).long() * size).argsort(dim=-1)  # position order, evicted first
        evict_idx, evict_valid = lowest.gather(-1, order), evicted.gather(-1, order)
    return EvictionPlan(kept, min(size, capacity), evict_idx, evict_valid, priority, merge_scores, keeps_order)


def protected(layer, sinks: int, recent: torch.Tensor) -> torch.Tensor:
    """[B, H_kv, S] bool: the first ``sinks`` tokens and the ``recent`` [B, H_kv] newest ones.

    Sinks are capped by the budget, and recent by what the sinks leave, so protected entries
    never outnumber the budget.
    """
    budget = layer.open_budget  # a kept prompt's entries are kept anyway: the shares are of the rest
    sink_count = budget.clamp(max=sinks)
    recent = torch.minimum(recent, budget - sink_count)
    positions = layer.positions  # -1 exactly on empty slots, which the live mask takes out
    is_sink = positions < sink_count[..., None]
    is_recent = positions >= (layer.real_seen[:, None, None] - recent[..., None])
    return (is_sink | is_recent) & layer.live()


def prompt_tail(layer, window: int, taken: torch.Tensor) -> torch.Tensor:
    """[B, H_kv, S] bool: each row's last ``window`` prompt tokens (the prompt's end as
    :func:`note_prompt_end` recorded it, its newest tokens where none was), capped by what the
    budget leaves after ``taken`` [B, H_kv] other protected entries. A kept prompt's entries are
    kept anyway (``decoding="keep_prompt"``): none then."""
    if layer.frozen is not None:
        return torch.zeros_like(layer.live())
    prompt_seen = layer.state.get("prompt_seen", layer.real_seen)[:, None, None]  # [B, 1, 1]
    count = (layer.open_budget - taken).clamp(min=0, max=window)[..., None]  # [B, H_kv, 1]
    positions = layer.positions
    return (positions >= prompt_seen - count) & (positions < prompt_seen) & layer.live()


def note_prompt_end(layer) -> None:
    """Record the tokens each row has seen as its prompt ends (``layer.state["prompt_seen"]`` [B]):
    what :func:`generated_recent_count` counts generated tokens from. Call it from ``observe`` at the
    prefill."""
    layer.state["prompt_seen"] = layer.real_seen.clone()


def generated_recent_count(layer, window: int) -> torch.Tensor:
    """[B, H_kv] how many of the newest tokens to protect: up to ``window``, counting only those that followed the
    prompt (:func:`note_prompt_end`): 0 at the prompt's own compression, then up to ``window`` as
    tokens are generated. A layer with no prompt recorded protects the newest ``window``."""
    prompt_seen = layer.state.get("prompt_seen")
    generated = layer.real_seen if prompt_seen is None else layer.real_seen - prompt_seen  # [B]
    return generated.clamp(min=0, max=window)[:, None].expand_as(layer.budget)


def pool_group(probs: torch.Tensor, row_dim: int | None = None) -> torch.Tensor:
    """Pool attention over a GQA group (mean over the g query heads), summing query rows first.

    probs [B, H_kv, g, (r,) S] -> [B, H_kv, S].
    """
    if row_dim is not None:
        probs = probs.sum(row_dim)
    return probs.mean(2)


@dataclass(frozen=True)
class ScoredSelection(Selection):
    """A selection that keeps sinks, a recent window and the highest-ranked of the rest.

    Subclasses say how many recent tokens to protect (``recent_count``) and, if they rank by
    score (``scored = True``), how scores are accumulated (``observe``, into the per-entry extra
    ``"score"``); an unscored one (window, StreamingLLM) ranks every unprotected entry alike.
    """

    sinks: int = 0

    def __post_init__(self):
        super().__post_init__()
        check_range("sinks", self.sinks, 0, math.inf)

    def protected_entries(self) -> int:
        return self.sinks

    def setup_layer(self, layer) -> None:
        if self.scored:
            layer.add_extra("score")

    def entry_extras(self, group: int) -> dict[str, Extra]:
        return {"score": Extra()} if self.scored else {}

    def recent_count(self, budget: torch.Tensor) -> torch.Tensor:
        """[B, H_kv] recent tokens always kept."""
        return torch.zeros_like(budget)

    def priority(self, layer, merge_scores=None) -> torch.Tensor:
        """[B, H_kv, S]: +inf for protected entries, else the score."""
        is_protected = protected(layer, self.sinks, self.recent_count(layer.open_budget))
        score = layer.extras["score"] if self.scored else torch.zeros_like(layer.bias)
        return score.masked_fill(is_protected, float("inf"))


def keep_prompt_refusal(method: Method) -> str | None:
    """Why ``method`` cannot keep a prompt whole (``decoding="keep_prompt"``), in one line, or None:
    it needs a selection with a merge that ``keeps_prompt``, no periodic refresh (which rebuilds
    every entry) and a selection scored without a reconstruction pass (it would score no prompt)."""
    merging = method.merging
    if merging is None or not merging.keeps_prompt:
        kept = ", ".join(name for name, merge in MERGES.items() if merge.keeps_prompt)
        return f"decoding='keep_prompt' runs a selection that evicts or ZIP-merges (merge {kept}), got {method.name!r}"
    if merging.refresh_interval is not None:
        return "decoding='keep_prompt' cannot keep a prompt through refresh_interval (it rebuilds every entry)"
    if method.needs(True).reconstruct:
        return (f"decoding='keep_prompt' scores no prompt, and {method.name} scores only prompts (its "
                "reconstruction pass): use another selection")
    return None


def serving_refusal(method: Method, keep_prompt: bool = False) -> str | None:
    """Why the paged adapter (``keepkv.paged``) cannot serve ``method``, in one line that reads after
    "does not serve ", or None; with ``keep_prompt`` (prompts kept whole), also
    :func:`keep_prompt_refusal`'s sentence. Read from what the method and its parts declare.

    A method is served when it is (``Method.served``: for a selection and a merge, the pair it is
    registered with) and, for a variant, when the selection and merge it runs are too; not when its
    merge rebuilds layers from a full copy (``refresh_interval``). A method that says why it is not
    served (``not_served``) is refused in its own words."""
    name = method.name or type(method).__name__
    if method.not_served:
        return f"{name}: {method.not_served}"
    if not method.served:
        if method.merging is None:
            return f"{name}: it is no selection with a merge"
        kind, part = next((kind, part) for kind, part in (("selection", type(method).default_part("selection")),
                                                            ("merge", type(method).default_part("merging")))
                          if not part.served)
        return f"{name}: the {kind} it is registered with, {part.name!r}, is not served"
    for kind, part in (("selection", method.selection), ("merge", method.merging)):
        if not part.served:
            return f"{name}: its {kind} {part.name!r} is not served"
    if method.merging.refresh_interval is not None:
        return "refresh_interval (it keeps a full copy of the cache)"
    refused = method.selection.serving_refusal()
    if refused is not None:
        return f"{name}: {refused}"
    if method.allocates_from_all_layers:  # a served selection's variant (learned+budgets=layers)
        return (f"{name}: layer budgets drawn from every layer's scores (a request is sized from its prompt's "
                "length alone; use budgets='uniform')")
    return keep_prompt_refusal(method) if keep_prompt else None


def served_names() -> tuple[list[str], list[str], list[str]]:
    """(methods, selections, merges) registered and served, in the order they were registered."""
    return ([name for name, cls in METHODS.items() if issubclass(cls, ComposedMethod) and cls().served],
            [name for name, cls in SELECTIONS.items() if cls.served],
            [name for name, cls in MERGES.items() if cls.served])
