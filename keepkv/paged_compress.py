"""A step's due compressions, run together: each layer's rows gathered as the layer's attention
call ends (:meth:`keepkv.paged.PagedCompression.forward`), then compressed with the other layers'
at the step's last layer, one store per group of rows. An engine whose layers hold blocks of their
own in groups (a ``PagedCompression`` per group) may hand every group's batch one list
(:attr:`keepkv.paged_requests.PagedBatch.due`): the groups' compressions then run together too.

A decoding request comes due in every layer at once, and an engine's step usually holds one or two
of them, so each layer alone would hand the method a store of one or two rows: hundreds of small
tensor ops whose cost is their count, not their arithmetic (KeepKV's merge most of all). Stacked,
a step's layers pay that count once. A store holds one layer's rows per part and the method ranks
each row alone, so every row keeps what its own layer's store would keep (a ranking with per-layer
parameters, the learned selection's scorer, reads each row's layer: ``LayerStore.row_layers``); a
method that reads its store's layer as one (``per_layer``: CaM's keyed draws) runs each layer alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .attention import StepStats
from .store import LayerStore

if TYPE_CHECKING:
    from .paged_requests import PagedRequests
    from .paged_slots import PagedSlots
    from .step import LayerStep

# Gathered stores wait for the step's last layer until they hold this many bytes of keys and values:
# past it, stacking copies more than the op count it saves (16 rows of 221 entries: one layer's).
DUE_BYTES = 4 << 20


@dataclass
class DueCompression:
    """One layer's compression of a group of decoding rows (``rows``, as ``StepPlan.compressing``
    groups them), gathered and with its statistics: its slots' store (the method's state resumed,
    budgets not set yet), the statistics, the positions and bias as read (``before``), the store's
    first slot in the requests' slots (``first``) and the budgets (budget [R, H_kv], mean [R],
    frozen [R] or None, frozen_held [R] or None) it takes; ``plan`` and ``requests``: the step plan
    and requests of the ``PagedCompression`` that gathered it (its layer group's)."""

    layer: int
    plan: object  # its keepkv.paged_plan.StepPlan (a layer above: not imported)
    requests: PagedRequests
    slots: PagedSlots
    rows: list[int]
    store: LayerStore
    stats: StepStats
    before: tuple[torch.Tensor, torch.Tensor]
    first: int
    budgets: tuple


def runs_due(plan, layer: int, method) -> bool:
    """Whether the step's gathered compressions (``plan``: its ``keepkv.paged_plan.StepPlan``) run
    now: at its last layer, when the batch says which
    that is (:attr:`keepkv.paged_requests.PagedBatch.layers`) and ``method`` may rank several layers'
    rows in one store (not ``per_layer``); else at every layer; and before their stores hold more
    than DUE_BYTES."""
    layers = plan.batch.layers
    if layers is None or method.per_layer or layer >= layers - 1:
        return True
    return sum(due.store.keys.nbytes + due.store.values.nbytes for due in plan.due) >= DUE_BYTES


def compress_due(plan, step: LayerStep) -> None:
    """The method's decode step (``step``) on the gathered stores of ``plan`` (a ``StepPlan``), the
    layers of one group of rows and one size stacked into one store, and each layer's kept entries
    written back into its rows' leading slots, its method state filed (each gathered layer's
    requests: :attr:`DueCompression.requests`)."""
    groups: dict = {}
    for due in plan.due:
        interval = due.plan.interval(due.rows, due.layer)  # layers of one size share it: it follows the budget
        groups.setdefault((tuple(due.rows), due.store.keys.shape[2], due.first, interval), []).append(due)
    plan.due.clear()  # in place: the list may be every layer group's (PagedBatch.due)
    for group in groups.values():
        alone = len(group) == 1
        store = group[0].store if alone else LayerStore.stack([due.store for due in group])
        budget, mean, frozen, held = (None if group[0].budgets[i] is None else torch.cat([due.budgets[i] for due in group])
                                      for i in range(4))
        step.set_budget(store, budget, mean, frozen, group[0].plan.interval(group[0].rows, group[0].layer), held)
        step.decode(store, group[0].stats if alone else StepStats.join([due.stats for due in group]))
        for due, part in zip(group, [store] if alone else store.split([len(due.rows) for due in group])):
            own = due.plan
            after = tuple(size - due.first for size in own.held(due.rows, due.layer, "after"))
            due.slots.write_back(own.blocks_of(due.rows, due.first + max(after)), own.starts(due.rows), part, after,
                                 due.before, due.first)
            due.requests.file_states(part.state, [own.batch.first_block[r] for r in due.rows], due.layer)
