"""``keepkv bench --soak``: long decodes report bounded cache growth (figures come from the bench,
not from here; these runs are a few dozen steps on tiny shapes)."""

import json

import pytest
import torch

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


def test_a_long_greedy_text_stays_bounded_and_no_more_repetitive_than_full():
    """The 1,500-token check of `keepkv bench --soak --soak-text` at a smaller size (a tiny random model, 64-token prompt, 160
    tokens, budget 16), every method: each compressing cache holds no more bytes at the end than
    at its first checkpoint (KVReviver: within its documented growth), and its text repeats its
    4-grams no more than the full cache's text does, give or take 0.05. The full figures, on the
    embedded model: ``keepkv bench --soak --soak-text`` (docs/record/2026-11-27-long-text-soak.md)."""
    from keepkv.bench.soak import documented_growth, repeated_share, run_text_soak
    from keepkv.methods import METHODS

    from conftest import tiny_model

    model = tiny_model("llama-gqa", layers=2)
    prompt = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(0))
    result = run_text_soak(model, None, sorted(METHODS), 16, prompt, steps=160, checkpoints=(40, 160), progress=False)
    by_method = {record["method"]: record for record in result["methods"]}
    assert list(by_method) == ["full", *[m for m in sorted(METHODS) if m != "full"]]
    full = by_method["full"]
    assert full["checkpoints"][-1]["cache_bytes"] > full["checkpoints"][0]["cache_bytes"]  # it keeps every token
    for method, record in by_method.items():
        assert len(record["generated"]) == 160
        assert record["repeated_share"] == repeated_share(record["generated"])
        assert record["repeated_share"] <= full["repeated_share"] + 0.05, method
        if method != "full":
            first, last = record["checkpoints"]
            assert record["bounded"] is True, method
            assert last["cache_bytes"] - first["cache_bytes"] <= documented_growth(method, model.config) * 120, method


def test_repeated_share_counts_ngrams_seen_before():
    from keepkv.bench.soak import repeated_share

    assert repeated_share(list(range(50))) == 0.0
    assert repeated_share([7] * 10) == 1 - 1 / 7  # one distinct 4-gram of seven
    assert repeated_share([1, 2, 3]) == 0.0
