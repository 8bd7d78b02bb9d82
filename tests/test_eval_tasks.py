import json
import re
from collections import Counter
from pathlib import Path

import pytest

from keepkv.eval.datasets import LONGBENCH_TEMPLATES, load_jsonl, load_longbench
from keepkv.eval.metrics import LONGBENCH_METRICS
from keepkv.eval.tasks import (
    prose_corpus,
    FIDELITY_INSTRUCTIONS,
    SUITES,
    approx_token_count,
    make_aggregation,
    make_fidelity,
    make_needle,
    make_ppl,
    make_suite,
    make_tracking,
)

FIXTURES = Path(__file__).parent / "fixtures"

CONFIGS = [
    ("needle", {}),
    ("needle", {"variant": "multikey", "haystack": "prose", "value_type": "uuid"}),
    ("needle", {"variant": "multivalue", "value_type": "word"}),
    ("needle", {"variant": "multiquery", "haystack": "prose"}),
    ("tracking", {}),
    ("tracking", {"haystack": "prose", "num_chains": 2}),
    ("aggregation", {"variant": "cwe"}),
    ("aggregation", {"variant": "fwe"}),
    ("ppl", {}),
    ("fidelity", {}),
    ("passkey", {}),
    ("passkey", {"digits": 4}),
    ("needle", {"haystack": "prose", "digits": 5}),
]
CONFIG_IDS = [name + "-" + "-".join(map(str, variant.values())) for name, variant in CONFIGS]


# ---------------------------------------------------------------- every generator


@pytest.mark.parametrize(("name", "variant"), CONFIGS, ids=CONFIG_IDS)
def test_same_seed_gives_identical_samples(name, variant):
    assert make_suite(name, 3, 500, 7, **variant) == make_suite(name, 3, 500, 7, **variant)


@pytest.mark.parametrize(("name", "variant"), CONFIGS, ids=CONFIG_IDS)
def test_different_seed_gives_different_samples(name, variant):
    first = make_suite(name, 3, 500, 7, **variant)
    second = make_suite(name, 3, 500, 8, **variant)
    assert all(a.context != b.context for a, b in zip(first, second))
    assert len({s.context for s in first}) == 3


