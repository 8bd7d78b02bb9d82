"""PyramidKV: SnapKV scores with more budget in lower layers."""

from dataclasses import dataclass, field

import torch

from .base import ComposedMethod, Merge, Selection, check_range, register, register_selection
from .snapkv import ObservationWindow


@register_selection
@dataclass(frozen=True)
class PyramidBudgets(ObservationWindow):
    """SnapKV's selection with layer budgets decreasing linearly from the first layer to the
    last: the last layer gets (b − w)/β + w and the first 2(b − w) − (b − w)/β + w, where b is the
    mean budget and w the window, so the mean stays b (the authors' code).

    Parameters
    ----------
    beta : float
        Steepness of the pyramid (paper: 20).
    window, kernel, sinks
        As SnapKV's (:class:`ObservationWindow`).
    """

    name = "pyramidkv"
    layered = True
    served = True
    beta: float = 20.0

    def __post_init__(self):
        super().__post_init__()
        check_range("beta", self.beta, 1.0, float("inf"))

    def allocate(self, layers, kv_heads, row_budget, prompt_lengths, scores=None):
        window = row_budget.clamp(max=self.window).double()
        spare = row_budget.double() - window
        smallest = spare / self.beta
        largest = 2 * spare - smallest
        # One layer: the middle of the pyramid, whose budget is the mean (linspace(0, 1, 1) is the bottom).
        depth = torch.linspace(0, 1, layers, dtype=torch.float64, device=row_budget.device) if layers > 1 else torch.full(
            (1,), 0.5, dtype=torch.float64, device=row_budget.device
        )
        per_layer = largest[None] - depth[:, None] * (largest - smallest)[None] + window[None]
        budgets = per_layer.round().long().clamp(min=1)
        return budgets[:, :, None].expand(layers, -1, kv_heads).clone()


@register
@dataclass
class PyramidKV(ComposedMethod):
    """PyramidKV (Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
    Information Funneling", 2024).

    Selection ``pyramidkv`` (:class:`PyramidBudgets`: SnapKV's scores, pyramidal layer budgets),
    merge ``none`` (evict).
    """

    name = "pyramidkv"
    paper = "Cai et al. 2024, arXiv 2406.02069"
    selection: Selection = field(default_factory=PyramidBudgets)
    merging: Merge = field(default_factory=Merge)
