"""keepkv against kvpress on the same question-agnostic prompts.

What it reproduces: keepkv's eval suites ``needle+setting=agnostic`` and
``passkey+setting=agnostic`` (1,024 tokens, seed 0, the first N samples), run sample by sample
on the embedded SmolLM2-135M-Instruct (fp32, CPU) by both libraries in one process. For every
sample the context (chat template start + document) is prefilled and compressed before the
question is seen; the question part (separator, question, template end, answer prefix) is then
appended uncompressed and the answer decoded greedily, up to the eval's cap (answer tokens + 8).

- keepkv: ``keepkv.compress(model, tokenizer, context, method, budget)`` then
  ``keepkv.generate(model, tokenizer, question, past_key_values=cache, answer_prefix=...)``.
- kvpress: ``KVPressTextGenerationPipeline(context, question=..., answer_prefix=..., press=...)``,
  which compresses the context only and appends the question uncompressed, with
  ``compression_ratio = 1 - budget``. The question is given as ``"\\n\\n" + question`` so that
  kvpress feeds exactly the token ids keepkv feeds (keepkv puts this separator at the start of
  the question part); the script checks that both sides' context and question ids are identical.

Samples, caps and scores come from keepkv's own eval (``keepkv.eval.runner``: ``SuiteSpec``,
``make_samples``, ``max_new_tokens_for``, ``score_answer``: RULER's string_match_all). Every
configuration runs on a sample before the next sample starts, so the slow phases of a busy
machine fall on both sides alike.

kvpress 0.5.5 (the newest release) supports transformers < 5.3; keepkv needs a newer one (it
imports ``transformers.GgufConfig``). From transformers 5.2x on, the attention layer receives the
cache as ``cache=`` (no longer ``past_key_values=``) and no ``cache_position``, both of which
kvpress's forward hooks read. :func:`adapt_press` wraps a press's hook to add those two keyword
arguments, computed from the cache (``cache_position`` = the positions this call appended); it
changes nothing else and does nothing where the old names are still passed. ``--replay`` checks
it: it reruns the kvpress side alone, without keepkv, on the prompts a run stored, for use in a
venv with transformers 5.2 where kvpress runs unadapted, and counts identical answers.

Set-up (kvpress is never a dependency of keepkv: a side venv that sees the system torch,
transformers and the editable keepkv; kvpress pins transformers<5.3, so it goes in without its
dependencies and only the small packages it imports are added)::

    python -m venv --system-site-packages /work/.venv-kvpress
    /work/.venv-kvpress/bin/pip install --no-deps kvpress==0.5.5
    /work/.venv-kvpress/bin/pip install cachetools datasets fire

Run::

    /work/.venv-kvpress/bin/python benchmarks/kvpress/compare.py --samples 12 \\
        --out docs/record/data/kvpress/compare.json

On a busy machine, one process per suite side by side, then one output::

    for suite in needle passkey; do /work/.venv-kvpress/bin/python benchmarks/kvpress/compare.py \
        --samples 12 --suites $suite+setting=agnostic --out docs/record/data/kvpress/compare-$suite.json & done; wait
    /work/.venv-kvpress/bin/python benchmarks/kvpress/compare.py --merge docs/record/data/kvpress/compare-needle.json \
        docs/record/data/kvpress/compare-passkey.json --out docs/record/data/kvpress/compare.json

Check the adapter (optional; kvpress on its own supported transformers)::

    python -m venv --system-site-packages /work/.venv-kvpress-tf52
    /work/.venv-kvpress-tf52/bin/pip install --no-deps kvpress==0.5.5
    /work/.venv-kvpress-tf52/bin/pip install cachetools datasets fire transformers==5.2.0
    /work/.venv-kvpress-tf52/bin/python benchmarks/kvpress/compare.py \\
        --replay docs/record/data/kvpress/compare.json --out docs/record/data/kvpress/replay-tf52.json
"""

from __future__ import annotations

