"""Paged decode attention with a per-entry bias: keepkv's own kernel for a serving engine's blocks.

One new query token per request, grouped-query attention over the request's kept entries, read
in place through its block table::

    z_s   = q·k_s·scaling + bias_s            (bias: KeepKV's votes, ln p; 0 for an entry never merged)
    p_s   = exp(z_s - max z) / Σ exp(z - max z)
    out   = Σ_s p_s v_s                        (fp32 accumulation)

and, in the same pass, what a method reads of the step's query: the logits q·k·scaling (no bias)
and the probabilities p, per entry, [R, H_kv, g, S] in fp32 (-inf and 0 past a request's length).

**Where an entry lives** (:class:`PagedGeometry`). The cache is one tensor per layer, ``kv_cache
[blocks, H_kv, ...]`` of the model's dtype; each (block, KV head) cell of ``cell`` elements holds
``block_size`` slots: the keys at element ``keys_at`` (slot-major ``[block_size, D]``, or
dim-major ``[D, block_size]`` as vLLM's CPU "vec" kernel packs them), the values at
``values_at`` (either order), and, read as fp32, ``words`` words per slot from fp32 word
``words_at``, of which word ``bias_word`` is the entry's bias (no bias plane: ``bias_word`` -1).
A keepkv slot thus costs the keys and values at the model's head size plus one fp32 word.

**Backends** (one contract, one reference):

- ``"numba"``: the CPU kernel (Numba; vLLM's CPU build depends on it, the test extra installs it).
  One task per (request, KV head): the keys of each block are read once into an fp32 tile, the
  group's g logits computed over it, then the values once. fp32 and bf16 caches.
- ``"cpp"``: the same in C++ (:mod:`keepkv.kernels.paged_cpp`: ``paged_cpu.cpp``, built on first use
  by torch's extension loader into the user's cache, AVX-512 / AVX2 / plain), on torch's own
  threads; reads bf16 and fp16 in place, splits long requests over blocks when tasks are few.
  Needs a C++ compiler and ninja; "auto" takes it on CPU where it builds (2-5x Numba's speed in
  ``benchmarks/kernels/paged_decode_cpu.py``), else Numba.
- ``"triton"``: the same on CUDA, or anywhere under Triton's interpreter (``TRITON_INTERPRET=1``).
- ``"torch"``: :func:`paged_decode_reference`, gathers each request's blocks (a loop over requests):
  the reference the tests compare against.
"""

from __future__ import annotations

import importlib.util
import math

import torch

from .paged_geometry import PagedGeometry, check_call

NEG_INF = float("-inf")


def paged_decode(query, kv_cache, block_table, seq_lens, scaling: float, geometry: PagedGeometry, *, max_len: int,
                 logits: bool = False, probs: bool = False, backend: str = "auto"):
    """Decode attention of one query token per request over its blocks, with each entry's bias.

    query [R, H, D] (any float dtype); kv_cache [blocks, H_kv, ...] contiguous, cells as
    ``geometry`` says; block_table [R, max_blocks] int; seq_lens [R] int, each ≤ ``max_len``
    (an int the caller knows: no device read here). Returns ``(out, probs, logits)``: out
    [R, H, D] in the query's dtype; probs and logits [R, H_kv, g, max_len] fp32, or None.

    ``backend``: "cpp", "numba", "triton", "torch", or "auto" (triton on CUDA; on CPU cpp where it
    builds, else numba). ValueError
    on mismatched shapes; ImportError, in one line, where the backend is not installed.
    """
    check_call(query, kv_cache, block_table, seq_lens, geometry, max_len)
    if backend == "auto":
        backend = "triton" if query.device.type == "cuda" else cpu_backend()
    if backend == "torch":
        return paged_decode_reference(query, kv_cache, block_table, seq_lens, scaling, geometry, max_len=max_len,
                                      logits=logits, probs=probs)
    if backend == "cpp":
        from .paged_cpp import _cpp_decode

        return _cpp_decode(query, kv_cache, block_table, seq_lens, scaling, geometry, max_len, logits, probs)
    if backend == "numba":
        return _numba_decode(query, kv_cache, block_table, seq_lens, scaling, geometry, max_len, logits, probs)
    if backend == "triton":
        from .paged_triton import triton_paged_decode

        return triton_paged_decode(query, kv_cache, block_table, seq_lens, scaling, geometry, max_len=max_len,
                                   logits=logits, probs=probs)
    raise ValueError(f"backend must be 'auto', 'cpp', 'numba', 'triton' or 'torch'; got {backend!r}")


_CPU_BACKEND: list = []  # "auto"'s choice on CPU, made once per process


def cpu_backend() -> str:
    """"auto" on CPU: "cpp" where a compiler is there and the kernel builds (the first call builds
    it: seconds, once per machine; benchmarks/kernels/paged_decode_cpu.py measured it faster than
    Numba's), else "numba" where Numba is installed, else "torch" (the reference: correct, slower)."""
    if not _CPU_BACKEND:
        from .paged_cpp import cpp_available, extension

        choice = "numba" if numba_available() else "torch"
        if cpp_available():
            try:
                extension()
                choice = "cpp"
            except ImportError:
                pass
        _CPU_BACKEND.append(choice)
    return _CPU_BACKEND[0]


# -- the reference --------------------------------------------------------------------------------
def plane_entries(plane: torch.Tensor, block_size: int, head_dim: int, by_dim: bool) -> torch.Tensor:
    """A plane [..., block_size * D] as entries [..., block_size, D] (a view): packed slot by slot,
    or dimension by dimension (``by_dim``, each block's [D, block_size] transposed)."""
    if by_dim:
        return plane.unflatten(-1, (head_dim, block_size)).transpose(-1, -2)
    return plane.unflatten(-1, (block_size, head_dim))


