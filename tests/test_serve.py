"""keepkv.vllm's checks that need no vLLM: the settings, the plugin's presence, and the command
line `keepkv serve` builds (tests/test_vllm.py starts the server itself, in the serving venv)."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from keepkv.cli import parse_arguments
from keepkv.methods import METHODS
from keepkv.paged import SERVED_METHODS
from keepkv.vllm import check, config, plugin_enabled
from keepkv.vllm import serve


@pytest.mark.parametrize("method", sorted(METHODS))
def test_only_servable_methods_pass_and_the_refusal_names_them(method):
    if method in SERVED_METHODS:
        served = method if "interval=" in method else f"{method}+interval=16"  # the serving default, unless named
        assert check({"method": method, "budget": 0.3}) == {"method": served, "budget": 0.3}
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
    ({"method": "snapkv+merge=zip", "budget": 0.1}, "merge keepkv or none"),
    ({"budget": 0.1}, 'takes "method", "budget", "keep_prompt" and "share_prefix"'),
    ({"method": "snapkv", "window": 3}, 'takes "method", "budget", "keep_prompt" and "share_prefix"'),
    ({"method": "snapkv", "budget": 64, "share_prefix": 1}, "the blocks of a chunk"),
    ({"method": "snapkv", "budget": 0.1, "share_prefix": True}, "give an int"),
    ({"method": "h2o", "budget": 64, "share_prefix": True}, "every query row"),
    ({"method": "keepkv", "budget": 64, "share_prefix": 4}, "votes"),
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
        assert config("h2o", 64) == {"keepkv": {"method": "h2o+interval=16", "budget": 64}}
    else:
        with pytest.raises(RuntimeError, match="leaves out keepkv's plugin"):
            config("h2o", 64)


def command(argv, environ=None, cpu=True, monkeypatch=None, convert=True):
    monkeypatch.setattr(serve, "cpu_build", lambda: cpu)
    args = parse_arguments(["serve", *argv])
    return serve.server_command(args, args.server_args, {} if environ is None else environ, convert=convert)


def test_serve_passes_vllm_flags_on_and_adds_what_the_cpu_build_needs(tmp_path, monkeypatch):
    model = tmp_path / "SmolLM2-135M-Instruct"
    model.mkdir()
    argv, added = command(["--model", str(model), "--method", "h2o", "--budget", "64", "--port", "8123",
                           "--dtype", "float32"], monkeypatch=monkeypatch)
    assert argv[1:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model"] and argv[4] == str(model)
    config_at = argv.index("--additional-config")
    assert json.loads(argv[config_at + 1]) == {"keepkv": {"method": "h2o+interval=16", "budget": 64}}  # served every 16 tokens
    assert argv[-4:] == ["--port", "8123", "--dtype", "float32"]  # as given, in order
    assert "--no-enable-prefix-caching" in argv and "--no-enable-chunked-prefill" not in argv  # vLLM's default: on
    assert "--enforce-eager" in argv  # no compile wait on CPU
    assert argv[argv.index("--served-model-name") + 1] == "SmolLM2-135M-Instruct"  # not a path
    assert added == {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    # What the user set is kept; off CPU (stock vLLM only, --method full) nothing is added for the CPU build.
    _, added = command(["--model", str(model)], {"VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "0"},
                       monkeypatch=monkeypatch)
    assert added == {}
    argv, added = command(["--model", str(model), "--method", "full"], cpu=False, monkeypatch=monkeypatch)
    assert added == {"HF_HUB_OFFLINE": "1"} and "--enforce-eager" not in argv
    assert "--no-enable-prefix-caching" not in argv  # --method full: stock vLLM with its defaults
    for flag in ("--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--enable-chunked-prefill",
                 "--served-model-name"):
        argv, _ = command(["--model", str(model), flag, *(["other"] if flag == "--served-model-name" else [])],
                          monkeypatch=monkeypatch)
        assert argv.count(flag) == 1
    argv, _ = command(["--model", str(model), "--no-enable-chunked-prefill"], monkeypatch=monkeypatch)
    assert argv.count("--no-enable-chunked-prefill") == 1  # chunked prefill turned off: served as asked


@pytest.mark.parametrize("given", [["-O3"], ["-O", "2"], ["--optimization-level=3"], ["--compilation-config", "{}"],
                                   ["-cc", "{}"], ["--no-enforce-eager"], ["--enforce-eager"]])
def test_serve_runs_eager_on_cpu_unless_compilation_is_asked_for(tmp_path, monkeypatch, given):
    argv, _ = command(["--model", str(tmp_path), *given], monkeypatch=monkeypatch)
    assert argv.count("--enforce-eager") == given.count("--enforce-eager")
    argv, _ = command(["--model", str(tmp_path)], monkeypatch=monkeypatch)
    assert argv.count("--enforce-eager") == 1


def test_stock_vllm_is_served_under_the_same_flags(tmp_path, monkeypatch):
    """--method full: stock vLLM with its defaults (no keepkv settings, prefix caching left on),
    eager and named as a method is, and what keepkv.vllm refuses is vLLM's to serve."""
    keepkv_argv, _ = command(["--model", str(tmp_path), "--port", "8000"], monkeypatch=monkeypatch)
    stock_argv, _ = command(["--model", str(tmp_path), "--method", "full", "--port", "8000"], monkeypatch=monkeypatch)
    at = keepkv_argv.index("--additional-config")
    assert stock_argv == [flag for flag in keepkv_argv[:at] + keepkv_argv[at + 2 :] if flag != "--no-enable-prefix-caching"]
    argv, _ = command(["--model", str(tmp_path), "--method", "full", "--enable-prefix-caching", "-tp", "2"],
                      monkeypatch=monkeypatch)
    assert "--enable-prefix-caching" in argv and "--no-enable-prefix-caching" not in argv
    with pytest.raises(ValueError, match="--method full keeps every entry: drop --budget"):
        command(["--model", str(tmp_path), "--method", "full", "--budget", "0.1"], monkeypatch=monkeypatch)


