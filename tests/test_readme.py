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

from keepkv.cli import _check_method, build_parser, main, parse_arguments
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
            if words and words[0].rsplit("/", 1)[-1] == "keepkv":  # keepkv, or a venv's (.venv-vllm/bin/keepkv)
                commands.append(words[1:])
    return commands


# ------------------------------------------------------------------ docs that cannot drift
#
# A ```text block right after a ```python block, or right after a shell block of cheap
# `keepkv` commands (CHEAP), is that block's output, and is compared with what it prints now. The
# figures printed are byte counts, token counts and greedy answers (fp32, CPU): deterministic,
# so the comparison is exact. A change that moves them must update the README with them.

def outputs(language: set[str]) -> list:
    """pytest params (code, expected output, id) of ``language`` blocks followed by a ```text block."""
    text = README.read_text()
    found = []
    matches = list(BLOCK.finditer(text))
    for match, following in zip(matches, matches[1:]):
        between = text[match.end():following.start()]
        if match.group(1) in SHELL:  # a shell block's output: only of cheap keepkv commands
            argvs = keepkv_commands(match.group(2))
            if not argvs or any(argv[0] not in CHEAP for argv in argvs):
                continue
        if match.group(1) in language and following.group(1) == "text" and "```" not in between:
            line = text.count("\n", 0, match.start()) + 1
            found.append(pytest.param(match.group(2), following.group(2), id=f"README.md:{line}"))
    return found


def text_after(marker: str) -> str:
    """The first ```text block after ``marker`` in the README."""
    text = README.read_text()
    return BLOCK.search(text, text.index(marker)).group(2)


def visible(stderr: str) -> list[str]:
    """stderr lines as a terminal shows them: the text after each line's last carriage return."""
    return [line.split("\r")[-1] for line in stderr.split("\n")]


ROOT = README.parent
PY_OUTPUTS = outputs({"python"})
SHELL_OUTPUTS = outputs(SHELL)
COMPARED = {param.values[0] for param in PY_OUTPUTS + SHELL_OUTPUTS}  # run by the output tests
PYTHON = blocks({"python"})
COMMANDS = [
    pytest.param(argv, script in COMPARED, id=f"{where}:{' '.join(argv)[:60]}")
    for script, where in blocks(SHELL)
    for argv in keepkv_commands(script)
]


def test_the_readme_has_blocks_to_check():
    assert PYTHON and COMMANDS  # a change to the fence syntax would otherwise skip every check


# The README's Python runs without a warning from the installed transformers or torch (a
# deprecated keyword, say): a reader copies it as it is. keepkv's own warnings are its output.
NO_WARNINGS = pytest.mark.filterwarnings("error", "default::keepkv.KeepKVWarning")


@NO_WARNINGS
@pytest.mark.parametrize(
    "code",
    [pytest.param(code, id=where, marks=[pytest.mark.integration] if "load_model" in code else [])
     for code, where in PYTHON if code not in COMPARED],
)
def test_python_block_runs(code, capsys):
    if "from vllm" in code:
        pytest.skip("a vLLM block: tests/test_vllm.py runs it in the serving venv (bash .ci/vllm)")
    exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
    assert capsys.readouterr().out.strip()  # every block shows its result


@pytest.mark.parametrize("argv, compared", COMMANDS)
def test_shell_command_parses(argv, compared):
    try:
        args = parse_arguments(argv)
    except SystemExit as error:  # argparse's way to reject a command line
        pytest.fail(f"`keepkv {' '.join(argv)}` does not parse (exit {error.code})")
    if args.command == "serve":
        from keepkv.vllm.serve import resolve_method

        resolve_method(args)  # the default method, as keepkv serve takes it
    if args.command == "serve" and args.method != "full":  # a method or budget keepkv.vllm does not serve
        from keepkv.vllm import DEFAULT_GENERATED, check
        from keepkv.vllm.serve import DEFAULT_BUDGET, kept_prompts

        kept = kept_prompts(args)
        budget = args.budget if args.budget is not None else DEFAULT_GENERATED if kept else DEFAULT_BUDGET
        check({"method": args.method, "budget": budget, "keep_prompt": kept}
              | ({"share_prefix": args.share_prefix} if args.share_prefix is not None else {}))
    # a method, variant, parameter or budget the code no longer takes
    if hasattr(args, "budget") and hasattr(args, "param") and hasattr(args, "method"):
        _check_method(args)
    methods = getattr(args, "methods", None) or []
    for name in methods.split(",") if isinstance(methods, str) else methods:
        get_method(name)


