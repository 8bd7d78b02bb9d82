"""A paged request's prompt, phase by phase: its chunks as they are read (each compressed to its
whole prompt's budget where the method scores each entry alone), its end, a whole prompt read in
one step over its budget, and a chunk compressed alone (:class:`PagedPrompts`).

The engine's kernel attends a prompt in place, over its slots (:mod:`keepkv.paged`); what the method
reads of it is filed between steps (:class:`~keepkv.paged_requests.PagedRequests`: the newest query
rows, or statistics summed chunk by chunk) until its end, when the method observes it and
compresses it, or keeps it whole (:class:`~keepkv.step.LayerStep`, the Hugging Face path's calls),
and its kept entries are written back compact (:class:`~keepkv.paged_slots.PagedSlots`).
"""

from __future__ import annotations

import torch

from .attention import StepStats, attend, group_queries, join_prefill_stats, prompt_window_stats
from .paged_plan import StepPlan
from .paged_requests import PagedRequests
from .paged_slots import PagedSlots
from .step import LayerStep
from .store import LayerStore


class PagedPrompts:
    """The prompts of one :class:`~keepkv.paged.PagedCompression`'s requests: its method's ``step``
    on the stores read from their slots, what is filed between steps in ``requests``.
    ``keep_prompt``: prompts are kept whole and unscored; ``config``: the model's (or a rank's)."""

    def __init__(self, step: LayerStep, requests: PagedRequests, keep_prompt: bool, config):
        method = step.method
        self.step, self.method, self.requests, self.keep_prompt, self.config = step, method, requests, keep_prompt, config
        self.needs = method.needs(True)
        # "summed" statistics of every chunk's query rows (H2O's column sums), or only the newest
        # rows (end_rows of them), computed once the prompt is whole
        self.sums = bool(self.needs.probs or self.needs.colsum or self.needs.decays or self.needs.logits
                         or self.needs.colmax)
        self.end_rows = method.prefill_query_rows()

    @property
    def group(self) -> int:
        """Query heads per KV head (read on use: a scheduler's config names only the KV heads)."""
        return self.config.num_attention_heads // self.config.num_key_value_heads

    def attention(self, query: torch.Tensor, store: LayerStore, scaling: float):
        """keepkv's attention of prompts' query rows [R, H, q, D], the store's last q entries,
        causal among them and seeing every entry before them: (output, the statistics the method
        reads of a prompt)."""
        rows = query.shape[2]
        mask = torch.ones(rows, rows, dtype=torch.bool, device=query.device).tril()[None, None]
        return attend(query, store.keys, store.values, store.bias, mask, scaling, self.needs, True,
                      store.binary_bias())

    def file_chunk(self, slots: PagedSlots, plan: StepPlan, row: int, query, scaling, layer: int) -> None:
        """A prompt's chunk, attended in place: keep what its close will need (the method's state,
        its newest query rows, or its statistics summed so far)."""
        batch = plan.batch
        earlier, chunk_key = batch.chunk_keys[row]
        before = self.requests.take_chunk(earlier, layer)
        start, stop = batch.query_start[row], batch.query_start[row + 1]
        rows_query = query[start:stop].transpose(0, 1)[None]  # [1, H, q, D]
        if not self.sums or self.keep_prompt:  # a kept prompt is unscored: its newest rows do
            if before is not None and before.queries is not None:
                rows_query = torch.cat([before.queries, rows_query], dim=2)
            newest = rows_query[:, :, -self.end_rows :].clone()
            if plan.compresses_chunk(row, layer):
                self._compress_read_chunk(slots, plan, row, before, newest, scaling, layer)
                return
            self.requests.file_chunk(chunk_key, layer, before.state if before is not None else {}, None, newest,
                                     before.extras if before is not None else (),
                                     plan.held([row], layer, "after")[0] if plan.batch.ends is not None else 0)
            return
        # Statistics of every query row: this chunk's queries over the prompt so far (its slots).
        held = batch.computed[row] + stop - start
        store = slots.gather(plan.blocks_of([row], held), (held,), (held,), layer)
        if before is None:
            self.step.start(store)
        else:
            store.resume(state=before.state)
        _, stats = self.attention(rows_query, store, scaling)
        if before is not None and before.stats is not None:
            stats = join_prefill_stats(before.stats, stats, self.needs.window)
        stats = StepStats(**{**vars(stats), "query": stats.query[:, :, :, -self.end_rows :]})
        self.requests.file_chunk(chunk_key, layer, dict(store.state), stats, None, tuple(store.extras))

    def _compress_read_chunk(self, slots: PagedSlots, plan: StepPlan, row: int, before, newest, scaling: float,
                             layer: int) -> None:
        """A chunk of a prompt compressed chunk by chunk (:meth:`StepPlan.compresses_chunk`), attended
        in place: the row's slots read into a store, observed through its newest query rows
        ``newest`` [1, H, r, D] and compressed to its whole prompt's budget
        (``LayerStep.compress_chunk``, as the Hugging Face cache's ``start_prefill``), the kept
        entries written back compact, and what its next chunk or its close needs filed."""
        batch = plan.batch
        written, kept = plan.held([row], layer, "written"), plan.held([row], layer, "after")
        store = slots.gather(plan.blocks_of([row], written[0]), written,
                             (batch.computed[row] + batch.query_lengths[row],), layer)
        if before is None:
            self.step.start(store)
        else:
            store.resume(state=before.state)
        stats = prompt_window_stats(group_queries(newest, slots.layout.kv_heads), store.keys, store.bias,
                                    store.positions, scaling, self.needs.window)
        read = (store.positions.clone(), store.bias.clone())
        self.step.compress_chunk(store, *plan.chunk_budgets(row, layer, store.device), stats)
        slots.write_back(plan.blocks_of([row], kept[0]), (0,), store, kept, read)
        self.requests.file_chunk(batch.chunk_keys[row][1], layer, dict(store.state), None, newest,
                                 tuple(store.extras), kept[0])

    def closing_groups(self, plan: StepPlan, layer: int) -> list[list[int]]:
        """The step's close rows in groups that close as one store: kept prompts (``keep_prompt``,
        whose chunks file only their newest query rows) of one length, offset and count of filed
        rows; any other close row alone. A group's rows are ranked each alone, as alone."""
        if not self.keep_prompt:
            return [[row] for row in plan.closing]
        groups: dict = {}
        for row in plan.closing:
            filed = self.requests.peek_chunk(plan.batch.chunk_keys[row][0], layer)
            newest = 0 if filed is None or filed.queries is None else filed.queries.shape[2]
            alone = filed is not None and (filed.stats is not None or bool(filed.state))
            key = ("alone", row) if alone else (plan.batch.computed[row], plan.batch.offsets[row], newest)
            groups.setdefault(key, []).append(row)
        return list(groups.values())

    def close(self, slots: PagedSlots, plan: StepPlan, rows: list[int], scaling: float, layer: int,
               query=None) -> None:
        """Prompts that are whole: the method observes each and compresses it (or keeps it whole),
        and its kept entries are written back compact. Close rows' prompts were read in chunks (a
        group of them: :meth:`closing_groups`); ``query``: the step's queries, of a whole prompt it
        read and attended in place (one row)."""
        batch, row = plan.batch, rows[0]
        filed = [None] if query is not None else [self.requests.take_chunk(batch.chunk_keys[r][0], layer) for r in rows]
        prompt = filed[0]
        length = batch.query_lengths[row] if query is not None else batch.computed[row]
        # a prompt compressed chunk by chunk holds fewer entries than its tokens (one row: not a kept prompt)
        held = prompt.held if prompt is not None and prompt.held else length
        if query is not None:  # [1, H, r, D]: the prompt's query rows, or its newest ones its chunks kept
            newest = query[batch.query_start[row] : batch.query_start[row + 1]].transpose(0, 1)[None]
        else:  # [R, H, r, D]
            newest = None if prompt is None or prompt.queries is None else torch.cat([p.queries for p in filed])
        first = 0
        if self.keep_prompt:  # kept whole and unscored: its end reads only the slots of its newest query rows
            first = length - max(1, 0 if newest is None else newest.shape[2])
        store = slots.gather(plan.blocks_of(rows, held), (held - first,) * len(rows),
                             tuple(length + batch.offsets[r] for r in rows), layer, first)
        if prompt is None or (prompt.stats is None and not prompt.state):  # its first chunk's store, or a prefix
            self.step.start(store)
        else:
            store.resume(state=prompt.state)
        if prompt is not None and prompt.stats is not None:
            stats = prompt.stats
        elif newest is not None and self.sums:
            _, stats = self.attention(newest, store, scaling)
        elif newest is not None:
            stats = prompt_window_stats(group_queries(newest[:, :, -self.end_rows :], store.keys.shape[1]),
                                        store.keys, store.bias, store.positions, scaling, self.needs.window)
        else:  # a prompt whose every token another request wrote (a whole shared prefix): no query of its own
            stats = StepStats(query=store.keys.new_zeros(len(rows), slots.layout.kv_heads, self.group, 0,
                                                         slots.layout.head_dim),
                              scaling=scaling, is_prefill=True)
        sizes = plan.held(rows, layer, "after") if query is not None else plan.closed_sizes(rows, layer)
        self._end(slots, plan, rows, store, stats, tuple(size - first for size in sizes), layer, first=first)

    def dense(self, slots: PagedSlots, plan: StepPlan, rows, query, key, value, scaling, layer, output) -> None:
        """A whole prompt over its budget, read in one step: its blocks hold only what it keeps, so it
        is attended here (keepkv's attention), compressed, and its kept entries written compact."""
        start, stop = plan.batch.query_start[rows[0]], plan.batch.query_start[rows[0] + 1]
        new_keys, new_values = (t[start:stop].transpose(0, 1)[None] for t in (key, value))  # [1, H_kv, q, D]
        store = LayerStore(layer)
        store.lazy_initialization(new_keys, new_values)
        self.step.start(store)
        store.append(new_keys, new_values, torch.ones(1, stop - start, dtype=torch.bool, device=key.device))
        out, stats = self.attention(query[start:stop].transpose(0, 1)[None], store, scaling)
        output[start:stop] = out[0].to(output.dtype)
        self._end(slots, plan, rows, store, stats, plan.held(rows, layer, "after"), layer, everything=True)

    def compress_chunk_alone(self, slots: PagedSlots, plan: StepPlan, row: int, query, scaling: float,
                              layer: int) -> None:
        """A prompt's whole chunk is in (``chunk_blocks``): the row's slots read into a store, the
        entries before the chunk frozen, and the chunk compressed alone to one block of entries per
        KV head (``LayerStep.compress_chunk``, as the Hugging Face cache's ``chunk_keep``), observed
        through its newest query rows; the kept entries are written into the chunk's last block,
        the row's table once the chunk is compressed (``PagedBatch.after_tables``)."""
        batch, block_size = plan.batch, slots.layout.block_size
        start, held = batch.chunk_starts[row], batch.computed[row] + batch.query_lengths[row]
        store = slots.gather(plan.blocks_of([row], held), (held,), (held + batch.offsets[row],), layer)
        self.step.start(store)
        newest = query[batch.query_start[row] : batch.query_start[row + 1]].transpose(0, 1)[None]  # [1, H, q, D]
        if newest.shape[2] < self.end_rows:  # the chunk's earlier rows, filed by its earlier steps
            earlier = self.requests.peek_chunk(batch.chunk_keys[row][0], layer)
            if earlier is not None and earlier.queries is not None:
                newest = torch.cat([earlier.queries, newest], dim=2)
        stats = prompt_window_stats(group_queries(newest[:, :, -self.end_rows :], slots.layout.kv_heads),
                                    store.keys, store.bias, store.positions, scaling, self.needs.window)
        device = store.device
        budget = torch.full((1, slots.layout.kv_heads), start + block_size, device=device)
        self.step.compress_chunk(store, budget, torch.tensor([block_size], device=device), stats,
                                 frozen=torch.tensor([start + batch.offsets[row]], device=device),
                                 frozen_held=torch.tensor([start], device=device))
        after = batch.after_tables[[row]][:, : start // block_size + 1].long()
        slots.write_back(after, (start,), store, (start + block_size,), None)

    def _end(self, slots: PagedSlots, plan: StepPlan, rows, store: LayerStore, stats: StepStats, sizes: tuple,
                    layer: int, everything: bool = False, first: int = 0) -> None:
        """A whole prompt's end (``LayerStep.observe_prompt`` then ``close_prompt``, with the budgets
        the Hugging Face cache sets), its kept entries written back into its first ``sizes`` slots
        from slot ``first`` (``everything``: its slots held nothing yet) and the method's state filed."""
        self.step.observe_prompt(store, stats)
        budget, mean, frozen, held = plan.budgets(rows, layer, store.device)
        before = None if everything else (store.positions.clone(), store.bias.clone())
        self.step.close_prompt(store, budget, mean, frozen, stats, plan.interval(rows, layer), held)
        slots.write_back(plan.blocks_of(rows, first + max(sizes)), plan.starts(rows), store, sizes, before, first)
        self.requests.file_states(store.state, [plan.batch.first_block[r] for r in rows], layer)
