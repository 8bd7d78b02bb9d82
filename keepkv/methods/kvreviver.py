"""KVReviver: reversible compression with a Count-Sketch "vague" store, rebuilt per layer.

Yuan et al., "KVReviver: Reversible KV Cache Compression with Sketch-Based Token
Reconstruction" (2025). No public code exists; this follows the paper's text,
Algorithms 1-4 and its appendix ("Parameter Settings", "Fisher Information").

Per layer, row and KV head the tokens live in three parts:

* **Recent** - the newest tokens, exact. They are the stored entries whose position is
  among the ``R`` newest of the row.
* **Candidate** - the highest accumulated-attention tokens, exact: the other stored
  entries (plus ``sinks`` pinned leading tokens, 0 as in the paper).
* **Vague** - every other token, in a Count Sketch of ``rows`` x ``buckets`` slots
  (:class:`keepkv.sketch.CountSketch`, kept in ``layer.state["sketch"]``). Per vague token
  only scalars are kept, in ``layer.state``: its position (``"vague_pos"``, int32, -1 for
  an empty slot) and its accumulated score (``"vague_score"``, fp32, -inf when empty),
  both [B, H_kv, T_vague]. Its vectors exist only in the sketch.

Recent + Candidate are the LayerStore's live entries, so everything the core does with
them (append, bias, positions, budget checks) is unchanged; the per-entry extra
``"score"`` holds their accumulated attention.

What is reversible and what is not
----------------------------------
* Nothing is evicted outright: every token seen is either stored exactly or held by the
  sketch, and is attended to at every step (``live + vague == tokens seen``, tested).
  The exception is ``vague_share=0`` with no ``buckets``: there is no sketch and the
  method is a plain eviction method (H2O's selection with KVReviver's split).
* Vague tokens come back *approximately*: a token is rebuilt exactly only when it shares
  its slot with no other vague token in at least 2 of the 3 sketch rows (median). With
  collisions, keys carry the sum of the colliding keys (keys are unsigned, as in the
  paper, so that error is biased unless keys have zero mean), values carry a zero-mean
  signed sum.
* A swap-back (Algorithm 3) moves a vague token's *estimate* into the exact store: its
  collision error is frozen there for good, and the sketch keeps the residual
  (true - estimate) in that token's slots, which later adds to the estimates of tokens
  that share them. With no collision both are exact.
* The sketch accumulates in fp32 whatever the cache's dtype: in bf16 a bucket summing
  hundreds of keys would round to about one key's size. In a bf16/fp16 cache its r*b buckets
  therefore take twice the bytes of r*b entries, beyond the share of the budget they are
  charged (``cache.nbytes()`` reports what is held).

How the paper's estimate and the ``"mean"`` default compare on the embedded model: docs/methods.md,
"KVReviver" (the paper's estimate is ``kvreviver+estimate=sum``).

Algorithm 3 (compress), per row and head, vectorised over all rows and heads
----------------------------------------------------------------------------
1. New tokens are appended to the store (they are Recent).
2. Recent spills to Candidate, Candidate over budget goes to Vague: one top-k over the
   stored entries keeps the sinks, the ``R`` newest and the highest-scoring others up to
   the exact budget; the rest are inserted into the sketch (one batched scatter-add).
   The paper spills Recent "in bulk" once it exceeds its budget by a *slack*: here
   compression runs every ``interval`` tokens, so Recent grows to ``R + interval - 1``
   between compressions and spills ``interval`` tokens at once: the paper's slack is
   ``interval - 1``.
3. Swap-back: while min(candidate score) x ``replace_rate`` < max(vague score), the best
   vague token is queried out of the sketch, its estimate deleted, and the worst candidate
   inserted in its place. The paper writes this as a sequential loop; with non-negative
   scores and ``replace_rate >= 1`` it is exactly one sorted exchange: sort candidates
   ascending (c_1 <= c_2 <= ...) and vague tokens descending (v_1 >= v_2 >= ...); the loop
   swaps c_i with v_i for the prefix of i where c_i x rate < v_i (see
   :func:`swap_counts`; checked against the loop in the tests). The k swapped tokens are
   queried from the sketch state before the exchange (the paper's loop re-queries after
   each swap; the two differ only where swapped tokens collide).
   The swap check runs at every compression, i.e. every ``interval`` tokens (the paper:
   every token).

Algorithm 4 (rebuild)
---------------------
:meth:`KVReviver.attention_entries` queries every vague token from the sketch and
*prepends* them to the stored entries for this one attention call. The paper rebuilds the
T tokens in positional order; attention is a sum over entries, so the order does not
matter (bar float summation order), and prepending keeps the core's rule that the new
block comes last. The query is one gather per chunk of tokens from a per-slot table built
once per call (each slot's key and value already divided by its occupancy, next to its
negation: the sign g_j(t) picks a row of the table, so nothing is multiplied or divided
per token), then the median; bucket hashes of positions come from a cached table (one
gather instead of ~20 integer ops per token and row). The rebuilt tensors are referenced
only by that call and freed before the next layer runs, so at most one layer's full-length
cache exists at a time. :class:`RebuildTracker` measures that with tensor byte accounting
(weak references on the rebuilt tensors; :meth:`KVReviver.tracker_of` a cache's tracker).

Scores: accumulated attention, as H2O: prefill column sums, then every decode query's
probabilities, pooled over a GQA group by the mean (``pool_group``). Vague tokens are
attended to, so their scores keep accumulating too - that is what lets them swap back.

Budgets
-------
The budget N of a row, layer and head counts token entries (keys + values of one token).
The sketch costs ``rows x b`` entries, b = floor(vague_share x N / rows), at least 1 when
vague_share > 0; the exact part is E = N - rows x b, of which Recent gets
R = max(1, round(recent_share x N)) and Candidate the rest, E - R (its share plus the
rounding left-overs; it includes the sinks). Stored entries therefore stay within
E + slack <= N + slack, and stored + sketch within N + slack. A row whose tokens fit N keeps
them all exactly (its sketch stays empty) until it outgrows N: a fitting row is never touched. ``buckets`` fixes b
instead (an ablation knob: the sketch is then extra memory on top of N - the exact part
still follows the shares).

Beyond the N entries each vague token costs 8 bytes of scalars (int32 position, fp32
score): for head_dim 64 that is 1.6% (fp32) or 3% (bf16) of an entry per vague token -
at a 10% budget about 14% / 28% on top of the stored entries. They are what keeps every
token swappable back (its score) and rebuildable (its position), so they grow with every
token a row takes past its budget - 8 x H_kv x L bytes per generated token, 720 B on
SmolLM2-135M - while the stored entries and the sketch stay constant. ``LayerStore.nbytes``
(hence ``cache.nbytes()`` and ``summary().state_bytes``) counts them and the sketch.

Layer budgets (``allocation``): ``"fisher"`` (default, the paper's appendix) gives layer l
a share of L x N proportional to its Fisher score, at least the smallest workable budget;
``"uniform"`` gives every layer N. A method never touches the model, so the scores come
from :func:`fisher_scores` (``KVReviver.prepare(model)`` calls it), which computes them
once per model from its K/V projection weights and caches them by the model's config, or
from the ``layer_scores`` parameter. With neither, ``"fisher"`` warns and uses uniform.
The paper gives no formula for "the Fisher Information of the Key and Value weight
matrices"; by default the score is the squared Frobenius norm of W_k and W_v
(:func:`keepkv.sketch.fisher_layer_scores`, a weights-only stand-in), and with
``calibration_ids`` it is the empirical diagonal Fisher sum(grad^2) of the LM loss on
those tokens (Palu's estimator, which the paper cites).
"""

