"""``keepkv bench --cuda-suite`` (``.ci/cuda``): everything a CUDA machine should check, in one command.

Phases, in order, each a subprocess whose output goes to the log, each given what is left of
the time budget (default 420 s: a GPU session has 15 minutes of device time, and the machine's
start and a rerun must fit beside it). The sizes below fit that budget on one H200:

1. ``tests``: the CUDA tests from a checkout (``tests/test_cuda.py``: bf16 batch row = prompt
   alone for every method, bf16 compressed = masked full, Theorem 3 in fp32;
   ``tests/test_decode_kernel.py``: the Triton kernel natively against the torch path;
   ``tests/test_gpu_path_on_cpu.py`` and ``tests/test_sketch.py``: the fp32-output GEMM, the
   deterministic sketch; ``tests/test_tensor_parallel.py``: the TP=2 case, two ranks with NCCL,
   one GPU each, where the machine has two; ``tests/test_contract.py``'s reference logits of every
   method on CUDA as well as the CPU). The CPU-only cases among them (gloo ranks, the Numba
   kernel), which the main suite runs, are deselected. Counts from pytest's JUnit XML.
2. ``ops``: ``keepkv bench --ops`` on the device (operation and sync counts per layer-step; the
   operation counts should equal the CPU's, and a ``.cpu()`` is a real sync there).
3. ``bench``: KeepKV's Table 1 shape, ``llama2-7b`` with random weights, bf16, 4096-token
   prompts, batch 8, budget 0.2, full/h2o/keepkv, with ``--overhead``; 256 generated tokens, not
   the paper's 1024, to fit the budget (the JSON says so), and ``--profile 8``: the device time
   per op and step, which says whether the device or the host sets the step's time.
4. ``memory_cap``: the same under an 80 GB cap (``--memory-cap 80``), 128 generated tokens.
5. ``bench_kernel``: phase 3's shapes for h2o/keepkv with 128 generated tokens and
   ``--kernel triton`` (the scoring methods' decode attention through the Triton kernel).

A phase that runs out of time is stopped and recorded as timed out; the phases after it are
recorded as skipped. Output: ``OUT/cuda.json`` (below) and ``OUT/cuda.log`` (every phase's
output). Exit code 0 when every phase passed, 1 otherwise, 2 when there is no CUDA device.

JSON: ``schema`` ("keepkv-cuda-suite/1"), ``created``, ``versions`` (keepkv, torch, transformers,
triton, python, cuda), ``host`` (device name, memory bytes), ``time_budget_s``, ``seconds``, ``ok``,
``phases[]`` with ``name``, ``command``, ``status`` ("passed", "failed", "timed_out", "skipped"),
``seconds``, ``returncode`` and, by phase, ``tests`` (passed/failed/skipped/errors and the names
of failures) or ``result`` (the bench's own JSON).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import torch

CPU_ONLY_CASES = "not gloo and not numba"  # the main suite runs these on the CPU
CUDA_TESTS = ["tests/test_cuda.py", "tests/test_decode_kernel.py", "tests/test_paged_decode.py",
              "tests/test_gpu_path_on_cpu.py", "tests/test_sketch.py", "tests/test_tensor_parallel.py",
              "tests/test_contract.py::test_logits_equal_the_reference"]
BENCH = [
    "--config", "llama2-7b", "--dtype", "bfloat16", "--methods", "full,h2o,keepkv", "--budget", "0.2",
    "--prompt-len", "4096", "--gen-len", "256", "--batch", "8", "--repeats", "1", "--warmup", "1",
    "--overhead", "--overhead-steps", "16", "--profile", "8",
]
MEMORY_CAP = [
    "--config", "llama2-7b", "--dtype", "bfloat16", "--methods", "full,h2o,keepkv", "--budget", "0.2",
    "--prompt-len", "4096", "--gen-len", "128", "--repeats", "1", "--warmup", "1", "--memory-cap", "80",
]

KERNEL_BENCH = [
    "--config", "llama2-7b", "--dtype", "bfloat16", "--methods", "h2o,keepkv", "--budget", "0.2",
    "--prompt-len", "4096", "--gen-len", "128", "--batch", "8", "--repeats", "1", "--warmup", "1",
    "--kernel", "triton",
]


def default_phases(out: str) -> list[dict]:
    """The suite's phases: name, argv (after ``python -m``), and where its JSON lands."""
    bench = [sys.executable, "-m", "keepkv.bench", "--no-progress"]
    return [
        {"name": "tests", "argv": [sys.executable, "-m", "pytest", "-q", "-rfE", *CUDA_TESTS, "-k", CPU_ONLY_CASES,
                                   "--junitxml", os.path.join(out, "tests.xml")], "junit": os.path.join(out, "tests.xml")},
        {"name": "ops", "argv": [*bench, "--ops", "--json", os.path.join(out, "ops.json")], "json": os.path.join(out, "ops.json")},
        {"name": "bench", "argv": [*bench, *BENCH, "--json", os.path.join(out, "bench.json")],
         "json": os.path.join(out, "bench.json"), "note": "256 generated tokens, not the paper's 1024 (time budget)"},
        {"name": "memory_cap", "argv": [*bench, *MEMORY_CAP, "--json", os.path.join(out, "memory_cap.json")],
         "json": os.path.join(out, "memory_cap.json"), "note": "128 generated tokens, not the paper's 1024 (time budget)"},
        {"name": "bench_kernel", "argv": [*bench, *KERNEL_BENCH, "--json", os.path.join(out, "bench_kernel.json")],
         "json": os.path.join(out, "bench_kernel.json"), "note": "--kernel triton, h2o/keepkv, 128 generated tokens"},
    ]


