"""Paired differences between two methods scored on the same samples.

Every cell of an eval group sees the same samples, so two methods are compared sample by
sample: ``d_i = score_method(i) - score_reference(i)``. The spread of ``d`` excludes the
between-sample spread that both methods share (a hard sample is hard for both), which makes
the paired interval much narrower than the difference of two unpaired intervals.

* Interval: Student t on the per-sample differences, ``mean(d) ± t_{0.975}(n-1) s_d / sqrt(n)``
  (keepkv.eval.metrics.mean_ci95). Two identical methods give ``0 ± 0``.
* 0/1 scores (a needle found or not): McNemar's exact test on the discordant pairs,
  ``p = min(1, 2 P[Binomial(b + c, 1/2) <= min(b, c)])`` with ``b`` the samples only the
  method solves and ``c`` those only the reference solves (McNemar 1947; the exact binomial
  form avoids the chi-square approximation at small counts).

A difference is *resolved* when its 95% interval excludes 0 and, for 0/1 scores, McNemar's
p < 0.05 (the t interval alone is ``± 0`` when every difference is equal, at any n).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .metrics import mean_ci95


@dataclass(frozen=True)
class PairedDifference:
    """``mean`` of ``method - reference`` over ``n`` paired samples, with its 95% half-width.

    ``mcnemar_p`` is set only when both score lists are 0/1; ``wins`` / ``losses`` count the
    samples where the method scores above / below the reference.
    """

    mean: float
    ci95: float
    n: int
    wins: int
    losses: int
    mcnemar_p: float | None = None

    @property
    def resolved(self) -> bool:
        return resolved(self.mean, self.ci95, self.mcnemar_p)


def resolved(mean: float, ci95: float, mcnemar_p: float | None = None) -> bool:
    """The 95% interval ``mean ± ci95`` excludes 0 and, for 0/1 scores, McNemar's p < 0.05.

    The t interval alone degenerates when every difference is equal (four samples that all
    flip from 1 to 0 give ``-1 ± 0``), while McNemar gives p = 0.125 there: both must agree.
    A zero difference with zero spread, or a nan interval (one sample), is not resolved.
    """
    if math.isnan(ci95) or abs(mean) <= ci95:
        return False
    return mcnemar_p is None or math.isnan(mcnemar_p) or mcnemar_p < 0.05


def mcnemar_exact(wins: int, losses: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts (1.0 when there are none).

    Parameters
    ----------
    wins, losses : int
        Pairs where only the method succeeds / only the reference succeeds.
    """
    if wins < 0 or losses < 0:
        raise ValueError(f"discordant counts must be >= 0, got {wins} and {losses}")
    total = wins + losses
    if total == 0:
        return 1.0
    tail = math.fsum(math.comb(total, k) for k in range(min(wins, losses) + 1)) / 2**total
    return min(1.0, 2 * tail)


def _binary(values: Sequence[float]) -> bool:
    return all(value in (0, 1) for value in values)


def paired_difference(scores: Sequence[float], reference: Sequence[float]) -> PairedDifference:
    """Paired difference ``scores - reference`` (same samples, same order).

    Parameters
    ----------
    scores, reference : sequences of float, length n >= 1
        Per-sample scores of the method and of the reference.
    """
    if len(scores) != len(reference):
        raise ValueError(f"paired scores need equal lengths, got {len(scores)} and {len(reference)}")
    if not scores:
        raise ValueError("paired_difference needs at least one sample")
    differences = [a - b for a, b in zip(scores, reference)]
    mean, ci95 = mean_ci95(differences)
    wins = sum(d > 0 for d in differences)
    losses = sum(d < 0 for d in differences)
    p = mcnemar_exact(wins, losses) if _binary(scores) and _binary(reference) else None
    return PairedDifference(mean, ci95, len(differences), wins, losses, p)


def pair_records(records: list[dict], reference: list[dict]) -> PairedDifference | None:
    """Paired difference of two cells' per-sample records, matched by sample ``id``.

    Returns None when the cells share no sample.
    """
    reference_scores = {record["id"]: record["score"] for record in reference}
    pairs = [(r["score"], reference_scores[r["id"]]) for r in records if r["id"] in reference_scores]
    if not pairs:
        return None
    scores, matched = zip(*pairs)
    return paired_difference(list(scores), list(matched))


