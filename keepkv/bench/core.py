"""run_bench() and the ``keepkv bench`` command line (documented in ``keepkv.bench``)."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import sys
import warnings

import torch
from tqdm.auto import tqdm

from ..arguments import DefaultsFormatter, check_device_option
from ..attention import decode_kernel_for
from ..diagnostics import KeepKVWarning
from ..methods.base import get_method, parse_value
from ..models import DTYPES, parse_device
from ..plotting import can_plot
from .configs import CONFIGS, build_config, param_bytes, random_model
from .options import QUICK_GEN_LEN, QUICK_METHODS, QUICK_REPEATS, add_arguments, check_modes  # noqa: F401 (add_arguments: this module's API)
from .setup import package_version, resolve_params, transformers_version
from .runner import (
    cache_bytes_per_row,
    device_name,
    is_cuda,
    max_batch,
    percentile,
    run_once,
    spread,
    weights_bytes,
)

GB = 1 << 30
RANDOM_NOTE = "random weights: speed only"


def documented_fields() -> list[str]:
    """Every JSON field path listed in the ``keepkv.bench`` docstring's schema section."""
    import keepkv.bench as bench

    section = bench.__doc__.split("JSON schema", 1)[1]
    return re.findall(r"^ {4}([A-Za-z_][\w.\[\]<>]*) : ", section, flags=re.MULTILINE)


# -- resolution of arguments ----------------------------------------------------------------------
def resolve_device(device) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = parse_device(device)  # one line for a CUDA device where torch has no CUDA
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def resolve_methods(methods) -> list[str]:
    """Registered methods or variants (``name+key=value``) to run ("full" first, added if missing);
    all registered by default or for ``"all"``."""
    from ..methods import METHODS

    if methods is None or methods in ("all", ["all"]):
        chosen = sorted(METHODS)
    else:
        if isinstance(methods, str):
            methods = [m for m in methods.split(",") if m.strip()]
        chosen = [m.strip() for m in methods]
        for method in chosen:
            get_method(method)  # unknown names and parameters fail here
    chosen = list(dict.fromkeys(chosen))
    return ["full"] + [m for m in chosen if m != "full"]


def load_bench_model(model=None, config=None, layers=None, dtype=torch.float32, device="cpu", seed=0):
    """(model, info): a named random-weight shape, a local model, or the embedded SmolLM2."""
    if model is not None and config is not None:
        raise ValueError("pass either a model or a config, not both")
    if config is not None:
        if isinstance(config, str):
            name = config
            config = build_config(config, layers=layers)
        else:
            name = getattr(config, "name_or_path", "") or config.model_type
            if layers is not None:
                config = type(config)(**{**config.to_dict(), "num_hidden_layers": layers})
        if torch.device(device).type == "cpu":
            need = param_bytes(config, dtype)
            available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
            if available and need > 0.8 * available:
                raise ValueError(
                    f"config {name!r} needs {need / GB:.1f} GB of weights in {dtype}, more than this machine can "
                    f"hold ({available / GB:.1f} GB); pass --layers N or a smaller shape"
                )
        built = random_model(config, dtype=dtype, device=device, seed=seed)
        return built, {"source": f"config:{name}", "random_weights": True, "note": RANDOM_NOTE}
    if model is None or isinstance(model, (str, os.PathLike)):
        from ..models import load_model

        loaded, _ = load_model(model, dtype=dtype, device=device)
        return loaded, {"source": "embedded" if model is None else str(model), "random_weights": False, "note": ""}
    if isinstance(model, torch.nn.Module):
        return model, {"source": type(model).__name__, "random_weights": False, "note": ""}
    raise ValueError(f"model must be None, a path or a torch module; got {type(model).__name__}")


def model_info(model, info: dict) -> dict:
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    param = next(model.parameters())
    return {
        **info,
        "model_type": config.model_type,
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": head_dim,
        "vocab_size": config.vocab_size,
        "dtype": str(param.dtype).replace("torch.", ""),
        "weights_bytes": weights_bytes(model),
    }


