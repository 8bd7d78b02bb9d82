"""Misuse is never silent: a reused cache checks what it continues, and every public entry checks
its arguments in one line that names the argument, before any work starts."""

import numpy as np
import pytest
import torch

import keepkv
from keepkv import cli
from keepkv.models import CACHE_KWARG

from conftest import CharTokenizer, VOCAB, random_batch, tiny_model
from test_generation_features import char_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::keepkv.KeepKVWarning")
GREEDY = dict(do_sample=False, pad_token_id=0)


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _generate(model, cache, input_ids, attention_mask=None, new_tokens=4, **options):
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    return model.generate(input_ids=input_ids, attention_mask=attention_mask, **{CACHE_KWARG: cache},
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens, **{**GREEDY, **options})


def _one_line_refusal(error) -> str:
    message = str(error.value)
    assert "\n" not in message
    assert "does not continue it" in message and "fresh" in message and "copy()" in message
    return message


# --------------------------------------------------------------------- 1. a reused cache
@pytest.mark.parametrize("method, budget", [("snapkv", 40), ("full", 1.0), ("h2o", 8)])
@pytest.mark.parametrize("longer", [True, False])
def test_a_new_unpadded_prompt_on_a_used_cache_is_refused_and_changes_nothing(method, budget, longer):
    """One cache, model.generate on a prompt, then on another prompt without padding, longer or
    shorter: refused in one line, not answered as a continuation of the first conversation (its
    first tokens sliced off unseen) nor failing in a torch reshape."""
    model = tiny_model("llama-gqa", layers=2)
    keepkv.enable(model)
    cache = keepkv.CompressedCache(model.config, method, budget)
    _generate(model, cache, _ids(48, seed=1))
    seen, nbytes = cache.get_seq_length(), cache.nbytes()
    other = _ids(70 if longer else 20, seed=2)
    with pytest.raises(ValueError) as error:
        _generate(model, cache, other)
    _one_line_refusal(error)
    assert (cache.get_seq_length(), cache.nbytes()) == (seen, nbytes)
    fresh = _generate(model, keepkv.CompressedCache(model.config, method, budget), other)
    assert fresh.shape[1] == other.shape[1] + 4


@pytest.mark.parametrize("longer", [True, False])
def test_a_new_padded_batch_on_a_used_cache_is_refused(longer):
    model = tiny_model("llama-gqa", layers=2)
    keepkv.enable(model)
    cache = keepkv.CompressedCache(model.config, "snapkv", 40)
    input_ids, attention_mask = random_batch(batch=2, length=48, pad=(0, 7), seed=1)
    _generate(model, cache, input_ids, attention_mask)
    other, other_mask = random_batch(batch=2, length=70 if longer else 20, pad=(3, 0), seed=5)
    with pytest.raises(ValueError) as error:
        _generate(model, cache, other, other_mask)
    _one_line_refusal(error)


def test_the_whole_sequence_plus_new_tokens_continues_a_used_cache_and_equals_a_fresh_one():
    model = tiny_model("llama-gqa", layers=2)
    keepkv.enable(model)
    input_ids, attention_mask = random_batch(batch=2, length=30, pad=(0, 5), seed=1)
    cache = keepkv.CompressedCache(model.config, "full")
    first = _generate(model, cache, input_ids, attention_mask)
    more = torch.cat([first, _ids(6, seed=3).expand(2, -1)], dim=-1)
    more_mask = torch.cat([attention_mask, torch.ones(2, more.shape[1] - 30, dtype=torch.long)], dim=-1)
    continued = _generate(model, cache, more, more_mask)
    fresh = _generate(model, keepkv.CompressedCache(model.config, "full"), more, more_mask)
    assert torch.equal(continued, fresh)
    # The same tokens with one changed in row 1: same length, same positions, other ids.
    changed = continued.clone()
    changed[1, 12] = (changed[1, 12] - 3 + 1) % (VOCAB - 3) + 3
    changed = torch.cat([changed, _ids(3, seed=4).expand(2, -1)], dim=-1)
    changed_mask = torch.cat([attention_mask, torch.ones(2, changed.shape[1] - 30, dtype=torch.long)], dim=-1)
    with pytest.raises(ValueError) as error:
        _generate(model, cache, changed, changed_mask)
    assert "row 1" in _one_line_refusal(error)


