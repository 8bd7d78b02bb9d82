"""The `keepkv` command line: generate, methods, demo, perturbation, eval, report, bench, serve."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import warnings
from functools import partial
from pathlib import Path

from .arguments import DefaultsFormatter, budget_arg

DEFAULT_BUDGET = 0.1  # `keepkv generate` and `keepkv perturbation` compress by default


def _param(text: str) -> tuple[str, object]:
    """'threshold=0.8' -> ('threshold', 0.8); values are Python or JSON literals when they can be."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"method parameters are NAME=VALUE, got {text!r}")
    from .methods.base import parse_value

    name, value = text.split("=", 1)
    return name, parse_value(value)


def _load(args):
    from .models import load_model

    return load_model(args.model, dtype=args.dtype)


def _check_plain(args) -> None:
    """The arguments that can be checked before torch loads, each refused in one line: method
    names, budgets, dtype, token counts, the model's path. ``_check_method`` checks the rest."""
    from .checks import as_int, check_dtype_name, check_method_name, validate_budget

    for name in [getattr(args, "method", None), *(getattr(args, "methods", None) or []),
                 *(getattr(args, "agnostic_methods", None) or [])]:
        if name is not None:
            check_method_name(name)
    for budget in [getattr(args, "budget", None), *(getattr(args, "budgets", None) or [])]:
        if budget is not None:
            validate_budget(budget)
    if getattr(args, "dtype", None) is not None:
        check_dtype_name(args.dtype)
    if getattr(args, "max_new_tokens", None) is not None:
        as_int("max_new_tokens", args.max_new_tokens, 0)
    if getattr(args, "prefill_chunk", None) is not None:
        as_int("prefill_chunk", args.prefill_chunk, 1)
    if getattr(args, "threads", None) is not None:
        as_int("threads", args.threads, 1)
    if getattr(args, "model", None) and not Path(args.model).exists():
        raise ValueError(f"--model {args.model}: no such file or directory")


def _check_method(args) -> None:
    """Reject a bad method, parameter, budget or dtype before the model loads."""
    from .budgets import check_budget_holds, check_full_budget, validate_budget
    from .methods import get_method
    from .models import parse_dtype

    method = get_method(args.method, **dict(args.param))
    if args.budget is None:  # the full cache takes no budget
        args.budget = 1.0 if method.name == "full" else DEFAULT_BUDGET
    validate_budget(args.budget)
    check_full_budget(method, args.budget)
    check_budget_holds(method, args.budget)
    parse_dtype(args.dtype)


def _set_threads(args) -> None:
    """torch's threads: ``--threads`` (checked by ``_check_plain``)."""
    import torch

    torch.set_num_threads(args.threads)


def _prompt(args, default=None) -> str | None:
    """The prompt given as an argument or in --prompt-file (not both), else ``default``."""
    if args.prompt is not None and args.prompt_file:
        raise ValueError("give the prompt as an argument or with --prompt-file, not both")
    if args.prompt_file:
        try:
            return Path(args.prompt_file).read_text()
        except (OSError, UnicodeDecodeError) as error:
            why = getattr(error, "strerror", None) or error
            raise ValueError(f"--prompt-file {args.prompt_file!r}: {why}") from None
    return default if args.prompt is None else args.prompt


# The scorer's feature sets (keepkv.scorer.FEATURES), listed here so that a wrong one is refused
# before torch loads (tests/test_learned.py checks the two lists agree).
SCORER_FEATURES = ("values+pairs", "pairs", "values", "unrotated+values", "keys+values")


