"""Paired differences (keepkv.eval.paired) and their columns in the summary (keepkv.eval.summary)."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keepkv.eval.paired import mcnemar_exact, pair_records, paired_difference
from keepkv.eval.summary import reference_columns

scores = st.lists(st.floats(-10, 10, allow_nan=False), min_size=2, max_size=30)


def test_known_binary_case_by_hand():
    method = [1, 1, 1, 0, 1, 1, 0, 1]
    reference = [0, 1, 0, 0, 1, 0, 0, 1]
    # d = [1,0,1,0,0,1,0,0]: mean 3/8; s^2 = (3 * 0.625^2 + 5 * 0.375^2) / 7 = 1.875 / 7;
    # half-width t_{0.975}(7) * s / sqrt(8) = 2.3646 * 0.517549 / 2.828427 = 0.432677.
    paired = paired_difference(method, reference)
    assert paired.mean == pytest.approx(0.375)
    assert paired.ci95 == pytest.approx(2.3646 * math.sqrt(1.875 / 7) / math.sqrt(8), rel=1e-9)
    assert paired.ci95 == pytest.approx(0.432677, abs=1e-6)
    assert (paired.n, paired.wins, paired.losses) == (8, 3, 0)
    # Three discordant pairs, all one way: p = 2 * (1/2)^3.
    assert paired.mcnemar_p == pytest.approx(0.25)
    assert not paired.resolved


def test_known_continuous_case_by_hand():
    # d = [1, 2, 3]: mean 2, s = 1, half-width t_{0.975}(2) / sqrt(3) = 4.3027 / 1.7320508.
    paired = paired_difference([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
    assert paired.mean == pytest.approx(2.0)
    assert paired.ci95 == pytest.approx(2.484166, abs=1e-6)
    assert paired.mcnemar_p is None
    assert not paired.resolved  # 2 < 2.48
    assert paired_difference([2.0, 4.0, 6.0, 8.0], [1.0, 2.0, 3.0, 4.0]).resolved


@given(scores)
def test_identical_methods_differ_by_zero(values):
    paired = paired_difference(values, values)
    assert paired.mean == 0 and paired.ci95 == 0
    assert (paired.wins, paired.losses) == (0, 0)
    assert not paired.resolved


@settings(max_examples=50)
@given(st.lists(st.tuples(st.floats(-5, 5), st.floats(-5, 5), st.floats(-100, 100)), min_size=2, max_size=20))
def test_shared_sample_difficulty_cancels(triples):
    """Adding a per-sample offset to both methods (a harder sample) changes nothing."""
    method = [a for a, _, _ in triples]
    reference = [b for _, b, _ in triples]
    plain = paired_difference(method, reference)
    shifted = paired_difference([a + c for a, _, c in triples], [b + c for _, b, c in triples])
    assert shifted.mean == pytest.approx(plain.mean, abs=1e-6)
    assert shifted.ci95 == pytest.approx(plain.ci95, abs=1e-6)


@given(scores, scores)
def test_antisymmetric(a, b):
    n = min(len(a), len(b))
    forward, backward = paired_difference(a[:n], b[:n]), paired_difference(b[:n], a[:n])
    assert forward.mean == pytest.approx(-backward.mean, abs=1e-9)
    assert forward.ci95 == pytest.approx(backward.ci95, abs=1e-9)
    assert (forward.wins, forward.losses) == (backward.losses, backward.wins)


def test_all_equal_binary_differences_need_enough_samples():
    """Four samples that all flip give -1 ± 0 (t degenerates), but McNemar p = 0.125: a tie;
    six give p = 2 / 64 < 0.05: resolved."""
    four = paired_difference([0] * 4, [1] * 4)
    assert (four.mean, four.ci95, four.mcnemar_p) == (-1.0, 0.0, 0.125)
    assert not four.resolved
    assert paired_difference([0] * 6, [1] * 6).resolved
    assert paired_difference([0.0, 0.5, 0.0, 0.5], [1.0] * 4).mcnemar_p is None  # not 0/1: t alone


def test_mcnemar_exact_values():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(5, 5) == 1.0
    assert mcnemar_exact(6, 0) == pytest.approx(2 / 64)
    # b = 8, c = 2: 2 * (C(10,0) + C(10,1) + C(10,2)) / 2^10 = 2 * 56 / 1024.
    assert mcnemar_exact(8, 2) == pytest.approx(112 / 1024)
    assert mcnemar_exact(2, 8) == mcnemar_exact(8, 2)
    with pytest.raises(ValueError, match=">= 0"):
        mcnemar_exact(-1, 2)


def test_bad_input_is_one_line():
    with pytest.raises(ValueError, match="equal lengths"):
        paired_difference([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="at least one"):
        paired_difference([], [])


def test_records_pair_by_sample_id_not_order():
    method = [{"id": "b", "score": 1.0}, {"id": "a", "score": 0.0}, {"id": "c", "score": 1.0}]
    reference = [{"id": "a", "score": 0.0}, {"id": "b", "score": 0.0}]
    paired = pair_records(method, reference)
    assert paired.n == 2 and paired.mean == pytest.approx(0.5) and paired.wins == 1
    assert pair_records(method, [{"id": "z", "score": 1.0}]) is None


def test_reference_columns_pair_at_the_same_budget():
    ones = [{"id": i, "score": 1.0} for i in range(4)]
    zeros = [{"id": i, "score": 0.0} for i in range(4)]
    cells = {("full", 1.0): ones, ("a", 0.1): zeros, ("a", 0.2): ones, ("b", 0.1): ones, ("b", 0.2): ones}
    columns = reference_columns(cells, "b")
    assert set(columns) == {("a", 0.1), ("a", 0.2), ("b", 0.1), ("b", 0.2)}
    assert columns[("a", 0.1)]["diff_ref"] == -1.0 and columns[("a", 0.1)]["diff_ref_p"] == pytest.approx(2 / 16)
    assert columns[("a", 0.2)]["diff_ref"] == 0.0 and columns[("a", 0.2)]["diff_ref_ci95"] == 0.0
    assert columns[("b", 0.1)]["diff_ref"] == 0.0


def _cell(scores):
    return [{"id": f"s{i}", "score": score} for i, score in enumerate(scores)]


def test_resolution_of_binary_cells_by_hand():
    from keepkv.eval.paired import resolution

    found = resolution({
        "a": _cell([1, 1, 1, 0, 1, 1, 0, 1]),
        "b": _cell([0, 1, 0, 0, 1, 0, 0, 1]),
        "c": _cell([0, 1, 0, 0, 1, 0, 0, 1]),
    })
    # a-b and a-c: 0.432677 each (the hand-computed case above); b-c: identical, 0.
    assert not found.relative and found.pairs == 3 and found.target == 0.15
    assert found.worst == pytest.approx(0.432677, abs=1e-6) and found.worst_pair == ("a", "b")
    assert found.median == pytest.approx(0.432677, abs=1e-6)
    assert found.within == 1
    assert found.resolved == 0  # a-b: 0.375 ± 0.43; b-c: no difference at all
    assert found.close_median == 0.0  # only b-c (means 0.375 each) are close; a's mean is 0.75


def test_resolution_of_continuous_cells_is_relative_to_the_pair_mean():
    from keepkv.eval.paired import resolution

    found = resolution({"a": _cell([2.0, 4.0, 6.0]), "b": _cell([1.0, 2.0, 3.0])})
    # half-width 2.484166 (the continuous case above) over the pair's mean score (4 + 2) / 2 = 3.
    assert found.relative and math.isnan(found.target)  # no blanket target for KL: close pairs instead
    assert found.worst == pytest.approx(2.484166 / 3, abs=1e-6)
    assert found.within == 0
    assert found.resolved == 0 and math.isnan(found.close_median)  # means 4 and 2: not close
    # c = b + 0.1 on every sample: resolved (interval 0.1 ± 0), close (means 2.1 vs 2), width 0.
    found = resolution({"a": _cell([2.0, 4.0, 6.0]), "b": _cell([1.0, 2.0, 3.0]), "c": _cell([1.1, 2.1, 3.1])})
    assert found.pairs == 3 and found.resolved == 1 and found.within == 0
    assert found.close_median == pytest.approx(0.0, abs=1e-12)
    assert found.median == pytest.approx(2.484166 / 3.05, abs=1e-6)  # a-c, the middle of 0, 0.8145, 0.828
    assert resolution({"a": _cell([1.0, 2.0])}) is None


def test_close_pairs_are_the_pairs_with_near_means_closest_first():
    from keepkv.eval.paired import close_pairs

    cells = {
        "a": _cell([2.0, 4.0, 6.0]),  # mean 4
        "b": _cell([1.0, 2.0, 3.0]),  # mean 2: not within 1.25x of a
        "c": _cell([1.1, 2.1, 3.1]),  # mean 2.1: close to b, b + 0.1 on every sample
        "d": _cell([1.2, 2.5, 3.1]),  # mean 2.2667: close to b (1.133x) and c (1.079x)
    }
    found = close_pairs(cells)
    assert [(first, second) for first, second, _, _ in found] == [("b", "c"), ("c", "d"), ("b", "d")]
    first, second, difference, width = found[0]
    assert difference.mean == pytest.approx(-0.1) and difference.ci95 == pytest.approx(0.0, abs=1e-12)
    assert difference.resolved and width == pytest.approx(0.0, abs=1e-12)
    assert found[2][3] == pytest.approx(found[2][2].ci95 / ((2.0 + 6.8 / 3) / 2))
    assert close_pairs({"a": _cell([1.0, 2.0])}) == []