def _versions() -> dict:
    from .setup import package_version, transformers_version

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "keepkv": package_version(), "torch": torch.__version__, "transformers": transformers_version(),
        "triton": triton_version, "python": platform.python_version(), "cuda": torch.version.cuda,
    }


def _junit_counts(path: str) -> dict:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in root.iter("testcase") if case.find("failure") is not None or case.find("error") is not None
    ]
    return {
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed": counts["failures"], "errors": counts["errors"], "skipped": counts["skipped"], "failures": failed,
    }


def run_phase(phase: dict, remaining: float, log) -> dict:
    """Run one phase with ``remaining`` seconds; its output goes to ``log``."""
    env = " ".join(f"{key}={value}" for key, value in phase.get("env", {}).items())
    record = {"name": phase["name"], "command": " ".join(filter(None, [env, *phase["argv"]])),
              **({"note": phase["note"]} if "note" in phase else {})}
    if remaining <= 5:
        return {**record, "status": "skipped", "seconds": 0.0, "returncode": None, "reason": "no time left"}
    log.write(f"\n===== {phase['name']}: {record['command']}\n")
    log.flush()
    began = time.perf_counter()
    try:
        env = {**os.environ, **phase.get("env", {})}
        returncode = subprocess.run(
            phase["argv"], stdout=log, stderr=subprocess.STDOUT, timeout=remaining, env=env
        ).returncode
        status = "passed" if returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        returncode, status = None, "timed_out"
    record.update(status=status, seconds=round(time.perf_counter() - began, 1), returncode=returncode)
    if phase.get("junit") and os.path.exists(phase["junit"]):
        record["tests"] = _junit_counts(phase["junit"])
        if record["tests"]["passed"] == 0 and status == "passed":
            record["status"] = "failed"  # nothing ran: no CUDA test is a failure of the suite
    if phase.get("json") and os.path.exists(phase["json"]):
        with open(phase["json"]) as handle:
            record["result"] = json.load(handle)
    log.write(f"===== {phase['name']}: {record['status']} in {record['seconds']} s\n")
    log.flush()
    return record


def run_suite(out: str, time_budget: float = 420.0, phases: list[dict] | None = None, require_cuda: bool = True) -> dict:
    """Run the phases, write ``out/cuda.json`` and ``out/cuda.log``; returns the JSON's dict."""
    if require_cuda and not torch.cuda.is_available():
        raise ValueError("the CUDA suite needs a CUDA device (torch.cuda.is_available() is False)")
    os.makedirs(out, exist_ok=True)
    phases = default_phases(out) if phases is None else phases
    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    result = {
        "schema": "keepkv-cuda-suite/1",
        "versions": _versions(),
        "host": {
            "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
            "memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None,
        },
        "time_budget_s": time_budget,
        "phases": [],
    }
    with open(os.path.join(out, "cuda.log"), "w") as log:
        log.write(json.dumps({"versions": result["versions"], "host": result["host"]}) + "\n")
        for phase in phases:
            remaining = time_budget - (time.perf_counter() - started)
            if any(p["status"] == "timed_out" for p in result["phases"]):
                remaining = 0.0  # recorded as skipped
            record = run_phase(phase, remaining, log)
            result["phases"].append(record)
            print(f"cuda suite: {record['name']}: {record['status']} ({record['seconds']} s)", file=sys.stderr)
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["ok"] = all(p["status"] == "passed" for p in result["phases"])
    result["created"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    with open(os.path.join(out, "cuda.json"), "w") as handle:
        handle.write(json.dumps(result, indent=2) + "\n")
    return result


def _seconds(text: str) -> float:
    """``--time-budget`` (``KEEPKV_CUDA_BUDGET`` in ``.ci/cuda``) as seconds; ValueError, in one line,
    unless it is a finite number above 0."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"--time-budget (KEEPKV_CUDA_BUDGET) must be a number of seconds above 0, got {text!r}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="keepkv bench --cuda-suite", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/cuda", help="folder of cuda.json and cuda.log (default: runs/cuda)")
    parser.add_argument("--time-budget", default="420", metavar="S", help="seconds for all phases (default 420)")
    args = parser.parse_args(argv)
    try:
        time_budget = _seconds(args.time_budget)  # before CUDA is asked for: a bad value is refused at once
        result = run_suite(args.out, time_budget)
    except ValueError as error:
        print(f"keepkv bench --cuda-suite: {error}", file=sys.stderr)
        return 2
    print(f"cuda suite: {'ok' if result['ok'] else 'FAILED'} in {result['seconds']} s; "
          f"{os.path.join(args.out, 'cuda.json')}, {os.path.join(args.out, 'cuda.log')}", file=sys.stderr)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