def test_the_record_follows_rows_that_num_return_sequences_repeats_and_select_rows_reorders():
    """CompressedCache.select_rows (beam search's reorder_cache) moves each row's record with it."""
    model = tiny_model("llama-gqa", layers=2)
    keepkv.enable(model)
    torch.manual_seed(0)
    cache = keepkv.CompressedCache(model.config, "h2o", 12)
    first = _generate(model, cache, _ids(24, seed=1), num_return_sequences=2, do_sample=True, top_k=0)
    assert not torch.equal(first[0], first[1])
    second = _generate(model, cache, torch.cat([first, _ids(3, seed=6).expand(2, -1)], dim=-1))
    cache.select_rows(torch.tensor([1, 0]))
    extra = _ids(3, seed=7).expand(2, -1)
    with pytest.raises(ValueError, match="row 0 has other token ids"):
        _generate(model, cache, torch.cat([second, extra], -1))
    output = _generate(model, cache, torch.cat([second.flip(0), extra], -1))  # the rows as they now are
    assert output.shape == (2, second.shape[1] + 3 + 4)


def test_a_beam_search_cache_is_refused_for_the_sequence_it_returns():
    """Beam search leaves num_beams rows in the cache, of the beams still running: continuing it
    with the returned sequence is refused in one line, not left to fail in a torch reshape."""
    model = tiny_model("llama-gqa", layers=2)
    keepkv.enable(model)
    cache = keepkv.CompressedCache(model.config, "h2o", 12)
    best = _generate(model, cache, _ids(24, seed=1), num_beams=2)
    with pytest.raises(ValueError) as error:
        _generate(model, cache, torch.cat([best, _ids(3, seed=6)], dim=-1))
    assert "rows" in _one_line_refusal(error)


def test_compressed_contexts_answer_their_questions_and_refuse_another_context():
    """keepkv.compress: each question continues the context (its ids follow the context's); a
    copy of the context given another text is refused."""
    model = tiny_model("llama-gqa", layers=2)
    tokenizer = char_tokenizer()
    context = "the pass key is 12345. " * 6
    cache = keepkv.compress(model, tokenizer, context, method="snapkv", budget=40, chat=False)
    results = keepkv.generate(model, tokenizer, ["what is it?", "say it"], past_key_values=cache, max_new_tokens=3)
    assert len(results) == 2 and results[0].prompt_tokens - results[1].prompt_tokens == 5  # "what is it?", "say it"
    ids = tokenizer("another context entirely, " * 7, return_tensors="pt")["input_ids"]
    with keepkv.enabled(model), pytest.raises(ValueError) as error:
        _generate(model, cache.copy(), ids)
    _one_line_refusal(error)


def test_a_cache_fed_by_a_forward_loop_is_checked_by_positions_and_continues():
    """A plain forward loop hands the cache no ids: a continuation goes on, a padded misfit is refused."""
    model = tiny_model("llama-gqa", layers=2)
    keepkv.enable(model)
    input_ids, attention_mask = random_batch(batch=2, length=20, pad=(0, 4), seed=1)
    cache = keepkv.CompressedCache(model.config, "full")
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache).logits
    token = logits[:, -1:].argmax(-1)
    more = torch.cat([input_ids, token], -1)
    more_mask = torch.cat([attention_mask, torch.ones_like(token)], -1)
    out = _generate(model, cache, torch.cat([more, token], -1), torch.cat([more_mask, torch.ones_like(token)], -1))
    assert out.shape[1] == 22 + 4


@pytest.mark.integration
def test_the_issues_script_is_refused_on_the_embedded_model():
    """snapkv at budget 64, model.generate on a question, then on a longer, different one."""
    model, tokenizer = keepkv.load_model()

    def chat(text):
        messages = [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)

    with keepkv.enabled(model):
        cache = keepkv.CompressedCache(model.config, "snapkv", budget=64)
        with torch.no_grad():
            model.generate(**chat("What is the capital of France?"), past_key_values=cache, max_new_tokens=8,
                           do_sample=False)
            for text in ("Thank you! Now tell me, what colours is a rainbow made of, from the outside in?", "Hi"):
                with pytest.raises(ValueError) as error:
                    model.generate(**chat(text), past_key_values=cache, max_new_tokens=8, do_sample=False)
                _one_line_refusal(error)


# --------------------------------------------------------------------- 2, 3. argument checks
MODEL = tiny_model("llama-gqa", layers=2)
TOKENIZER = CharTokenizer()


def _refused(call, argument: str):
    with pytest.raises((ValueError, TypeError)) as error:
        call()
    message = str(error.value)
    assert "\n" not in message and argument in message, message
    return message


@pytest.mark.parametrize("budget", [10**30, 2**63, np.int64(-3), float("nan"), float("inf"), "64", None])
def test_a_budget_out_of_range_is_refused_in_one_line_at_every_entry(budget):
    _refused(lambda: keepkv.generate(MODEL, TOKENIZER, "hello", "snapkv", budget=budget), "budget")
    _refused(lambda: keepkv.compress(MODEL, TOKENIZER, "hello", "snapkv", budget=budget), "budget")
    _refused(lambda: keepkv.CompressedCache(MODEL.config, "snapkv", budget=budget), "budget")


