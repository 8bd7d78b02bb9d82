"""Plots are an extra (keepkv[plot]): without matplotlib, keepkv eval and keepkv bench write every
number, draw no plot, and say so in one line that names the extra."""

import json
import sys

import pytest

from keepkv.bench.core import build_parser, main as bench_main
from keepkv.cli import main as keepkv_main
from keepkv.eval.summary import read_summary

from conftest import tiny_model
from test_eval_runner import char_tokenizer


@pytest.fixture
def no_matplotlib(monkeypatch):
    """``import matplotlib`` fails, as where the extra is not installed."""
    for name in [name for name in sys.modules if name == "matplotlib" or name.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)


def notes(text: str) -> list[str]:
    """The lines that mention the plot extra."""
    return [line for line in text.splitlines() if "[plot]" in line]


def test_bench_without_matplotlib_writes_the_numbers_and_says_how_to_get_plots(no_matplotlib, tmp_path, capsys):
    args = build_parser().parse_args(
        ["--config", "smollm2-135m", "--layers", "1", "--prompt-len", "16", "--gen-len", "2", "--batch", "1",
         "--repeats", "1", "--warmup", "0", "--methods", "h2o", "--budget", "0.5", "--out", str(tmp_path),
         "--plot", str(tmp_path / "extra.png"), "--no-progress"]
    )
    assert bench_main(args) == 0
    shown = capsys.readouterr()
    assert "Fixed batch" in shown.out
    assert notes(shown.err) == [
        'keepkv bench: note: no plot without matplotlib (pip install "keepkv[plot]" (from a checkout: '
        'pip install -e ".[plot]")); the table and the JSON hold every number'
    ]
    assert json.loads((tmp_path / "bench.json").read_text())["settings"]["methods"] == ["full", "h2o"]
    assert (tmp_path / "bench.txt").read_text().startswith("keepkv bench:")
    assert not (tmp_path / "bench.png").exists() and not (tmp_path / "extra.png").exists()


def test_eval_without_matplotlib_writes_the_results_and_says_how_to_get_plots(no_matplotlib, tmp_path, monkeypatch,
                                                                               capsys):
    model, tokenizer = tiny_model("llama-gqa", layers=2), char_tokenizer()
    monkeypatch.setattr("keepkv.models.load_model", lambda path=None, **options: (model, tokenizer))
    out = tmp_path / "run"
    assert keepkv_main([
        "eval", "--suite", "needle", "--methods", "streamingllm", "--budgets", "0.3", "--samples", "2",
        "--lengths", "140", "--max-new-tokens", "3", "--out", str(out), "--no-progress", "--sweep",
    ]) == 0
    shown = capsys.readouterr()
    assert "| streamingllm |" in shown.out
    assert notes(shown.err) == [
        'keepkv eval: note: no plot without matplotlib (pip install "keepkv[plot]" (from a checkout: '
        f'pip install -e ".[plot]")); the numbers are in {out / "summary.csv"}'
    ]
    assert f"plot: none  records: {out / 'cells'}" in shown.err
    rows = read_summary(out / "summary.csv")
    assert {row["method"] for row in rows} == {"full", "streamingllm"}
    assert (out / "config.json").is_file() and (out / "timing.json").is_file()
    assert len(list((out / "cells").glob("*.json"))) == len(rows)
    assert not list(out.glob("*.png"))
