"""The evaluation runner: every method, every budget, on the same samples, with one prefill each.

For every suite and length (a *group*) the runner makes the samples, batches them (left
padding, ``batch_size`` rows), and for each batch

1. runs ONE prefill forward with a recording cache,
   ``CompressedCache(config, "full", record=Needs.union(needs of every method))``;
2. for every cell (method, budget) of the group, ``fork()``\\s the recorded prefill: the exact
   cache that method would hold after its own prefill, built by copying tensors and
   statistics, not by a forward pass;
3. decodes greedily on the forked cache with :func:`greedy_decode` (a plain forward loop,
   starting from the prefill's last logits; the cache compresses *during* decoding as the
   method says), and scores the result.

The full cache is the first cell of every group: it is the reference that every table
reports and that ``fidelity`` is scored against.

Suites
------
``needle``, ``tracking``, ``aggregation``
    context + question in the chat template, the reply started by the sample's answer prefix;
    scored with RULER's ``string_match_all`` (share of the reference answers contained in the
    prediction, so multi-key/value/query needles get partial credit). Generation stops at EOS
    or after ``answer tokens + ANSWER_SLACK`` tokens (RULER caps at 30-128 tokens per task; we
    cap per sample to fit the time budget: containment scoring gains nothing from text after
    the answer).
``ppl``
    teacher-forced perplexity of ``pydoc_data`` prose, the cache compressed *during decoding*:
    a head of ``PPL_HEAD`` tokens is prefilled (and shared), then the text is fed one token per
    step and the NLL of each next token is taken. A prompt of 32 tokens would make a
    fractional budget meaningless, so for ``ppl`` a budget ``b`` becomes an absolute entry
    count ``round(b * length)`` (0.1 x 512 = 51 entries per layer and KV head); an int budget
    is used as is. Score = perplexity, mean over samples (lower is better).
``fidelity``
    a prose document + instruction; free greedy generation of ``FIDELITY_NEW_TOKENS`` tokens,
    compared with the full cache's answer: tokens until the first divergence
    (``agree_prefix``), share of identical tokens over the full answer (``agree_share``),
    mean KL(full || method) of the next-token distribution along the full cache's continuation
    (teacher-forced into the compressed cache; ``kl``), and ROUGE-L of the answer against the
    full cache's answer, which is the score. Each sample takes two rows of the batch (one free,
    one teacher-forced), which doubles the prefill but halves the decode steps. Note that the
    first new token of every method equals the full cache's: the prefill's logits are computed
    before the cache is compressed.
``kl``
    real text that no one here wrote, ``kl+source=pydoc`` (``pydoc_data`` prose) or
    ``kl+source=stdlib`` (the head of a standard-library ``.py`` file of the running
    interpreter: code refers back to names defined thousands of tokens earlier). The first
    ``length`` tokens are prefilled (the budget is a fraction of them), the next
    ``KL_CONTINUATION`` = 128 are teacher-forced with the cache compressed *during* decoding,
    and the full cache decodes in the same forward pass as every cell. Per sample: mean
    KL(full || method) of the next-token distribution over the 128 positions (the score,
    lower is better), mean NLL, and ``nll_delta`` = NLL(method) - NLL(full cache), nats per token.
``longbench`` / ``jsonl``
    local datasets (``data={"longbench": DIR, "jsonl": FILE}``), with LongBench's per-task
    metrics, or exact match + F1 (score) + ROUGE-L. A context longer than the group's length
    is cut in the middle, as LongBench does. Generation stops at LongBench's per-task
    ``dataset2maxlen`` (jsonl: answer tokens + ANSWER_SLACK, at most 64).

Suites take generator variants as ``needle+variant=multikey+haystack=prose``.

Settings
--------
``needle``, ``passkey``, ``tracking``, ``aggregation``, ``longbench`` and ``jsonl`` have a
question. By default it sits inside the prompt that is compressed (*question-aware*: SnapKV's
observation window then is the question). ``+setting=agnostic`` (``keepkv eval --setting
agnostic|both``) compresses the context before the question is seen, as kvpress's leaderboard
runs by default and as a user asking several questions about one document does
(:func:`keepkv.compress`): the recording prefill holds the chat template's start and the
document; every cell forks it (compressing it), then the question part (separator, question,
template end, answer prefix; tokenized on its own) is appended to every cell as one block, and
decoding goes on as in the aware setting. Batches hold samples whose question parts have one
length (no padding inside that block).

Output (``out_dir``)
--------------------
``cells/<suite>-<length>-<method>-<budget>.json``
    every prediction of the cell, its score and the settings it was made with. A cell whose
    file exists with the same settings and sample ids is not recomputed. The prefill of a
    batch is shared by every cell of the group, so it is skipped only when every cell is done.
``summary.csv``
    suite, length, method, budget, score, ci95 (half-width of the Student-t 95% interval over
    samples), share_of_full (score / full score; full / score where lower is better),
    cache_bytes, full_cache_bytes (means over samples at the end of decoding), n,
    higher_is_better, then kept_entries, seconds (wall time; shared work split evenly over the
    cells that shared it), cpu_seconds (summed over workers), the suite's extra metrics, and
    the paired differences (keepkv.eval.paired): ``diff_full`` = mean over samples of
    (method - full cache), its 95% half-width ``diff_full_ci95`` and, for 0/1 scores, the exact
    McNemar ``diff_full_p``; with ``reference=METHOD`` the same against that method at the
    same budget (``reference``, ``diff_ref``, ``diff_ref_ci95``, ``diff_ref_p``).
``scores.png``
    score against budget, one line per method, one panel per suite and length, the full cache
    as a horizontal line.
``config.json``
    every setting and every method's parameters, written before the first cell runs.

Seeds
-----
Seed 0 (``TEST_SEED``) makes the reported samples. Anything tuned is tuned on ``DEV_SEED`` =
1000 and above (``keepkv eval --seed dev``), never on the reported seed. No method
hyperparameter is set here: every method runs with its registered defaults (written to
``config.json``). The suite variants and lengths below were chosen from the *full cache's*
scores on the dev seed (the issue asks for lengths where the full cache succeeds), and from
timing, never from any method's scores.

Speed
-----
1. One prefill per batch, shared by every cell through ``fork()`` (tensors and statistics
   copied, no forward pass).
2. All cells of a group decode together (:class:`JointCache`): one forward pass per step for
   every (method, budget) at once, so the model's linear layers run once per step; each
   attention call is split by rows and each cache runs its own method. ``joint_cells=1``
   decodes cells one by one (same tokens; floats may differ in the last bits).
3. ``workers`` forked processes (CPU) split each group's samples; one thread each. Decoding
   on this model is bound by per-op overhead, not FLOPs, so two processes beat two threads.
   A SIGTERM while they run ends them (terminated and joined) before the run exits with 143.

Default suites
--------------
A task enters the default only if the full cache scores >= 0.9 on it on the dev seed: ``needle``
(single, noise haystack) and its question-agnostic twin, the 5-digit prose needle, ``passkey``
and its question-agnostic twin, and the two ``kl`` suites (no threshold: they measure the
distance from the full cache). ``tracking``, ``aggregation``, ``ppl`` and ``fidelity`` stay
available with ``--suite``; ``--suite ruler`` runs the RULER preset (``RULER_SUITES``). The
full cache's dev-seed scores that chose them, and where the run's time goes:
docs/record/2026-11-24-default-eval-time.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..attention import Needs
from ..budgets import budget_for, check_budget_holds, validate_budget
from ..cache import DECODING, CompressedCache
from ..generation import build_prompts, context_and_question_ids, encode
from ..methods import METHODS, get_method
from ..plotting import can_plot
from . import metrics
from .datasets import load_jsonl, load_longbench
from .decoding import _strip, _with_eos, decode_cells, greedy_decode, prefill
from .summary import average_rows, summarize_cell, summary_rows, write_summary
from .options import (  # noqa: F401 (the run's defaults, this module's API too)
    DEFAULT_BATCH_SIZE, DEFAULT_BUDGETS, DEFAULT_LENGTHS, DEFAULT_SAMPLES, DEFAULT_SAMPLES_OTHER, DEFAULT_SUITES,
    DEV_SEED, MAX_WORKERS, PROSE_NEEDLE, QUICK_BUDGETS, QUICK_LENGTHS, QUICK_SAMPLES, SWEEP_BUDGETS, TEST_SEED,
)
from .tasks import SUITES, Sample, make_suite

# ---------------------------------------------------------------- defaults (fixed before any run)

# The local-data suites, and what each reads (its refusal without it names it).
DATA_NEEDED = {"longbench": "a directory: --data DIR (or data={'longbench': DIR})",
               "jsonl": "a file: --data FILE.jsonl (or data={'jsonl': FILE})"}
DATA_SUITES = tuple(DATA_NEEDED)
# Question-aware (the question inside the compressed prompt; SnapKV's window then is the question)
# or question-agnostic (the context compressed before the question, as kvpress's leaderboard runs
# by default, and as a user asking several questions about one document): ``+setting=agnostic``.
SETTINGS = ("aware", "agnostic")
RUNNER_KEYS = ("setting", "decoding")  # suite variants the runner reads, not the sample generator
# What decoding does after the compression, per setting (``+decoding=`` names the other).
DEFAULT_DECODING = {"aware": "compress", "agnostic": "append"}
QUESTION_SUITES = ("needle", "passkey", "tracking", "aggregation", "longbench", "jsonl")
KNOWN_SUITES = (*SUITES, *DATA_SUITES)
# Run by default beside every registered method: KeepKV's merge on the selection that keeps facts
# compressed before the question (the pairing the question-agnostic setting asks about), and
# KVzip's paper-literal budgets (non-uniform heads).
DEFAULT_VARIANTS = ("keepkv+selection=kvzip", "kvzip+budgets=global")
# `keepkv eval --suite ruler`: the RULER tasks that the full embedded model solves (>= 0.8 on the
# dev seed) at the length where it does, prose haystacks included, and their unweighted average
# (RULER's score); run question-aware and question-agnostic unless --setting says one. Full
# cache, dev seed, RULER string match (see "Default suites" above and docs/eval.md):
RULER_SUITES = (
    "needle", "needle+haystack=prose", PROSE_NEEDLE, "needle+variant=multikey+num_needles=2", "passkey",
)
RULER_LENGTHS = {suite: 1024 for suite in RULER_SUITES}
RULER_SAMPLES = {suite: 32 for suite in RULER_SUITES}
RULER_AVERAGE = "ruler-average"
PPL_HEAD = 32
KL_CONTINUATION = 128
FIDELITY_NEW_TOKENS = 32
ANSWER_SLACK = 8
JSONL_MAX_NEW_TOKENS = 64
# LongBench's dataset2maxlen.json.
LONGBENCH_MAX_NEW_TOKENS = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64, "hotpotqa": 32,
    "2wikimqa": 32, "musique": 32, "dureader": 128, "gov_report": 512, "qmsum": 512, "multi_news": 512,
    "vcsum": 512, "trec": 64, "triviaqa": 32, "samsum": 128, "lsht": 64, "passage_count": 32,
    "passage_retrieval_en": 32, "passage_retrieval_zh": 32, "lcc": 64, "repobench-p": 64,
}# ---------------------------------------------------------------- suites and cells


@dataclass(frozen=True)
class SuiteSpec:
    """A suite name, its generator variant and the label used in tables and file names."""

    name: str
    variant: tuple[tuple[str, object], ...] = ()

    @property
    def label(self) -> str:
        return "+".join([self.name, *(f"{key}={value}" for key, value in self.variant)])

    @staticmethod
    def parse(text: str) -> "SuiteSpec":
        """``needle`` or ``needle+variant=multikey+haystack=prose``."""
        name, *parts = text.split("+")
        if name not in KNOWN_SUITES:
            raise ValueError(f"unknown suite {name!r}; valid suites: {', '.join(KNOWN_SUITES)}")
        variant = []
        for part in parts:
            if "=" not in part:
                raise ValueError(f"suite variants are KEY=VALUE, got {part!r} in {text!r}")
            key, value = part.split("=", 1)
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass
            variant.append((key, value))
        settings = [value for key, value in variant if key == "setting"]
        if any(value not in SETTINGS for value in settings) or len(settings) > 1:
            raise ValueError(f"setting must be one of {', '.join(SETTINGS)} (once), got {text!r}")
        decodings = [value for key, value in variant if key == "decoding"]
        if any(value not in DECODING for value in decodings) or len(decodings) > 1:
            raise ValueError(f"decoding must be one of {', '.join(DECODING)} (once), got {text!r}")
        implied = ("decoding", DEFAULT_DECODING[settings[0] if settings else "aware"])  # the label names no default
        variant = [(key, value) for key, value in variant if (key, value) not in (("setting", "aware"), implied)]
        if settings and settings[0] == "agnostic" and name not in QUESTION_SUITES:
            raise ValueError(f"suite {name!r} has no question to keep out of the compressed context, got {text!r}")
        if [key for key, _ in variant if key not in RUNNER_KEYS] and name in DATA_SUITES + ("ppl",):
            raise ValueError(f"suite {name!r} takes no variants, got {text!r}")
        return SuiteSpec(name, tuple(variant))

    @property
    def setting(self) -> str:
        """``aware``: the question is in the prompt that is compressed (the label names no setting);
        ``agnostic``: the context is compressed before the question is seen (``+setting=agnostic``)."""
        return dict(self.variant).get("setting", "aware")

    @property
    def decoding(self) -> str:
        """What decoding does after the prompt or context is compressed (``CompressedCache``'s
        ``decoding``): "compress" keeps the budget, "append" lets the question and the answer in
        uncompressed. The question-aware setting compresses (as a method does while it decodes),
        the question-agnostic one appends (a context compressed once, then asked: kvpress's and
        KVzip's setting); ``+decoding=...`` names the other."""
        return dict(self.variant).get("decoding", DEFAULT_DECODING[self.setting])

    @property
    def generator_variant(self) -> dict:
        """The variant's options for the sample generator (the setting and decoding are the runner's)."""
        return {key: value for key, value in self.variant if key not in RUNNER_KEYS}

    @property
    def task_label(self) -> str:
        """The label without the setting: the task, whichever setting runs it."""
        return self.with_setting("aware").label

    def with_setting(self, setting: str) -> "SuiteSpec":
        """This suite in ``setting`` (the aware label names no setting)."""
        rest = tuple((key, value) for key, value in self.variant if key != "setting")
        spec = SuiteSpec(self.name, rest + ((("setting", setting),) if setting == "agnostic" else ()))
        return SuiteSpec.parse(spec.label)  # a decoding that is the new setting's default is not named


def _budget_label(budget) -> str:
    return str(budget)


def cell_path(out_dir: Path, suite: str, length: int, method: str, budget) -> Path:
    """Where the JSON records of one cell go: one file in ``cells/``, whatever the method's spec
    holds (a path separator in a parameter, ``scorer=dir/file.pt``, is written ``%2F``, and ``%``
    itself ``%25``; the file holds the spec as given)."""
    name = f"{suite}-{length}-{method}-{_budget_label(budget)}".replace("%", "%25").replace("/", "%2F")
    return Path(out_dir) / "cells" / f"{name}.json"


@dataclass
class Cell:
    """One (method, budget) of a group, with what it accumulated over the batches."""

    method: str
    budget: int | float
    params: dict
    path: Path
    key: dict
    records: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    done: bool = False

# ---------------------------------------------------------------- samples


class _Tokens:
    """Token counting and encoding with one tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def _truncate_middle(sample: Sample, length: int, tokens: _Tokens) -> Sample:
    """Cut the context in the middle so that the whole prompt stays within ``length`` tokens."""
    ids = tokens.ids(sample.context)
    rendered = build_prompts(tokens.tokenizer, [sample.prompt], True, sample.answer_prefix)[0]
    overhead = tokens.count(rendered) - len(ids) + 8  # template, question, prefix; 8 for joins
    room = max(16, length - overhead)
    if len(ids) <= room:
        return sample
    half = room // 2
    decode = tokens.tokenizer.decode
    context = decode(ids[:half], skip_special_tokens=True) + decode(ids[len(ids) - (room - half) :], skip_special_tokens=True)
    return dataclasses.replace(sample, context=context, meta={**sample.meta, "truncated_from": len(ids)})


def make_samples(spec: SuiteSpec, samples: int, length: int, seed: int, tokens: _Tokens, data: dict) -> list[Sample]:
    """The samples of one group (``run_eval`` has checked that ``data`` holds what it reads)."""
    if spec.name == "longbench":
        loaded = load_longbench(data["longbench"], limit=samples)
        return [_truncate_middle(s, length, tokens) for s in loaded]
    if spec.name == "jsonl":
        return [_truncate_middle(s, length, tokens) for s in load_jsonl(data["jsonl"], limit=samples)]
    if spec.name == "ppl":
        # A little longer than asked, then cut to exactly `length` tokens (no padding needed).
        return make_suite("ppl", samples, length + length // 16 + 8, seed, tokens.count)
    if spec.name == "kl":
        # `length` prompt tokens, the continuation, and a margin for the 1% fit tolerance.
        needed = length + KL_CONTINUATION
        return make_suite("kl", samples, needed + needed // 16 + 8, seed, tokens.count, **spec.generator_variant)
    return make_suite(spec.name, samples, length, seed, tokens.count, **spec.generator_variant)


def _answer_steps(sample: Sample, tokens: _Tokens, cap: int | None) -> int:
    steps = tokens.count(", ".join(sample.answers)) + ANSWER_SLACK
    return min(steps, cap) if cap is not None else steps


def max_new_tokens_for(spec: SuiteSpec, sample: Sample, tokens: _Tokens, override: int | None) -> int:
    """Generation cap of one sample (see the module docstring)."""
    if override is not None:
        return override
    if spec.name == "fidelity":
        return FIDELITY_NEW_TOKENS
    if spec.name == "longbench":
        return LONGBENCH_MAX_NEW_TOKENS.get(sample.meta.get("task"), 64)
    if spec.name == "jsonl":
        return _answer_steps(sample, tokens, JSONL_MAX_NEW_TOKENS)
    return _answer_steps(sample, tokens, None)


# ---------------------------------------------------------------- scoring


def score_answer(spec: SuiteSpec, sample: Sample, prediction: str) -> dict:
    """Score of one generated answer (and the suite's extra metrics)."""
    if spec.name == "longbench":
        task = sample.meta["task"]
        return {"score": metrics.longbench_score(task, prediction, sample.answers, sample.meta.get("all_classes") or ())}
    if spec.name == "jsonl":
        return {
            "score": metrics.qa_f1(prediction, sample.answers),
            "em": metrics.exact_match(prediction, sample.answers),
            "f1": metrics.qa_f1(prediction, sample.answers),
            "rouge_l": metrics.rouge_l(prediction, sample.answers),
        }
    return {"score": metrics.string_match_all(prediction, sample.answers)}


def _rouge_vs(prediction: str, reference: str) -> float:
    if not prediction.strip() and not reference.strip():
        return 1.0
    return metrics.rouge_l(prediction, reference)


# ---------------------------------------------------------------- one suite at one length


class _SuiteAtLength:
    """One suite at one length: samples, cells, batches."""

    def __init__(self, runner: "_Runner", spec: SuiteSpec, length: int):
        self.runner, self.spec, self.length = runner, spec, length
        # compressed before the question: a method runs on its compress-once selection (KeepKV: kvzip's)
        self.compress_once = spec.setting == "agnostic"
        count = _samples_for(spec, runner.samples)
        self.samples = make_samples(spec, count, length, runner.seed, runner.tokens, runner.data)
        if not self.samples:
            raise ValueError(f"suite {spec.label} has no samples")
        ids = [s.id for s in self.samples]
        self.cells: list[Cell] = []
        for method, budget in runner.grid():
            instance = get_method(method, compress_once=self.compress_once)
            params = instance.params()
            key = {
                "suite": spec.label, "length": length, "method": method, "budget": budget, "params": params,
                "seed": runner.seed, "sample_ids": ids, "max_new_tokens": runner.max_new_tokens,
                "ppl_head": PPL_HEAD if spec.name == "ppl" else None,
                "continuation": KL_CONTINUATION if spec.name == "kl" else None,
            }
            cell = Cell(method, budget, params, cell_path(runner.out_dir, spec.label, length, method, budget), key)
            self.cells.append(cell)

    # -- resume --------------------------------------------------------------------------
    def load_finished(self) -> None:
        for cell in self.cells:
            if not cell.path.is_file():
                continue
            try:
                stored = json.loads(cell.path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if stored.get("key") == json.loads(json.dumps(cell.key, default=_json_default)):
                cell.records, cell.seconds, cell.done = stored["records"], stored.get("seconds", 0.0), True
                cell.cpu_seconds = stored.get("cpu_seconds", 0.0)

    def write(self, cell: Cell) -> None:
        cell.path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "suite": self.spec.label, "length": self.length, "method": cell.method, "budget": cell.budget,
            "params": cell.params, "seconds": round(cell.seconds, 3),
            "cpu_seconds": round(cell.cpu_seconds, 3), "key": cell.key,
            "summary": summarize_cell(cell.records), "records": cell.records,
        }
        tmp = cell.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(payload, indent=1, default=_json_default))
        os.replace(tmp, cell.path)
        cell.done = True

    # -- run -----------------------------------------------------------------------------
    def run(self, bar) -> None:
        """Compute the unfinished cells (sharded over worker processes) and write them."""
        fresh = [cell for cell in self.cells if not cell.done]
        bar.update(len(self.cells) - len(fresh))
        if not fresh:
            return
        todo = fresh
        full = self.cells[0]
        if self.spec.name in ("fidelity", "kl") and full.done:
            todo = [full, *fresh]  # the reference continuation is needed in memory
        samples = self.samples
        if self.spec.setting == "agnostic":  # one question length per batch: keep each length in few shards
            samples = sorted(samples, key=lambda sample: len(self._question_parts(sample)[1]))
        shards = _split(samples, self.runner.workers)
        started = time.perf_counter()
        if len(shards) == 1:
            results = [self.run_shard(todo, shards[0], progress=self.runner.progress)]
        else:
            results = _fork_map(self, todo, shards)
        for index, cell in enumerate(todo):
            cell.records = [record for result in results for record in result[index][0]]
            cell.seconds = max(result[index][1] for result in results)  # the workers ran in parallel
            cell.cpu_seconds = sum(result[index][2] for result in results)
        self.wall_seconds = time.perf_counter() - started
        for cell in fresh:
            self.write(cell)
        bar.update(len(fresh))

    def run_shard(self, todo: list[Cell], samples: list[Sample], progress: bool) -> list[tuple]:
        """(records, seconds, CPU seconds) of every cell in ``todo`` over ``samples``."""
        for cell in todo:
            cell.records, cell.seconds, cell.cpu_seconds = [], 0.0, 0.0
        needs = Needs.union([get_method(cell.method, compress_once=self.compress_once).needs(True) for cell in todo])
        size = self.runner.batch_size
        self.progress = progress
        if self.spec.setting == "agnostic":
            for batch in self._agnostic_batches(samples, size):
                self.run_agnostic_batch(batch, todo, needs)
        else:
            for start in range(0, len(samples), size):
                self.run_batch(samples[start : start + size], todo, needs)
        return [(cell.records, cell.seconds, cell.cpu_seconds) for cell in todo]

    def run_batch(self, batch: list[Sample], todo: list[Cell], needs: Needs) -> None:
        runner = self.runner
        model, eos = runner.model, runner.eos
        if self.spec.name == "ppl":
            return self.run_ppl_batch(batch, todo, needs)
        if self.spec.name == "kl":
            return self.run_kl_batch(batch, todo, needs)
        fidelity = self.spec.name == "fidelity"
        texts = [build_prompts(runner.tokenizer, [s.prompt], True, s.answer_prefix)[0] for s in batch]
        if fidelity:
            texts = texts + texts  # rows B..2B-1 are teacher-forced with the full continuation
        inputs = encode(runner.tokenizer, texts, True, runner.device)
        mask = inputs["attention_mask"]
        rows = len(batch)
        limits = [max_new_tokens_for(self.spec, s, runner.tokens, runner.max_new_tokens) for s in batch]
        if fidelity:
            limits = limits + limits
        clock = _Clock(todo)
        record = CompressedCache(model.config, "full", record=needs)
        first_logits = prefill(model, record, inputs["input_ids"], mask, runner.tokenizer)
        clock.share(todo)

        reference = None
        rest = todo
        if fidelity:
            # The full cache runs alone first: the other cells are teacher-forced with its answer.
            full, rest = todo[0], todo[1:]
            logps = []
            cache = record.fork(self.runner.instance(full.method, self.compress_once), full.budget)
            out = greedy_decode(
                model, cache, first_logits, mask, limits, eos, progress=self.progress,
                observe=lambda t, logits: logps.append(torch.log_softmax(logits[:rows], -1)),
            )
            reference = (out[:rows], torch.stack(logps, dim=1))
            full.records.extend(self._fidelity_records(batch, out, None, reference, cache, mask))
            clock.share([full])
        force = None
        if fidelity:
            force = torch.cat([torch.full_like(reference[0], -1), reference[0]], dim=0)
        for chunk in _chunks(rest, runner.joint_cells):
            caches = [record.fork(self.runner.instance(cell.method, self.compress_once), cell.budget, self.spec.decoding) for cell in chunk]
            logps = []
            observe = None
            if fidelity:
                observe = lambda t, logits: logps.append(  # noqa: E731
                    torch.log_softmax(logits.view(len(chunk), 2 * rows, -1)[:, rows:], -1)
                )
            outs = decode_cells(
                model, caches, first_logits, mask, limits, eos, force=force, observe=observe, progress=self.progress
            )
            for index, (cell, cache, out) in enumerate(zip(chunk, caches, outs)):
                if fidelity:
                    own_logps = torch.stack([step[index] for step in logps], dim=1)
                    cell.records.extend(self._fidelity_records(batch, out, own_logps, reference, cache, mask))
                else:
                    cell.records.extend(self._answer_records(batch, out, cache, mask))
            clock.share(chunk)
            del caches

    def _agnostic_batches(self, samples: list[Sample], size: int) -> list[list[tuple]]:
        """Batches of (sample, context ids, question ids) whose question parts have one length: the
        question is appended as one block after the compressed context, and padding inside that
        block would add padded queries to the statistics of methods that score while decoding."""
        by_length: dict[int, list[tuple]] = {}
        for sample in samples:
            head, tail = self._question_parts(sample)
            by_length.setdefault(len(tail), []).append((sample, head, tail))
        return [items[i : i + size] for _, items in sorted(by_length.items()) for i in range(0, len(items), size)]

    def _question_parts(self, sample: Sample) -> tuple[list[int], list[int]]:
        """(context ids, question ids) of a sample (:func:`keepkv.generation.context_and_question_ids`)."""
        parts = self.__dict__.setdefault("_parts", {})
        if sample.id not in parts:
            parts[sample.id] = context_and_question_ids(
                self.runner.tokenizer, sample.context, sample.question, True, sample.answer_prefix
            )
        return parts[sample.id]

    def run_agnostic_batch(self, parts: list[tuple], todo: list[Cell], needs: Needs) -> None:
        """Question-agnostic: prefill and compress the contexts (template start + document), then
        append each sample's question part (separator, question, template end, answer prefix) to
        every cell's compressed cache as one block, then decode greedily."""
        runner = self.runner
        model, eos, device = runner.model, runner.eos, runner.device
        batch = [sample for sample, _, _ in parts]
        width = max(len(head) for _, head, _ in parts)
        pad = runner.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(head)) + head for _, head, _ in parts], device=device)
        mask = torch.tensor([[0] * (width - len(head)) + [1] * len(head) for _, head, _ in parts], device=device)
        question = torch.tensor([tail for _, _, tail in parts], device=device)
        full_mask = torch.cat([mask, torch.ones_like(question)], dim=-1)
        limits = [max_new_tokens_for(self.spec, s, runner.tokens, runner.max_new_tokens) for s in batch]
        clock = _Clock(todo)
        record = CompressedCache(model.config, "full", record=needs)
        prefill(model, record, input_ids, mask, runner.tokenizer)
        clock.share(todo)
        for chunk in _chunks(todo, runner.joint_cells):
            caches = [record.fork(self.runner.instance(cell.method, self.compress_once), cell.budget, self.spec.decoding) for cell in chunk]
            outs = decode_cells(model, caches, None, mask, limits, eos, question=question, progress=self.progress)
            for cell, cache, out in zip(chunk, caches, outs):
                cell.records.extend(self._answer_records(batch, out, cache, full_mask))
            clock.share(chunk)
            del caches

    @staticmethod
    def _cache_fields(cache) -> list[dict]:
        """Per row: mean kept entries per layer and head, and bytes, at the end of decoding."""
        summary = cache.summary()
        return [
            {"kept_entries": kept, "cache_bytes": held, "full_cache_bytes": full}
            for kept, held, full in zip(summary.kept_entries, summary.cache_bytes, summary.full_cache_bytes)
        ]

    def _answer_records(self, batch, out, cache, mask) -> list[dict]:
        eos, decode = self.runner.eos, self.runner.tokenizer.decode
        memory = self._cache_fields(cache)
        records = []
        for row, sample in enumerate(batch):
            ids = _strip(out[row].tolist(), eos)
            prediction = decode(ids, skip_special_tokens=True).strip()
            records.append({
                "id": sample.id, "prediction": prediction, "answers": sample.answers,
                **score_answer(self.spec, sample, prediction),
                "prompt_tokens": int(mask[row].sum()), "new_tokens": len(ids), "output_ids": ids,
                **memory[row], "meta": sample.meta,
            })
        return records

    def _fidelity_records(self, batch, out, logps, reference, cache, mask) -> list[dict]:
        eos, decode = self.runner.eos, self.runner.tokenizer.decode
        ref_tokens, ref_logps = reference
        memory = self._cache_fields(cache)
        records = []
        for row, sample in enumerate(batch):
            ref = _with_eos(ref_tokens[row].tolist(), eos)
            own = _with_eos(out[row].tolist(), eos)
            prefix = 0
            while prefix < min(len(ref), len(own)) and ref[prefix] == own[prefix]:
                prefix += 1
            same = sum(a == b for a, b in zip(ref, own))
            span = max(1, len(ref))
            if logps is None:
                kl = 0.0
            else:
                count = min(len(ref), logps.shape[1], ref_logps.shape[1])
                kl = metrics.kl_divergence(ref_logps[row, :count], logps[row, :count]) if count else 0.0
            prediction = decode(_strip(own, eos), skip_special_tokens=True).strip()
            full_answer = decode(_strip(ref, eos), skip_special_tokens=True).strip()
            rouge = _rouge_vs(prediction, full_answer)
            records.append({
                "id": sample.id, "prediction": prediction, "full_prediction": full_answer, "score": rouge,
                "rouge_l": rouge, "agree_prefix": prefix, "agree_share": same / span, "kl": kl,
                "prompt_tokens": int(mask[row].sum()), "new_tokens": len(_strip(own, eos)), "output_ids": own,
                **memory[row], "meta": {**sample.meta, "instruction": sample.question},
            })
        return records

    def _text_ids(self, batch, count: int) -> torch.Tensor:
        """The first ``count`` tokens of every sample's text, [B, count] (no template, no padding)."""
        ids = []
        for sample in batch:
            sample_ids = self.runner.tokens.ids(sample.context)
            if len(sample_ids) < count:
                raise ValueError(f"{self.spec.name} sample {sample.id} has {len(sample_ids)} tokens, fewer than {count}")
            ids.append(sample_ids[:count])
        return torch.tensor(ids, device=self.runner.device)

    def _prefill_texts(self, batch, head: int, length: int, todo, needs):
        """The batch's texts as ``length`` token ids [B, length], their first ``head`` prefilled into a
        full recording cache: (input_ids, mask, record, the last prefill logits, the cells' clock)."""
        input_ids = self._text_ids(batch, length)
        mask = torch.ones_like(input_ids)
        clock = _Clock(todo)
        record = CompressedCache(self.runner.model.config, "full", record=needs)
        first_logits = prefill(self.runner.model, record, input_ids[:, :head], mask[:, :head], self.runner.tokenizer, chat=False)
        clock.share(todo)
        return input_ids, mask, record, first_logits, clock

    def run_kl_batch(self, batch, todo, needs) -> None:
        """Prefill ``length`` tokens of real text, then teacher-force the next ``KL_CONTINUATION``
        into every cell at once, the full cache first in every chunk: per step and row,
        KL(full || method) of the next-token distribution and each cell's NLL of the true token."""
        runner = self.runner
        model, head = runner.model, self.length
        input_ids, mask, record, first_logits, clock = self._prefill_texts(batch, head, head + KL_CONTINUATION, todo, needs)
        targets = input_ids[:, head:]
        rows = len(batch)
        full, rest = todo[0], todo[1:]
        for number, chunk in enumerate(_chunks(rest, runner.joint_cells) if rest else [[]]):
            cells = [full, *chunk]
            caches = [record.fork(self.runner.instance(cell.method, self.compress_once), cell.budget, self.spec.decoding) for cell in cells]
            kl, nll = [], []

            def observe(t, logits):
                logp = torch.log_softmax(logits, -1).view(len(cells), rows, -1)  # [cells, rows, V]
                kl.append((logp[0].exp() * (logp[0] - logp)).sum(-1))
                nll.append(-logp.gather(-1, targets[None, :, t : t + 1].expand(len(cells), -1, -1))[..., 0])

            decode_cells(
                model, caches, first_logits, mask[:, :head], KL_CONTINUATION, None, force=targets,
                observe=observe, progress=self.progress,
            )
            kl, nll = torch.stack(kl, dim=-1).mean(-1), torch.stack(nll, dim=-1).mean(-1)  # [cells, rows]
            for index, (cell, cache) in enumerate(zip(cells, caches)):
                if index == 0 and number > 0:
                    continue  # the full cache's records come from the first chunk
                memory = self._cache_fields(cache)
                for row, sample in enumerate(batch):
                    cell.records.append({
                        "id": sample.id, "score": float(kl[index, row]), "kl": float(kl[index, row]),
                        "nll": float(nll[index, row]), "nll_delta": float(nll[index, row] - nll[0, row]),
                        "tokens_scored": KL_CONTINUATION, "prompt_tokens": head, **memory[row], "meta": sample.meta,
                    })
            clock.share(cells if number == 0 else chunk)
            del caches

    def run_ppl_batch(self, batch, todo, needs) -> None:
        runner = self.runner
        model, length = runner.model, self.length
        head = min(PPL_HEAD, length - 1)
        input_ids, mask, record, first_logits, clock = self._prefill_texts(batch, head, length, todo, needs)
        targets = input_ids[:, head:]
        rows = len(batch)
        for chunk in _chunks(todo, runner.joint_cells):
            entries = [budget_for(cell.method, ppl_entries(cell.budget, length)) for cell in chunk]
            caches = [record.fork(self.runner.instance(cell.method, self.compress_once), count, self.spec.decoding) for cell, count in zip(chunk, entries)]
            nll = []

            def observe(t, logits):
                logp = torch.log_softmax(logits, -1).view(len(chunk), rows, -1)
                nll.append(-logp.gather(-1, targets[None, :, t : t + 1].expand(len(chunk), -1, -1))[..., 0])

            decode_cells(
                model, caches, first_logits, mask[:, :head], length - head, None, force=targets,
                observe=observe, progress=self.progress,
            )
            nll = torch.stack(nll, dim=-1)  # [cells, rows, tokens]
            for index, (cell, cache, count) in enumerate(zip(chunk, caches, entries)):
                memory = self._cache_fields(cache)
                for row, sample in enumerate(batch):
                    mean_nll = float(nll[index, row].mean())
                    cell.records.append({
                        "id": sample.id, "score": math.exp(mean_nll), "nll": mean_nll,
                        "tokens_scored": nll.shape[-1], "prompt_tokens": head, "total_tokens": length,
                        "budget_entries": count, **memory[row], "meta": sample.meta,
                    })
            clock.share(chunk)
            del caches


