"""Budget arithmetic, in one place: how a budget becomes entry counts per layer, row and head, and
how many entries a layer holds while it decodes.

- :func:`row_budgets`: each row's mean budget per layer and head (a fraction of its prompt, with
  the floor of :func:`budget_floor`, or a count);
- :func:`layer_budgets`: the method's allocation over layers and heads, fitted to the prompt
  (:func:`fit_to_prompt`);
- the decode schedule: a layer compresses every ``interval`` decode steps down to its budget less
  interval - 1 entries, so that it never holds more than its budget between steps
  (``keepkv.step.LayerStep.set_budget``, :func:`held_entries`, :func:`capacity_bound`).

The cache (keepkv.cache), a serving scheduler (``capacity_bound``, :class:`RequestSizes`) and the
paged adapter (keepkv.paged) all read these functions.
"""

from __future__ import annotations

import functools

import torch

from .checks import MAX_COUNT, as_int, is_int, shown, validate_budget  # noqa: F401 (validate_budget: this module's API)

# The budget floor: a fractional budget keeps at least the method's protected tokens plus this
# many scored entries per layer and head. A fraction of a short prompt (a chat template around a
# one-line question is ~40 tokens) would otherwise leave fewer entries than the method always
# keeps (keepkv, snapkv, pyramidkv: 32), and the answer is garbage; with the floor, a prompt no
# longer than it is not compressed at all (as PyramidKV's code, which compresses only prompts
# longer than its capacity). An int budget is an exact entry count and has no floor.
SCORED_FLOOR = 32


# The largest int budget (entries per layer and head): no context comes near it, so it keeps
# everything, as a full cache does. A larger one is refused in one line, not clamped.
MAX_BUDGET = MAX_COUNT


def budget_floor(method) -> int:
    """Fewest entries per layer and head a fractional budget gives a row (see ``SCORED_FLOOR``)."""
    return method.protected_entries() + SCORED_FLOOR


def check_budget_holds(method, budget: int | float) -> None:
    """Raise ValueError, in one line, when an entry budget cannot hold the entries ``method`` keeps
    whatever their scores (its sinks and fixed recent window, ``protected_entries()``): every
    compressed prompt would lose part of them, and the answers are garbage. A fraction never goes
    below them (the budget floor). The rule of the command line, ``keepkv.generate`` and serving;
    a ``CompressedCache`` built by hand only warns (experiments at tiny budgets)."""
    protected = method.protected_entries()
    if isinstance(budget, int) and not isinstance(budget, bool) and budget < protected:
        hint = " (an int budget is an entry count; 1.0 compresses nothing)" if budget == 1 else ""
        raise ValueError(
            f"budget {budget}{hint} keeps {budget} per layer and head, fewer than {method.name}'s {protected} "
            f"protected tokens (sinks + recent window): give at least {protected} entries, or a fraction "
            f"(it never keeps fewer than {budget_floor(method)})"
        )


def check_full_budget(method, budget: int | float) -> None:
    """Raise ValueError, in one line, when the full cache is given a budget other than 1.0: it
    keeps every entry, and a budget would be ignored without a word."""
    if method.name == "full" and not (isinstance(budget, float) and budget == 1.0):
        raise ValueError(f"method 'full' keeps every entry and takes no budget, got budget={shown(budget)}: leave "
                         "it at 1.0, or name a method that compresses")


def budget_for(spec: str, budget: int | float) -> int | float:
    """The budget a method (a name or variant) runs at beside others (a bench row): ``budget``, or
    1.0 for ``full``."""
    return 1.0 if spec.split("+")[0] == "full" else budget


def floor_warning(method, budget: int | float) -> str | None:
    """One line when an entry budget holds the method's protected entries but is under its budget
    floor (so few entries are left to choose by score that answers may suffer); None otherwise."""
    floor = budget_floor(method)
    if isinstance(budget, int) and not isinstance(budget, bool) and budget < floor:
        return (f"budget {budget} is under {method.name}'s budget floor of {floor} entries ({method.protected_entries()} "
                f"protected + {SCORED_FLOOR} chosen by score): a prompt longer than {budget} tokens keeps {budget} "
                "entries per layer and head, and its answers may suffer; a fraction never goes below the floor")
    return None


