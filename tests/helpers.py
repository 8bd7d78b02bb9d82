"""Views of keepkv that only the tests need (not used by the library): the merges' pure forms,
the merge gates alone, a layer's EMA scores, a cache's reports, a sketch's hashes, a served
request's state."""

import math

import torch

from keepkv.merging import MergedRows, convex_merge_rows, momentum_merge_rows, spread_values_rows, zip_merge_rows
from keepkv.methods.kvreviver import KVReviver
from keepkv.store import write_rows


# -- merges, applied -------------------------------------------------------------------------
def applied(rows: MergedRows, **tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Copies of ``tensors`` (name -> [B, H_kv, S(, D)]) with ``rows``' merged rows written, in order;
    slots that receive no merge are bit-identical to the input."""
    return tuple(write_rows(x.clone(), rows.groups, rows.rows[name]) for name, x in tensors.items())


def zip_merge(keys, values, bias, log_scores, src, dst, merge, **options) -> tuple[torch.Tensor, ...]:
    """:func:`keepkv.merging.zip_merge_rows` applied: merged copies of keys, values [B, H_kv, S, D]
    and bias [B, H_kv, S]."""
    rows = zip_merge_rows(keys, values, bias, log_scores, src, dst, merge, **options)
    return applied(rows, keys=keys, values=values, bias=bias)


def convex_merge(keys, values, src, dst, merge, weights) -> tuple[torch.Tensor, ...]:
    """:func:`keepkv.merging.convex_merge_rows` applied: merged copies of keys, values."""
    return applied(convex_merge_rows(keys, values, src, dst, merge, weights), keys=keys, values=values)


def momentum_merge(keys, values, counts, src, dst, merge) -> tuple[torch.Tensor, ...]:
    """:func:`keepkv.merging.momentum_merge_rows` applied: merged copies of keys, values and counts."""
    rows = momentum_merge_rows(keys, values, counts, src, dst, merge)
    return applied(rows, keys=keys, values=values, count=counts)


def spread_values(values, src, merge, m, kept_next_idx) -> torch.Tensor:
    """:func:`keepkv.merging.spread_values_rows` applied: the merged values [B, H_kv, S, D]."""
    return applied(spread_values_rows(values, src, merge, m, kept_next_idx), values=values)[0]


def gate_merges(values, bias, log_scores, src, dst, merge, max_value_change=math.inf, max_share=1.0) -> torch.Tensor:
    """The merges of a plan that pass ZIP-merging's gates (``max_value_change`` ε, ``max_share`` δ):
    ``merge`` [B, H_kv, E] with every group that would move its target's value by more than ε
    relative, or bring it more than δ of the merged weight, dropped whole. The gates do not depend
    on the key rule: this is what :func:`keepkv.merging.zip_merge_rows` reports as merged."""
    keys = torch.zeros_like(values)  # the "mean" key rule: the keys do not enter the gates
    return zip_merge_rows(keys, values, bias, log_scores, src, dst, merge, key_rule="mean",
                          max_value_change=max_value_change, max_share=max_share).merge


# -- a method's state and reports ------------------------------------------------------------
def ema_scores(merging, layer) -> torch.Tensor:
    """[B, H_kv, g, S] KeepKV's bias-corrected EMA log-scores ln ŝ^h = ln S^h - ln N of a layer
    (-inf on empty slots); ``merging``: the method's KeepKVMerge."""
    return merging.ranking_scores(layer).heads


def offload_report(cache) -> dict:
    """Sum of :meth:`keepkv.offload.FullKVCopy.report` over a CompressedCache's layers, plus refresh
    counts: tokens (of the first layer), bytes, reserved_bytes, bytes_to_host, seconds_to_host,
    bytes_to_device, seconds_to_device, appends, loads, refreshes (summed over layers), layers (how
    many layers hold a copy). All zero when no layer keeps a copy."""
    summed = (
        "bytes", "reserved_bytes", "bytes_to_host", "seconds_to_host",
        "bytes_to_device", "seconds_to_device", "appends", "loads",
    )
    totals = dict.fromkeys(summed, 0)
    totals.update(tokens=0, refreshes=0, layers=0)
    for layer in cache.layers:
        copy = layer.state.get("offload")
        if copy is None:
            continue
        report = copy.report()
        for key in summed:
            totals[key] += report[key]
        totals["tokens"] = max(totals["tokens"], report["tokens"])
        totals["refreshes"] += layer.state.get("refreshes", 0)
        totals["layers"] += 1
    return totals


def memory_report(cache) -> dict:
    """A KVReviver cache's stored bytes (entries, sketch, vague scalars) next to the measured
    rebuild peak (its :class:`keepkv.methods.kvreviver.RebuildTracker`)."""
    summary = cache.summary()
    # the entries' buffers; cache.nbytes() adds the sketch and the per-layer state tensors
    entries = sum(summary.entry_bytes) + sum(summary.padding_bytes) + sum(summary.spare_bytes)
    sketch = sum(layer.state["sketch"].nbytes() for layer in cache.layers if layer.state.get("sketch") is not None)
    first = cache.layers[0]
    tracker = KVReviver.tracker_of(first)
    per_token = 2 * first.keys.shape[1] * first.keys.shape[-1] * first.keys.element_size()
    return {
        "entry_bytes": entries,
        "sketch_bytes": sketch,
        "vague_scalar_bytes": sum(
            layer.state[name].numel() * layer.state[name].element_size()
            for layer in cache.layers
            for name in ("vague_pos", "vague_score")
            if name in layer.state
        ),
        "stored_bytes": cache.nbytes(),
        "peak_rebuilt_bytes": tracker.peak,
        "largest_layer_rebuilt_bytes": max(layer.state.get("peak_rebuilt_bytes", 0) for layer in cache.layers),
        "rebuilt_bytes_alive": tracker.live,
        "full_cache_bytes": int(first.real_seen.sum()) * per_token * cache.num_layers,
        "swaps": int(sum(layer.state["swaps"].sum() for layer in cache.layers if "swaps" in layer.state)),
    }


# -- a sketch's hashes -----------------------------------------------------------------------
def buckets_of(sketch, token_ids: torch.Tensor) -> torch.Tensor:
    """token_ids [...] int64 -> the sketch's bucket index h_j(t) [..., r], int64 in [0, b)."""
    return sketch._hashes(token_ids)[0]


def signs_of(sketch, token_ids: torch.Tensor) -> torch.Tensor:
    """token_ids [...] int64 -> the sketch's sign g_j(t) [..., r] in {-1, +1}, in the sketch's dtype."""
    return sketch._hashes(token_ids)[1]


# -- a served request ------------------------------------------------------------------------
def request_state(paged, first_block: int, layer: int) -> dict:
    """The method's state that a PagedCompression filed for the request whose first block is
    ``first_block``, at ``layer`` (per-row tensors as [1, ...])."""
    return paged.requests.states([first_block], layer)


def slot_positions(paged, kv_cache: torch.Tensor, blocks: torch.Tensor, size: int, head_dim: int) -> torch.Tensor:
    """[H_kv, size] int64: the position word of a request's slots 0..size-1, per KV head, in
    ``kv_cache`` [blocks, H_kv, block_size, C] laid out by ``paged`` (a PagedCompression) for a model
    head of ``head_dim``; ``blocks`` [n] int64: the request's block table."""
    kv_heads, block_size = kv_cache.shape[1:3]
    layout = paged.layout(block_size, kv_heads, head_dim, kv_cache.dtype)
    _, _, words = layout.planes(kv_cache)
    slots = torch.arange(size)
    index = layout.word_index(blocks[slots // block_size][None, :], torch.arange(kv_heads)[:, None],
                              (slots % block_size)[None, :])
    return words[index].long()


def assert_equal_up_to_rounding(got: torch.Tensor, expected: torch.Tensor, ulps: int = 64, msg: str = "") -> None:
    """Two fp32 computations of one quantity in different shapes (a rank's head slice against the
    whole model's heads, a row against its batch) may take other kernels, whose sums round
    differently on another CPU or BLAS build: equal within ``ulps`` of the largest |expected|, a few
    hundred times below what one entry kept in place of another changes."""
    atol = ulps * torch.finfo(torch.float32).eps * max(expected.abs().max().item(), 1.0)
    torch.testing.assert_close(got, expected, rtol=0, atol=atol, msg=lambda text: f"{msg} {text}")


# -- the learned selection on a test model ---------------------------------------------------------
_SCORERS: dict[str, str] = {}


def with_scorer(spec: str, config, seed: int = 0) -> str:
    """``spec`` with ``+scorer=PATH`` where it runs the learned selection: a linear scorer of random
    weights (``seed``) fitted to ``config`` (saved once per config and seed in a temporary folder), since the shipped
    one is the embedded model's and any other model's cache refuses it. Its layer shares
    (``budgets="trained"``) give the first layer 1.5 times the mean budget and the last 0.5 at 10%."""
    if "selection=learned" not in spec or "scorer=" in spec:
        return spec
    import json
    import tempfile

    from keepkv.scorer import FEATURES, Scorer, config_key

    key = config_key(config)
    name = json.dumps([key, seed], sort_keys=True)
    if name not in _SCORERS:
        layers, heads, width = key["layers"], key["kv_heads"], FEATURES["values+pairs"](key["head_dim"])
        generator = torch.Generator().manual_seed(seed)
        tensors = {"mean": torch.zeros(layers, heads, width), "std": torch.ones(layers, heads, width),
                   "weight": torch.randn(layers, heads, width, generator=generator), "bias": torch.zeros(layers, heads)}
        path = tempfile.NamedTemporaryFile(prefix="keepkv-test-scorer-", suffix=".pt", delete=False).name
        shares = {"budgets": [0.1, 1.0], "shares": [torch.linspace(1.5, 0.5, layers).tolist(), [1.0] * layers]}
        _SCORERS[name] = str(Scorer("linear", "values+pairs", key, tensors, layer_shares=shares).save(path))
    return f"{spec}+scorer={_SCORERS[name]}"