def _split(samples: list, parts: int) -> list[list]:
    """``samples`` in at most ``parts`` contiguous, nearly equal shards."""
    parts = max(1, min(parts, len(samples)))
    size, extra = divmod(len(samples), parts)
    shards, start = [], 0
    for index in range(parts):
        stop = start + size + (index < extra)
        shards.append(samples[start:stop])
        start = stop
    return shards


_FORKED: tuple | None = None  # (group, todo, shards, threads) inherited by forked workers


def _shard_job(index: int):
    group, todo, shards, threads = _FORKED
    torch.set_num_threads(threads)
    return group.run_shard(todo, shards[index], progress=group.runner.progress and index == 0)


def _fork_map(group, todo, shards) -> list:
    """Run the shards in forked worker processes (CPU only), one thread each by default. A SIGTERM
    meanwhile ends the workers with the run (:func:`_exit_on_sigterm`), none left computing."""
    import multiprocessing

    global _FORKED
    threads = max(1, group.runner.threads // len(shards))
    _FORKED = (group, todo, shards, threads)
    try:
        with multiprocessing.get_context("fork").Pool(len(shards)) as pool, _exit_on_sigterm():
            return pool.map(_shard_job, range(len(shards)))
    finally:
        _FORKED = None


@contextlib.contextmanager
def _exit_on_sigterm():
    """While inside (installed after the workers fork, so they keep the default): SIGTERM raises
    SystemExit(143) in this process, so that the pool's ``with`` terminates and joins its workers
    on the way out (SIGTERM's default would end this process alone, and leave them computing)."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        yield
        return

    def stop(number, frame):
        raise SystemExit(128 + number)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def ppl_entries(budget, length: int) -> int:
    """The ppl suite's entry budget: a fraction of the whole text, or an entry count as is."""
    return max(1, round(budget * length)) if isinstance(budget, float) else budget


def _chunks(items: list, size: int | None) -> list[list]:
    size = size or max(1, len(items))
    return [items[i : i + size] for i in range(0, len(items), size)]


class _Clock:
    """Wall and CPU time (this process) split evenly over the cells that shared them."""

    def __init__(self, cells):
        self.last, self.last_cpu = time.perf_counter(), time.process_time()

    def share(self, cells) -> None:
        now, now_cpu = time.perf_counter(), time.process_time()
        for cell in cells:
            cell.seconds += (now - self.last) / len(cells)
            cell.cpu_seconds += (now_cpu - self.last_cpu) / len(cells)
        self.last, self.last_cpu = now, now_cpu


# ---------------------------------------------------------------- summaries

def _json_default(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")

# ---------------------------------------------------------------- the run


class _Runner:
    def __init__(self, model, tokenizer, *, methods, budgets, samples, seed, out_dir, max_new_tokens,
                 progress, data, batch_size, joint_cells, workers):
        if tokenizer is None:
            raise ValueError("the evaluation needs a tokenizer (the model directory has none)")
        self.model, self.tokenizer = model, tokenizer
        self.tokens = _Tokens(tokenizer)
        self.methods, self.budgets = methods, budgets
        self.samples, self.seed, self.out_dir = samples, seed, Path(out_dir)
        self.max_new_tokens, self.progress, self.data = max_new_tokens, progress, data
        self.batch_size = batch_size
        self.joint_cells = joint_cells
        self.device = next(model.parameters()).device
        self.threads = torch.get_num_threads()
        if workers is None:
            workers = _default_workers() if self.device.type == "cpu" else 1
        if workers > 1 and self.device.type != "cpu":
            raise ValueError("workers > 1 forks processes and needs the model on the CPU")
        self.workers = workers
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.eos = tokenizer.eos_token_id
        self._instances: dict = {}

    def instance(self, spec: str, compress_once: bool = False):
        """The method ``spec`` names (on its compress-once selection with ``compress_once``: a
        question-agnostic suite), prepared for the model once (KVReviver's Fisher layer scores live
        on the instance), shared by every cell of it."""
        key = (spec, compress_once)
        if key not in self._instances:
            self._instances[key] = get_method(spec, compress_once=compress_once)
            self._instances[key].prepare(self.model)
        return self._instances[key]

    def grid(self) -> list[tuple[str, int | float]]:
        cells = [("full", 1.0)]
        for method in self.methods:
            if method != "full":
                cells += [(method, budget) for budget in self.budgets]
        return cells


def _default_workers() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS))


