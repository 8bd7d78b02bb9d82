"""The eval plot: score against budget, one line per method, one panel per suite and length."""

from __future__ import annotations

import math
from pathlib import Path


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h")
_COLOUR_ORDER = (0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19)  # tab20: dark shades first


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


Y_LABELS = {"ppl": "perplexity", "kl": "KL(full ‖ method), nats per token"}


def plot_scores(rows: list[dict], path) -> Path:
    """Draw ``rows`` (summary rows) into a PNG at ``path``; the full cache is a dashed line.

    Error bars are the 95% half-widths, clipped to the metric's range. Methods are nudged
    apart along the budget axis so that equal scores stay visible. Lower-is-better panels
    (perplexity, KL) use a log scale. Panels say whether higher or lower is better.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        panels.setdefault((str(row["suite"]), row["length"]), []).append(row)
    count = max(1, len(panels))
    columns = min(3, count)
    lines = math.ceil(count / columns)
    figure, axes = plt.subplots(lines, columns, figsize=(4.6 * columns, 3.6 * lines), squeeze=False)
    methods = []
    for row in rows:
        if row["method"] != "full" and row["method"] not in methods:
            methods.append(row["method"])
    colours = plt.get_cmap("tab20")
    handles = {}
    for axis, ((suite, length), panel) in zip(axes.flat, panels.items()):
        higher = panel[0].get("higher_is_better", True) in (True, "true", "True")
        budgets_here = sorted({float(r["budget"]) for r in panel if r["method"] != "full"})
        gaps = [b - a for a, b in zip(budgets_here, budgets_here[1:])]
        nudge = 0.25 * min(gaps) / max(1, len(methods)) if gaps else 0.0
        scores_here = [r["score"] for r in panel if _is_number(r["score"])]
        unit_range = higher and scores_here and all(0.0 <= v <= 1.0 for v in scores_here)
        for row in panel:
            if row["method"] == "full" and _is_number(row["score"]):
                handles["full"] = axis.axhline(row["score"], color="black", linestyle="--", linewidth=1.2, label="full")
        for index, method in enumerate(methods):
            points = sorted(
                (float(r["budget"]), r["score"], r["ci95"]) for r in panel if r["method"] == method and _is_number(r["score"])
            )
            if not points:
                continue
            budgets, scores, errors = zip(*points)
            errors = [e if _is_number(e) else 0.0 for e in errors]
            low = [min(e, s) if unit_range else (min(e, 0.9 * s) if not higher else e) for s, e in zip(scores, errors)]
            high = [min(e, 1.0 - s) if unit_range else e for s, e in zip(scores, errors)]
            shift = (index - (len(methods) - 1) / 2) * nudge
            handles[method] = axis.errorbar(
                [b + shift for b in budgets], scores, yerr=[low, high], marker=MARKERS[index % len(MARKERS)],
                markersize=4, capsize=2, linewidth=1.2, color=colours(_COLOUR_ORDER[index % 20]), label=method,
            )
        axis.set_title(f"{suite} @ {length} tokens ({'higher' if higher else 'lower'} is better)", fontsize=9)
        if not higher:
            axis.set_yscale("log")
        elif unit_range:
            axis.set_ylim(-0.05, 1.05)
        if budgets_here:
            axis.set_xticks(budgets_here)
        axis.set_xlabel("budget")
        axis.set_ylabel(Y_LABELS.get(suite.split("+")[0], "score"))
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[count:]:
        axis.set_visible(False)
    if handles:
        figure.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(7, len(handles)), fontsize=8,
                      frameon=False)
    figure.tight_layout(rect=(0, 0.08 if lines == 1 else 0.05, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _setting(suite: str) -> str:
    return "agnostic" if "setting=agnostic" in str(suite).split("+") else "aware"


def sweep_points(rows: list[dict]) -> dict[tuple[str, str], dict[str, list[tuple[float, float]]]]:
    """The sweep plot's data: per panel, (setting, "higher" / "lower" is better), and per method,
    (compression ratio = 1 - budget, mean score over that panel's suites) for every fractional
    budget that every such suite has. Question-aware and question-agnostic suites are separate
    panels (their mean would mix two settings). The full cache's mean is one point at ratio 0.
    Average rows are left out (their suites are already in)."""
    panels: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        if row.get("average_of") or not _is_number(row["score"]):
            continue
        higher = row.get("higher_is_better", True) in (True, "true", "True")
        panels.setdefault((_setting(row["suite"]), "higher" if higher else "lower"), []).append(row)
    points = {}
    for panel, wanted in sorted(panels.items(), key=lambda item: (item[0][0] != "aware", item[0][1])):
        suites = {(row["suite"], row["length"]) for row in wanted}
        scores: dict[tuple[str, float], list[float]] = {}
        for row in wanted:
            budget = 1.0 if row["method"] == "full" else row["budget"]
            if isinstance(budget, float) and 0 < budget <= 1:
                scores.setdefault((row["method"], budget), []).append(row["score"])
        by_method: dict[str, list[tuple[float, float]]] = {}
        for (method, budget), values in scores.items():
            if len(values) == len(suites):
                by_method.setdefault(method, []).append((round(1.0 - budget, 6), sum(values) / len(values)))
        points[panel] = {method: sorted(values) for method, values in by_method.items()}
    return points


def plot_sweep(rows: list[dict], path) -> Path | None:
    """``keepkv eval --sweep``: the mean score against the compression ratio (1 - budget), one line
    per method, the full cache dashed, as kvpress's leaderboard draws it; one panel per setting
    (question-aware, question-agnostic) and one for the lower-is-better suites (KL) when there are
    any. None, with a message on stderr, when matplotlib is not installed (the numbers are in
    summary.csv)."""
    import sys

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("keepkv: the sweep plot needs matplotlib (pip install matplotlib); the numbers are in summary.csv",
              file=sys.stderr)
        return None
    points = sweep_points(rows)
    panels = list(points)
    figure, axes = plt.subplots(1, max(1, len(panels)), figsize=(5.6 * max(1, len(panels)), 4.2), squeeze=False)
    colours = plt.get_cmap("tab20")
    methods = list(dict.fromkeys(m for panel in panels for m in points[panel] if m != "full"))
    handles = {}
    for axis, panel in zip(axes.flat, panels):
        setting, direction = panel
        for method, values in points[panel].items():
            if method == "full":
                handles["full"] = axis.axhline(values[0][1], color="black", linestyle="--", linewidth=1.2, label="full")
        for index, method in enumerate(methods):
            if method not in points[panel]:
                continue
            ratios, scores = zip(*points[panel][method])
            (handles[method],) = axis.plot(
                ratios, scores, marker=MARKERS[index % len(MARKERS)], markersize=4, linewidth=1.2,
                color=colours(_COLOUR_ORDER[index % 20]), label=method,
            )
        axis.set_xlabel("compression ratio (1 - budget)")
        axis.set_ylabel("mean score" if direction == "higher" else "mean KL(full ‖ method)")
        axis.set_title(f"question-{setting}, {direction} is better", fontsize=9)
        if direction == "lower":
            axis.set_yscale("log")
        else:
            axis.set_ylim(-0.05, 1.05)
        axis.grid(alpha=0.3)
    if handles:
        figure.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(7, len(handles)), fontsize=8,
                      frameon=False)
    figure.tight_layout(rect=(0, 0.1, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
