"""Answer metrics (SQuAD, LongBench, RULER), distribution distance and confidence intervals.

Every answer metric has the form ``metric(prediction, answers) -> float`` in
[0, 1], where ``answers`` is one reference string or a list of them; unless
stated otherwise the score is the best over the references, as in LongBench.

Differences from the reference implementations, all to avoid dependencies:

- ``rouge_l`` is sentence-level LCS F1 on lowercase alphanumeric tokens (as
  Google's ``rouge_score`` rougeL without stemming). LongBench calls the
  ``rouge`` package, whose summary-level union LCS splits on periods.
- ``qa_f1_zh`` and ``rouge_l_zh`` use characters as tokens; LongBench
  segments Chinese with ``jieba``.
- ``code_similarity`` uses ``edit_similarity`` (Levenshtein); LongBench uses
  ``fuzzywuzzy``'s ``fuzz.ratio``.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

import torch

Answers = str | Sequence[str]

_ZH_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_ALL_PUNCTUATION = frozenset(string.punctuation + _ZH_PUNCTUATION)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PARAGRAPH_ID = re.compile(r"(?:Paragraph |段落)(\d+)")
_NUMBER = re.compile(r"\d+")


def _as_list(answers: Answers) -> list[str]:
    answer_list = [answers] if isinstance(answers, str) else list(answers)
    if not answer_list:
        raise ValueError("answers is empty")
    return answer_list


# ---------------------------------------------------------------- normalisation


def normalize_answer(text: str) -> str:
    """SQuAD / LongBench normalisation: lowercase, drop punctuation and articles, squeeze spaces."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return " ".join(_ARTICLES.sub(" ", text).split())


def normalize_zh_answer(text: str) -> str:
    """LongBench's Chinese normalisation: lowercase, drop ASCII and CJK punctuation and all whitespace."""
    return "".join(ch for ch in text.lower() if ch not in _ALL_PUNCTUATION and not ch.isspace())


# ---------------------------------------------------------------- overlap scores


def _f1(overlap: int, num_predicted: int, num_reference: int) -> float:
    if overlap == 0:
        return 0.0
    precision, recall = overlap / num_predicted, overlap / num_reference
    return 2 * precision * recall / (precision + recall)


def _token_f1(predicted: Sequence[str], reference: Sequence[str]) -> float:
    overlap = sum((Counter(predicted) & Counter(reference)).values())
    return _f1(overlap, len(predicted), len(reference))