def _samples_for(spec: SuiteSpec, samples) -> int:
    """Samples of one suite: ``samples`` itself, or its entry by label, then by suite name."""
    if isinstance(samples, dict):
        for key in (spec.label, spec.task_label, spec.name):
            if key in samples:
                return samples[key]
        return DEFAULT_SAMPLES_OTHER
    return samples


def _lengths_for(spec: SuiteSpec, lengths) -> list[int]:
    if lengths is None:
        return [DEFAULT_LENGTHS[spec.name]]
    if isinstance(lengths, dict):
        key = next((k for k in (spec.label, spec.task_label) if k in lengths), spec.name)
        chosen = lengths.get(key, DEFAULT_LENGTHS[spec.name])
        return list(chosen) if isinstance(chosen, (list, tuple)) else [chosen]
    return list(lengths)


def check_lengths(config, plan: list[tuple[SuiteSpec, int]], max_new_tokens: int | None) -> None:
    """Refuse, in one line and before any work, a group longer than the model's context
    (``max_position_embeddings``; scores past the trained positions would measure the model, not
    the cache) or, on a sliding-window model, than its window (keepkv.models.check_context)."""
    from ..models import check_context

    limit = getattr(config, "max_position_embeddings", None)
    for spec, length in plan:
        extra = KL_CONTINUATION if spec.name == "kl" else (max_new_tokens or 64)
        if limit is not None and length + extra > limit:
            raise ValueError(
                f"suite {spec.label} at {length} tokens: with up to {extra} new tokens it exceeds the model's context "
                f"of {limit} tokens (max_position_embeddings); choose --lengths of at most {limit - extra}"
            )
        try:
            check_context(config, length + extra)
        except ValueError as error:
            raise ValueError(f"suite {spec.label} at {length} tokens: {error}") from None