# kvpress before keepkv: importing kvpress wraps every attention function registered in
# transformers at that moment (kvpress.attention_patch). keepkv's "keepkv" attention takes
# ``scaling`` before ``dropout``, which that wrapper passes positionally, so it must be
# registered after (keepkv registers it when its public names are first used).
import kvpress  # isort: skip
from kvpress import KeyDiffPress, KVPressTextGenerationPipeline, KVzipPress, SnapKVPress  # isort: skip

import argparse
import dataclasses
import importlib.metadata
import json
import platform
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

SUITES = ("needle+setting=agnostic", "passkey+setting=agnostic")
KEEPKV_METHODS = ("kvzip", "keepkv+selection=kvzip", "keydiff", "snapkv")
# keepkv's kvzip splits the budget over layers with equal heads ("layers"); kvpress's KVzipPress
# default (layerwise=False) is one top-k over every layer and head: keepkv's "budgets=global".
KEEPKV_EXTRA = ("kvzip+budgets=global",)
KVPRESS_PRESSES = {"KVzipPress": KVzipPress, "KeyDiffPress": KeyDiffPress, "SnapKVPress": SnapKVPress}
SEPARATOR = "\n\n"  # keepkv.generation.QUESTION_SEPARATOR (checked in main)
ADAPTED_CALLS = 0  # hook calls that got the adapter's keyword arguments


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def versions() -> dict:
    found = {"transformers": transformers.__version__, "torch": torch.__version__, "python": platform.python_version()}
    for package in ("kvpress", "keepkv", "tokenizers"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


# ---------------------------------------------------------------- kvpress side


def adapt_press(press):
    """Let kvpress 0.5.5's forward hook run on transformers >= 5.2x (see the module docstring):
    add ``past_key_values`` (the cache) and ``cache_position`` (the positions this call appended,
    read from the cache after its update) when the attention layer got ``cache=`` instead."""
    hook = press.forward_hook

    def forward_hook(module, args, kwargs, output):
        global ADAPTED_CALLS
        if "past_key_values" not in kwargs and kwargs.get("cache") is not None:
            cache = kwargs["cache"]
            appended = kwargs["hidden_states"].shape[1]
            length = cache.get_seq_length(module.layer_idx)
            position = torch.arange(length - appended, length, device=kwargs["hidden_states"].device)
            kwargs = {**kwargs, "past_key_values": cache, "cache_position": position}
            ADAPTED_CALLS += 1
        return hook(module, args, kwargs, output)

    press.forward_hook = forward_hook
    return press


def kvpress_kept_entries(model, cache) -> float:
    """Mean entries per layer and KV head that attention can see after the press: the cache's
    length, less the entries KVzipPress masks (it leaves them in the cache: attention_patch)."""
    config = model.config
    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    held = sum(cache.get_seq_length(layer) for layer in range(layers)) * heads
    masked = 0
    for layer in model.model.layers:
        indices = getattr(layer.self_attn, "masked_key_indices", None)
        if indices is not None:
            masked += len(indices[0])
    return (held - masked) / (layers * heads)


def run_kvpress(pipe, prompt: dict, press_name: str | None, budget: float) -> dict:
    """The kvpress pipeline: the press around the context's prefill, the question appended."""
    press = None
    if press_name is not None:
        press = adapt_press(KVPRESS_PRESSES[press_name](compression_ratio=round(1 - budget, 6)))
    cache = DynamicCache()
    started = time.perf_counter()
    out = pipe(
        prompt["context"], question=SEPARATOR + prompt["question"], answer_prefix=prompt["answer_prefix"],
        press=press, max_new_tokens=prompt["max_new_tokens"], cache=cache,
    )
    seconds = time.perf_counter() - started
    kept = kvpress_kept_entries(pipe.model, cache)
    for layer in pipe.model.model.layers:  # KVzip's mask must not outlive its context
        layer.self_attn.masked_key_indices = None
    return {"prediction": out["answer"].strip(), "seconds": seconds, "kept_entries": kept}


def kvpress_ids(pipe, prompt: dict) -> tuple[list[int], list[int]]:
    """The context ids and question ids kvpress's pipeline feeds."""
    tensors = pipe.preprocess(
        prompt["context"], questions=[SEPARATOR + prompt["question"]], answer_prefix=prompt["answer_prefix"],
        max_context_length=10**9,
    )
    return tensors["context_ids"][0].tolist(), tensors["questions_ids"][0][0].tolist()


def kvpress_pipeline(directory: str):
    """The model for kvpress: the same weights as keepkv's, SDPA, loaded from keepkv's model
    directory (KVzipPress reloads the tokenizer from ``config.name_or_path``)."""
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="sdpa").eval()
    return KVPressTextGenerationPipeline(model=model, tokenizer=AutoTokenizer.from_pretrained(directory))


