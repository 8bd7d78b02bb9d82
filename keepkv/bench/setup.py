"""What a bench run is set up from, shared by its kinds (timing, ops, soak, CUDA suite): each
method's parameters and the versions a report records."""

from __future__ import annotations

from ..methods.base import accepted_params, parse_method_spec


def resolve_params(methods: list[str], method_params: dict | None) -> dict[str, dict]:
    """Per-method parameters. Keys of ``method_params``: a method name (its own dict) or
    ``"*"`` (applied to every method that has that field, e.g. ``{"*": {"interval": 8}}``)."""
    from ..methods import METHODS

    method_params = dict(method_params or {})
    shared = method_params.pop("*", {})
    unknown = [m for m in method_params if m not in METHODS]
    if unknown:
        raise ValueError(f"parameters given for unknown method(s): {', '.join(unknown)}")
    resolved = {}
    for method in methods:
        fields = accepted_params(parse_method_spec(method)[0])
        params = {key: value for key, value in shared.items() if key in fields}
        params.update(method_params.get(method, {}))
        resolved[method] = params
    return resolved


def package_version() -> str:
    try:
        from importlib.metadata import version

        return version("keepkv")
    except Exception:  # not installed: running from a checkout
        return "0.1.0+checkout"


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def stand_in_tokenizer(vocab_size: int):
    """A tokenizer of one id per character (ids 3.., modulo ``vocab_size``), built in memory: what a
    reconstruction pass's instruction is read with on a model of random weights, which has no
    tokenizer of its own (its text means nothing to such a model; its length is what counts)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for index, char in enumerate(chars):
        vocab.setdefault(char, 3 + index % max(1, vocab_size - 3))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
