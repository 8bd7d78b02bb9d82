"""keepkv.generate(): prompts in, answers and memory figures out."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

from . import reconstruction
from .attention import enabled
from .budgets import check_budget_holds, check_full_budget, validate_budget
from .cache import CompressedCache, method_of
from .checks import as_bool, as_int, as_text, check_model, check_tokenizer, shown
from .diagnostics import warn_context_length
from .models import CACHE_KWARG, check_context, check_prompt_length
from .templates import split_template


@dataclass
class GenerationResult:
    """One prompt's answer and what its row of the cache held at the end.

    ``cache_bytes = entry_bytes + padding_bytes + spare_bytes + state_bytes`` (see
    :class:`keepkv.cache.CacheSummary`), and the rows of one call add up to the cache's bytes.
    """

    answer: str
    prompt_tokens: int
    kept_entries: float  # mean live entries per layer and KV head
    cache_bytes: int  # what this row holds: the four parts below
    entry_bytes: int  # its live entries (keys, values, bias, positions, per-entry method state)
    padding_bytes: int  # its empty slots (left padding; slots other rows or heads of the batch fill)
    spare_bytes: int  # slots kept free for the next appends
    state_bytes: int  # its share of per-layer method state (e.g. KVReviver's sketch)
    full_cache_bytes: int  # keys + values of an uncompressed cache of this row's tokens
    method: str
    budget: float | int | None  # None: the method kept everything and used no budget
    new_tokens: int

    def to_dict(self) -> dict:
        return asdict(self)


class _Progress(StoppingCriteria):
    """Progress bars named after the method, one per stage: the prefill, a tick per decoder layer
    (forward hooks that only count, removed when the prefill ends), then a tick per generated
    token. Never stops generation."""

    def __init__(self, model, method: str, new_tokens: int):
        layers = model.get_decoder().layers
        self.method, self.new_tokens = method, new_tokens
        self.bar = tqdm(total=len(layers), desc=f"{method}: prefill", unit="layer", leave=False)
        self.hooks = [layer.register_forward_hook(self._layer_done) for layer in layers]
        self.decoding = False

    def _layer_done(self, *args) -> None:
        self.bar.update(1)

    def close(self) -> None:
        """End the current stage: remove the counting hooks, close its bar."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        self.bar.close()

    def __call__(self, input_ids, scores, **kwargs):
        if not self.decoding:  # the first call comes after the prefill and the first token
            self.close()
            self.bar = tqdm(total=self.new_tokens, desc=f"{self.method}: generating", unit="tok", leave=False)
            self.decoding = True
        self.bar.update(1)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def build_prompts(tokenizer, prompts: list[str], chat: bool, answer_prefix: str) -> list[str]:
    """Wrap each prompt in the chat template (if asked and available) and start the reply."""
    if chat and getattr(tokenizer, "chat_template", None):
        return [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            + answer_prefix
            for p in prompts
        ]
    return [p + answer_prefix for p in prompts]


# The user message of a "compress once, ask many" prompt is CONTEXT + QUESTION_SEPARATOR +
# question: the separator the eval's samples use between a document and its question.
QUESTION_SEPARATOR = "\n\n"
def context_and_question_ids(tokenizer, context: str, question: str, chat: bool, answer_prefix: str = ""):
    """Token ids of a prompt split at the context's end: (context part, question part), each
    tokenized on its own, so that a cache compressed at the end of the first continues with
    the second. The context part is the template's start and the context; the question part is
    ``QUESTION_SEPARATOR + question``, the template's end and the answer prefix."""
    before, after = split_template(tokenizer, chat)
    special = not (chat and getattr(tokenizer, "chat_template", None))
    head = tokenizer(before + context, add_special_tokens=special)["input_ids"]
    tail = tokenizer(QUESTION_SEPARATOR + question + after + answer_prefix, add_special_tokens=False)["input_ids"]
    return list(head), list(tail)


def encode(tokenizer, texts: list[str], chat: bool, device) -> dict:
    """Left-padded input_ids and attention_mask."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    has_template = chat and getattr(tokenizer, "chat_template", None)
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not has_template)
    return {key: value.to(device) for key, value in batch.items() if key in ("input_ids", "attention_mask")}


def validate_prompts(prompts) -> list[str]:
    """A str or a non-empty list (or tuple) of non-empty str."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if (not isinstance(prompts, (list, tuple)) or not prompts
            or any(not isinstance(p, str) or not p.strip() for p in prompts)):
        raise ValueError(f"prompts must be a non-empty string or a non-empty list of non-empty strings, got "
                         f"{shown(prompts)}")
    return list(prompts)


