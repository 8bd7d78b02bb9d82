"""The options of ``keepkv eval`` and ``keepkv report`` and the run's defaults, in a module that
imports neither torch nor the runner: ``keepkv --help`` and every argument error come at once,
before torch loads. The sizes and timing of these defaults: keepkv/eval/runner.py."""

from __future__ import annotations

import argparse

from ..arguments import budget_arg

TEST_SEED = 0
DEV_SEED = 1000
# Variants where the full cache does best on the embedded model (dev seed; see TIMING below).
# Tasks the full cache solves (>= 0.9 on the dev seed) and the KL/NLL suites on real text.
# passkey and the prose needle hold numbers in real text: the haystacks where a merge can blend
# an evicted number into the answer's digits (the noise needle has no other number to blend).
PROSE_NEEDLE = "needle+haystack=prose+digits=5"
DEFAULT_SUITES = (
    "needle", "needle+setting=agnostic", PROSE_NEEDLE, "passkey", "passkey+setting=agnostic", "kl+source=pydoc",
    "kl+source=stdlib",
)
DEFAULT_BUDGETS = (0.1, 0.2)
# Samples per suite label, then task, then name (others: DEFAULT_SAMPLES_OTHER), sized for the
# run's time on 2 CPU cores (docs/eval.md, "Time"). A paired 0/1 difference
# with up to 30% discordant samples has a 95% half-width of about 2 * 0.55 / sqrt(n): 0.19 at
# n = 32, 0.22 at 24.
DEFAULT_SAMPLES = {
    "needle": 32, "needle+setting=agnostic": 24, PROSE_NEEDLE: 32, "passkey": 24, "passkey+setting=agnostic": 16,
    "kl": 12,
}
DEFAULT_SAMPLES_OTHER = 4
DEFAULT_LENGTHS = {
    "needle": 1024,
    "tracking": 256,
    "aggregation": 512,
    "passkey": 1024,
    "ppl": 256,
    "fidelity": 512,
    "kl": 1024,
    "longbench": 1024,
    "jsonl": 1024,
}
# `keepkv eval --sweep`: the budgets of the field's ratio sweeps (kvpress's leaderboard draws
# compression ratios 0.25-0.875; ratio = 1 - budget), plotted as the average score against the
# compression ratio, one line per method (sweep.png).
SWEEP_BUDGETS = (0.9, 0.75, 0.5, 0.25, 0.125, 0.1)
# `keepkv eval --quick`: a smoke check of every default suite, not a measurement.
QUICK_SAMPLES = 2
QUICK_BUDGETS = (0.1,)
QUICK_LENGTHS = {"needle": 512, "passkey": 512, "kl": 512}
DEFAULT_BATCH_SIZE = 8
MAX_WORKERS = 4
REPORT_BEGIN = "<!-- keepkv report: begin -->"
REPORT_END = "<!-- keepkv report: end -->"


def _seed(text: str) -> int:
    """An int, or 'dev' for the tuning seed set (runner.DEV_SEED)."""
    if text == "dev":
        return DEV_SEED
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seed must be an int or 'dev', got {text!r}")