def row_budgets(budget: int | float, prompt_lengths: torch.Tensor, floor: int = 0) -> torch.Tensor:
    """[B] entries per layer and head each row may keep: a fraction of its prompt, but at least
    ``floor`` (:func:`budget_floor`) and 1; or a count. A row whose prompt is no longer than its
    budget is not compressed, and keeps up to its budget while it decodes. 1.0 bounds nothing:
    ``MAX_BUDGET``, as the full cache keeps every token, the generated ones too."""
    if isinstance(budget, float) and budget == 1.0:
        return torch.full_like(prompt_lengths, MAX_BUDGET)
    if isinstance(budget, float):
        return (prompt_lengths.double() * budget).round().long().clamp(min=max(1, floor))
    return torch.full_like(prompt_lengths, budget)


def fit_to_prompt(budgets: torch.Tensor, mean_budget: torch.Tensor, prompt_lengths: torch.Tensor) -> torch.Tensor:
    """Layer budgets [L, B, H_kv] that never exceed their row's prompt, with the same mean.

    A budget above the prompt would keep nothing more than the whole prompt, and its excess would
    be lost (PyramidKV's largest layers, at high budgets). Each row's budgets are pulled towards
    its uniform ``mean_budget`` [B], b + λ (a - b), with the largest λ <= 1 that fits the prompt
    [B]: the shape of the allocation is kept, only flattened, and the mean stays b (KVCache-Factory
    instead falls back to uniform budgets when its pyramid does not fit). Cumulative rounding over
    layers keeps the total.
    """
    mean = mean_budget.double()[None, :, None]
    cap = prompt_lengths.double()[None, :, None]
    deviation = budgets.double() - mean
    room = torch.where(deviation > 0, (cap - mean).clamp(min=0) / deviation, torch.inf)
    shrink = room.amin(dim=(0, 2), keepdim=True).clamp(max=1.0)  # λ per row
    fitted = mean + shrink * deviation
    cumulative = fitted.cumsum(0).round()
    rounded = torch.diff(cumulative, dim=0, prepend=torch.zeros_like(cumulative[:1]))
    return torch.where(shrink < 1, rounded.clamp(min=1).minimum(cap), budgets.double()).long()


def layer_budgets(
    method, layers: int, kv_heads: int, budget: int | float, prompt_lengths: torch.Tensor,
    scores: list | None = None,
) -> torch.Tensor | None:
    """[L, B, H_kv] entries each layer, row and head keeps: the method's allocation, fitted to the
    prompt; None when the method never compresses. ``scores``: each layer's
    ``method.allocation_scores`` after its prefill, for a method that allocates from them (D2O, KVzip)."""
    per_row = row_budgets(budget, prompt_lengths, budget_floor(method))
    budgets = method.allocate(layers, kv_heads, per_row, prompt_lengths, scores)
    if budgets is None:
        return None
    budgets = fit_to_prompt(budgets, per_row, prompt_lengths)
    # A prompt that fits its mean budget is not compressed in any layer (as PyramidKV's code).
    fits = (prompt_lengths <= per_row)[None, :, None]
    return torch.where(fits, per_row[None, :, None], budgets)


def check_keep_prompt(method, budget) -> None:
    """Raise ValueError, in one line, unless ``method`` can keep a prompt whole and keep ``budget``
    generated entries (decoding="keep_prompt"): what its merge and selection declare
    (:func:`keepkv.methods.base.keep_prompt_refusal`), and an int budget that holds its protected
    entries."""
    from .methods.base import keep_prompt_refusal

    reason = keep_prompt_refusal(method)
    if reason:
        raise ValueError(reason)
    if not is_int(budget):
        raise ValueError(f"decoding='keep_prompt' keeps the prompt whole and `budget` generated entries per layer "
                         f"and head: give an int, got {shown(budget)}")
    check_budget_holds(method, int(budget))


def kept_prompt_budgets(layers: int, kv_heads: int, generated: int, prompt_lengths: torch.Tensor) -> torch.Tensor:
    """[L, B, H_kv] budgets of decoding="keep_prompt": each row's prompt plus ``generated`` entries."""
    return (prompt_lengths + generated)[None, :, None].expand(layers, -1, kv_heads).contiguous()


