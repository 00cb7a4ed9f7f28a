"""Hostile inputs and faults: one line on stderr, the documented exit code, nothing left behind.

The table drives ``kvtool.cli.app.main`` in-process on a tiny random checkpoint; each case checks the exit
code, that stderr is exactly one ``kvtool: error:`` line containing the expected words, that no traceback
appears and that the working directory holds no new file. Engine-level tests below check the guarantees
with oracles: the masking reference during decode, the pinned question, each policy's own window.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvtool.cli.app import main
from kvtool.core import storage as cache_mod
from kvtool.errors import UsageError, printable
from kvtool.kvc import format as kvc_format
from kvtool.kvc import write as kvc_write
from kvtool.runtime import store
from tests.helpers import VOCAB, make_engine, masking_reference_logits, record_visibility, tiny_checkpoint, tiny_llama

DOC = " ".join(["the river ran past the old castle and the king slept"] * 30) + "\n"
READ = ["--budget", "64", "--block-size", "16", "--device", "cpu", "-q"]
FAST = [*READ, "--max-new-tokens", "4"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    model = tiny_checkpoint(root / "tiny")
    doc = root / "doc.txt"
    doc.write_text(DOC, encoding="utf-8")
    kvc = root / "doc.kvc"
    assert main(["prefill", str(doc), "-o", str(kvc), "--model", str(model), "--policy", "h2o", *READ]) == 0
    return SimpleNamespace(root=root, model=str(model), doc=doc, kvc=kvc)


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTOOL_HOME", str(tmp_path / "home"))


def _rewrite_meta(src: Path, dst: Path, edit, rehash: bool = True) -> Path:
    """Copy a .kvc with its kvtool metadata edited (and its metadata checksum recomputed unless told)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(src), "pt") as f:
        md = dict(f.metadata())
    meta = json.loads(md["kvtool"])
    edit(meta)
    if rehash:
        meta["meta_sha256"] = kvc_format.meta_digest(meta)
    md["kvtool"] = json.dumps(meta)
    save_file(load_file(str(src)), str(dst), metadata=md)
    return dst


def _raw_header(src: Path, dst: Path, header: bytes) -> Path:
    """A file whose JSON header is ``header`` (a safetensors-like frame around arbitrary bytes)."""
    dst.write_bytes(len(header).to_bytes(8, "little") + header)
    return dst


def _nested(src: Path, dst: Path) -> Path:
    return _raw_header(
        src, dst, b'{"__metadata__":{"format":"kvtool-kvc","x":' + b"[" * 200_000 + b"]" * 200_000 + b"}}"
    )


def _set(section: str, key: str | None, value):
    def edit(meta):
        if key is None:
            meta[section] = value
        else:
            meta[section][key] = value

    return edit


def _layout_length(meta):
    meta["layout"][0][0]["length"] += 1


def _pickle_dir(root: Path) -> Path:
    d = root / "pickled"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    return d


def _garbage_config(root: Path) -> Path:
    d = root / "garbage"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text("{this is not json")
    return d


def _empty_questions(root: Path) -> Path:
    p = root / "empty-questions.txt"
    p.write_text("\n  \n")
    return p


def _bad_profile(root: Path) -> Path:
    p = root / "bad.yaml"
    p.write_text("budgett: 4k\nblok_size: 16\n")
    return p


