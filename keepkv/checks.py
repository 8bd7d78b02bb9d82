"""One-line checks of the public entries' arguments, run before any work starts.

Each raises ValueError in one line that names the argument and what it accepts, and returns the
value in its plain Python type. An integer-like numpy scalar counts as an int (as ``np.float64``
counts as a float); a bool counts as neither.
"""

from __future__ import annotations

import numbers

# The largest count of tokens or entries an argument may give: far beyond any context, and far
# inside the int64 tensors that hold positions, lengths and their sums over layers, heads and rows.
MAX_COUNT = 2**48

# The model families keepkv runs (``config.model_type``); any other is refused in one line.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


def validate_budget(budget) -> int | float:
    """The budget as an int in [1, MAX_COUNT] (an entry count) or a float in (0, 1] (a fraction of
    the prompt); integer numpy scalars count as ints, numpy floats as floats. ValueError otherwise."""
    if is_int(budget):
        if not 1 <= int(budget) <= MAX_COUNT:
            raise ValueError(f"an integer budget is an entry count per layer and head and must be in [1, 2**48], "
                             f"got {shown(budget)}")
        return int(budget)
    if isinstance(budget, numbers.Real) and not isinstance(budget, bool):
        if not 0.0 < float(budget) <= 1.0:
            raise ValueError(f"a float budget is a fraction of the prompt and must be in (0, 1], got {shown(budget)}")
        return float(budget)
    raise ValueError(f"budget must be a float in (0, 1] or an int in [1, 2**48], got {shown(budget)}")


# The model dtypes (keepkv.models.DTYPES maps them to torch's).
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def check_dtype_name(dtype) -> None:
    """Refuse, in one line, a dtype name keepkv does not load models in."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}; got {shown(dtype)}")


# The registered methods (keepkv.methods.METHODS, which imports torch): a command line refuses a
# mistyped name before torch loads. tests/test_cli_speed.py checks that this is the registry's list.
METHOD_NAMES = (
    "cam", "d2o", "full", "h2o", "keepkv", "keydiff", "kvmerger", "kvreviver", "kvzip", "pyramidkv", "snapkv",
    "streamingllm", "window", "zeromerge",
)
# The methods keepkv.vllm serves (keepkv.paged.SERVED_METHODS, which imports torch): what `keepkv serve
# --help` lists. tests/test_serve.py checks that this is the paged adapter's list.
SERVED_METHOD_NAMES = ("h2o", "keepkv", "keydiff", "pyramidkv", "snapkv", "streamingllm", "window")


def check_method_name(spec) -> None:
    """Refuse, in one line, a method or variant (``name+key=value``) whose name is not registered;
    its parameters are checked when the method is built (``get_method``)."""
    name = spec.split("+")[0].strip() if isinstance(spec, str) else None
    if name not in METHOD_NAMES:
        raise ValueError(f"unknown method {(name if name is not None else spec)!r}; choose one of: "
                         f"{', '.join(METHOD_NAMES)}")


def shown(value) -> str:
    """A value as an error message shows it: its repr, cut to one short line."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 80 else text[:77] + "..."


def is_int(value) -> bool:
    """An int or an integer numpy scalar, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def as_int(name: str, value, low: int = 0, high: int = MAX_COUNT, none_ok: bool = False) -> int | None:
    """``value`` as an int in [low, high] (or None when ``none_ok``)."""
    if none_ok and value is None:
        return None
    if not is_int(value) or not low <= int(value) <= high:
        too_big = is_int(value) and int(value) > high
        bound = f"in [{low}, {'2**48' if high == MAX_COUNT else high}]" if too_big or high != MAX_COUNT else f">= {low}"
        optional = " (or None)" if none_ok else ""
        raise ValueError(f"{name} must be an int {bound}{optional}, got {shown(value)}")
    return int(value)


def as_bool(name: str, value) -> bool:
    """``value`` if it is True or False (numpy's bool too)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise ValueError(f"{name} must be True or False, got {shown(value)}")


def as_text(name: str, value, empty_ok: bool = True) -> str:
    """``value`` if it is a str (a non-blank one unless ``empty_ok``)."""
    if not isinstance(value, str) or not (empty_ok or value.strip()):
        raise ValueError(f"{name} must be a {'' if empty_ok else 'non-empty '}string, got {shown(value)}")
    return value


def check_model(model) -> None:
    """A transformers causal LM (what ``keepkv.load_model()`` returns)."""
    if not (callable(model) and hasattr(model, "config") and hasattr(model, "generate")):
        raise ValueError(f"model must be a transformers causal LM (keepkv.load_model()), got {shown(model)}")


def check_tokenizer(tokenizer) -> None:
    """A transformers tokenizer: callable on a list of texts, with ``batch_decode``."""
    if not (callable(tokenizer) and hasattr(tokenizer, "batch_decode") and hasattr(tokenizer, "pad_token")):
        raise ValueError(f"tokenizer must be the model's transformers tokenizer (keepkv.load_model()), got "
                         f"{shown(tokenizer)}")


def check_architecture(config) -> None:
    """Raise if a model config names an architecture keepkv does not support.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        Any object with a ``model_type`` attribute.

    Raises
    ------
    ValueError
        If ``config.model_type`` is not in :data:`SUPPORTED_ARCHITECTURES`.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; keepkv supports: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