from __future__ import annotations

import math
import warnings
import weakref
from dataclasses import dataclass

import torch

from ..attention import Needs
from ..sketch import CountSketch, fisher_layer_scores, median_rows, proportional_budgets
from ..store import NEG_INF
from .base import Extra, Method, check_range, plan_eviction, pool_group, register

# Rebuilding vague tokens: the per-row sketch estimates of one chunk ([B, H_kv, c, r, D] for
# keys and values) stay within this fraction of the rebuilt layer, with chunks of at least
# QUERY_CHUNK_MIN tokens (see KVReviver.rebuild_vague).
REBUILD_WORKSPACE_FRACTION = 0.25
QUERY_CHUNK_MIN = 16


# ------------------------------------------------------------------------------- sketch


class RaggedSketch(CountSketch):
    """A CountSketch whose number of buckets in use differs per (row, head).

    ``active`` [B, H_kv] long: buckets b of each row and head (<= the tensor's b_max).
    Token t goes to bucket H(t) mod b of its own row and head, so a row of a batch hashes
    exactly as it would alone, whatever the other rows' budgets. Only the bucket hash is
    changed (``CountSketch._hashes``); insert/delete/query/pop are the base class's.
    """

    active: torch.Tensor | None = None

    def _hashes(self, token_ids, limit=None):
        if self.active is None:
            return super()._hashes(token_ids, limit)
        h = self._raw_hashes(token_ids, limit)  # [B, H, N, 2, r]
        buckets = h[..., 0, :] % self.active[:, :, None, None]
        signs = (1 - 2 * ((h[..., 1, :] >> 31) & 1)).to(self.keys.dtype)
        return buckets, signs


