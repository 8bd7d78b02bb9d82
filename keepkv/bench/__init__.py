"""keepkv.bench: throughput, memory and per-step overhead of every registered method, in one run.

Python: ``keepkv.bench.run_bench(...) -> dict`` (fields below). CLI: ``keepkv bench`` (or
``python -m keepkv.bench``), built from :func:`add_arguments` and run by :func:`main`.

Models
------
The embedded SmolLM2-135M (default), a local model (``model=PATH``), or a named shape with
random weights (``config=NAME``: llama2-7b, llama3-8b, mistral-7b, qwen2-7b, smollm2-135m;
``layers=N`` shrinks the depth for smoke runs). Random weights measure speed only, and the
output says so. A shape is built directly on its device in its dtype with HF's init skipped
(see :mod:`keepkv.bench.configs`), so a 7B shape in bf16 builds in seconds on a GPU; on this
project's CPU machines use ``smollm2-135m`` or ``--layers``.

Modes
-----
Fixed batch (always): for each batch ``b`` and method, ``repeats`` runs of one prefill of
``b`` random prompts of ``prompt_len`` tokens and ``gen_len`` greedy decode steps with a
:class:`keepkv.CompressedCache` (a manual loop, not ``generate``; the prefill returns only the
last position's logits). Methods are interleaved within each repetition and every run is
preceded by ``warmup`` short runs of the same batch. Reported: the median over repetitions
with min and max. With ``prefill_chunk`` (``--prefill-chunk N``) each prompt is fed in blocks
of N tokens: prefill attention's workspace is one block's, and every layer holds its whole
uncompressed prompt until the last block, so the prefill cache peak is the full prompt cache.
With ``prefill_rows`` (``--prefill-rows R``) the batch is prefilled R prompts at a time, each
group compressed before the next starts, and the groups are stacked into one decode batch
(:meth:`keepkv.CompressedCache.stack`), as a serving engine admits requests: the cache then
holds one group's uncompressed prompt at most, and the memory cap buys compressed rows.

Memory cap (``memory_cap_gb``, GB = 2**30 bytes): per method, the largest batch whose
weights + peak cache + workspace fit, by byte accounting: :func:`max_batch` over
``weights + workspace_fixed + b * (cache_peak_per_row + workspace_per_row)``. Per-row cache
bytes come from a batch-1 probe run at the full prompt length: per-entry bytes at the end of
prefill (when the core still holds every layer's whole prompt), and the cache's size after
compression plus ``interval`` entries (or ``prompt_len + gen_len`` entries for a cache that
never compresses). Workspace is the probes' measured peak memory above their start minus
their cache peak, at batch 1 and 2 (1 and 1 + 4R with ``prefill_rows`` R: staggered
prefills leave only decode activations per row, and RSS noise is divided among more rows),
fitted as a fixed part plus a part per row; with ``prefill_rows`` the cache term is
``max((b - R) * decode + R * prefill, b * decode * (L + 1) / L)`` instead. Throughput
is then measured at that batch, capped at ``max_measure_batch`` (default 8 on CPU, none on
GPU; a capped row says so), and divided by ``full``'s from the same run.

Overhead (``overhead_steps`` > 0): after the timed steps of the first repetition, that many
more decode steps run with timing proxies on the method instance's ``observe``, ``compress``
and ``attention_entries`` (the method's own code), every layer's ``append`` and the cache's
``forward_layer`` (CUDA events on GPU, perf_counter on CPU). Profile (``profile_steps`` >
0): that many more steps of the largest batch under ``torch.profiler``; the top ops by self
time, per step, and the ``keepkv::<part>`` ranges of the proxies.

Throughput ``tokens_per_s`` is ``b * gen_len / (prefill + decode time)`` (end to end, as the
papers' tables); ``decode_tokens_per_s`` leaves the prefill out. Every ratio divides numbers
measured in the same process and run.

JSON schema (schema_version 1)
------------------------------
One field per line as ``path : type : meaning``; ``[]`` stands for every element of a list,
``<method>`` for every key of a dict. Times are seconds (``_s``) or milliseconds (``_ms``).

    schema_version : int : 1
    created : str : ISO-8601 time the run finished
    versions : dict : software versions
    versions.keepkv : str : package version
    versions.torch : str : torch version
    versions.transformers : str : transformers version
    versions.python : str : Python version
    host : dict : where the run happened
    host.device : str : torch device the run used, e.g. "cpu" or "cuda:0"
    host.device_name : str : CPU model or GPU name
    host.gpu : bool : whether the device is a GPU
    host.threads : int : torch intra-op threads
    host.cpu_count : int : logical CPUs of the host
    host.load_avg_start : float|null : 1-minute load average when the run started (shared hosts)
    host.load_avg_end : float|null : 1-minute load average when it finished
    model : dict : the model benchmarked
    model.source : str : "embedded", the local path, or "config:NAME"
    model.random_weights : bool : true for a named config (speed only)
    model.note : str : "random weights: speed only" for random weights, else ""
    model.model_type : str : HF model_type
    model.num_layers : int : decoder layers
    model.hidden_size : int : hidden size
    model.num_attention_heads : int : query heads
    model.num_key_value_heads : int : KV heads
    model.head_dim : int : head dimension
    model.vocab_size : int : vocabulary size
    model.dtype : str : parameter dtype, e.g. "float32"
    model.weights_bytes : int : bytes of parameters and buffers
    settings : dict : the run's parameters
    settings.prompt_len : int : prompt tokens per row (random ids)
    settings.prefill_chunk : int|null : prompt tokens per prefill block (null: the whole prompt in one)
    settings.prefill_rows : int|null : prompts prefilled at a time, then stacked (null: the whole batch at once)
    settings.gen_len : int : timed decode steps per run
    settings.batches : list[int] : batch sizes of the fixed-batch mode
    settings.budget : float|int : cache budget (fraction of the prompt, or entries)
    settings.repeats : int : timed repetitions per (batch, method)
    settings.warmup : int : untimed short runs before each timed one
    settings.methods : list[str] : methods run, "full" first
    settings.method_params : dict : parameters each method was built with, by method
    settings.compile : bool : caches built with ``compile=True`` (``--compile``: each layer's decode-time method step compiled)
    settings.seed : int : seed of the random prompts
    settings.memory_cap_gb : float|null : memory cap, GB = 2**30 bytes
    settings.max_measure_batch : int|null : largest batch measured in memory-cap mode
    settings.overhead_steps : int : decode steps timed by the overhead proxies
    settings.profile_steps : int : decode steps under torch.profiler
    settings.contention : str|null : the warning of a CPU run started on a busy host (load average against free cores), else null
    fixed : list : one record per (batch, method)
    fixed[].method : str : method name
    fixed[].batch : int : rows
    fixed[].prompt_len : int : prompt tokens per row
    fixed[].gen_len : int : decode steps
    fixed[].repeats : int : timed repetitions
    fixed[].tokens_per_s : float : median of batch*gen_len/(prefill+decode seconds)
    fixed[].tokens_per_s_min : float : smallest over repetitions
    fixed[].tokens_per_s_max : float : largest over repetitions
    fixed[].decode_tokens_per_s : float : median of batch*gen_len/decode seconds
    fixed[].step_ms_mean : float : median over repetitions of the mean decode-step latency
    fixed[].step_ms_mean_min : float : smallest over repetitions
    fixed[].step_ms_mean_max : float : largest over repetitions
    fixed[].step_ms_p95 : float : median over repetitions of the 95th-percentile step latency
    fixed[].step_ms_p95_min : float : smallest over repetitions
    fixed[].step_ms_p95_max : float : largest over repetitions
    fixed[].prefill_s : float : median prefill time (forward over the prompt + first argmax)
    fixed[].prefill_s_min : float : smallest over repetitions
    fixed[].prefill_s_max : float : largest over repetitions
    fixed[].cache_bytes : int : cache.nbytes() after the last step
    fixed[].cache_bytes_prefill : int : the cache's peak during prefill (cache.prefill_peak_bytes)
    fixed[].cache_bytes_peak : int : largest cache.nbytes() seen between forward calls
    fixed[].full_cache_bytes : int : keys+values an uncompressed cache of the same tokens holds
    fixed[].kept_entries : float : mean live entries per layer, row and KV head at the end
    fixed[].peak_memory_bytes : int : peak of the median-throughput run (see peak_memory_kind)
    fixed[].peak_memory_delta_bytes : int : that peak minus the reading at the run's start
    fixed[].peak_memory_kind : str : "cuda_max_allocated" or "process_rss_sampled"
    fixed[].process_peak_rss_bytes : int : getrusage peak RSS of the process so far (monotone)
    fixed[].tokens_per_s_vs_full : float : tokens_per_s / full's at the same batch
    fixed[].step_ms_vs_full : float : step_ms_mean / full's at the same batch
    fixed[].step_ms_vs_h2o : float|null : step_ms_mean / h2o's at the same batch (null without h2o)
    overhead : list : one record per (batch, method); empty unless overhead_steps > 0
    overhead[].method : str : method name
    overhead[].batch : int : rows
    overhead[].steps : int : decode steps averaged
    overhead[].step_ms : float : mean step time with the proxies installed
    overhead[].method_ms : float : observe + refresh + compress + attention_entries per step
    overhead[].method_share : float : method_ms / step_ms
    overhead[].rest_ms : float : step_ms - method_ms
    overhead[].observe_ms : float : method.observe per step (all layers)
    overhead[].refresh_ms : float : method.refresh per step (KeepKV's rebuild from its full copy; the compression that follows is compress_ms)
    overhead[].compress_ms : float : method.compress per step (all layers); with ``compile=True`` the whole compiled step (observe + refresh + compress), observe_ms and refresh_ms then 0
    overhead[].attention_entries_ms : float : method.attention_entries per step
    overhead[].append_ms : float : LayerStore.append per step (core, not the method)
    overhead[].attend_ms : float : rest of cache.forward_layer: the attention itself
    overhead[].model_ms : float : rest of the step: projections, MLP, norms, logits, argmax
    memory_cap : dict|null : null unless memory_cap_gb is given
    memory_cap.capacity_bytes : int : the cap in bytes
    memory_cap.capacity_gb : float : the cap in GB (2**30 bytes)
    memory_cap.weights_bytes : int : model bytes counted against the cap
    memory_cap.note : str : how the batch was found and measured
    memory_cap.methods : list : one record per method
    memory_cap.methods[].method : str : method name
    memory_cap.methods[].cache_bytes_per_row : int : predicted peak cache bytes per row (with prefill_rows: one more row of a large batch)
    memory_cap.methods[].cache_prefill_bytes_per_row : int : predicted cache bytes per row at the end of prefill
    memory_cap.methods[].cache_decode_bytes_per_row : int : predicted cache bytes per row at the end of decoding
    memory_cap.methods[].workspace_bytes_per_row : int : peak workspace per row (batch-2 minus batch-1 probe)
    memory_cap.methods[].workspace_bytes_fixed : int : peak workspace independent of the batch
    memory_cap.methods[].bytes_per_row : int : cache_bytes_per_row + workspace_bytes_per_row
    memory_cap.methods[].max_batch : int : largest batch that fits (0: none)
    memory_cap.methods[].bytes_at_max_batch : int : accounted bytes at max_batch
    memory_cap.methods[].bytes_at_max_batch_plus_1 : int : accounted bytes at max_batch + 1 (> capacity)
    memory_cap.methods[].measured_batch : int : batch whose throughput was measured
    memory_cap.methods[].capped : bool : measured_batch < max_batch (max_measure_batch)
    memory_cap.methods[].tokens_per_s : float|null : median throughput at measured_batch
    memory_cap.methods[].tokens_per_s_min : float|null : smallest over repetitions
    memory_cap.methods[].tokens_per_s_max : float|null : largest over repetitions
    memory_cap.methods[].step_ms_mean : float|null : median mean step latency at measured_batch
    memory_cap.methods[].tokens_per_s_vs_full : float|null : tokens_per_s / full's, same run
    memory_cap.methods[].batch_vs_full : float|null : max_batch / full's max_batch
    profile : dict : by method; empty unless profile_steps > 0
    profile.<method>.batch : int : rows profiled
    profile.<method>.steps : int : decode steps profiled
    profile.<method>.sort_by : str : profiler column ranked (self CPU or self device time)
    profile.<method>.ops : list : top ops, then the keepkv:: ranges
    profile.<method>.ops[].name : str : op or range name
    profile.<method>.ops[].calls : int : calls per step
    profile.<method>.ops[].self_ms_per_step : float : self time per step
    profile.<method>.ops[].total_ms_per_step : float : time including children per step
    profile.<method>.ops[].self_pct : float : share of all self time
    errors : dict : method -> error message, for methods that raised and were left out
    notes : list[str] : caveats of this run (random weights, caps, CPU peak memory)
"""

from __future__ import annotations

# The names load on first use, so that ``keepkv.bench.options`` (the command line's options)
# imports neither torch nor the benchmark.
_HOMES = {
    "CONFIGS": "configs", "build_config": "configs", "random_model": "configs", "max_batch": "runner",
    "run_once": "runner", "add_arguments": "options", "documented_fields": "core", "main": "core",
    "run_bench": "core", "format_table": "plot", "save_plot": "plot",
}

__all__ = sorted(_HOMES)


def __getattr__(name):
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
