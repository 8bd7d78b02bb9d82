"""``keepkv bench --cuda-suite``'s plumbing, on CPU with stand-in phases: one JSON and one log,
pytest counts from JUnit XML, a phase past the time budget stopped and the rest skipped."""

import json
import sys

import pytest

from keepkv.bench.core import build_parser, main
from keepkv.bench.cuda_suite import default_phases, run_suite


def test_suite_records_every_phase_and_stops_at_the_time_budget(tmp_path):
    tests = tmp_path / "test_standin.py"
    tests.write_text("def test_ok():\n    assert 1 + 1 == 2\n\ndef test_bad():\n    assert 1 + 1 == 3\n")
    result_json = tmp_path / "standin.json"
    phases = [
        {"name": "tests", "argv": [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests),
                                   "--rootdir", str(tmp_path),  # test ids relative to it, wherever pytest runs
                                   "--junitxml", str(tmp_path / "t.xml")], "junit": str(tmp_path / "t.xml")},
        {"name": "bench", "argv": [sys.executable, "-c", f"import json, os; json.dump({{'x': os.environ['SUITE_X']}}, "
                                                         f"open({str(result_json)!r}, 'w'))"],
         "json": str(result_json), "env": {"SUITE_X": "1"}},
    ]
    result = run_suite(str(tmp_path / "out"), time_budget=300, phases=phases, require_cuda=False)
    status = {p["name"]: p["status"] for p in result["phases"]}
    assert status == {"tests": "failed", "bench": "passed"}
    tests_phase = result["phases"][0]
    assert tests_phase["tests"]["passed"] == 1 and tests_phase["tests"]["failed"] == 1
    assert tests_phase["tests"]["failures"] == ["test_standin::test_bad"]
    assert result["phases"][1]["result"] == {"x": "1"} and result["phases"][1]["command"].startswith("SUITE_X=1 ")
    assert result["ok"] is False
    written = json.loads((tmp_path / "out" / "cuda.json").read_text())
    assert written["phases"] == result["phases"] and written["schema"] == "keepkv-cuda-suite/1"
    assert "1 failed, 1 passed" in (tmp_path / "out" / "cuda.log").read_text()


def test_a_phase_past_the_budget_is_stopped_and_the_rest_skipped(tmp_path):
    phases = [
        {"name": "slow", "argv": [sys.executable, "-c", "import time; time.sleep(60)"]},
        {"name": "after", "argv": [sys.executable, "-c", "print('never')"]},
    ]
    result = run_suite(str(tmp_path), time_budget=7, phases=phases, require_cuda=False)
    assert [p["status"] for p in result["phases"]] == ["timed_out", "skipped"]
    assert result["seconds"] < 30 and result["ok"] is False
    assert "never" not in (tmp_path / "cuda.log").read_text()


def test_default_phases_are_the_cuda_tests_then_the_gpu_bench(tmp_path):
    names = [p["name"] for p in default_phases(str(tmp_path))]
    assert names == ["tests", "ops", "bench", "memory_cap", "bench_kernel"]
    bench = " ".join(default_phases(str(tmp_path))[2]["argv"])
    assert "--config llama2-7b --dtype bfloat16" in bench and "--prompt-len 4096 --gen-len 256 --batch 8" in bench
    kernel = default_phases(str(tmp_path))[4]
    assert "--gen-len 128 --batch 8" in " ".join(kernel["argv"]) and "--kernel triton" in " ".join(kernel["argv"])
    tests = default_phases(str(tmp_path))[0]["argv"]
    assert tests[tests.index("-k") + 1] == "not gloo and not numba"  # CPU-only cases: the main suite's
    # every phase's command line parses as a keepkv bench / pytest invocation
    for phase in default_phases(str(tmp_path))[1:]:
        build_parser().parse_args(phase["argv"][3:])


def test_without_cuda_the_suite_refuses_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(build_parser().parse_args(["--cuda-suite"])) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize("budget", ["0", "-5", "nan", "inf", "ten"])
def test_a_bad_time_budget_is_refused_in_one_line_before_anything_runs(budget, capsys, tmp_path, monkeypatch):
    from keepkv.bench.cuda_suite import main as suite_main

    monkeypatch.setattr("keepkv.bench.cuda_suite.run_suite", lambda *a, **k: pytest.fail("the suite ran"))
    assert suite_main(["--out", str(tmp_path / "out"), "--time-budget", budget]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--time-budget" in err[0] and repr(budget) in err[0]
    assert not (tmp_path / "out").exists()