def test_the_largest_budget_is_a_full_cache():
    big = keepkv.budgets.MAX_BUDGET
    (result,) = keepkv.generate(MODEL, TOKENIZER, "hello there", "snapkv", budget=big, max_new_tokens=3)
    (full,) = keepkv.generate(MODEL, TOKENIZER, "hello there", "full", max_new_tokens=3)
    assert result.answer == full.answer and result.budget == big
    _refused(lambda: keepkv.CompressedCache(MODEL.config, "snapkv", budget=big + 1), "budget")


def test_integer_numpy_scalars_are_accepted_as_ints():
    (as_numpy,) = keepkv.generate(MODEL, TOKENIZER, "hello there", "h2o", budget=np.int64(6),
                                  max_new_tokens=np.int32(3), prefill_chunk=np.int16(4))
    (as_int,) = keepkv.generate(MODEL, TOKENIZER, "hello there", "h2o", budget=6, max_new_tokens=3, prefill_chunk=4)
    assert as_numpy == as_int and type(as_numpy.budget) is int
    assert keepkv.CompressedCache(MODEL.config, "h2o", np.uint8(6)).budget == 6
    assert keepkv.CompressedCache(MODEL.config, "h2o", np.float32(0.5)).budget == 0.5


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(method=None), "method"),
        (dict(method=3), "method"),
        (dict(prompts=123), "prompts"),
        (dict(prompts=["a", None]), "prompts"),
        (dict(answer_prefix=5), "answer_prefix"),
        (dict(chat="yes"), "chat"),
        (dict(progress=None), "progress"),
        (dict(max_new_tokens=2**70), "max_new_tokens"),
        (dict(max_new_tokens=2.0), "max_new_tokens"),
        (dict(prefill_chunk=0), "prefill_chunk"),
        (dict(past_key_values="cache"), "past_key_values"),
        (dict(model=None), "model"),
        (dict(tokenizer=5), "tokenizer"),
    ],
)
def test_a_wrong_argument_to_generate_is_named_in_one_line(kwargs, argument):
    call = dict(model=MODEL, tokenizer=TOKENIZER, prompts="hello", max_new_tokens=2) | kwargs
    _refused(lambda: keepkv.generate(**call), argument)


@pytest.mark.parametrize(
    "kwargs, argument",
    [(dict(context=7), "context"), (dict(method=None), "method"), (dict(chat=1), "chat"),
     (dict(prefill_chunk=2**64), "prefill_chunk"), (dict(model="m"), "model"), (dict(tokenizer=None), "tokenizer")],
)
def test_a_wrong_argument_to_compress_is_named_in_one_line(kwargs, argument):
    call = dict(model=MODEL, tokenizer=TOKENIZER, context="hello") | kwargs
    _refused(lambda: keepkv.compress(**call), argument)


@pytest.mark.parametrize(
    "args, kwargs, argument",
    [((None,), {}, "config"), ((5, "full"), {}, "config"), ((MODEL.config, None), {}, "method"),
     ((MODEL.config, "full"), dict(compile=1), "compile"), ((MODEL.config, "full"), dict(record=3), "record"),
     ((MODEL.config, "keepkv", 0.5), dict(static_shapes="yes"), "static_shapes")],
)
def test_a_wrong_argument_to_compressed_cache_is_named_in_one_line(args, kwargs, argument):
    _refused(lambda: keepkv.CompressedCache(*args, **kwargs), argument)


def test_compressed_cache_takes_a_model_for_its_config():
    cache = keepkv.CompressedCache(MODEL, "snapkv", 64)
    assert cache.config is MODEL.config and cache.num_layers == 2


@pytest.mark.parametrize(
    "kwargs, argument",
    [(dict(path=5), "path"), (dict(dtype=None), "dtype"), (dict(device=3.5), "device"),
     (dict(device="nodevice"), "device")],
)
def test_a_wrong_argument_to_load_model_is_named_in_one_line(kwargs, argument):
    _refused(lambda: keepkv.load_model(**kwargs), argument)


def test_the_vllm_config_checks_its_arguments():
    from keepkv.vllm import check

    assert check({"method": "snapkv", "budget": np.int64(64)})["budget"] == 64
    _refused(lambda: check({"method": None, "budget": 0.1}), "method")
    _refused(lambda: check({"method": "snapkv", "budget": 10**30}), "budget")


