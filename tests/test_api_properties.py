"""Arbitrary arguments thrown at the public API: keepkv.generate, keepkv.compress,
keepkv.CompressedCache and the command line (keepkv.cli.main).

Each example takes a call that works and replaces one argument with an arbitrary value: ints of
any size, floats with nan and inf, strings, None, bools, lists, numpy scalars, tensors. The
outcome is a result, or a ValueError/TypeError in one line whose message names that argument;
never another exception. On the command line: exit status 0, or 2 with one
``keepkv: error: ...`` line that names the flag.

CI runs conftest.FUZZ_EXAMPLES (a fixed, small count) of each; ``pytest
--hypothesis-profile=long tests/test_api_properties.py`` searches deeper.
"""

import shlex

import numpy as np
import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

import keepkv
import keepkv.models
from keepkv import cli
from keepkv.attention import Needs
from keepkv.checks import MAX_COUNT
from keepkv.methods import METHODS

from conftest import fuzz_settings, tiny_model
from test_generation_features import char_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::keepkv.KeepKVWarning")

MODEL = tiny_model("llama-gqa", layers=2)
TOKENIZER = char_tokenizer()
NUMPY = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint64, np.float16, np.float32, np.float64, np.bool_]


def _numpy_scalar(value, kind):
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            return kind(value)
    except (OverflowError, ValueError):
        return kind(0)


scalars = st.one_of(
    st.integers(),
    st.integers(min_value=2**48 - 2, max_value=2**64 + 2),
    st.integers().map(lambda n: n * 10**30),
    st.integers(max_value=-(2**62)),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.none(),
    st.booleans(),
    st.builds(_numpy_scalar, st.integers(-(2**70), 2**70) | st.floats(), st.sampled_from(NUMPY)),
)
tensors = st.one_of(
    st.integers(-5, 100).map(torch.tensor),
    st.floats(allow_nan=True).map(torch.tensor),
    st.lists(st.integers(-5, 100), max_size=3).map(lambda xs: torch.tensor(xs, dtype=torch.long)),
)
anything = st.one_of(scalars, tensors, st.lists(scalars, max_size=3), st.just(MODEL), st.just(MODEL.config))
# A valid count beyond a few is a long run, not a finding: counts are drawn small or out of range.
counts = st.one_of(st.integers(-3, 3), st.integers(min_value=MAX_COUNT + 1), st.integers(max_value=-(2**64)),
                   anything.filter(lambda v: not (keepkv.checks.is_int(v) and 3 < int(v) <= MAX_COUNT)))
methods = st.one_of(st.sampled_from(sorted(METHODS) + ["keepkv+protect=0.9", "snapkv+window=8"]), anything)
PARAMS = ["interval", "window", "sinks", "protect", "kernel", "bogus"]
small = st.integers(1, 40)
VALID = {  # values that work, numpy's among them, drawn as often as arbitrary ones
    "budget": st.one_of(small, st.floats(0.01, 1.0), st.just(MAX_COUNT), small.map(np.int32), st.just(np.float32(0.5))),
    "max_new_tokens": st.integers(0, 3) | st.integers(0, 3).map(np.int64),
    "prefill_chunk": st.none() | small | small.map(np.uint16),
    "prompts": st.text(min_size=1, max_size=20).filter(str.strip)
    | st.lists(st.sampled_from(["a b", "xyz"]), min_size=1, max_size=3),
    "context": st.text(min_size=1, max_size=40).filter(str.strip),
    "chat": st.booleans() | st.just(np.bool_(True)),
    "progress": st.booleans(),
    "answer_prefix": st.text(max_size=8),
    "compile": st.just(False),
    "interval": small | small.map(np.int64),
    "window": st.integers(1, 16),
    "sinks": st.integers(0, 8),
    "kernel": st.sampled_from([1, 3, 5]),
    "protect": st.floats(0.0, 1.0),
}

GENERATE = dict(model=MODEL, tokenizer=TOKENIZER, prompts="hello there", method="snapkv", budget=0.5,
                max_new_tokens=2, chat=False, answer_prefix="", progress=False, prefill_chunk=None)
COMPRESS = dict(model=MODEL, tokenizer=TOKENIZER, context="a context of some length", method="snapkv", budget=0.5,
                chat=False, prefill_chunk=None)
CACHE = dict(config=MODEL.config, method="snapkv", budget=0.5, record=None, compile=False)
STRATEGY = {"max_new_tokens": counts, "prefill_chunk": counts, "method": methods,
            "prompts": st.one_of(anything, st.lists(st.text(max_size=8), max_size=3))}