def check_suite(spec: SuiteSpec) -> None:
    """Refuse, in one line, a suite variant its generator does not take (a key or a value): one
    sample of it is made, without a tokenizer (a few milliseconds)."""
    if spec.name in SUITES:
        try:
            make_suite(spec.name, 1, 256, TEST_SEED, None, **spec.generator_variant)
        except TypeError as error:  # an unknown keyword
            raise ValueError(f"suite {spec.label}: {error}") from None
        except ValueError as error:
            raise ValueError(f"suite {spec.label}: {error}") from None


def check_data(spec: SuiteSpec, data: dict) -> None:
    """Refuse, in one line, a local-data suite (:data:`DATA_SUITES`) that ``data`` gives nothing to read."""
    if spec.name in DATA_SUITES and spec.name not in data:
        raise ValueError(f"the {spec.name} suite needs {DATA_NEEDED[spec.name]}")


def default_methods() -> list[str]:
    """The methods of a run that names none: every registered one and ``DEFAULT_VARIANTS``."""
    return [*METHODS, *DEFAULT_VARIANTS]


class _Budget:
    """What ``Method.check_budget`` reads of a cache: its budget alone."""

    def __init__(self, budget):
        self.budget = budget


def check_grid(methods, budgets, plan: list[tuple[SuiteSpec, int]]) -> None:
    """Refuse, in one line and before any work (the command line: before the model loads), a
    method or variant that does not build, a budget out of range, or a budget below what a method
    can run at: an entry budget under its protected tokens (``check_budget_holds``, the command
    line's rule) or under its own minimum (``check_budget``: KVReviver's sketch), the ppl suite's
    entry budgets (a fraction of its text) included. The full cache runs at 1.0 alone."""
    budgets = [validate_budget(budget) for budget in budgets]
    lengths = sorted({length for spec, length in plan if spec.name == "ppl"})
    # every name and variant first, on its compress-once selection too (a question-agnostic suite's)
    built = [(name, get_method(name, compress_once=once)) for name in methods for once in (False, True)]
    for budget in budgets:
        refused = []
        for name, method in built:
            if method.name == "full":
                continue
            try:
                check_budget_holds(method, budget)
                for entries in {budget, *(ppl_entries(budget, length) for length in lengths)}:
                    method.check_budget(_Budget(entries))
            except ValueError as error:
                refused.append((name, str(error)))
        if refused:
            (name, why), others = refused[0], [o for o in dict.fromkeys(n for n, _ in refused) if o != refused[0][0]]
            also = f"; too small for {', '.join(others)} too" if others else ""
            raise ValueError(f"{name} at budget {budget}: {why}{also}")


