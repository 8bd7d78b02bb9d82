"""Summaries of an eval run: per-cell means and intervals, paired differences, summary.csv.

``summary_rows`` turns every cell's per-sample records into one row: the mean score and its
95% interval, the share of the full cache's score, memory, the suite's extra metrics, and
the paired differences against the full cache and against an optional reference method
(keepkv.eval.paired). ``write_summary`` / ``read_summary`` are the CSV round trip.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from . import metrics
from .paired import pair_records

LOWER_IS_BETTER = frozenset({"ppl", "kl"})
SUMMARY_COLUMNS = (
    "suite", "length", "method", "budget", "score", "ci95", "share_of_full", "cache_bytes",
    "full_cache_bytes", "n", "higher_is_better",
)
REQUIRED_COLUMNS = SUMMARY_COLUMNS[:5]  # what a report reads of every row: suite, length, method, budget, score
# Per-sample fields averaged into extra summary columns (when a suite has them).
EXTRA_COLUMNS = ("kept_entries", "budget_entries", "agree_prefix", "agree_share", "kl", "rouge_l", "em", "f1", "nll", "nll_delta")


def summarize_cell(records: list[dict]) -> dict:
    """Mean score, its 95% half-width and the means of the extra fields, over the cell's samples."""
    scores = [r["score"] for r in records]
    mean, ci = metrics.mean_ci95(scores) if scores else (math.nan, math.nan)
    out = {"score": mean, "ci95": ci, "n": len(scores)}
    for name in ("cache_bytes", "full_cache_bytes", *EXTRA_COLUMNS):
        values = [r[name] for r in records if r.get(name) is not None]
        if values:
            out[name] = sum(values) / len(values)
    return out


def paired_columns(records: list[dict], reference: list[dict], prefix: str) -> dict:
    """``{prefix}``, ``{prefix}_ci95`` and ``{prefix}_p`` (McNemar, 0/1 scores only) of the paired
    difference ``records - reference`` (matched by sample id); empty when no sample matches."""
    paired = pair_records(records, reference)
    if paired is None:
        return {}
    columns = {prefix: paired.mean, f"{prefix}_ci95": paired.ci95}
    if paired.mcnemar_p is not None:
        columns[f"{prefix}_p"] = paired.mcnemar_p
    return columns


def reference_columns(cells: dict, reference: str) -> dict:
    """Paired columns of every cell of one group against ``reference`` at the same budget.

    Parameters
    ----------
    cells : dict
        ``(method, budget) -> records`` of one suite and length.
    reference : str
        A method of ``cells``; its cell at each budget is the reference of that budget.

    Returns
    -------
    dict
        ``(method, budget) -> {"reference": reference, "diff_ref": ..., "diff_ref_ci95": ..., "diff_ref_p": ...}``
        for the cells whose budget the reference ran at.
    """
    out = {}
    for (method, budget), records in cells.items():
        baseline = cells.get((reference, budget))
        if method == "full" or baseline is None:
            continue
        out[(method, budget)] = {"reference": reference, **paired_columns(records, baseline, "diff_ref")}
    return out


def _round(value):
    return math.nan if value is None else round(value)


def summary_rows(groups, reference: str | None = None) -> list[dict]:
    """One row per cell, with share_of_full and the paired differences against the full cache
    (``diff_full*``) and, with ``reference``, against that method at the same budget (``diff_ref*``).

    ``groups``: the runner's groups (``spec``, ``length``, ``cells``; the full cache first).
    """
    rows = []
    for group in groups:
        lower = group.spec.name in LOWER_IS_BETTER
        full_score = None
        full_records = group.cells[0].records
        against_reference = {}
        if reference is not None:
            against_reference = reference_columns({(c.method, c.budget): c.records for c in group.cells}, reference)
        for cell in group.cells:
            stats = summarize_cell(cell.records)
            if full_score is None:
                full_score = stats["score"]
            if lower:
                share = full_score / stats["score"] if stats["score"] and full_score else math.nan
            else:
                share = stats["score"] / full_score if full_score else math.nan
            row = {
                "suite": group.spec.label, "length": group.length, "method": cell.method, "budget": cell.budget,
                "score": stats["score"], "ci95": stats["ci95"], "share_of_full": share,
                "cache_bytes": _round(stats.get("cache_bytes")),
                "full_cache_bytes": _round(stats.get("full_cache_bytes")),
                "n": stats["n"], "higher_is_better": not lower,
            }
            for name in EXTRA_COLUMNS:
                if name in stats:
                    row[name] = stats[name]
            if cell.method != "full":
                row.update(paired_columns(cell.records, full_records, "diff_full"))
            row.update(against_reference.get((cell.method, cell.budget), {}))
            row["seconds"] = round(cell.seconds, 2)
            row["cpu_seconds"] = round(cell.cpu_seconds, 2)
            rows.append(row)
    return rows


