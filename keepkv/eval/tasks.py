"""Model-independent evaluation tasks: RULER-style synthetic suites and prose.

Every generator has the signature
``make_<suite>(n, length_tokens, seed, tokenizer_len=None, **variant)`` and
returns ``n`` :class:`Sample` objects.

- ``length_tokens`` is the target token count of ``Sample.context``. The
  question and answer prefix add a few dozen tokens on top.
- ``tokenizer_len`` counts tokens (``str -> int``). Without one, a token is
  taken to be about 4 characters.
- Samples depend only on ``(suite, seed, index)``: the same seed gives the
  same samples, and the first ``k`` samples of ``n`` do not depend on ``n``
  (except the needle depth, which is spread over all ``n``).

RULER scores every synthetic suite here with ``string_match_all``.
``ppl`` and ``fidelity`` have no answers: they are scored against the
full-cache model.
"""

from __future__ import annotations

import math
import os
import random
import re
import string
import sysconfig
import uuid
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache, partial
from pathlib import Path
from pydoc_data.topics import topics as _PYDOC_TOPICS

TokenCounter = Callable[[str], int]


@dataclass
class Sample:
    """One evaluation prompt and its reference answers.

    Attributes
    ----------
    id : str
        Unique within a suite, stable for a given seed.
    suite : str
        Name of the generator or loader that produced the sample.
    context : str
        The long document, including any instruction that precedes it.
    question : str
        What follows the document (empty for ``ppl``).
    answer_prefix : str
        Text the model's answer should start with (may be empty).
    answers : list of str
        Reference answers; empty when the sample is scored against the full cache.
    meta : dict
        Suite-specific details (variant, depth, token count, LongBench classes...).
    """

    id: str
    suite: str
    context: str
    question: str
    answer_prefix: str
    answers: list[str]
    meta: dict = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        """The user message: context and question separated by a blank line."""
        return f"{self.context}\n\n{self.question}" if self.question else self.context


# ---------------------------------------------------------------- shared parts

NOISE_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
HAYSTACKS = ("noise", "prose")

_ADJECTIVES = (
    "amber", "ancient", "brave", "bright", "calm", "clever", "crimson", "curious",
    "daring", "eager", "fearless", "gentle", "golden", "graceful", "hidden", "humble",
    "icy", "jolly", "kind", "lively", "lucky", "mighty", "misty", "noble",
    "odd", "patient", "proud", "quiet", "rapid", "rustic", "silent", "silver",
    "sleepy", "swift", "tender", "tiny", "vivid", "wandering", "witty", "zealous",
)
_NOUNS = (
    "badger", "beacon", "canyon", "cormorant", "falcon", "fern", "glacier", "harbor",
    "heron", "island", "jaguar", "kettle", "lantern", "lemur", "meadow", "mongoose",
    "nebula", "orchard", "otter", "pelican", "pebble", "quartz", "raven", "river",
    "saddle", "salmon", "sparrow", "spruce", "thistle", "tiger", "tulip", "valley",
    "violin", "walrus", "willow", "wombat", "yak", "zebra", "compass", "dolphin",
)
_WORD_PAIRS = tuple(f"{adj}-{noun}" for adj in _ADJECTIVES for noun in _NOUNS)

_FIT_STEPS = 6
_FIT_TOLERANCE = 0.01
_SENTENCE_END = re.compile(r"[.!?]\s+")


def approx_token_count(text: str) -> int:
    """Token count estimate of about 4 characters per token."""
    return math.ceil(len(text) / 4)