# (case id, argv builder (env, tmp) -> list, words the error line must contain); exit code 2 in every case
CASES = [
    ("missing file", lambda e, t: ["ask", t / "missing.txt", "q"], ["no such file"]),
    ("spec +caote", lambda e, t: ["ask", e.doc, "q", "--model", e.model, "--policy", "+caote"], ["empty component"]),
    (
        "spec snapkv++caote",
        lambda e, t: ["ask", e.doc, "q", "--model", e.model, "--policy", "snapkv++caote"],
        ["empty component"],
    ),
    (
        "spec duplicate modifier",
        lambda e, t: ["ask", e.doc, "q", "--model", e.model, "--policy", "tova+caote+caote"],
        ["'caote' appears twice"],
    ),
    (
        "spec two bases",
        lambda e, t: ["ask", e.doc, "q", "--model", e.model, "--policy", "snapkv+snapkv"],
        ["one base per policy"],
    ),
    ("pickle checkpoint", lambda e, t: ["ask", e.doc, "q", "--model", _pickle_dir(t)], ["pytorch_model.bin", "pickle"]),
    (
        "garbage config.json",
        lambda e, t: ["ask", e.doc, "q", "--model", _garbage_config(t)],
        ["config.json is not a valid JSON config"],
    ),
    (
        "empty questions file",
        lambda e, t: ["ask", e.doc, "--questions-file", _empty_questions(t), "--model", e.model],
        ["empty-questions.txt has no questions"],
    ),
    (
        "profile unknown keys",
        lambda e, t: ["ask", e.doc, "q", "--profile", _bad_profile(t), "--model", e.model],
        ["'budgett'", "'blok_size'"],
    ),
    (
        "kvc nested header (ask)",
        lambda e, t: ["ask", _nested(e.kvc, t / "n.kvc"), "q", "--model", e.model],
        ["corrupted"],
    ),
    ("kvc nested header (inspect)", lambda e, t: ["inspect", _nested(e.kvc, t / "n.kvc")], ["corrupted"]),
    (
        "kvc layout 5 (inspect)",
        lambda e, t: ["inspect", _rewrite_meta(e.kvc, t / "l.kvc", _set("layout", None, 5))],
        ["corrupted", "layout"],
    ),
    (
        "kvc settings 'x' (inspect)",
        lambda e, t: ["inspect", _rewrite_meta(e.kvc, t / "s.kvc", _set("settings", None, "x"))],
        ["corrupted"],
    ),
    (
        "kvc settings 'x' (ask)",
        lambda e, t: ["ask", _rewrite_meta(e.kvc, t / "s.kvc", _set("settings", None, "x")), "q", "--model", e.model],
        ["corrupted"],
    ),
    (
        "kvc budget edited, checksum stale",
        lambda e, t: [
            "ask",
            _rewrite_meta(e.kvc, t / "b.kvc", _set("settings", "budget_tokens", 3_000_000), rehash=False),
            "q",
            "--model",
            e.model,
        ],
        ["metadata does not match"],
    ),
    (
        "kvc absurd budget",
        lambda e, t: ["inspect", _rewrite_meta(e.kvc, t / "a.kvc", _set("settings", "block_size", 10**20))],
        ["corrupted", "settings.block_size"],
    ),
    (
        "kvc layout vs tensor shapes",
        lambda e, t: ["inspect", _rewrite_meta(e.kvc, t / "m.kvc", _layout_length)],
        ["corrupted", "tensors are"],
    ),
    (
        "kvc seen vs document length",
        lambda e, t: ["inspect", _rewrite_meta(e.kvc, t / "d.kvc", _set("document", "tokens", 5))],
        ["corrupted", "seen"],
    ),
    (
        "question cannot be pinned",
        lambda e, t: [
            "ask",
            e.doc,
            " ".join(["the king"] * 20),
            "--model",
            e.model,
            "--policy",
            "h2o",
            "--budget",
            "40",
            "--max-new-tokens",
            "30",
            "-q",
        ],
        ["does not fit the budget", "raise --budget to at least"],
    ),
]


