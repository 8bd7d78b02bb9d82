"""The eval runner on tiny random models: shared prefill == separate runs, outputs, resume, report."""

import argparse
import csv
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

import keepkv
from keepkv.eval import cli as eval_cli
from keepkv.eval import runner as runner_module
from keepkv.eval.decoding import greedy_decode, prefill
from keepkv.eval.runner import (
    DEFAULT_LENGTHS, DEFAULT_SAMPLES, DEFAULT_SUITES, QUICK_BUDGETS, QUICK_LENGTHS, QUICK_SAMPLES, SuiteSpec, make_samples, run_eval,
    _Tokens,
)
from keepkv.eval.summary import read_summary
from keepkv.generation import build_prompts, encode
from keepkv.budgets import budget_floor
from keepkv.methods import METHODS, get_method

from conftest import VOCAB, tiny_model

from keepkv.plotting import have_matplotlib

# Tests of the plot extra (keepkv[plot], matplotlib) skip where it is absent, as after `pip install -e ".[test]"`.
needs_plot = pytest.mark.skipif(not have_matplotlib(), reason="matplotlib (keepkv[plot]) is not installed")

CHARS = "\n" + "".join(chr(c) for c in range(32, 127))


def char_tokenizer():
    """A character-level tokenizer: <pad>=0, <eos>=1, <unk>=2, then printable ASCII and newline."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{ch: i + 3 for i, ch in enumerate(CHARS)}}
    assert len(vocab) <= VOCAB
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one thread is faster, and immune to a busy machine's OpenMP stalls."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama-gqa", layers=2)


def test_char_tokenizer_round_trip(tokenizer):
    text = "VAR ABC = 12345.\nThe sky is blue."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text


def test_greedy_decode_matches_generate(model, tokenizer):
    """The manual loop gives generate()'s tokens on a left-padded batch."""
    texts = ["The sky is blue. What colour?", "Here we go."]
    inputs = encode(tokenizer, texts, False, "cpu")
    keepkv.enable(model)
    cache = keepkv.CompressedCache(model.config, "h2o", 0.5)
    first = prefill(model, cache, inputs["input_ids"], inputs["attention_mask"])
    ours = greedy_decode(model, cache, first, inputs["attention_mask"], 6, None)
    reference = keepkv.CompressedCache(model.config, "h2o", 0.5)
    with torch.no_grad():
        output = model.generate(
            **inputs, past_key_values=reference, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0
        )
    assert torch.equal(ours, output[:, inputs["input_ids"].shape[1]:])


