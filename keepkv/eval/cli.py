"""`keepkv eval` and `keepkv report`: arguments, the run, and the Markdown table.

``keepkv eval`` with no options evaluates every registered method at budgets 0.1 and 0.2 on
the default suites, question-aware and question-agnostic (``DEFAULT_SUITES``; sizes and timing:
keepkv/eval/runner.py); ``--suite ruler`` runs the RULER preset, ``--sweep`` the ratio sweep.
``keepkv report RUN_DIR`` renders a run's summary.csv as Markdown, with the paired
differences and, from the run's cells, its resolution.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from ..arguments import check_device_option
from ..plotting import have_matplotlib
from . import runner as _runner
from .options import REPORT_BEGIN, REPORT_END, _length, _positive, _seed, add_arguments, add_report_arguments  # noqa: F401
from .paired import CLOSE_RATIO, close_pairs, pair_records, resolution, resolved
from .summary import load_cells, read_summary, with_reference


def _data_paths(entries: list[str]) -> dict:
    data = {}
    for entry in entries:
        if "=" in entry and entry.split("=", 1)[0] in _runner.DATA_SUITES:
            name, path = entry.split("=", 1)
        else:
            path = entry
            name = "longbench" if Path(path).is_dir() else "jsonl"
        data[name] = path
    return data


def _lengths(entries):
    if not entries:
        return None
    common = [value for suite, value in entries if suite is None]
    per_suite: dict = {}
    for suite, value in entries:
        if suite is not None:
            per_suite.setdefault(suite, []).append(value)
    if not per_suite:
        return common
    return {**{name: common or [_runner.DEFAULT_LENGTHS[name]] for name in _runner.DEFAULT_LENGTHS}, **per_suite}


def run_sizes(args) -> dict:
    """Budgets, samples, lengths and output directory: the options given, else the defaults
    (``--quick``: the QUICK_* defaults of keepkv.eval.runner)."""
    quick = getattr(args, "quick", False)
    lengths = _lengths(args.lengths)
    if lengths is None and quick:
        lengths = {**_runner.DEFAULT_LENGTHS, **_runner.QUICK_LENGTHS}
    return {
        "budgets": args.budgets or list(_runner.QUICK_BUDGETS if quick else _runner.DEFAULT_BUDGETS),
        "samples": args.samples or (_runner.QUICK_SAMPLES if quick else _runner.DEFAULT_SAMPLES),
        "lengths": lengths,
        "out_dir": args.out or ("runs/eval-quick" if quick else "runs/eval"),
    }


def run(args) -> list[dict]:
    """``keepkv eval``: load the model, run, print the table (or JSON rows with --json)."""
    data = _data_paths(args.data)
    # --data alone evaluates that data; --suite names the suites explicitly.
    suites = args.suite or (list(data) if data else list(_runner.DEFAULT_SUITES))
    sizes = run_sizes(args)
    suites, averages = expand_presets(suites, sizes, args)
    setting = getattr(args, "setting", None)
    if averages and setting is None:
        setting = "both"  # the preset runs as the field does (question-agnostic) and as keepkv did (aware)
    suites = apply_setting(suites, setting)
    if averages and setting is not None:
        averages = {
            (name if each == "aware" else f"{name}+setting={each}"): apply_setting(members, each)
            for name, members in averages.items() for each in (("aware", "agnostic") if setting == "both" else (setting,))
        }
    check_before_work(args, suites, sizes, data)
    model, tokenizer = _load_model(args)
    out = sizes["out_dir"]
    rows = _runner.run_eval(
        model, tokenizer, suites=suites, methods=args.methods, **sizes, seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        progress=not args.no_progress, data=data, batch_size=getattr(args, "batch_size", None),
        workers=args.workers, reference=args.reference, averages=averages, sweep=getattr(args, "sweep", False),
    )
    if getattr(args, "json", False):
        print(json.dumps(rows, indent=1))
    else:
        print(format_table(rows))
        out = Path(out)
        plots = f"{out / 'scores.png'}" + (f", {out / 'sweep.png'}" if getattr(args, "sweep", False) else "")
        plots = plots if have_matplotlib() else "none"
        print(f"\nsummary: {out / 'summary.csv'}  plot: {plots}  records: {out / 'cells'}", file=sys.stderr)
    return rows


def check_before_work(args, suites: list[str], sizes: dict, data: dict) -> None:
    """Everything ``keepkv eval`` can check before the model loads, each refused in one line:
    suites, methods and variants, budgets against every method's minimum, the reference, the data
    and model paths (a data suite without its --data), the device, and an output directory holding
    an earlier run's cells (``--resume``)."""
    specs = [_runner.SuiteSpec.parse(suite) for suite in suites]
    for spec in specs:
        _runner.check_suite(spec)
        _runner.check_data(spec, data)
    methods = args.methods or _runner.default_methods()
    plan = [(spec, length) for spec in specs for length in _runner._lengths_for(spec, sizes["lengths"])]
    _runner.check_grid(methods, sizes["budgets"], plan)
    if args.reference is not None and args.reference not in methods:
        raise ValueError(f"--reference {args.reference} is not among the methods run: {', '.join(methods)}")
    for name, path in data.items():
        if not Path(path).exists():
            raise ValueError(f"--data {name}={path}: no such file or directory")
    if getattr(args, "model", None) and not Path(args.model).exists():
        raise ValueError(f"--model {args.model}: no such file or directory")
    check_device_option(getattr(args, "device", "cpu") or "cpu")
    cells = Path(sizes["out_dir"]) / "cells"
    if not getattr(args, "resume", False) and cells.is_dir() and any(cells.glob("*.json")):
        raise ValueError(f"{sizes['out_dir']} holds the cells of an earlier run: pass --resume to continue it (its "
                         "finished cells are kept), or give another --out")


