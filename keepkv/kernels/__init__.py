"""Optional GPU kernels (``pip install -e ".[gpu]"``, which brings Triton).

:func:`decode_attention` is keepkv's decode-step attention as one Triton kernel that reads
each stored key and value once (see :mod:`keepkv.kernels.decode`). Nothing calls it by default:
the torch path of :mod:`keepkv.attention` stays the reference and the default;
``KEEPKV_DECODE_KERNEL=triton`` makes :func:`keepkv.attention.attend` use it for decode steps
that need probabilities or logits, and :func:`keepkv.attention.decode_kernel` says whether it
can run on a device.
"""

from .decode import decode_attention, triton_available

__all__ = ["decode_attention", "triton_available"]