@pytest.mark.parametrize("model, name", [("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
                                         ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Llama-3.2-1B-Instruct"),
                                         ("qwen2.5-0.5b.f16.gguf", "qwen2.5-0.5b"),
                                         ("my-model", "my-model")])
def test_the_served_model_is_named_after_the_model(model, name):
    assert serve.model_name(Path("/models") / model) == name


def test_a_dry_run_writes_nothing(tmp_path, monkeypatch, capsys):
    """--dry-run names the embedded model's dense copy and converts nothing (517 MB otherwise)."""
    from keepkv.models import embedded_gguf_path

    monkeypatch.setenv("KEEPKV_CACHE_DIR", str(tmp_path / "cache"))
    find_spec = serve.importlib.util.find_spec
    monkeypatch.setattr(serve.importlib.util, "find_spec", lambda name, *rest: object() if name == "vllm" else find_spec(name, *rest))
    monkeypatch.setattr(serve, "cpu_build", lambda: True)
    args = parse_arguments(["serve", "--dry-run", "--port", "8001"])
    assert serve.main(args, args.server_args) == 0
    err = capsys.readouterr().err
    assert str(tmp_path / "cache" / embedded_gguf_path().stem) in err and "written on the first real start" in err
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("argv, environ, message", [
    (["--enable-prefix-caching"], {}, "does not support prefix caching: a block shared"),
    (["--additional-config", "{}"], {}, "writes it from --method and --budget"),
    (["--method", "cam"], {}, "serves h2o, keepkv, keydiff, pyramidkv, snapkv, streamingllm, window"),
    (["--budget", "2"], {}, "budget 2 keeps 2 per layer and head, fewer than keepkv's 32 protected"),
    ([], {"VLLM_PLUGINS": ""}, "leaves out keepkv's plugin"),
    (["--speculative-config", '{"method": "ngram"}'], {}, "does not support speculative decoding"),
    (["--spec-method=ngram"], {}, "does not support speculative decoding"),
    (["--pipeline-parallel-size", "2"], {}, r"does not support pipeline parallelism > 1: vLLM 0.32.0's CPU build dies"),
    (["-pp=2", "-tp", "3"], {}, r"intermediate_tensors is not None.* \(--pipeline-parallel-size 1\)"),
    (["--enable-lora"], {}, "does not support LoRA"),
    (["--kv-cache-dtype", "fp8_e4m3"], {}, "does not support an fp8 KV cache"),
    (["--port", "notaport"], {}, r"^--port takes an int in \[1, 65535\], got 'notaport'$"),
    (["--port", "65536"], {}, r"^--port takes an int in \[1, 65535\], got '65536'$"),
    (["--host", "0.0.0.0", "--port"], {}, r"^--port takes an int in \[1, 65535\], got no value$"),
    (["-tp", "two"], {}, r"^-tp takes an int >= 1, got 'two'$"),
    (["--max-num-seqs=0"], {}, r"^--max-num-seqs takes an int >= 1, got '0'$"),
    (["--method", "full", "--tensor-parallel-size", "0"], {}, r"^--tensor-parallel-size takes an int >= 1"),
    (["--keep-prompt", "--budget", "0.1"], {}, r"^--keep-prompt keeps every prompt whole and --budget generated "
                                               r"entries per layer and head: give --budget an int, got 0.1$"),
])
def test_serve_refuses_before_starting_anything(tmp_path, monkeypatch, argv, environ, message):
    with pytest.raises((ValueError, RuntimeError), match=message) as raised:
        command(["--model", str(tmp_path), *argv], environ, monkeypatch=monkeypatch)
    assert "\n" not in str(raised.value)


def test_serve_sets_a_thread_binding_for_tensor_parallel_workers_on_too_few_numa_nodes(tmp_path, monkeypatch):
    """vLLM's default binding gives each CPU worker a NUMA node of its own: on a host with fewer,
    keepkv serve sets VLLM_CPU_OMP_THREADS_BIND (each worker's cores), for stock vLLM too, unless
    it is set; with a node per worker it adds nothing."""
    from keepkv.vllm import settings

    monkeypatch.setattr(settings, "memory_nodes", lambda: 1)
    assert settings.thread_binding(3, cpus={0, 1}) == "0|1|0"  # fewer cores than workers: they share
    assert settings.thread_binding(2, cpus=range(5)) == "0,1|2,3,4"
    assert settings.thread_binding(1, cpus={0, 1}) is None
    for method in ("snapkv", "full"):
        _, added = command(["--model", str(tmp_path), "--method", method, "-tp", "3"], monkeypatch=monkeypatch)
        assert added[settings.BIND] == settings.thread_binding(3)
    _, added = command(["--model", str(tmp_path), "--tensor-parallel-size=3"], {settings.BIND: "0-1|0-1|0-1"},
                       monkeypatch=monkeypatch)
    assert settings.BIND not in added  # the user's
    _, added = command(["--model", str(tmp_path)], monkeypatch=monkeypatch)
    assert settings.BIND not in added  # one worker
    monkeypatch.setattr(settings, "memory_nodes", lambda: 4)
    _, added = command(["--model", str(tmp_path), "-tp", "3"], monkeypatch=monkeypatch)
    assert settings.BIND not in added  # a node per worker: vLLM's default binds them


@pytest.mark.parametrize("method, size, refused", [
    ("keepkv", "9", r"does not support KV heads replicated over ranks: .* \(9 ranks, 3 KV heads\)"),
    ("keepkv", "2", r"^--tensor-parallel-size 2 does not split the model's 9 attention heads and 3 KV heads evenly "
                    r"over ranks: take 1 or 3$"),
    ("snapkv", "6", "KV heads replicated over ranks"),
    ("full", "2", r"^--tensor-parallel-size 2 does not split .* evenly over ranks: take 1, 3 or 9$"),
    ("full", "4", "take 1, 3 or 9"),
    ("full", "6", "take 1, 3 or 9"),
    ("keepkv", "3", None), ("full", "3", None), ("full", "9", None), ("snapkv", "1", None),
])
def test_serve_refuses_a_tensor_parallel_size_the_heads_do_not_allow(tmp_path, monkeypatch, method, size, refused):
    """A tensor-parallel size that does not split the model's heads evenly (read from its
    config.json; vLLM would refuse it only once started, in a traceback) or, for a keepkv method,
    above its KV heads is refused in one line naming the sizes that work; stock vLLM also takes a
    multiple of the KV heads that divides the attention heads (the KV heads are copied)."""
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 9, "num_key_value_heads": 3}))
    argv = ["--model", str(tmp_path), "--method", method, "-tp", size]
    if refused is None:
        command(argv, monkeypatch=monkeypatch)
        return
    with pytest.raises(ValueError, match=refused) as raised:
        command(argv, monkeypatch=monkeypatch)
    assert "\n" not in str(raised.value)