def _load_model(args):
    """The model of --model (default: the embedded one) in --dtype on --device."""
    from .. import models

    device = getattr(args, "device", "cpu") or "cpu"  # checked by check_before_work
    return models.load_model(getattr(args, "model", None), dtype=getattr(args, "dtype", "float32"), device=device)


def apply_setting(suites: list[str], setting: str | None) -> list[str]:
    """Each suite with a question in the asked setting (``both``: aware, then agnostic); the others
    (kl, ppl, fidelity) as they are. None: the suites as named."""
    if setting is None:
        return list(suites)
    out = []
    for suite in suites:
        spec = _runner.SuiteSpec.parse(suite)
        if spec.name not in _runner.QUESTION_SUITES:
            out.append(suite)
            continue
        for each in ("aware", "agnostic") if setting == "both" else (setting,):
            label = spec.with_setting(each).label
            if label not in out:
                out.append(label)
    return out


def expand_presets(suites: list[str], sizes: dict, args) -> tuple[list[str], dict]:
    """``ruler`` becomes the RULER preset's tasks (their lengths and samples unless --lengths or
    --samples say otherwise) and an average row; ``--sweep`` sets the sweep's budgets unless
    --budgets does."""
    averages = {}
    if getattr(args, "sweep", False) and not args.budgets:
        sizes["budgets"] = list(_runner.SWEEP_BUDGETS)
    if "ruler" not in suites:
        return suites, averages
    tasks = list(_runner.RULER_SUITES)
    out = []
    for suite in suites:
        out += [task for task in tasks if task not in out] if suite == "ruler" else [suite]
    if args.lengths is None and not getattr(args, "quick", False):
        sizes["lengths"] = {**_runner.DEFAULT_LENGTHS, **_runner.RULER_LENGTHS}
    if args.samples is None:
        base = sizes["samples"] if isinstance(sizes["samples"], dict) else {}
        sizes["samples"] = sizes["samples"] if isinstance(sizes["samples"], int) else {**base, **_runner.RULER_SAMPLES}
    averages[_runner.RULER_AVERAGE] = tasks
    return out, averages


