import math

import pytest
import torch

from keepkv.eval.metrics import (
    LONGBENCH_METRICS,
    classification_score,
    code_similarity,
    count_score,
    edit_similarity,
    exact_match,
    kl_divergence,
    levenshtein,
    longbench_score,
    mean_ci95,
    normalize_answer,
    qa_f1,
    qa_f1_zh,
    retrieval_score,
    rouge_l,
    rouge_l_zh,
    string_match_all,
    string_match_part,
    t_quantile_975,
)


def test_normalize_answer_drops_case_punctuation_articles_and_extra_spaces():
    assert normalize_answer("  The Cat,  sat on A mat! ") == "cat sat on mat"


def test_exact_match():
    assert exact_match("The Cat!", ["a dog", "cat"]) == 1.0
    assert exact_match("cats", "cat") == 0.0


def test_qa_f1_by_hand():
    # "the cat sat" -> [cat, sat] (article dropped); "cat sat down" -> [cat, sat, down].
    # 2 tokens in common: precision 2/2, recall 2/3, F1 = 2 * 1 * 2/3 / (1 + 2/3) = 0.8.
    assert qa_f1("the cat sat", "cat sat down") == pytest.approx(0.8)
    assert qa_f1("cat", ["dog", "The cat."]) == 1.0
    assert qa_f1("dog", "cat") == 0.0


def test_qa_f1_zh_uses_characters():
    # [北, 京, 市] vs [北, 京]: precision 2/3, recall 1, F1 = 2 * 2/3 / (5/3) = 0.8.
    assert qa_f1_zh("北京市。", "北京") == pytest.approx(0.8)


def test_rouge_l_by_hand():
    # LCS of "police killed the gunman" and "police kill the gunman" is "police the gunman":
    # 3 of 4 tokens on each side, so P = R = F = 0.75 (Lin 2004's example).
    assert rouge_l("police killed the gunman", "police kill the gunman") == pytest.approx(0.75)
    # LCS "the cat on the mat" (5): P = 5/6, R = 5/7, F = 2 * (5/6)(5/7) / (5/6 + 5/7) = 10/13.
    assert rouge_l("The cat sat on the mat.", "the cat lay down on the mat") == pytest.approx(10 / 13)
    assert rouge_l("", "anything") == 0.0
    assert rouge_l("same words", ["other", "Same words!"]) == 1.0


def test_rouge_l_zh_uses_characters():
    # 北京大学 vs 北京的大学: LCS 4, P = 4/4, R = 4/5, F = 2 * 0.8 / 1.8 = 8/9.
    assert rouge_l_zh("北京大学", "北京的大学") == pytest.approx(8 / 9)


def test_edit_similarity_kitten_sitting():
    # kitten -> sitten -> sittin -> sitting: 3 edits; 1 - 3/7.
    assert levenshtein("kitten", "sitting") == 3
    assert edit_similarity("kitten", "sitting") == pytest.approx(4 / 7)
    assert edit_similarity("", "") == 1.0
    assert edit_similarity("abc", ["xyz", "abc"]) == 1.0


def test_code_similarity_skips_comment_lines():
    assert code_similarity("\n# the next line\nx = 1\ny = 2", "x = 1") == 1.0
    assert code_similarity("// only comments", "x = 1") == 0.0


def test_classification_score():
    classes = ["Date", "City", "Other", "Other number"]
    assert classification_score("Date", "Date", classes) == 1.0
    assert classification_score("Date or City", "Date", classes) == 0.5
    assert classification_score("City", "Date", classes) == 0.0
    # "Other" is a strict substring of the answer "Other number", so it does not count against it.
    assert classification_score("Other number", "Other number", classes) == 1.0


def test_retrieval_and_count_scores():
    assert retrieval_score("Paragraph 3", "Paragraph 3") == 1.0
    assert retrieval_score("Paragraph 3 or Paragraph 5", "Paragraph 3") == 0.5
    assert retrieval_score("no idea", "Paragraph 3") == 0.0
    assert retrieval_score("答案是段落12", "段落12") == 1.0
    with pytest.raises(ValueError, match="names no paragraph"):
        retrieval_score("3", "three")
    assert count_score("There are 4 unique paragraphs, not 5.", "4") == 0.5
    assert count_score("four", "4") == 0.0


def test_ruler_string_match():
    assert string_match_all("Numbers: 123 and 456", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert string_match_part("Numbers: 123 and 456", ["123", "456", "789"]) == 1.0
    assert string_match_all("the words are AMBER-FALCON", ["amber-falcon"]) == 1.0
    assert string_match_part("nothing", ["123"]) == 0.0
    with pytest.raises(ValueError, match="empty"):
        string_match_all("x", [])


def test_longbench_score_dispatches_and_keeps_first_line_for_few_shot_tasks():
    classes = ["Date", "City"]
    assert longbench_score("trec", "\nDate\nCity", ["Date"], classes) == 1.0
    assert longbench_score("hotpotqa", "the cat sat", ["cat sat down"]) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="unknown LongBench task"):
        longbench_score("nope", "x", ["x"])
    assert {"narrativeqa", "2wikimqa", "repobench-p", "passage_retrieval_zh", "vcsum"} <= set(LONGBENCH_METRICS)


def test_kl_divergence_by_hand():
    # p = (1/2, 1/2), q = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3).
    p = torch.tensor([[0.5, 0.5], [0.5, 0.5]]).log()
    q = torch.tensor([[0.25, 0.75], [0.5, 0.5]]).log()
    # Mean over the two positions: the second has KL 0.
    assert kl_divergence(p, q) == pytest.approx(0.25 * math.log(4 / 3), rel=1e-6)
    assert kl_divergence(p[:1], q[:1]) == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6)
    assert kl_divergence(p + 3.0, q - 1.0) == pytest.approx(kl_divergence(p, q), rel=1e-6)  # raw logits
    assert kl_divergence(p, p) == pytest.approx(0.0, abs=1e-7)


def test_kl_divergence_ignores_zero_probability_reference_entries():
    # p = (1, 0), q = (1/2, 1/2): KL = ln 2.
    p = torch.tensor([0.0, float("-inf")])
    q = torch.tensor([0.5, 0.5]).log()
    assert kl_divergence(p, q) == pytest.approx(math.log(2), rel=1e-6)
    with pytest.raises(ValueError, match="shape"):
        kl_divergence(p, q[:1])


def test_mean_ci95_by_hand():
    # [1, 2, 3]: mean 2, sample sd 1, t_{0.975}(2) = 4.3027, half-width 4.3027 / sqrt(3) = 2.4841.
    mean, half_width = mean_ci95([1, 2, 3])
    assert mean == 2.0
    assert half_width == pytest.approx(4.3027 / math.sqrt(3))
    mean, half_width = mean_ci95([0.7])
    assert mean == 0.7 and math.isnan(half_width)
    assert mean_ci95([5, 5, 5]) == (5.0, 0.0)
    with pytest.raises(ValueError):
        mean_ci95([])


def test_t_quantile_beyond_the_table():
    # Published t_{0.975} values for 40, 60 and 120 degrees of freedom; 1.96 in the limit.
    assert t_quantile_975(40) == pytest.approx(2.0211, abs=1e-4)
    assert t_quantile_975(60) == pytest.approx(2.0003, abs=1e-4)
    assert t_quantile_975(120) == pytest.approx(1.9799, abs=1e-4)
    assert t_quantile_975(10**6) == pytest.approx(1.95996, abs=1e-4)