def _length(text: str):
    """'1024' (every suite) or 'needle=1536' (one suite)."""
    if "=" in text:
        suite, value = text.split("=", 1)
        return suite, _positive(value)
    return None, _positive(text)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``keepkv eval`` (the caller adds --model and --json)."""
    lengths = ", ".join(
        f"{name} {DEFAULT_LENGTHS[name.split('+')[0]]}" for name in DEFAULT_SUITES
    )
    parser.add_argument(
        "--suite", nargs="+", action="extend", metavar="SUITE",
        help=f"suites, repeatable (default: {' '.join(DEFAULT_SUITES)}); also longbench, jsonl "
        "(with --data) and variants such as needle+variant=multikey+haystack=prose",
    )
    parser.add_argument(
        "--methods", nargs="+", metavar="METHOD",
        help="methods, or variants such as keepkv+interval=8+zip_key=group (default: every registered one, "
             "keepkv+selection=kvzip and kvzip+budgets=global)",
    )
    parser.add_argument(
        "--budgets", nargs="+", type=budget_arg, metavar="B",
        help="fractions of the prompt or entry counts (default: "
        f"{' '.join(map(str, DEFAULT_BUDGETS))}; ppl: fraction of its total length)",
    )
    parser.add_argument(
        "--samples", type=_positive,
        help="samples per suite and length (default: "
        + ", ".join(f"{name} {count}" for name, count in DEFAULT_SAMPLES.items())
        + f", others {DEFAULT_SAMPLES_OTHER})",
    )
    parser.add_argument(
        "--lengths", nargs="+", type=_length, metavar="N|SUITE=N",
        help=f"context lengths in tokens, for every suite or one (default: {lengths})",
    )
    parser.add_argument(
        "--seed", type=_seed, default=TEST_SEED,
        help="sample seed: 0 for reported numbers, 'dev' (= 1000) or >= 1000 for tuning",
    )
    parser.add_argument("--out", help="output directory (default: runs/eval; with --quick: runs/eval-quick)")
    quick_lengths = " ".join(f"{name}={value}" for name, value in QUICK_LENGTHS.items())
    parser.add_argument(
        "--quick", action="store_true",
        help=f"smoke check: {QUICK_SAMPLES} samples, budget "
        f"{' '.join(map(str, QUICK_BUDGETS))}, lengths {quick_lengths} (options given explicitly win)",
    )
    parser.add_argument(
        "--data", action="append", default=[], metavar="PATH",
        help="local data: a LongBench directory or a jsonl file (or longbench=DIR, jsonl=FILE)",
    )
    parser.add_argument("--max-new-tokens", type=_positive, help="override every suite's generation cap")
    parser.add_argument(
        "--batch-size", type=_positive,
        help=f"samples per prefill batch (default: {DEFAULT_BATCH_SIZE} on the CPU; on a GPU, what a quarter "
        "of its free memory holds for the model's KV cache at the longest length)",
    )
    parser.add_argument(
        "--setting", choices=("aware", "agnostic", "both"),
        help="question-aware (the question inside the compressed prompt), question-agnostic (the context "
        "compressed before the question is seen, as kvpress's leaderboard runs) or both, for every suite with "
        "a question (default: as each suite names it; the default suites include both)",
    )
    parser.add_argument(
        "--sweep", action="store_true",
        help=f"budgets {' '.join(map(str, SWEEP_BUDGETS))} and sweep.png: mean score against the "
        "compression ratio (1 - budget), one line per method",
    )
    parser.add_argument("--dtype", default="float32", help="model dtype: float32, bfloat16 or float16")
    parser.add_argument("--device", default="cpu", help="device of the model: cpu, cuda, cuda:1, ...")
    parser.add_argument(
        "--workers", type=_positive,
        help="worker processes that split each suite's samples (default: CPU cores, at most "
        f"{MAX_WORKERS}; 1 on a GPU)",
    )
    parser.add_argument(
        "--reference", metavar="METHOD",
        help="also pair every method with METHOD at the same budget (diff_ref columns); the full cache is "
        "always paired (diff_full)",
    )
    parser.add_argument(
        "--resume", action="store_true",
        help="continue the run in --out: its finished cells (written as each suite and length ends) are kept, "
        "the rest computed; without it, an --out holding cells is refused",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``keepkv report``."""
    parser.add_argument("path", help="an eval run directory or its summary.csv")
    parser.add_argument(
        "--out", metavar="FILE",
        help="also write the Markdown to FILE; a FILE holding the lines "
        f"'{REPORT_BEGIN}' and '{REPORT_END}' (a docs page, docs/results.md) keeps everything else "
        "and gets the Markdown between them",
    )
    parser.add_argument("--json", action="store_true", help="print the summary rows as JSON instead")
    parser.add_argument(
        "--reference", metavar="METHOD",
        help="pair every method with METHOD at the same budget, from the run's cells/ (default: the "
        "reference the run was made with, if any)",
    )
    parser.add_argument(
        "--methods", nargs="+", metavar="METHOD",
        help="only these methods' rows, in this order (the full cache's row is always first)",
    )
    parser.add_argument(
        "--budgets", nargs="+", type=float, metavar="B",
        help="only the columns of these budgets (the full cache's score is shown under each)",
    )


def check_plain(args: argparse.Namespace) -> None:
    """What ``keepkv eval`` can check before torch loads, each refused in one line: method names,
    budgets, the data and model paths (``keepkv.eval.cli.check_before_work`` checks the rest
    before the model loads)."""
    from pathlib import Path

    from ..checks import check_method_name, validate_budget

    for name in [*(args.methods or []), *([args.reference] if args.reference else [])]:
        check_method_name(name)
    for budget in args.budgets or []:
        validate_budget(budget)
    for entry in args.data:
        path = entry.split("=", 1)[1] if "=" in entry and entry.split("=", 1)[0] in ("longbench", "jsonl") else entry
        if not Path(path).exists():
            raise ValueError(f"--data {entry}: no such file or directory")
    if getattr(args, "model", None) and not Path(args.model).exists():
        raise ValueError(f"--model {args.model}: no such file or directory")