# ---------------------------------------------------------------- keepkv side


def run_keepkv(model, tokenizer, prompt: dict, method: str, budget: float) -> dict:
    """Compress the context, then ask the question on the compressed cache (append decoding)."""
    import keepkv

    started = time.perf_counter()
    cache = keepkv.compress(model, tokenizer, prompt["context"], method=method, budget=budget)
    kept = float(cache.summary().kept_entries[0])  # mean live entries per layer and KV head, context only
    result = keepkv.generate(
        model, tokenizer, prompt["question"], past_key_values=cache, max_new_tokens=prompt["max_new_tokens"],
        answer_prefix=prompt["answer_prefix"],
    )[0]
    return {"prediction": result.answer, "seconds": time.perf_counter() - started, "kept_entries": kept}


# ---------------------------------------------------------------- tables


def configurations(budgets, keepkv_methods, presses) -> list[tuple[str, str, float]]:
    """(library, method or press, budget); the full cache first on each side."""
    grid = [("keepkv", "full", 1.0), ("kvpress", "none", 1.0)]
    for budget in budgets:
        grid += [("keepkv", method, budget) for method in keepkv_methods]
        grid += [("kvpress", press, budget) for press in presses]
    return grid


def summarize(records: list[dict]) -> list[dict]:
    rows: dict[tuple, dict] = {}
    for record in records:
        key = (record["suite"], record["library"], record["method"], record["budget"])
        row = rows.setdefault(key, dict(zip(("suite", "library", "method", "budget"), key), found=0.0, n=0,
                                        seconds=0.0, kept_entries=0.0))
        row["found"] += record["score"]
        row["n"] += 1
        row["seconds"] += record["seconds"]
        row["kept_entries"] += record["kept_entries"]
    for row in rows.values():
        row["seconds_per_prompt"] = round(row.pop("seconds") / row["n"], 3)
        row["kept_entries"] = round(row["kept_entries"] / row["n"], 1)
    return list(rows.values())


def log_summary(rows: list[dict]) -> None:
    for row in rows:
        found = f"{row['found']:g}/{row['n']}" if "found" in row else f"same {row['same']}/{row['n']}"
        log(f"{row['suite']:26s} {row['library']:8s} {row['method']:24s} {row['budget']:<4} {found:>6}  "
            f"{row['seconds_per_prompt']:.2f} s/prompt  kept {row['kept_entries']}")


# ---------------------------------------------------------------- the runs