@st.composite
def one_argument_changed(draw, call: dict):
    """(name, value): one of the call's arguments or a method parameter, and what it becomes."""
    name = draw(st.sampled_from(sorted(call) + PARAMS))
    arbitrary = STRATEGY.get(name, anything)
    return name, draw(st.one_of(VALID[name], arbitrary) if name in VALID else arbitrary)


def _named(error: Exception, name: str, value) -> None:
    """One line naming ``name`` (a method given as a variant may name the parameter inside it)."""
    message = str(error)
    assert "\n" not in message, message
    names = {name, name.rstrip("s")}
    if name == "method" and isinstance(value, str):
        names |= {part.partition("=")[0].strip() for part in value.split("+")[1:]}
    assert any(n and n in message for n in names), f"{name}={value!r}: {message}"


def _call(function, call: dict, name, value):
    """``function`` with argument (or method parameter) ``name`` set to ``value``: its result, or
    None after a ValueError/TypeError that names it."""
    try:
        result = function(**{**call, name: value})
    except (ValueError, TypeError) as error:
        _named(error, name, value)
        event(f"refused: {name}")
        return None
    event("result")
    return result


@fuzz_settings()
@given(change=one_argument_changed(GENERATE))
def test_generate_returns_or_names_the_argument(change):
    results = _call(keepkv.generate, GENERATE, *change)
    if results is not None:
        assert results and all(isinstance(r, keepkv.GenerationResult) for r in results)


@fuzz_settings(0.5)
@given(change=one_argument_changed(COMPRESS))
def test_compress_returns_or_names_the_argument(change):
    cache = _call(keepkv.compress, COMPRESS, *change)
    if cache is not None:
        assert isinstance(cache, keepkv.CompressedCache) and cache.get_seq_length() > 0


@fuzz_settings()
@given(change=one_argument_changed(CACHE), record=st.sampled_from([None, Needs(colsum=True)]))
def test_compressed_cache_is_built_or_names_the_argument(change, record):
    cache = _call(keepkv.CompressedCache, {**CACHE, "record": record}, *change)
    if cache is not None:
        assert type(cache.budget) in (int, float) and cache.get_seq_length() == 0


# ------------------------------------------------------------------------------ the command line
FLAGS = {  # flag -> a value that works; the positional prompt is "prompt"
    "prompt": "hello there",
    "--method": "snapkv",
    "--budget": "8",
    "--param": "window=4",
    "--max-new-tokens": "2",
    "--answer-prefix": "Sure",
    "--prefill-chunk": "4",
    "--dtype": "float32",
    "--model": ".",
}
texts = st.one_of(st.text(max_size=12), scalars.map(str), st.sampled_from(["-1", "0", "1e400", "nan", "--help", "-x"]))


@pytest.fixture(scope="module")
def tiny_loads():
    """load_model's checks run as they are; only the folder's weights are the tiny model's."""
    patch = pytest.MonkeyPatch()
    patch.setattr(keepkv.models, "_load_dir", lambda directory, dtype: (MODEL, TOKENIZER))
    yield
    patch.undo()


@fuzz_settings()
@given(flag=st.sampled_from(sorted(FLAGS)), value=texts, command=st.sampled_from(["generate", "methods"]))
def test_the_command_line_answers_or_names_the_flag_in_one_line(tiny_loads, flag, value, command):
    if command == "methods":
        argv = ["methods", value if flag == "prompt" else flag]
    else:
        argv = ["generate", "--raw", "--json"]
        for name, good in FLAGS.items():
            given_value = value if name == flag else good
            argv += [given_value] if name == "prompt" else [name, given_value]
    code, err = _main(argv)
    event(f"exit {code}")
    if code == 0:
        return
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("keepkv: error: "), (argv, err)
    # It names the flag (as given, or as the Python argument it becomes), or quotes what was given.
    names = {flag, flag.lstrip("-").replace("-", "_"), value, value.partition("=")[0], shlex.quote(value)}
    names = {" ".join(name.split()) for name in names}  # as the one line shows them
    assert any(n and n in lines[0] for n in names), (argv, lines[0])


def _main(argv) -> tuple[int, str]:
    """cli.main's exit status and stderr; argparse's SystemExit only for --help (status 0)."""
    import contextlib
    import io

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = cli.main(argv)
    return code, err.getvalue()
