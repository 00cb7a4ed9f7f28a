"""Saved caches (.kvc): engine-level round trips, the prefill/inspect/ask commands, and every error case.

Engine-level tests use the tiny random models of tests/helpers.py; CLI tests build a tiny Llama checkpoint
with a word-level tokenizer on disk and run ``kvtool.cli.main`` (a few KB per cache, well under a second
per command).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from kvtool.cli.app import main
from kvtool.errors import KvtoolError, UsageError
from kvtool.kvc import format as kvc_format
from kvtool.kvc import load as kvc_load
from kvtool.kvc import write as kvc_write
from kvtool.runtime import store
from kvtool.runtime.model import CHATML_TEMPLATE
from tests.helpers import VOCAB, make_engine, stream_logits, tiny_llama

# ------------------------------------------------------------------------------------------------------------
# Engine level: state_dict -> .kvc -> load gives the same cache, the same logits and the same continuation


def _through_file(tmp_path: Path, engine, cache, name: str = "c.kvc"):
    tensors, scalars = cache.snapshot()
    path = tmp_path / name
    kvc_write.write_kvc(path, tensors, {"cache": scalars})
    header = kvc_format.read_header(path)
    loaded = engine.new_cache()
    loaded.load(kvc_load.load_tensors(header), header.meta["cache"])
    return loaded, header


def _continue(engine, cache, ids: torch.Tensor, n_new: int = 8) -> tuple[torch.Tensor, list[int]]:
    logits, _ = stream_logits(engine, ids, cache=cache)
    out, _ = engine.generate(cache, logits[-1:], n_new, eos_ids=set())
    return logits, out


def _assert_same_cache(a, b) -> None:
    assert a.seen == b.seen
    assert a.compact == b.compact
    assert a.compact_since == b.compact_since
    assert a.pin_start == b.pin_start
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize(
    ("policy", "positions", "max_positions"),
    [
        ("h2o", "absolute", 2048),  # per-token running state (accumulated attention)
        ("scissorhands", "absolute", 2048),  # several state fields
        ("sink", "absolute", 2048),  # attention-free, no state
        ("keydiff", "compact", 2048),  # keys stored at compact slot positions
        ("h2o", "auto", 96),  # switches to compact mid-document: counter and switch point must survive
        ("razor", "absolute", 2048),  # two head groups per layer, compensation token sums
    ],
)
def test_engine_round_trip_same_logits_and_continuation(tmp_path, policy, positions, max_positions):
    model = tiny_llama(max_positions=max_positions)
    retrieval = (lambda: {0: [0], 1: [1]}) if policy == "razor" else None
    engine = make_engine(model, policy, 40, block_size=16, positions=positions, retrieval=retrieval)
    gen = torch.Generator().manual_seed(7)
    doc = torch.randint(0, VOCAB, (200,), generator=gen)
    more = torch.randint(0, VOCAB, (37,), generator=gen)

    _, cache = stream_logits(engine, doc)
    assert cache.counters.evicted_tokens > 0
    if positions == "auto":
        assert cache.compact and cache.compact_since is not None and cache.compact_since > 0
    loaded, header = _through_file(tmp_path, engine, cache)
    _assert_same_cache(cache, loaded)
    assert header.meta["cache"]["seen"] == 200

    logits_a, out_a = _continue(engine, cache, more)
    logits_b, out_b = _continue(engine, loaded, more)
    assert torch.equal(logits_a, logits_b)
    assert out_a == out_b
    _assert_same_cache(cache, loaded)  # and both keep evicting the same way


def test_positions_survive_round_trip_exactly(tmp_path):
    model = tiny_llama(max_positions=64)
    engine = make_engine(model, "h2o", 32, block_size=8, positions="auto")
    _, cache = stream_logits(engine, torch.arange(150) % VOCAB)
    loaded, header = _through_file(tmp_path, engine, cache)
    for g_a, g_b in zip(cache.groups(), loaded.groups(), strict=True):
        assert torch.equal(g_a.positions[:, : g_a.length], g_b.positions[:, : g_b.length])
        assert g_b.positions.dtype == torch.long
    assert header.tensors["l0.g0.positions"]["dtype"] == "I32"  # stored compactly, restored as int64
    assert (header.meta["cache"]["compact"], header.meta["cache"]["positions_mode"]) == (True, "auto")


# ------------------------------------------------------------------------------------------------------------
# Header-level checks (no model)


def test_is_kvc_by_content_not_name(tmp_path):
    engine = make_engine(tiny_llama(), "sink", 24, block_size=8)
    _, cache = stream_logits(engine, torch.arange(40) % VOCAB)
    tensors, scalars = cache.snapshot()
    odd_name = tmp_path / "notes.txt"
    kvc_write.write_kvc(odd_name, tensors, {"cache": scalars})
    assert kvc_format.is_kvc(odd_name)

    text = tmp_path / "doc.kvc"
    text.write_text("just a document that happens to be called .kvc\n" * 50)
    assert not kvc_format.is_kvc(text)
    (tmp_path / "empty").write_bytes(b"")
    assert not kvc_format.is_kvc(tmp_path / "empty")
    assert not kvc_format.is_kvc(tmp_path / "missing")
    assert not kvc_format.is_kvc(tmp_path)
    other = tmp_path / "other.safetensors"
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(3)}, str(other), metadata={"format": "pt"})
    assert not kvc_format.is_kvc(other)
    with pytest.raises(UsageError, match="not a kvtool cache"):
        kvc_format.read_header(other)


def test_write_is_atomic_and_never_clobbers(tmp_path, monkeypatch):
    engine = make_engine(tiny_llama(), "sink", 24, block_size=8)
    _, cache = stream_logits(engine, torch.arange(40) % VOCAB)
    tensors, scalars = cache.snapshot()
    out = tmp_path / "c.kvc"
    out.write_bytes(b"precious")
    with pytest.raises(UsageError, match="already exists; use --force"):
        kvc_write.write_kvc(out, tensors, {"cache": scalars})

    real_pwrite = os.pwrite

    def boom(fd, data, offset):
        real_pwrite(fd, b"half a file", offset)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kvc_write.os, "pwrite", boom)
    with pytest.raises(KvtoolError, match="No space left"):
        kvc_write.write_kvc(out, tensors, {"cache": scalars}, force=True)
    assert out.read_bytes() == b"precious"  # the old file is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.kvc"]  # no temp file left behind
    monkeypatch.undo()
    size = kvc_write.write_kvc(out, tensors, {"cache": scalars}, force=True)
    assert size == out.stat().st_size and kvc_format.is_kvc(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.kvc"]


def test_unwritable_destinations(tmp_path, monkeypatch):
    with pytest.raises(UsageError, match="does not exist"):
        kvc_write.check_output(tmp_path / "no" / "such" / "dir.kvc")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="not a directory"):
        kvc_write.check_output(tmp_path / "file" / "c.kvc")
    with pytest.raises(UsageError, match="is a directory"):
        kvc_write.check_output(tmp_path, force=True)
    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    with pytest.raises(UsageError, match="not writable"):
        kvc_write.check_output(tmp_path / "c.kvc")


# ------------------------------------------------------------------------------------------------------------
# CLI level: a tiny checkpoint on disk

WORDS = (
    "the a of and to in is was it that cache tokens document question answer user assistant text above brief "
    "specific summarize river mountain king queen castle night day light dark sea ship wind stone fire water old "
    "new red blue green house road tree bird song story"
).split()


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "<|im_start|>", "<|im_end|>", *WORDS]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"]
    )
    tok.chat_template = CHATML_TEMPLATE  # a chat model's (a checkpoint without a template is a base model)
    return tok


def _checkpoint(directory: Path, layers: int = 2) -> Path:
    tok = _tokenizer()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tok),
        max_position_embeddings=128,
        rope_theta=10000.0,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    return directory


# Prefix (2 tokens) + 300 words = 302 positions > max_position_embeddings 128: "auto" switches to compact.
SETTINGS = ["--policy", "h2o", "--budget", "40", "--block-size", "16", "--device", "cpu"]
GEN = ["--max-new-tokens", "8"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("kvc")
    rng = random.Random(1)
    doc = root / "doc.txt"
    doc.write_text(" ".join(rng.choice(WORDS[20:]) for _ in range(300)) + "\n", encoding="utf-8")
    return {
        "root": root,
        "model": str(_checkpoint(root / "tiny")),
        "other_model": str(_checkpoint(root / "tiny3", layers=3)),
        "doc": doc,
    }


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTOOL_HOME", str(tmp_path / "home"))


def cli(capsys, *args: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_usage_error(result: tuple[int, str, str], *needles: str) -> str:
    rc, _, err = result
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, err
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("kvtool: error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def kvc(env) -> Path:
    """One prefilled cache, shared (tests that damage it work on a copy)."""
    out = env["root"] / "doc.kvc"
    rc = main(["prefill", str(env["doc"]), "-o", str(out), "--model", env["model"], *SETTINGS, "-q"])
    assert rc == 0
    return out


def _copy(kvc: Path, tmp_path: Path, name: str = "copy.kvc") -> Path:
    dst = tmp_path / name
    shutil.copyfile(kvc, dst)
    return dst


def test_prefill_inspect_ask_same_answers_as_document(env, tmp_path, capsys):
    out = tmp_path / "book.kvc"
    rc, stdout, err = cli(capsys, "prefill", env["doc"], "-o", out, "--model", env["model"], *SETTINGS, "--json", "-q")
    assert rc == 0, err
    info = json.loads(stdout)
    assert info["output"] == str(out) and info["bytes"] == out.stat().st_size
    assert info["stats"]["document_tokens"] == 300 and info["stats"]["evicted_tokens"] > 0

    rc, stdout, err = cli(capsys, "inspect", out, "--json")
    assert rc == 0, err
    desc = json.loads(stdout)
    meta = desc["metadata"]
    assert meta["format"] == "kvtool-kvc" and meta["format_version"] == kvc_format.FORMAT_VERSION
    assert meta["kvtool_version"] and meta["model"]["name"] == "tiny" and len(meta["model"]["identity"]) == 64
    assert meta["dtype"] == "float32"
    assert meta["policy"]["spec"] == "h2o" and meta["settings"]["budget_tokens"] == 40
    assert meta["settings"]["block_size"] == 16 and meta["settings"]["positions"] == "auto"
    assert meta["prompt"]["prefix"] == "<|im_start|>user\n"
    assert meta["document"]["tokens"] == 300 and len(meta["document"]["sha256"]) == 64
    # the position counter and mode: 302 tokens seen, switched to compact at the model's 128 positions
    assert meta["cache"]["seen"] == 302 and meta["cache"]["compact"] and meta["cache"]["compact_since"] == 128
    assert [[g["length"] for g in layer["groups"]] for layer in desc["layers"]] == [[40], [40]]

    # size: the K/V bytes the budget promises, plus positions/state (a few bytes per token) and the header
    promised = desc["kv_promised_bytes"]
    assert desc["kv_bytes"] == promised == 2 * 2 * 40 * 2 * 8 * 4  # layers x heads x tokens x K,V x dim x fp32
    assert desc["size_bytes"] - desc["header_bytes"] <= 1.2 * promised
    assert desc["size_bytes"] < 20 * 1024  # a few KB

    rc, stdout, err = cli(capsys, "inspect", out)
    assert rc == 0 and "kvtool cache" in stdout and "compact since token 128" in stdout

    q = ["what is the castle", "where is the ship"]
    base = ["--model", env["model"], "--json", "-q", *GEN]
    rc, from_doc, err = cli(capsys, "ask", env["doc"], *q, *SETTINGS, *base)
    assert rc == 0, err
    disguised = tmp_path / "cache.bin"  # detected by content, not by extension
    shutil.copyfile(out, disguised)
    rc, from_kvc, err = cli(capsys, "ask", disguised, *q, *base)  # settings come from the file
    assert rc == 0, err
    a_doc, a_kvc = json.loads(from_doc), json.loads(from_kvc)
    assert a_doc["answers"] == a_kvc["answers"]
    assert all(a["answer"] for a in a_kvc["answers"])
    assert a_kvc["stats"]["budget"] == 40 and a_kvc["stats"]["policy"] == "h2o"
    assert a_kvc["stats"]["compact_since_token"] == 128

    rc, s_doc, _ = cli(capsys, "summarize", env["doc"], "--length", "short", *SETTINGS, *base)
    rc2, s_kvc, _ = cli(capsys, "summarize", out, "--length", "short", *SETTINGS, *base)  # same flags: fine
    assert rc == rc2 == 0
    assert json.loads(s_doc)["summary"] == json.loads(s_kvc)["summary"]


def test_prefill_reports_one_line_and_loads_without_document(env, tmp_path, capsys):
    doc = tmp_path / "gone.txt"
    shutil.copyfile(env["doc"], doc)
    out = tmp_path / "gone.kvc"
    rc, stdout, err = cli(capsys, "prefill", doc, "-o", out, "--model", env["model"], *SETTINGS)
    assert rc == 0, err
    assert stdout == ""
    assert f"wrote {out} (" in err and "40 tokens/head, 2 layers)" in err
    doc.unlink()
    rc, stdout, err = cli(capsys, "ask", out, "what is the castle", "--model", env["model"], "--json", "-q", *GEN)
    assert rc == 0, err
    assert json.loads(stdout)["stats"]["document_tokens"] == 300


def test_output_exists_needs_force(env, kvc, tmp_path, capsys):
    out = _copy(kvc, tmp_path, "exists.kvc")
    before = out.read_bytes()
    args = ["prefill", env["doc"], "-o", out, "--model", env["model"], *SETTINGS, "-q"]
    assert_usage_error(cli(capsys, *args), "already exists", "--force")
    assert out.read_bytes() == before
    rc, _, err = cli(capsys, *args, "--force")
    assert rc == 0, err
    assert kvc_format.read_header(out).meta["document"]["tokens"] == 300


def test_unwritable_output(env, tmp_path, capsys):
    base = [env["doc"], "--model", env["model"], *SETTINGS, "-q"]
    assert_usage_error(cli(capsys, "prefill", *base, "-o", tmp_path / "missing" / "c.kvc"), "does not exist")
    (tmp_path / "plain").write_text("x")
    assert_usage_error(cli(capsys, "prefill", *base, "-o", tmp_path / "plain" / "c.kvc"), "not a directory")
    assert_usage_error(cli(capsys, "prefill", *base, "-o", tmp_path), "is a directory")


def test_permission_denied_while_writing(env, tmp_path, capsys, monkeypatch):
    import tempfile

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", denied)
    out = tmp_path / "c.kvc"
    line = assert_usage_error(
        cli(capsys, "prefill", env["doc"], "-o", out, "--model", env["model"], *SETTINGS, "-q"), "Permission denied"
    )
    assert str(out) in line and not out.exists()


def test_truncated_file(env, kvc, tmp_path, capsys):
    for keep in (kvc.stat().st_size - 100, 200, 5):
        bad = _copy(kvc, tmp_path)
        bad.write_bytes(kvc.read_bytes()[:keep])
        assert_usage_error(cli(capsys, "ask", bad, "q", "--model", env["model"], "-q"), "truncated or corrupted")
        assert_usage_error(cli(capsys, "inspect", bad), "truncated or corrupted")


def test_corrupted_header_and_data(env, kvc, tmp_path, capsys):
    raw = bytearray(kvc.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = raw[8 : 8 + n]
    at = header.index(b'"data_offsets":[') + len(b'"data_offsets":[')
    bad = _copy(kvc, tmp_path, "header.kvc")
    damaged = bytearray(raw)
    damaged[8 + at] = ord("x")  # the JSON no longer parses
    bad.write_bytes(bytes(damaged))
    assert_usage_error(cli(capsys, "ask", bad, "q", "--model", env["model"], "-q"), "truncated or corrupted")
    assert_usage_error(cli(capsys, "inspect", bad), "truncated or corrupted")

    bad = _copy(kvc, tmp_path, "data.kvc")
    damaged = bytearray(raw)
    damaged[8 + n + 17] ^= 0xFF  # a flipped bit in the tensor data: caught by the checksum
    bad.write_bytes(bytes(damaged))
    assert_usage_error(cli(capsys, "ask", bad, "q", "--model", env["model"], "-q"), "truncated or corrupted")

    bad = _copy(kvc, tmp_path, "tail.kvc")
    bad.write_bytes(bytes(raw) + b"\0" * 16)
    assert_usage_error(cli(capsys, "inspect", bad), "truncated or corrupted")


def test_wrong_model(env, kvc, capsys):
    line = assert_usage_error(
        cli(capsys, "ask", kvc, "q", "--model", env["other_model"], "-q"), "was made with model tiny", "--model"
    )
    assert env["model"] in line


def test_cache_from_an_older_policy_state_layout(env, kvc, capsys, monkeypatch):
    """A cache whose per-token policy state differs from this kvtool's (a policy gained a per-token
    constant) is refused with one line, not loaded into the wrong fields."""
    from kvtool.policies.h2o import H2O

    monkeypatch.setattr(H2O, "state_fields", ("acc", "extra"))
    assert_usage_error(
        cli(capsys, "ask", kvc, "q", "--model", env["model"], "-q", *GEN),
        "per-token policy state ['acc']",
        "prefill it again",
    )


def test_wrong_dtype(env, kvc, capsys):
    assert_usage_error(
        cli(capsys, "ask", kvc, "q", "--model", env["model"], "--dtype", "bfloat16", "-q"),
        "prefilled with --dtype float32",
        "drop --dtype",
    )
    rc, _, err = cli(capsys, "ask", kvc, "q", "--model", env["model"], "--dtype", "fp32", "-q", *GEN)
    assert rc == 0, err  # the same dtype spelled differently is fine


def test_load_cache_checks_dtype_and_settings_directly(env, kvc):
    from kvtool.runtime.session import Session
    from kvtool.runtime.settings import Settings

    base = {"model": env["model"], "device": "cpu", "policy": "h2o", "budget": "40", "block_size": 16}
    session = Session(Settings(**base, dtype="bfloat16").validate())
    with pytest.raises(UsageError, match="made in float32, this run uses bfloat16"):
        store.load_cache(kvc, session)
    session = Session(Settings(**{**base, "block_size": 8}).validate())
    with pytest.raises(UsageError, match="block size 16, this run has 8"):
        store.load_cache(kvc, session)
    session = Session(Settings(**base).validate())
    read = store.load_cache(kvc, session)
    assert session.last_read is read and read.document_tokens == 300 and read.prefix_tokens == 2
    assert read.cache.seen == 302 and read.cache.compact and read.cache.compact_since == 128


def test_incompatible_version(env, kvc, tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(kvc), "pt") as f:
        md = dict(f.metadata())
    meta = json.loads(md["kvtool"])
    meta.update(format_version=99, kvtool_version="9.9.0")
    md.update(format_version="99", kvtool=json.dumps(meta))
    bad = tmp_path / "future.kvc"
    save_file(load_file(str(kvc)), str(bad), metadata=md)
    for args in (["ask", bad, "q", "--model", env["model"], "-q"], ["inspect", bad]):
        line = assert_usage_error(
            cli(capsys, *args), "kvtool 9.9.0", "kvc format 99", f"kvc format {kvc_format.READ_FORMAT_VERSION}"
        )
        assert f"this kvtool {kvc_format.__version__}" in line


def test_conflicting_settings_on_ask(env, kvc, capsys):
    base = ["ask", kvc, "q", "--model", env["model"], "-q"]
    assert_usage_error(cli(capsys, *base, "--budget", "64"), "prefilled with --budget 40", "drop --budget")
    assert_usage_error(cli(capsys, *base, "--policy", "keydiff"), "prefilled with --policy h2o")
    assert_usage_error(cli(capsys, *base, "--positions", "absolute"), "prefilled with --positions auto")
    assert_usage_error(cli(capsys, *base, "--block-size", "32"), "prefilled with --block-size 16")
    # the same budget written as bytes: 40 tokens x 2 layers x 2 heads x (K+V) x 8 dims x 4 bytes
    rc, _, err = cli(capsys, *base, "--budget", f"{40 * 2 * 2 * 2 * 8 * 4}B", *GEN)
    assert rc == 0, err


def test_settings_overrides_fills_fixed_settings(kvc):
    header = kvc_format.read_header(kvc)
    got = store.settings_overrides(header, {"model": "m", "temperature": 0.5, "dtype": "auto", "budget": "40"})
    assert got["model"] == "m" and got["temperature"] == 0.5
    assert got["policy"] == "h2o" and got["budget"] == "40" and got["block_size"] == 16
    assert got["positions"] == "auto" and got["dtype"] == "float32" and got["sinks"] == 4 and got["recent"] == 8
    with pytest.raises(UsageError, match="--policy-opt"):
        store.settings_overrides(header, {"policy_options": {"recent_ratio": "0.25"}})


def test_prefill_input_errors(env, kvc, tmp_path, capsys):
    assert_usage_error(
        cli(capsys, "prefill", kvc, "-o", tmp_path / "x.kvc", "--model", env["model"]), "already a .kvc cache"
    )
    assert_usage_error(cli(capsys, "prefill", tmp_path / "nope.txt", "-o", tmp_path / "x.kvc"), "no such file")
    assert_usage_error(cli(capsys, "prefill", env["doc"], "-o", env["doc"], "--force"), "is the input document")
    assert_usage_error(cli(capsys, "prefill", env["doc"]), "--output")
    assert_usage_error(cli(capsys, "inspect", env["doc"]), "not a kvtool cache")
    assert not (tmp_path / "x.kvc").exists()