# -- aggregation -------------------------------------------------------------------------------------
def aggregate(runs: list[dict]) -> dict:
    """One fixed-batch record from the repetitions of one (batch, method)."""
    first = runs[0]
    batch, gen_len = first["batch"], first["gen_len"]
    tps = [batch * gen_len / (r["prefill_s"] + r["decode_s"]) for r in runs]
    decode_tps = [batch * gen_len / r["decode_s"] if r["decode_s"] else float("nan") for r in runs]
    means = [1000.0 * sum(r["step_s"]) / len(r["step_s"]) if r["step_s"] else float("nan") for r in runs]
    p95s = [1000.0 * percentile(r["step_s"], 95) if r["step_s"] else float("nan") for r in runs]
    prefills = [r["prefill_s"] for r in runs]
    median_run = sorted(zip(tps, range(len(runs))))[len(runs) // 2][1]
    chosen = runs[median_run]
    record = {"method": first["method"], "batch": batch, "prompt_len": first["prompt_len"], "gen_len": gen_len}
    record["repeats"] = len(runs)
    for key, values in (("tokens_per_s", tps), ("step_ms_mean", means), ("step_ms_p95", p95s), ("prefill_s", prefills)):
        record[key], record[f"{key}_min"], record[f"{key}_max"] = spread(values)
        if key == "tokens_per_s":
            record["decode_tokens_per_s"] = spread(decode_tps)[0]
    for key in (
        "cache_bytes",
        "cache_bytes_prefill",
        "cache_bytes_peak",
        "full_cache_bytes",
        "kept_entries",
        "peak_memory_bytes",
        "peak_memory_delta_bytes",
        "peak_memory_kind",
    ):
        record[key] = chosen[key]
    record["process_peak_rss_bytes"] = max(r["process_peak_rss_bytes"] for r in runs)
    return record


def _ratio(a, b):
    if a is None or b is None or not b or (isinstance(b, float) and math.isnan(b)):
        return None
    return a / b


def add_ratios(records: list[dict]) -> None:
    by_key = {(r["batch"], r["method"]): r for r in records}
    for record in records:
        full = by_key.get((record["batch"], "full"))
        h2o = by_key.get((record["batch"], "h2o"))
        record["tokens_per_s_vs_full"] = _ratio(record["tokens_per_s"], full and full["tokens_per_s"])
        record["step_ms_vs_full"] = _ratio(record["step_ms_mean"], full and full["step_ms_mean"])
        record["step_ms_vs_h2o"] = _ratio(record["step_ms_mean"], h2o["step_ms_mean"]) if h2o else None


# -- the benchmark -------------------------------------------------------------------------------------
def run_bench(
    model=None,
    *,
    config=None,
    layers: int | None = None,
    dtype=None,
    device=None,
    methods=None,
    budget: float | int = 0.2,
    method_params: dict | None = None,
    prompt_len: int = 1024,
    gen_len: int = 128,
    batches=(1,),
    repeats: int = 3,
    warmup: int = 1,
    memory_cap_gb: float | None = None,
    max_measure_batch: int | None = None,
    overhead_steps: int = 0,
    profile_steps: int = 0,
    seed: int = 0,
    progress: bool = True,
    log=None,
    prefill_chunk: int | None = None,
    prefill_rows: int | None = None,
    compile: bool = False,
    kernel: str = "torch",
) -> dict:
    """Benchmark methods on one model; returns the dict documented in ``keepkv.bench``.
    ``compile``: caches with ``compile=True`` (each layer's decode-time method step compiled);
    ``kernel``: the caches' decode kernel (``CompressedCache(kernel=...)``).

    Parameters
    ----------
    model : None, path or torch module
        None: the embedded SmolLM2-135M. A path: a local model (``keepkv.load_model``).
    config : str or PretrainedConfig
        A named shape (``keepkv.bench.CONFIGS``) or a config, built with random weights.
    layers : int
        Override the depth of ``config`` (smoke runs of large shapes).
    dtype : "auto", "float32", "bfloat16", "float16" or torch.dtype
        "auto": bf16 on CUDA, fp32 on CPU.
    device : str or torch.device
        Default: CUDA if available, else CPU.
    methods : list of str or comma-separated str
        Default: every registered method. ``full`` is always run (ratios).
    budget : float or int
        As ``CompressedCache``.
    method_params : dict
        ``{method: {param: value}}``; the key ``"*"`` applies to every method with that field.
    prompt_len, gen_len : int
        Prompt tokens per row and timed decode steps.
    batches : int or sequence of int
        Batch sizes of the fixed-batch mode.
    repeats, warmup : int
        Timed repetitions (median and min/max reported) and untimed short runs before each.
    memory_cap_gb : float
        Turns on the memory-cap mode (GB = 2**30 bytes).
    max_measure_batch : int
        Largest batch measured in memory-cap mode (default 8 on CPU, unlimited on GPU).
    overhead_steps, profile_steps : int
        Extra decode steps for the overhead proxies and for ``torch.profiler``.
    seed : int
        Seed of the random prompts and weights.
    prefill_chunk : int
        Feed each prompt in blocks of this many tokens (``keepkv.generate``'s ``prefill_chunk``):
        prefill attention's workspace is one block's, and the cache peaks at every layer's
        uncompressed prompt. None: one block.
    prefill_rows : int
        Prefill the batch this many prompts at a time, each group compressed before the next, and
        stack the groups into one decode batch (``CompressedCache.stack``, as a serving engine
        admits requests): the cache never holds more than one group's uncompressed prompt.
        None: the whole batch at once.
    progress : bool
        tqdm progress bars (stderr).
    log : callable
        Receives progress messages (default: print to stderr when ``progress``).
    """
    for name, value, low in (("prompt_len", prompt_len, 1), ("gen_len", gen_len, 1), ("repeats", repeats, 1),
                             ("warmup", warmup, 0), ("overhead_steps", overhead_steps, 0),
                             ("profile_steps", profile_steps, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                      or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk must be an int >= 1 (or None: one block), got {prefill_chunk!r}")
    if prefill_rows is not None and (isinstance(prefill_rows, bool) or not isinstance(prefill_rows, int)
                                     or prefill_rows < 1):
        raise ValueError(f"prefill_rows must be an int >= 1 (or None: the whole batch at once), got {prefill_rows!r}")
    batches = [batches] if isinstance(batches, int) else list(batches)
    if not batches or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batches):
        raise ValueError(f"batches must be ints >= 1, got {batches!r}")
    if memory_cap_gb is not None and not memory_cap_gb > 0:
        raise ValueError(f"memory_cap_gb must be > 0, got {memory_cap_gb!r}")
    if log is None:  # tqdm.write: a message is its own line above the bars, never glued to one
        log = (lambda msg: tqdm.write(msg, file=sys.stderr)) if progress else (lambda msg: None)

    load_start = _load_avg()
    device = resolve_device(device)
    decode_kernel_for(kernel, device)  # refused before the model loads where it cannot run
    dtype = resolve_dtype(dtype, device)
    names = resolve_methods(methods)
    params = resolve_params(names, method_params)
    from ..budgets import validate_budget

    validate_budget(budget)
    torch.manual_seed(seed)

    log(f"bench: loading model on {device} ({str(dtype).replace('torch.', '')})")
    loaded, info = load_bench_model(model, config, layers, dtype, device, seed)
    busy = contention(load_start, torch.get_num_threads()) if device.type == "cpu" else None
    if busy:
        warnings.warn(busy, KeepKVWarning, stacklevel=2)
    minfo = model_info(loaded, info)
    notes = []
    if minfo["random_weights"]:
        notes.append(f"{RANDOM_NOTE} ({minfo['source']}, {minfo['num_layers']} layers)")
    if device.type == "cpu":
        notes.append(
            "CPU: peak_memory_bytes is the process RSS sampled every 2 ms during the run (allocator caching "
            "included); process_peak_rss_bytes is getrusage's lifetime peak"
        )
    requested = [m.strip() for m in methods.split(",")] if isinstance(methods, str) else methods
    if requested is not None and "full" not in requested:
        notes.append("full added: every ratio is against full measured in the same run")
    if any(get_method(name, **params[name]).interval > 1 for name in names):
        notes.append("interval > 1 trades quality for speed: check it with `keepkv eval`")

    errors: dict[str, str] = {}

    def one(method, batch, L, G, rep_seed, overhead=0, prof=0, bar=False):
        """run_once, or None (and the method dropped from the run) if the method raises."""
        if method in errors:
            return None
        try:
            return run_once(
                loaded, method, budget, params[method], prompt_len=L, gen_len=G, batch=batch, seed=rep_seed,
                overhead_steps=overhead, profile_steps=prof, progress=bar and progress, prefill_chunk=prefill_chunk,
                prefill_rows=prefill_rows, compile=compile, kernel=kernel,
            )
        except Exception as error:  # a method under development must not sink the whole benchmark
            if method == "full":
                raise
            errors[method] = f"{type(error).__name__}: {error}"
            log(f"bench: {method} failed and is left out: {errors[method]}")
            return None

    def warm(batch):
        # Short untimed runs; a warning about their prompt (one the user never gave) would mislead.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KeepKVWarning)
            for method in names:
                for _ in range(warmup):
                    # compiled: the timed shapes, so that no step of a timed run compiles
                    one(method, batch, prompt_len if compile else min(prompt_len, 128), min(gen_len, 4), seed)

    # -- fixed batch
    fixed, overhead, profile = [], [], {}
    largest = max(batches)
    # One bar over every timed run: its ETA is the whole benchmark's (warm-ups included in the rate).
    overall = tqdm(total=len(batches) * repeats * len(names), desc="bench", unit="run", disable=not progress)
    for batch in batches:
        warm(batch)
        runs: dict[str, list] = {m: [] for m in names}
        for rep in range(repeats):
            for method in names:
                overall.set_postfix_str(f"b={batch} rep {rep + 1}/{repeats} {method}")
                overall.update(0)
                out = one(
                    method, batch, prompt_len, gen_len, seed + rep,
                    overhead=overhead_steps if rep == 0 else 0,
                    prof=profile_steps if rep == 0 and batch == largest else 0,
                    bar=True,
                )
                overall.update(1)
                if out is None:
                    continue
                runs[method].append(out)
                if "overhead" in out:
                    overhead.append({"method": method, "batch": batch, **out["overhead"]})
                if "profile" in out:
                    profile[method] = {"batch": batch, **out["profile"]}
        fixed.extend(aggregate(runs[m]) for m in names if runs[m] and m not in errors)
    overall.close()
    add_ratios(fixed)

    # -- memory cap
    memory_cap = None
    if memory_cap_gb is not None:
        memory_cap = memory_cap_mode(
            loaded, names, one, warm, memory_cap_gb, max_measure_batch, minfo["weights_bytes"], device,
            prompt_len, gen_len, repeats, seed, log, notes, errors, prefill_rows,
        )

    import keepkv

    for method, message in errors.items():
        notes.append(f"{method} raised and was left out: {message}")
    return {
        "schema_version": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "keepkv": getattr(keepkv, "__version__", None) or package_version(),
            "torch": torch.__version__,
            "transformers": transformers_version(),
            "python": platform.python_version(),
        },
        "host": {
            "device": str(device),
            "device_name": device_name(device),
            "gpu": device.type == "cuda",
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "load_avg_start": load_start,
            "load_avg_end": _load_avg(),
        },
        "model": minfo,
        "settings": {
            "prompt_len": prompt_len,
            "prefill_chunk": prefill_chunk,
            "prefill_rows": prefill_rows,
            "gen_len": gen_len,
            "batches": batches,
            "budget": budget,
            "repeats": repeats,
            "warmup": warmup,
            "methods": names,
            "method_params": params,
            "compile": compile,
            "seed": seed,
            "memory_cap_gb": memory_cap_gb,
            "max_measure_batch": memory_cap and memory_cap["max_measure_batch"],
            "overhead_steps": overhead_steps,
            "profile_steps": profile_steps,
            "contention": busy,
        },
        "fixed": fixed,
        "overhead": overhead,
        "memory_cap": memory_cap and {k: v for k, v in memory_cap.items() if k != "max_measure_batch"},
        "profile": profile,
        "errors": errors,
        "notes": notes,
    }


def memory_cap_mode(model, names, one, warm, cap_gb, max_measure, weights, device, prompt_len, gen_len, repeats,
                    seed, log, notes, errors, prefill_rows=None) -> dict:
    """The papers' method: the largest batch per method under the cap, and its throughput.

    With ``prefill_rows`` R the prompts are prefilled R at a time, each group compressed before
    the next: the cache of a batch b > R peaks at max((b - R)·decode + R·prefill, b·decode·(L+1)/L)
    (the last group's prompt beside the compressed rows; the stack moves one layer at a time).
    """
    capacity = int(cap_gb * GB)
    if max_measure is None and not is_cuda(device):
        max_measure = 8
    # Staggered prefills leave only decode activations per row: probe further apart, so that
    # the RSS noise (tens of MB on CPU) is divided among more rows.
    probe_batches = (1, 1 + 4 * prefill_rows) if prefill_rows else (1, 2)
    rows = []
    for method in names:
        log(f"bench: memory cap: probing {method} at batch {probe_batches[0]} and {probe_batches[1]}")
        probes = [one(method, batch, prompt_len, min(gen_len, 2), seed) for batch in probe_batches]
        if any(probe is None for probe in probes):
            continue
        acct = cache_bytes_per_row(probes[0], prompt_len, gen_len)
        # Workspace = measured peak above the start, minus the cache; fitted as fixed + per row
        # (the attention chunks are bounded in bytes whatever the batch).
        space = [max(0, p["peak_memory_delta_bytes"] - p["cache_bytes_peak"]) for p in probes]
        per_row_space = max(0, space[1] - space[0]) // (probe_batches[1] - probe_batches[0])
        fixed_space = max(0, space[0] - per_row_space)
        layers = len(probes[0]["layer_entries_prefill"])
        stacked_row = acct["decode_bytes"] * (layers + 1) / layers  # a row, and one layer of it moving

        def cache_for_batch(b, acct=acct, stacked_row=stacked_row):
            if not prefill_rows or b <= prefill_rows:
                return b * acct["peak_bytes"]
            return max((b - prefill_rows) * acct["decode_bytes"] + prefill_rows * acct["prefill_bytes"], b * stacked_row)

        per_row = (stacked_row if prefill_rows else acct["peak_bytes"]) + per_row_space  # one more row, large batches

        def bytes_for_batch(b, per_row_space=per_row_space, fixed_space=fixed_space, cache_for_batch=cache_for_batch):
            return weights + fixed_space + cache_for_batch(b) + b * per_row_space

        best = max_batch(capacity, bytes_for_batch)
        measured = min(best, max_measure) if max_measure else best
        rows.append(
            {
                "method": method,
                "cache_bytes_per_row": math.ceil(stacked_row) if prefill_rows else acct["peak_bytes"],
                "cache_prefill_bytes_per_row": acct["prefill_bytes"],
                "cache_decode_bytes_per_row": acct["decode_bytes"],
                "workspace_bytes_per_row": per_row_space,
                "workspace_bytes_fixed": fixed_space,
                "bytes_per_row": per_row,
                "max_batch": best,
                "bytes_at_max_batch": bytes_for_batch(best),
                "bytes_at_max_batch_plus_1": bytes_for_batch(best + 1),
                "measured_batch": measured,
                "capped": measured < best,
            }
        )
    # Throughput at each method's batch; methods interleaved per repetition.
    results: dict[str, list] = {row["method"]: [] for row in rows}
    for batch in sorted({row["measured_batch"] for row in rows if row["measured_batch"]}):
        warm(batch)
    for rep in range(repeats):
        for row in rows:
            if row["measured_batch"]:
                log(f"bench: memory cap rep {rep + 1}/{repeats} {row['method']} b={row['measured_batch']}")
                results[row["method"]].append(one(row["method"], row["measured_batch"], prompt_len, gen_len, seed + rep,
                                                  bar=True))
    for row in rows:
        runs = [run for run in results[row["method"]] if run is not None]
        if runs and row["method"] not in errors:
            record = aggregate(runs)
            row.update(
                tokens_per_s=record["tokens_per_s"],
                tokens_per_s_min=record["tokens_per_s_min"],
                tokens_per_s_max=record["tokens_per_s_max"],
                step_ms_mean=record["step_ms_mean"],
            )
        else:
            row.update(tokens_per_s=None, tokens_per_s_min=None, tokens_per_s_max=None, step_ms_mean=None)
    full = next(row for row in rows if row["method"] == "full")
    for row in rows:
        row["tokens_per_s_vs_full"] = _ratio(row["tokens_per_s"], full["tokens_per_s"])
        row["batch_vs_full"] = _ratio(row["max_batch"], full["max_batch"])
    cache_rule = ("max((b - R) * decode + R * prefill, b * decode * (L + 1) / L) for b > R = prefill_rows, else b * peak"
                  if prefill_rows else "b * predicted peak cache per row")
    note = (
        f"bytes(b) = weights + workspace_fixed + cache(b) + b * workspace per row, cache(b) = {cache_rule}; "
        f"workspace measured at batch {probe_batches[0]} and {probe_batches[1]}; max_batch by binary search under {cap_gb:g} GB"
    )
    if any(row["capped"] for row in rows):
        note += f"; throughput measured at min(max_batch, {max_measure}) (max_measure_batch), not at max_batch"
        notes.append(
            f"memory cap: batches above {max_measure} were not measured on {device.type}; "
            "the capped tokens_per_s_vs_full is not the papers' memory-cap ratio"
        )
    if not is_cuda(device):
        notes.append(f"memory cap on CPU: workspace from the RSS deltas of the batch-{probe_batches[0]} and "
                     f"batch-{probe_batches[1]} probes (allocator caching makes it approximate)")
    return {
        "capacity_bytes": capacity,
        "capacity_gb": cap_gb,
        "weights_bytes": weights,
        "note": note,
        "methods": rows,
        "max_measure_batch": max_measure,
    }


def contention(load_avg: float | None, threads: int) -> str | None:
    """The one-line warning of a CPU run that starts on a busy host, or None: when the 1-minute load
    average (before the run) leaves more than half a core fewer free than the run's torch threads,
    other work takes turns with them, and each method's time is stretched by how often it waits
    (docs/performance.md has a measured case)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if load_avg is None or cores - load_avg >= threads - 0.5:
        return None
    return (f"the host is busy (load average {load_avg:.1f} on {cores} cores before the run, for {threads} torch "
            f"thread{'s' if threads > 1 else ''}): times are stretched by other work, unevenly between methods; "
            f"measure on an idle host{'' if threads == 1 else ', or with --threads 1'}")


def _load_avg() -> float | None:
    """1-minute load average of the host (timings on a shared CPU are only as good as this is low)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


# -- command line ----------------------------------------------------------------------------------------
def parse_params(items: list[str] | None) -> dict:
    """``["interval=8", "h2o.recent_ratio=0.3"]`` -> ``{"*": {"interval": 8}, "h2o": {"recent_ratio": 0.3}}``."""
    params: dict[str, dict] = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--param wants KEY=VALUE or METHOD.KEY=VALUE, got {item!r}")
        method, dot, name = key.rpartition(".")
        params.setdefault(method if dot else "*", {})[name] = parse_value(text)
    return params


# `keepkv bench` with no options: a quick run (about 2 minutes on a 2-core CPU), not the grid.
FULL_GRID = "keepkv bench --methods all --repeats 3 --gen-len 128 (every registered method; over an hour on a 2-core CPU)"


def main(args: argparse.Namespace) -> int:
    """Run ``keepkv bench`` from parsed arguments; returns the exit code."""
    from .plot import format_table, save_plot

    json_to = getattr(args, "json", None)
    if json_to is True:  # a parent parser's --json flag
        json_to = "-"
    elif json_to is False:
        json_to = None
    try:  # before any model loads (keepkv bench has run check_plain, check_modes with it, before torch loaded)
        check_modes(args)
        if getattr(args, "device", None) is not None:
            check_device_option(args.device)
    except ValueError as error:
        return _refused(error)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    if getattr(args, "cuda_suite", False):
        from .cuda_suite import main as cuda_main

        return cuda_main(["--out", args.out or "runs/cuda"])
    if getattr(args, "soak", False):
        return _soak_main(args, json_to)
    if getattr(args, "ops", False):
        return _ops_main(args, json_to)
    if getattr(args, "reconstruction", False):
        return _reconstruction_main(args, json_to)
    if args.layers is not None and args.config is None:
        return _refused("--layers needs --config")
    if args.model is not None and args.config is not None:
        return _refused("pass either --model or --config, not both")
    try:
        result = run_bench(
            args.model,
            config=args.config,
            layers=args.layers,
            dtype=args.dtype,
            device=args.device,
            methods=args.methods,
            budget=0.2 if args.budget is None else args.budget,
            method_params=parse_params(args.param),
            compile=args.compile,
            prompt_len=1024 if args.prompt_len is None else args.prompt_len,
            gen_len=args.gen_len,
            batches=[1] if args.batch is None else args.batch,
            repeats=args.repeats,
            warmup=args.warmup,
            memory_cap_gb=args.memory_cap,
            max_measure_batch=args.max_measure_batch,
            overhead_steps=args.overhead_steps if args.overhead else 0,
            profile_steps=args.profile,
            seed=args.seed,
            progress=not args.no_progress,
            prefill_chunk=args.prefill_chunk,
            prefill_rows=args.prefill_rows,
            kernel=args.kernel,
        )
    except ValueError as error:
        return _refused(error)
    if (args.methods, args.repeats, args.gen_len) == (QUICK_METHODS, QUICK_REPEATS, QUICK_GEN_LEN):
        result["notes"].append(f"a quick run; the full grid: {FULL_GRID}")
    table = format_table(result)
    text = json.dumps(result, indent=2)
    print(table, file=sys.stderr if json_to == "-" else sys.stdout)
    if json_to == "-":
        print(text)
    elif json_to:
        with open(json_to, "w") as handle:
            handle.write(text + "\n")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench.json"), "w") as handle:
            handle.write(text + "\n")
        with open(os.path.join(args.out, "bench.txt"), "w") as handle:
            handle.write(table + "\n")
    plots = [path for path in (args.out and os.path.join(args.out, "bench.png"), args.plot) if path]
    if plots and can_plot("keepkv bench", "the table and the JSON hold every number"):
        for path in plots:
            save_plot(result, path)
    return 0


def _refused(error) -> int:
    """Print a refusal as the command line's one error line; the exit status of a usage error."""
    print(f"keepkv: error: {' '.join(str(error).split())}", file=sys.stderr)
    return 2


def _soak_main(args: argparse.Namespace, json_to: str | None) -> int:
    """``keepkv bench --soak``: see :mod:`keepkv.bench.soak`."""
    from .soak import format_soak, run_soak

    if getattr(args, "soak_text", False):
        return _text_soak_main(args, json_to)
    try:
        if args.soak_steps is None:
            args.soak_steps = 20_000
        if isinstance(args.soak_steps, bool) or not isinstance(args.soak_steps, int) or args.soak_steps < 1:
            raise ValueError(f"soak steps must be an int >= 1, got {args.soak_steps!r}")  # before the model loads
        device = resolve_device(args.device)
        config = args.config if args.model is not None or args.config else "smollm2-135m"
        layers = args.layers if args.layers is not None or args.model is not None else 2
        model, info = load_bench_model(
            args.model, config=config if args.model is None else None, layers=layers,
            dtype=resolve_dtype(args.dtype, device), device=device, seed=args.seed,
        )
        prompt_len = 256 if args.prompt_len is None else args.prompt_len
        methods = resolve_methods("all" if args.methods == QUICK_METHODS else args.methods)
        result = run_soak(
            model, methods, 0.2 if args.budget is None else args.budget, prompt_len=prompt_len, steps=args.soak_steps, seed=args.seed,
            progress=not args.no_progress, method_params=parse_params(args.param), compile=args.compile,
        )
    except ValueError as error:
        return _refused(error)
    result["model"].update(source=info["source"], random_weights=info["random_weights"])
    _emit("soak", result, format_soak(result), json_to)
    return 0


def _text_soak_main(args: argparse.Namespace, json_to: str | None) -> int:
    """``keepkv bench --soak --soak-text``: see :func:`keepkv.bench.soak.run_text_soak`."""
    from ..models import load_model
    from .reconstruction import prose_ids
    from .soak import TEXT_STEPS, format_text_soak, run_text_soak

    try:
        if args.config is not None:
            raise ValueError("--soak-text runs the embedded model or --model (it writes text)")
        steps = TEXT_STEPS if args.soak_steps is None else args.soak_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"soak steps must be an int >= 1, got {steps!r}")
        methods = resolve_methods("all" if args.methods == QUICK_METHODS else args.methods)
        model, tokenizer = load_model(args.model, device=resolve_device(args.device))
        prompt_ids = prose_ids(tokenizer, 1024 if args.prompt_len is None else args.prompt_len)
        prompt_ids = prompt_ids.to(next(model.parameters()).device)
        result = run_text_soak(model, tokenizer, methods, 0.1 if args.budget is None else args.budget, prompt_ids,
                               steps=steps, progress=not args.no_progress, method_params=parse_params(args.param))
    except ValueError as error:
        return _refused(error)
    _emit("text_soak", result, format_text_soak(result), json_to)
    return 0