@pytest.mark.parametrize(("case", "argv", "needles"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_nothing_left(env, tmp_path, capsys, monkeypatch, case, argv, needles):
    args = [str(a) for a in argv(env, tmp_path)]
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    before = set(os.listdir(tmp_path))
    rc = main(args)
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("kvtool: error: ") and "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert set(os.listdir(tmp_path)) == before and not os.listdir(work)  # no file left behind
    assert not out


def test_embedded_model_cache_says_drop_model(env, tmp_path):
    from kvtool.runtime.model import EMBEDDED_NAME

    path = _rewrite_meta(env.kvc, tmp_path / "e.kvc", lambda m: m["model"].update(name=EMBEDDED_NAME))
    session = SimpleNamespace(loaded=SimpleNamespace(identity="other", name="tiny", source=env.model))
    with pytest.raises(UsageError, match="drop --model"):
        store.load_cache(path, session)


# -- printing user-supplied strings literally ---------------------------------------------------------------------
def test_markup_and_escapes_in_names_are_printed_literally(env, tmp_path, capsys):
    (tmp_path / "notes[").mkdir()
    doc = tmp_path / "notes[" / "v2] [bold].txt"
    doc.write_text(DOC, encoding="utf-8")
    kvc = tmp_path / "c.kvc"
    assert main(["prefill", str(doc), "-o", str(kvc), "--model", env.model, *READ]) == 0
    capsys.readouterr()
    assert main(["inspect", str(kvc)]) == 0
    out = capsys.readouterr().out
    flat = "".join(out.replace("│", "").split())  # the table may fold a long path over lines
    assert "notes[/v2][bold].txt" in flat

    evil = _rewrite_meta(kvc, tmp_path / "evil.kvc", lambda m: m["document"].update(name="x\x1b]0;pwned\x07\x1b[31m"))
    assert main(["inspect", str(evil)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\\x1b]0;pwned" in out

    rc = main(["ask", str(tmp_path / "no\x1b[2Jsuch\n.txt"), "q"])
    err = capsys.readouterr().err
    assert rc == 2 and "\x1b" not in err and len(err.strip().splitlines()) == 1


def test_printable_escapes_controls_only():
    assert printable("a\x1b[31mb\x9bc\td\ne") == "a\\x1b[31mb\\x9bc\td\ne"
    assert printable("a\tb\nc", one_line=True) == "a\\tb\\nc"
    assert printable("[bold]ü") == "[bold]ü"


# -- signals, FIFOs, fast failures ---------------------------------------------------------------------------------
def test_sigterm_during_write_cleans_up_and_exits_143(env, tmp_path, capsys, monkeypatch):
    real_fsync = os.fsync

    def fsync_then_term(fd):
        real_fsync(fd)
        os.kill(os.getpid(), signal.SIGTERM)  # arrives during the final write, after the temp file exists

    monkeypatch.setattr(kvc_write.os, "fsync", fsync_then_term)
    rc = main(["prefill", str(env.doc), "-o", str(tmp_path / "out.kvc"), "--model", env.model, *READ])
    err = capsys.readouterr().err
    assert rc == 143
    assert err.strip().splitlines() == ["kvtool: terminated (SIGTERM)"]
    assert os.listdir(tmp_path) == []  # neither the temp file nor a partial output
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is restored after main()


def test_fifo_says_it_waits_and_reads_like_stdin(env, tmp_path, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)

    def writer():
        with open(fifo, "w", encoding="utf-8") as f:
            f.write(DOC)

    t = threading.Thread(target=writer)
    t.start()
    rc = main(
        ["ask", str(fifo), "q", "--model", env.model, "--device", "cpu", "--budget", "200", "--max-new-tokens", "4"]
    )
    t.join(timeout=10)
    err = capsys.readouterr().err
    assert rc == 0, err
    assert f"waiting for input on {fifo}" in err


def test_errors_that_need_no_model_do_not_import_torch(tmp_path):
    code = (
        "import sys; from kvtool.cli.app import main; rc = main(['ask', 'missing.txt', 'q']); "
        "print(rc, 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.stdout.split() == ["2", "False", "False"], r.stdout + r.stderr
    assert r.stderr.strip() == "kvtool: error: no such file: missing.txt"


# -- huge budgets and blocks ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags", [["--budget", "999999999999"], ["--budget", "1m"], ["--block-size", "999999999999"]])
def test_huge_budget_or_block_allocates_what_the_document_needs(env, capsys, flags):
    rc = main(
        ["ask", str(env.doc), "q", "--model", env.model, "--device", "cpu", "--max-new-tokens", "4", "-q", *flags]
    )
    assert rc == 0, capsys.readouterr().err


def test_cache_buffers_start_small_and_refuse_growth_beyond_free_memory(monkeypatch):
    model = tiny_llama()
    engine = make_engine(model, "tova", 10**12, block_size=16)
    cache = engine.new_cache()
    for g in cache.groups():
        assert g.slots <= cache_mod.LAZY_START_SLOTS and g.max_slots == 10**12 + 16
    ids = torch.randint(0, VOCAB, (48,), generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(cache_mod, "LAZY_START_SLOTS", 8)
    cache = engine.new_cache()
    engine.feed(cache, [ids], progress=False)  # grows 8 -> 16 -> 32 -> 64 slots as tokens arrive
    assert all(g.length == 48 and g.slots == 64 for g in cache.groups())
    monkeypatch.setattr(cache_mod, "free_device_bytes", lambda device: 100)
    with pytest.raises(UsageError, match="GiB free; lower the budget"):
        engine.feed(cache, [ids], progress=False)


# -- the pinned question -------------------------------------------------------------------------------------------
def test_pin_refuses_a_question_that_cannot_fit_with_the_windows():
    model = tiny_llama()
    engine = make_engine(model, "h2o", 40, block_size=8, sinks=4, recent=8)  # H2O keeps a 20-token window
    cache = engine.new_cache()
    engine.feed(cache, [torch.randint(0, VOCAB, (100,), generator=torch.Generator().manual_seed(2))], progress=False)
    with pytest.raises(UsageError, match="at least 44"):
        engine.pin(cache, 20, 30)  # 4 sinks + 20 question + 20 answer tokens in the window > 40
    engine.pin(cache, 16, 30)  # 4 + 16 + 20 = 40: fits


@pytest.mark.parametrize("policy", ["tova", "h2o", "snapkv", "scissorhands", "keydiff"])
def test_question_is_never_evicted_while_a_long_answer_is_generated(policy):
    model = tiny_llama()
    opts = {"window": "8"} if policy == "snapkv" else None
    engine = make_engine(model, policy, 48, block_size=8, sinks=4, recent=8, options=opts)
    cache = engine.new_cache()
    engine.feed(cache, [torch.randint(0, VOCAB, (100,), generator=torch.Generator().manual_seed(3))], progress=False)
    question = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(4))
    start = cache.seen
    engine.pin(cache, question.numel(), 40)
    logits = engine.feed(cache, [question], progress=False)
    engine.generate(cache, logits, 40, eos_ids=set())  # the answer outgrows every window: older answer is evictable
    for g in cache.groups():
        assert g.length <= g.capacity + 8  # decoding evicts lazily: at most one block of answer above capacity
        for h in range(g.num_heads):
            assert set(range(start, start + 12)) <= set(g.positions[h, : g.length].tolist())


# -- each policy's own protected window ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("policy", "options", "window"),
    [
        ("h2o", None, 20),  # half of the 40-token budget
        ("snapkv", {"window": "12"}, 12),  # the observation window
        ("scissorhands", {"local": "10"}, 10),  # the local window
    ],
)
def test_each_policy_keeps_its_own_window(policy, options, window):
    model = tiny_llama()
    engine = make_engine(model, policy, 40, block_size=4, sinks=0, recent=0, options=options)
    cache = engine.new_cache()
    ids = torch.randint(0, VOCAB, (160,), generator=torch.Generator().manual_seed(5))

    def check(c):
        for g in c.groups():
            for h in range(g.num_heads):
                assert set(range(max(0, c.seen - window), c.seen)) <= set(g.positions[h, : g.length].tolist())

    for step_logits in engine.steps(cache, ids):
        check(cache)
        tok = step_logits[-1:].argmax(-1)
    assert cache.counters.evicted_tokens > 0
    for _ in range(12):  # decoding: blocks of one token, the window still holds
        logits = engine.step(cache, tok, 1)
        tok = logits[-1:].argmax(-1)
        check(cache)


# -- decoding after eviction equals the dense masking reference -----------------------------------------------------
@pytest.mark.parametrize("policy", ["h2o", "tova", "snapkv", "keydiff", "tova+caote"])
def test_decode_after_eviction_equals_masking_reference(monkeypatch, policy):
    model = tiny_llama()
    visibility = record_visibility(monkeypatch)
    engine = make_engine(model, policy, 32, block_size=8, options={"window": "8"} if "snapkv" in policy else None)
    cache = engine.new_cache()
    ids = torch.randint(0, VOCAB, (80,), generator=torch.Generator().manual_seed(6))
    *_, logits = engine.steps(cache, ids)
    got, seq = [], ids.tolist()
    tok = int(logits[-1].argmax())
    for _ in range(16):
        seq.append(tok)
        step = engine.step(cache, torch.tensor([tok]), 1)
        got.append(step[-1])
        tok = int(step[-1].argmax())
    assert cache.counters.evicted_tokens > 0
    ref = masking_reference_logits(model, torch.tensor(seq), visibility)
    torch.testing.assert_close(torch.stack(got), ref[len(ids) :], atol=2e-5, rtol=1e-4)


# -- small correctness fixes (case 14) ------------------------------------------------------------------------------
def test_compensation_sums_the_dropped_tokens_without_cancellation():
    from kvtool.core.cache import HeadGroup
    from kvtool.core.contract import GroupSpec, PolicyEnv
    from kvtool.policies import build_policy

    env = PolicyEnv(num_layers=1, num_kv_heads=2, num_attention_heads=2, head_dim=4, budget=62)
    g = HeadGroup(
        GroupSpec(heads=[0, 1], capacity=62, policy=build_policy("sink", {}, env), compensation=True),
        num_kv_heads=2,
        q_per_kv=1,
        head_dim=4,
        block_size=64,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    gen = torch.Generator().manual_seed(7)
    keys = 1e6 + torch.rand(1, 2, 64, 4, generator=gen) * 100  # large common offset: "all − kept" cancels
    values = -1e6 + torch.rand(1, 2, 64, 4, generator=gen) * 100
    g.append(keys, values, torch.arange(64).expand(2, 64))
    keep = torch.stack([torch.cat([torch.arange(10), torch.arange(12, 64)]), torch.arange(2, 64)])  # drop 2 each
    g.gather(keep)
    drop = [sorted(set(range(64)) - set(k.tolist())) for k in keep]
    want_k = torch.stack([keys[0, h, drop[h]].double().sum(0) for h in range(2)])
    want_v = torch.stack([values[0, h, drop[h]].double().sum(0) for h in range(2)])
    # two float32 values near 1e6 sum to within half an ulp of 2e6 (0.125); sums of all 64 (6.4e7, ulp 4)
    # minus the kept 62 would be off by several units
    torch.testing.assert_close(g.comp_key_sum.double(), want_k, rtol=0, atol=0.13)
    torch.testing.assert_close(g.comp_value_sum.double(), want_v, rtol=0, atol=0.13)
    assert g.comp_count == 2  # per head


def test_caote_joint_error_is_kept_per_layer():
    model = tiny_llama()
    engine = make_engine(model, "tova+caote", 24, block_size=8, options={"caote.greedy": "true"})
    cache = engine.new_cache()
    engine.feed(cache, [torch.randint(0, VOCAB, (64,), generator=torch.Generator().manual_seed(8))], progress=False)
    errors = engine.policy.last_joint_error
    assert sorted(errors) == list(range(model.config.num_hidden_layers))
    assert all(e.shape == (model.config.num_key_value_heads,) for e in errors.values())


@pytest.mark.parametrize("value", [5, "x", [], None, {}, -1, 10**30, True])
def test_any_metadata_value_is_corrupted_or_fine_never_an_internal_error(env, tmp_path, capsys, value):
    """A sweep: every metadata key (top level and one level down) set to a hostile value, then inspected."""
    meta = json.loads(__import__("safetensors").safe_open(str(env.kvc), "pt").metadata()["kvtool"])
    paths = [(k,) for k in meta] + [(k, kk) for k, v in meta.items() if isinstance(v, dict) for kk in v]
    for path in paths:

        def edit(m, path=path):
            d = m
            for key in path[:-1]:
                d = d[key]
            d[path[-1]] = value

        f = _rewrite_meta(env.kvc, tmp_path / "z.kvc", edit)
        rc = main(["inspect", str(f)])
        err = capsys.readouterr().err
        assert rc in (0, 2) and "internal error" not in err and len(err.strip().splitlines()) <= 1, (path, err)