@pytest.mark.integration
@pytest.mark.parametrize("argv", [c.values[0] for c in COMMANDS if c.values[0][0] in CHEAP and not c.values[1]])
def test_cheap_shell_command_runs(argv, capsys, monkeypatch):
    monkeypatch.chdir(README.parent)  # the README's paths are relative to the repository
    if argv[0] == "report" and not Path(argv[1]).exists():
        pytest.skip(f"{argv[1]} is written by the `keepkv eval` before it")
    assert main(argv) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip()


def test_the_readme_has_outputs_to_compare():
    assert len(PY_OUTPUTS) >= 3  # the three Python examples (a shell block's output is compared too, if shown)


@NO_WARNINGS
@pytest.mark.integration
@pytest.mark.parametrize("code, expected", PY_OUTPUTS)
def test_python_block_prints_what_the_readme_shows(code, expected, capsys):
    exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
    assert capsys.readouterr().out == expected


@pytest.mark.integration
@pytest.mark.parametrize("script, expected", SHELL_OUTPUTS)
def test_shell_block_prints_what_the_readme_shows(script, expected, capsys, monkeypatch):
    """Each command's stdout, then its memory line (stderr's line starting with '['), in order."""
    monkeypatch.chdir(ROOT)
    shown = []
    for argv in keepkv_commands(script):
        assert main(argv) == 0
        captured = capsys.readouterr()
        shown.append(captured.out)
        shown += [line + "\n" for line in visible(captured.err) if line.startswith("[")]
    assert "".join(shown) == expected


@pytest.mark.integration
def test_demo_prints_what_the_readme_shows(capsys):
    """`keepkv demo` (about 20 s): the README shows its output as the first thing a user runs."""
    assert main(["demo"]) == 0
    assert capsys.readouterr().out == text_after("`keepkv demo` prints")


def test_the_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    commands = [code.strip() for code, _ in blocks(SHELL)]
    assert ci in commands
    install = next(c for c in commands if c.endswith("keepkv demo"))
    assert install.split(" && ")[0] == ci.split(" && ")[0].replace(" -q", "")  # the same torch line


def test_the_results_table_is_the_reports():
    """The generated part of docs/results.md is `keepkv report docs/results --reference snapkv`,
    and the README's results table is the first table of the `keepkv report docs/results ...`
    command the README names beside it, row for row."""
    import argparse
    import contextlib
    import io

    from keepkv.eval import cli as eval_cli

    def report(args):
        with contextlib.redirect_stdout(io.StringIO()):
            return eval_cli.report(args)

    page = (ROOT / "docs" / "results.md").read_text()
    whole = argparse.Namespace(path=str(ROOT / "docs" / "results"), out=None, json=False, reference="snapkv")
    assert eval_cli.report_section(page) == report(whole).strip()
    readme = README.read_text()
    named = re.search(r"`keepkv (report docs/results\b[^`]*)`", readme)
    assert named, "the README names no `keepkv report docs/results ...` command for its table"
    args = parse_arguments(shlex.split(named.group(1)))
    args.path = str(ROOT / args.path)
    rows = [line for line in report(args).split("\n\n")[0].splitlines() if line.startswith("|")]
    assert len(rows) > 3 and "\n".join(rows) in readme, "README's results table is not the report's"


def test_every_docs_page_is_linked_and_every_link_resolves():
    readme = README.read_text()
    links = set(re.findall(r"\]\((docs/[^)#]+)", readme))
    for link in links:
        assert (ROOT / link).exists(), link
    pages = {f"docs/{page.name}" for page in (ROOT / "docs").glob("*.md")}
    assert pages <= links, f"not linked from the README: {sorted(pages - links)}"
    for page in (ROOT / "docs").glob("*.md"):
        for link in re.findall(r"\]\(([^)#:]+)", page.read_text()):
            assert (page.parent / link).exists(), f"{page.name}: {link}"


