"""Evaluation: RULER-style suites, perplexity and fidelity, local datasets, metrics and the runner.

``run_eval`` (keepkv.eval.runner) evaluates every registered method at every budget;
``keepkv eval`` / ``keepkv report`` are its command line (keepkv.eval.cli).
"""

__all__ = ["run_eval", "greedy_decode", "read_summary", "format_table", "plot_scores"]


def __getattr__(name):
    # Lazy, so that importing keepkv.eval.tasks or .metrics does not pull the runner.
    if name == "run_eval":
        from .runner import run_eval

        return run_eval
    if name == "greedy_decode":
        from .decoding import greedy_decode

        return greedy_decode
    if name == "read_summary":
        from .summary import read_summary

        return read_summary
    if name == "format_table":
        from .cli import format_table

        return format_table
    if name == "plot_scores":
        from .plot import plot_scores

        return plot_scores
    raise AttributeError(f"module 'keepkv.eval' has no attribute {name!r}")