def select_rows(rows: list[dict], methods=None, budgets=None) -> list[dict]:
    """The rows of ``methods`` (in that order, the full cache first) at ``budgets``; a method or
    budget the run does not hold is refused in one line."""
    if methods:
        held = {str(r["method"]) for r in rows}
        missing = [m for m in methods if m not in held]
        if missing:
            raise ValueError(f"--methods: {', '.join(missing)} not in this run (it holds {', '.join(sorted(held))})")
        order = {m: i for i, m in enumerate(["full", *[m for m in methods if m != "full"]])}
        rows = sorted((r for r in rows if str(r["method"]) in order), key=lambda r: order[str(r["method"])])
    if budgets:
        held = {float(r["budget"]) for r in rows if r["method"] != "full"}
        missing = [b for b in budgets if float(b) not in held]
        if missing:
            raise ValueError(f"--budgets: {', '.join(map(str, missing))} not in this run (it holds "
                             f"{', '.join(map(str, sorted(held)))})")
        rows = [r for r in rows if r["method"] == "full" or float(r["budget"]) in {float(b) for b in budgets}]
    return rows


def report(args) -> str:
    """``keepkv report``: the Markdown tables of a summary.csv, to stdout (and --out FILE)."""
    rows = read_summary(args.path)
    if getattr(args, "reference", None):
        run_dir = Path(args.path)
        rows = with_reference(rows, run_dir if run_dir.is_dir() else run_dir.parent, args.reference)
    selected = getattr(args, "methods", None) or getattr(args, "budgets", None)
    rows = select_rows(rows, getattr(args, "methods", None), getattr(args, "budgets", None))
    text = format_table(rows)
    run_dir = Path(args.path) if Path(args.path).is_dir() else Path(args.path).parent
    reference = getattr(args, "reference", None) or _reference_name(rows)
    # the resolution paragraphs cover the whole run: a selection shows its tables only
    resolution_text = "" if selected or not (run_dir / "cells").is_dir() else format_resolution(load_cells(run_dir), reference)
    if resolution_text:
        text += "\n" + resolution_text  # a blank line: the paragraph must not join the last table
    if getattr(args, "json", False):
        print(json.dumps(rows, indent=1))
    else:
        print(text)
    if getattr(args, "out", None):
        write_report(Path(args.out), text)
    return text


# What `keepkv report --out PAGE` replaces in a docs page, so that the page's prose stays.


def write_report(path: Path, text: str) -> None:
    """Write the report to ``path``; into a page with the REPORT_BEGIN/REPORT_END lines, between them."""
    page = path.read_text() if path.exists() else ""
    if REPORT_BEGIN in page and REPORT_END in page:
        head, rest = page.split(REPORT_BEGIN, 1)
        _, tail = rest.split(REPORT_END, 1)
        path.write_text(f"{head}{REPORT_BEGIN}\n\n{text}\n\n{REPORT_END}{tail}")
    else:
        path.write_text(text + "\n")


def report_section(page: str) -> str:
    """The part of a docs page that ``keepkv report --out`` wrote (between the markers)."""
    return page.split(REPORT_BEGIN, 1)[1].split(REPORT_END, 1)[0].strip()


# ---------------------------------------------------------------- Markdown


def _number(value, digits: int = 3) -> str:
    if value is None or value == "" or (isinstance(value, float) and math.isnan(value)):
        return "–"
    value = float(value)
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.{digits - 1}f}"


def _budget_text(budget) -> str:
    return str(budget)


