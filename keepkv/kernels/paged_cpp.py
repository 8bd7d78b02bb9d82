"""The C++ backend of :func:`keepkv.kernels.paged.paged_decode` (``backend="cpp"``): the loader.

The kernel is ``paged_cpu.cpp`` beside this file (which also holds KeepKV's EMA fold and target
search, :mod:`keepkv.kernels.ema` and :mod:`keepkv.kernels.nearest`), compiled on first use by torch's extension
loader (``torch.utils.cpp_extension.load``: a C++ compiler and ninja), once per instruction set,
source and torch version, into ``$KEEPKV_CACHE_DIR`` (else ``$XDG_CACHE_HOME/keepkv``, else
``~/.cache/keepkv``) ``/paged_cpu/``; a later process imports the built library from there
without compiling. Its threads are torch's intra-op threads (``torch.set_num_threads``): the
kernel runs in ``at::parallel_for``, so it shares torch's OpenMP pool rather than starting one of
its own.

Instruction set: torch's own reading of the CPU (``torch.backends.cpu.get_cpu_capability()``):
AVX-512 (F, BW, VL, DQ), AVX2 (with FMA and F16C), or plain C++; ``KEEPKV_CPP_ISA`` (``avx512``,
``avx2``, ``generic``) asks for another (one the CPU runs: the tests build the narrower ones).
Reads fp32, bf16 and fp16 caches in place.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("paged_cpu.cpp")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "generic": [],
}


def cpp_available() -> bool:
    """Whether the C++ backend can be built here: a C++ compiler (``$CXX``, else ``c++``) and ninja
    (torch's extension loader needs both). Compiles nothing."""
    compiler = os.environ.get("CXX", "c++")
    if not SOURCE.exists() or shutil.which(compiler.split()[0]) is None:
        return False
    from torch.utils.cpp_extension import is_ninja_available

    return is_ninja_available()


def isa() -> str:
    """The instruction set the kernel is built for: ``$KEEPKV_CPP_ISA``, else torch's reading of the CPU."""
    return _isa(os.environ.get("KEEPKV_CPP_ISA", ""))


@functools.cache
def _isa(asked: str) -> str:
    capability = torch.backends.cpu.get_cpu_capability().upper()
    found = "avx512" if capability.startswith("AVX512") else "avx2" if capability.startswith("AVX2") else "generic"
    asked = asked.strip().lower()
    if not asked:
        return found
    order = list(_FLAGS)[::-1]  # generic, avx2, avx512
    if asked not in _FLAGS:
        raise ValueError(f"KEEPKV_CPP_ISA must be one of {', '.join(_FLAGS)}; got {asked!r}")
    if order.index(asked) > order.index(found):
        raise ValueError(f"KEEPKV_CPP_ISA={asked}: this CPU runs {found} at most (torch reads it as {capability})")
    return asked


def cache_root() -> Path:
    """``$KEEPKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/keepkv``, else ``~/.cache/keepkv`` (as keepkv.models)."""
    if os.environ.get("KEEPKV_CACHE_DIR"):
        return Path(os.environ["KEEPKV_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "keepkv"


def _build_flags(target: str) -> tuple[list[str], list[str]]:
    cflags = ["-O3", "-fno-math-errno", *_FLAGS[target]]
    ldflags = []
    if "ATen parallel backend: OpenMP" in torch.__config__.parallel_info():
        # at::parallel_for is an OpenMP region compiled into the caller: -fopenmp, linked against
        # libgomp.so.1, which resolves to the copy torch has already loaded (one pool, torch's)
        cflags.append("-fopenmp")
        ldflags.append("-fopenmp")
    return cflags, ldflags


def extension(target: str | None = None):
    """The built module for ``target`` (default :func:`isa`): imported from the cache, else
    compiled there first. ImportError, in one line, where it cannot be built."""
    return _extension(target or isa())


@functools.cache
def _extension(target: str):
    cflags, ldflags = _build_flags(target)
    try:
        source = SOURCE.read_bytes()
    except OSError as error:
        raise ImportError(f"keepkv's C++ paged kernel has no source here ({SOURCE}: {error.strerror})") from None
    key = hashlib.sha256(b"\0".join([source, " ".join(cflags + ldflags).encode(), torch.__version__.encode(),
                                     sys.version.encode(), os.environ.get("CXX", "c++").encode()])).hexdigest()[:16]
    name = f"keepkv_paged_cpu_{target}_{key}"
    folder = cache_root() / "paged_cpu" / name
    built = folder / f"{name}.so"
    if built.exists() and not (folder / "lock").exists():  # built, and no build under way (torch's lock file)
        try:
            spec = importlib.util.spec_from_file_location(name, built)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except (ImportError, OSError) as error:
            raise ImportError(f"keepkv's C++ paged kernel in {folder} does not load ({error}); delete the folder "
                              f"to build it again") from None
        return module
    if not cpp_available():
        raise ImportError("keepkv's C++ paged kernel needs a C++ compiler ($CXX or c++) and ninja (pip install ninja)")
    folder.mkdir(parents=True, exist_ok=True)
    from torch.utils.cpp_extension import load

    try:
        return load(name=name, sources=[str(SOURCE)], extra_cflags=cflags, extra_ldflags=ldflags,
                    build_directory=str(folder), verbose=False)
    except Exception as error:  # the compiler's output runs to many lines: its first error, in one
        lines = [line.strip() for line in str(error).splitlines() if "error" in line.lower()]
        first = lines[0] if lines else str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ImportError(f"keepkv's C++ paged kernel did not build ({target}, in {folder}): {first}") from None


@functools.lru_cache(maxsize=64)
def _geometry_args(geometry, itemsize: int) -> tuple:
    """The kernel's geometry arguments, block_size to cell_words (a geometry is frozen: once per geometry)."""
    return (geometry.block_size, geometry.cell, geometry.keys_at, geometry.values_at, int(geometry.keys_by_dim),
            int(geometry.values_by_dim), geometry.words_at, geometry.words, geometry.bias_word,
            geometry.cell * itemsize // 4)


_MODULES: dict = {}  # $KEEPKV_CPP_ISA as set at the call -> the built module


def _cpp_decode(query, kv_cache, block_table, seq_lens, scaling, geometry, max_len: int, logits: bool, probs: bool):
    """:func:`keepkv.kernels.paged.paged_decode` on the C++ kernel (its arguments already checked
    by ``paged_geometry.check_call``): fp32, bf16 and fp16 caches on CPU. ValueError, in one line, for a cache or
    query off the CPU, a request longer than ``max_len`` or a block outside the cache (both checked
    in the kernel, before it reads anything)."""
    if kv_cache.device.type != "cpu" or query.device.type != "cpu":
        raise ValueError(f"the cpp backend runs on CPU; got a cache on {kv_cache.device}, a query on {query.device}")
    asked = os.environ.get("KEEPKV_CPP_ISA", "")
    module = _MODULES.get(asked)
    if module is None:
        module = _MODULES[asked] = _extension(isa())
    rows, heads, head_dim = query.shape
    kv_heads = geometry.kv_heads
    if query.dtype in _DTYPES and query.is_contiguous():  # read as it is, widened in the kernel
        q = query
    else:
        q = query.float().contiguous()
    out_dtype = torch.bfloat16 if query.dtype == torch.bfloat16 else torch.float32  # bf16: narrowed in the kernel
    table = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
    if table.shape[1] > 1 and table.stride(1) != 1:
        table = table.contiguous()
    lens = seq_lens if seq_lens.dtype == torch.int32 and seq_lens.is_contiguous() else seq_lens.to(torch.int32).contiguous()
    out = torch.empty(rows, heads, head_dim, dtype=out_dtype)
    stats_shape = (rows, kv_heads, heads // kv_heads, max_len)
    logits_out = torch.empty(stats_shape) if logits else None  # every element written by the kernel
    probs_out = torch.empty(stats_shape) if probs else None
    blocks = kv_cache.numel() // (kv_heads * geometry.cell)
    error, row = module.decode(
        q.data_ptr(), kv_cache.data_ptr(), table.data_ptr(), lens.data_ptr(), out.data_ptr(),
        logits_out.data_ptr() if logits else 0, probs_out.data_ptr() if probs else 0, _DTYPES[kv_cache.dtype],
        rows, heads, head_dim, kv_heads, *_geometry_args(geometry, kv_cache.element_size()), table.stride(0), max_len,
        blocks, _DTYPES[q.dtype], int(out_dtype == torch.bfloat16), float(scaling))
    if error == 1:
        raise ValueError(f"a request of {int(seq_lens[row])} entries is longer than max_len {max_len} (or negative)")
    if error == 2:
        raise ValueError(f"request {row}'s block table names a block outside the cache's {blocks}")
    if error == 3:
        raise ValueError(f"the geometry places keys, values or words outside a cell of {geometry.cell} elements")
    return out if out.dtype == query.dtype else out.to(query.dtype), probs_out, logits_out
