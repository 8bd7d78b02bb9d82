"""Text table and PNG of a ``run_bench`` result."""

from __future__ import annotations

MB = 1 << 20


def _num(value, fmt: str = "{:.2f}", none: str = "-") -> str:
    if value is None or (isinstance(value, float) and value != value):
        return none
    return fmt.format(value)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def format_table(result: dict) -> str:
    """The whole result as plain-text tables (header, fixed batch, memory cap, overhead, profile)."""
    model, settings, host = result["model"], result["settings"], result["host"]
    out = [
        f"keepkv bench: {model['source']} ({model['model_type']}, {model['num_layers']} layers, {model['dtype']})"
        f" on {host['device']} [{host['device_name']}, {host['threads']} threads]",
    ]
    if model["random_weights"]:
        out.append(f"  {model['note']}")
    out.append(
        f"  prompt {settings['prompt_len']} + {settings['gen_len']} generated, budget {settings['budget']}, "
        f"median of {settings['repeats']} (min-max), warm-up {settings['warmup']}"
    )
    params = {m: p for m, p in settings["method_params"].items() if p}
    if params:
        out.append(f"  method params: {params}")
    out.append("")
    out.append("Fixed batch")
    rows = []
    for r in result["fixed"]:
        rows.append(
            [
                r["method"],
                str(r["batch"]),
                f"{r['tokens_per_s']:.2f} ({r['tokens_per_s_min']:.2f}-{r['tokens_per_s_max']:.2f})",
                _num(r["decode_tokens_per_s"]),
                f"{r['step_ms_mean']:.2f} ({r['step_ms_mean_min']:.2f}-{r['step_ms_mean_max']:.2f})",
                _num(r["step_ms_p95"]),
                _num(r["prefill_s"], "{:.3f}"),
                _num(r["cache_bytes"] / MB, "{:.1f}"),
                _num(r["cache_bytes_peak"] / MB, "{:.1f}"),
                _num(r["peak_memory_bytes"] / MB, "{:.0f}"),
                _num(r["tokens_per_s_vs_full"], "{:.2f}x"),
                _num(r["step_ms_vs_full"], "{:.3f}x"),
                _num(r["step_ms_vs_h2o"], "{:.3f}x"),
            ]
        )
    out.append(
        _table(
            ["method", "b", "tok/s (min-max)", "decode tok/s", "step ms mean (min-max)", "p95 ms", "prefill s",
             "cache MB", "cache peak MB", "peak mem MB", "tok/s vs full", "step vs full", "step vs h2o"],
            rows,
        )
    )
    cap = result.get("memory_cap")
    if cap:
        out += ["", f"Memory cap {cap['capacity_gb']:g} GB (weights {cap['weights_bytes'] / MB:.0f} MB): {cap['note']}"]
        rows = [
            [
                r["method"],
                _num(r["cache_bytes_per_row"] / MB, "{:.1f}"),
                _num(r["workspace_bytes_per_row"] / MB, "{:.1f}"),
                str(r["max_batch"]),
                str(r["measured_batch"]) + (" (capped)" if r["capped"] else ""),
                _num(r["tokens_per_s"]),
                _num(r["tokens_per_s_vs_full"], "{:.2f}x"),
                _num(r["batch_vs_full"], "{:.2f}x"),
            ]
            for r in cap["methods"]
        ]
        out.append(
            _table(["method", "cache MB/row", "workspace MB/row", "max batch", "measured at", "tok/s",
                    "tok/s vs full", "batch vs full"], rows)
        )
    if result.get("overhead"):
        out += ["", "Overhead per decode step (ms; method = observe + refresh + compress + attention_entries)"]
        rows = [
            [
                r["method"],
                str(r["batch"]),
                _num(r["step_ms"]),
                _num(r["method_ms"], "{:.3f}"),
                _num(100 * r["method_share"], "{:.1f}%"),
                _num(r["observe_ms"], "{:.3f}"),
                _num(r["compress_ms"], "{:.3f}"),
                _num(r["attention_entries_ms"], "{:.3f}"),
                _num(r["append_ms"], "{:.3f}"),
                _num(r["attend_ms"], "{:.3f}"),
                _num(r["model_ms"], "{:.3f}"),
            ]
            for r in result["overhead"]
        ]
        out.append(
            _table(["method", "b", "step", "method", "share", "observe", "compress", "attn_entries", "append",
                    "attend", "model rest"], rows)
        )
    for method, prof in (result.get("profile") or {}).items():
        out += ["", f"Profile {method} (b={prof['batch']}, {prof['steps']} steps, by {prof['sort_by']}; ms per step)"]
        rows = [
            [r["name"][:60], str(r["calls"]), _num(r["self_ms_per_step"], "{:.3f}"),
             _num(r["total_ms_per_step"], "{:.3f}"), _num(r["self_pct"], "{:.1f}%")]
            for r in prof["ops"]
        ]
        out.append(_table(["op", "calls", "self ms", "total ms", "self %"], rows))
    if result.get("notes"):
        out += ["", "Notes:"] + [f"  - {note}" for note in result["notes"]]
    return "\n".join(out)


def save_plot(result: dict, path: str) -> str:
    """PNG: throughput against batch per method (memory-cap points as stars), and each method
    against full (fixed batch at the largest batch, and memory cap when run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = result["settings"]["methods"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {m: plt.cm.tab10(i % 10) for i, m in enumerate(methods)}
    for method in methods:
        recs = sorted((r for r in result["fixed"] if r["method"] == method), key=lambda r: r["batch"])
        if not recs:
            continue
        xs = [r["batch"] for r in recs]
        ys = [r["tokens_per_s"] for r in recs]
        err = [[y - r["tokens_per_s_min"] for y, r in zip(ys, recs)], [r["tokens_per_s_max"] - y for y, r in zip(ys, recs)]]
        left.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=method, color=colors[method])
    cap = result.get("memory_cap")
    if cap:
        for r in cap["methods"]:
            if r["tokens_per_s"] is not None:
                left.scatter([r["measured_batch"]], [r["tokens_per_s"]], marker="*", s=160, color=colors[r["method"]],
                             edgecolors="black", zorder=5)
    left.set_xlabel("batch")
    left.set_ylabel("tokens/s (end to end)")
    left.set_xscale("log", base=2)
    left.set_title("Throughput against batch" + (" (stars: memory cap)" if cap else ""))
    left.legend(fontsize=8)
    left.grid(alpha=0.3)

    largest = max(result["settings"]["batches"])
    fixed = {r["method"]: r for r in result["fixed"] if r["batch"] == largest}
    labels = [m for m in methods if m in fixed]
    width = 0.4 if cap else 0.8
    positions = range(len(labels))
    right.bar([p - (width / 2 if cap else 0) for p in positions], [fixed[m]["tokens_per_s_vs_full"] or 0 for m in labels],
              width, label=f"fixed batch {largest}", color=[colors[m] for m in labels])
    if cap:
        capped = {r["method"]: r for r in cap["methods"]}
        right.bar([p + width / 2 for p in positions], [capped[m]["tokens_per_s_vs_full"] or 0 for m in labels], width,
                  label="memory cap", color=[colors[m] for m in labels], hatch="//", alpha=0.6)
        right.legend(fontsize=8)
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set_xticks(list(positions), labels, rotation=30, ha="right")
    right.set_ylabel("tokens/s / full's (same run)")
    right.set_title("Method against full")
    right.grid(axis="y", alpha=0.3)
    model = result["model"]
    title = f"{model['source']} {model['dtype']} on {result['host']['device_name']}"
    if model["random_weights"]:
        title += f" - {model['note']}"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
