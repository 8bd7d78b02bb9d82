"""K-norm: keep the entries whose keys have the smallest L2 norm (Devoto et al., "A Simple and
Effective L2 Norm-Based Strategy for KV Cache Compression", EMNLP 2024).

A whole compression method in one file (docs/architecture.md, "Adding a method"): a selection
(which entries stay) and a method that pairs it with a merge (eviction by default). Import this
module and ``"knorm"`` works wherever a method name does (``keepkv.generate``, ``CompressedCache``,
``get_method("knorm+sinks=0")``, ``get_method("knorm+merge=zip")``), and ``selection=knorm``
pairs it with any other method's merge (``keepkv+selection=knorm``).
"""

from dataclasses import dataclass, field

import torch

from keepkv.methods.base import (
    ComposedMethod, Merge, ScoredSelection, Selection, protected, register, register_selection,
)


@register_selection
@dataclass(frozen=True)
class SmallKeyNorm(ScoredSelection):
    """Keep ``sinks`` leading tokens, then the keys of smallest L2 norm: a low-norm key draws high
    attention (the paper's observation), so no attention statistics are needed.

    Parameters
    ----------
    sinks : int
        Leading tokens always kept.
    """

    name = "knorm"
    sinks: int = 4

    def priority(self, layer, merge_scores=None) -> torch.Tensor:
        """[B, H_kv, S]: +inf for the sinks, else minus the key's norm (a higher priority stays)."""
        is_protected = protected(layer, self.sinks, torch.zeros_like(layer.budget))
        return (-layer.keys.float().norm(dim=-1)).masked_fill(is_protected, float("inf"))


@register
@dataclass
class KNorm(ComposedMethod):
    """K-norm (Devoto et al. 2024): selection ``knorm`` (:class:`SmallKeyNorm`), merge ``none``."""

    name = "knorm"
    paper = "Devoto et al. 2024, arXiv 2406.11430"
    selection: Selection = field(default_factory=SmallKeyNorm)
    merging: Merge = field(default_factory=Merge)
