"""KVReviver's "Vague" store: a batched Count-Sketch variant, plus Fisher layer budgets.

Source: Yuan et al., "KVReviver: Reversible KV Cache Compression with Sketch-Based
Token Reconstruction" (2025), section "Vague Sketch" (Algorithms 1 and 2),
Algorithm 3 (query → delete → re-insert swap), the appendix "Parameter Settings"
(r = 3) and the appendix "Fisher Information".

Naming. The paper calls the r hash rows "buckets" and b the "bucket length"
("The Vague Part consists of r buckets, each containing b tensors"). Here we use the
usual Count-Sketch names: ``rows`` = r (one hash function each), ``buckets`` = b
(slots per row). Each slot holds one key vector and one value vector, so a sketch
costs r·b token entries, whatever the number of tokens inserted.

Everything is vectorised over batch rows, KV heads, tokens and sketch rows: inserts
and deletes are one accumulating ``index_put_`` each for keys and values, queries one
``index_select`` plus a median over the row axis.

Determinism. Tokens of one insert that share a slot are summed by ``index_put_(...,
accumulate=True)``, not ``index_add_``: on CUDA ``index_add_`` adds with atomics, in an order
that changes from run to run, while ``index_put_`` sorts the slot indices and sums each slot's
tokens in that fixed order (in fp32 for bf16/fp16 tables, one rounding per slot and call); on
CPU both add serially in index order. So the same inserts give the same bits on every run, which
the bit-exact delete below relies on.
"""

from __future__ import annotations

import copy
import math
import operator
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

__all__ = [
    "CountSketch",
    "fisher_layer_scores",
    "proportional_budgets",
]

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF


# --------------------------------------------------------------------------- hashing
#
# All arithmetic stays inside [0, 2**48] so no int64 operation ever overflows: the
# hash is bit-identical on every device and does not rely on wrap-around of signed
# integer multiplication (undefined behaviour in C++, whatever torch happens to do).
# The helpers work on Python ints and on int64 tensors alike.


def _mul32(x, c: int):
    """(x * c) mod 2**32 for x in [0, 2**32) and a constant c in [0, 2**32), overflow-free."""
    lo = x & 0xFFFF
    hi = x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _MASK32


