"""keepkv.vllm's checks that need no vLLM: the settings, the plugin's presence, and the command
line `keepkv serve` builds (tests/test_vllm.py starts the server itself, in the serving venv)."""

import json

import pytest

from keepkv.cli import parse_arguments
from keepkv.methods import METHODS
from keepkv.paged import SERVED_METHODS
from keepkv.vllm import check, config, plugin_enabled
from keepkv.vllm import serve


@pytest.mark.parametrize("method", sorted(METHODS))
def test_only_servable_methods_pass_and_the_refusal_names_them(method):
    if method in SERVED_METHODS:
        assert check({"method": method, "budget": 0.3}) == {"method": method, "budget": 0.3}
    else:
        served = "does not serve kvzip: its reconstruction pass" if method == "kvzip" else (
            f"keepkv.vllm serves {', '.join(SERVED_METHODS)} .*got '{method}'"
        )
        with pytest.raises(ValueError, match=served) as raised:
            check({"method": method, "budget": 0.3})
        assert "\n" not in str(raised.value)


@pytest.mark.parametrize("given, message", [
    ({"method": "snapkv", "budget": 0.0}, "budget"),
    ({"method": "snapkv", "budget": 1.5}, "budget"),
    ({"method": "snapkv+bogus=1", "budget": 0.1}, "unknown parameter"),
    ({"method": "snapkv+merge=zip", "budget": 0.1}, "merge none or keepkv"),
    ({"budget": 0.1}, 'takes "method" and "budget"'),
    ({"method": "snapkv", "window": 3}, 'takes "method" and "budget"'),
    ("snapkv", "is a dict"),
])
def test_bad_settings_are_refused_in_one_line(given, message):
    with pytest.raises(ValueError, match=message) as raised:
        check(given)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("plugins, loaded", [(None, True), ("keepkv", True), ("other,keepkv", True), ("", False),
                                             ("other", False)])
def test_a_config_vllm_would_ignore_is_refused(monkeypatch, plugins, loaded):
    """With VLLM_PLUGINS leaving keepkv out, vLLM would serve the full cache: config() refuses."""
    if plugins is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", plugins)
    assert plugin_enabled() == loaded
    if loaded:
        assert config("h2o", 64) == {"keepkv": {"method": "h2o", "budget": 64}}
    else:
        with pytest.raises(RuntimeError, match="leaves out keepkv's plugin"):
            config("h2o", 64)


def command(argv, environ=None, cpu=True, monkeypatch=None):
    monkeypatch.setattr(serve, "cpu_build", lambda: cpu)
    args = parse_arguments(["serve", *argv])
    return serve.server_command(args, args.server_args, {} if environ is None else environ)