def _reconstruction_main(args: argparse.Namespace, json_to: str | None) -> int:
    """``keepkv bench --reconstruction``: see :mod:`keepkv.bench.reconstruction`."""
    from ..models import load_model
    from .reconstruction import LENGTHS, METHODS, format_reconstruction, run_reconstruction_bench

    try:
        if args.config is not None:
            raise ValueError("--reconstruction runs the embedded model or --model (it needs a tokenizer)")
        methods = list(METHODS) if args.methods == QUICK_METHODS else [m for m in resolve_methods(args.methods) if m != "full"]
        for method in methods:
            if not get_method(method).needs(True).reconstruct:
                raise ValueError(f"{method} runs no reconstruction pass")
        if args.prompt_len is not None and args.prompt_len < 1:
            raise ValueError(f"--prompt-len must be >= 1, got {args.prompt_len}")
        lengths = LENGTHS if args.prompt_len is None else (args.prompt_len,)
        model, tokenizer = load_model(args.model, device=resolve_device(args.device))
        result = run_reconstruction_bench(model, tokenizer, methods, lengths, repeats=args.repeats,
                                          progress=not args.no_progress)
    except ValueError as error:
        return _refused(error)
    table = format_reconstruction(result)
    text = _emit("reconstruction", result, table, json_to)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        for name, content in (("reconstruction.json", text), ("reconstruction.txt", table)):
            with open(os.path.join(args.out, name), "w") as handle:
                handle.write(content + "\n")
    return 0


