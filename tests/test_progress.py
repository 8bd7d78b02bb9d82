"""Warnings and progress that do not collide: every warning is its own line, long
commands show progress, and `keepkv bench` with no options is a quick run that names the grid."""

import warnings

import pytest

import keepkv
from keepkv import cli
from keepkv.bench.core import build_parser as bench_parser
from keepkv.bench.core import main as bench_main

from conftest import CharTokenizer, tiny_model


def visible_lines(stream: str) -> list[str]:
    """What a terminal shows of each line: the text after its last carriage return (tqdm redraws
    a bar in place with \\r; a message printed after a bar without a newline joins the bar's line)."""
    return [line.split("\r")[-1] for line in stream.split("\n")]


class TextTokenizer(CharTokenizer):
    """CharTokenizer that also takes one text (as HF tokenizers do)."""

    def __call__(self, texts, **kwargs):
        return super().__call__([texts] if isinstance(texts, str) else texts, **kwargs)


@pytest.fixture
def tiny_cli(monkeypatch):
    """The CLI on a tiny random model (its loader replaced): the real parser, warnings and bars."""
    model = tiny_model("llama-gqa", layers=2)
    monkeypatch.setattr(cli, "_load", lambda args: (model, TextTokenizer()))
    return model


def test_a_warning_is_its_own_line_beside_progress_bars(tiny_cli, capsys):
    # an entry budget of 1 (likely meant as 1.0) warns at the end of the prefill, while the
    # prefill's bar is on screen
    assert cli.main(["generate", "x" * 40, "--method", "h2o", "--budget", "1", "--max-new-tokens", "4", "--raw"]) == 0
    err = capsys.readouterr().err
    assert "h2o: prefill" in err  # the bars were drawn
    warned = [line for line in visible_lines(err) if "keepkv: warning:" in line]
    assert warned and all(line.startswith("keepkv: warning: budget=1 is an entry count") for line in warned), warned


def test_a_budget_below_the_protected_tokens_is_refused_before_the_model_loads(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_load", lambda args: pytest.fail("the model was loaded"))
    assert cli.main(["generate", "x" * 40, "--budget", "3"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("keepkv: error: budget 3 keeps 3 per layer and head, fewer than keepkv's 32 protected")


def test_perturbation_shows_progress(tiny_cli, capsys):
    assert cli.main(["perturbation", "y" * 48, "--method", "h2o", "--budget", "8"]) == 0
    captured = capsys.readouterr()
    assert "h2o: perturbation" in captured.err and "/130 [" in captured.err  # 2 x (prefill + 64 steps)
    assert "overall" in captured.out
    assert cli.main(["perturbation", "y" * 48, "--method", "h2o", "--budget", "8", "--json"]) == 0
    assert "perturbation" not in capsys.readouterr().err  # --json: the output alone


def test_bench_with_no_options_is_a_quick_run_that_names_the_full_grid(capsys, monkeypatch):
    """The defaults of `keepkv bench` (here on a 1-layer random shape with a short prompt): a few
    methods, one repetition, an overall bar with an ETA, and the command of the full grid. Its
    warm-up warns about nothing: the only KeepKVWarnings are the timed runs' own (on an idle host:
    a busy one adds its own warning, tests/test_edges.py)."""
    monkeypatch.setattr("os.getloadavg", lambda: (0.0, 0.0, 0.0))
    args = bench_parser().parse_args(["--config", "smollm2-135m", "--layers", "1", "--prompt-len", "48",
                                      "--budget", "4"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert bench_main(args) == 0
    captured = capsys.readouterr()
    methods = args.methods.split(",")
    assert len(methods) <= 4 and args.repeats == 1
    assert f"bench: 100%" in captured.err and f"{len(methods)}/{len(methods)}" in captured.err
    assert "the full grid: keepkv bench --methods all" in captured.out
    compressing = [m for m in methods if m != "full"]
    budget_warnings = [w for w in caught if issubclass(w.category, keepkv.KeepKVWarning)]
    assert len(budget_warnings) == len(compressing)  # one per timed run, none from the warm-up
    assert all("48-token prompt" in str(w.message) for w in budget_warnings)
    full_grid = bench_parser().parse_args(["--methods", "all"])
    from keepkv.bench.core import resolve_methods
    from keepkv.methods import METHODS

    assert resolve_methods(full_grid.methods) == ["full"] + sorted(set(METHODS) - {"full"})
