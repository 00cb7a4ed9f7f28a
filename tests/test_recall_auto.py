"""Answers by default: ``--recall auto`` (on for ``ask`` when the archive fits the disk, off for
``summarize``), the repeat guard that replaced the repetition penalty, and what they report."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from typer.testing import CliRunner

from kvtool.cli.app import app
from kvtool.core import recall
from kvtool.core.events import Note
from kvtool.core.sampling import Chooser
from kvtool.documents import open_document
from kvtool.runtime import archive_disk
from kvtool.runtime.budget import DEFAULT_RECALL, parse_recall
from kvtool.runtime.detokenize import letter_tokens
from kvtool.runtime.settings import Settings, resolve_settings
from tests.helpers import tiny_checkpoint

runner = CliRunner()
DOC = "The harbour was quiet that morning. " * 90 + "The secret number is 60494. " + "Gulls circled the mast. " * 30


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tiny_checkpoint(tmp_path_factory.mktemp("auto") / "tiny"))


@pytest.fixture
def doc(tmp_path):
    p = tmp_path / "doc.txt"
    p.write_text(DOC, encoding="utf-8")
    return str(p)


def session_for(model_dir: str, notes: list[str], **overrides):
    from kvtool.runtime.session import Session

    flags = {"model": model_dir, "policy": "h2o", "budget": "160", "block_size": 16, "max_new_tokens": 3, **overrides}
    return Session(
        resolve_settings(None, flags), listener=lambda e: notes.append(e.message) if isinstance(e, Note) else None
    )


# -- the repeat guard ----------------------------------------------------------------------------------


def repeats(seq: list[int], n: int) -> bool:
    """Brute force: does ``seq`` hold some n-gram twice?"""
    grams = [tuple(seq[i : i + n]) for i in range(len(seq) - n + 1)]
    return len(grams) != len(set(grams))


def banned(chooser: Chooser, seq: list[int], vocab: int) -> set[int]:
    """The tokens the chooser's guard rules out after the answer ``seq`` (−inf in its guarded logits)."""
    chooser.ids[: len(seq)] = torch.tensor(seq, dtype=torch.long)
    logits = chooser.guarded(torch.zeros(vocab), len(seq))
    return set(torch.nonzero(torch.isinf(logits)).flatten().tolist())


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_guard_bans_exactly_the_tokens_that_repeat_an_ngram(n):
    rng = random.Random(n)
    seq: list[int] = []
    chooser = Chooser(61, "cpu", no_repeat_ngram=n)
    for _ in range(60):
        ruled_out = banned(chooser, seq, 6)
        for tok in range(6):  # brute force over a small vocabulary
            assert (tok in ruled_out) == (repeats(seq + [tok], n) and not repeats(seq, n)), (seq, tok)
        allowed = [t for t in range(6) if t not in ruled_out]
        if not allowed:
            break
        seq.append(rng.choice(allowed))
    assert not repeats(seq, n)


def test_guard_lets_numbers_repeat_but_stops_word_loops():
    """``letters`` says which tokens spell a letter: digit n-grams (``,000``) may repeat, words may not."""
    letters = torch.ones(10, dtype=torch.bool)
    letters[[1, 2, 3]] = False  # digits
    assert banned(Chooser(4, "cpu", no_repeat_ngram=2, letters=letters), [1, 2, 1], 10) == set()  # a number again
    assert banned(Chooser(4, "cpu", no_repeat_ngram=2, letters=letters), [7, 8, 7], 10) == {8}  # words: banned
    assert banned(Chooser(4, "cpu", no_repeat_ngram=2, letters=letters), [7, 2, 7], 10) == {2}  # "x2" has a letter


def test_greedy_with_the_guard_equals_argmax_until_a_repeat_then_takes_the_next_best():
    chooser = Chooser(6, "cpu", no_repeat_ngram=2)
    for step in range(6):
        logits = torch.full((10,), -5.0)
        logits[[4, 5][step % 2]] = 3.0  # the model wants to loop "4 5 4 5 ..."
        logits[9] = 1.0  # the runner-up
        chooser(logits, step)
    out = chooser.ids.tolist()
    assert out[:3] == [4, 5, 4]
    assert not repeats(out, 2)
    assert 9 in out


def test_the_default_generation_no_longer_penalises_digits():
    """A 5-digit answer with a repeated digit: the old penalty (1.1) turned the logit margin of the
    second 4 of 60494 into a loss; the default (guard, no penalty) keeps it."""
    s = Settings()
    assert s.repetition_penalty == 1.0 and s.no_repeat_ngram == 4
    logits = torch.zeros(10)
    logits[4], logits[7] = 2.0, 1.9  # "4" (again) is right by a small margin
    chosen = []
    for penalty, n in ((1.1, 0), (s.repetition_penalty, s.no_repeat_ngram)):
        chooser = Chooser(5, "cpu", repetition_penalty=penalty, no_repeat_ngram=n)
        chooser.ids[:4] = torch.tensor([6, 0, 4, 9])
        chosen.append(int(chooser(logits, 4)))
    assert chosen == [7, 4]