def prompt_budgets(
    method, budget: int | float, decoding: str, layers: int, kv_heads: int, prompt_lengths: torch.Tensor,
    scores: list | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The budgets a cache sets when its rows' prompts end, the one rule of both caches
    (``keepkv.cache`` and ``keepkv.paged``): ([L, B, H_kv] entries each layer, row and head keeps,
    or None when the method never compresses; [B] each row's mean budget, what a recent window is
    a share of). ``decoding``: as ``CompressedCache(decoding=...)``; with "keep_prompt" each row
    keeps its prompt plus ``budget`` generated entries, and its mean budget is ``budget``.
    ``scores``: each layer's ``method.allocation_scores`` after its prefill (D2O, KVzip allocate from them)."""
    if decoding == "keep_prompt":
        return (kept_prompt_budgets(layers, kv_heads, budget, prompt_lengths),
                torch.full_like(prompt_lengths, budget))
    per_row = row_budgets(budget, prompt_lengths, budget_floor(method))
    if isinstance(budget, float) and budget == 1.0:  # the identity: nothing is compressed, ever
        return None, per_row
    return layer_budgets(method, layers, kv_heads, budget, prompt_lengths, scores), per_row


def decode_interval(interval: int, budgets: torch.Tensor, frozen: torch.Tensor | None = None,
                    protected: int = 0) -> int:
    """Every how many decode steps a layer of budgets ``budgets`` [B, H_kv] compresses: the
    method's ``interval``, but no more than half its smallest budget (beyond a kept prompt,
    ``frozen`` [B]) less its ``protected`` entries (``Method.protected_entries``: sinks, a recent
    window), so that a compression (``LayerStep.set_budget``: to budget - (interval - 1)) keeps
    them and at least half of its scored entries; 1 where the budget holds no more than them.
    One host read: at a prompt's end, never in a decode step."""
    open_budget = budgets if frozen is None else budgets - frozen[:, None].to(budgets.device)
    return max(1, min(interval, (int(open_budget.min()) - protected) // 2))


def held_entries(kept: int, prompt_length: int, computed: int, interval: int) -> int:
    """Entries a layer of budget ``kept`` holds per head after ``computed`` tokens (prompt
    included), between attention calls: min(P + t, kept - (interval - 1) + t mod interval) after
    t decode steps (``keepkv.step.LayerStep.set_budget``: it compresses every ``interval`` steps, to
    ``interval`` - 1 below its budget). A prompt no longer than that target is left whole."""
    decoded = computed - prompt_length
    return min(computed, kept - (interval - 1) + decoded % interval)


def capacity_bound(method, prompt_length: int, budget: int | float, config, keep_prompt: bool = False) -> list[int] | None:
    """The most entries each layer of one request holds per KV head while it decodes, known before
    the model runs: what a serving scheduler must reserve (``docs/serving.md``).

    A layer compresses every ``interval`` steps to ``interval`` - 1 below its budget
    (``keepkv.step.LayerStep.set_budget``): budget + 1 at the attention call that compresses,
    whatever the interval. The prefill holds the layer's whole prompt once; that peak is the
    prefill's reservation, not this bound. Layer
    budgets drawn from the prompt's attention (D2O) are bounded by the prompt. None: the method
    never compresses (``full``), and the request grows with every token.

    method: a Method or a registered name; config: the model's HF config (depth, KV heads);
    keep_prompt: decoding="keep_prompt" (the prompt plus ``budget`` generated entries).
    """
    from .methods import Method, get_method  # the registry, imported when budgets are asked

    if isinstance(method, str):
        method = get_method(method)
    if not isinstance(method, Method):
        raise ValueError(f"method must be a keepkv.Method or a registered name, got {shown(method)}")
    budget = validate_budget(budget)
    prompt_length = as_int("prompt_length", prompt_length, low=1)
    layers = getattr(config, "num_hidden_layers", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    if not (is_int(layers) and is_int(kv_heads)):
        raise ValueError(f"config must be the model's transformers config (model.config), got {shown(config)}")
    lengths = torch.tensor([prompt_length])
    if keep_prompt:
        check_keep_prompt(method, budget)
        return [prompt_length + budget + 1] * layers
    if method.allocates_from_all_layers:
        per_row = row_budgets(budget, lengths, budget_floor(method))
        budgets = torch.maximum(per_row, lengths).expand(layers, 1, kv_heads)
    else:
        budgets = layer_budgets(method, layers, kv_heads, budget, lengths)
        if budgets is None:
            return None
    return (budgets.amax(dim=(1, 2)) + 1).tolist()


class RequestSizes:
    """Entries per head a layer of one request holds after any number of tokens, from token counts
    alone, as a :class:`~keepkv.cache.CompressedCache` of that request alone holds them: what an
    engine's scheduler sizes a request's blocks by, and the paged adapter its slots (``method``,
    ``budget``, ``config`` and ``keep_prompt`` as :class:`~keepkv.paged.PagedCompression`'s)."""

    def __init__(self, method, budget, config, keep_prompt: bool):
        self.method, self.budget, self.config, self.keep_prompt = method, budget, config, keep_prompt
        self.decoding = "keep_prompt" if keep_prompt else "compress"
        self._kept: dict[int, tuple[list[int], int]] = {}  # prompt length -> (entries each layer keeps, mean)
        self._intervals: dict[int, list[int]] = {}  # prompt length -> each layer's decode steps between compressions

    @functools.cached_property
    def layered(self) -> bool:
        """Whether the layers may keep budgets of their own: the selection allocates them (PyramidKV,
        KeepKV's EMA selection); a kept prompt's budgets are the same in every layer."""
        return not self.keep_prompt and self.method.selection.layered

    def kept(self, prompt_length: int, layer: int = 0) -> int:
        """Entries per head ``layer`` keeps once compressed (:func:`keepkv.budgets.prompt_budgets`, the
        Hugging Face cache's rule; the same for every head of a layer, and for every layer but
        PyramidKV's), fixed by the prompt's length."""
        return self._budgets(prompt_length)[0][layer]

    def mean(self, prompt_length: int) -> int:
        """The request's mean budget per layer (what a recent window is a share of: the second of
        :func:`keepkv.budgets.prompt_budgets`), fixed by the prompt's length."""
        return self._budgets(prompt_length)[1]

    def _budgets(self, prompt_length: int) -> tuple[list[int], int]:
        if prompt_length not in self._kept:
            budgets, mean = prompt_budgets(self.method, self.budget, self.decoding, self.config.num_hidden_layers,
                                           self.config.num_key_value_heads, torch.tensor([prompt_length]))
            layers = self.config.num_hidden_layers
            self._kept[prompt_length] = ([MAX_BUDGET] * layers if budgets is None else budgets[:, 0, 0].tolist(),
                                         int(mean[0]))
        return self._kept[prompt_length]

    @functools.cached_property
    def compresses_chunks(self) -> bool:
        """Whether a prompt read in chunks is compressed after each chunk but its last, to its whole
        prompt's budget (the method ``compresses_chunks``; prompts compressed, not kept whole), as
        ``CompressedCache.start_prefill`` compresses it: :meth:`read`."""
        return not self.keep_prompt and self.method.compresses_chunks

    def read(self, prompt_length: int, computed: int, layer: int = 0) -> int:
        """Entries ``layer`` holds per head after its first ``computed`` tokens of a prompt of
        ``prompt_length`` read in chunks, each chunk before the one that ends the prompt compressed
        to the whole prompt's budget (:attr:`compresses_chunks`): min(computed, budget), since a
        layer under its budget is never compressed and one over it keeps its budget."""
        return min(computed, self.kept(prompt_length, layer))

    def interval(self, prompt_length: int, layer: int = 0) -> int:
        """Decode steps between ``layer``'s compressions (:func:`keepkv.budgets.decode_interval`: the
        method's, but no more than the layer's budget beyond a kept prompt), as the Hugging Face
        cache of that request alone compresses: a layer of a small budget compresses more often."""
        if prompt_length not in self._intervals:
            layers = self.config.num_hidden_layers
            frozen = prompt_length if self.keep_prompt else 0
            self._intervals[prompt_length] = [
                decode_interval(self.method.interval, torch.tensor([self.kept(prompt_length, each) - frozen]),
                                protected=self.method.protected_entries())
                for each in range(layers)]
        return self._intervals[prompt_length][layer]

    def stored(self, prompt_length: int, computed: int, layer: int = 0, closed: int | None = None) -> int:
        """Entries ``layer`` holds per head after ``computed`` tokens (prompt included).

        A layer keeps min(prompt, budget - (k - 1)) after the prefill, takes one entry per decode
        step and shrinks back every k = :meth:`interval` steps: min(P + t, budget - (k - 1) + t mod
        k) after t decode steps (:func:`keepkv.budgets.held_entries`), never more than its budget
        (k: the layer's own).
        ``closed``: the tokens it held at its close when more than its prompt (``keep_prompt``, a
        replay after a preemption: :class:`~keepkv.paged_requests.PagedBatch`); t counts from
        there, and every entry is held until its first compression, ``interval`` steps later.
        """
        closed = prompt_length if closed is None else closed
        interval = self.interval(prompt_length, layer)
        if self.keep_prompt and computed - closed < interval:
            return computed  # nothing compressed since its close (a kept prompt's close compresses nothing)
        return held_entries(self.kept(prompt_length, layer), closed, computed, interval)

    def capacity(self, prompt_length: int, layers: tuple[int, ...] | None = None) -> int:
        """Slots a request needs at most (``keepkv.capacity_bound``, the largest layer; of
        ``layers`` alone when given: an engine's group of layers with blocks of their own)."""
        bound = capacity_bound(self.method, prompt_length, self.budget, self.config, self.keep_prompt)
        return max(bound if layers is None else [bound[layer] for layer in layers])