def format_table(rows: list[dict]) -> str:
    """Markdown: methods as rows, suite x budget as columns.

    A score cell reads ``score ± ci95 (share of full)``; the full cache's row repeats its
    score under every budget. A second table gives each cell's cache size as a share of an
    uncompressed cache of the same tokens (means at the end of decoding).
    """
    if not rows:
        return "(no results)"
    groups: list[tuple[str, int]] = []
    budgets: dict[tuple[str, int], list] = {}
    methods: list[str] = []
    index = {}
    for row in rows:
        group = (str(row["suite"]), row["length"])
        if group not in budgets:
            groups.append(group)
            budgets[group] = []
        if row["method"] != "full" and row["budget"] not in budgets[group]:
            budgets[group].append(row["budget"])
        if row["method"] not in methods:
            methods.append(row["method"])
        index[(group, row["method"], row["budget"])] = row
    if "full" in methods:
        methods.remove("full")
        methods.insert(0, "full")
    for group in groups:
        if not budgets[group]:
            budgets[group] = [1.0]
    columns = [(group, budget) for group in groups for budget in budgets[group]]

    def find(group, method, budget):
        row = index.get((group, method, budget))
        if row is None and method == "full":
            row = next((r for (g, m, _), r in index.items() if g == group and m == "full"), None)
        return row

    def higher(group) -> bool:
        row = next(r for (g, _, _), r in index.items() if g == group)
        return row.get("higher_is_better", True) in (True, "true", "True")

    header = ["method"] + [f"{g[0]} {g[1]} @{_budget_text(b)} {'↑' if higher(g) else '↓'}" for g, b in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + [":---:"] * len(columns)) + "|"]
    for method in methods:
        cells = [method]
        for group, budget in columns:
            row = find(group, method, budget)
            if row is None:
                cells.append("")
                continue
            text = _number(row["score"])
            if row.get("ci95") not in (None, "") and not (isinstance(row["ci95"], float) and math.isnan(row["ci95"])):
                text += f" ± {_number(row['ci95'])}"
            share = row.get("share_of_full")
            if method != "full" and isinstance(share, (int, float)) and not math.isnan(share):
                text += f" ({share:.0%})"
            cells.append(text)
        lines.append("| " + " | ".join(cells) + " |")

    memory = ["", "Cache size at the end of decoding, % of an uncompressed cache of the same tokens:", ""]
    memory.append("| " + " | ".join(["method"] + [f"{g[0]} {g[1]} @{_budget_text(b)}" for g, b in columns]) + " |")
    memory.append("|" + "|".join(["---"] + [":---:"] * len(columns)) + "|")
    for method in methods:
        cells = [method]
        for group, budget in columns:
            row = find(group, method, budget)
            held, full = (row or {}).get("cache_bytes"), (row or {}).get("full_cache_bytes")
            ok = isinstance(held, (int, float)) and isinstance(full, (int, float)) and full and not math.isnan(held)
            cells.append(f"{held / full:.0%}" if ok else "")
        memory.append("| " + " | ".join(cells) + " |")
    detail = []
    for group in groups:
        group_rows = [r for (g, _, _), r in index.items() if g == group]
        if any(isinstance(r.get("agree_share"), (int, float)) for r in group_rows):
            title = ("mean KL(full ‖ method) of the next token along the full cache's answer, tokens until the "
                     "first divergence, share of identical tokens")

            def text(row):
                return (f"KL {row['kl']:.3f}, prefix {_number(row.get('agree_prefix'))}, "
                        f"same {float(row.get('agree_share') or 0):.0%}")
        elif any(isinstance(r.get("nll_delta"), (int, float)) for r in group_rows):
            title = "mean KL(full ‖ method) and NLL(method) − NLL(full), nats per teacher-forced token"

            def text(row):
                return f"KL {row['kl']:.3f}, ΔNLL {row['nll_delta']:+.3f}"
        else:
            continue
        detail += ["", f"{group[0]} {group[1]}: {title}:", ""]
        detail.append("| " + " | ".join(["method"] + [f"@{_budget_text(b)}" for b in budgets[group]]) + " |")
        detail.append("|" + "|".join(["---"] + [":---:"] * len(budgets[group])) + "|")
        for method in methods:
            cells = [method]
            for budget in budgets[group]:
                row = find(group, method, budget)
                cells.append("" if row is None or not isinstance(row.get("kl"), (int, float)) else text(row))
            detail.append("| " + " | ".join(cells) + " |")
    paired = []
    for prefix, title in (("diff_full", "the full cache"), ("diff_ref", _reference_name(rows))):
        if title is not None and any(isinstance(r.get(prefix), (int, float)) for r in rows):
            paired += _paired_table(prefix, title, methods, columns, find, higher)
    n_values = sorted({int(r["n"]) for r in rows if isinstance(r.get("n"), (int, float))})
    notes = [
        "",
        f"Score ± 95% CI half-width (Student t over samples, n = {', '.join(map(str, n_values))}) and, in "
        "parentheses, the share of the full cache's score (for ↓ metrics: full / score). "
        "needle, tracking, aggregation: RULER string match; ppl: perplexity with the cache compressed "
        "during decoding; fidelity: ROUGE-L against the full cache's answer; kl: mean KL(full ‖ method) of the "
        "next token over 128 teacher-forced tokens of real text.",
    ]
    return "\n".join(lines + notes + paired + memory + detail)