def cmd_train_scorer(args) -> None:
    """Train the learned selection's scorer on a model: KVzip's own scores as the targets."""
    from .checks import as_int

    if args.model_path is not None:
        if args.model is not None and args.model != args.model_path:
            raise ValueError(f"give the model once: {args.model_path!r} and --model {args.model!r}")
        args.model = args.model_path
    _check_plain(args)
    as_int("documents", args.documents, 1)
    as_int("chars", args.chars, 100)
    texts = None
    if args.files:
        texts = []
        for name in args.files:
            try:
                texts.append(Path(name).read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError) as error:
                why = getattr(error, "strerror", None) or error
                raise ValueError(f"--files {name!r}: {why}") from None
        if not any(text.strip() for text in texts):
            raise ValueError("--files: every file is empty")
    out = Path(args.out if args.out else f"scorer-{Path(args.model).stem if args.model else 'smollm2-135m-instruct'}.pt")
    if out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a directory: name a file")
    _set_threads(args)
    from .scorer_training import train_scorer

    model, tokenizer = _load(args)
    if not args.json:
        count = len(texts) if texts else args.documents
        say(f"keepkv: training a {args.kind} scorer on KVzip's scores of {count} document{'s' * (count != 1)} "
            "(KVzip's pass over each, then the fit)")
    scorer = train_scorer(model, tokenizer, texts, kind=args.kind, documents=args.documents, chars=args.chars,
                          features=args.features, seed=args.seed, save=out, progress=not args.json)
    report = {**scorer.report, "path": str(out)}
    if args.json:
        print(json.dumps(report))
        return
    if "spearman" in report:
        held = report["heldout_documents"]
        print(f"held-out fit ({held} document{'s' * (held != 1)}): Spearman {report['spearman']:.2f} with "
              f"KVzip's scores; kept-set overlap {report['overlap@0.1']:.2f} at budget 0.1, "
              f"{report['overlap@0.2']:.2f} at 0.2")
    else:
        print("no held-out fit: one document (give two or more to see one)")
    print(f"saved {out} ({report['seconds_targets'] + report['seconds_fit']:.0f} s); use it: "
          f"--method snapkv+selection=learned+scorer={out}")


def cmd_methods(args) -> None:
    from .methods import describe_methods

    described = describe_methods()
    if args.json:
        print(json.dumps(described, indent=2))
        return
    for entry in described:
        params = ", ".join(f"{name}={value!r}" for name, value in entry["params"].items())
        print(f"{entry['name']:<13} {entry['paper']}\n{'':<13} {params}")


def cmd_generate(args) -> None:
    prompt = _prompt(args)
    if prompt is None:
        raise ValueError("give a prompt as an argument or with --prompt-file")
    _check_plain(args)
    from .generation import check_arguments, generate

    _check_method(args)
    check_arguments(prompt, args.method, args.budget, args.max_new_tokens, not args.raw, args.answer_prefix,
                    prefill_chunk=args.prefill_chunk, **dict(args.param))
    _set_threads(args)
    model, tokenizer = _load(args)
    result = generate(
        model, tokenizer, prompt, method=args.method, budget=args.budget, max_new_tokens=args.max_new_tokens,
        chat=not args.raw, answer_prefix=args.answer_prefix, progress=not args.json,
        prefill_chunk=args.prefill_chunk, **dict(args.param),
    )[0]
    if args.json:
        print(json.dumps(result.to_dict()))
        return
    print(result.answer)
    print(memory_line(result), file=sys.stderr)


def memory_line(result) -> str:
    """One line: what the cache kept and held, its parts, and its share of an uncompressed cache."""
    mib = 2**20
    label = result.method if result.budget is None else f"{result.method} budget={result.budget}"
    return (
        f"[{label}] prompt {result.prompt_tokens} tokens, kept {result.kept_entries:.1f} entries per layer "
        f"and head; cache {result.cache_bytes / mib:.2f} MiB = entries {result.entry_bytes / mib:.2f} + padding "
        f"{result.padding_bytes / mib:.2f} + spare slots {result.spare_bytes / mib:.2f} + method state "
        f"{result.state_bytes / mib:.2f}; full cache {result.full_cache_bytes / mib:.2f} MiB "
        f"({result.cache_bytes / result.full_cache_bytes:.1%})"
    )


def cmd_demo(args) -> None:
    _check_plain(args)
    from .budgets import validate_budget
    from .demo import format_demo, run_demo
    from .methods import get_method

    for budget in args.budgets:
        validate_budget(budget)
    for name in [*args.methods, *args.agnostic_methods]:
        get_method(name)
    _set_threads(args)
    model, tokenizer = _load(args)
    settings = ("aware", "agnostic") if args.setting == "both" else (args.setting,)
    result = run_demo(model, tokenizer, methods=args.methods, budgets=args.budgets, progress=not args.json,
                      agnostic_methods=args.agnostic_methods, settings=settings)
    print(json.dumps(result, indent=2) if args.json else format_demo(result))


def cmd_perturbation(args) -> None:
    prompt = _prompt(args)
    _check_plain(args)
    from .perturbation import format_perturbation, perturbation

    _check_method(args)
    model, tokenizer = _load(args)
    result = perturbation(model, tokenizer, prompt=prompt, method=args.method, budget=args.budget,
                          progress=not args.json, **dict(args.param))
    print(json.dumps(result, indent=2) if args.json else format_perturbation(result))