def _sample_rng(suite: str, seed: int, index: int) -> random.Random:
    """A generator that depends only on the suite, the seed and the sample index."""
    return random.Random(f"{suite}:{seed}:{index}")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _fit(
    build: Callable[[int], str],
    target: int,
    count: TokenCounter,
    probe: int,
    max_units: int | None = None,
) -> tuple[str, int]:
    """Search the number of filler units whose text is within 1% of ``target`` tokens.

    ``build(units)`` must be deterministic. Token count is close to affine in
    the number of units, so a secant search from ``0`` and ``probe`` units
    converges in one or two steps (at most ``_FIT_STEPS``).

    Returns
    -------
    (text, tokens) : tuple of str and int

    Raises
    ------
    ValueError
        When even ``max_units`` units stay more than 10% short of the target.
    """
    limit = max_units if max_units is not None else math.inf
    u0, t0 = 0, count(build(0))
    u1 = min(max(probe, 1), limit)
    t1 = count(build(u1))
    for _ in range(_FIT_STEPS):
        if abs(t1 - target) <= _FIT_TOLERANCE * target or t1 == t0:
            break
        u2 = min(max(round(u1 + (target - t1) * (u1 - u0) / (t1 - t0)), 0), limit)
        if u2 == u1:
            break
        u0, t0, u1 = u1, t1, u2
        t1 = count(build(u1))
    if u1 == limit and t1 < 0.9 * target:
        raise ValueError(f"cannot fill {target} tokens: at most {t1} with this suite's vocabulary")
    return build(u1), t1


def _insert_at_depths(haystack: str, items: list[tuple[float, str]]) -> str:
    """Insert sentences into ``haystack`` at sentence boundaries.

    Each item is ``(depth, sentence)``; depth 0 is the start of the haystack
    and 1 its end. A sentence goes to the boundary nearest to
    ``depth * len(haystack)`` and is followed by the whitespace that ends the
    sentence before it, so a needle after a paragraph is a paragraph of its
    own. Items that land on the same boundary keep their order in ``items``.
    """
    haystack = haystack.rstrip() + "\n"
    separator_after = {0: " "} | {m.end(): m.group()[1:] for m in _SENTENCE_END.finditer(haystack)}
    boundaries = sorted(separator_after)

    def nearest_boundary(depth: float) -> int:
        target = depth * len(haystack)
        j = bisect_left(boundaries, target)
        candidates = boundaries[max(j - 1, 0) : j + 1]
        return min(candidates, key=lambda b: abs(b - target))

    cuts = sorted((nearest_boundary(depth), order, sentence) for order, (depth, sentence) in enumerate(items))
    pieces, previous = [], 0
    for cut, _, sentence in cuts:
        pieces += [haystack[previous:cut], sentence, separator_after[cut]]
        previous = cut
    pieces.append(haystack[previous:])
    return "".join(pieces).rstrip()


def _noise(num_sentences: int) -> str:
    return " ".join(NOISE_SENTENCES[i % len(NOISE_SENTENCES)] for i in range(num_sentences))


@lru_cache(maxsize=1)
def prose_corpus() -> str:
    """All of ``pydoc_data.topics`` (about 465 KB of English), topics in name order."""
    return "\n\n".join(_PYDOC_TOPICS[name].strip() for name in sorted(_PYDOC_TOPICS))


@lru_cache(maxsize=1)
def _paragraph_starts() -> tuple[int, ...]:
    return (0,) + tuple(m.end() for m in re.finditer(r"\n\n+", prose_corpus()))


def _prose(start: int, num_chars: int) -> str:
    """``num_chars`` characters of the corpus from ``start``, wrapping around, cut at a space."""
    corpus = prose_corpus() + "\n\n"
    text = corpus[start : start + num_chars]
    while len(text) < num_chars:
        text += corpus[: num_chars - len(text)]
    last_space = text.rfind(" ")
    return (text[:last_space] if last_space > 0 else text).strip()


def _fill_haystack(
    kind: str,
    rng: random.Random,
    header: str,
    inserts: list[tuple[float, str]],
    length_tokens: int,
    count: TokenCounter,
) -> tuple[str, int]:
    """``header``, a newline, then a ``kind`` haystack holding ``inserts``, fitted to ``length_tokens``.

    Returns the context and its token count.
    """
    if kind == "noise":
        build_filler, probe = _noise, length_tokens // 5
    else:
        build_filler, probe = partial(_prose, rng.choice(_paragraph_starts())), length_tokens * 4

    def build(units: int) -> str:
        return header + "\n" + _insert_at_depths(build_filler(units), inserts)

    return _fit(build, length_tokens, count, probe)


# ---------------------------------------------------------------- needle

NEEDLE_VARIANTS = ("single", "multikey", "multivalue", "multiquery")
NEEDLE_VALUE_TYPES = ("number", "word", "uuid")