def test_letter_tokens_reads_each_token_once(model_dir):
    """The guard's table: a token spells a letter when its own text has one (or is a piece of a character)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    table = letter_tokens(tok, len(tok) + 3)
    assert table.shape == (len(tok) + 3,) and not table[len(tok) :].any()
    for i in range(len(tok)):
        text = tok.decode([i], skip_special_tokens=True)
        assert bool(table[i]) == any(c.isalpha() or c == "\ufffd" for c in text)
    assert table.any() and not table.all()


# -- settings --------------------------------------------------------------------------------------------


def test_recall_defaults_to_auto_with_an_int8_archive():
    s = Settings()
    assert s.recall == "auto" and s.archive_dtype == "int8"
    assert parse_recall("auto") == DEFAULT_RECALL
    assert resolve_settings(None, {"recall": "AUTO"}).recall == "auto"
    assert resolve_settings(None, {"recall": "off"}).recall == "off"
    assert resolve_settings(None, {"no_repeat_ngram": 0}).no_repeat_ngram == 0


# -- the session's choice --------------------------------------------------------------------------------


def test_ask_recalls_by_default_and_says_so(model_dir, doc, tmp_path, monkeypatch):
    monkeypatch.setenv("KVTOOL_ARCHIVE_DIR", str(tmp_path))
    notes: list[str] = []
    s = session_for(model_dir, notes)
    with s.read(open_document(doc)) as read:
        assert recall.archived_tokens(read.cache) > 0
        s.ask(read, "What is the secret number?")
        stats = s.stats(read, 0)
    assert s.recall_mode == "auto" and stats["recall_mode"] == "auto"
    assert stats["recall_tokens"] == DEFAULT_RECALL and stats["archive_dtype"] == "int8"
    assert "(default)" in stats["recall_note"] and str(tmp_path) in stats["recall_note"]
    assert any(n == stats["recall_note"] for n in notes)
    assert any(n.startswith("recall: ") and "pages" in n for n in notes)  # it did recall


def test_auto_recall_is_off_when_the_archive_would_not_fit(model_dir, doc, tmp_path, monkeypatch):
    monkeypatch.setenv("KVTOOL_ARCHIVE_DIR", str(tmp_path))
    monkeypatch.setattr(archive_disk, "disk", lambda d: archive_disk.Disk(free=(1 << 30) + 4096, total=1 << 34))
    notes: list[str] = []
    s = session_for(model_dir, notes)
    before = len(os.listdir("/proc/self/fd"))
    with s.read(open_document(doc)) as read:
        assert recall.archives(read.cache) == []  # closed before the first block
        assert len(os.listdir("/proc/self/fd")) <= before
        stats = s.stats(read, 0)
    assert stats["recall_tokens"] == 0
    line = stats["recall_note"]
    assert line.startswith("recall off: its archive (~") and "does not fit" in line and "KVTOOL_ARCHIVE_DIR" in line
    assert line in notes


def test_an_explicit_recall_ignores_the_prediction(model_dir, doc, tmp_path, monkeypatch):
    monkeypatch.setenv("KVTOOL_ARCHIVE_DIR", str(tmp_path))
    monkeypatch.setattr(archive_disk, "disk", lambda d: archive_disk.Disk(free=0, total=1 << 34))
    s = session_for(model_dir, [], recall="64")
    with s.read(open_document(doc)) as read:
        assert recall.archived_tokens(read.cache) > 0
    assert s.recall_mode == "set"


def test_a_disk_that_runs_short_while_reading_drops_the_archive(model_dir, doc, tmp_path, monkeypatch):
    """A length unknown beforehand (stdin) is watched: once the free space falls under the reserve
    the archive is closed, reading goes on, and the answer goes without recall."""
    monkeypatch.setenv("KVTOOL_ARCHIVE_DIR", str(tmp_path))
    monkeypatch.setattr(archive_disk, "WATCH_STEP", 1)
    monkeypatch.setattr(archive_disk, "disk", lambda d: archive_disk.Disk(free=1 << 20, total=1 << 34))
    monkeypatch.setattr("kvtool.runtime.session.estimate_tokens", lambda doc: None)
    notes: list[str] = []
    s = session_for(model_dir, notes)
    with s.read(open_document(doc)) as read:
        assert recall.archives(read.cache) == []
        ans = s.ask(read, "What is the secret number?")
        stats = s.stats(read, 0)
    assert ans.tokens > 0
    assert stats["recall_tokens"] == 0 and stats["recall_note"].startswith("recall off from token ")
    assert "length unknown" in notes[0] or any("length unknown" in n for n in notes)


def test_disk_watch_looks_again_only_after_each_step(monkeypatch):
    calls = []
    monkeypatch.setattr(archive_disk, "disk", lambda d: calls.append(d) or archive_disk.Disk(free=0, total=1 << 34))
    w = archive_disk.DiskWatch("/x")
    assert w.short(archive_disk.WATCH_STEP - 1) is None and not calls
    assert "down to" in w.short(archive_disk.WATCH_STEP)
    assert w.short(archive_disk.WATCH_STEP + 1) is None and len(calls) == 1


def test_fits_keeps_a_reserve_and_a_margin(monkeypatch):
    monkeypatch.setattr(archive_disk, "disk", lambda d: archive_disk.Disk(free=(1 << 30) + 1000, total=1 << 34))
    assert archive_disk.fits(800, "/x")[0]  # 800 × 1.25 = 1000 bytes above the 1 GiB reserve
    assert not archive_disk.fits(801, "/x")[0]
    monkeypatch.setattr(archive_disk, "disk", lambda d: None)
    assert not archive_disk.fits(1, "/x")[0]


# -- the command line ----------------------------------------------------------------------------------------


def cli(model_dir, *args, answer: bool = True):
    return runner.invoke(
        app,
        [
            *map(str, args),
            "--model",
            model_dir,
            "--budget",
            "160",
            "--block-size",
            "16",
            *(["--max-new-tokens", "3", "--json"] if answer else []),
            "--quiet",
        ],
    )


def test_ask_json_says_recall_is_the_default_and_summarize_keeps_it_off(model_dir, doc, tmp_path, monkeypatch):
    monkeypatch.setenv("KVTOOL_ARCHIVE_DIR", str(tmp_path))
    r = cli(model_dir, "ask", doc, "What is the secret number?")
    assert r.exit_code == 0, r.output
    stats = json.loads(r.stdout)["stats"]
    assert stats["recall_mode"] == "auto" and stats["recall_tokens"] == DEFAULT_RECALL
    r = cli(model_dir, "summarize", doc)
    assert r.exit_code == 0, r.output
    stats = json.loads(r.stdout)["stats"]
    assert stats["recall_tokens"] == 0 and stats["archived_tokens"] == 0
    r = cli(model_dir, "summarize", doc, "--recall", "64")
    assert json.loads(r.stdout)["stats"]["recall_tokens"] == 64
    r = cli(model_dir, "ask", doc, "q", "--recall", "0")
    stats = json.loads(r.stdout)["stats"]
    assert stats["recall_tokens"] == 0 and stats["recall_mode"] == "off"


def test_a_kvc_without_an_archive_answers_without_recall_quietly(model_dir, doc, tmp_path, monkeypatch):
    monkeypatch.setenv("KVTOOL_ARCHIVE_DIR", str(tmp_path))
    out = tmp_path / "d.kvc"
    r = cli(model_dir, "prefill", doc, "-o", out, "--recall", "off", answer=False)
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["ask", str(out), "q", "--model", model_dir, "--max-new-tokens", "2", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["stats"]["recall_tokens"] == 0
    assert "without recall" not in r.stderr


def test_profile_shows_the_archive_on_disk_for_a_document_length(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KVTOOL_ARCHIVE_DIR", str(tmp_path))
    r = runner.invoke(app, ["profile", "--model", model_dir, "--budget", "160", "--doc-tokens", "10000", "--json"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    per = plan["archive_bytes_per_evicted_token"]
    assert plan["archive_doc_tokens"] == 10000
    assert plan["archive_bytes"] == (10000 - 160) * (per["file"] + per["index"])
    assert plan["archive_verdict"].startswith("recall on by default: archive ~")


def test_an_archive_that_cannot_be_created_turns_auto_off_not_the_run(model_dir, doc, tmp_path, monkeypatch):
    """``auto`` answers without recall when the archive directory is unusable; an explicit ``--recall``
    still stops with one line (exit 2)."""
    monkeypatch.setenv("KVTOOL_ARCHIVE_DIR", str(tmp_path / "missing"))
    r = cli(model_dir, "ask", doc, "q")
    assert r.exit_code == 0, r.output
    stats = json.loads(r.stdout)["stats"]
    assert stats["recall_tokens"] == 0
    assert stats["recall_note"].startswith("recall off: cannot create the recall archive in ")
    r = cli(model_dir, "ask", doc, "q", "--recall", "64")
    assert r.exit_code == 2 and "cannot create the recall archive" in r.stderr


def test_summarize_of_a_kvc_with_an_archive_keeps_recall_off(model_dir, doc, tmp_path, monkeypatch):
    monkeypatch.setenv("KVTOOL_ARCHIVE_DIR", str(tmp_path))
    out = tmp_path / "d.kvc"
    assert cli(model_dir, "prefill", doc, "-o", out, answer=False).exit_code == 0
    assert list(tmp_path.glob("d.kvc.*.archive"))  # prefill archived: recall is ask's default
    ask = runner.invoke(app, ["ask", str(out), "q", "--model", model_dir, "--max-new-tokens", "2", "--json"])
    assert json.loads(ask.stdout)["stats"]["archived_tokens"] > 0  # a short document: recall 256 > its tokens
    summ = runner.invoke(app, ["summarize", str(out), "--model", model_dir, "--max-new-tokens", "2", "--json"])
    assert summ.exit_code == 0, summ.output
    assert json.loads(summ.stdout)["stats"]["recall_tokens"] == 0