def check_arguments(prompts, method="full", budget=1.0, max_new_tokens=64, chat=True, answer_prefix="",
                    progress=False, prefill_chunk=None, **method_params) -> dict:
    """:func:`generate`'s arguments other than the model, tokenizer and cache, checked before any
    work starts (the command line checks them before it loads the model): ValueError in one line
    naming the argument, or the arguments in their plain types (numpy integers as ints)."""
    checked = dict(
        prompts=validate_prompts(prompts),
        max_new_tokens=as_int("max_new_tokens", max_new_tokens, 0),
        chat=as_bool("chat", chat),
        answer_prefix=as_text("answer_prefix", answer_prefix),
        progress=as_bool("progress", progress),
        prefill_chunk=as_int("prefill_chunk", prefill_chunk, 1, none_ok=True),
        budget=validate_budget(budget),
    )
    check_full_budget(method_of(method, method_params), checked["budget"])
    return checked


def _run(model, tokenizer, cache, inputs: dict, max_new_tokens: int, progress: bool, prefill_chunk,
         chat: bool = True) -> torch.Tensor:
    """Feed ``inputs`` (the whole sequence; a cache that holds a context is continued) and generate
    greedily; returns the new tokens [B, n].

    A method that scores its prompt with reconstruction passes (KVzip) gets its prompt prefilled,
    the passes run and the prompt compressed (:func:`keepkv.reconstruction.prefill`); the first new
    token is the prefill's greedy choice, and ``generate`` goes on from it."""
    total = inputs["input_ids"].shape[1]
    seen = cache.get_seq_length()
    if seen == 0 and cache.defers_to_reconstruction:
        cache.see_ids(inputs["input_ids"], total, inputs["attention_mask"], check=False)  # the record of the prompt
        with enabled(model):
            logits = reconstruction.prefill(model, tokenizer, cache, inputs["input_ids"], inputs["attention_mask"],
                                            chat, prefill_chunk, progress)
        first = logits.argmax(-1, keepdim=True)  # [B, 1]
        if max_new_tokens <= 1:
            return first[:, :max_new_tokens]
        grown = {
            "input_ids": torch.cat([inputs["input_ids"], first], dim=-1),
            "attention_mask": torch.cat([inputs["attention_mask"], torch.ones_like(first)], dim=-1),
        }
        rest = _run(model, tokenizer, cache, grown, max_new_tokens - 1, progress, None, chat)
        tokens = torch.cat([first, rest], dim=-1)
        if tokenizer.eos_token_id is not None:  # a row whose first token ends it stops there
            ended = (tokens == tokenizer.eos_token_id).long().cumsum(-1) > 0
            after = torch.cat([torch.zeros_like(ended[:, :1]), ended[:, :-1]], dim=-1)
            tokens = tokens.masked_fill(after, tokenizer.pad_token_id)
        return tokens
    bars = _Progress(model, cache.method.name, max_new_tokens) if progress else None
    try:
        with enabled(model):
            if max_new_tokens == 0:
                chunk = prefill_chunk or total - seen
                for start in range(seen, total, chunk):
                    stop = min(start + chunk, total)
                    mask = inputs["attention_mask"][:, :stop]
                    cache.see_ids(inputs["input_ids"][:, :stop], stop - start, mask, check=start == seen)
                    model(input_ids=inputs["input_ids"][:, start:stop], attention_mask=mask, **{CACHE_KWARG: cache},
                          use_cache=True)
                return inputs["input_ids"][:, :0]
            output = model.generate(
                **inputs,
                **{CACHE_KWARG: cache},
                max_new_tokens=max_new_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                pad_token_id=tokenizer.pad_token_id,
                stopping_criteria=StoppingCriteriaList([bars]) if bars else None,
                prefill_chunk_size=prefill_chunk,
            )
            return output[:, total:]
    finally:
        if bars:
            bars.close()


def _results(tokenizer, cache, inputs: dict, new_tokens: torch.Tensor, budget) -> list[GenerationResult]:
    summary = cache.summary()
    answers = tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    real_new = (new_tokens != tokenizer.pad_token_id).sum(-1) if new_tokens.numel() else new_tokens.sum(-1)
    return [
        GenerationResult(
            answer=answers[row].strip(),
            prompt_tokens=int(inputs["attention_mask"][row].sum()),
            kept_entries=summary.kept_entries[row],
            cache_bytes=summary.cache_bytes[row],
            entry_bytes=summary.entry_bytes[row],
            padding_bytes=summary.padding_bytes[row],
            spare_bytes=summary.spare_bytes[row],
            state_bytes=summary.state_bytes[row],
            full_cache_bytes=summary.full_cache_bytes[row],
            method=cache.method_spec,
            budget=None if cache.method.name == "full" else budget,
            new_tokens=int(real_new[row]),
        )
        for row in range(new_tokens.shape[0])
    ]


