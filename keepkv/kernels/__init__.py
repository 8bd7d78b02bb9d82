"""keepkv's kernels: optional GPU kernels (``pip install -e ".[gpu]"``, which brings Triton), and
C++ ones on CPU (``paged_cpu.cpp``, built on first use where a compiler and ninja are there).

:func:`decode_attention` is keepkv's decode-step attention as one Triton kernel that reads
each stored key and value once (see :mod:`keepkv.kernels.decode`). Nothing calls it by default:
the torch path of :mod:`keepkv.attention` stays the reference and the default;
``CompressedCache(kernel="triton")`` makes a cache's decode steps that need probabilities or
logits use it, and :func:`keepkv.attention.decode_kernel_for` refuses it, in one line, on a
device where it cannot run.

On CPU, :mod:`keepkv.kernels.paged` attends a serving engine's blocks in place; a paged
compression's kept queries get their softmax in one C++ pass (:mod:`keepkv.kernels.kept`); and
three steps of KeepKV's merge run in one C++ pass each where the kernels build, with torch's code
everywhere else: its EMA fold (:mod:`keepkv.kernels.ema`), the ``protect`` gate (:mod:`keepkv.kernels.protect`)
and the merge's target search (:mod:`keepkv.kernels.nearest`).
"""

from .decode import decode_attention, triton_available

__all__ = ["decode_attention", "triton_available"]