def _lcs_length(a: Sequence, b: Sequence) -> int:
    """Length of the longest common subsequence (dynamic programming, two rows)."""
    if len(a) < len(b):
        a, b = b, a
    previous = [0] * (len(b) + 1)
    for item in a:
        current = [0]
        for j, other in enumerate(b):
            current.append(previous[j] + 1 if item == other else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def exact_match(prediction: str, answers: Answers) -> float:
    """1.0 when the normalised prediction equals a normalised answer, else 0.0."""
    predicted = normalize_answer(prediction)
    return float(any(predicted == normalize_answer(answer) for answer in _as_list(answers)))


def qa_f1(prediction: str, answers: Answers) -> float:
    """SQuAD / LongBench token F1 on normalised words, best over the answers."""
    predicted = normalize_answer(prediction).split()
    return max(_token_f1(predicted, normalize_answer(answer).split()) for answer in _as_list(answers))


def qa_f1_zh(prediction: str, answers: Answers) -> float:
    """Token F1 for Chinese with characters as tokens (LongBench segments with jieba)."""
    predicted = list(normalize_zh_answer(prediction))
    return max(_token_f1(predicted, list(normalize_zh_answer(answer))) for answer in _as_list(answers))


def _rouge_tokens(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def rouge_l(prediction: str, answers: Answers) -> float:
    """ROUGE-L F1: longest common subsequence of lowercase alphanumeric tokens.

    With ``L`` the LCS length, ``P = L / len(prediction)`` and
    ``R = L / len(reference)``, the score is ``2PR / (P + R)``.
    """
    predicted = _rouge_tokens(prediction)
    scores = []
    for answer in _as_list(answers):
        reference = _rouge_tokens(answer)
        scores.append(_f1(_lcs_length(predicted, reference), len(predicted), len(reference)))
    return max(scores)


def rouge_l_zh(prediction: str, answers: Answers) -> float:
    """ROUGE-L F1 with characters as tokens, whitespace dropped (LongBench segments with jieba)."""
    predicted = "".join(prediction.split())
    scores = []
    for answer in _as_list(answers):
        reference = "".join(answer.split())
        scores.append(_f1(_lcs_length(predicted, reference), len(predicted), len(reference)))
    return max(scores)


# ---------------------------------------------------------------- code


def levenshtein(a: str, b: str) -> int:
    """Edit distance with unit costs for insertion, deletion and substitution."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def edit_similarity(prediction: str, answers: Answers) -> float:
    """``1 - levenshtein(prediction, answer) / max(len(prediction), len(answer))``, best over answers.

    This is the edit similarity of code-completion benchmarks (CodeXGLUE,
    RepoBench), not ``fuzz.ratio``: "kitten" / "sitting" gives
    1 - 3/7 = 0.571 here and 2*4/13 = 0.615 with ``fuzz.ratio``. Two empty
    strings score 1.
    """
    scores = []
    for answer in _as_list(answers):
        longest = max(len(prediction), len(answer))
        scores.append(1.0 - levenshtein(prediction, answer) / longest if longest else 1.0)
    return max(scores)


def code_similarity(prediction: str, answers: Answers) -> float:
    """LongBench ``code_sim``: ``edit_similarity`` of the first prediction line that is not a comment.

    Lines containing a backtick, ``#`` or ``//`` are skipped, as in LongBench.
    """
    first_code_line = next(
        (line for line in prediction.lstrip("\n").split("\n") if not any(mark in line for mark in ("`", "#", "//"))),
        "",
    )
    return edit_similarity(first_code_line, answers)


# ---------------------------------------------------------------- LongBench classification and synthetic


def classification_score(prediction: str, answers: Answers, all_classes: Sequence[str]) -> float:
    """LongBench classification (TREC, LSHT).

    The classes named in the prediction are found by substring match; those
    that are strict substrings of the answer are dropped. The score is
    ``1 / len(named)`` when the answer is among them, else 0. (LongBench drops
    them while iterating over the same list, which can skip one; this is the
    intended rule.)
    """
    scores = []
    for answer in _as_list(answers):
        named = [c for c in all_classes if c in prediction and not (c in answer and c != answer)]
        scores.append(1.0 / len(named) if answer in named else 0.0)
    return max(scores)


def _share_equal_to(numbers: list[str], target: str) -> float:
    return sum(number == target for number in numbers) / len(numbers) if numbers else 0.0


def retrieval_score(prediction: str, answers: Answers) -> float:
    """LongBench passage retrieval (en and zh).

    The answer names a paragraph ("Paragraph 12" or "段落12"); the score is the
    share of numbers in the prediction equal to its id.
    """
    numbers = _NUMBER.findall(prediction)
    scores = []
    for answer in _as_list(answers):
        match = _PARAGRAPH_ID.search(answer)
        if match is None:
            raise ValueError(f"retrieval answer names no paragraph: {answer!r}")
        scores.append(_share_equal_to(numbers, match.group(1)))
    return max(scores)


def count_score(prediction: str, answers: Answers) -> float:
    """LongBench passage count: share of numbers in the prediction equal to the answer."""
    numbers = _NUMBER.findall(prediction)
    return max(_share_equal_to(numbers, str(answer)) for answer in _as_list(answers))


# ---------------------------------------------------------------- RULER


def string_match_all(prediction: str, answers: Answers) -> float:
    """RULER: share of the answers contained in the prediction (case-insensitive)."""
    answer_list = _as_list(answers)
    predicted = prediction.lower()
    return sum(answer.lower() in predicted for answer in answer_list) / len(answer_list)


def string_match_part(prediction: str, answers: Answers) -> float:
    """RULER: 1.0 when any answer is contained in the prediction (case-insensitive), else 0.0."""
    predicted = prediction.lower()
    return float(any(answer.lower() in predicted for answer in _as_list(answers)))


# ---------------------------------------------------------------- LongBench registry

Metric = Callable[..., float]

LONGBENCH_METRICS: dict[str, Metric] = {
    "narrativeqa": qa_f1,
    "qasper": qa_f1,
    "multifieldqa_en": qa_f1,
    "multifieldqa_zh": qa_f1_zh,
    "hotpotqa": qa_f1,
    "2wikimqa": qa_f1,
    "musique": qa_f1,
    "dureader": rouge_l_zh,
    "gov_report": rouge_l,
    "qmsum": rouge_l,
    "multi_news": rouge_l,
    "vcsum": rouge_l_zh,
    "trec": classification_score,
    "triviaqa": qa_f1,
    "samsum": rouge_l,
    "lsht": classification_score,
    "passage_count": count_score,
    "passage_retrieval_en": retrieval_score,
    "passage_retrieval_zh": retrieval_score,
    "lcc": code_similarity,
    "repobench-p": code_similarity,
}
FIRST_LINE_TASKS = frozenset({"trec", "triviaqa", "samsum", "lsht"})


def longbench_score(task: str, prediction: str, answers: Answers, all_classes: Sequence[str] = ()) -> float:
    """Score one LongBench prediction the way LongBench's ``eval.py`` does.

    Few-shot tasks (``FIRST_LINE_TASKS``) keep only the prediction's first
    line; ``all_classes`` goes to the classification tasks.
    """
    if task not in LONGBENCH_METRICS:
        raise ValueError(f"unknown LongBench task {task!r}; known: {', '.join(LONGBENCH_METRICS)}")
    if task in FIRST_LINE_TASKS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = LONGBENCH_METRICS[task]
    if metric is classification_score:
        return classification_score(prediction, answers, all_classes)
    return metric(prediction, answers)


# ---------------------------------------------------------------- distributions and statistics


def kl_divergence(logp_ref: torch.Tensor, logp: torch.Tensor) -> float:
    """KL(ref || model) over the last axis, averaged over all other positions.

    Parameters
    ----------
    logp_ref, logp : torch.Tensor
        Log-probabilities of the same shape ``[..., vocab]``, e.g. the
        full-cache and the compressed-cache model. Both are passed through
        ``log_softmax``, so raw logits work too. Computed in at least fp32;
        entries where the reference has probability 0 contribute 0.
    """
    if logp_ref.shape != logp.shape:
        raise ValueError(f"shape mismatch: {tuple(logp_ref.shape)} vs {tuple(logp.shape)}")
    dtype = torch.promote_types(logp_ref.dtype, torch.float32)
    ref = torch.log_softmax(logp_ref.to(dtype), dim=-1)
    model = torch.log_softmax(logp.to(dtype), dim=-1)
    ref_prob = ref.exp()
    terms = torch.where(ref_prob > 0, ref_prob * (ref - model), torch.zeros_like(ref))
    return terms.sum(dim=-1).mean().item()


# Two-sided 95% quantiles of Student's t, t_{0.975}(df), for df = 1..30.
_T975 = (
    12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
    2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
    2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423,
)
_Z975 = 1.959964


def t_quantile_975(df: int) -> float:
    """Student's t 97.5% quantile: a table up to df = 30, then the Cornish-Fisher expansion.

    The expansion in powers of 1/df is accurate to about 1e-5 beyond df = 30.
    """
    if df < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
    )


def mean_ci95(values: Sequence[float]) -> tuple[float, float]:
    """Mean and half-width of its 95% confidence interval.

    The half-width is ``t_{0.975}(n - 1) * s / sqrt(n)`` with ``s`` the sample
    standard deviation (Student's t, exact for normal data and conservative
    for small ``n``). With one value the half-width is ``nan``.
    """
    n = len(values)
    if n == 0:
        raise ValueError("mean_ci95 needs at least one value")
    mean = math.fsum(values) / n
    if n == 1:
        return mean, math.nan
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, t_quantile_975(n - 1) * std / math.sqrt(n)
