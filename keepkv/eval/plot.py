"""The eval plot: score against budget, one line per method, one panel per suite and length."""

from __future__ import annotations

import math
from pathlib import Path


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def plot_scores(rows: list[dict], path) -> Path:
    """Draw ``rows`` (summary rows) into a PNG at ``path``; the full cache is a dashed line.

    Error bars are the 95% half-widths. Panels say whether higher or lower is better.
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
            handles[method] = axis.errorbar(
                budgets, scores, yerr=errors, marker="o", markersize=4, capsize=2, linewidth=1.2,
                color=colours(index % 20), label=method,
            )
        axis.set_title(f"{suite} @ {length} tokens ({'higher' if higher else 'lower'} is better)", fontsize=9)
        axis.set_xlabel("budget")
        axis.set_ylabel("perplexity" if not higher else "score")
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