def test_a_gguf_tensor_parallel_size_is_checked_from_its_header_before_any_conversion(tmp_path, monkeypatch):
    """The embedded GGUF not converted yet: its heads come from the GGUF's header (9 and 3), and
    nothing is converted or written."""
    monkeypatch.setenv("KEEPKV_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="9 attention heads and 3 KV heads evenly over ranks: take 1 or 3$"):
        command(["-tp", "2"], monkeypatch=monkeypatch)
    assert not (tmp_path / "cache").exists()


def test_serve_help_lists_the_served_methods():
    """The help's list is the paged adapter's (keepkv.paged.SERVED_METHODS), through the torch-free
    copy that --help reads."""
    from keepkv.checks import SERVED_METHOD_NAMES

    assert SERVED_METHOD_NAMES == SERVED_METHODS
    from keepkv.cli import serve_parser

    text = " ".join(serve_parser()._subparsers._group_actions[0].choices["serve"].format_help().split())
    assert f"served method: {', '.join(SERVED_METHODS)}, or a variant" in text


@pytest.mark.parametrize("method, tensor, pipeline, kv_heads, refused", [
    ("snapkv", 3, 1, 3, []),
    ("pyramidkv", 3, 1, 6, []),
    ("keepkv", 9, 1, 3, ["KV heads replicated over ranks"]),
    ("snapkv", 1, 2, 3, ["pipeline parallelism > 1"]),
    ("d2o", 3, 1, 3, ["layer budgets drawn from every layer's scores under tensor parallelism"]),
    ("d2o", 1, 1, 3, []),
    ("kvzip+budgets=global", 2, 1, 3, ["layer budgets drawn from every layer's scores under tensor parallelism"]),
    ("snapkv+selection=learned+budgets=uniform", 3, 1, 3, []),
    ("snapkv+selection=learned", 3, 1, 3, []),  # its trained split: from the prompt's length alone
    ("keepkv+selection=learned+budgets=uniform", 1, 1, 3, []),
    ("full", 3, 1, 3, []),
])
def test_parallel_engines_refuse_what_would_need_communication(method, tensor, pipeline, kv_heads, refused):
    """Each tensor-parallel rank compresses its own KV heads with no communication: a method whose
    layer budgets come from every layer's scores (D2O, KVzip's non-uniform budgets) and KV heads
    replicated over ranks are refused under tensor parallelism, each in its one line."""
    from keepkv.vllm.settings import parallel_problems, refusal

    assert parallel_problems(method, tensor, pipeline, kv_heads) == refused
    for name in refused:
        assert "\n" not in refusal(name)


def test_serve_refuses_keepkv_off_the_cpu_build(tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match="CPU build only .* --method full serves this vLLM stock"):
        command(["--model", str(tmp_path)], cpu=False, monkeypatch=monkeypatch)


@pytest.mark.parametrize("flag, message", [
    (["--speculative-config", "{}"], "keepkv.vllm does not support "), (["--enable-lora"], "keepkv.vllm does not support "),
    (["--kv-cache-dtype", "fp8"], "keepkv.vllm does not support "), (["-pp", "2"], "keepkv.vllm does not support "),
    (["--port", "notaport"], "--port takes an int in [1, 65535], got 'notaport'"),
    (["--method", "full", "-tp=2.5"], "-tp takes an int >= 1, got '2.5'"),
    (["--keep-prompt", "--budget", "0.5"], "--keep-prompt keeps every prompt whole"),
])
def test_serve_refuses_flags_before_torch_or_vllm_is_imported(flag, message):
    """keepkv serve's flag refusals come from its own process, before torch (or vLLM) is imported:
    one line on stderr, status 2, whatever the load of the host (the times are in docs/serving.md)."""
    import subprocess
    import sys

    code = ("import sys; from keepkv.cli import main; status = main(['serve', *sys.argv[1:]]); "
            "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, sorted(sys.modules); sys.exit(status)")
    done = subprocess.run([sys.executable, "-c", code, *flag], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"keepkv: error: {message}") and done.stderr.count("\n") == 1, done.stderr


def test_config_serves_keydiff_by_default_with_share_prefix():
    from keepkv.vllm import config

    assert config(share_prefix=True) == {"keepkv": {"method": "keydiff+interval=16", "budget": 256, "keep_prompt": True,
                                                    "share_prefix": 8}}
    assert config()["keepkv"]["method"] == "snapkv+interval=16"


def test_a_budget_under_the_floor_warns_in_config():
    import keepkv
    from keepkv.vllm import config

    with pytest.warns(keepkv.KeepKVWarning, match="budget 40 is under snapkv's budget floor of 64 entries"):
        assert config("snapkv", 40) == {"keepkv": {"method": "snapkv+interval=16", "budget": 40}}
    with pytest.raises(ValueError, match="budget 8 keeps 8 per layer and head, fewer than snapkv's 32"):
        config("snapkv", 8)


def test_a_budget_under_the_floor_warns_in_one_line_at_serve_start(tmp_path, monkeypatch):
    args = parse_arguments(["serve", "--budget", "40"])
    (line,) = [serve.floor_warning(args)]
    assert "budget 40 is under keepkv's budget floor of 64 entries" in line and "\n" not in line
    assert serve.floor_warning(parse_arguments(["serve", "--budget", "64"])) is None
    assert serve.floor_warning(parse_arguments(["serve", "--budget", "0.05"])) is None  # a fraction has the floor
    assert serve.floor_warning(parse_arguments(["serve"])) is None


@pytest.mark.parametrize("budget", ["0", "1.5", "-3", "2e60", "half"])
def test_a_budget_out_of_range_is_refused_as_the_arguments_are_parsed(budget):
    """Before torch is imported (a subprocess: this one has torch), in one line naming the range."""
    import subprocess
    import sys

    code = ("import sys\nfrom keepkv.cli import parse_arguments\ntry:\n    parse_arguments(['serve', '--budget', "
            f"{budget!r}])\nexcept SystemExit as stop:\n    print('torch' in sys.modules, stop.code)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "2"]
    assert "budget" in done.stderr.strip().splitlines()[-1] and "must be" in done.stderr  # after the usage, one line


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
    for row, mib in zip(results, (64.0, 12.5)):  # rows that measured the KV memory in use
        row["peak_kv_mib"] = mib
    assert bench.table(results).splitlines()[2:] == ["| full (stock vLLM) | 36 | 4 | 64.0 | 1,400 | 20.0 | 1.00× |",
                                                     "| snapkv | 35 | 4 | 12.5 | 1,400 | 30.0 | 1.50× |"]


def test_the_serving_bench_spreads_ragged_prompts_around_the_length():
    from keepkv.vllm.bench import prompt_lengths

    assert prompt_lengths(4, 1024, ragged=False) == [1024] * 4
    ragged = prompt_lengths(32, 1024, ragged=True)
    assert sorted(ragged) == [512 + (1024 * i) // 31 for i in range(32)]  # 512 .. 1,536, each once
    assert ragged != sorted(ragged)  # submitted mixed, not shortest first
    assert abs(sum(ragged) / 32 - 1024) < 1
    assert prompt_lengths(32, 1024, ragged=True) == ragged  # a fixed order: runs compare
    assert min(prompt_lengths(3, 1, ragged=True)) == 1  # never an empty prompt


def test_the_shared_documents_shape_interleaves_documents_and_counts_prompt_tokens_computed():
    """--documents: request i asks about document i mod D; the count of prompt tokens computed takes
    each scheduled request's tokens inside its prompt past what it had (computed or cached)."""
    from keepkv.vllm.bench import interleaved, prompt_tokens_computed

    assert interleaved(3, 7) == [0, 1, 2, 0, 1, 2, 0]
    assert interleaved(1, 3) == [0, 0, 0]
    requests = {"a": SimpleNamespace(num_prompt_tokens=100), "b": SimpleNamespace(num_prompt_tokens=50),
                "c": SimpleNamespace(num_prompt_tokens=10)}
    output = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="a", num_computed_tokens=64)],  # 64 found in the prefix cache
        scheduled_cached_reqs=SimpleNamespace(req_ids=["b", "c"], num_computed_tokens=[40, 10]),
        num_scheduled_tokens={"a": 36, "b": 16, "c": 1},  # b: its last 10 prompt tokens and 6 more; c decodes
    )
    assert prompt_tokens_computed(output, requests) == 36 + 10 + 0
    output.scheduled_new_reqs[0].num_computed_tokens = 0  # a miss: a chunk of the prompt
    output.num_scheduled_tokens["a"] = 48
    assert prompt_tokens_computed(output, requests) == 48 + 10