def auto_batch_size(model, length: int, cells: int) -> int:
    """Samples per prefill batch: DEFAULT_BATCH_SIZE on the CPU; on a GPU, as many as a quarter
    of the free memory holds, counting per row the uncompressed prompt of the recording
    prefill and of the full cell, the compressed cells (each at most the prompt) and 16 hidden
    states per token of activations, at most 64."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return DEFAULT_BATCH_SIZE
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    kv_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element
    per_row = length * (kv_token * (2 + 0.25 * cells) + 16 * config.hidden_size * element)
    free, _ = torch.cuda.mem_get_info(device)
    return int(max(1, min(64, free // 4 // max(1, per_row))))


def run_eval(
    model,
    tokenizer,
    *,
    suites=DEFAULT_SUITES,
    methods=None,
    budgets=DEFAULT_BUDGETS,
    samples: int | dict = DEFAULT_SAMPLES,
    lengths=None,
    seed: int = TEST_SEED,
    out_dir="runs/eval",
    max_new_tokens: int | None = None,
    progress: bool = True,
    data: dict | None = None,
    batch_size: int | None = DEFAULT_BATCH_SIZE,
    joint_cells: int | None = None,
    workers: int | None = None,
    reference: str | None = None,
    plot: bool = True,
    averages: dict | None = None,
    sweep: bool = False,
) -> list[dict]:
    """Evaluate every method at every budget on every suite; return the summary rows.

    Parameters
    ----------
    model, tokenizer
        A Llama-family causal LM (switched to keepkv's attention) and its tokenizer.
    suites : list of str
        Suite names (``needle``, ``tracking``, ``aggregation``, ``ppl``, ``fidelity``, ``kl``,
        ``longbench``, ``jsonl``), optionally with generator variants
        (``needle+variant=multikey``, ``kl+source=stdlib``).
    methods : list of str, optional
        Registered method names; default: every registered method. ``full`` always runs.
    budgets : list of float or int
        Fractions of each prompt in (0, 1] or entry counts (see ``ppl`` in the module doc).
    samples : int or dict suite -> int
        Samples per suite and length (every cell sees the same ones); a dict is looked up by
        suite label, then name, else ``DEFAULT_SAMPLES_OTHER``.
    lengths : int list, or dict suite -> int or list, optional
        Context lengths in tokens; default ``DEFAULT_LENGTHS``.
    seed : int
        Sample seed: ``TEST_SEED`` (0) for reported numbers, ``DEV_SEED`` (1000+) for tuning.
    out_dir : path
        Where cells, ``summary.csv``, ``scores.png`` and ``config.json`` go.
    max_new_tokens : int, optional
        Overrides every suite's generation cap.
    data : dict, optional
        ``{"longbench": DIR, "jsonl": FILE}`` for the local-dataset suites.
    batch_size : int, optional
        Samples per prefill batch (left padded; fidelity uses two rows per sample); None: from the
        model and device (:func:`auto_batch_size`).
    joint_cells : int, optional
        Cells decoded together in one forward pass (:class:`JointCache`); default: all of a
        group's cells at once. 1 decodes each cell alone.
    workers : int, optional
        Processes that split each group's samples (forked after the model is loaded; CPU
        only). Default: the CPU cores available to this process, at most ``MAX_WORKERS``;
        each worker gets ``torch.get_num_threads() // workers`` threads.
    reference : str, optional
        One of ``methods``: every cell also gets its paired difference against this method
        at the same budget (``diff_ref*`` columns); the full cache is always a reference
        (``diff_full*``).
    averages : dict name -> list of suite labels, optional
        Extra summary rows ``name``: per method and budget, the unweighted mean of those suites'
        scores (RULER's average over tasks; ``keepkv eval --suite ruler``).
    sweep : bool
        Also draw ``sweep.png``: the mean score of the higher-is-better suites against the
        compression ratio (1 - budget), one line per method.

    Returns
    -------
    list of dict
        One row per (suite, length, method, budget), as in ``summary.csv``.
    """
    methods = default_methods() if methods is None else list(methods)
    if reference is not None and reference not in methods:
        raise ValueError(f"reference {reference!r} is not among the methods run: {', '.join(methods)}")
    budgets = list(budgets)
    for count in samples.values() if isinstance(samples, dict) else [samples]:
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"samples must be an int >= 1 (or a dict suite -> int >= 1), got {samples!r}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    specs = [spec if isinstance(spec, SuiteSpec) else SuiteSpec.parse(spec) for spec in suites]
    check_grid(methods, budgets, [(spec, n) for spec in specs for n in _lengths_for(spec, lengths)])
    data = dict(data or {})
    for spec in specs:
        check_data(spec, data)
    check_lengths(model.config, [(spec, n) for spec in specs for n in _lengths_for(spec, lengths)], max_new_tokens)
    if batch_size is None:
        longest = max(n for spec in specs for n in _lengths_for(spec, lengths))
        batch_size = auto_batch_size(model, longest, 1 + len(methods) * len(budgets))
    runner = _Runner(
        model, tokenizer, methods=methods, budgets=budgets, samples=samples, seed=seed, out_dir=out_dir,
        max_new_tokens=max_new_tokens, progress=progress, data=data, batch_size=batch_size,
        joint_cells=joint_cells, workers=workers,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = [(spec, length) for spec in specs for length in _lengths_for(spec, lengths)]
    config = {
        "suites": [spec.label for spec in specs], "lengths": {spec.label: _lengths_for(spec, lengths) for spec in specs},
        "methods": ["full", *[m for m in methods if m != "full"]], "budgets": budgets, "samples": samples,
        "seed": seed, "max_new_tokens": max_new_tokens, "batch_size": batch_size, "workers": runner.workers,
        "joint_cells": joint_cells, "reference": reference, "ppl_head": PPL_HEAD,
        "kl_continuation": KL_CONTINUATION,
        "fidelity_new_tokens": FIDELITY_NEW_TOKENS, "answer_slack": ANSWER_SLACK, "data": data,
        "model": getattr(model.config, "_name_or_path", "") or model.config.model_type,
        "method_params": {m: dataclasses.asdict(get_method(m)) for m in ["full", *methods]},
        # where a question-agnostic suite runs a method on another selection (keepkv: kvzip's)
        "compress_once_params": {
            m: once for m in methods if (once := get_method(m, compress_once=True).params()) != get_method(m).params()
        },
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=1, default=_json_default))

    groups = []
    started = time.perf_counter()
    total_cells = len(plan) * len(runner.grid())
    with tqdm(total=total_cells, desc="eval cells", unit="cell", disable=not progress) as bar:
        for spec, length in plan:
            bar.set_postfix_str(f"{spec.label} {length}")
            group = _SuiteAtLength(runner, spec, length)
            group.load_finished()
            group.run(bar)
            groups.append(group)
    rows = summary_rows(groups, reference)
    for name, members in (averages or {}).items():
        rows += average_rows(rows, name, members)
    write_summary(rows, out_dir / "summary.csv")
    if plot and can_plot("keepkv eval", f"the numbers are in {out_dir / 'summary.csv'}"):
        from .plot import plot_scores, plot_sweep

        plot_scores([row for row in rows if not row.get("average_of")], out_dir / "scores.png")
        if sweep:
            plot_sweep(rows, out_dir / "sweep.png")
    (out_dir / "timing.json").write_text(json.dumps({"wall_seconds": round(time.perf_counter() - started, 2)}))
    return rows