def compare(args) -> int:
    import keepkv
    from keepkv.eval.runner import SuiteSpec, _Tokens, make_samples, max_new_tokens_for, score_answer
    from keepkv.generation import QUESTION_SEPARATOR, context_and_question_ids
    from keepkv.models import model_directory

    keepkv.get_method("full")  # loads keepkv's public names: registers its attention
    from keepkv.attention import keepkv_attention
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if ALL_ATTENTION_FUNCTIONS["keepkv"] is not keepkv_attention:
        raise SystemExit("keepkv's attention was wrapped by kvpress: import kvpress before keepkv")
    if QUESTION_SEPARATOR != SEPARATOR:
        raise SystemExit(f"keepkv's question separator is {QUESTION_SEPARATOR!r}, not {SEPARATOR!r}")

    model, tokenizer = keepkv.load_model()
    directory = str(model_directory())
    pipe = kvpress_pipeline(directory)
    same_weights = all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), pipe.model.state_dict().values())
    )
    grid = configurations(args.budgets, args.keepkv_methods, args.presses)
    meta = {
        "versions": versions(), "model": directory, "dtype": "float32", "device": "cpu",
        "same_weights_both_sides": same_weights, "torch_threads": args.threads,
        "suites": args.suites, "length": args.length, "seed": args.seed, "samples": args.samples,
        "budgets": args.budgets, "keepkv_methods": args.keepkv_methods, "kvpress_presses": args.presses,
        "keepkv_method_params": {m: keepkv.get_method(m).params() for m in ["full", *args.keepkv_methods]},
        "kvpress_press_defaults": {name: {f.name: f.default for f in dataclasses.fields(cls)}
                                   for name, cls in KVPRESS_PRESSES.items()},
        "fields": {
            "context": "Sample.context: compressed (keepkv: after the chat template's start)",
            "question": "'\\n\\n' (keepkv QUESTION_SEPARATOR) + Sample.question + template end, appended uncompressed",
            "answer_prefix": "Sample.answer_prefix, after the template's end: starts the reply",
            "answers": "Sample.answers, scored by keepkv.eval.runner.score_answer (string_match_all)",
            "max_new_tokens": "keepkv.eval.runner.max_new_tokens_for (answer tokens + ANSWER_SLACK)",
        },
    }
    tokens = _Tokens(tokenizer)
    prompts, records = [], []
    if args.resume and args.out.is_file():  # the samples a stopped run finished are kept, not rerun
        stored = json.loads(args.out.read_text())
        prompts, records = stored["prompts"], stored["records"]
        meta["resumed"] = stored["meta"].get("resumed", 0) + 1
        meta["adapted_before_resume"] = stored["meta"].get("adapted_hook_calls", 0)
    done = {prompt["id"] for prompt in prompts}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for label in args.suites:
        spec = SuiteSpec.parse(label)
        samples = make_samples(spec, args.samples, args.length, args.seed, tokens, {})
        for index, sample in enumerate(samples):
            if sample.id in done:
                continue
            head, tail = context_and_question_ids(tokenizer, sample.context, sample.question, True, sample.answer_prefix)
            prompt = {
                "suite": spec.label, "id": sample.id, "context": sample.context, "question": sample.question,
                "answer_prefix": sample.answer_prefix, "answers": sample.answers,
                "max_new_tokens": max_new_tokens_for(spec, sample, tokens, None), "depth": sample.meta.get("depth"),
                "context_ids": head, "question_ids": tail,
            }
            press_head, press_tail = kvpress_ids(pipe, prompt)
            prompt["context_ids_equal"], prompt["question_ids_equal"] = head == press_head, tail == press_tail
            prompts.append(prompt)
            for library, method, budget in grid:
                if library == "keepkv":
                    out = run_keepkv(model, tokenizer, prompt, method, budget)
                else:
                    out = run_kvpress(pipe, prompt, None if method == "none" else method, budget)
                records.append({
                    "suite": spec.label, "id": sample.id, "library": library, "method": method, "budget": budget,
                    "compression_ratio": round(1 - budget, 6), "answers": sample.answers,
                    "score": score_answer(spec, sample, out["prediction"])["score"], **out,
                })
            scores = " ".join(f"{r['library']}:{r['method']}@{r['budget']}={r['score']:g}"
                              for r in records if r["id"] == sample.id)
            log(f"[{spec.label} {index + 1}/{len(samples)}] ids equal: context {prompt['context_ids_equal']}, "
                f"question {prompt['question_ids_equal']}; {scores}")
            meta["adapted_hook_calls"] = meta.get("adapted_before_resume", 0) + ADAPTED_CALLS
            payload = {"meta": meta, "summary": summarize(records), "records": records, "prompts": prompts}
            args.out.write_text(json.dumps(payload, indent=1))
    log_summary(summarize(records))
    log(f"wrote {args.out}")
    return 0