def test_the_serving_bench_refuses_flags_it_cannot_honour(capsys):
    from keepkv.vllm import bench

    for argv, says in [(["--documents", "4"], "need --shared-prefix"),
                       (["--shared-prefix", "64", "--prompt-modes", "keep,squash"], "--prompt-modes takes"),
                       (["--shared-prefix", "64", "--prompt-modes", "keep,keep"], "--prompt-modes takes"),
                       (["--shared-prefix", "64", "--documents", "0"], "--documents must be >= 1"),
                       (["--shared-prefix", "64", "--prompt-budget", "1.5"], "--prompt-budget must be"),
                       (["--shared-prefix", "64", "--share-blocks", "4"], "--share-blocks needs --prompt-modes share"),
                       (["--shared-prefix", "64", "--prompt-modes", "share", "--share-blocks", "1"],
                        "--share-blocks (the blocks of a chunk) must be >= 2"),
                       (["--blocks", "1"], "--blocks must be >= 2"),
                       (["--block-size", "8"], "--block-size must be a multiple of 16"),
                       (["--block-size", "100"], "--block-size must be a multiple of 16"),
                       (["--block-size", "0"], "--block-size must be a multiple of 16"),
                       (["--repeats", "0"], "--repeats must be >= 1"),
                       (["--chunk-tokens", "0"], "--chunk-tokens must be >= 1, with chunked prefill on"),
                       (["--chunk-tokens", "512", "--no-chunked-prefill"],
                        "--chunk-tokens must be >= 1, with chunked prefill on")]:
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert says in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_bench_names_an_engine_by_its_prompt_mode_only_where_it_runs_several():
    from keepkv.vllm.bench import engine_name

    assert engine_name(None) == "full (stock vLLM)"
    assert engine_name({"method": "keepkv", "budget": 64}) == "keepkv"
    assert engine_name({"method": "keepkv", "budget": 0.1, "prompt_mode": "compress"}) == "keepkv (compress prompts)"


