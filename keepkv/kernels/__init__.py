"""Optional GPU kernels (``pip install -e ".[gpu]"``, which brings Triton).

:func:`decode_attention` is keepkv's decode-step attention as one Triton kernel that reads
each stored key and value once (see :mod:`keepkv.kernels.decode`). Nothing calls it by default:
the torch path of :mod:`keepkv.attention` stays the reference and the default;
``CompressedCache(kernel="triton")`` makes a cache's decode steps that need probabilities or
logits use it, and :func:`keepkv.attention.decode_kernel_for` refuses it, in one line, on a
device where it cannot run.
"""

from .decode import decode_attention, triton_available

__all__ = ["decode_attention", "triton_available"]
