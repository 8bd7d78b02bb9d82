"""``keepkv bench --ops``: kernel operations and host synchronisations of one decode step, per layer.

On a GPU each ATen operation that is not a view is (at least) one kernel launch, and a short
decode step is launch-bound; a host synchronisation stalls the launch queue. Both counts depend
only on the code path, not on the device, so they can be measured and targeted on a CPU.

For each method: a prefill of ``batch`` random prompts of ``prompt_len`` tokens, ``warm_steps``
untimed decode steps (so that every layer has compressed and holds its steady-state size), then
``steps`` decode steps under :class:`OpCounter`, a ``TorchDispatchMode``. Counts are per layer
and step (the totals divided by ``steps × num_hidden_layers``), split by where they happen:

- ``method``: the method's own code (``observe``, ``compress``, ``attention_entries``: the
  parts ``--overhead`` times, :data:`keepkv.bench.runner.METHOD_PARTS`);
- ``append``: the layer store's ``append``;
- ``attention``: the rest of the cache's ``forward_layer`` (the attention itself);
- ``model``: everything else (projections, MLP, norms, RoPE, LM head).

A *kernel operation* is an ATen operation whose schema is not a view (``func.is_view``) and
that is not a ``view_copy`` variant. A *synchronisation* is an operation whose result the host
must wait for: ``_local_scalar_dense`` (``.item()``, ``bool(t)``, ``int(t)``), any operation
tagged ``data_dependent_output`` (``equal``, ``is_nonzero``) or ``dynamic_output_shape``
(``nonzero``, ``unique``, ``masked_select``, ``repeat_interleave`` without a size), indexing or
index-assignment with a boolean mask, ``linalg.solve``'s error check
(``_linalg_check_errors``), and the Python-level ``.tolist()``, ``.cpu()`` and ``.numpy()``
(patched for the count: on a CPU tensor they never reach the dispatcher, on a GPU they copy to
the host). Integer-index gathers are not synchronisations.

JSON (``--json``): ``{"ops": {...}}`` with ``settings``, ``model`` and ``methods[]``, each with
``ops_per_layer_step`` (total), ``method``/``append``/``attention``/``model`` ops per layer-step,
``extra_vs_full`` (total minus full's), ``syncs_per_layer_step``, ``syncs`` (operation name →
count per step, all layers), ``sync_sites`` ("operation at file:line" of the innermost caller
outside torch → count per step), ``kept_entries`` and ``method_op_names`` (the method's own
operations by name → count per layer-step, most frequent first: where to cut).
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm.auto import tqdm

from .. import reconstruction
from ..attention import enabled
from ..budgets import budget_for
from ..cache import CompressedCache
from ..models import CACHE_KWARG
from .runner import METHOD_PARTS
from .setup import stand_in_tokenizer

PARTS = ("method", "append", "attention", "model")
# With compile=True these run inside the compiled step, counted from its profile.
COMPILED_PARTS = ("observe", "refresh", "compress")
CUDA_LAUNCHES = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"}
COMPILED_SYNCS = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "item"}
# Python-level tensor methods that copy to the host (not seen by the dispatcher on a CPU tensor).
HOST_COPIES = ("tolist", "cpu", "numpy")
_SYNC_OPS = {"aten::_local_scalar_dense", "aten::_linalg_check_errors", "aten::equal", "aten::is_nonzero"}
_MASK_INDEXING = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8) for index in indices or ())


def is_sync(func, args) -> bool:
    """Whether the host must wait for this operation's result (see the module docstring)."""
    name = func._schema.name
    if name in _MASK_INDEXING:
        return _has_bool_index(args)
    if name in _SYNC_OPS:
        return True
    return torch.Tag.data_dependent_output in func.tags or torch.Tag.dynamic_output_shape in func.tags


def sync_site() -> str:
    """``path:line`` of the innermost caller frame outside torch and this module."""
    here = os.path.abspath(__file__)
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path != here and not path.startswith(torch_dir):
            parts = path.split(os.sep)
            short = os.sep.join(parts[parts.index("keepkv"):] if "keepkv" in parts[:-1] else parts[-2:])
            return f"{short}:{frame.lineno}"
    return "?"


