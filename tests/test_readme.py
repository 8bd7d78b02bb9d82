"""Every code block of README.md runs as written.

```python blocks are executed (integration-marked when they load the embedded model). Every
`keepkv ...` command of a shell block is parsed by the real CLI parser, so a renamed or
removed flag fails here, and the cheap ones (CHEAP) run. Blocks are found when the tests are
collected, so a new README section is covered without touching this file.
"""

import re
import shlex
from pathlib import Path

import pytest

from keepkv.cli import _check_method, build_parser, main
from keepkv.methods import get_method

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
SHELL = {"bash", "sh", "shell", "console"}
# Subcommands that finish in seconds to a minute on the embedded model; the others (demo runs every
# method, eval and bench run for minutes to hours) are parsed and checked, not run.
CHEAP = {"methods", "generate", "report"}


def blocks(language: set[str]) -> list:
    """pytest params (code, id) of the README's fenced blocks in ``language``."""
    text = README.read_text()
    found = []
    for match in BLOCK.finditer(text):
        if match.group(1) in language:
            line = text.count("\n", 0, match.start()) + 1
            found.append((match.group(2), f"README.md:{line}"))
    return found


def keepkv_commands(script: str) -> list[list[str]]:
    """argv of every `keepkv ...` command in a shell script (continuations joined; &&, ;, | split)."""
    commands = []
    for line in script.replace("\\\n", " ").splitlines():
        for command in re.split(r"&&|\|\||;|\|", line):
            words = shlex.split(command, comments=True)
            if words and words[0] == "keepkv":
                commands.append(words[1:])
    return commands


PYTHON = blocks({"python"})
COMMANDS = [
    pytest.param(argv, id=f"{where}:{' '.join(argv)[:60]}")
    for script, where in blocks(SHELL)
    for argv in keepkv_commands(script)
]


def test_the_readme_has_blocks_to_check():
    assert PYTHON and COMMANDS  # a change to the fence syntax would otherwise skip every check


@pytest.mark.parametrize(
    "code",
    [pytest.param(code, id=where, marks=[pytest.mark.integration] if "load_model" in code else []) for code, where in PYTHON],
)
def test_python_block_runs(code, capsys):
    if "from vllm" in code:
        pytest.skip("a vLLM block: tests/test_vllm.py runs it in the serving venv (bash .ci/vllm)")
    exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
    assert capsys.readouterr().out.strip()  # every block shows its result


@pytest.mark.parametrize("argv", COMMANDS)
def test_shell_command_parses(argv):
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as error:  # argparse's way to reject a command line
        pytest.fail(f"`keepkv {' '.join(argv)}` does not parse (exit {error.code})")
    # a method, variant, parameter or budget the code no longer takes
    if hasattr(args, "budget") and hasattr(args, "param") and hasattr(args, "method"):
        _check_method(args)
    methods = getattr(args, "methods", None) or []
    for name in methods.split(",") if isinstance(methods, str) else methods:
        get_method(name)


@pytest.mark.integration
@pytest.mark.parametrize("argv", [c for c in COMMANDS if c.values[0][0] in CHEAP])
def test_cheap_shell_command_runs(argv, capsys, monkeypatch):
    monkeypatch.chdir(README.parent)  # the README's paths are relative to the repository
    if argv[0] == "report" and not Path(argv[1]).exists():
        pytest.skip(f"{argv[1]} is written by the `keepkv eval` before it")
    assert main(argv) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip()