# The evaluation's resolution target for 0/1 scores: a paired 95% half-width below 0.15 (a 0.15
# difference in accuracy is resolved). Continuous scores (KL) have no blanket target: what a user
# decides on is each method against the one it would replace (the paired table against
# --reference) and the pairs that score alike (close_pairs), which the report lists.
ABSOLUTE_TARGET = 0.15
RELATIVE_TARGET = math.nan
# Pairs whose mean scores differ by less than this factor count as "close" in Resolution.
CLOSE_RATIO = 1.25


@dataclass(frozen=True)
class Resolution:
    """Paired 95% half-widths of every pair of methods in one cell group (same samples, one budget).

    ``relative``: half-widths are divided by the pair's mean score (the mean of both methods'
    means), for continuous scores; 0/1 scores are absolute. ``within`` counts the pairs below
    ``target``, ``resolved`` those whose difference is resolved. ``close_median``: the median
    half-width over the pairs whose means are within ``CLOSE_RATIO`` of each other (nan when
    none are): the resolution where it matters, between methods that score alike.
    """

    pairs: int
    median: float
    worst: float
    worst_pair: tuple[str, str]
    within: int
    target: float
    relative: bool
    resolved: int = 0
    close_median: float = math.nan


def resolution(cells: dict[str, list[dict]]) -> Resolution | None:
    """The resolution of a group's cells, ``method -> per-sample records`` (one budget; the
    full cache left out, since its KL is 0 by definition). None with fewer than two methods."""
    names = sorted(cells)
    scores = {name: [record["score"] for record in cells[name]] for name in names}
    relative = not all(_binary(values) for values in scores.values())
    widths, resolved_pairs, close = {}, 0, []
    for index, first in enumerate(names):
        for second in names[index + 1:]:
            difference = pair_records(cells[first], cells[second])
            if difference is None or math.isnan(difference.ci95):
                continue
            means = sorted(abs(_mean(scores[name])) for name in (first, second))
            scale = sum(means) / 2 if relative else 1.0
            width = difference.ci95 / scale if scale > 0 else math.inf
            widths[(first, second)] = width
            resolved_pairs += difference.resolved
            if means[1] < CLOSE_RATIO * means[0]:
                close.append(width)
    if not widths:
        return None
    target = RELATIVE_TARGET if relative else ABSOLUTE_TARGET
    ordered = sorted(widths.values())
    worst_pair = max(widths, key=widths.get)
    return Resolution(
        pairs=len(ordered), median=_median(ordered), worst=widths[worst_pair], worst_pair=worst_pair,
        within=sum(width < target for width in ordered) if not math.isnan(target) else 0, target=target,
        relative=relative,
        resolved=resolved_pairs, close_median=_median(sorted(close)) if close else math.nan,
    )


def close_pairs(cells: dict[str, list[dict]]) -> list[tuple[str, str, PairedDifference, float]]:
    """The pairs of a group's cells (``method -> records``, one budget) whose mean scores are within
    ``CLOSE_RATIO`` of each other: (first, second, paired difference first − second, its 95%
    half-width relative to the pair's mean), closest means first."""
    names = sorted(cells)
    means = {name: _mean([record["score"] for record in cells[name]]) for name in names}
    found = []
    for index, first in enumerate(names):
        for second in names[index + 1:]:
            low, high = sorted(abs(means[name]) for name in (first, second))
            if not high < CLOSE_RATIO * low:
                continue
            difference = pair_records(cells[first], cells[second])
            if difference is None or math.isnan(difference.ci95):
                continue
            scale = (low + high) / 2
            found.append((first, second, difference, difference.ci95 / scale if scale > 0 else math.inf, high / low))
    return [entry[:4] for entry in sorted(found, key=lambda entry: entry[4])]


def _median(ordered: list[float]) -> float:
    return ordered[len(ordered) // 2]


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)