def _fmix32(h):
    """MurmurHash3's 32-bit finaliser: a bijection on [0, 2**32) with full avalanche."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    h = h ^ (h >> 16)
    return h


def _salts(seed: int, rows: int, device: torch.device) -> Tensor:
    """Per-(purpose, row) 32-bit salts, shape [2, rows]; purpose 0 = bucket, 1 = sign."""
    s = int(seed) & _MASK64
    s_lo, s_hi = s & _MASK32, s >> 32
    j = torch.arange(rows, dtype=torch.int64, device=device)
    p = torch.arange(2, dtype=torch.int64, device=device)[:, None]
    code = (2 * j[None, :] + p + 1) & _MASK32  # distinct, non-zero per (purpose, row)
    salt = _fmix32(_mul32(code, 0x9E3779B9) ^ s_lo)
    salt = _fmix32(salt ^ _fmix32((s_hi ^ 0x5BD1E995) & _MASK32))
    return salt


def _hash_positions(token_ids: Tensor, salts: Tensor) -> Tensor:
    """h[..., p, j] = fmix32(fmix32(lo32(pos) ^ salt[p, j]) ^ hi32(pos)), in [0, 2**32)."""
    pos = token_ids.to(torch.int64)[..., None, None]
    lo = pos & _MASK32
    hi = (pos >> 32) & _MASK32  # arithmetic shift, masked: fine for negative positions too
    return _fmix32(_fmix32(lo ^ salts) ^ hi)


# Hash tables of positions, one per (seed, sketch rows, device), each as long as the longest sequence
# hashed so far (rounded up to a power of 2): bounded by those few keys, grown, never duplicated.
_POSITION_TABLES: dict[tuple, Tensor] = {}


def _position_table(seed: int, salts: Tensor, limit: int) -> Tensor:
    """[P, 2, r] int64: ``_hash_positions`` of positions 0..P-1, P >= limit a power of 2."""
    key = (seed, salts.shape[-1], str(salts.device))
    table = _POSITION_TABLES.get(key)
    if table is None or table.shape[0] < limit:
        size = 1 << max(10, (int(limit) - 1).bit_length())
        table = _hash_positions(torch.arange(size, device=salts.device), salts)
        _POSITION_TABLES[key] = table
    return table


# ---------------------------------------------------------------------------- sketch


@dataclass(eq=False)
class CountSketch:
    """KVReviver's Vague Part: a Count Sketch whose counters are key/value vectors.

    Shapes: keys, values [B, H_kv, r, b, D]; token_ids [B, H_kv, N] (int64 token
    positions; size-1 leading dims broadcast); per-token keys/values [B, H_kv, N, D];
    masks [B, H_kv, N] bool. Every (batch row, KV head) pair has its own independent
    r × b sketch; the hash functions are shared (they depend on the position only).

    Hashes. For sketch row j and token position t (int64, split into 32-bit halves
    lo, hi), with ``fmix32`` = MurmurHash3's 32-bit finaliser::

        H_p,j(t) = fmix32(fmix32(lo(t) XOR salt[p, j]) XOR hi(t))
        h_j(t)   = H_0,j(t) mod b                  (bucket, in [0, b))
        g_j(t)   = +1 if bit 31 of H_1,j(t) is 0 else -1   (sign)

    The salts are themselves fmix32 mixes of (seed, j, p), so each (seed, row) pair
    gets its own bucket hash and an independent sign hash. Everything is computed in
    int64 torch ops that never overflow, so the same token maps to the same buckets
    and signs on every device, call and process; a different seed gives different
    hashes. (mod b has a bias of at most b / 2**32, negligible.)

    Insert (Algorithm 1 of the paper), for every row j::

        keys[j, h_j(t)]   += k_t
        values[j, h_j(t)] += v_t * g_j(t)

    Keys get no sign. That is the paper's choice, not an omission: "randomly
    multiplying the value embeddings by coefficients of ±1 during both insertion and
    query operations (g_i in pseudocodes) ... It is worth noting that key embeddings
    do not require such unbiasedness, as the subsequent computation of
    Softmax(QK^T) involves a nonlinear Softmax operation". Algorithm 1 adds
    ``T.key`` unsigned and ``T.value × g_i(J)``. Consequence: a key estimate is
    biased by the sum of the colliding keys; it is centred only when keys have zero
    mean, which the paper assumes (K ~ N(0, σ_k)) but real (RoPE'd) keys often
    violate. ``sign_keys=True`` (not in the paper) signs keys too and makes the key
    estimate unbiased as well; the default follows the paper.

    Query (Algorithm 2): per row the slot contents, values multiplied back by g_j(t);
    then the coordinate-wise median over the r rows. For odd r that is the middle
    value; for even r it is torch.median's *lower* median (the smaller of the two
    middle values), not their mean. r = 3 uses an exact min/max network.

    Delete subtracts exactly what insert adds. Algorithm 3 deletes the *estimate*
    (``tmp ← V.Query(i); V.Delete(tmp)``), so after a swap the sketch keeps the
    residual (true − estimate) of that token in its slots; with no collision the
    estimate is exact and the sketch returns bit-for-bit to its state without the
    token. :meth:`pop` does query-then-delete in one call.

    Memory: r·b key vectors + r·b value vectors per (batch row, head), fixed.
    For a vague budget of E token entries use ``b = E // r`` (see
    ``KVReviver.sketch_buckets``); the paper fixes r = 3.

    Precision: keep the tables in fp32 (``empty``'s default) even for a bf16/fp16 model:
    inserts and deletes take keys/values of any dtype and add them in the tables' dtype.
    In bf16 a slot holding hundreds of keys has a rounding step about the size of one key
    (8 mantissa bits), so deleting a token's estimate would leave as much error as the
    token itself; fp32 tables cost 2× the bytes of bf16 ones. Estimates come back in the
    tables' dtype; cast them to the cache's.
    """

    keys: Tensor  # [B, H_kv, r, b, D]
    values: Tensor  # [B, H_kv, r, b, D]
    seed: int = 0
    sign_keys: bool = False
    _salts: Tensor = field(init=False, repr=False, compare=False)

    # ------------------------------------------------------------------ construction
    def __post_init__(self) -> None:
        if not isinstance(self.keys, Tensor) or not isinstance(self.values, Tensor):
            raise TypeError("keys and values must be torch tensors")
        if self.keys.dim() != 5:
            raise ValueError(
                f"keys must have shape [B, H_kv, rows, buckets, D], got {tuple(self.keys.shape)}"
            )
        if self.values.shape != self.keys.shape:
            raise ValueError(
                f"values shape {tuple(self.values.shape)} != keys shape {tuple(self.keys.shape)}"
            )
        if self.values.dtype != self.keys.dtype or self.values.device != self.keys.device:
            raise ValueError("keys and values must share dtype and device")
        if not self.keys.is_floating_point():
            raise ValueError(f"sketch tensors must be floating point, got {self.keys.dtype}")
        _check_positive("rows", self.keys.shape[2])
        _check_positive("buckets", self.keys.shape[3])
        self.seed = operator.index(self.seed)
        if not self.keys.is_contiguous():
            self.keys = self.keys.contiguous()
        if not self.values.is_contiguous():
            self.values = self.values.contiguous()
        self._salts = _salts(self.seed, self.rows, self.keys.device)

    @classmethod
    def empty(
        cls,
        batch: int,
        kv_heads: int,
        rows: int,
        buckets: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        seed: int = 0,
        sign_keys: bool = False,
    ) -> "CountSketch":
        """An all-zero sketch of shape [batch, kv_heads, rows, buckets, head_dim]."""
        _check_positive("rows", rows)
        _check_positive("buckets", buckets)
        _check_positive("batch", batch)
        _check_positive("kv_heads", kv_heads)
        _check_positive("head_dim", head_dim)
        shape = (batch, kv_heads, rows, buckets, head_dim)
        return cls(
            keys=torch.zeros(shape, dtype=dtype, device=device),
            values=torch.zeros(shape, dtype=dtype, device=device),
            seed=seed,
            sign_keys=sign_keys,
        )

    # ------------------------------------------------------------------- properties
    @property
    def batch(self) -> int:
        return self.keys.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def rows(self) -> int:
        return self.keys.shape[2]

    @property
    def buckets(self) -> int:
        return self.keys.shape[3]

    @property
    def head_dim(self) -> int:
        return self.keys.shape[4]

    def nbytes(self) -> int:
        """Bytes held by the sketch: 2 · B · H_kv · r · b · D · element_size."""
        return (
            self.keys.numel() * self.keys.element_size()
            + self.values.numel() * self.values.element_size()
        )

    def select_rows(self, index: Tensor) -> "CountSketch":
        """A sketch of batch rows ``index`` [B'] (repeats allowed), in that order; this one is unchanged."""
        index = index.to(self.keys.device)
        picked = copy.copy(self)
        picked.keys, picked.values = self.keys.index_select(0, index), self.values.index_select(0, index)
        for name, value in vars(self).items():  # per-row extras of a subclass (RaggedSketch.active)
            if name not in ("keys", "values", "_salts") and isinstance(value, Tensor) and value.dim():
                setattr(picked, name, value.index_select(0, index))
        return picked

    # ----------------------------------------------------------------------- hashes
    def _raw_hashes(self, token_ids: Tensor, limit: int | None = None) -> Tensor:
        """H_p,j(t) [..., 2, r] of token_ids [...].

        With ``limit``, read from a table of the positions [0, limit) (built once per seed,
        rows and device, grown by doubling): one gather instead of ~20 integer ops per
        token. Negative ids (empty slots the caller masks) then read position 0's hashes.
        """
        token_ids = token_ids.to(self.keys.device)
        if limit is None:
            return _hash_positions(token_ids, self._salts)
        table = _position_table(self.seed, self._salts, limit)
        flat = token_ids.clamp(min=0).reshape(-1).long()
        return table.index_select(0, flat).view(*token_ids.shape, 2, self.rows)

    def _hashes(self, token_ids: Tensor, limit: int | None = None) -> tuple[Tensor, Tensor]:
        h = self._raw_hashes(token_ids, limit)  # [..., 2, r]
        buckets = h[..., 0, :] % self.buckets
        signs = (1 - 2 * ((h[..., 1, :] >> 31) & 1)).to(self.keys.dtype)
        return buckets, signs

    # ---------------------------------------------------------------- index helpers
    def _flat_index(self, token_ids: Tensor, n: int, limit: int | None = None) -> tuple[Tensor, Tensor]:
        """Linear slot index [B, H, N, r] into keys.view(-1, D), and signs [B, H, N, r]
        (``limit``: see :meth:`_raw_hashes`)."""
        B, H, r, b = self.batch, self.kv_heads, self.rows, self.buckets
        if token_ids.dim() != 3:
            raise ValueError(
                f"token_ids must have shape [B, H_kv, N], got {tuple(token_ids.shape)}"
            )
        if token_ids.shape[-1] != n or any(
            s not in (1, full) for s, full in zip(token_ids.shape[:2], (B, H))
        ):
            raise ValueError(
                f"token_ids shape {tuple(token_ids.shape)} does not broadcast to {(B, H, n)}"
            )
        # Hash before broadcasting: ids shared by all rows/heads are hashed once.
        bucket, sign = self._hashes(token_ids, limit)
        base = torch.arange(B * H * r, device=self.keys.device, dtype=torch.int64)
        base = base.view(B, H, 1, r) * b
        return base + bucket, sign.expand(B, H, n, r)

    def _check_kv(self, token_ids: Tensor, keys: Tensor, values: Tensor) -> int:
        B, H, D = self.batch, self.kv_heads, self.head_dim
        if keys.dim() != 4 or keys.shape[0] != B or keys.shape[1] != H or keys.shape[3] != D:
            raise ValueError(f"keys must have shape [{B}, {H}, N, {D}], got {tuple(keys.shape)}")
        if values.shape != keys.shape:
            raise ValueError(
                f"values shape {tuple(values.shape)} != keys shape {tuple(keys.shape)}"
            )
        if token_ids.dim() != 3 or token_ids.shape[-1] != keys.shape[2]:
            raise ValueError(
                f"token_ids must have shape [B, H_kv, N] with N = {keys.shape[2]}, "
                f"got {tuple(token_ids.shape)}"
            )
        return keys.shape[2]

    def _accumulate(self, token_ids, keys, values, mask, sign_of_update: float, limit=None) -> None:
        n = self._check_kv(token_ids, keys, values)
        if n == 0:
            return
        B, H, r, D = self.batch, self.kv_heads, self.rows, self.head_dim
        idx, g = self._flat_index(token_ids, n, limit)
        dt, dev = self.keys.dtype, self.keys.device
        k = keys.to(device=dev, dtype=dt)
        v = values.to(device=dev, dtype=dt)
        if mask is not None:
            m = mask.to(device=dev, dtype=torch.bool).expand(B, H, n)[..., None]
            # where(), not multiply: a masked-out slot may hold inf/nan padding.
            k = torch.where(m, k, torch.zeros((), dtype=dt, device=dev))
            v = torch.where(m, v, torch.zeros((), dtype=dt, device=dev))
        if sign_of_update < 0:
            k, v = -k, -v
        gk = g[..., None]  # [B, H, N, r, 1]
        k_src = k[:, :, :, None, :] * gk if self.sign_keys else k[:, :, :, None, :].expand(B, H, n, r, D)
        v_src = v[:, :, :, None, :] * gk
        flat_idx = (idx.reshape(-1),)
        # Deterministic on every device (module doc): never index_add_, whose CUDA atomics are not.
        self.keys.view(-1, D).index_put_(flat_idx, k_src.reshape(-1, D), accumulate=True)
        self.values.view(-1, D).index_put_(flat_idx, v_src.reshape(-1, D), accumulate=True)

    # ------------------------------------------------------------------- operations
    def insert(
        self, token_ids: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None = None,
        limit: int | None = None,
    ) -> None:
        """Add tokens: keys[j, h_j(t)] += k (× g_j(t) if sign_keys), values[j, h_j(t)] += v·g_j(t).

        token_ids [B, H_kv, N]; keys/values [B, H_kv, N, D]; mask [B, H_kv, N] bool
        (None = all): only True entries go in. In place. ``limit``: the ids lie in [0, limit)
        (or are masked out), so their hashes come from a table (:meth:`_raw_hashes`; the same bits).
        """
        self._accumulate(token_ids, keys, values, mask, +1.0, limit)

    def delete(
        self, token_ids: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None = None,
        limit: int | None = None,
    ) -> None:
        """Subtract a contribution: the exact inverse of :meth:`insert` (same arguments)."""
        self._accumulate(token_ids, keys, values, mask, -1.0, limit)

    def row_estimates(self, token_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Per-row estimates before the median: keys, values [B, H_kv, N, r, D].

        Values are already multiplied back by g_j(t) (keys too when sign_keys).
        """
        n = token_ids.shape[-1] if token_ids.dim() == 3 else -1
        if n < 0:
            raise ValueError(
                f"token_ids must have shape [B, H_kv, N], got {tuple(token_ids.shape)}"
            )
        B, H, r, D = self.batch, self.kv_heads, self.rows, self.head_dim
        idx, g = self._flat_index(token_ids, n)
        flat_idx = idx.reshape(-1)
        k = self.keys.view(-1, D).index_select(0, flat_idx).view(B, H, n, r, D)
        v = self.values.view(-1, D).index_select(0, flat_idx).view(B, H, n, r, D)
        gk = g[..., None]
        if self.sign_keys:
            k = k * gk
        return k, v * gk

    def query(self, token_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Estimates [B, H_kv, N, D] for keys and values: coordinate-wise median over rows."""
        k, v = self.row_estimates(token_ids)
        return median_rows(k), median_rows(v)

    def zero_(self) -> "CountSketch":
        """Reset every slot to zero (in place)."""
        self.keys.zero_()
        self.values.zero_()
        return self


def median_rows(x: Tensor, dim: int = -2, inplace: bool = False) -> Tensor:
    """Coordinate-wise median over ``dim`` (the sketch-row axis, r long; default: x is
    [..., r, D]): the lower median for even r (as ``torch.median``); r = 3 by an exact
    min/max network, which with ``inplace`` overwrites x to save two buffers."""
    r = x.shape[dim]
    if r == 1:
        return x.select(dim, 0)
    if r != 3:
        return torch.median(x, dim=dim).values  # even r: the lower of the two middle values
    a, b, c = x.unbind(dim)
    if not inplace:
        return torch.maximum(torch.minimum(a, b), torch.minimum(torch.maximum(a, b), c))
    low = torch.minimum(a, b)
    torch.maximum(a, b, out=b)
    torch.minimum(b, c, out=b)
    return torch.maximum(low, b, out=low)


def _check_positive(name: str, value) -> int:
    try:
        v = operator.index(value)
    except TypeError as e:
        raise TypeError(f"{name} must be an integer, got {value!r}") from e
    if v < 1:
        raise ValueError(f"{name} must be an integer >= 1 (valid range: 1, 2, ...), got {v}")
    return v


# ----------------------------------------------------------------- Fisher budgets


def fisher_layer_scores(
    k_proj_weights: Sequence[Tensor] | Tensor,
    v_proj_weights: Sequence[Tensor] | Tensor,
    *,
    k_fisher: Sequence[Tensor] | Tensor | None = None,
    v_fisher: Sequence[Tensor] | Tensor | None = None,
) -> Tensor:
    """Per-layer Fisher score, float64 [L]: F(W_k) + F(W_v) for each layer.

    What the paper says (appendix "Fisher Information"), in full: "KVReviver computes
    the Fisher Information of a layer by summing the Fisher Information of the Key and
    Value weight matrices within the same layer. This value is then used to determine
    the memory budget allocation ratio across different layers." It gives no formula,
    no data set and no estimator; it cites Palu (Chang et al. 2024) for the idea.

    What is computed here:

    * With ``k_fisher``/``v_fisher`` (one tensor per layer, e.g. Palu's per-weight
      empirical Fisher, the mean over calibration batches of (∂L/∂W)², or its square
      root as Palu's code stores it): F(W) = sum of that tensor's entries, i.e. the
      trace of the diagonal Fisher. Use this when you can run backward passes.
    * Without them, a weights-only proxy: F(W) = ||W||_F² (squared Frobenius norm).
      This is a documented stand-in, not the Fisher information: for a linear map the
      true Fisher depends on the inputs and the loss, not on ||W||. It only ranks
      layers by the energy of their K/V projections.
    """
    if len(k_proj_weights) != len(v_proj_weights):
        raise ValueError(
            f"got {len(k_proj_weights)} key and {len(v_proj_weights)} value projections; "
            "need one of each per layer"
        )
    L = len(k_proj_weights)
    if L == 0:
        raise ValueError("need at least one layer")
    if (k_fisher is None) != (v_fisher is None):
        raise ValueError("pass both k_fisher and v_fisher, or neither")
    if k_fisher is not None:
        if len(k_fisher) != L or len(v_fisher) != L:
            raise ValueError(f"k_fisher/v_fisher must have one entry per layer ({L})")
        terms = [
            torch.as_tensor(k_fisher[i]).double().sum() + torch.as_tensor(v_fisher[i]).double().sum()
            for i in range(L)
        ]
    else:
        terms = [
            k_proj_weights[i].detach().double().pow(2).sum()
            + v_proj_weights[i].detach().double().pow(2).sum()
            for i in range(L)
        ]
    scores = torch.stack([t.cpu() for t in terms])
    if not torch.isfinite(scores).all() or (scores < 0).any():
        raise ValueError(f"Fisher scores must be finite and >= 0, got {scores.tolist()}")
    return scores


def proportional_budgets(scores: Tensor, totals: Tensor, minimum: int) -> Tensor:
    """[L, B] integer budgets, one column per total: proportional to ``scores`` [L], each column
    summing to ``totals`` [B] exactly, every entry at least ``minimum``.

    Layers whose share falls below the minimum are pinned at it and the rest of the total is
    re-shared among the others (water-filling, at most L rounds); shares are then floored and
    the leftover units go to the largest fractional remainders (ties: larger score, then lower
    layer). A layer with a larger score never gets less. All-zero scores split uniformly.
    """
    layers = scores.numel()
    weights = scores.double().flatten().to(totals.device).clamp(min=0)
    if not bool(weights.sum() > 0):
        weights = torch.ones_like(weights)
    total = totals.double()
    pinned = torch.zeros(layers, total.numel(), dtype=torch.bool, device=total.device)
    for _ in range(layers):
        free = torch.where(pinned, 0.0, weights[:, None])
        left = total - minimum * pinned.sum(0)
        share = free / free.sum(0).clamp(min=1e-300) * left
        share = torch.where(pinned, float(minimum), share)
        low = ~pinned & (share < minimum)
        if not bool(low.any()):
            break
        pinned |= low
    base = share.floor().clamp(min=minimum)
    leftover = (total - base.sum(0)).round().clamp(min=0)  # [B], fewer than the free layers
    remainder = (share - base).masked_fill(pinned, -math.inf)
    by_score = weights.argsort(descending=True, stable=True)  # [L] tie order: score, then layer
    ranked = by_score[remainder[by_score].argsort(dim=0, descending=True, stable=True)]  # [L, B] layers
    places = torch.arange(layers, device=total.device)[:, None].expand_as(ranked)
    rank = torch.empty_like(ranked).scatter_(0, ranked, places)
    return (base + (rank < leftover[None]).double()).long()
