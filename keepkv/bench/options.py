"""The options of ``keepkv bench`` (``keepkv.bench`` documents what each mode measures), in a module
that imports neither torch nor the benchmark itself: ``keepkv --help`` and every argument error
come at once, before torch loads."""

from __future__ import annotations

import argparse

from ..arguments import budget_arg
from ..checks import DTYPE_NAMES

# `keepkv bench` with no options: a quick run (about 2 minutes on a 2-core CPU), not the grid.
QUICK_METHODS = "full,snapkv,keepkv"
QUICK_REPEATS = 1
QUICK_GEN_LEN = 64
# The named model shapes (keepkv.bench.configs.CONFIGS, which builds them with torch):
# tests/test_cli_speed.py checks that these are its names.
CONFIG_NAMES = ("llama2-7b", "llama3-8b", "mistral-7b", "qwen2-7b", "smollm2-135m")
# The runs that replace the timing run: one at a time.
OTHER_RUNS = ("soak", "ops", "reconstruction", "cuda_suite")
# Options only the timing run reads, with their defaults (given otherwise, another run refuses them).
TIMING_ONLY = {"memory_cap": None, "max_measure_batch": None, "overhead": False, "profile": 0, "kernel": "torch",
               "prefill_chunk": None, "prefill_rows": None}