def test_serve_says_it_is_warming_up_until_the_server_is_ready(monkeypatch, capsys):
    """The server's output passes through; a "warming up" line while it starts, one "ready" line
    when it says it answers, and its exit status is the command's."""
    import sys

    monkeypatch.setattr(serve, "PROGRESS_EVERY", 0.2)
    fake = ("import sys, time; print('loading', flush=True); time.sleep(1.5); "
            "print('INFO:     Application startup complete.', flush=True); time.sleep(0.5); sys.exit(3)")
    assert serve.supervise([sys.executable, "-c", fake], {}, "http://localhost:8000/v1") == 3
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["loading", "INFO:     Application startup complete."]
    lines = captured.err.splitlines()
    assert lines[0].startswith("keepkv serve: warming up, ") and lines[-1].startswith("keepkv serve: ready after ")
    assert lines[-1].endswith(" s at http://localhost:8000/v1") and len(lines) >= 3


def test_keep_prompt_serves_with_prefix_caching_and_counts_generated_entries(tmp_path, monkeypatch):
    """--keep-prompt: the config says so, prefix caching and chunked prefill are left on (vLLM's
    defaults; they may be asked for), and the budget is the generated entries kept (256 by default)."""
    model = tmp_path / "SmolLM2-135M-Instruct"
    model.mkdir()
    argv, _ = command(["--model", str(model), "--method", "snapkv", "--keep-prompt"], monkeypatch=monkeypatch)
    assert json.loads(argv[argv.index("--additional-config") + 1]) == {
        "keepkv": {"method": "snapkv+interval=16", "budget": 256, "keep_prompt": True}}
    assert "--no-enable-prefix-caching" not in argv and "--no-enable-chunked-prefill" not in argv
    argv, _ = command(["--model", str(model), "--method", "keepkv", "--keep-prompt", "--budget", "64",
                       "--enable-prefix-caching"], monkeypatch=monkeypatch)
    assert json.loads(argv[argv.index("--additional-config") + 1])["keepkv"]["budget"] == 64
    with pytest.raises(ValueError, match="^--keep-prompt .* give --budget an int, got 0.1$"):  # the flag, not the API's name
        command(["--model", str(model), "--keep-prompt", "--budget", "0.1"], monkeypatch=monkeypatch)
    with pytest.raises(ValueError, match="prefix caching.*--keep-prompt"):
        command(["--model", str(model), "--enable-prefix-caching"], monkeypatch=monkeypatch)
    with pytest.raises(ValueError, match="drop --budget, --keep-prompt and --share-prefix"):
        command(["--model", str(model), "--method", "full", "--keep-prompt"], monkeypatch=monkeypatch)