def test_shared_prefill_equals_separate_runs(model, tokenizer, tmp_path):
    """Every registered method, forked from one recorded prefill, predicts what it predicts alone."""
    methods = sorted(METHODS)
    budgets = [0.2, 0.5]
    rows = run_eval(
        model, tokenizer, suites=["needle"], methods=methods, budgets=budgets, samples=2, lengths=[160],
        out_dir=tmp_path, max_new_tokens=8, progress=False, plot=False, workers=1,
    )
    assert len(rows) == 1 + (len(methods) - 1) * len(budgets)
    samples = make_samples(SuiteSpec("needle"), 2, 160, 0, _Tokens(tokenizer), {})
    texts = [build_prompts(tokenizer, [s.prompt], True, s.answer_prefix)[0] for s in samples]
    inputs = encode(tokenizer, texts, True, "cpu")
    assert inputs["attention_mask"].min() == 0 or inputs["input_ids"].shape[0] == 2
    keepkv.enable(model)
    for method in methods:
        for budget in [1.0] if method == "full" else budgets:
            instance = keepkv.get_method(method)
            instance.prepare(model)  # as the runner does (KVReviver's Fisher layer scores)
            cache = keepkv.CompressedCache(model.config, instance, budget)
            first = prefill(model, cache, inputs["input_ids"], inputs["attention_mask"], tokenizer)
            alone = greedy_decode(model, cache, first, inputs["attention_mask"], 8, tokenizer.eos_token_id)
            cell = json.loads((tmp_path / "cells" / f"needle-160-{method}-{budget}.json").read_text())
            for row, record in enumerate(cell["records"]):
                ids = alone[row].tolist()
                ids = ids[: ids.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in ids else ids
                assert record["output_ids"] == ids, (method, budget, row)


@needs_plot
def test_end_to_end_outputs_and_resume(model, tokenizer, tmp_path):
    suites = ["needle", "tracking", "aggregation+variant=fwe", "ppl", "fidelity"]
    kwargs = dict(
        suites=suites, methods=["window", "h2o"], budgets=[0.2, 0.5], samples=3,
        lengths={"needle": 150, "tracking": 150, "aggregation": 150, "ppl": 96, "fidelity": 120},
        out_dir=tmp_path, max_new_tokens=6, progress=False, workers=1,
    )
    rows = run_eval(model, tokenizer, **kwargs)
    assert len(rows) == len(suites) * 5
    header = next(csv.reader((tmp_path / "summary.csv").open()))
    assert header[:11] == [
        "suite", "length", "method", "budget", "score", "ci95", "share_of_full", "cache_bytes",
        "full_cache_bytes", "n", "higher_is_better",
    ]
    assert (tmp_path / "scores.png").read_bytes()[:4] == b"\x89PNG"
    cells = sorted(p.name for p in (tmp_path / "cells").glob("*.json"))
    assert len(cells) == len(rows)
    assert "ppl-96-h2o-0.2.json" in cells and "aggregation+variant=fwe-150-full-1.0.json" in cells
    by_key = {(r["suite"], r["method"], r["budget"]): r for r in rows}
    for suite in ("needle", "tracking", "aggregation+variant=fwe", "ppl", "fidelity"):
        full = by_key[(suite, "full", 1.0)]
        assert full["n"] == 3 and full["ci95"] == full["ci95"]  # three samples, a finite interval
    assert by_key[("ppl", "full", 1.0)]["higher_is_better"] is False
    assert by_key[("ppl", "full", 1.0)]["score"] > 1.0
    fidelity_full = by_key[("fidelity", "full", 1.0)]
    assert fidelity_full["score"] == 1.0 and fidelity_full["kl"] == 0.0 and fidelity_full["agree_share"] == 1.0
    assert by_key[("fidelity", "window", 0.2)]["kl"] >= 0.0
    ppl = json.loads((tmp_path / "cells" / "ppl-96-window-0.2.json").read_text())
    assert ppl["records"][0]["budget_entries"] == round(0.2 * 96)
    assert ppl["records"][0]["kept_entries"] <= round(0.2 * 96)
    needle = json.loads((tmp_path / "cells" / "needle-150-h2o-0.5.json").read_text())
    assert len(needle["records"]) == 3 and "prediction" in needle["records"][0]
    assert needle["records"][0]["cache_bytes"] < needle["records"][0]["full_cache_bytes"]

    # Resume: a finished cell is not recomputed; a missing one is.
    stamps = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cells").glob("*.json")}
    (tmp_path / "cells" / "needle-150-h2o-0.5.json").unlink()
    again = run_eval(model, tokenizer, **kwargs)
    assert (tmp_path / "cells" / "needle-150-h2o-0.5.json").is_file()
    for path in (tmp_path / "cells").glob("*.json"):
        if path.name != "needle-150-h2o-0.5.json":
            assert path.stat().st_mtime_ns == stamps[path.name], path.name
    assert [r["score"] for r in again] == [r["score"] for r in rows]
    assert [r["cache_bytes"] for r in again] == [r["cache_bytes"] for r in rows]


def test_workers_and_joint_decoding_change_nothing(model, tokenizer, tmp_path):
    """Forked workers (samples split) and cells decoded alone give the one-process records.

    Only cache_bytes may differ (it splits a batch's padded tensors evenly over its rows), and
    floats by rounding (linear layers see other batch shapes); tokens are identical.
    """
    kwargs = dict(
        # Not SnapKV/PyramidKV: their max-pooled scores tie exactly, and topk breaks ties by slot
        # index, which left padding shifts; so their kept set may change with the batch.
        suites=["needle", "fidelity", "ppl"], methods=["streamingllm", "h2o", "window"], budgets=[0.3], samples=3,
        lengths={"needle": 150, "fidelity": 120, "ppl": 80}, max_new_tokens=5, progress=False, plot=False,
    )
    base = run_eval(model, tokenizer, out_dir=tmp_path / "a", workers=1, **kwargs)
    forked = run_eval(model, tokenizer, out_dir=tmp_path / "b", workers=2, **kwargs)
    alone = run_eval(model, tokenizer, out_dir=tmp_path / "c", workers=1, joint_cells=1, **kwargs)
    for other in (forked, alone):
        assert [(r["suite"], r["method"], r["budget"], r["kept_entries"]) for r in other] == [
            (r["suite"], r["method"], r["budget"], r["kept_entries"]) for r in base
        ]
        assert [r["score"] for r in other] == pytest.approx([r["score"] for r in base], rel=1e-4, abs=1e-6)
    for name in ("needle-150-h2o-0.3.json", "fidelity-120-window-0.3.json", "ppl-80-streamingllm-0.3.json"):
        records = [json.loads((tmp_path / run / "cells" / name).read_text())["records"] for run in "abc"]
        floats = ("cache_bytes", "score", "nll", "kl")
        strip = [[{k: v for k, v in r.items() if k not in floats} for r in rs] for rs in records]
        assert strip[0] == strip[1] == strip[2], name
        for field in ("score", "nll", "kl"):
            values = [[r.get(field, 0.0) for r in rs] for rs in records]
            assert values[1] == pytest.approx(values[0], rel=1e-4, abs=1e-6)
            assert values[2] == pytest.approx(values[0], rel=1e-4, abs=1e-6)


def test_method_variants_are_rows_of_their_own(model, tokenizer, tmp_path):
    """``h2o+interval=1`` is h2o under another name; ``h2o+interval=4`` runs with its parameters."""
    rows = run_eval(
        model, tokenizer, suites=["fidelity"], methods=["h2o", "h2o+interval=1", "h2o+interval=4"], budgets=[0.3],
        samples=2, lengths={"fidelity": 100}, out_dir=tmp_path, progress=False, plot=False,
    )
    by_method = {r["method"]: r for r in rows}
    assert set(by_method) == {"full", "h2o", "h2o+interval=1", "h2o+interval=4"}
    assert by_method["h2o+interval=1"]["score"] == by_method["h2o"]["score"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["method_params"]["h2o+interval=4"]["interval"] == 4


@needs_plot
def test_cli_run_and_report(model, tokenizer, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("keepkv.models.load_model", lambda path=None, **options: (model, tokenizer))
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--json", action="store_true")
    eval_cli.add_arguments(parser)
    out = tmp_path / "run"
    args = parser.parse_args([
        "--suite", "needle", "--suite", "fidelity", "--methods", "streamingllm", "--budgets", "0.3",
        "--samples", "3", "--lengths", "140", "--max-new-tokens", "5", "--out", str(out), "--no-progress",
    ])
    assert args.seed == 0
    eval_cli.run(args)
    printed = capsys.readouterr().out
    assert "| method |" in printed and "| full |" in printed and "streamingllm" in printed
    for name in ("summary.csv", "scores.png", "config.json"):
        assert (out / name).is_file()

    report_parser = argparse.ArgumentParser()
    eval_cli.add_report_arguments(report_parser)
    markdown = tmp_path / "table.md"
    eval_cli.report(report_parser.parse_args([str(out), "--out", str(markdown)]))
    table = capsys.readouterr().out
    assert table.strip() == markdown.read_text().strip()
    lines = [line for line in table.splitlines() if line.startswith("|")]
    assert lines[0].startswith("| method | needle 140 @0.3 ↑ | fidelity 140 @0.3 ↑ |")
    assert any(line.startswith("| full | 1.00") or line.startswith("| full |") for line in lines)
    assert any(line.startswith("| streamingllm |") and "%" in line for line in lines)


def test_report_from_handwritten_csv(tmp_path, capsys):
    path = tmp_path / "summary.csv"
    path.write_text(
        "suite,length,method,budget,score,ci95,share_of_full,cache_bytes,full_cache_bytes,n,higher_is_better\n"
        "needle,1024,full,1.0,0.8,0.1,1,1000,1000,4,true\n"
        "needle,1024,h2o,0.1,0.4,0.2,0.5,100,1000,4,true\n"
        "ppl,384,full,1.0,10,1,1,1000,1000,4,false\n"
        "ppl,384,h2o,0.1,20,2,0.5,100,1000,4,false\n"
    )
    rows = read_summary(path)
    assert rows[1]["budget"] == 0.1 and rows[2]["higher_is_better"] is False
    parser = argparse.ArgumentParser()
    eval_cli.add_report_arguments(parser)
    eval_cli.report(parser.parse_args([str(path)]))
    table = capsys.readouterr().out.splitlines()
    assert table[0] == "| method | needle 1024 @0.1 ↑ | ppl 384 @0.1 ↓ |"
    assert table[2] == "| full | 0.80 ± 0.10 | 10.0 ± 1.00 |"
    assert table[3] == "| h2o | 0.40 ± 0.20 (50%) | 20.0 ± 2.00 (50%) |"
    assert "| h2o | 10% | 10% |" in table


def test_paired_differences_end_to_end(model, tokenizer, tmp_path, capsys):
    """A budget that fits every prompt leaves every method equal to the full cache: 0 ± 0;
    a method paired with itself differs by 0; ``report --reference`` re-pairs from the cells."""
    rows = run_eval(
        model, tokenizer, suites=["needle"], methods=["window", "h2o"], budgets=[1.0, 0.2], samples=3,
        lengths={"needle": 140}, out_dir=tmp_path, max_new_tokens=5, progress=False, plot=False, workers=1,
        reference="h2o",
    )
    by_key = {(r["method"], r["budget"]): r for r in rows}
    for method in ("window", "h2o"):
        fitting = by_key[(method, 1.0)]
        assert (fitting["diff_full"], fitting["diff_full_ci95"], fitting["diff_full_p"]) == (0.0, 0.0, 1.0)
        assert by_key[("h2o", 1.0)]["diff_ref"] == 0.0 and by_key[("h2o", 0.2)]["diff_ref_ci95"] == 0.0
    assert "diff_full" not in by_key[("full", 1.0)]
    squeezed = by_key[("window", 0.2)]
    assert squeezed["diff_full"] == pytest.approx(squeezed["score"] - by_key[("full", 1.0)]["score"])
    assert squeezed["diff_ref"] == pytest.approx(squeezed["score"] - by_key[("h2o", 0.2)]["score"])
    stored = read_summary(tmp_path)
    assert stored[1]["reference"] == "h2o" and "diff_ref_ci95" in stored[1]

    parser = argparse.ArgumentParser()
    eval_cli.add_report_arguments(parser)
    eval_cli.report(parser.parse_args([str(tmp_path), "--reference", "window"]))
    table = capsys.readouterr().out
    assert "Paired difference from the full cache" in table and "Paired difference from window" in table
    assert "Paired difference from h2o" not in table
    assert "| window | +0.000 ± 0.000 p=1 |" in table  # window vs window at 1.0, then at 0.2
    with pytest.raises(ValueError, match="its methods: full, h2o, window"):
        eval_cli.report(parser.parse_args([str(tmp_path), "--reference", "snapkv"]))
    with pytest.raises(ValueError, match="not among the methods run"):
        run_eval(model, tokenizer, suites=["needle"], methods=["window"], out_dir=tmp_path, reference="h2o")


@pytest.mark.parametrize("source", ["pydoc", "stdlib"])
def test_kl_suite_pairs_every_cell_with_the_full_cache(model, tokenizer, tmp_path, source):
    """KL(full || full) is 0; a compressed cell's KL is >= 0, its NLL change is its NLL minus the
    full cache's on the same sample, and cells decoded in chunks give the same numbers."""
    kwargs = dict(
        suites=[f"kl+source={source}"], methods=["window", "h2o"], budgets=[0.2], samples=2,
        lengths={"kl": 100}, progress=False, plot=False, workers=1,
    )
    rows = run_eval(model, tokenizer, out_dir=tmp_path / "joint", **kwargs)
    alone = run_eval(model, tokenizer, out_dir=tmp_path / "alone", joint_cells=1, **kwargs)
    full, window, h2o = rows
    assert full["score"] == 0.0 and full["nll_delta"] == 0.0 and full["higher_is_better"] is False
    cells = tmp_path / "joint" / "cells"
    full_records = json.loads((cells / f"kl+source={source}-100-full-1.0.json").read_text())["records"]
    for row in (window, h2o):
        assert row["score"] > 0.0 and row["diff_full"] == pytest.approx(row["score"])
        records = json.loads((cells / f"kl+source={source}-100-{row['method']}-0.2.json").read_text())["records"]
        for record, reference in zip(records, full_records):
            assert record["tokens_scored"] == 128 and record["prompt_tokens"] == 100
            assert record["nll_delta"] == pytest.approx(record["nll"] - reference["nll"], abs=1e-5)
            # budget 0.2 of 100 tokens is 20 entries, under the budget floor (protected + 32)
            assert record["kept_entries"] <= budget_floor(get_method(row["method"]))
    assert [r["score"] for r in alone] == pytest.approx([r["score"] for r in rows], rel=1e-4, abs=1e-6)
    table = eval_cli.format_table(rows)
    assert f"| window | KL {window['kl']:.3f}, ΔNLL {window['nll_delta']:+.3f} |" in table
    assert "prefix" not in table  # the fidelity detail belongs to fidelity


def test_report_marks_resolved_paired_differences(tmp_path, capsys):
    path = tmp_path / "summary.csv"
    path.write_text(
        "suite,length,method,budget,score,ci95,share_of_full,cache_bytes,full_cache_bytes,n,higher_is_better,"
        "diff_full,diff_full_ci95,diff_full_p\n"
        "needle,1024,full,1.0,1.0,0,1,1000,1000,8,true,,,\n"
        "needle,1024,h2o,0.1,0.5,0.4,0.5,100,1000,8,true,-0.5,0.43,0.031\n"
        "needle,1024,snapkv,0.1,0.9,0.2,0.9,100,1000,8,true,-0.1,0.2,1\n"
    )
    parser = argparse.ArgumentParser()
    eval_cli.add_report_arguments(parser)
    eval_cli.report(parser.parse_args([str(path)]))
    table = capsys.readouterr().out.splitlines()
    assert "| h2o | **-0.500 ± 0.430** p=0.031 |" in table
    assert "| snapkv | -0.100 ± 0.200 p=1 |" in table


def test_suite_spec_and_cli_parsing():
    spec = SuiteSpec.parse("needle+variant=multikey+num_needles=3")
    assert spec.label == "needle+variant=multikey+num_needles=3" and dict(spec.variant)["num_needles"] == 3
    with pytest.raises(ValueError, match="unknown suite"):
        SuiteSpec.parse("haystack")
    parser = argparse.ArgumentParser()
    eval_cli.add_arguments(parser)
    args = parser.parse_args(["--seed", "dev", "--lengths", "512", "needle=1536", "--budgets", "0.1", "128"])
    assert args.seed == 1000 and args.budgets == [0.1, 128]
    lengths = eval_cli._lengths(args.lengths)
    assert lengths["needle"] == [1536] and lengths["ppl"] == [512]
    defaults = eval_cli.run_sizes(parser.parse_args([]))
    assert defaults == {"budgets": [0.1, 0.2], "samples": DEFAULT_SAMPLES, "lengths": None, "out_dir": "runs/eval"}
    quick = eval_cli.run_sizes(parser.parse_args(["--quick"]))
    assert quick["budgets"] == list(QUICK_BUDGETS) and quick["samples"] == QUICK_SAMPLES
    assert quick["out_dir"] == "runs/eval-quick" and quick["lengths"]["needle"] == QUICK_LENGTHS["needle"]
    assert quick["lengths"]["fidelity"] == DEFAULT_LENGTHS["fidelity"]
    explicit = eval_cli.run_sizes(parser.parse_args(["--quick", "--samples", "3", "--out", "x", "--lengths", "300"]))
    assert (explicit["samples"], explicit["out_dir"], explicit["lengths"]) == (3, "x", [300])


def test_local_datasets(model, tokenizer, tmp_path):
    """longbench (per-task metrics) and jsonl (F1 score, EM and ROUGE-L extras) on the fixtures."""
    fixtures = Path(__file__).parent / "fixtures"
    rows = run_eval(
        model, tokenizer, suites=["longbench", "jsonl"], methods=["window"], budgets=[0.5], samples=2,
        lengths=[260], out_dir=tmp_path, max_new_tokens=4, progress=False, plot=False, workers=1,
        data={"longbench": fixtures / "longbench", "jsonl": fixtures / "qa.jsonl"},
    )
    assert [(r["suite"], r["method"]) for r in rows] == [
        ("longbench", "full"), ("longbench", "window"), ("jsonl", "full"), ("jsonl", "window"),
    ]
    longbench = json.loads((tmp_path / "cells" / "longbench-260-full-1.0.json").read_text())
    assert {r["meta"]["task"] for r in longbench["records"]} == {"hotpotqa", "trec"}
    assert all(r["prompt_tokens"] <= 260 for r in longbench["records"]), [r["prompt_tokens"] for r in longbench["records"]]
    jsonl = json.loads((tmp_path / "cells" / "jsonl-260-window-0.5.json").read_text())
    assert {"em", "f1", "rouge_l"} <= set(jsonl["records"][0])
    assert "em" in rows[2] and "f1" in rows[2]
    with pytest.raises(ValueError, match="needs a directory"):
        run_eval(model, tokenizer, suites=["longbench"], methods=[], out_dir=tmp_path / "x", progress=False)


def test_report_states_the_resolution_of_every_group():
    def cell(scores):
        return [{"id": f"s{i}", "score": score} for i, score in enumerate(scores)]

    groups = {
        ("needle", 1024): {
            ("full", 1.0): cell([1, 1, 1, 1]),
            ("a", 0.1): cell([1, 0, 1, 1]),
            ("b", 0.1): cell([1, 0, 1, 1]),
        },
        ("kl+source=pydoc", 1024): {("a", 0.1): cell([0.2, 0.4, 0.3]), ("b", 0.1): cell([0.1, 0.3, 0.2])},
        ("kl+source=stdlib", 1024): {("a", 0.1): cell([0.2, 0.4, 0.3])},  # one method: nothing to pair
    }
    text = eval_cli.format_resolution(groups)
    rows = [line for line in text.splitlines() if line.startswith("| needle") or line.startswith("| kl")]
    # needle: a and b solve the same samples: half-width 0, close (equal means), not resolved.
    assert rows[0] == "| needle 1024 | 0.1 | 1 | 0.000 | 0.000 | 0.000 (a vs b) | 1/1 below 0.150 | 0/1 |"
    # kl: every difference is 0.1, so the half-width is 0 (no blanket target for KL); means 0.3 and
    # 0.2 are not within 1.25x (no close pair); the difference is resolved.
    assert rows[0] == "| needle 1024 | 0.1 | 1 | 0.000 | 0.000 | 0.000 (a vs b) | 1/1 below 0.150 | 0/1 |"
    assert rows[1] == "| kl+source=pydoc 1024 | 0.1 | 1 | 0% | – | 0% (a vs b) | – | 1/1 |"
    # Both kl suites pooled: b has pydoc samples only, so the pairs are pydoc's (ids kept apart by suite).
    assert rows[2] == "| kl (pooled: 2 suites) 1024 | 0.1 | 1 | 0% | – | 0% (a vs b) | – | 1/1 |"
    assert len(rows) == 3
    assert "Close pairs of continuous" not in text and "Against" not in text
    # c (mean 0.22) is close to b (0.2), not to a (0.3): b − c = -0.02, -0.03, -0.01, so -0.020 with
    # sd 0.01 and half-width t(2) 4.303 x 0.01 / sqrt(3) = 0.0248, 12% of the pair's mean 0.21.
    groups[("kl+source=pydoc", 1024)][("c", 0.1)] = cell([0.12, 0.33, 0.21])
    text = eval_cli.format_resolution(groups, reference="b")
    pairs = [line for line in text.splitlines() if " − " in line and line.startswith("| kl")]
    assert pairs == ["| kl+source=pydoc 1024 | 0.1 | b − c | -0.020 ± 0.025 | 12% |"]
    # Against b, relative to b's mean 0.2: a +0.1 on every sample (+50%, resolved), c +10% ± 12.4%.
    against = [line for line in text.splitlines() if line.startswith("| a |") or line.startswith("| c |")]
    assert against == ["| a | **+50.0% ± 0.0%** |", "| c | +10.0% ± 12.4% |"]
    assert eval_cli.format_resolution({("needle", 1024): {("a", 0.1): cell([1])}}) == ""


def test_question_agnostic_cells_answer_what_compress_once_ask_answers(model, tokenizer, tmp_path, monkeypatch):
    """``+setting=agnostic``: each cell's answer is keepkv.compress(context) then the question on the
    compressed cache; the full cache answers as in the question-aware setting."""
    # generate() stops where the runner does (the tiny config's own eos id is another token).
    monkeypatch.setattr(model.generation_config, "eos_token_id", tokenizer.eos_token_id)
    methods = ["h2o", "snapkv", "keepkv", "streamingllm", "kvreviver"]
    rows = run_eval(
        model, tokenizer, suites=["needle", "needle+setting=agnostic"], methods=methods, budgets=[0.3], samples=3,
        lengths=[160], out_dir=tmp_path, max_new_tokens=6, progress=False, plot=False, workers=1, batch_size=1,
    )
    assert {r["suite"] for r in rows} == {"needle", "needle+setting=agnostic"}
    samples = make_samples(SuiteSpec.parse("needle+setting=agnostic"), 3, 160, 0, _Tokens(tokenizer), {})
    cells = tmp_path / "cells"
    aware = json.loads((cells / "needle-160-full-1.0.json").read_text())["records"]
    agnostic = json.loads((cells / "needle+setting=agnostic-160-full-1.0.json").read_text())["records"]
    by_id = {r["id"]: r for r in aware}
    assert sorted(by_id) == sorted(r["id"] for r in agnostic)
    for record in agnostic:  # batches go by question length: the order may differ
        assert record["output_ids"] == by_id[record["id"]]["output_ids"]
        assert record["prompt_tokens"] == by_id[record["id"]]["prompt_tokens"]
    for method in methods:
        records = json.loads((cells / f"needle+setting=agnostic-160-{method}-0.3.json").read_text())["records"]
        by_id = {r["id"]: r for r in records}
        for sample in samples:
            record = by_id[sample.id]
            cache = keepkv.compress(model, tokenizer, sample.context, method=method, budget=0.3)
            [answer] = keepkv.generate(
                model, tokenizer, sample.question, answer_prefix=sample.answer_prefix,
                max_new_tokens=max(1, len(record["output_ids"])), past_key_values=cache,
            )
            assert answer.answer == record["prediction"], (method, sample.id)
    # keepkv runs on kvzip's selection where the context is compressed before the question
    selection = {suite: json.loads((cells / f"{suite}-160-keepkv-0.3.json").read_text())["params"]["selection"]
                 for suite in ("needle", "needle+setting=agnostic")}
    assert selection == {"needle": "snapkv", "needle+setting=agnostic": "kvzip"}
    assert json.loads((tmp_path / "config.json").read_text())["compress_once_params"]["keepkv"]["selection"] == "kvzip"


def test_the_setting_is_a_suite_variant():
    assert SuiteSpec.parse("needle+setting=agnostic").setting == "agnostic"
    assert SuiteSpec.parse("needle+setting=aware") == SuiteSpec.parse("needle")
    assert SuiteSpec.parse("passkey").with_setting("agnostic").label == "passkey+setting=agnostic"
    assert SuiteSpec.parse("needle+haystack=prose+setting=agnostic").generator_variant == {"haystack": "prose"}
    for bad in ("kl+setting=agnostic", "ppl+setting=agnostic", "needle+setting=blind"):
        with pytest.raises(ValueError):
            SuiteSpec.parse(bad)


def _cli_args(*argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--json", action="store_true")
    eval_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_setting_flag_doubles_only_the_suites_with_a_question():
    suites = ["needle", "passkey+setting=agnostic", "kl+source=pydoc"]
    assert eval_cli.apply_setting(suites, None) == suites
    assert eval_cli.apply_setting(suites, "aware") == ["needle", "passkey", "kl+source=pydoc"]
    assert eval_cli.apply_setting(suites, "both") == [
        "needle", "needle+setting=agnostic", "passkey", "passkey+setting=agnostic", "kl+source=pydoc",
    ]
    assert "needle+setting=agnostic" in DEFAULT_SUITES and "passkey+setting=agnostic" in DEFAULT_SUITES


def test_ruler_preset_and_sweep_sizes():
    from keepkv.eval.runner import RULER_AVERAGE, RULER_LENGTHS, RULER_SUITES, SWEEP_BUDGETS

    args = _cli_args("--suite", "ruler", "--sweep")
    sizes = eval_cli.run_sizes(args)
    suites, averages = eval_cli.expand_presets(args.suite, sizes, args)
    assert suites == list(RULER_SUITES) and averages == {RULER_AVERAGE: list(RULER_SUITES)}
    assert sizes["budgets"] == list(SWEEP_BUDGETS) == [0.9, 0.75, 0.5, 0.25, 0.125, 0.1]
    assert all(sizes["lengths"][suite] == RULER_LENGTHS[suite] for suite in RULER_SUITES)
    args = _cli_args("--suite", "ruler", "--sweep", "--budgets", "0.3", "--samples", "2")
    sizes = eval_cli.run_sizes(args)
    eval_cli.expand_presets(args.suite, sizes, args)
    assert sizes["budgets"] == [0.3] and sizes["samples"] == 2


def test_average_rows_take_the_unweighted_mean_of_the_tasks():
    from keepkv.eval.summary import average_rows

    rows = [
        {"suite": "a", "length": 512, "method": "full", "budget": 1.0, "score": 1.0},
        {"suite": "b", "length": 1024, "method": "full", "budget": 1.0, "score": 0.8},
        {"suite": "a", "length": 512, "method": "h2o", "budget": 0.5, "score": 0.5},
        {"suite": "b", "length": 1024, "method": "h2o", "budget": 0.5, "score": 0.2},
        {"suite": "a", "length": 512, "method": "h2o", "budget": 0.25, "score": 0.1},  # b lacks 0.25
        {"suite": "c", "length": 512, "method": "h2o", "budget": 0.5, "score": 0.0},
    ]
    out = {(r["method"], r["budget"]): r for r in average_rows(rows, "avg", ["a", "b"])}
    assert set(out) == {("full", 1.0), ("h2o", 0.5)}
    assert out[("full", 1.0)]["score"] == pytest.approx(0.9) and out[("h2o", 0.5)]["score"] == pytest.approx(0.35)
    assert out[("h2o", 0.5)]["share_of_full"] == pytest.approx(0.35 / 0.9)
    assert out[("h2o", 0.5)]["length"] == 1024 and out[("h2o", 0.5)]["n"] == 2


@needs_plot
def test_sweep_runs_every_budget_and_draws_score_against_ratio(model, tokenizer, tmp_path, monkeypatch, capsys):
    from keepkv.eval.plot import sweep_points

    monkeypatch.setattr("keepkv.models.load_model", lambda path=None, **options: (model, tokenizer))
    out = tmp_path / "sweep"
    rows = eval_cli.run(_cli_args(
        "--suite", "needle", "passkey", "--methods", "h2o", "--sweep", "--samples", "2", "--lengths", "150",
        "--max-new-tokens", "3", "--out", str(out), "--no-progress", "--workers", "1",
    ))
    assert sorted({r["budget"] for r in rows if r["method"] == "h2o"}) == [0.1, 0.125, 0.25, 0.5, 0.75, 0.9]
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    points = sweep_points(rows)[("aware", "higher")]
    assert [ratio for ratio, _ in points["h2o"]] == [0.1, 0.25, 0.5, 0.75, 0.875, 0.9]
    by_budget = {}
    for row in rows:
        if row["method"] == "h2o":
            by_budget.setdefault(row["budget"], []).append(row["score"])
    for ratio, score in points["h2o"]:
        assert score == pytest.approx(sum(by_budget[round(1 - ratio, 6)]) / 2)
    assert points["full"] == [(0.0, pytest.approx(sum(r["score"] for r in rows if r["method"] == "full") / 2))]
    agnostic = [{**r, "suite": r["suite"] + "+setting=agnostic"} for r in rows if r["suite"] == "needle"]
    panels = sweep_points(rows + agnostic)
    assert set(panels) == {("aware", "higher"), ("agnostic", "higher")}  # settings are never averaged together
    assert panels[("aware", "higher")] == sweep_points(rows)[("aware", "higher")]


def test_a_length_the_model_cannot_hold_is_refused_before_any_work(model, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="needle at 5000 tokens"):
        run_eval(model, tokenizer, suites=["needle"], methods=["h2o"], lengths=[5000], out_dir=tmp_path,
                 progress=False)
    assert not (tmp_path / "cells").exists()
    from transformers import MistralConfig, MistralForCausalLM

    sliding = MistralForCausalLM(MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=64,
    )).eval()
    with pytest.raises(ValueError, match="needle at 160 tokens: keepkv does not support sliding-window"):
        run_eval(sliding, tokenizer, suites=["needle"], methods=["h2o"], lengths=[160], out_dir=tmp_path,
                 progress=False)


def test_ruler_preset_end_to_end_has_an_average_per_setting(model, tokenizer, tmp_path, monkeypatch, capsys):
    from keepkv.eval.runner import RULER_AVERAGE, RULER_SUITES

    monkeypatch.setattr("keepkv.models.load_model", lambda path=None, **options: (model, tokenizer))
    rows = eval_cli.run(_cli_args(
        "--suite", "ruler", "--methods", "h2o", "--budgets", "0.3", "--samples", "1", "--lengths", "200",
        "--max-new-tokens", "2", "--out", str(tmp_path), "--no-progress", "--workers", "1",
    ))
    suites = {row["suite"] for row in rows}
    agnostic = {SuiteSpec.parse(s).with_setting("agnostic").label for s in RULER_SUITES}
    assert suites == set(RULER_SUITES) | agnostic | {RULER_AVERAGE, RULER_AVERAGE + "+setting=agnostic"}
    for name, members in ((RULER_AVERAGE, RULER_SUITES), (RULER_AVERAGE + "+setting=agnostic", agnostic)):
        for method, budget in (("full", 1.0), ("h2o", 0.3)):
            [average] = [r for r in rows if r["suite"] == name and r["method"] == method]
            scores = [r["score"] for r in rows if r["suite"] in members and r["method"] == method]
            assert average["score"] == pytest.approx(sum(scores) / len(scores), abs=1e-6)
            assert average["n"] == len(RULER_SUITES) and average["budget"] == budget
    assert "ruler-average 200 @0.3" in capsys.readouterr().out


def test_summary_round_trips_missing_values_as_none(tmp_path):
    """An average row has no CI or cache bytes: written as empty, read back as None (a file from
    before, with the text "None", reads the same), so ``keepkv report`` renders it."""
    from keepkv.eval.summary import write_summary

    row = {"suite": "ruler-average", "length": 1024, "method": "keepkv", "budget": 0.2, "score": 0.6,
           "ci95": None, "cache_bytes": None, "n": 5, "higher_is_better": True}
    write_summary([row], tmp_path / "summary.csv")
    (back,) = read_summary(tmp_path)
    assert back["ci95"] is None and back["cache_bytes"] is None and back["score"] == 0.6
    (tmp_path / "old.csv").write_text((tmp_path / "summary.csv").read_text().replace(",,", ",None,"))
    (old,) = read_summary(tmp_path / "old.csv")
    assert old["ci95"] is None


@pytest.mark.parametrize("argv, message", [
    (["--budgets", "2", "--quick"], r"at budget 2: .* too small for .*kvreviver"),
    (["--budgets", "8", "--methods", "snapkv"], r"snapkv at budget 8: budget 8 .* fewer than snapkv's 32 protected"),
    (["--methods", "snapkv+nonsense=1"], r"unknown parameter"),
    (["--suite", "needle+variant=nonsense"], r"variant"),
    (["--reference", "h2o", "--methods", "snapkv"], r"--reference h2o is not among the methods run"),
    (["--data", "jsonl=/nonexistent/file.jsonl"], r"no such file"),
])
def test_eval_checks_everything_before_the_model_loads(monkeypatch, tmp_path, argv, message):
    """What eval cannot run is refused in one line before the model loads, nothing written (a budget
    out of range is refused earlier still, as the arguments are parsed: tests/test_cli_speed.py)."""
    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded before the arguments were checked")

    monkeypatch.setattr("keepkv.models.load_model", no_model)
    with pytest.raises(ValueError, match=message) as error:
        eval_cli.run(_cli_args(*argv, "--out", str(tmp_path / "run")))
    assert "\n" not in str(error.value)
    assert not (tmp_path / "run").exists()  # nothing written, nothing lost


def test_a_stopped_run_keeps_its_finished_cells_and_resumes(model, tokenizer, tmp_path, monkeypatch):
    """Each suite and length writes its cells as it ends: a run stopped in the second keeps the first's,
    a rerun without --resume is refused (nothing overwritten), and --resume computes only the rest."""
    monkeypatch.setattr("keepkv.models.load_model", lambda path=None, **options: (model, tokenizer))
    out = tmp_path / "run"
    argv = ["--suite", "needle", "fidelity", "--methods", "window", "--budgets", "0.3", "--samples", "2",
            "--lengths", "120", "--max-new-tokens", "4", "--out", str(out), "--no-progress", "--workers", "1"]
    groups = []
    real_run = runner_module._SuiteAtLength.run

    def stop_in_the_second(group, bar):
        groups.append(group.spec.label)
        if len(groups) == 2:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the run
        return real_run(group, bar)

    monkeypatch.setattr(runner_module._SuiteAtLength, "run", stop_in_the_second)
    with pytest.raises(KeyboardInterrupt):
        eval_cli.run(_cli_args(*argv))
    kept = sorted(path.name for path in (out / "cells").glob("*.json"))
    assert kept == ["needle-120-full-1.0.json", "needle-120-window-0.3.json"]
    stamps = {name: (out / "cells" / name).stat().st_mtime_ns for name in kept}
    monkeypatch.setattr(runner_module._SuiteAtLength, "run", real_run)
    with pytest.raises(ValueError, match="holds the cells of an earlier run: pass --resume"):
        eval_cli.run(_cli_args(*argv))
    computed, real_write = [], runner_module._SuiteAtLength.write
    monkeypatch.setattr(runner_module._SuiteAtLength, "write", lambda group, cell: (computed.append(cell.path.name),
                                                                           real_write(group, cell)))
    rows = eval_cli.run(_cli_args(*argv, "--resume"))
    assert sorted(computed) == ["fidelity-120-full-1.0.json", "fidelity-120-window-0.3.json"]
    assert {name: (out / "cells" / name).stat().st_mtime_ns for name in kept} == stamps
    assert len(rows) == 4


@settings(max_examples=50, deadline=None)
@given(methods=st.lists(st.text(alphabet="ab/%+=.", min_size=1, max_size=8), min_size=2, max_size=4, unique=True))
def test_a_cell_is_one_file_in_cells_whatever_its_methods_spec(methods):
    """A spec with a path in a parameter (``scorer=dir/file.pt``) still names one file directly in
    ``cells/`` (where ``keepkv report`` reads them), and distinct specs never share a file."""
    out = Path("/nonexistent-run")
    paths = [runner_module.cell_path(out, "needle", 1024, f"snapkv+scorer={method}", 0.1) for method in methods]
    assert all(path.parent == out / "cells" for path in paths)
    assert len(set(paths)) == len(paths)


def test_report_reads_the_cell_of_a_spec_with_a_path(tmp_path):
    from keepkv.eval.summary import load_cells

    spec = "snapkv+selection=learned+scorer=/tmp/scorers/mine.pt"
    path = runner_module.cell_path(tmp_path, "needle", 1024, spec, 0.1)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"suite": "needle", "length": 1024, "method": spec, "budget": 0.1, "records": [{"score": 1.0}]}))
    assert load_cells(tmp_path) == {("needle", 1024): {(spec, 0.1): [{"score": 1.0}]}}