class OpCounter(TorchDispatchMode):
    """Count kernel operations and synchronisations, attributed to the innermost open part.

    ``with OpCounter() as counter:`` counts every ATen operation dispatched inside; ``part(name)``
    opens a labelled region (nested regions: the innermost one counts). ``ops[part]``,
    ``syncs[part]`` and ``sync_names`` (operation name → count) hold the results.
    """

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.syncs: Counter = Counter()
        self.sync_names: Counter = Counter()
        self.sync_sites: Counter = Counter()  # "operation at file:line" of the innermost frame outside torch
        self.names: Counter = Counter()  # (part, operation name) -> count
        self._stack = ["model"]
        self._patched: list[tuple[str, object]] = []

    @contextlib.contextmanager
    def part(self, name: str):
        self._stack.append(name)
        try:
            yield
        finally:
            self._stack.pop()

    def _sync(self, name: str) -> None:
        self.syncs[self._stack[-1]] += 1
        self.sync_names[name] += 1
        self.sync_sites[f"{name} at {sync_site()}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and torch.Tag.view_copy not in func.tags:
            self.ops[self._stack[-1]] += 1
            self.names[self._stack[-1], func._schema.name.removeprefix("aten::")] += 1
            if is_sync(func, args):
                self._sync(func._schema.name.removeprefix("aten::"))
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in HOST_COPIES:  # on a CPU tensor these never reach the dispatcher
            original = getattr(torch.Tensor, name)

            def host_copy(tensor, *args, _original=original, _name=name, **kwargs):
                self._sync(_name)
                return _original(tensor, *args, **kwargs)

            self._patched.append((name, original))
            setattr(torch.Tensor, name, host_copy)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._patched:
            setattr(torch.Tensor, name, original)
        self._patched.clear()
        return super().__exit__(*exc)

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def total_syncs(self) -> int:
        return sum(self.syncs.values())


def _is_view(name: str) -> bool:
    packet = getattr(torch.ops.aten, name.removeprefix("aten::"), None)
    if packet is None:
        return False
    overloads = packet.overloads()
    tensor_overload = next((o for o in ("default", "Tensor", "int", "self") if o in overloads), overloads[0])
    return getattr(packet, tensor_overload).is_view


def _launches(event, cuda: bool, counts: Counter) -> None:
    """Count into ``counts`` the kernel launches under a profiler event of a compiled step: the
    kernels inductor generated and the ATen operations the graph calls (not their insides)."""
    name = event.name
    if cuda and name in CUDA_LAUNCHES:
        counts["kernel"] += 1
    elif not cuda and "cpp_fused" in name:
        counts["fused kernel"] += 1
    elif name.startswith("aten::"):
        if not _is_view(name):
            counts[name.removeprefix("aten::")] += 1
        if not cuda:
            return  # an operation's own calls are inside its kernel
    for child in event.cpu_children:
        _launches(child, cuda, counts)


@contextlib.contextmanager
def compiled_step_counted(counter: OpCounter, cache: CompressedCache):
    """Count the launches of ``cache``'s compiled method step (``compile=True``) into ``counter``'s
    "method" part. A dispatch mode would force the step eager, so it runs with the counter's mode
    set aside, under the profiler; inductor tags its CPU kernels for that (``enable_kernel_profile``
    must be on before the step compiles, :func:`count_method` sets it)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.utils._python_dispatch import _disable_current_modes

    step = cache._method_step
    cuda = cache.layers[0].device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def counted(*args):
        with _disable_current_modes(), profile(activities=activities) as prof:
            step(*args)
        counts: Counter = Counter()
        for event in prof.events():
            if event.cpu_parent is None:
                _launches(event, cuda, counts)
        for name, count in counts.items():
            counter.ops["method"] += count
            counter.names["method", name] += count
            if name in COMPILED_SYNCS:
                counter.syncs["method"] += count
                counter.sync_names[name] += count

    cache._method_step = counted
    try:
        yield
    finally:
        cache._method_step = step


@contextlib.contextmanager
def attributed(counter: OpCounter, cache: CompressedCache):
    """Shadow (on the instances only) the method's parts, every layer's ``append`` and the cache's
    ``forward_layer`` so that ``counter`` attributes their operations; restored on exit."""
    shadowed = []

    def shadow(obj, name: str, part: str) -> None:
        fn = getattr(obj, name)

        def labelled(*args, **kwargs):
            with counter.part(part):
                return fn(*args, **kwargs)

        setattr(obj, name, labelled)
        shadowed.append((obj, name))

    for name in METHOD_PARTS:
        if cache.compile and name in COMPILED_PARTS:  # inside the compiled step: counted by its profile
            continue
        shadow(cache.method, name, "method")
    for layer in cache.layers:
        shadow(layer, "append", "append")
    shadow(cache, "forward_layer", "attention")
    try:
        yield
    finally:
        for obj, name in shadowed:
            with contextlib.suppress(AttributeError):
                delattr(obj, name)


@torch.inference_mode()
def count_method(model, method: str, budget, prompt_len: int = 512, batch: int = 2, warm_steps: int = 3,
                 steps: int = 1, seed: int = 0, compile: bool = False, **params) -> dict:
    """One method's counts per layer-step (see the module docstring). ``compile``: the cache's
    ``compile=True`` path, whose method step counts the launches of its compiled graph."""
    config = model.config
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch, prompt_len), generator=generator).to(device)
    mask = torch.ones_like(ids)
    if compile:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True  # CPU kernels visible to the profiler
    # static_shapes: an accelerator's decode step (on CPU, KeepKV's merge would size its work by a host read)
    cache = CompressedCache(config, method, budget_for(method, budget), compile=compile, static_shapes=True, **params)
    cache.method.prepare(model)  # as keepkv.generate and the bench do (KVReviver's Fisher scores)

    def forward(tokens):
        out = model(input_ids=tokens, attention_mask=mask, **{CACHE_KWARG: cache}, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1:].argmax(-1)

    with enabled(model):
        if cache.defers_to_reconstruction:  # KVzip: the prompt, then its pass, before the decode steps
            logits = reconstruction.prefill(model, stand_in_tokenizer(config.vocab_size), cache, ids, mask, chat=False)
            token = logits.argmax(-1, keepdim=True)
        else:
            token = forward(ids)
        for _ in range(warm_steps):
            mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
            token = forward(token)
        counter = OpCounter()
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
            step_counted = compiled_step_counted(counter, cache) if compile else contextlib.nullcontext()
            with attributed(counter, cache), step_counted, counter:
                token = forward(token)
    per = steps * config.num_hidden_layers
    kept = torch.stack([layer.live_counts().double().mean() for layer in cache.layers]).mean()
    return {
        "method": method,
        "ops_per_layer_step": counter.total_ops / per,
        **{f"{part}_ops": counter.ops[part] / per for part in PARTS},
        "syncs_per_layer_step": counter.total_syncs / per,
        "method_syncs": counter.syncs["method"] / per,
        "syncs": {name: count / steps for name, count in sorted(counter.sync_names.items())},
        "sync_sites": {site: count / steps for site, count in sorted(counter.sync_sites.items())},
        "kept_entries": round(float(kept), 2),
        "compiled": compile and cache._method_step.failed is None,
        "method_op_names": {
            name: count / per
            for (part, name), count in sorted(counter.names.items(), key=lambda item: (-item[1], item[0][1]))
            if part == "method"
        },
    }


def run_ops(model, methods: list[str], budget, prompt_len: int = 512, batch: int = 2, warm_steps: int = 3,
            steps: int = 1, seed: int = 0, progress: bool = True, method_params: dict | None = None,
            compile: bool = False) -> dict:
    """Counts of every method in ``methods`` ("full" first, for ``extra_vs_full``)."""
    from .setup import resolve_params

    params = resolve_params(methods, method_params)
    records, errors = [], {}
    for method in tqdm(methods, desc="ops", unit="method", disable=not progress):
        try:
            records.append(count_method(model, method, budget, prompt_len, batch, warm_steps, steps, seed, compile,
                                        **params[method]))
        except Exception as error:  # one method's failure leaves the others' counts
            errors[method] = f"{type(error).__name__}: {error}"
            if progress:
                print(f"keepkv bench --ops: {method} failed: {errors[method]}", file=sys.stderr)
    full = next((r["ops_per_layer_step"] for r in records if r["method"] == "full"), None)
    for record in records:
        record["extra_vs_full"] = None if full is None else record["ops_per_layer_step"] - full
    config = model.config
    return {
        "settings": {"budget": budget, "prompt_len": prompt_len, "batch": batch, "warm_steps": warm_steps,
                     "steps": steps, "seed": seed, "methods": methods, "method_params": params, "compile": compile},
        "model": {"num_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
                  "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
                  "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                  "device": str(next(model.parameters()).device)},
        "methods": records,
        "errors": errors,
    }


def format_ops(result: dict) -> str:
    """The counts as a Markdown table."""
    settings = result["settings"]
    lines = [
        f"Kernel operations (non-view ATen ops) and host syncs per layer and decode step: batch {settings['batch']}, "
        f"{settings['prompt_len']}-token prompts, budget {settings['budget']}, {result['model']['num_layers']} layers, "
        f"{result['model']['dtype']} on {result['model']['device']}"
        + (", compile=True (the method's own: launches of its compiled step)" if settings.get("compile") else ""),
        "",
        "| method | ops total | method's own | append | attention | model | extra vs full | syncs | sync ops |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in result["methods"]:
        if settings.get("compile") and r["method"] != "full" and not r.get("compiled"):
            r = {**r, "method": f"{r['method']} (eager: did not compile)"}
        extra = "" if r["extra_vs_full"] is None else f"{r['extra_vs_full']:+.1f}"
        names = ", ".join(f"{name} {count:g}" for name, count in r["syncs"].items()) or "none"
        lines.append(
            f"| {r['method']} | {r['ops_per_layer_step']:.1f} | {r['method_ops']:.1f} | {r['append_ops']:.1f} | "
            f"{r['attention_ops']:.1f} | {r['model_ops']:.1f} | {extra} | {r['syncs_per_layer_step']:.2f} | {names} |"
        )
    for method, error in result["errors"].items():
        lines.append(f"\n{method}: failed: {error}")
    return "\n".join(lines)
