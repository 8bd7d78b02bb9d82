"""The `keepkv` command line: generate, methods, demo, perturbation, eval, report, bench."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .arguments import budget_arg


def _param(text: str) -> tuple[str, object]:
    """'threshold=0.8' -> ('threshold', 0.8); values are Python or JSON literals when they can be."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"method parameters are NAME=VALUE, got {text!r}")
    from .methods.base import parse_value

    name, value = text.split("=", 1)
    return name, parse_value(value)


def _load(args):
    from .models import load_model

    return load_model(args.model)


def _check_method(args) -> None:
    """Reject a bad method, parameter or budget before the model loads."""
    from .cache import validate_budget
    from .methods import get_method

    validate_budget(args.budget)
    get_method(args.method, **dict(args.param))


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
    from .generation import generate

    if args.prompt_file:
        prompt = Path(args.prompt_file).read_text()
    elif args.prompt is not None:
        prompt = args.prompt
    else:
        raise ValueError("give a prompt as an argument or with --prompt-file")
    _check_method(args)
    model, tokenizer = _load(args)
    result = generate(
        model, tokenizer, prompt, method=args.method, budget=args.budget, max_new_tokens=args.max_new_tokens,
        chat=not args.raw, answer_prefix=args.answer_prefix, progress=not args.json, **dict(args.param),
    )[0]
    if args.json:
        print(json.dumps(result.to_dict()))
        return
    print(result.answer)
    print(
        f"[{result.method} budget={result.budget}] prompt {result.prompt_tokens} tokens, kept "
        f"{result.kept_entries:.1f} entries per layer and head, cache {result.cache_bytes / 2**20:.2f} MiB "
        f"vs full {result.full_cache_bytes / 2**20:.2f} MiB ({result.cache_bytes / result.full_cache_bytes:.1%})",
        file=sys.stderr,
    )


def cmd_demo(args) -> None:
    from .demo import format_demo, run_demo

    model, tokenizer = _load(args)
    rows = run_demo(model, tokenizer, methods=args.methods, budget=args.budget, progress=not args.json)
    print(json.dumps(rows, indent=2) if args.json else format_demo(rows))


def cmd_perturbation(args) -> None:
    from .perturbation import format_perturbation, perturbation

    prompt = Path(args.prompt_file).read_text() if args.prompt_file else args.prompt
    _check_method(args)
    model, tokenizer = _load(args)
    result = perturbation(model, tokenizer, prompt=prompt, method=args.method, budget=args.budget, **dict(args.param))
    print(json.dumps(result, indent=2) if args.json else format_perturbation(result))


def cmd_eval(args) -> None:
    from .eval import cli as eval_cli

    eval_cli.run(args)


def cmd_report(args) -> None:
    from .eval import cli as eval_cli

    eval_cli.report(args)


def cmd_bench(args) -> None:
    from . import bench

    return bench.main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keepkv", description="KV-cache compression for Hugging Face LLMs")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", help="local HF model directory or GGUF file (default: embedded SmolLM2-135M)")
    common.add_argument("--json", action="store_true", help="print JSON")
    method_args = argparse.ArgumentParser(add_help=False)
    method_args.add_argument("--method", default="keepkv", help="compression method (see `keepkv methods`)")
    method_args.add_argument("--budget", type=budget_arg, default=0.1, help="fraction in (0, 1] or entry count")
    method_args.add_argument(
        "--param", type=_param, action="append", default=[], metavar="NAME=VALUE", help="method parameter"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    methods = commands.add_parser("methods", parents=[common], help="list methods, parameters and defaults")
    methods.set_defaults(func=cmd_methods)

    gen = commands.add_parser("generate", parents=[common, method_args], help="answer a prompt")
    gen.add_argument("prompt", nargs="?", help="the prompt text")
    gen.add_argument("--prompt-file", help="read the prompt from a file")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--raw", action="store_true", help="send the text as is, without the chat template")
    gen.add_argument("--answer-prefix", default="", metavar="TEXT", help="start the reply with TEXT")
    gen.set_defaults(func=cmd_generate)

    demo = commands.add_parser("demo", parents=[common], help="hidden-fact document, every method side by side")
    demo.add_argument("--budget", type=budget_arg, default=0.1)
    demo.add_argument("--methods", nargs="+", help="methods to show (default: all)")
    demo.set_defaults(func=cmd_demo)

    pert = commands.add_parser(
        "perturbation", parents=[common, method_args], help="attention-output error of compression per layer"
    )
    pert.add_argument("prompt", nargs="?", help="prompt (default: a built-in ~1k-token document)")
    pert.add_argument("--prompt-file")
    pert.set_defaults(func=cmd_perturbation)

    from .eval import cli as eval_cli

    evaluate = commands.add_parser("eval", parents=[common], help="quality of every method at every budget")
    eval_cli.add_arguments(evaluate)
    evaluate.set_defaults(func=cmd_eval)
    report = commands.add_parser("report", help="render an eval summary.csv as a Markdown table")
    eval_cli.add_report_arguments(report)
    report.set_defaults(func=cmd_report)

    from . import bench

    bench_parser = commands.add_parser("bench", parents=[common], help="throughput and memory benchmark")
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(func=cmd_bench)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as error:
        print(f"keepkv: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
