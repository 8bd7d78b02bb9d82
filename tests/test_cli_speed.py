"""`keepkv --help` and every argument error come before torch loads the command line
checks what it can without torch, each refusal one line. (How long they take is measured, not
tested: docs/record/2026-11-27-cli-start.md.)"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# A command line, then the one line it is refused with (None: --help, exit 0).
REFUSED = [
    (["--help"], None),
    (["generate", "--help"], None),
    (["eval", "--help"], None),
    (["bench", "--help"], None),
    (["demo", "--help"], None),
    (["nonsense"], "invalid choice"),
    (["generate", "x", "--budget", "0"], "must be in [1, 2**48], got 0"),
    (["generate", "x", "--budget", "1.5"], "must be in (0, 1], got 1.5"),
    (["generate", "x", "--method", "snapk"], "unknown method 'snapk'"),
    (["generate", "x", "--dtype", "float64"], "dtype must be one of"),
    (["generate", "x", "--max-new-tokens", "-1"], "max_new_tokens must be an int >= 0"),
    (["generate", "x", "--model", "/nonexistent/model"], "no such file or directory"),
    (["perturbation", "--budget", "0"], "must be in [1, 2**48]"),
    (["demo", "--budgets", "2.0"], "must be in (0, 1]"),
    (["demo", "--methods", "snapk"], "unknown method 'snapk'"),
    (["eval", "--budgets", "1.5"], "must be in (0, 1]"),
    (["eval", "--methods", "snapk"], "unknown method 'snapk'"),
    (["eval", "--reference", "snapk"], "unknown method 'snapk'"),
    (["eval", "--data", "/nonexistent.jsonl"], "no such file or directory"),
    (["bench", "--budget", "0"], "must be in [1, 2**48]"),
    (["bench", "--methods", "full,snapk"], "unknown method 'snapk'"),
    (["bench", "--gen-len", "0"], "--gen-len must be an int >= 1"),
    (["train-scorer", "--help"], None),
    (["train-scorer", "/nonexistent/model"], "no such file or directory"),
    (["train-scorer", "--documents", "0"], "documents must be an int >= 1"),
    (["train-scorer", "--files", "/nonexistent.txt"], "--files '/nonexistent.txt'"),
    (["train-scorer", "--features", "keys"], "invalid choice"),
    (["train-scorer", "--out", "."], "is a directory"),
]

PROBE = """
import sys
from keepkv.cli import main
code = main(sys.argv[1:])
print("torch loaded" if "torch" in sys.modules else "no torch", code)
"""


@pytest.mark.parametrize("argv, message", REFUSED, ids=[" ".join(argv) for argv, _ in REFUSED])
def test_refused_in_one_line_before_torch_loads(argv, message):
    run = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, cwd=ROOT, timeout=120)
    if message is None:
        assert run.stdout.strip().startswith("usage: keepkv"), run.stderr
        assert run.stdout.strip().endswith("no torch 0")
        return
    assert run.stdout.strip() == "no torch 2", (run.stdout, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("keepkv: error:") and message in lines[0], run.stderr


def test_the_torch_free_lists_are_the_registries():
    from keepkv.bench.configs import CONFIGS
    from keepkv.bench.options import CONFIG_NAMES
    from keepkv.checks import DTYPE_NAMES, METHOD_NAMES
    from keepkv.methods import METHODS
    from keepkv.models import DTYPES

    assert list(METHOD_NAMES) == sorted(METHODS)
    assert list(CONFIG_NAMES) == sorted(CONFIGS)
    assert list(DTYPE_NAMES) == list(DTYPES)
    from keepkv.cli import SCORER_FEATURES
    from keepkv.scorer import FEATURES

    assert set(SCORER_FEATURES) == set(FEATURES)