def cmd_eval(args) -> None:
    from .eval.options import check_plain

    check_plain(args)  # before torch loads
    from .eval import cli as eval_cli

    eval_cli.run(args)


def cmd_report(args) -> None:
    from .eval import cli as eval_cli

    eval_cli.report(args)


def cmd_bench(args) -> None:
    from .bench.options import check_plain

    check_plain(args)  # before torch loads
    from . import bench

    return bench.main(args)


def cmd_serve(args) -> int:
    from .vllm import serve

    return serve.main(args, args.server_args)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are the one line every other error of the command line is,
    ``keepkv: error: ...`` (exit status 2), without argparse's usage block (``--help`` shows it)."""

    def error(self, message: str):
        self.exit(2, f"keepkv: error: {' '.join(message.split())}\n")


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser; it imports no torch (nor any module that does), so that ``--help``
    and every argument error come at once."""
    from .arguments import DEMO_AGNOSTIC_METHODS, DEMO_BUDGETS, DEMO_METHODS

    parser = OneLineParser(prog="keepkv", description="KV-cache compression for Hugging Face LLMs",
                           formatter_class=DefaultsFormatter)
    json_args = argparse.ArgumentParser(add_help=False)
    json_args.add_argument("--json", action="store_true", help="print JSON")
    common = argparse.ArgumentParser(add_help=False, parents=[json_args])
    common.add_argument("--model", help="local HF model directory or GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    threads_args = argparse.ArgumentParser(add_help=False)
    threads_args.add_argument("--threads", type=int, default=1,
                              help="torch threads (on a busy machine more threads wait for each other)")
    dtype_args = argparse.ArgumentParser(add_help=False)
    dtype_args.add_argument("--dtype", default="float32", help="model dtype: float32, bfloat16 or float16")
    method_args = argparse.ArgumentParser(add_help=False)
    method_args.add_argument("--method", default="keepkv", help="compression method (see `keepkv methods`)")
    method_args.add_argument("--budget", type=budget_arg, help=f"fraction in (0, 1] or entry count; 1.0 compresses "
                             f"nothing (default: {DEFAULT_BUDGET}; with --method full: 1.0)")
    method_args.add_argument(
        "--param", type=_param, action="append", default=[], metavar="NAME=VALUE", help="method parameter"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add_command = partial(commands.add_parser, formatter_class=DefaultsFormatter)  # --help shows defaults

    methods = add_command("methods", parents=[json_args], help="list methods, parameters and defaults")
    methods.set_defaults(func=cmd_methods)

    gen = add_command("generate", parents=[common, dtype_args, method_args, threads_args], help="answer a prompt")
    gen.add_argument("prompt", nargs="?", help="the prompt text")
    gen.add_argument("--prompt-file", help="read the prompt from a file")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    gen.add_argument("--raw", action="store_true", help="send the text as is, without the chat template")
    gen.add_argument("--answer-prefix", default="", metavar="TEXT", help="start the reply with TEXT")
    gen.add_argument(
        "--prefill-chunk", type=int, metavar="N",
        help="feed the prompt in blocks of N tokens: prefill attention's workspace stays one block's "
        "(same output; the cache peaks at every layer's uncompressed prompt)",
    )
    gen.set_defaults(func=cmd_generate)

    demo = add_command(
        "demo", parents=[common, dtype_args, threads_args],
        help="hidden pass key: memory kept against correctness, per method and budget",
    )
    demo.add_argument("--budgets", type=budget_arg, nargs="+", default=list(DEMO_BUDGETS), metavar="B",
                      help="budgets to try")
    demo.add_argument("--methods", nargs="+", default=list(DEMO_METHODS), metavar="M",
                      help="methods besides the full cache, the question inside the compressed prompt")
    demo.add_argument("--agnostic-methods", nargs="+", default=list(DEMO_AGNOSTIC_METHODS), metavar="M",
                      help="methods besides the full cache, the question asked after the document is compressed")
    demo.add_argument("--setting", choices=("aware", "agnostic", "both"), default="both",
                      help="the question inside the compressed prompt (aware), after it (agnostic), or both")
    demo.set_defaults(func=cmd_demo)

    pert = add_command(
        "perturbation", parents=[common, dtype_args, method_args], help="attention-output error of compression per layer"
    )
    pert.add_argument("prompt", nargs="?", help="prompt (default: a built-in ~1k-token document)")
    pert.add_argument("--prompt-file", help="read the prompt from a file")
    pert.set_defaults(func=cmd_perturbation)

    from .eval import options as eval_options

    evaluate = add_command("eval", parents=[common], help="quality of every method at every budget")
    eval_options.add_arguments(evaluate)
    evaluate.set_defaults(func=cmd_eval)
    report = add_command("report", help="render an eval summary.csv as a Markdown table")
    eval_options.add_report_arguments(report)
    report.set_defaults(func=cmd_report)

    from .bench import options as bench_options

    bench_parser = add_command("bench", parents=[common], help="throughput and memory benchmark")
    bench_options.add_arguments(bench_parser)
    bench_parser.set_defaults(func=cmd_bench)

    train = add_command("train-scorer", parents=[common, dtype_args, threads_args],
                        help="train the learned selection's scorer on a model (KVzip's scores as targets)")
    train.add_argument("model_path", nargs="?", metavar="MODEL",
                       help="local HF model directory or GGUF file (or --model; default: the embedded model)")
    train.add_argument("--files", nargs="+", metavar="FILE",
                       help="train on these text files (default: the eval's offline corpus, pydoc prose and "
                       "standard-library sources)")
    train.add_argument("--documents", type=int, default=50, help="documents of the default corpus")
    train.add_argument("--chars", type=int, default=4000, help="characters per document of the default corpus")
    train.add_argument("--kind", choices=("linear", "mlp"), default="linear",
                       help="linear (ridge) or mlp (the ridge plus a 32-unit MLP on its residual)")
    train.add_argument("--features", choices=SCORER_FEATURES, default="values+pairs",
                       help="what the scorer reads of an entry (docs/methods.md, 'learned')")
    train.add_argument("--seed", type=int, default=0, help="the corpus's and the held-out split's seed")
    train.add_argument("--out", help="the scorer file (default: scorer-MODEL.pt here)")
    train.set_defaults(func=cmd_train_scorer)

    add_serve_command(add_command)
    return parser


def add_serve_command(add_command) -> argparse.ArgumentParser:
    from .vllm import serve

    # Flags it does not take go to vLLM's server (main() passes them); no abbreviations, so that
    # none of vLLM's is read as one of keepkv's.
    serve_parser = add_command("serve", help="vLLM's OpenAI-compatible server with a keepkv method", allow_abbrev=False)
    serve.add_arguments(serve_parser)
    serve_parser.set_defaults(func=cmd_serve)
    return serve_parser


def serve_parser() -> argparse.ArgumentParser:
    """The parser of ``keepkv serve`` alone: it imports none of the other commands' modules (nor
    torch), so that serve refuses a flag within a second or two."""
    parser = argparse.ArgumentParser(prog="keepkv", formatter_class=DefaultsFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_command(partial(commands.add_parser, formatter_class=DefaultsFormatter))
    return parser


def say(line: str) -> None:
    """Print one line to stderr above any progress bar (``tqdm.write`` clears the bars, prints,
    redraws them): every warning and message of the command line goes through here, so none is
    glued to the end of a bar."""
    from tqdm.auto import tqdm

    tqdm.write(line, file=sys.stderr)


def _one_line_warnings():
    """A ``warnings.showwarning`` that prints keepkv's warnings (keepkv/diagnostics.py) as one
    ``keepkv: warning: ...`` line each, and any other warning in Python's format, through :func:`say`."""
    from .diagnostics import KeepKVWarning

    def show_warning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, KeepKVWarning):
            say(f"keepkv: warning: {message}")
        else:
            say(warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n"))

    return show_warning


def parse_arguments(argv=None) -> argparse.Namespace:
    """The command line's arguments; ``server_args``: the flags ``keepkv serve`` passes on to
    vLLM's server (any other command refuses flags it does not take)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = serve_parser() if argv[:1] == ["serve"] else build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "serve":
        parser.error(f"unrecognized arguments: {shlex.join(extra)}")
    args.server_args = extra
    return args


def main(argv=None) -> int:
    try:
        args = parse_arguments(argv)
    except SystemExit as stop:  # a one-line parse error (OneLineParser), or --help
        return stop.code or 0
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warnings()
            code = args.func(args)
    except (ValueError, OSError, RuntimeError) as error:  # OSError: a file that cannot be read or written
        print(f"keepkv: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