@pytest.mark.parametrize(("name", "variant"), CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("length_tokens", [600, 3000])
def test_context_length_hits_target_with_char_fallback(name, variant, length_tokens):
    for sample in make_suite(name, 2, length_tokens, 0, **variant):
        tokens = approx_token_count(sample.context)
        assert abs(tokens - length_tokens) <= 0.15 * length_tokens
        assert sample.meta["length_tokens"] == tokens


@pytest.mark.parametrize(("name", "variant"), CONFIGS, ids=CONFIG_IDS)
def test_context_length_uses_the_given_tokenizer(name, variant):
    def count_words(text):
        return len(text.split())

    for sample in make_suite(name, 2, 800, 0, count_words, **variant):
        assert abs(count_words(sample.context) - 800) <= 0.15 * 800


def test_samples_do_not_depend_on_how_many_are_asked_for():
    assert make_tracking(2, 500, 3) == make_tracking(5, 500, 3)[:2]


def test_make_suite_rejects_unknown_names_and_variants():
    with pytest.raises(ValueError, match="needle.*tracking"):
        make_suite("nope", 1, 100, 0)
    with pytest.raises(ValueError, match="multikey"):
        make_needle(1, 100, 0, variant="bogus")
    with pytest.raises(ValueError, match="noise"):
        make_tracking(1, 100, 0, haystack="bogus")
    with pytest.raises(ValueError, match="pydoc"):
        make_suite("kl", 1, 100, 0, source="bogus")
    assert set(SUITES) == {"needle", "tracking", "aggregation", "passkey", "ppl", "fidelity", "kl"}


@pytest.mark.parametrize("source", ["pydoc", "stdlib"])
def test_kl_text_is_real_seeded_and_fitted(source):
    import sysconfig

    samples = make_suite("kl", 3, 1200, 7, source=source)
    assert samples == make_suite("kl", 2, 1200, 7, source=source) + samples[2:]
    assert len({s.context for s in samples}) == 3
    for sample in samples:
        assert abs(sample.meta["length_tokens"] - 1200) <= 0.01 * 1200
        assert sample.question == "" and sample.answers == []
        if source == "stdlib":
            code = (Path(sysconfig.get_paths()["stdlib"]) / sample.meta["file"]).read_text(encoding="utf-8")
            assert code.startswith(sample.context) and sample.context.endswith("\n")  # the head, whole lines
            assert "/test" not in "/" + sample.meta["file"] and "encodings" not in sample.meta["file"]
        else:
            assert sample.context[:200] in prose_corpus()


def test_suite_too_long_for_its_vocabulary_is_refused():
    with pytest.raises(ValueError, match="cannot fill"):
        make_aggregation(1, 200_000, 0, variant="cwe")


# ---------------------------------------------------------------- needle


@pytest.mark.parametrize("haystack", ["noise", "prose"])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_needle_sits_at_the_requested_depth(haystack, depth):
    (sample,) = make_needle(1, 2000, 0, haystack=haystack, depth=depth)
    (needle,) = sample.meta["needles"]
    position = sample.context.index(needle) / len(sample.context)
    assert abs(position - depth) < 0.05


def test_needle_depths_spread_evenly_by_default():
    samples = make_needle(5, 500, 0)
    assert [s.meta["depth"] for s in samples] == [0.0, 0.25, 0.5, 0.75, 1.0]
    positions = [s.context.index(s.meta["needles"][0]) for s in samples]
    assert positions == sorted(positions)


def test_needle_single_sample_shape():
    (sample,) = make_needle(1, 500, 0)
    (value,) = sample.answers
    assert re.fullmatch(r"\d{7}", value)
    key = re.search(r"for (\S+) mentioned", sample.question).group(1)
    assert f"One of the special magic numbers for {key} is: {value}." in sample.context
    assert sample.question == f"What is the special magic number for {key} mentioned in the provided text?"
    assert sample.answer_prefix == f"The special magic number for {key} mentioned in the provided text is"


def test_needle_multikey_has_distractors_and_one_answer():
    (sample,) = make_needle(1, 800, 0, variant="multikey", num_needles=4)
    assert len(sample.answers) == 1
    needles = sample.meta["needles"]
    assert len(needles) == 4 and all(n in sample.context for n in needles)
    assert len({re.search(r"for (\S+) is", n).group(1) for n in needles}) == 4


@pytest.mark.parametrize("variant", ["multivalue", "multiquery"])
def test_needle_multi_answer_variants_need_all_values(variant):
    (sample,) = make_needle(1, 800, 0, variant=variant, num_needles=3)
    assert len(sample.answers) == 3
    assert all(answer in sample.context for answer in sample.answers)
    assert sample.question.startswith("What are all the special magic numbers for")
    keys = {re.search(r"for (\S+) is", n).group(1) for n in sample.meta["needles"]}
    assert len(keys) == (1 if variant == "multivalue" else 3)
    assert all(key in sample.question for key in keys)


def test_needle_uuid_values():
    (sample,) = make_needle(1, 300, 0, value_type="uuid")
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", sample.answers[0])


# ---------------------------------------------------------------- tracking, aggregation, prose


def test_tracking_chain_is_ordered_and_answers_are_its_variables():
    (sample,) = make_tracking(1, 1500, 0, num_chains=2, num_hops=4)
    names = sample.answers
    assert len(names) == 5
    value = re.search(r"assigned the value (\d+)", sample.question).group(1)
    statements = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    positions = [sample.context.index(statement) for statement in statements]
    assert positions == sorted(positions)
    assert len(re.findall(r"VAR [A-Z]{5} = \d+\.", sample.context)) == 2
    assert "5 variables are assigned the value" in sample.answer_prefix


def test_cwe_answers_are_the_most_common_words():
    (sample,) = make_aggregation(1, 2000, 0, variant="cwe")
    words = re.findall(r"^\d+\. (\S+)$", sample.context, flags=re.MULTILINE)
    counts = Counter(words)
    assert len(sample.answers) == 10
    assert {word for word, _ in counts.most_common(10)} == set(sample.answers)
    assert min(counts[w] for w in sample.answers) > max(c for w, c in counts.items() if w not in sample.answers)


def test_fwe_answers_are_the_three_most_frequent_coded_words():
    (sample,) = make_aggregation(1, 2000, 0, variant="fwe")
    words = sample.context.split("\n", 1)[1].split()
    ranked = [word for word, _ in Counter(words).most_common(4)]
    assert ranked[0] == "...."
    assert ranked[1:] == sample.answers


def test_ppl_samples_are_plain_prose_chunks():
    samples = make_ppl(3, 1000, 0)
    assert all(s.question == "" and s.answers == [] and s.prompt == s.context for s in samples)
    assert len({s.meta["offset"] for s in samples}) == 3


def test_fidelity_cycles_instructions_unless_one_is_given():
    samples = make_fidelity(5, 400, 0)
    assert [s.question for s in samples] == [FIDELITY_INSTRUCTIONS[i % len(FIDELITY_INSTRUCTIONS)] for i in range(5)]
    assert all(s.answers == [] and s.prompt.endswith(s.question) for s in samples)
    fixed = make_fidelity(2, 400, 0, instruction="Translate the text above into French.")
    assert {s.question for s in fixed} == {"Translate the text above into French."}


# ---------------------------------------------------------------- loaders


def test_load_longbench_reads_fixture_tasks():
    samples = load_longbench(FIXTURES / "longbench")
    assert [s.meta["task"] for s in samples] == ["hotpotqa", "hotpotqa", "trec", "trec"]
    hotpot = samples[0]
    assert hotpot.id == "hotpot-0001" and hotpot.suite == "longbench"
    assert "Rialto Bridge is the oldest" in hotpot.context
    assert hotpot.question.endswith("Question: Which river flows through the city where the Rialto Bridge stands?")
    assert hotpot.answer_prefix == "Answer:" and hotpot.answers == ["Grand Canal"]
    trec = samples[2]
    assert "Other number" in trec.meta["all_classes"] and trec.answers == ["Other number"]
    assert trec.question == "What is the population of Tokyo?"


def test_load_longbench_selects_tasks_and_limits():
    assert [s.id for s in load_longbench(FIXTURES / "longbench", tasks=["trec"], limit=1)] == ["trec-0001"]


def test_load_longbench_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="no such directory"):
        load_longbench(tmp_path / "absent")
    with pytest.raises(ValueError, match="no such file"):
        load_longbench(FIXTURES / "longbench", tasks=["qasper"])
    (tmp_path / "mystery.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="unknown LongBench task 'mystery'"):
        load_longbench(tmp_path)
    (tmp_path / "mystery.jsonl").unlink()
    (tmp_path / "hotpotqa.jsonl").write_text(json.dumps({"context": "c", "answers": ["a"]}) + "\n")
    with pytest.raises(ValueError, match=r"hotpotqa.jsonl:1: missing field\(s\) input"):
        load_longbench(tmp_path)


def test_every_longbench_template_has_a_metric():
    assert set(LONGBENCH_TEMPLATES) == set(LONGBENCH_METRICS)


def test_load_jsonl_reads_fixture():
    samples = load_jsonl(FIXTURES / "qa.jsonl")
    assert [s.id for s in samples] == ["qa-1", "cats", "qa-3"]
    assert samples[0].answers == ["red"] and samples[0].answer_prefix == "Answer:"
    assert samples[1].answers == ["Pepper and Salt", "Salt and Pepper"]
    assert samples[2].answer_prefix == "Platform:" and samples[2].meta == {"source": "handwritten"}
    assert all(s.suite == "qa" for s in samples)
    assert len(load_jsonl(FIXTURES / "qa.jsonl", limit=2)) == 2


def test_load_jsonl_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_jsonl(tmp_path / "absent.jsonl")
    good = json.dumps({"context": "c", "question": "q", "answers": "a"})
    path = tmp_path / "bad.jsonl"
    path.write_text(good + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: malformed JSON"):
        load_jsonl(path)
    path.write_text(good + "\n\n" + json.dumps({"context": "c", "answers": "a"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:3: missing field\(s\) question"):
        load_jsonl(path)
    path.write_text(json.dumps({"context": "c", "question": "q", "answers": [1, 2]}) + "\n")
    with pytest.raises(ValueError, match="answers must be a string or a list of strings"):
        load_jsonl(path)
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="expected a JSON object"):
        load_jsonl(path)


# ---------------------------------------------------------------- pass keys in prose


def test_passkey_hides_one_number_in_prose_and_asks_by_its_context():
    from keepkv.eval.metrics import string_match_all
    from keepkv.eval.tasks import PASSKEY_TEMPLATES, make_passkey

    samples = make_passkey(8, 700, 3)
    assert [s.meta["digits"] for s in samples] == [4, 5] * 4  # several key lengths by default
    assert len({s.question for s in samples}) > 2  # several templates and names
    facts = {template[0].split("{")[0] for template in PASSKEY_TEMPLATES}
    for sample in samples:
        (value,) = sample.answers
        assert value.isdigit() and len(value) == sample.meta["digits"]
        assert sample.context.count(sample.meta["fact"]) == 1 and value in sample.meta["fact"]
        assert any(sample.meta["fact"].startswith(f) for f in facts)
        assert string_match_all(f"{sample.answer_prefix} {value}.", sample.answers) == 1.0
        assert string_match_all(f"{sample.answer_prefix} {int(value) + 1}.", sample.answers) == 0.0
    # real prose, most of it with numbers of its own that a merge could blend into the key
    with_numbers = [bool(re.search(r"\d", s.context.replace(s.meta["fact"], ""))) for s in samples]
    assert sum(with_numbers) >= len(samples) // 2
    assert make_passkey(3, 700, 3, digits=6)[0].meta["digits"] == 6
    with pytest.raises(ValueError, match="digits"):
        make_passkey(1, 700, 3, digits=1)


def test_needle_digits_sets_the_value_length():
    for digits in (4, 5, 7):
        (sample,) = make_needle(1, 500, 2, haystack="prose", digits=digits)
        assert len(sample.answers[0]) == digits and sample.answers[0] in sample.context
    with pytest.raises(ValueError, match="digits"):
        make_needle(1, 500, 2, digits=20)