def format_resolution(groups: dict, reference: str | None = None) -> str:
    """Markdown (empty when no group has two compressed methods): per suite and budget, the paired
    95% half-widths over every pair of compressed methods (0/1 scores against the 0.15 target;
    continuous scores, KL, have no blanket target). Suites run in several variants at one length
    and setting (``kl+source=pydoc`` and ``kl+source=stdlib``) also get a row of all their samples
    pooled. Then, for continuous scores, what a user decides on: every close pair (means within
    ``CLOSE_RATIO``) with its paired difference, and, with ``reference``, every method's paired
    difference from it relative to its mean."""
    header = [
        "", "Resolution: paired 95% half-width over every pair of compressed methods at one budget (0/1 scores: "
        "absolute, target 0.15; others: relative to the pair's mean score, no blanket target: see the close "
        "pairs below); a pair resolves a difference larger than its half-width. Close pairs: means within "
        f"{CLOSE_RATIO:g}x of each other. Resolved: pairs whose interval excludes 0.", "",
        "| suite | budget | pairs | median | close pairs' median | largest (pair) | below target | resolved |",
        "|---|:---:|:---:|:---:|:---:|:---:|:---:|:---:|",
    ]
    pooled: dict = {}
    for (suite, length), cells in groups.items():
        name = suite.split("+")[0] + ("+setting=agnostic" if "setting=agnostic" in suite.split("+") else "")
        pooled.setdefault((name, length), []).append((suite, cells))
    tables = list(groups.items())
    for (name, length), members in pooled.items():
        if len(members) > 1:
            merged: dict = {}
            for suite, cells in members:
                for key, records in cells.items():
                    merged.setdefault(key, []).extend({**r, "id": f"{suite}/{r['id']}"} for r in records)
            tables.append(((f"{name} (pooled: {len(members)} suites)", length), merged))
    lines, close_lines, continuous = [], [], []
    for index, ((suite, length), cells) in enumerate(tables):
        for budget in sorted({b for m, b in cells if m != "full"}):
            at_budget = {m: records for (m, b), records in cells.items() if b == budget and m != "full"}
            found = resolution(at_budget)
            if found is None:
                continue

            def show(width):
                if math.isnan(width):
                    return "–"
                return f"{width:.0%}" if found.relative else f"{width:.3f}"

            target = "–" if math.isnan(found.target) else f"{found.within}/{found.pairs} below {show(found.target)}"
            lines.append(
                f"| {suite} {length} | {budget} | {found.pairs} | {show(found.median)} | {show(found.close_median)} | "
                f"{show(found.worst)} ({' vs '.join(found.worst_pair)}) | {target} | {found.resolved}/{found.pairs} |"
            )
            if found.relative and index < len(groups):  # close pairs of each suite, not of the pooled rows
                continuous.append((suite, length, budget, at_budget))
                for first, second, difference, width in close_pairs(at_budget):
                    text = f"{difference.mean:+.3f} ± {difference.ci95:.3f}"
                    if difference.resolved:
                        text = f"**{text}**"
                    close_lines.append(f"| {suite} {length} | {budget} | {first} − {second} | {text} | {width:.0%} |")
    if not lines:
        return ""
    out = header + lines
    if close_lines:
        out += [
            "", "Close pairs of continuous scores (KL): the pairs of compressed methods whose mean scores are within "
            f"{CLOSE_RATIO:g}x of each other, closest first, with their paired difference (first − second) ± 95% "
            "half-width (**bold**: resolved) and that half-width relative to the pair's mean score.", "",
            "| suite | budget | pair | difference | half-width / mean |", "|---|:---:|---|:---:|:---:|",
            *close_lines,
        ]
    if reference is not None and continuous:
        out += _reference_resolution(reference, continuous)
    return "\n".join(out)