OVERHEAD_STEPS = 16
OPS_STEPS = 1
# Options of one mode alone: option -> (its default, the mode that reads it).
MODE_OPTIONS = {"overhead_steps": (OVERHEAD_STEPS, "overhead"), "ops_steps": (OPS_STEPS, "ops"),
                "soak_steps": (None, "soak"), "soak_text": (False, "soak")}


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``keepkv bench`` options to ``parser`` (see ``keepkv.bench``).

    Options the parser already has (a parent parser's ``--model`` or ``--json``) are kept as
    they are; :func:`main` accepts ``--json`` as a flag (JSON to stdout) or with a path.
    """
    existing = set(parser._option_string_actions)

    def add(group, *flags, **kwargs):
        if not existing.intersection(flags):
            group.add_argument(*flags, **kwargs)

    model = parser.add_argument_group("model")
    add(model, "--model", metavar="PATH", help="local HF model folder or .gguf (default: embedded SmolLM2-135M)")
    add(model, "--config", choices=CONFIG_NAMES, help="named shape with random weights (speed only)")
    add(model, "--layers", type=int, metavar="N", help="override the depth of --config (smoke runs)")
    add(model, "--dtype", default="auto", choices=["auto", *DTYPE_NAMES], help="auto: bf16 on CUDA, fp32 on CPU")
    add(model, "--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    add(model, "--threads", type=int, metavar="N", help="torch CPU threads (1 is steadier on a shared CPU)")
    run = parser.add_argument_group("workload")
    add(run, "--methods", default=QUICK_METHODS,
        help="comma-separated methods, or 'all' for every registered one (full is always run)")
    add(run, "--budget", type=budget_arg,
        help="fraction of the prompt or entry count (default: 0.2; --ops: 0.1)")
    add(run, "--param", action="append", metavar="[METHOD.]KEY=VALUE",
        help="method parameter, e.g. interval=8 (every method with it) or h2o.recent_ratio=0.3")
    add(run, "--prompt-len", type=int, metavar="L", help="prompt tokens per row (default: 1024; --soak: 256)")
    add(run, "--gen-len", type=int, default=QUICK_GEN_LEN, metavar="G", help="timed decode steps")
    add(run, "--batch", type=int, nargs="+", metavar="B", help="batch size(s) (default: 1; --ops: 2)")
    add(run, "--repeats", type=int, default=QUICK_REPEATS, help="timed repetitions; median and min/max reported")
    add(run, "--warmup", type=int, default=1, help="untimed short runs before each timed one")
    add(run, "--seed", type=int, default=0, help="seed of the random prompts (and --config weights)")
    add(run, "--prefill-chunk", type=int, metavar="N",
        help="feed each prompt in blocks of N tokens: bounded prefill workspace (default: one block)")
    add(run, "--prefill-rows", type=int, metavar="R",
        help="prefill R prompts at a time, each group compressed before the next, then decode them as one "
             "batch, as a serving engine admits requests (default: the whole batch at once)")
    modes = parser.add_argument_group("modes")
    add(modes, "--memory-cap", type=float, metavar="GB",
        help="find each method's largest batch under GB (2**30 bytes) and measure it")
    add(modes, "--max-measure-batch", type=int, metavar="B",
        help="largest batch measured in memory-cap mode (default 8 on CPU, none on GPU)")
    add(modes, "--overhead", action="store_true", help="time the method's own code per decode step")
    add(modes, "--overhead-steps", type=int, default=OVERHEAD_STEPS, metavar="N", help="steps for --overhead")
    add(modes, "--profile", type=int, default=0, metavar="N", help="torch.profiler over N decode steps (0: off)")
    add(modes, "--soak", action="store_true",
        help="soak instead: one long decode per method (every registered one unless --methods names others), "
             "cache bytes and RSS at steps 100, 1k, 10k, 20k (default model: the smollm2-135m shape, random "
             "weights, --layers 2; --prompt-len 256)")
    add(modes, "--ops", action="store_true",
        help="count instead: kernel operations (non-view ATen ops) and host syncs of one decode step, per layer, "
             "for every registered method unless --methods names others (default model: the smollm2-135m shape, "
             "random weights, --layers 4; --prompt-len 512, --batch 2, --budget 0.1)")
    add(modes, "--kernel", choices=("torch", "triton"), default="torch",
        help="the caches' decode kernel: torch (the reference) or triton (the one-pass kernel; CUDA)")
    add(modes, "--reconstruction", action="store_true",
        help="time instead: a reconstruction pass (kvzip; --methods names others) against the prompt's own "
             "prefill, and the pass's peak against a full cache of the prompt (target: at most 1.25x), at 256, "
             "1,024, 2,048 and 8,192 tokens (--prompt-len sets one length) on the embedded model")
    add(modes, "--compile", action="store_true",
        help="caches with compile=True: each layer's decode-time method step as one torch.compile graph (with "
             "--ops: the launches of that graph are counted; the warm-up runs the timed shapes, so that timed steps "
             "never compile: about a minute per method on CPU)")
    add(modes, "--ops-steps", type=int, default=OPS_STEPS, metavar="N", help="decode steps counted by --ops (averaged)")
    add(modes, "--cuda-suite", action="store_true",
        help="on a CUDA machine: the CUDA tests, the op count and the GPU bench in one run (under 10 min on one "
             "H100), writing cuda.json and cuda.log into --out (default: runs/cuda); see .ci/cuda")
    add(modes, "--soak-steps", type=int, metavar="N", help="decode steps of --soak (default: 20000; --soak-text: 1500)")
    add(modes, "--soak-text", action="store_true",
        help="with --soak: greedy text on the embedded model (or --model) instead of random ids, every method at "
             "--budget (default 0.1) after 1,024 tokens of Python's documentation (--prompt-len): the cache's bytes at steps 100, 500, 1k, 1.5k "
             "and the share of repeated 4-grams of its text against the full cache's")
    out = parser.add_argument_group("output")
    add(out, "--json", nargs="?", const="-", metavar="PATH",
        help="write the JSON to PATH, or to stdout without one (the table then goes to stderr)")
    add(out, "--out", metavar="DIR", help="write bench.json, bench.txt and bench.png into DIR")
    add(out, "--plot", metavar="PATH", help="write the PNG here")
    add(out, "--no-progress", action="store_true", help="no progress bars or messages")
    return parser


def flag(name: str) -> str:
    """``"soak_text"`` -> ``"--soak-text"``."""
    return "--" + name.replace("_", "-")


def check_modes(args: argparse.Namespace) -> None:
    """Refuse, in one line, options that would be ignored: two of the runs that replace the timing
    run (:data:`OTHER_RUNS`), one of them with an option of the timing run alone
    (:data:`TIMING_ONLY`), or an option of a mode without that mode (:data:`MODE_OPTIONS`)."""
    runs = [flag(name) for name in OTHER_RUNS if getattr(args, name, False)]
    if len(runs) > 1:
        raise ValueError(f"{' and '.join(runs)} are separate runs: pass one of {', '.join(map(flag, OTHER_RUNS))}")
    timing = [flag(name) for name, default in TIMING_ONLY.items() if getattr(args, name, default) != default]
    if runs and timing:
        raise ValueError(f"{', '.join(timing)} {'is an option' if len(timing) == 1 else 'are options'} of the timing "
                         f"run, and {runs[0]} runs instead: drop one")
    for name, (default, mode) in MODE_OPTIONS.items():
        if getattr(args, name, default) != default and not getattr(args, mode, False):
            raise ValueError(f"{flag(name)} is an option of {flag(mode)}: pass {flag(mode)} too, or drop it")


def check_plain(args: argparse.Namespace) -> None:
    """What ``keepkv bench`` can check before torch loads, each refused in one line: the modes
    (:func:`check_modes`), the budget, the method names (``--methods``: comma-separated, or
    ``all``) and the counts."""
    from ..checks import as_int, check_method_name, validate_budget

    check_modes(args)

    if getattr(args, "budget", None) is not None:
        validate_budget(args.budget)
    methods = getattr(args, "methods", None)
    if methods and methods != "all":
        for name in methods.split(","):
            check_method_name(name.strip())
    for flag in ("prompt_len", "gen_len", "repeats", "threads", "prefill_chunk", "prefill_rows", "soak_steps",
                 "ops_steps", "layers"):
        value = getattr(args, flag, None)
        if value is not None:
            as_int(f"--{flag.replace('_', '-')}", value, 1)
    for value in getattr(args, "batch", None) or []:
        as_int("--batch", value, 1)