# --------------------------------------------------------------------- 2, 4, 5. the command line
def _cli_error(argv, capsys, monkeypatch) -> str:
    """The one stderr line of a refused command line; the model is never loaded."""
    monkeypatch.setattr(keepkv.models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    code = cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("keepkv: error: ") and "\n" not in err, err
    return err


def test_a_huge_cli_budget_is_refused_before_the_model_loads(capsys, monkeypatch):
    err = _cli_error(["generate", "What is the capital of France?", "--budget", "1" + "0" * 30], capsys, monkeypatch)
    assert "budget" in err


def test_a_prompt_and_a_prompt_file_together_are_refused(tmp_path, capsys, monkeypatch):
    path = tmp_path / "prompt.txt"
    path.write_text("the file's question")
    err = _cli_error(["generate", "Q", "--prompt-file", str(path)], capsys, monkeypatch)
    assert "--prompt-file" in err and "prompt" in err


@pytest.mark.parametrize(
    "argv, argument",
    [(["generate", "Q", "--budget", "abc"], "budget"), (["generate", "Q", "--max-new-tokens", "x"], "max-new-tokens"),
     (["generate"], "prompt"), (["nosuchcommand"], "nosuchcommand"),
     (["generate", "Q", "--frobnicate"], "--frobnicate"),
     (["generate", "Q", "--max-new-tokens", "-1"], "max_new_tokens"), (["demo", "--threads", "0"], "threads"),
     (["generate", "Q", "--prefill-chunk", "0"], "prefill_chunk"), ([], "command")],
)
def test_argparse_errors_are_the_one_line_form(argv, argument, capsys, monkeypatch):
    err = _cli_error(argv, capsys, monkeypatch)
    assert argument in err and "usage:" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--device", "cuda"], "--device cuda: no CUDA device is available here"),
        (["eval", "--device", "cuda"], "--device cuda: no CUDA device is available here"),
        (["bench", "--device", "nodevice"], "--device nodevice: not a device; give cpu, cuda or cuda:N"),
        (["eval", "--suite", "jsonl"], "the jsonl suite needs a file: --data FILE.jsonl"),
        (["eval", "--suite", "longbench", "--quick"], "the longbench suite needs a directory: --data DIR"),
        (["bench", "--kernel", "triton", "--device", "cpu"], "kernel='triton' needs Triton"),
        (["bench", "--ops", "--reconstruction"], "--ops and --reconstruction are separate runs: pass one of --soak, "),
        (["bench", "--soak", "--ops"], "--soak and --ops are separate runs"),
        (["bench", "--ops", "--kernel", "triton"], "--kernel is an option of the timing run, and --ops runs instead"),
        (["bench", "--soak", "--memory-cap", "1", "--overhead"], "--memory-cap, --overhead are options of the timing run"),
        (["bench", "--soak-text"], "--soak-text is an option of --soak: pass --soak too"),
        (["bench", "--overhead-steps", "4"], "--overhead-steps is an option of --overhead"),
        (["generate", "Q", "--method", "snapkv+window=4+window=8"], "'snapkv+window=4+window=8' gives window twice"),
        (["generate", "Q", "--threads", "0"], "threads must be an int >= 1"),
        (["methods", "--model", "/nonexistent/model"], "unrecognized arguments: --model /nonexistent/model"),
        (["report", "{plain}"], "is not an eval summary.csv (no suite, length, method, budget, score column)"),
        (["report", "{empty}"], "is not an eval summary.csv"),
    ],
)
def test_a_misused_command_is_refused_in_one_line_before_the_model_loads(argv, message, tmp_path, capsys, monkeypatch):
    """Each refused in one line (exit status 2) before any model loads; nothing silently ignored."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the Triton kernel then needs CUDA
    (tmp_path / "plain.txt").write_text("some notes\nnot a table\n")
    (tmp_path / "empty.csv").write_text("")
    argv = [arg.format(plain=tmp_path / "plain.txt", empty=tmp_path / "empty.csv") for arg in argv]
    assert message in _cli_error(argv, capsys, monkeypatch)


@pytest.mark.parametrize(
    "name, message",
    [
        (None, "method must be a method name or variant (a str such as 'snapkv'"),
        (3, "`keepkv methods` lists them), got 3"),
        ("snapkv+window=4+window=8", "gives window twice: give each parameter once"),
    ],
)
def test_get_method_names_what_it_takes(name, message):
    assert message in _refused(lambda: keepkv.get_method(name), "method")


# --------------------------------------------------------------------- 6. result.method
@pytest.mark.parametrize("method", ["keepkv+protect=0.9", "snapkv+window=8", "h2o"])
def test_result_method_is_the_variant_as_given(method):
    (result,) = keepkv.generate(MODEL, TOKENIZER, "hello there, this is a prompt", method, budget=0.5, max_new_tokens=2)
    assert result.method == method