def heading_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown page (fenced blocks skipped): lower
    case, punctuation dropped, spaces to hyphens, a repeated heading suffixed -1, -2, ..."""
    anchors, seen, fenced = set(), {}, False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"#{1,6}\s+(.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_heading_anchors_follow_githubs_rule():
    page = "# GPU: the CUDA command\n```\n# not a heading\n```\n## The \"any\" op, twice\n## The \"any\" op, twice\n"
    assert heading_anchors(page) == {"gpu-the-cuda-command", "the-any-op-twice", "the-any-op-twice-1"}


def test_every_link_to_a_section_finds_its_heading():
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    links = 0
    for page in pages:
        for target, anchor in re.findall(r"\]\(([^)#:\s]*)#([^)\s]+)\)", page.read_text()):
            linked = page.parent / target if target else page
            if linked.suffix == ".md":
                links += 1
                assert anchor in heading_anchors(linked.read_text()), f"{page.name}: {target}#{anchor}"
    assert links > 10  # the README alone links a dozen sections


def test_what_the_readme_says_about_the_code_is_true():
    """Supported architectures, protected tokens, the budget floor, and the options it names."""
    from keepkv.budgets import budget_floor
    from keepkv.models import SUPPORTED_ARCHITECTURES

    readme = " ".join(README.read_text().split())  # as read: line breaks are spaces
    assert f"(`config.model_type` {', '.join(SUPPORTED_ARCHITECTURES[:-1])}, {SUPPORTED_ARCHITECTURES[-1]})" in readme
    # "keepkv, snapkv and pyramidkv protect 32, so their floor is 64; h2o's is 32"
    for name in ("keepkv", "snapkv", "pyramidkv"):
        assert get_method(name).protected_entries() == 32 and budget_floor(get_method(name)) == 64
    assert "keepkv, snapkv and pyramidkv protect 32, so their floor is 64" in readme
    assert budget_floor(get_method("h2o")) == 32 and "h2o's is 32" in readme
    # docs/troubleshooting.md lists every method's protected tokens: "(keepkv, snapkv, pyramidkv: 32; ...; the rest: none)"
    trouble = " ".join((ROOT / "docs" / "troubleshooting.md").read_text().split())
    listed = re.search(r"fixed recent window \(([^)]*); the rest: none\)", trouble).group(1)
    named = {}
    for group in listed.split("; "):
        names, count = group.rsplit(": ", 1)
        named.update({name.strip(): int(count) for name in names.split(",")})
    from keepkv.methods import METHODS

    for name in METHODS:
        assert get_method(name).protected_entries() == named.get(name, 0), name
    # "Every command that loads a model takes --model PATH ... and --json"; report takes --json
    import argparse

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, parser in commands.items():
        options = parser._option_string_actions
        if name == "serve":  # "(`serve`: `--model` only)": it becomes vLLM's server, which prints its own
            assert "--model" in options and "--json" not in options
            continue
        assert "--json" in options, name
        if name not in ("methods", "report"):
            assert "--model" in options, name


def test_report_writes_between_the_markers_of_a_docs_page(tmp_path, capsys):
    """`keepkv report RUN --out PAGE` regenerates a page's tables and keeps its prose; --json
    prints the rows."""
    import json

    from keepkv.eval import cli as eval_cli

    page = tmp_path / "results.md"
    page.write_text(f"# Prose before\n\n{eval_cli.REPORT_BEGIN}\nstale\n{eval_cli.REPORT_END}\n\nProse after.\n")
    assert main(["report", str(ROOT / "docs" / "results"), "--out", str(page)]) == 0
    printed = capsys.readouterr().out.strip()
    written = page.read_text()
    assert written.startswith("# Prose before\n") and written.endswith("\nProse after.\n")
    assert "stale" not in written and eval_cli.report_section(written) == printed
    assert main(["report", str(ROOT / "docs" / "results"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {row["method"] for row in rows} >= {"full", "keepkv", "snapkv"}


def test_report_selects_methods_and_budgets(capsys):
    """`keepkv report RUN --methods ... --budgets ...`: the full cache first, then the named
    methods in their order, only the named budgets' columns; what the run lacks is one line."""
    run = str(ROOT / "docs" / "results")
    assert main(["report", run, "--methods", "snapkv", "keepkv", "--budgets", "0.2"]) == 0
    table = capsys.readouterr().out.split("\n\n")[0].splitlines()
    assert [line.split(" | ")[0] for line in table[2:]] == ["| full", "| snapkv", "| keepkv"]
    assert "@0.2" in table[0] and "@0.1" not in table[0]
    for argv in (["--methods", "no-such-method"], ["--budgets", "0.3"]):
        assert main(["report", run, *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("keepkv: error: ") and "not in this run" in err