@torch.inference_mode()
def compress(
    model,
    tokenizer,
    context: str,
    method="full",
    budget: int | float = 1.0,
    chat: bool = True,
    prefill_chunk: int | None = None,
    decoding: str = "append",
    **method_params,
) -> CompressedCache:
    """Prefill ``context`` and compress it before any question is seen ("compress once, ask many").

    Returns a :class:`CompressedCache` holding the context, compressed by ``method`` at
    ``budget`` (a fraction of the context's tokens, or an entry count). Ask questions with
    ``keepkv.generate(model, tokenizer, questions, past_key_values=cache)``: each question runs on
    its own ``cache.copy()`` and the cache is left as it was. The user message is
    ``context + "\\n\\n" + question`` in the chat template (``chat=True``), the context and the
    question tokenized apart (:func:`context_and_question_ids`).

    ``decoding`` says what the question and the answer do to the compressed context: "append"
    (default) lets their tokens in uncompressed, so nothing the compression kept is evicted for
    them (kvpress's and KVzip's setting; the cache grows by the question and the answer, and the
    context's copy is discarded after each question); "compress" keeps the budget while they come
    in, so a method that compresses while decoding evicts (or merges) context entries to make room.
    On the embedded model's question-agnostic pass keys, "append" keeps facts that "compress" loses
    (docs/results.md). A method named by a string runs on its compress-once selection where it has
    one: ``"keepkv"`` here is KeepKV's merge on KVzip's selection (``"keepkv+selection=snapkv"``
    names another). The answer equals that of prefilling context + question in one sequence
    with the compression triggered at the context's end (``tests/test_compress_once.py``).
    """
    check_model(model)
    check_tokenizer(tokenizer)
    context = as_text("context", context, empty_ok=False)
    chat = as_bool("chat", chat)
    prefill_chunk = as_int("prefill_chunk", prefill_chunk, 1, none_ok=True)
    method_of(method, method_params, compress_once=True)
    if decoding == "keep_prompt":
        raise ValueError("keepkv.compress compresses the context: decoding must be 'append' or 'compress' "
                         "(keep_prompt keeps a prompt whole: keepkv.generate or CompressedCache)")
    cache = CompressedCache(model.config, method, budget, decoding=decoding, compress_once=True, **method_params)
    check_budget_holds(cache.method, cache.budget)
    cache.method.prepare(model)
    device = next(model.parameters()).device
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    head, _ = context_and_question_ids(tokenizer, context, "", chat)
    check_prompt_length(model.config, len(head))
    check_context(model.config, len(head))
    input_ids = torch.tensor([head], device=device)
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    if prefill_chunk is not None and not cache.defers_to_reconstruction:
        cache.start_prefill(inputs["attention_mask"])
    _run(model, tokenizer, cache, inputs, 0, False, prefill_chunk, chat)
    cache.context_ids, cache.context_chat = head, chat
    return cache