def read_entries(kv_cache, block_table_row, length: int, geometry: PagedGeometry):
    """One request's first ``length`` entries: keys, values [H_kv, length, D] in the cache's dtype
    and bias [H_kv, length] fp32 (zeros where unbiased)."""
    g = geometry
    blocks = block_table_row[: max(1, math.ceil(length / g.block_size))].long()
    cells = kv_cache.reshape(-1, g.kv_heads, g.cell)[blocks]  # [n, H_kv, cell]
    plane = g.block_size * g.head_dim

    def plane_at(offset: int, by_dim: bool) -> torch.Tensor:
        entries = plane_entries(cells[..., offset : offset + plane], g.block_size, g.head_dim, by_dim)
        return entries.transpose(0, 1).reshape(g.kv_heads, -1, g.head_dim)[:, :length]

    keys, values = plane_at(g.keys_at, g.keys_by_dim), plane_at(g.values_at, g.values_by_dim)
    if not g.biased:
        return keys, values, torch.zeros(g.kv_heads, length, device=kv_cache.device)
    words = kv_cache.reshape(-1, g.kv_heads, g.cell).view(torch.float32)[blocks]  # [n, H_kv, cell words]
    words = words[..., g.words_at : g.words_at + g.block_size * g.words].unflatten(-1, (g.block_size, g.words))
    bias = words[..., g.bias_word].transpose(0, 1).reshape(g.kv_heads, -1)[:, :length]
    return keys, values, bias


def paged_decode_reference(query, kv_cache, block_table, seq_lens, scaling: float, geometry: PagedGeometry, *,
                           max_len: int, logits: bool = False, probs: bool = False):
    """:func:`paged_decode` in plain torch (fp32 arithmetic): the reference."""
    rows, heads, head_dim = query.shape
    group = heads // geometry.kv_heads
    out = torch.empty(rows, heads, head_dim, dtype=torch.float32, device=query.device)
    probs_out = torch.zeros(rows, geometry.kv_heads, group, max_len, device=query.device) if probs else None
    logits_out = torch.full((rows, geometry.kv_heads, group, max_len), NEG_INF, device=query.device) if logits else None
    for row, length in enumerate(seq_lens.tolist()):
        keys, values, bias = read_entries(kv_cache, block_table[row], length, geometry)
        q = query[row].float().view(geometry.kv_heads, group, head_dim)
        z = q @ keys.float().transpose(-1, -2) * scaling  # [H_kv, g, S]
        p = (z + bias[:, None].float()).softmax(-1)
        out[row] = (p @ values.float()).reshape(heads, head_dim)
        if probs:
            probs_out[row, ..., :length] = p
        if logits:
            logits_out[row, ..., :length] = z
    return out.to(query.dtype), probs_out, logits_out


# -- Numba, the CPU kernel ------------------------------------------------------------------------
def numba_available() -> bool:
    """Whether Numba is installed (found, not imported: see :mod:`keepkv.kernels.paged_numba`)."""
    return importlib.util.find_spec("numba") is not None


def numba_threads(count: int) -> None:
    """Run the Numba kernel on ``count`` threads (at most Numba's pool: ``NUMBA_NUM_THREADS``)."""
    from .paged_numba import set_threads

    set_threads(count)


def _numba_decode(query, kv_cache, block_table, seq_lens, scaling, geometry: PagedGeometry, max_len: int,
                  logits: bool, probs: bool):
    import numpy as np

    if kv_cache.device.type != "cpu" or query.device.type != "cpu":
        raise ValueError(f"the numba backend runs on CPU; got a cache on {kv_cache.device}, a query on {query.device}")
    if seq_lens.numel() and int(seq_lens.max()) > max_len:  # a host tensor: no device read
        raise ValueError(f"a request of {int(seq_lens.max())} entries is longer than max_len {max_len}")
    if kv_cache.dtype == torch.float16:
        raise ValueError("the numba backend reads float32 and bfloat16 caches; got float16")
    try:
        from .paged_numba import LOCK, paged_decode_numba
    except ImportError as error:
        raise ImportError('keepkv\'s paged CPU kernel needs Numba: pip install numba (the "test" and "vllm" extras '
                          "bring it)") from error
    rows, heads, head_dim = query.shape
    group = heads // geometry.kv_heads
    from_bf16 = kv_cache.dtype == torch.bfloat16
    flat = kv_cache.view(-1)
    cache = flat.view(torch.int16).numpy().view(np.uint16) if from_bf16 else flat.numpy()
    words = flat.view(torch.float32).numpy() if geometry.biased else np.empty(0, np.float32)
    cell_words = geometry.cell * kv_cache.element_size() // 4
    out = torch.empty(rows, heads, head_dim, dtype=torch.float32)
    stats_shape = (rows, geometry.kv_heads, group, max_len)
    logits_out = torch.full(stats_shape, NEG_INF) if logits else torch.empty(0, 0, 0, 0)
    probs_out = torch.zeros(stats_shape) if probs else torch.empty(0, 0, 0, 0)
    with LOCK:
        paged_decode_numba(query.float().contiguous().numpy(), cache, words, block_table.to(torch.int32).numpy(),
                           seq_lens.to(torch.int32).numpy(), out.numpy(), logits_out.numpy(), probs_out.numpy(),
                           float(scaling), geometry.kv_heads, head_dim, geometry.block_size, geometry.cell,
                           geometry.keys_at, geometry.values_at, geometry.keys_by_dim, geometry.values_by_dim,
                           geometry.words_at, geometry.words, geometry.bias_word, cell_words, logits, probs)
    return out.to(query.dtype), probs_out if probs else None, logits_out if logits else None
