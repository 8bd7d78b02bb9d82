"""K-norm: keep the entries whose keys have the smallest L2 norm (Devoto et al., "A Simple and
Effective L2 Norm-Based Strategy for KV Cache Compression", EMNLP 2024).

A whole compression method in one file (docs/architecture.md, "Adding a method"): import this
module and ``"knorm"`` works wherever a method name does (``keepkv.generate``, ``CompressedCache``,
``get_method("knorm+sinks=0")``).
"""

from dataclasses import dataclass

import torch

from keepkv.methods.base import ScoredEviction, protected, register


@register
@dataclass
class KNorm(ScoredEviction):
    """Keep ``sinks`` leading tokens, then the keys of smallest L2 norm: a low-norm key draws high
    attention (the paper's observation), so no attention statistics are needed.

    Parameters
    ----------
    sinks : int
        Leading tokens always kept.
    interval : int
        Compress every ``interval`` decode steps.
    """

    name = "knorm"
    paper = "Devoto et al. 2024, arXiv 2406.11430"
    scored = False  # the score is read from the keys: no per-entry state to keep
    sinks: int = 4

    def priority(self, layer) -> torch.Tensor:
        """[B, H_kv, S]: +inf for the sinks, else minus the key's norm (a higher priority stays)."""
        is_protected = protected(layer, self.sinks, torch.zeros_like(layer.budget))
        return (-layer.keys.float().norm(dim=-1)).masked_fill(is_protected, float("inf"))