@torch.inference_mode()
def generate(
    model,
    tokenizer,
    prompts,
    method="full",
    budget: int | float = 1.0,
    max_new_tokens: int = 64,
    chat: bool = True,
    answer_prefix: str = "",
    progress: bool = False,
    prefill_chunk: int | None = None,
    past_key_values: CompressedCache | None = None,
    decoding: str = "compress",
    **method_params,
) -> list[GenerationResult]:
    """Greedy generation with a compressed KV cache, one result per prompt.

    Parameters
    ----------
    model, tokenizer
        A Llama-family causal LM and its tokenizer (``keepkv.load_model()``).
    prompts : str or list of str
        Batched with left padding; each row is compressed independently. With
        ``past_key_values``: the questions about its context.
    method : str or Method
        A registered method (``keepkv.describe_methods()``).
    budget : float or int
        Fraction of each prompt in (0, 1], or an entry count in [1, 2**48], per layer and head
        (integer numpy scalars count as ints). A fraction never keeps fewer than the method's
        protected tokens + 32 (``keepkv.budgets.budget_floor``): a prompt no longer than that is
        not compressed. An entry count below the method's protected tokens is refused
        (ValueError, ``keepkv.budgets.check_budget_holds``).
    max_new_tokens : int
        Tokens to generate (>= 0; 0 runs the prefill and compression only).
    chat : bool
        Apply the tokenizer's chat template.
    answer_prefix : str
        Text that starts the assistant's reply.
    progress : bool
        Show progress bars on stderr, named after the method: the prefill (per decoder layer),
        then the generated tokens.
    prefill_chunk : int, optional
        Feed the prompt in blocks of this many tokens (>= 1), so that prefill attention's
        workspace is bounded by one block. The outputs are those of an unchunked prefill (the
        method sees the statistics of the whole prompt and compresses after its last block);
        the cache peaks at the uncompressed prompt of every layer (``CompressedCache``). The
        exception: a selection that scores each entry alone (``snapkv+selection=learned``) is
        compressed after every block, so the cache peaks at the budget plus one block, and later
        blocks attend to the compressed earlier ones (``Method.compresses_chunks``).
    past_key_values : CompressedCache, optional
        A context compressed by :func:`keepkv.compress`: each prompt is a question about it,
        answered on its own ``copy()`` of the cache (this one is left untouched), one question
        at a time. The method and budget are the cache's (passing others is refused).
    decoding : str
        "compress" (default): the method keeps the budget while the answer is generated.
        "append": the prompt is compressed once and the answer's tokens are appended
        uncompressed. "keep_prompt": the prompt is kept whole and the method keeps ``budget``
        (an int) of the answer's entries (``CompressedCache``).
    **method_params
        Parameters of the method.

    Every argument is checked before any work starts (:func:`check_arguments`): a wrong one is
    refused with a ValueError, in one line that names it. ``result.method`` is the method as
    given (a variant keeps its parameters). The model's attention implementation is switched to
    ``"keepkv"`` for the call and restored after it. A :class:`keepkv.KeepKVWarning` says when
    prompt plus new tokens exceed the model's ``max_position_embeddings``, or when the budget
    leaves a compressed prompt fewer entries than the method's protected tokens.
    """
    if past_key_values is not None:
        if not isinstance(past_key_values, CompressedCache) or getattr(past_key_values, "context_ids", None) is None:
            raise ValueError(f"past_key_values must be a cache returned by keepkv.compress(), got "
                             f"{shown(past_key_values)}")
        defaults = isinstance(method, str) and method == "full" and isinstance(budget, float) and budget == 1.0
        if not defaults or method_params or decoding != "compress":
            raise ValueError("with past_key_values the method, budget and decoding are the cache's: pass none of them")
    args = check_arguments(prompts, method, budget, max_new_tokens, chat, answer_prefix, progress, prefill_chunk,
                           **method_params)
    prompts, budget, max_new_tokens, prefill_chunk = (args[k] for k in ("prompts", "budget", "max_new_tokens",
                                                                         "prefill_chunk"))
    chat, answer_prefix, progress = args["chat"], args["answer_prefix"], args["progress"]
    check_model(model)
    check_tokenizer(tokenizer)
    if past_key_values is not None:
        return _ask(model, tokenizer, prompts, past_key_values, max_new_tokens, answer_prefix, progress)
    cache = CompressedCache(model.config, method, budget, decoding=decoding, **method_params)
    check_budget_holds(cache.method, cache.budget)
    cache.method.prepare(model)
    device = next(model.parameters()).device
    inputs = encode(tokenizer, build_prompts(tokenizer, prompts, chat, answer_prefix), chat, device)
    prompt_length = inputs["input_ids"].shape[1]
    check_prompt_length(model.config, prompt_length)
    warn_context_length(model.config, prompt_length, max_new_tokens)
    check_context(model.config, prompt_length + max_new_tokens)
    if prefill_chunk is not None and not cache.defers_to_reconstruction:
        cache.start_prefill(inputs["attention_mask"])
    new_tokens = _run(model, tokenizer, cache, inputs, max_new_tokens, progress, prefill_chunk, chat)
    return _results(tokenizer, cache, inputs, new_tokens, budget)


def _ask(model, tokenizer, questions, context_cache, max_new_tokens, answer_prefix, progress) -> list[GenerationResult]:
    """Each question on its own copy of a compressed context (see :func:`compress`)."""
    device = next(model.parameters()).device
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    results = []
    for question in questions:
        head, tail = context_and_question_ids(tokenizer, "", question, context_cache.context_chat, answer_prefix)
        ids = context_cache.context_ids + tail
        check_prompt_length(model.config, len(ids))
        warn_context_length(model.config, len(ids), max_new_tokens)
        check_context(model.config, len(ids) + max_new_tokens)
        input_ids = torch.tensor([ids], device=device)
        inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
        cache = context_cache.copy()
        new_tokens = _run(model, tokenizer, cache, inputs, max_new_tokens, progress, None)
        results += _results(tokenizer, cache, inputs, new_tokens, cache.budget)
    return results