def _fmt(value) -> str:
    if value is None:
        return ""  # read back as None
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    return str(value)


def write_summary(rows: list[dict], path: Path) -> None:
    """Write the summary rows as CSV (fixed columns first, then every extra column met)."""
    columns = list(SUMMARY_COLUMNS)
    for row in rows:
        columns += [key for key in row if key not in columns]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({key: _fmt(row[key]) if key in row else "" for key in columns})


def _parse_value(text: str):
    if text in ("", "None"):  # "None": what runs before the writer wrote "" for it
        return None
    if text in ("true", "false", "True", "False"):
        return text.lower() == "true"
    for number in (int, float):  # "3" is an int, "0.1" a float, anything else stays text
        try:
            return number(text)
        except ValueError:
            continue
    return text


def read_summary(path) -> list[dict]:
    """Rows of a summary.csv (``path`` is the file or the run directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / "summary.csv"
    if not path.is_file():
        raise FileNotFoundError(f"no summary.csv at {path}")
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [name for name in REQUIRED_COLUMNS if name not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path} is not an eval summary.csv (no {', '.join(missing)} column): give a `keepkv eval` "
                             "run directory or its summary.csv")
        rows = [{key: _parse_value(value) for key, value in row.items()} for row in reader]
    for row in rows:
        for key in ("suite", "method"):
            row[key] = str(row[key])
    return rows


def load_cells(run_dir) -> dict:
    """Per-sample records of a run's ``cells/*.json``: ``(suite, length) -> {(method, budget): records}``."""
    cells_dir = Path(run_dir) / "cells"
    if not cells_dir.is_dir():
        raise FileNotFoundError(f"no cells directory at {cells_dir} (paired differences need the per-sample records)")
    groups: dict = {}
    for path in sorted(cells_dir.glob("*.json")):
        stored = json.loads(path.read_text())
        groups.setdefault((stored["suite"], stored["length"]), {})[(stored["method"], stored["budget"])] = stored["records"]
    return groups


def with_reference(rows: list[dict], run_dir, reference: str) -> list[dict]:
    """``rows`` with their ``diff_ref*`` columns recomputed against ``reference`` from the run's cells."""
    groups = load_cells(run_dir)
    methods = sorted({method for cells in groups.values() for method, _ in cells})
    if reference not in methods:
        raise ValueError(f"reference {reference!r} is not in this run; its methods: {', '.join(methods)}")
    columns = {key: reference_columns(cells, reference) for key, cells in groups.items()}
    out = []
    for row in rows:
        row = {key: value for key, value in row.items() if key != "reference" and not key.startswith("diff_ref")}
        found = columns.get((row["suite"], row["length"]), {}).get((row["method"], row["budget"]), {})
        out.append({**row, **found})
    return out


def average_rows(rows: list[dict], name: str, suites: list[str]) -> list[dict]:
    """Per method and budget, the unweighted mean score over ``suites`` (labels), as RULER reports
    its tasks' average: one row with suite ``name``, length the longest of them, ``n`` the number
    of suites, ``average_of`` their labels. Only (method, budget) pairs that every suite has; the
    full cache's row counts at every budget."""
    members = [row for row in rows if row["suite"] in suites]
    if not members:
        return []
    full = {row["suite"]: row for row in members if row["method"] == "full"}
    budgets = sorted({row["budget"] for row in members if row["method"] != "full"}, key=float)
    methods = list(dict.fromkeys(row["method"] for row in members))
    out = []
    for method in methods:
        for budget in [1.0] if method == "full" else budgets:
            found = [
                row for row in members if row["method"] == method and (method == "full" or row["budget"] == budget)
            ]
            if {row["suite"] for row in found} != set(suites):
                continue
            score = sum(row["score"] for row in found) / len(found)
            full_score = sum(row["score"] for row in full.values()) / len(full) if len(full) == len(suites) else None
            out.append({
                "suite": name, "length": max(row["length"] for row in found), "method": method, "budget": budget,
                "score": round(score, 6), "ci95": None,
                "share_of_full": round(score / full_score, 6) if full_score else None,
                "cache_bytes": None, "full_cache_bytes": None, "n": len(found),
                "higher_is_better": all(row.get("higher_is_better", True) in (True, "true", "True") for row in found),
                "average_of": " ".join(suites),
            })
    return out