def _reference_resolution(reference: str, continuous: list[tuple]) -> list[str]:
    """Each method's paired difference from ``reference`` relative to the reference's mean score,
    per continuous-score suite and budget: what a user who would replace the reference reads."""
    methods = sorted({m for *_, cells in continuous for m in cells if m != reference})
    if not any(reference in cells for *_, cells in continuous):
        return []
    header = [f"{suite} {length} @{budget}" for suite, length, budget, _ in continuous]
    lines = [
        "", f"Against {reference} (continuous scores): paired difference (method − {reference}) over {reference}'s "
        "mean score, ± its 95% half-width on the same scale; **bold**: resolved.", "",
        "| method | " + " | ".join(header) + " |", "|" + "|".join(["---"] + [":---:"] * len(header)) + "|",
    ]
    for method in methods:
        cells_text = []
        for _, _, _, cells in continuous:
            difference = pair_records(cells[method], cells[reference]) if method in cells and reference in cells else None
            scale = abs(math.fsum(r["score"] for r in cells.get(reference, [])) / max(1, len(cells.get(reference, []))))
            if difference is None or math.isnan(difference.ci95) or scale == 0:
                cells_text.append("")
                continue
            text = f"{difference.mean / scale:+.1%} ± {difference.ci95 / scale:.1%}"
            cells_text.append(f"**{text}**" if difference.resolved else text)
        lines.append(f"| {method} | " + " | ".join(cells_text) + " |")
    return lines


def _reference_name(rows: list[dict]) -> str | None:
    return next((str(r["reference"]) for r in rows if r.get("reference") not in (None, "")), None)


def _paired_table(prefix: str, title: str, methods, columns, find, higher) -> list[str]:
    """Markdown rows of the paired differences ``method - title`` stored under ``prefix``."""
    lines = [
        "", f"Paired difference from {title} (method − {title}, same samples): mean ± 95% half-width "
        "(Student t over the per-sample differences); p: exact McNemar test where scores are 0/1; **bold** "
        "where the interval excludes 0 (and p < 0.05 for 0/1 scores): a resolved difference, any other is "
        "a tie.", "",
        "| " + " | ".join(["method"] + [f"{g[0]} {g[1]} @{_budget_text(b)} {'↑' if higher(g) else '↓'}" for g, b in columns]) + " |",
        "|" + "|".join(["---"] + [":---:"] * len(columns)) + "|",
    ]
    for method in methods:
        cells = [method]
        for group, budget in columns:
            row = find(group, method, budget) if method != "full" else None
            mean, ci = (row or {}).get(prefix), (row or {}).get(f"{prefix}_ci95")
            if not isinstance(mean, (int, float)) or math.isnan(mean):
                cells.append("")
                continue
            text = f"{mean:+.3f}" if not isinstance(ci, (int, float)) or math.isnan(ci) else f"{mean:+.3f} ± {ci:.3f}"
            p = row.get(f"{prefix}_p")
            if isinstance(ci, (int, float)) and resolved(mean, ci, p if isinstance(p, (int, float)) else None):
                text = f"**{text}**"
            if isinstance(p, (int, float)) and not math.isnan(p):
                text += f" p={p:.2g}"
            cells.append(text)
        if any(cells[1:]):
            lines.append("| " + " | ".join(cells) + " |")
    return lines