def test_serve_passes_vllm_flags_on_and_adds_what_the_cpu_build_needs(tmp_path, monkeypatch):
    argv, added = command(["--model", str(tmp_path), "--method", "h2o", "--budget", "64", "--port", "8123",
                           "--dtype", "float32"], monkeypatch=monkeypatch)
    assert argv[1:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model"] and argv[4] == str(tmp_path)
    config_at = argv.index("--additional-config")
    assert json.loads(argv[config_at + 1]) == {"keepkv": {"method": "h2o", "budget": 64}}
    assert argv[-4:] == ["--port", "8123", "--dtype", "float32"]  # as given, in order
    assert "--no-enable-prefix-caching" in argv and "--no-enable-chunked-prefill" in argv
    assert added == {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    # What the user set is kept; off CPU nothing is added for the CPU build.
    _, added = command(["--model", str(tmp_path)], {"VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "0"},
                       monkeypatch=monkeypatch)
    assert added == {}
    _, added = command(["--model", str(tmp_path)], cpu=False, monkeypatch=monkeypatch)
    assert added == {"HF_HUB_OFFLINE": "1"}
    for flag in ("--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--enable-chunked-prefill"):
        argv, _ = command(["--model", str(tmp_path), flag], monkeypatch=monkeypatch)
        assert argv.count(flag) == 1
    assert "--no-enable-chunked-prefill" not in argv  # chunked prefill asked for: served as asked


@pytest.mark.parametrize("argv, environ, message", [
    (["--enable-prefix-caching"], {}, "does not support prefix caching: a block shared"),
    (["--additional-config", "{}"], {}, "writes --additional-config"),
    (["--method", "cam"], {}, "serves window, streamingllm, snapkv, h2o, pyramidkv, keydiff, keepkv"),
    (["--budget", "0"], {}, "budget"),
    ([], {"VLLM_PLUGINS": ""}, "leaves out keepkv's plugin"),
])
def test_serve_refuses_before_starting_anything(tmp_path, monkeypatch, argv, environ, message):
    with pytest.raises((ValueError, RuntimeError), match=message):
        command(["--model", str(tmp_path), *argv], environ, monkeypatch=monkeypatch)


def test_only_serve_takes_flags_it_does_not_know():
    with pytest.raises(SystemExit):
        parse_arguments(["generate", "hi", "--port", "8000"])
    assert parse_arguments(["serve", "--port", "8000"]).server_args == ["--port", "8000"]


def test_the_serving_bench_reports_each_engine_as_it_finishes(tmp_path, capsys):
    """python -m keepkv.vllm.bench: each engine's line is printed (and the JSON rewritten) before
    the next starts, with progress lines; a failure keeps the engines done; a table at the end."""
    from keepkv.vllm import bench

    path = tmp_path / "out.json"
    seen = []

    def run(keepkv, blocks, progress):
        seen.append((capsys.readouterr(), json.loads(path.read_text())["results"] if path.exists() else []))
        progress(3, 8, 120, 12.0)
        if keepkv and keepkv["method"] == "crash":
            raise KeyboardInterrupt  # a time-out
        return {"method": keepkv["method"] if keepkv else "full (stock vLLM)", "blocks": blocks, "peak_running": 4,
                "steps": 1400, "tokens_per_s": 20.0 if keepkv is None else 30.0}

    engines = [(None, 36), ({"method": "snapkv", "budget": 0.1}, 35), ({"method": "crash", "budget": 0.1}, 35)]
    with pytest.raises(KeyboardInterrupt):
        bench.run_all(engines, run, {"budget": 0.1}, str(path))
    before_second, before_third = seen[1], seen[2]
    assert json.loads(before_second[0].out.strip())["method"] == "full (stock vLLM)"
    assert "[1/3] full (stock vLLM): 3/8 requests done, 120 tokens, 12 s" in before_second[0].err
    assert json.loads(before_third[0].out.strip())["tokens_per_s_vs_full"] == 1.5
    assert [row["method"] for row in before_third[1]] == ["full (stock vLLM)", "snapkv"]
    assert [row["method"] for row in json.loads(path.read_text())["results"]] == ["full (stock vLLM)", "snapkv"]

    results = bench.run_all(engines[:2], run, {"budget": 0.1}, None)
    table = capsys.readouterr().out.strip().splitlines()[-4:]
    assert table[0].startswith("| engine | KV blocks | peak concurrent requests")
    assert table[2] == "| full (stock vLLM) | 36 | 4 | 1,400 | 20.0 | 1.00× |"
    assert table[3] == "| snapkv | 35 | 4 | 1,400 | 30.0 | 1.50× |"
    assert results[1]["tokens_per_s_vs_full"] == 1.5


def test_the_serving_bench_spreads_ragged_prompts_around_the_length():
    from keepkv.vllm.bench import prompt_lengths

    assert prompt_lengths(4, 1024, ragged=False) == [1024] * 4
    ragged = prompt_lengths(32, 1024, ragged=True)
    assert sorted(ragged) == [512 + (1024 * i) // 31 for i in range(32)]  # 512 .. 1,536, each once
    assert ragged != sorted(ragged)  # submitted mixed, not shortest first
    assert abs(sum(ragged) / 32 - 1024) < 1
    assert prompt_lengths(32, 1024, ragged=True) == ragged  # a fixed order: runs compare
    assert min(prompt_lengths(3, 1, ragged=True)) == 1  # never an empty prompt