def _needle_value(value_type: str, rng: random.Random, taken: set[str], digits: int = 7) -> str:
    while True:
        if value_type == "number":
            value = str(rng.randint(10 ** (digits - 1), 10**digits - 1))
        elif value_type == "word":
            value = rng.choice(_WORD_PAIRS)
        else:
            value = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        if value not in taken:
            taken.add(value)
            return value


def _join_keys(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + " and " + keys[-1]


def _evenly_spread_depths(n: int) -> list[float]:
    return [0.5] if n == 1 else [i / (n - 1) for i in range(n)]


def make_needle(
    n: int,
    length_tokens: int,
    seed: int,
    tokenizer_len: TokenCounter | None = None,
    *,
    variant: str = "single",
    haystack: str = "noise",
    value_type: str = "number",
    num_needles: int = 4,
    depth: float | None = None,
    digits: int = 7,
) -> list[Sample]:
    """RULER needle-in-a-haystack.

    Parameters
    ----------
    n, length_tokens, seed, tokenizer_len
        See the module docstring.
    variant : {"single", "multikey", "multivalue", "multiquery"}
        ``single``: one key, one value. ``multikey``: ``num_needles`` keys,
        one asked for, the rest distractors. ``multivalue``: one key with
        ``num_needles`` values, all required. ``multiquery``: ``num_needles``
        keys, all asked for.
    haystack : {"noise", "prose"}
        Repeated filler sentences, or ``pydoc_data`` text from a seeded offset.
    value_type : {"number", "word", "uuid"}
        ``digits``-digit numbers (RULER: 7), adjective-noun words, or UUIDs.
    num_needles : int
        Needle count of the multi-needle variants.
    depth : float, optional
        Where the first needle goes, 0 (start) to 1 (end of the haystack).
        By default spread evenly over [0, 1] across the ``n`` samples. The
        other needles go to uniformly random depths.
    digits : int
        Digits of a number value, 2 to 12. On a prose haystack the embedded model retrieves
        4-5 digits where 7 defeat every method (README "Results").
    """
    if isinstance(digits, bool) or not isinstance(digits, int) or not 2 <= digits <= 12:
        raise ValueError(f"digits must be an int in [2, 12], got {digits!r}")
    _check_choice("variant", variant, NEEDLE_VARIANTS)
    _check_choice("haystack", haystack, HAYSTACKS)
    _check_choice("value_type", value_type, NEEDLE_VALUE_TYPES)
    count = tokenizer_len or approx_token_count
    depths = [depth] * n if depth is not None else _evenly_spread_depths(n)
    num_keys = num_needles if variant in ("multikey", "multiquery") else 1
    values_per_key = num_needles if variant == "multivalue" else 1
    noun = value_type
    samples = []
    for i in range(n):
        rng = _sample_rng("needle", seed, i)
        keys = rng.sample(_WORD_PAIRS, num_keys)
        taken = set(keys)
        pairs = [(key, _needle_value(value_type, rng, taken, digits)) for key in keys for _ in range(values_per_key)]
        needle_depths = [depths[i]] + [rng.random() for _ in pairs[1:]]
        needles = [
            (d, f"One of the special magic {noun}s for {key} is: {value}.")
            for d, (key, value) in zip(needle_depths, pairs)
        ]
        asked_keys = keys if variant == "multiquery" else keys[:1]
        answers = [value for key, value in pairs if key in asked_keys]
        header = (
            f"Some special magic {noun}s are hidden within the following text. "
            f"Make sure to memorize it. I will quiz you about the {noun}s afterwards."
        )
        context, tokens = _fill_haystack(haystack, rng, header, needles, length_tokens, count)
        asked = _join_keys(asked_keys)
        if len(answers) == 1:
            question = f"What is the special magic {noun} for {asked} mentioned in the provided text?"
            answer_prefix = f"The special magic {noun} for {asked} mentioned in the provided text is"
        else:
            question = f"What are all the special magic {noun}s for {asked} mentioned in the provided text?"
            answer_prefix = f"The special magic {noun}s for {asked} mentioned in the provided text are"
        samples.append(
            Sample(
                id=f"needle-{variant}-{seed}-{i}",
                suite="needle",
                context=context,
                question=question,
                answer_prefix=answer_prefix,
                answers=answers,
                meta={
                    "variant": variant,
                    "haystack": haystack,
                    "value_type": value_type,
                    "depth": depths[i],
                    "needles": [sentence for _, sentence in needles],
                    "length_tokens": tokens,
                },
            )
        )
    return samples


# ---------------------------------------------------------------- pass keys in prose

# (fact, question, answer prefix): a number stated once in prose and asked for by its context.
PASSKEY_TEMPLATES = (
    ("The secret pass key for the {name} archive is {value}. Remember it, it will be asked later.",
     "What is the secret pass key for the {name} archive mentioned in the text above?",
     "The secret pass key for the {name} archive is"),
    ("The door code of the {name} room is {value}.",
     "What is the door code of the {name} room mentioned in the text above?",
     "The door code of the {name} room is"),
    ("Note that the build number of the {name} release is {value}.",
     "What is the build number of the {name} release mentioned in the text above?",
     "The build number of the {name} release is"),
    ("The {name} account was opened with the PIN {value}.",
     "Which PIN was the {name} account opened with, according to the text above?",
     "The {name} account was opened with the PIN"),
)
PASSKEY_DIGITS = (4, 5)


def make_passkey(
    n: int,
    length_tokens: int,
    seed: int,
    tokenizer_len: TokenCounter | None = None,
    *,
    digits: int | None = None,
    depth: float | None = None,
) -> list[Sample]:
    """A number hidden in real prose (``pydoc_data``, which has numbers of its own), asked for
    by the words around it.

    Each sample draws one of :data:`PASSKEY_TEMPLATES`, a name (adjective-noun) and a number of
    ``digits`` digits (default: 4 and 5 alternating over the samples). The fact goes at ``depth``
    (default: spread evenly over [0.1, 0.9] across the ``n`` samples) of a prose haystack from
    a seeded offset. The numbers of the prose are what a merge can blend into the key's digits.
    """
    if digits is not None and (isinstance(digits, bool) or not isinstance(digits, int) or not 2 <= digits <= 12):
        raise ValueError(f"digits must be an int in [2, 12] (or None: 4 and 5 alternating), got {digits!r}")
    count = tokenizer_len or approx_token_count
    depths = [depth] * n if depth is not None else [0.1 + 0.8 * d for d in _evenly_spread_depths(n)]
    samples = []
    for i in range(n):
        rng = _sample_rng("passkey", seed, i)
        fact, question, prefix = rng.choice(PASSKEY_TEMPLATES)
        name = rng.choice(_WORD_PAIRS)
        size = digits if digits is not None else PASSKEY_DIGITS[i % len(PASSKEY_DIGITS)]
        value = str(rng.randint(10 ** (size - 1), 10**size - 1))
        sentence = fact.format(name=name, value=value)
        context, tokens = _fill_haystack("prose", rng, "Read the following text carefully.", [(depths[i], sentence)],
                                         length_tokens, count)
        samples.append(
            Sample(
                id=f"passkey-{seed}-{i}",
                suite="passkey",
                context=context,
                question=question.format(name=name),
                answer_prefix=prefix.format(name=name),
                answers=[value],
                meta={"depth": depths[i], "digits": size, "fact": sentence, "length_tokens": tokens},
            )
        )
    return samples


# ---------------------------------------------------------------- variable tracking


def make_tracking(
    n: int,
    length_tokens: int,
    seed: int,
    tokenizer_len: TokenCounter | None = None,
    *,
    haystack: str = "noise",
    num_chains: int = 1,
    num_hops: int = 4,
) -> list[Sample]:
    """RULER variable tracking.

    Each chain is ``VAR A = 12345.``, ``VAR B = VAR A.``, ... (``num_hops``
    hops), its statements at sorted random depths. The first chain is asked
    for; the others are distractors with other values. The answers are the
    ``num_hops + 1`` variable names of the asked chain.
    """
    _check_choice("haystack", haystack, HAYSTACKS)
    count = tokenizer_len or approx_token_count
    samples = []
    for i in range(n):
        rng = _sample_rng("tracking", seed, i)
        names: list[str] = []
        while len(names) < num_chains * (num_hops + 1):
            name = "".join(rng.choices(string.ascii_uppercase, k=5))
            if name not in names:
                names.append(name)
        chain_values = rng.sample(range(10_000, 100_000), num_chains)
        chains = [names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)] for c in range(num_chains)]
        statements = []
        for chain, value in zip(chains, chain_values):
            texts = [f"VAR {chain[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
            statements += zip(sorted(rng.random() for _ in texts), texts)
        header = "Memorize and track the chain(s) of variable assignment hidden in the following text."
        context, tokens = _fill_haystack(haystack, rng, header, statements, length_tokens, count)
        value = chain_values[0]
        samples.append(
            Sample(
                id=f"tracking-{seed}-{i}",
                suite="tracking",
                context=context,
                question=f"Question: Find all variables that are assigned the value {value} in the text above.",
                answer_prefix=(
                    "Answer: According to the chain(s) of variable assignment in the text above, "
                    f"{num_hops + 1} variables are assigned the value {value}, they are:"
                ),
                answers=chains[0],
                meta={"haystack": haystack, "num_chains": num_chains, "num_hops": num_hops, "length_tokens": tokens},
            )
        )
    return samples


# ---------------------------------------------------------------- aggregation

AGGREGATION_VARIANTS = ("cwe", "fwe")
_CODED_WORD_LENGTH = 6
_CODED_VOCABULARY = 2000
_FWE_ALPHA = 2.0
_ZETA_OF_ALPHA = math.pi**2 / 6  # Riemann zeta(2): normalises counts k**-2
_FWE_NOISE_WORD = "...."


@lru_cache(maxsize=1)
def _prose_vocabulary() -> tuple[str, ...]:
    """Distinct lowercase words of 4 to 10 letters in the prose corpus, sorted."""
    return tuple(sorted(set(re.findall(r"\b[a-z]{4,10}\b", prose_corpus()))))


def _aggregation_sample(sample_id, variant, context, tokens, question, answer_prefix, answers, details) -> Sample:
    return Sample(
        id=sample_id,
        suite="aggregation",
        context=context,
        question=question,
        answer_prefix=answer_prefix,
        answers=list(answers),
        meta={"variant": variant, "length_tokens": tokens, **details},
    )


def _cwe_sample(sample_id, rng, length_tokens, count, num_common, common_freq, rare_freq) -> Sample:
    vocabulary = rng.sample(_prose_vocabulary(), len(_prose_vocabulary()))
    common = vocabulary[:num_common]
    if common_freq is None:
        # RULER uses 30 vs 3 repeats; short lists need fewer common repeats.
        common_freq = min(30, max(rare_freq + 2, length_tokens // (4 * 3 * num_common)))

    def build(num_rare: int) -> str:
        rare = vocabulary[num_common : num_common + num_rare]
        words = common * common_freq + rare * rare_freq
        random.Random(f"{sample_id}:shuffle").shuffle(words)
        numbered = "\n".join(f"{k}. {word}" for k, word in enumerate(words, start=1))
        return (
            "Below is a numbered list of words. In these words, some appear more often than others. "
            "Memorize the ones that appear most often.\n" + numbered
        )

    context, tokens = _fit(
        build, length_tokens, count, length_tokens // (5 * rare_freq), max_units=len(vocabulary) - num_common
    )
    return _aggregation_sample(
        sample_id,
        "cwe",
        context,
        tokens,
        f"Question: What are the {num_common} most common words in the above list?",
        f"Answer: The top {num_common} words that appear most often in the list are:",
        common,
        {"common_freq": common_freq, "rare_freq": rare_freq},
    )


def _fwe_sample(sample_id, rng, length_tokens, count) -> Sample:
    codes: list[str] = []
    while len(codes) < _CODED_VOCABULARY:
        code = "".join(rng.choices(string.ascii_lowercase, k=_CODED_WORD_LENGTH))
        if code not in codes:
            codes.append(code)
    vocabulary = [_FWE_NOISE_WORD] + codes[1:]  # rank 1 is noise, as in RULER

    def build(num_words: int) -> str:
        words = [
            word
            for rank, word in enumerate(vocabulary, start=1)
            for _ in range(int(num_words * rank**-_FWE_ALPHA / _ZETA_OF_ALPHA))
        ]
        random.Random(f"{sample_id}:shuffle").shuffle(words)
        return (
            "Read the following coded text and track the frequency of each coded word. "
            "Find the three most frequently appeared coded words.\n" + " ".join(words)
        )

    context, tokens = _fit(build, length_tokens, count, length_tokens // 2)
    return _aggregation_sample(
        sample_id,
        "fwe",
        context,
        tokens,
        "Question: Do not provide any explanation. Please ignore the dots '....'. "
        "What are the three most frequently appeared words in the above coded text?",
        "Answer: According to the coded text above, the three most frequently appeared words are:",
        vocabulary[1:4],
        {"alpha": _FWE_ALPHA},
    )


def make_aggregation(
    n: int,
    length_tokens: int,
    seed: int,
    tokenizer_len: TokenCounter | None = None,
    *,
    variant: str = "cwe",
    num_common: int = 10,
    common_freq: int | None = None,
    rare_freq: int = 3,
) -> list[Sample]:
    """RULER common-word (``cwe``) and frequent-word (``fwe``) extraction.

    ``cwe``: a numbered list of ``pydoc_data`` words in which ``num_common``
    words appear ``common_freq`` times and every other word ``rare_freq``
    times; the answers are the common words. ``common_freq`` defaults to
    RULER's 30, lowered for short targets so that the common words fill
    about a third of the list (never below ``rare_freq + 2``).

    ``fwe``: random 6-letter coded words with counts proportional to
    ``rank ** -2`` (Zipf, alpha = 2). Rank 1 is the noise word ``....``; the
    answers are ranks 2 to 4. ``num_common``, ``common_freq`` and
    ``rare_freq`` do not apply.
    """
    _check_choice("variant", variant, AGGREGATION_VARIANTS)
    count = tokenizer_len or approx_token_count
    samples = []
    for i in range(n):
        rng = _sample_rng(f"aggregation-{variant}", seed, i)
        sample_id = f"aggregation-{variant}-{seed}-{i}"
        if variant == "cwe":
            sample = _cwe_sample(sample_id, rng, length_tokens, count, num_common, common_freq, rare_freq)
        else:
            sample = _fwe_sample(sample_id, rng, length_tokens, count)
        samples.append(sample)
    return samples


# ---------------------------------------------------------------- prose suites

FIDELITY_INSTRUCTIONS = (
    "Summarize the text above in two sentences.",
    "List three key facts from the text.",
    "What is the main topic of the text above? Answer in one sentence.",
    "Write one question that the text above answers, and answer it.",
)


def _prose_sample(rng: random.Random, length_tokens: int, count: TokenCounter) -> tuple[str, int, int]:
    start = rng.choice(_paragraph_starts())
    text, tokens = _fit(partial(_prose, start), length_tokens, count, length_tokens * 4)
    return text, tokens, start


def make_ppl(
    n: int,
    length_tokens: int,
    seed: int,
    tokenizer_len: TokenCounter | None = None,
) -> list[Sample]:
    """Perplexity chunks: ``pydoc_data`` text from seeded paragraph starts, no question."""
    count = tokenizer_len or approx_token_count
    samples = []
    for i in range(n):
        text, tokens, start = _prose_sample(_sample_rng("ppl", seed, i), length_tokens, count)
        samples.append(
            Sample(
                id=f"ppl-{seed}-{i}",
                suite="ppl",
                context=text,
                question="",
                answer_prefix="",
                answers=[],
                meta={"offset": start, "length_tokens": tokens},
            )
        )
    return samples


def make_fidelity(
    n: int,
    length_tokens: int,
    seed: int,
    tokenizer_len: TokenCounter | None = None,
    *,
    instruction: str | None = None,
) -> list[Sample]:
    """A ``pydoc_data`` document followed by an instruction, scored against the full cache.

    Sample ``i`` gets ``FIDELITY_INSTRUCTIONS[i % 4]`` unless ``instruction``
    fixes one for all.
    """
    count = tokenizer_len or approx_token_count
    samples = []
    for i in range(n):
        text, tokens, start = _prose_sample(_sample_rng("fidelity", seed, i), length_tokens, count)
        samples.append(
            Sample(
                id=f"fidelity-{seed}-{i}",
                suite="fidelity",
                context=text,
                question=instruction or FIDELITY_INSTRUCTIONS[i % len(FIDELITY_INSTRUCTIONS)],
                answer_prefix="",
                answers=[],
                meta={"offset": start, "length_tokens": tokens},
            )
        )
    return samples


# ---------------------------------------------------------------- kl: real text, continued

KL_SOURCES = ("pydoc", "stdlib")
# Tests, installed packages, codec tables and generated data are not code written to be read.
_STDLIB_SKIP = frozenset({
    "test", "tests", "idle_test", "site-packages", "dist-packages", "lib2to3", "__pycache__", "encodings", "pydoc_data",
})
_STDLIB_MIN_BYTES = 32_000  # about 9k tokens of code: room for a 2k-token prompt and its continuation


@lru_cache(maxsize=1)
def stdlib_sources() -> tuple[str, ...]:
    """The running interpreter's standard-library ``.py`` files of at least 32 KB, as paths
    relative to the stdlib root, sorted (tests, site-packages, codecs, generated files left out)."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _STDLIB_SKIP)
        for name in files:
            path = os.path.join(directory, name)
            generated = name.startswith("_sysconfigdata")
            if name.endswith(".py") and not generated and os.path.getsize(path) >= _STDLIB_MIN_BYTES:
                found.append(os.path.relpath(path, root))
    return tuple(sorted(found))


def _source_head(text: str, num_chars: int) -> str:
    """The first ``num_chars`` characters of a source file, cut after the last whole line."""
    head = text[:num_chars]
    cut = head.rfind("\n")
    return head[: cut + 1] if cut > 0 else head


def make_kl(
    n: int,
    length_tokens: int,
    seed: int,
    tokenizer_len: TokenCounter | None = None,
    source: str = "pydoc",
) -> list[Sample]:
    """Real text that no one here wrote, to be continued: no question, no answer.

    ``source="pydoc"``: ``pydoc_data`` prose from a seeded paragraph start (as ``ppl``).
    ``source="stdlib"``: the head of a standard-library ``.py`` file of the running
    interpreter (:func:`stdlib_sources`, in a seeded order without repeats), from its first line: code refers back to names
    defined thousands of tokens earlier. The runner prefills the first part of ``context``
    and scores the model on the rest (see keepkv.eval.runner).
    """
    _check_choice("source", source, KL_SOURCES)
    count = tokenizer_len or approx_token_count
    # Files in a seeded order, one per sample: no file repeats before all have been used.
    files = list(stdlib_sources())
    random.Random(f"kl-stdlib:{seed}").shuffle(files)
    samples = []
    for i in range(n):
        if source == "pydoc":
            text, tokens, start = _prose_sample(_sample_rng(f"kl-{source}", seed, i), length_tokens, count)
            origin = {"offset": start}
        else:
            relative = files[i % len(files)]
            code = (Path(sysconfig.get_paths()["stdlib"]) / relative).read_text(encoding="utf-8", errors="replace")
            text, tokens = _fit(partial(_source_head, code), length_tokens, count, length_tokens * 3, len(code))
            origin = {"file": relative}
        samples.append(
            Sample(
                id=f"kl-{source}-{seed}-{i}", suite="kl", context=text, question="", answer_prefix="", answers=[],
                meta={"source": source, **origin, "length_tokens": tokens},
            )
        )
    return samples


# ---------------------------------------------------------------- registry

SUITES: dict[str, Callable[..., list[Sample]]] = {
    "needle": make_needle,
    "tracking": make_tracking,
    "aggregation": make_aggregation,
    "passkey": make_passkey,
    "ppl": make_ppl,
    "fidelity": make_fidelity,
    "kl": make_kl,
}


def make_suite(
    name: str,
    n: int,
    length_tokens: int,
    seed: int,
    tokenizer_len: TokenCounter | None = None,
    **variant,
) -> list[Sample]:
    """Generate ``n`` samples of the suite ``name``; ``variant`` goes to its generator."""
    if name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; valid suites: {', '.join(SUITES)}")
    return SUITES[name](n, length_tokens, seed, tokenizer_len, **variant)