def _emit(kind: str, result: dict, table: str, json_to: str | None) -> str:
    """Print a run's table (to stderr when the JSON goes to stdout) and its JSON ``{kind: result}``
    to ``json_to`` ("-": stdout); returns the JSON text."""
    print(table, file=sys.stderr if json_to == "-" else sys.stdout)
    text = json.dumps({kind: result}, indent=2)
    if json_to == "-":
        print(text)
    elif json_to:
        with open(json_to, "w") as handle:
            handle.write(text + "\n")
    return text


def _ops_main(args: argparse.Namespace, json_to: str | None) -> int:
    """``keepkv bench --ops``: see :mod:`keepkv.bench.ops`."""
    from .ops import format_ops, run_ops

    try:
        if isinstance(args.ops_steps, bool) or not isinstance(args.ops_steps, int) or args.ops_steps < 1:
            raise ValueError(f"--ops-steps must be an int >= 1, got {args.ops_steps!r}")
        batch = args.batch or [2]
        if len(batch) != 1 or batch[0] < 1:
            raise ValueError(f"--ops counts one batch size >= 1, got {' '.join(map(str, batch))}")
        prompt_len = 512 if args.prompt_len is None else args.prompt_len
        if prompt_len < 1:
            raise ValueError(f"--prompt-len must be >= 1, got {prompt_len}")
        device = resolve_device(args.device)
        config = args.config if args.model is not None or args.config else "smollm2-135m"
        layers = args.layers if args.layers is not None or args.model is not None else 4
        model, info = load_bench_model(
            args.model, config=config if args.model is None else None, layers=layers,
            dtype=resolve_dtype(args.dtype, device), device=device, seed=args.seed,
        )
        methods = resolve_methods("all" if args.methods == QUICK_METHODS else args.methods)
        budget = 0.1 if args.budget is None else args.budget
        from ..budgets import validate_budget

        validate_budget(budget)
        result = run_ops(
            model, methods, budget, prompt_len=prompt_len, batch=batch[0], steps=args.ops_steps, seed=args.seed,
            progress=not args.no_progress, method_params=parse_params(args.param), compile=args.compile,
        )
    except ValueError as error:
        return _refused(error)
    result["model"].update(source=info["source"], random_weights=info["random_weights"])
    table = format_ops(result)
    text = _emit("ops", result, table, json_to)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ops.json"), "w") as handle:
            handle.write(text + "\n")
        with open(os.path.join(args.out, "ops.txt"), "w") as handle:
            handle.write(table + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keepkv bench", description="Throughput, memory and per-step overhead of every registered method.",
        formatter_class=DefaultsFormatter,
    )
    return add_arguments(parser)