def replay(args) -> int:
    """kvpress alone (no keepkv import) on the prompts of a stored run: same answers?"""
    stored = json.loads(args.replay.read_text())
    pipe = kvpress_pipeline(stored["meta"]["model"])
    wanted = {(r["id"], r["method"], r["budget"]): r for r in stored["records"] if r["library"] == "kvpress"}
    records = []
    taken: dict[str, int] = {}
    for prompt in stored["prompts"]:
        taken[prompt["suite"]] = taken.get(prompt["suite"], 0) + 1
        if args.replay_samples is not None and taken[prompt["suite"]] > args.replay_samples:
            continue
        ids_equal = kvpress_ids(pipe, prompt) == (prompt["context_ids"], prompt["question_ids"])
        for (sample_id, method, budget), before in wanted.items():
            if sample_id != prompt["id"]:
                continue
            out = run_kvpress(pipe, prompt, None if method == "none" else method, budget)
            records.append({
                "suite": prompt["suite"], "id": sample_id, "library": "kvpress", "method": method, "budget": budget,
                "ids_equal_stored": ids_equal, "same_answer": out["prediction"] == before["prediction"],
                "stored_prediction": before["prediction"], **out,
            })
        log(f"[replay {prompt['id']}] ids as stored: {ids_equal}; same answers: "
            f"{sum(r['same_answer'] for r in records if r['id'] == prompt['id'])}/"
            f"{sum(r['id'] == prompt['id'] for r in records)}")
        rows: dict[tuple, dict] = {}
        for r in records:
            row = rows.setdefault((r["suite"], r["method"], r["budget"]), {
                "suite": r["suite"], "library": "kvpress", "method": r["method"], "budget": r["budget"],
                "same": 0, "n": 0, "seconds": 0.0, "kept_entries": 0.0})
            row["same"] += r["same_answer"]
            row["n"] += 1
            row["seconds"] += r["seconds"]
            row["kept_entries"] += r["kept_entries"]
        summary = [{**row, "seconds_per_prompt": round(row["seconds"] / row["n"], 3),
                    "kept_entries": round(row["kept_entries"] / row["n"], 1)} for row in rows.values()]
        meta = {"versions": versions(), "replayed": str(args.replay), "adapted_hook_calls": ADAPTED_CALLS,
                "torch_threads": args.threads}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "summary": summary, "records": records}, indent=1))
    log_summary(summary)
    log(f"wrote {args.out}")
    return 0


def merge(args) -> int:
    """One output from runs of single suites (``--suites X`` each, run side by side): their
    records and prompts concatenated, the summary recomputed; the first run's settings, with
    every run's suites, samples and adapter count."""
    parts = [json.loads(path.read_text()) for path in args.merge]
    meta = dict(parts[0]["meta"])
    meta["suites"] = [suite for part in parts for suite in part["meta"]["suites"]]
    meta["adapted_hook_calls"] = sum(part["meta"]["adapted_hook_calls"] for part in parts)
    meta["merged_from"] = [str(path) for path in args.merge]
    records = [record for part in parts for record in part["records"]]
    prompts = [prompt for part in parts for prompt in part["prompts"]]
    args.out.write_text(json.dumps({"meta": meta, "summary": summarize(records), "records": records,
                                    "prompts": prompts}, indent=1))
    log_summary(summarize(records))
    log(f"wrote {args.out}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=12, help="first N samples of each suite (default 12)")
    parser.add_argument("--out", type=Path, default=Path("docs/record/data/kvpress/compare.json"))
    parser.add_argument("--suites", nargs="+", default=list(SUITES))
    parser.add_argument("--length", type=int, default=1024, help="context tokens (the eval's default: 1024)")
    parser.add_argument("--seed", type=int, default=0, help="sample seed (the eval's reported seed: 0)")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.2, 0.1],
                        help="keepkv budgets; kvpress gets compression_ratio = 1 - budget")
    parser.add_argument("--keepkv-methods", nargs="+", default=[*KEEPKV_METHODS, *KEEPKV_EXTRA])
    parser.add_argument("--presses", nargs="+", default=list(KVPRESS_PRESSES), choices=list(KVPRESS_PRESSES))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--resume", action="store_true", help="keep the samples already in --out; run the rest")
    parser.add_argument("--replay", type=Path, help="a stored run: rerun its kvpress side alone (no keepkv)")
    parser.add_argument("--replay-samples", type=int, help="with --replay: the first N prompts of each suite only")
    parser.add_argument("--merge", type=Path, nargs="+", help="outputs of single-suite runs: write them as one --out")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.merge:
        return merge(args)
    return replay(args) if args.replay else compare(args)


if __name__ == "__main__":
    sys.exit(main())
