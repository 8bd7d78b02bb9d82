"""One layer's compression step, in phases: the code both caches run.

The Hugging Face cache (:class:`keepkv.cache.CompressedCache`) and the paged adapter
(:class:`keepkv.paged.PagedCompression`) each own their attention and their storage; what a
method does to a layer's store is this object's, so a request served from an engine's blocks
is compressed by the very calls that compress it in ``keepkv.generate``:

==================  =====================================================================
phase               calls
==================  =====================================================================
prefill, chunk      :meth:`LayerStep.start` at a layer's first tokens (the method's extras);
                    nothing else until the prompt is whole, unless the method
                    ``compresses_chunks``: then :meth:`LayerStep.compress_chunk` after each
end of prompt       :meth:`LayerStep.observe_prompt` (the prompt's statistics), then
                    :meth:`LayerStep.close_prompt` (budgets; compress, or keep the prompt whole)
decode              :meth:`LayerStep.decode`: the step's statistics (one query row, or the
                    rows since the last compression), then the compression when it is due
reconstruction      none: a KVzip pass only adds to the prompt's statistics
                    (``CompressedCache.begin_reconstruction``); its end of prompt follows
==================  =====================================================================

Budgets come from :func:`keepkv.budgets.prompt_budgets`, the one rule of both caches.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .fused import CompiledStep, method_step

DECODING = ("compress", "append", "keep_prompt")


class LayerStep:
    """A method's phases on one layer's store (:class:`keepkv.store.LayerStore`), for a cache
    that decodes as ``decoding`` says (``CompressedCache(decoding=...)``). ``compile``: each decode
    step's ``observe`` and ``compress`` run as one ``torch.compile`` graph (:mod:`keepkv.fused`).
    ``static_shapes``: as ``CompressedCache``'s (True with ``compile``), handed to the method in
    each decode step's statistics."""

    def __init__(self, method, decoding: str = "compress", compile: bool = False, static_shapes: bool | None = None):
        if decoding not in DECODING:
            raise ValueError(f"decoding must be one of {', '.join(map(repr, DECODING))}, got {decoding!r}")
        self.method = method
        self.decoding = decoding
        self._method_step = CompiledStep() if compile else method_step
        self.static_shapes = True if compile else static_shapes

    def start(self, layer) -> None:
        """A layer's first tokens: the method registers its per-entry extras."""
        self.method.setup_layer(layer)

    def observe_prompt(self, layer, stats) -> None:
        """The whole prompt's statistics (its chunks' summed, a reconstruction pass's included)."""
        self.method.observe(layer, stats)

    def compress_chunk(self, layer, budget: torch.Tensor, row_budget: torch.Tensor | None, stats,
                       frozen: torch.Tensor | None = None, frozen_held: torch.Tensor | None = None) -> None:
        """A chunk of a prompt is in and the method ``compresses_chunks``: the chunk is observed as a
        prompt's end and the layer compressed to ``budget`` [B, H_kv], the budget of its whole prompt,
        so a layer never holds more than that plus one chunk. The entries it sheds are ones the
        whole prompt's compression would shed too (each scored alone, at least ``budget`` better
        ones kept), so what the last chunk's :meth:`close_prompt` keeps is what one compression of
        the whole prompt keeps, given the same entries. ``frozen``, ``frozen_held`` [B] (a chunk compressed alone,
        ``start_prefill(chunk_keep=(N, K))``): the entries of positions below ``frozen``, that many,
        stay as they are, so ``budget`` is theirs plus what the chunk keeps."""
        self.method.observe(layer, stats)
        layer.set_budget(budget, row_budget, frozen, 1, frozen_held)
        # The kept entries are copied out in slot order (no headroom: LayerStore.keep's select), as a
        # paged adapter's store, read for this one call, keeps them: ties rank by slot, so the next
        # chunk's compression then ranks alike on both paths.
        headroom = layer.headroom
        layer.reserve(0)
        self.method.compress(layer, stats)
        layer.reserve(headroom)

    def close_prompt(self, layer, budget: torch.Tensor | None, row_budget: torch.Tensor | None,
                     frozen: torch.Tensor | None = None, stats=None, interval: int = 1,
                     frozen_held: torch.Tensor | None = None) -> None:
        """The end of a layer's prompt, once the method observed it: the layer takes its budgets
        ([B, H_kv] entries each row and head may hold, None: never compress; [B] mean budgets) and is
        compressed, keeps its prompt whole (``decoding="keep_prompt"``, ``frozen`` [B] the prompt
        lengths), or is left to grow (``decoding="append"``). ``stats``: the prompt's statistics,
        which the compression may read. ``interval``: the cache's decode steps between compressions
        (:func:`keepkv.budgets.decode_interval`); the layer keeps interval - 1 fewer after each
        (:meth:`set_budget`), so it never holds more than its budget between steps, and its
        buffers have the room of interval 1. ``frozen_held`` [B]: the entries a kept prompt holds,
        where its chunks were compressed as they came (:meth:`compress_chunk`)."""
        layer.reserve(None)
        if budget is not None and self.decoding != "append":
            self.set_budget(layer, budget, row_budget, frozen, interval, frozen_held)
            layer.reserve(interval)
            if self.decoding == "compress":
                self.method.compress(layer, stats)
        elif budget is not None:
            layer.set_budget(budget, row_budget)
            self.method.compress(layer, stats)
        layer.restart_interval()

    @staticmethod
    def set_budget(layer, budget: torch.Tensor, row_budget: torch.Tensor | None, frozen: torch.Tensor | None,
                   interval: int, frozen_held: torch.Tensor | None = None) -> None:
        """Give ``layer`` its budgets [B, H_kv] (the most each row and head may hold between steps)
        as a layer decoding every ``interval`` steps keeps them: each compression keeps
        budget - (interval - 1), so the interval's appends bring it back to its budget, and to
        budget + 1 at the attention call that compresses, the peak of interval 1
        (``interval``: :func:`keepkv.budgets.decode_interval`)."""
        layer.set_budget(budget - (interval - 1), row_budget, frozen, interval, frozen_held)

    def compresses(self, layer) -> bool:
        """Whether the decode step now running compresses the layer: it has a budget, decoding
        keeps it, and its ``interval`` tokens came since the last compression."""
        return layer.budget is not None and layer.pending >= layer.interval and self.decoding != "append"

    def decode(self, layer, stats) -> None:
        """A decode step's method work: the step's statistics, then the compression if due
        (:meth:`compresses`). ``stats`` covers the rows appended since the last compression that
        the method has not seen (one per step in the Hugging Face cache). With a kept prompt
        (``decoding="keep_prompt"``) the probabilities are each query's attention among the
        generated entries (:func:`generated_share`)."""
        if layer.frozen is not None and stats.probs is not None:
            stats = generated_share(layer, stats)
        if self.static_shapes is not None:
            stats = replace(stats, static_shapes=self.static_shapes)
        compress = self.compresses(layer)
        self._method_step(self.method, layer, stats, compress)  # decode shapes are stable: compiled once
        if compress:
            layer.restart_interval()


def generated_share(layer, stats):
    """``stats`` with each query's probabilities [B, H_kv, g, q, S] over the generated entries only,
    renormalised among them: with a kept prompt (``decoding="keep_prompt"``) the prompt is outside
    the compression, so what ranks a generated entry is its share of the attention the generated
    entries received, not of a prompt's. (The paged adapter then scores a request's generated
    entries without reading its prompt.) A query that saw none of them gives zeros."""
    frozen = layer.frozen_entries()[:, :, None, None]  # [B, H_kv, 1, 1, S]
    probs = stats.probs.masked_fill(frozen, 0.0)
    return replace(stats, probs=probs / probs.sum(-1, keepdim=True).clamp_min(torch.finfo(probs.dtype).tiny))
