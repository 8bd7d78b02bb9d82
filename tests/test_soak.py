"""``keepkv bench --soak``: long decodes report bounded cache growth (figures come from the bench,
not from here; these runs are a few dozen steps on tiny shapes)."""

import json

import pytest

from keepkv.bench.core import build_parser, main
from keepkv.bench.soak import documented_growth, format_soak, run_soak

from conftest import tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::keepkv.KeepKVWarning")


def test_soak_reports_constant_caches_and_kvrevivers_documented_growth():
    model = tiny_model("llama-gqa", layers=2)
    result = run_soak(model, ["full", "h2o", "kvreviver"], 0.5, prompt_len=32, steps=40, checkpoints=(10, 40),
                      progress=False, method_params={"kvreviver": {"allocation": "uniform"}})
    by_method = {record["method"]: record for record in result["methods"]}
    assert [c["step"] for c in by_method["h2o"]["checkpoints"]] == [10, 40]
    h2o = by_method["h2o"]
    assert h2o["growth_bytes_per_token"] == 0 and h2o["bounded"] is True
    reviver = by_method["kvreviver"]
    assert reviver["expected_growth_bytes_per_token"] == 8 * 2 * 2  # 8 x H_kv x L
    assert reviver["growth_bytes_per_token"] == reviver["expected_growth_bytes_per_token"] and reviver["bounded"]
    assert by_method["full"]["bounded"] is None and by_method["full"]["growth_bytes_per_token"] > 0
    assert "kvreviver" in format_soak(result)


def test_documented_growth():
    config = tiny_model("llama-gqa", layers=3).config
    assert documented_growth("full", config) is None
    assert documented_growth("snapkv+interval=4", config) == 0
    assert documented_growth("kvreviver", config) == 8 * 2 * 3


def test_cli_soak_json(capsys):
    args = build_parser().parse_args(
        ["--soak", "--soak-steps", "12", "--layers", "1", "--methods", "h2o", "--prompt-len", "16", "--json", "-"]
    )
    assert main(args) == 0
    shown = capsys.readouterr()
    soak = json.loads(shown.out)["soak"]  # stdout holds the JSON alone; progress lines go to stderr
    assert "soak h2o: step 12" in shown.err
    assert soak["model"]["source"] == "config:smollm2-135m" and soak["model"]["num_layers"] == 1
    assert [record["method"] for record in soak["methods"]] == ["full", "h2o"]
    assert soak["methods"][1]["checkpoints"][-1]["step"] == 12


def test_cli_soak_rejects_bad_steps(capsys):
    assert main(build_parser().parse_args(["--soak", "--soak-steps", "0", "--layers", "1", "--no-progress"])) == 2
    assert "soak steps must be an int >= 1" in capsys.readouterr().err