def test_share_prefix_serves_compressed_chunks_with_prefix_caching(tmp_path, monkeypatch):
    """--share-prefix [BLOCKS]: the config carries the chunk's blocks (8 by default) and keeps
    prompts by --keep-prompt's rule otherwise; prefix caching stays on; without --method it serves
    keydiff (keepkv without it); a method it does not serve and a fractional budget are refused in
    one line."""
    model = tmp_path / "SmolLM2-135M-Instruct"
    model.mkdir()
    argv, _ = command(["--model", str(model), "--method", "snapkv", "--share-prefix", "--budget", "64"],
                      monkeypatch=monkeypatch)
    assert json.loads(argv[argv.index("--additional-config") + 1]) == {
        "keepkv": {"method": "snapkv+interval=16", "budget": 64, "keep_prompt": True, "share_prefix": 8}}
    assert "--no-enable-prefix-caching" not in argv
    argv, _ = command(["--model", str(model), "--method", "window", "--share-prefix", "4"], monkeypatch=monkeypatch)
    assert json.loads(argv[argv.index("--additional-config") + 1])["keepkv"]["share_prefix"] == 4
    argv, _ = command(["--model", str(model), "--share-prefix"], monkeypatch=monkeypatch)  # keepkv's merge is refused there
    assert json.loads(argv[argv.index("--additional-config") + 1])["keepkv"]["method"] == "keydiff+interval=16"
    argv, _ = command(["--model", str(model)], monkeypatch=monkeypatch)
    assert json.loads(argv[argv.index("--additional-config") + 1])["keepkv"]["method"] == "keepkv+interval=16"
    with pytest.raises(ValueError, match="^--share-prefix .* give --budget an int, got 0.1$"):
        command(["--model", str(model), "--share-prefix", "--budget", "0.1"], monkeypatch=monkeypatch)
    with pytest.raises(ValueError, match="^--share-prefix takes the blocks of a chunk, an int >= 2, got 1$"):
        command(["--model", str(model), "--share-prefix", "1"], monkeypatch=monkeypatch)
    with pytest.raises(ValueError, match="chunk_blocks does not serve h2o"):
        command(["--model", str(model), "--method", "h2o", "--share-prefix"], monkeypatch=monkeypatch)
    with pytest.raises(ValueError, match="drop --budget, --keep-prompt and --share-prefix"):
        command(["--model", str(model), "--method", "full", "--share-prefix"], monkeypatch=monkeypatch)