# ----------------------------------------------------------------------- memory tracking


class RebuildTracker:
    """Tensor byte accounting of the rebuilt (full-length) caches.

    Every rebuilt tensor is registered with a weak-reference finaliser, so ``live`` is the
    bytes of rebuilt tensors that still exist and ``peak`` the most that ever existed at
    once (plus the query workspace of the rebuild in progress).
    """

    def __init__(self):
        self.live = 0
        self.peak = 0

    def _release(self, nbytes: int) -> None:
        self.live -= nbytes

    def track(self, tensors) -> int:
        """Count ``tensors`` as live until they are freed; returns their bytes."""
        total = 0
        for tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            self.live += nbytes
            total += nbytes
            weakref.finalize(tensor, self._release, nbytes)
        self.peak = max(self.peak, self.live)
        return total


# --------------------------------------------------------------------------- swap-back


def swap_counts(cand_sorted: torch.Tensor, vague_sorted: torch.Tensor, rate: float) -> torch.Tensor:
    """[..., K] bool: which pairs Algorithm 3's swap loop exchanges.

    ``cand_sorted`` candidate scores ascending (+inf pads), ``vague_sorted`` vague scores
    descending (-inf pads), both [..., K]. The loop "while min(C) x rate < max(V): swap"
    exchanges c_i and v_i for i = 1..k, k the length of the prefix where c_i x rate < v_i
    (for scores >= 0 and rate >= 1: a token swapped in is never the next to leave, and one
    swapped out never the next to come back).
    """
    wins = cand_sorted * rate < vague_sorted
    return wins.long().cumprod(-1).bool()


# ------------------------------------------------------------------------------ Fisher


def _kv_projections(model):
    """(k_proj weights, v_proj weights), one per layer, in layer order."""
    found = {}
    for module in model.modules():
        if hasattr(module, "k_proj") and hasattr(module, "v_proj") and hasattr(module, "layer_idx"):
            found[module.layer_idx] = module
    if not found:
        raise ValueError("found no attention modules with k_proj/v_proj in the model")
    ordered = [found[i] for i in sorted(found)]
    return [m.k_proj.weight for m in ordered], [m.v_proj.weight for m in ordered]