@pytest.mark.parametrize("given, message", [
    ({"method": "snapkv", "budget": 0.3, "keep_prompt": True}, "give an int"),
    ({"method": "snapkv", "budget": 16, "keep_prompt": True}, "fewer than snapkv's 32 protected"),
    ({"method": "snapkv", "budget": 64, "keep_prompt": "yes"}, "must be true or false"),
])
def test_keep_prompt_settings_are_checked(given, message):
    with pytest.raises(ValueError, match=message) as raised:
        check(given)
    assert "\n" not in str(raised.value)
    assert check({"method": "keydiff", "keep_prompt": True}) == {"method": "keydiff+interval=16", "budget": 256,
                                                                  "keep_prompt": True}
    assert check({"method": "snapkv+interval=1", "budget": 64, "keep_prompt": False}) == {"method": "snapkv+interval=1",
                                                                                          "budget": 64}


def test_serve_passes_a_learned_selections_scorer_and_refuses_it_elsewhere(tmp_path, monkeypatch):
    """--scorer PATH becomes the learned selection's scorer=ABSOLUTE_PATH in the engine's settings;
    with a method whose selection is not the learned one, or --method full, it is refused in one line."""
    from keepkv.scorer import default_scorer

    model = tmp_path / "SmolLM2-135M-Instruct"
    model.mkdir()
    argv, _ = command(["--model", str(model), "--method", "snapkv+selection=learned+budgets=uniform", "--scorer", str(default_scorer())],
                      monkeypatch=monkeypatch)
    settings = json.loads(argv[argv.index("--additional-config") + 1])["keepkv"]
    assert settings["method"] == f"snapkv+selection=learned+budgets=uniform+scorer={default_scorer().resolve()}+interval=16"
    for method, message in (("snapkv", "--scorer is the learned selection's"), ("full", "drop --scorer")):
        with pytest.raises(ValueError, match=message):
            command(["--model", str(model), "--method", method, "--scorer", str(default_scorer())], monkeypatch=monkeypatch)
    with pytest.raises(ValueError, match="no scorer file"):
        command(["--model", str(model), "--method", "snapkv+selection=learned+budgets=uniform", "--scorer", str(tmp_path / "none.pt")],
                monkeypatch=monkeypatch)