def fisher_scores(model, calibration_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Per-layer Fisher scores [L] of ``model``'s K/V projections.

    Without ``calibration_ids``: squared Frobenius norms ||W_k||^2 + ||W_v||^2 (see
    :func:`keepkv.sketch.fisher_layer_scores`). With ``calibration_ids`` [B, T]: the
    empirical diagonal Fisher, sum over W_k and W_v entries of (dL/dW)^2 for the LM loss
    on those tokens.
    """
    config = model.config
    k_weights, v_weights = _kv_projections(model)
    if calibration_ids is None:
        scores = fisher_layer_scores(k_weights, v_weights)
    else:
        params = k_weights + v_weights
        flags = [p.requires_grad for p in params]
        grads = [torch.zeros_like(p, dtype=torch.float64) for p in params]
        implementation = config._attn_implementation
        if implementation == "keepkv":  # the keepkv path needs a CompressedCache; use SDPA here
            model.set_attn_implementation("sdpa")
        try:
            with torch.enable_grad(), torch.inference_mode(False):
                for p in params:
                    p.requires_grad_(True)
                for row in calibration_ids:  # one sequence at a time: the per-example Fisher
                    ids = row[None].to(next(model.parameters()).device)
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                    for acc, g in zip(grads, torch.autograd.grad(loss, params)):
                        acc += g.double() ** 2
        finally:
            for p, flag in zip(params, flags):
                p.requires_grad_(flag)
            if implementation == "keepkv":
                model.set_attn_implementation("keepkv")
        half = len(k_weights)
        scores = fisher_layer_scores(k_weights, v_weights, k_fisher=grads[:half], v_fisher=grads[half:])
    return scores


# ------------------------------------------------------------------------------- method



@register
@dataclass
class KVReviver(Method):
    """KVReviver (Yuan et al., "KVReviver: Reversible KV Cache Compression with Sketch-Based
    Token Reconstruction", 2025). See the module docstring for the design.

    Parameters
    ----------
    recent_share, candidate_share, vague_share : float
        Shares of each row/layer/head budget for Recent, Candidate and the Vague sketch;
        they must sum to 1 (paper, Tables 2-3 at a 10% budget: 0.45, 0.45, 0.1).
    rows : int
        Sketch rows r, one hash function each (paper: 3).
    buckets : int or None
        Buckets b per sketch row. None: b = floor(vague_share x budget / rows), >= 1 when
        vague_share > 0, charged to the budget. An int fixes b for every row and head; the
        sketch is then *extra* memory (ablations, exactness tests).
    replace_rate : float
        A vague token swaps back when its score exceeds the lowest candidate score times
        this (paper: 1.1; must be >= 1).
    estimate : str
        ``"mean"`` (default) or ``"sum"`` (paper). ``"sum"``: a slot holds the sum of its tokens' keys (and signed values) and
        a row's estimate is the slot itself. ``"mean"`` (not in the paper): the slot is
        divided by the number of vague tokens in it, so a colliding key is the mean of the
        keys sharing its slot instead of their sum (and values shrink by the same count);
        per-slot counts cost r x b floats. Identical when nothing collides.
    sinks : int
        Leading tokens pinned in Candidate (0: the paper has none).
    allocation : str
        ``"fisher"`` (paper) or ``"uniform"`` layer budgets.
    layer_scores : tuple of float or None
        Per-layer Fisher scores for ``"fisher"``; None: those :meth:`prepare` computed from the
        model (keepkv.generate and the eval call it), else uniform budgets with a warning.
    seed : int
        Seed of the sketch's hash functions (deterministic per seed).
    interval : int
        Compress every ``interval`` tokens; the Recent queue's slack is ``interval - 1``.
    """

    name = "kvreviver"
    paper = "Yuan et al. 2025, KVReviver (sketch-based reversible KV compression)"
    recent_share: float = 0.45
    candidate_share: float = 0.45
    vague_share: float = 0.1
    rows: int = 3
    buckets: int | None = None
    replace_rate: float = 1.1
    estimate: str = "mean"
    sinks: int = 0
    allocation: str = "fisher"
    layer_scores: tuple | None = None
    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        for share in ("recent_share", "candidate_share", "vague_share"):
            check_range(share, getattr(self, share), 0.0, 1.0)
        check_range("vague_share", self.vague_share, 0.0, 1.0, high_open=True)
        total = self.recent_share + self.candidate_share + self.vague_share
        if abs(total - 1.0) > 1e-6:
            raise ValueError(
                f"recent_share + candidate_share + vague_share must sum to 1, got "
                f"{self.recent_share} + {self.candidate_share} + {self.vague_share} = {total:g}"
            )
        check_range("rows", self.rows, 1, math.inf)  # types: check_field_types
        if self.buckets is not None:
            check_range("buckets", self.buckets, 1, math.inf)
        check_range("replace_rate", self.replace_rate, 1.0, math.inf)
        check_range("sinks", self.sinks, 0, math.inf)
        if self.estimate not in ("sum", "mean"):
            raise ValueError(f"estimate must be 'sum' or 'mean', got {self.estimate!r}")
        if self.allocation not in ("fisher", "uniform"):
            raise ValueError(f"allocation must be 'fisher' or 'uniform', got {self.allocation!r}")
        if self.layer_scores is not None:
            scores = tuple(float(s) for s in self.layer_scores)
            if not scores or any(not math.isfinite(s) or s < 0 for s in scores):
                raise ValueError(f"layer_scores must be finite and >= 0, got {self.layer_scores!r}")
            self.layer_scores = scores
        self._warned_uniform = False
        self._model_scores = None  # Fisher layer scores of the model, set by prepare()

    # -- budgets -------------------------------------------------------------------------
    def sketch_buckets(self, budget):
        """b charged to a budget N (tensor or int): floor(vague_share x N / r), >= 1 if share > 0."""
        if isinstance(budget, torch.Tensor):
            b = (budget.double() * self.vague_share / self.rows).floor().long()
            return b.clamp(min=1) if self.vague_share > 0 else torch.zeros_like(b)
        b = math.floor(budget * self.vague_share / self.rows)
        return max(b, 1) if self.vague_share > 0 else 0

    def min_budget(self) -> int:
        """Smallest budget whose exact part holds the sinks plus one recent token
        (for this and every larger budget), once a compression every ``interval`` steps keeps
        interval - 1 below it (:meth:`keepkv.step.LayerStep.set_budget`)."""
        need = self.sinks + 1
        if self.vague_share == 0:
            return need + self.interval - 1
        return max(need + self.rows, math.ceil(need / (1.0 - self.vague_share) - 1e-9)) + self.interval - 1

    def _check_mean_budget(self, smallest: int) -> None:
        if smallest < self.min_budget():
            raise ValueError(
                f"kvreviver needs a budget of at least {self.min_budget()} entries per layer and head "
                f"(sinks={self.sinks} plus one recent token, after the sketch's rows x buckets = "
                f"{self.rows} x {self.sketch_buckets(max(smallest, 1))}); got {smallest}"
            )

    def check_budget(self, cache) -> None:
        if isinstance(cache.budget, int):
            self._check_mean_budget(cache.budget)

    def allocate(self, layers, kv_heads, row_budget, prompt_lengths, scores=None):
        self._check_mean_budget(int(row_budget.min()))
        scores = None
        if self.allocation == "fisher":
            if self.layer_scores is not None:
                scores = torch.tensor(self.layer_scores, dtype=torch.float64)
            else:
                scores = self._model_scores
            if scores is None and not self._warned_uniform:
                warnings.warn(
                    "kvreviver: no Fisher layer scores for this model (call "
                    "keepkv.methods.kvreviver.fisher_scores(model) or method.prepare(model), or "
                    "pass layer_scores=...); using uniform layer budgets",
                    stacklevel=2,
                )
                self._warned_uniform = True
        if scores is None:
            return row_budget[None, :, None].expand(layers, -1, kv_heads).clone()
        if scores.numel() != layers:
            raise ValueError(f"layer_scores has {scores.numel()} entries, the model has {layers} layers")
        budgets = proportional_budgets(scores, row_budget * layers, self.min_budget())
        return budgets[:, :, None].expand(layers, -1, kv_heads).clone()

    def prepare(self, model, calibration_ids=None) -> None:
        """Compute the Fisher layer scores of ``model`` (see :func:`fisher_scores`) for ``allocate``."""
        if self.allocation == "fisher" and self.layer_scores is None:
            self._model_scores = fisher_scores(model, calibration_ids)

    # -- hooks -----------------------------------------------------------------------------
    def needs(self, is_prefill):
        return Needs(colsum=True) if is_prefill else Needs(probs=True)

    def setup_layer(self, layer) -> None:
        layer.add_extra("score")

    def entry_extras(self, group: int) -> dict[str, Extra]:
        return {"score": Extra()}

    def attention_entries(self, layer):
        """Stored entries with the vague tokens, rebuilt from the sketch, prepended."""
        state = layer.state
        sketch = state.get("sketch")
        vague_pos = state.get("vague_pos")
        if sketch is None or vague_pos is None or vague_pos.shape[-1] == 0:
            return layer.keys, layer.values, layer.bias
        batch, kv_heads, size, head_dim = layer.keys.shape
        count = vague_pos.shape[-1]
        keys = layer.keys.new_empty(batch, kv_heads, count + size, head_dim)
        values = layer.values.new_empty(batch, kv_heads, count + size, layer.values.shape[-1])
        keys[:, :, count:] = layer.keys
        values[:, :, count:] = layer.values
        vague_bias = torch.zeros_like(state["vague_score"]).masked_fill(vague_pos < 0, NEG_INF)
        bias = torch.cat([vague_bias, layer.bias], dim=-1)
        tracker = self.tracker_of(layer)
        rebuilt = tracker.track((keys, values, bias))
        workspace = self.rebuild_vague(state, vague_pos, keys, values, layer.seen, tracker)
        state["rebuilt_bytes"] = rebuilt
        state["peak_rebuilt_bytes"] = max(state.get("peak_rebuilt_bytes", 0), rebuilt + workspace)
        return keys, values, bias

    @staticmethod
    def tracker_of(layer) -> RebuildTracker:
        """The rebuild tracker of the layer's cache (one per cache, shared by its layers: caches that
        share a KVReviver instance are measured apart)."""
        return layer.shared.setdefault("kvreviver.rebuild_tracker", RebuildTracker())

    def rebuild_vague(self, state, token_ids, keys_out, values_out, limit: int, tracker=None) -> int:
        """Query ``token_ids`` [B, H_kv, n] from the layer's sketch into ``keys_out[:, :, :n]``
        and ``values_out[:, :, :n]`` (Algorithm 2: the r slots, values times their sign, the
        coordinate-wise median; see ``estimate``), in chunks so that the per-row estimates
        [B, H_kv, c, r, D_k + D_v] stay within REBUILD_WORKSPACE_FRACTION of the rebuilt layer
        (at least QUERY_CHUNK_MIN tokens a chunk). ``token_ids`` lie in [0, limit) or are -1
        (empty slots, masked by the caller). Returns the largest workspace in bytes, as counted by
        ``tracker`` (a RebuildTracker; a new one when None).
        """
        tracker = RebuildTracker() if tracker is None else tracker
        sketch = state["sketch"]
        rows, key_dim = sketch.rows, sketch.head_dim
        batch, kv_heads, count = token_ids.shape
        per_chunk = int(keys_out.shape[2] * REBUILD_WORKSPACE_FRACTION / rows)
        chunk = min(count, max(QUERY_CHUNK_MIN, per_chunk))
        table = self._slot_estimates(state)
        # Sketch row first: each row's estimates come out contiguous for the median.
        index = self._slots(sketch, token_ids, limit, signed=True).movedim(-1, 0)  # [r, B, H_kv, n]
        table_bytes, workspace = tracker.track((table,)), 0
        for start in range(0, count, chunk):
            stop = min(count, start + chunk)
            estimates = table.index_select(0, index[..., start:stop].reshape(-1))
            workspace = max(workspace, table_bytes + tracker.track((estimates,)))
            median = median_rows(estimates.view(rows, batch, kv_heads, stop - start, -1), dim=0, inplace=True)
            keys_out[:, :, start:stop] = median[..., :key_dim]
            values_out[:, :, start:stop] = median[..., key_dim:]
            del estimates, median
        return workspace

    @staticmethod
    def _slots(sketch, token_ids, limit=None, signed=False):
        """Flat slot index [B, H_kv, n, r]: into the sketch's slots [B, H_kv, r, b], or with
        ``signed`` into :meth:`_slot_estimates`'s [B, H_kv, r, 2, b] (1: the negated slot)."""
        batch, kv_heads, rows, buckets, _ = sketch.keys.shape
        bucket, sign = sketch._hashes(token_ids, limit)
        base = torch.arange(batch * kv_heads * rows, device=bucket.device).view(batch, kv_heads, 1, rows)
        if not signed:
            return base * buckets + bucket
        return base * (2 * buckets) + (sign < 0).long() * buckets + bucket

    def _slot_estimates(self, state):
        """[B * H_kv * r * 2 * b, D_k + D_v]: what each slot contributes to a query before the
        median (Algorithm 2), keys and values side by side: slot / occupancy for ``"mean"``,
        then the same negated (values; keys too with ``sign_keys``), so that one gather picks
        g_j(t) x slot. Per slot, not per token: r * b rows instead of n * r."""
        sketch = state["sketch"]
        keys, values = sketch.keys, sketch.values
        if self.estimate == "mean":
            occupancy = state["slot_counts"].clamp(min=1).to(keys.dtype)[..., None]
            keys, values = keys / occupancy, values / occupancy
        plus = torch.cat([keys, values], dim=-1)
        minus = torch.cat([-keys if sketch.sign_keys else keys, -values], dim=-1)
        return torch.stack([plus, minus], dim=3).view(-1, plus.shape[-1])

    def query(self, state, token_ids, limit=None):
        """Estimates [B, H_kv, n, D] of keys and values of ``token_ids`` (in [0, ``limit``) or
        masked by the caller, if given) from the layer's sketch."""
        table = self._slot_estimates(state)
        estimates = table.index_select(0, self._slots(state["sketch"], token_ids, limit, signed=True).reshape(-1))
        median = median_rows(estimates.view(*token_ids.shape, state["sketch"].rows, -1))
        key_dim = state["sketch"].head_dim
        return median[..., :key_dim], median[..., key_dim:]  # fp32: the caller casts to the cache dtype

    def _count(self, state, token_ids, mask, delta: float, limit=None) -> None:
        """Add ``delta`` to the occupancy of the slots of the masked ``token_ids`` ("mean")."""
        if self.estimate != "mean":
            return
        sketch = state["sketch"]
        flat = self._slots(sketch, token_ids, limit)
        weight = mask.to(torch.float32)[..., None].expand(flat.shape) * delta
        state["slot_counts"].view(-1).index_put_((flat.reshape(-1),), weight.reshape(-1), accumulate=True)

    def observe(self, layer, stats):
        scores = pool_group(stats.colsum) if stats.is_prefill else pool_group(stats.probs, row_dim=3)
        count = scores.shape[-1] - layer.size  # vague tokens prepended by attention_entries
        if count:
            layer.state["vague_score"] += scores[..., :count]
        layer.add_to("score", scores[..., count:])

    # -- compression -------------------------------------------------------------------------
    def _setup_split(self, layer) -> dict:
        """Derive Recent / exact / sketch sizes from the layer's budget, once."""
        state = layer.state
        budget = layer.budget
        charged = self.sketch_buckets(budget)
        exact = budget - self.rows * charged
        if bool((exact < self.sinks + 1).any()):
            raise ValueError(
                f"kvreviver: a budget of {int(budget.min())} entries leaves {int(exact.min())} exact "
                f"entries after the sketch ({self.rows} x {int(charged.max())}); need sinks + 1 = "
                f"{self.sinks + 1}"
            )
        recent = (budget.double() * self.recent_share).round().long().clamp(min=1)
        state["recent"] = torch.minimum(recent, exact - self.sinks)
        state["exact"] = exact
        state["exact_max"] = int(exact.max())
        # Rows take one token per step together, so row b fits its budget while the layer's
        # host-side length is at most this [B, H_kv]; no host sync per step to know it.
        state["fits_while_seen"] = layer.seen + budget - layer.real_seen[:, None]
        state["last_fit_seen"] = int(state["fits_while_seen"].max())
        state["exact_min"] = int(exact.min())
        buckets = torch.full_like(budget, self.buckets) if self.buckets is not None else charged
        state["buckets"] = buckets
        batch, kv_heads, _, head_dim = layer.keys.shape
        if int(buckets.max()) > 0:
            sketch = RaggedSketch.empty(
                batch, kv_heads, self.rows, int(buckets.max()), head_dim,
                # fp32 tables: a bucket sums many keys, which bf16 would round to about one key's size
                dtype=torch.float32, device=layer.keys.device, seed=self.seed,
            )
            sketch.active = buckets
            state["sketch"] = sketch
            if self.estimate == "mean":
                state["slot_counts"] = torch.zeros(
                    batch, kv_heads, self.rows, int(buckets.max()), dtype=torch.float32, device=layer.device
                )
            state["vague_pos"] = torch.full((batch, kv_heads, 0), -1, dtype=torch.int32, device=layer.device)
            state["vague_score"] = torch.full((batch, kv_heads, 0), NEG_INF, device=layer.device)
        else:
            state["sketch"] = None
        return state

    def select_rows(self, layer, index):
        """Per-row state and sketch follow their rows; the host-side extremes over the rows are
        recomputed for the rows now present."""
        state = super().select_rows(layer, index)
        if "exact" in state:
            state["exact_max"], state["exact_min"] = int(state["exact"].max()), int(state["exact"].min())
            state["last_fit_seen"] = int(state["fits_while_seen"].max())
        return state

    def protected(self, layer) -> torch.Tensor:
        """[B, H_kv, S] bool: sinks and the Recent part (the R newest tokens)."""
        positions = layer.positions
        recent = layer.state["recent"]
        is_sink = (positions >= 0) & (positions < self.sinks)
        is_recent = positions >= (layer.real_seen[:, None, None] - recent[..., None])
        return (is_sink | is_recent) & layer.live()

    def compress(self, layer, stats) -> None:
        state = layer.state if "exact" in layer.state else self._setup_split(layer)
        sketch = state["sketch"]
        if layer.size > state["exact_min"]:
            score = layer.extras["score"]
            priority = score.masked_fill(self.protected(layer), float("inf"))
            # A row whose tokens fit its budget keeps them all, exactly: nothing goes to the sketch.
            fits = layer.seen <= state["fits_while_seen"]
            exact = torch.where(fits, layer.budget, state["exact"])
            capacity = layer.capacity if layer.seen <= state["last_fit_seen"] else state["exact_max"]
            plan = plan_eviction(layer, priority, (exact, capacity, state["exact_min"]))
            if sketch is not None and plan.evict_idx.shape[-1]:
                self._to_vague(layer, plan.evict_idx, plan.evict_valid)
            layer.keep(plan.kept, plan.slots)
        if sketch is not None and state["vague_pos"].shape[-1]:
            self._swap_back(layer)

    def _gather_kv(self, layer, index):
        expand = index[..., None].expand(*index.shape, layer.keys.shape[-1])
        return layer.keys.gather(2, expand), layer.values.gather(2, expand)

    def _to_vague(self, layer, index, valid) -> None:
        """Insert the stored entries at ``index`` [B, H_kv, E] (where ``valid``) into the sketch."""
        state = layer.state
        positions = layer.positions.gather(-1, index)
        keys, values = self._gather_kv(layer, index)
        state["sketch"].insert(positions, keys, values, mask=valid, limit=layer.seen)
        self._count(state, positions, valid, 1.0, layer.seen)
        new_scores = layer.extras["score"].gather(-1, index)

        old_pos, old_score = state["vague_pos"], state["vague_score"]
        old_len, added = old_pos.shape[-1], index.shape[-1]
        # Vague tokens per row/head after this compression = real tokens - exact budget.
        capacity = max(old_len, min(old_len + added, layer.seen - state["exact_min"]))
        batch, kv_heads = old_pos.shape[:2]
        vague_pos = old_pos.new_full((batch, kv_heads, capacity + 1), -1)
        vague_score = old_score.new_full((batch, kv_heads, capacity + 1), NEG_INF)
        vague_pos[..., :old_len] = old_pos
        vague_score[..., :old_len] = old_score
        old_count = (old_pos >= 0).sum(-1, keepdim=True)
        dest = (old_count + valid.long().cumsum(-1) - 1).masked_fill(~valid, capacity)  # slot `capacity`: discard
        vague_pos.scatter_(-1, dest, positions.to(torch.int32).masked_fill(~valid, -1))
        vague_score.scatter_(-1, dest, new_scores.masked_fill(~valid, NEG_INF))
        state["vague_pos"] = vague_pos[..., :capacity]
        state["vague_score"] = vague_score[..., :capacity]

    def _swap_back(self, layer) -> None:
        """Algorithm 3's swap loop as one sorted exchange (see :func:`swap_counts`)."""
        state = layer.state
        vague_pos, vague_score = state["vague_pos"], state["vague_score"]
        score = layer.extras["score"]
        is_candidate = layer.live() & ~self.protected(layer)
        width = min(layer.size, vague_pos.shape[-1])
        cand_sorted, cand_idx = score.masked_fill(~is_candidate, float("inf")).topk(width, largest=False)
        vague_sorted, vague_idx = vague_score.topk(width, largest=True)
        swap = swap_counts(cand_sorted, vague_sorted, self.replace_rate)
        cand_score = score.gather(-1, cand_idx)  # an unswapped slot keeps its own score, not the +inf it ranked by
        # The whole exchange runs on every device, with no host sync: an unswapped pair writes its
        # own entries back and leaves the sketch as it was.
        in_score = vague_sorted
        out_pos = layer.positions.gather(-1, cand_idx)
        out_keys, out_values = self._gather_kv(layer, cand_idx)
        in_pos = vague_pos.gather(-1, vague_idx)

        sketch = state["sketch"]
        # Positions lie below layer.seen: their hashes come from a table (one gather, the same bits).
        in_keys, in_values = self.query(state, in_pos, layer.seen)  # Algorithm 3: query, then delete the estimate
        sketch.delete(in_pos, in_keys, in_values, mask=swap, limit=layer.seen)
        self._count(state, in_pos, swap, -1.0, layer.seen)
        sketch.insert(out_pos, out_keys, out_values, mask=swap, limit=layer.seen)
        self._count(state, out_pos, swap, 1.0, layer.seen)

        flag = swap[..., None]
        layer.write(
            cand_idx,
            keys=torch.where(flag, in_keys, out_keys),
            values=torch.where(flag, in_values, out_values),
            positions=torch.where(swap, in_pos.long(), out_pos),
            score=torch.where(swap, in_score, cand_score),
        )
        state["vague_pos"] = vague_pos.scatter(-1, vague_idx, torch.where(swap, out_pos.to(torch.int32), in_pos))
        state["vague_score"] = vague_score.scatter(-1, vague_idx, torch.where(swap, cand_score, in_score))
        # [B] swaps per batch row (a tensor: no host sync per step; per row: it follows reordered rows)
        state["swaps"] = state.get("swaps", 0) + swap.sum(dim=(1, 2))
