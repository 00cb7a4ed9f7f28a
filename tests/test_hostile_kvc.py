"""Hostile and unlucky ``.kvc`` files: bombs, names that escape, races, crashes, full disks, lost settings.

Files are edited at the byte level (the safetensors frame and the metadata JSON, its checksum recomputed
where a test says so), so each test reads the file as an attacker or a crash would leave it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import shutil
import threading
import time
import tracemalloc
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvtool.cli.app import main
from tests.test_store import WORDS, _checkpoint

KV = ["--policy", "h2o", "--budget", "40", "--block-size", "16", "--device", "cpu"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile_kvc")
    model = _checkpoint(root / "tiny")
    docs = []
    for seed in (3, 4):
        rng = random.Random(seed)
        doc = root / f"doc{seed}.txt"
        doc.write_text(" ".join(rng.choice(WORDS[20:]) for _ in range(300)) + "\n", encoding="utf-8")
        docs.append(doc)
    kvc = root / "r.kvc"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVTOOL_HOME", str(root / "home"))
        mp.setenv("KVTOOL_ARCHIVE_DIR", str(root))
        assert main(["prefill", str(docs[0]), "-o", str(kvc), "--model", str(model), *KV, "--recall", "64", "-q"]) == 0
    return SimpleNamespace(root=root, model=str(model), docs=docs, kvc=kvc)


@pytest.fixture(autouse=True)
def _dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTOOL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KVTOOL_ARCHIVE_DIR", str(tmp_path))


def cli(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


# -- byte-level access to a .kvc ------------------------------------------------------------------------------------
def read_frame(path: Path) -> tuple[dict, dict, bytes]:
    """(header JSON, kvtool metadata, tensor data) of a file, without kvtool."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    return header, json.loads(header["__metadata__"]["kvtool"]), raw[8 + n :]


def meta_sha(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=True).encode()).hexdigest()


def rewrite(src: Path, dst: Path, edit, rehash: bool = True) -> Path:
    """A copy of ``src`` whose metadata ``edit`` changed (its checksum recomputed unless ``rehash`` is False)."""
    header, meta, data = read_frame(src)
    edit(meta)
    if rehash:
        meta["meta_sha256"] = meta_sha(meta)
    header["__metadata__"]["kvtool"] = json.dumps(meta, sort_keys=True)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    dst.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return dst


def copy_pair(env, tmp_path: Path, name: str = "c.kvc") -> tuple[Path, Path]:
    """The shared cache and its archive copied into ``tmp_path`` (the archive keeps its recorded name)."""
    _, meta, _ = read_frame(env.kvc)
    arch = meta["archive"]["file"]
    shutil.copyfile(env.root / arch, tmp_path / arch)
    dst = tmp_path / name
    shutil.copyfile(env.kvc, dst)
    return dst, tmp_path / arch


def ask(env, capsys, kvc: Path, *extra) -> tuple[int, dict | None, str]:
    rc, out, err = cli(
        capsys, "ask", kvc, "what is the castle", "--model", env.model, "--max-new-tokens", "4", "--json", *extra
    )
    return rc, (json.loads(out) if rc == 0 and out.strip() else None), err


def one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("kvtool: error")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# -- a. a zlib bomb in the source map ------------------------------------------------------------------------------
def test_source_map_bomb_is_refused_without_inflating_it(env, tmp_path, capsys):
    from kvtool.runtime.citations import SourceMap

    bomb = base64.b64encode(zlib.compress(b"\0" * (64 << 20), 9)).decode()  # 64 MiB of zeros in ~64 KB

    def plant(meta):
        meta["document"]["source_map"]["positions"] = bomb

    _, meta, _ = read_frame(env.kvc)
    plant(meta)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError):
            SourceMap.from_meta(meta["document"]["source_map"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"inflating the source map peaked at {peak / 2**20:.0f} MiB"

    bad = rewrite(env.kvc, tmp_path / "bomb.kvc", plant)
    rc, _, err = ask(env, capsys, bad, "--recall", "off")
    assert rc == 2 and "truncated or corrupted" in one_error_line(err)

    def claim_more(meta):  # an entry count larger than the document: refused before anything is inflated
        meta["document"]["source_map"]["entries"] = 10**9

    bad = rewrite(env.kvc, tmp_path / "count.kvc", claim_more)
    rc, _, err = cli(capsys, "inspect", bad)
    assert rc == 2 and "source_map" in one_error_line(err)


# -- b. the archive name is confined to the cache's directory, regular files only ------------------------------------
def test_archive_name_outside_the_directory_is_not_followed(env, tmp_path, capsys):
    import tempfile

    (tmp_path / "outside").mkdir()
    fd, short = tempfile.mkstemp(dir="/tmp", prefix="s")  # a short absolute path, like /etc/shadow
    os.write(fd, b"SECRET!!" + b"x" * 100)
    os.close(fd)
    secret = Path(short)
    kvc, _ = copy_pair(env, tmp_path / "outside")  # a pair elsewhere, then only the .kvc is moved here
    os.replace(kvc, tmp_path / "c.kvc")
    shutil.copyfile(secret, tmp_path / "outside" / "shadow")
    leaked = str(int.from_bytes(b"SECRET!!", "little"))
    try:
        _never_followed(env, tmp_path, capsys, secret, leaked)
    finally:
        secret.unlink()


def _never_followed(env, tmp_path: Path, capsys, secret: Path, leaked: str) -> None:
    for name in (str(secret), "../outside/shadow", "sub/x.archive", ""):
        bad = rewrite(tmp_path / "c.kvc", tmp_path / "named.kvc", lambda m, n=name: m["archive"].update(file=n))
        rc, data, err = ask(env, capsys, bad, "--recall", "64")
        assert rc == 0 and "answering without recall" in err, err
        assert data["stats"]["recalled_pages"] == 0
        assert leaked not in err and "SECRET" not in err and "Traceback" not in err

    os.symlink(secret, tmp_path / "link.archive")  # a plain name, but a link: not followed
    bad = rewrite(tmp_path / "c.kvc", tmp_path / "named.kvc", lambda m: m["archive"].update(file="link.archive"))
    rc, data, err = ask(env, capsys, bad, "--recall", "64")
    assert rc == 0 and "answering without recall" in err and leaked not in err, err


def test_archive_that_is_a_fifo_does_not_hang(env, tmp_path, capsys):
    from kvtool.runtime import store
    from kvtool.runtime.session import Session
    from kvtool.runtime.settings import resolve_settings

    kvc, arch = copy_pair(env, tmp_path)
    arch.unlink()
    os.mkfifo(arch)
    session = Session(
        resolve_settings(
            None,
            {"model": env.model, "policy": "h2o", "budget": "40", "block_size": 16, "device": "cpu", "recall": "64"},
        )
    )
    done: list[object] = []
    worker = threading.Thread(target=lambda: done.append(store.load_cache(kvc, session)), daemon=True)
    worker.start()
    worker.join(30)
    if worker.is_alive():  # blocked opening the FIFO: unblock it so the thread can end, then fail
        fd = os.open(arch, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        worker.join(10)
    assert done, "loading a cache whose archive is a FIFO hung"
    assert all(g.archive is None for g in done[0].cache.groups())


# -- c. two writers racing for one output keep a cache and its own archive together -------------------------------
def test_concurrent_prefills_to_one_output_keep_the_pair_together(env, tmp_path, monkeypatch):
    from kvtool.documents import open_document
    from kvtool.runtime import store
    from kvtool.runtime.session import Session
    from kvtool.runtime.settings import resolve_settings

    settings = {"model": env.model, "policy": "h2o", "budget": "40", "block_size": 16, "device": "cpu", "recall": "64"}
    reads = []
    for doc in env.docs:  # two documents: two different archives
        s = Session(resolve_settings(None, settings))
        reads.append((s, s.read(open_document(str(doc)))))
    out = tmp_path / "out.kvc"

    # Force the interleaving that loses an archive when the pair is placed without care: A places its
    # archive, B its archive, B its cache, A its cache. (Waits time out rather than deadlock a writer
    # that places under a lock: correctness must not depend on the order.)
    order = ["A1", "B1", "B2", "A2"]
    events = {k: threading.Event() for k in order}
    calls: dict[str, int] = {"A": 0, "B": 0}
    real_replace, real_link = os.replace, os.link

    def step(dst) -> None:
        name = threading.current_thread().name
        if name not in calls or not str(dst).startswith(str(tmp_path)) or str(dst).endswith(".tmp"):
            return
        calls[name] += 1
        key = f"{name}{calls[name]}"
        if key in order:
            i = order.index(key)
            if i:
                events[order[i - 1]].wait(3)
            events[key].set()

    def replace(src, dst, *a, **k):
        step(dst)
        return real_replace(src, dst, *a, **k)

    def link(src, dst, *a, **k):
        step(dst)
        return real_link(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "link", link)
    errors: list[BaseException] = []

    def write(i: int) -> None:
        try:
            store.save_cache(out, *reads[i], force=True)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(i,), name=n) for i, n in enumerate("AB")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    monkeypatch.undo()
    assert not errors, errors
    _, meta, _ = read_frame(out)
    named = tmp_path / meta["archive"]["file"]
    _, arch_meta, _ = read_frame(named)
    assert arch_meta["tensors_sha256"] == meta["archive"]["tensors_sha256"]  # the winner's own archive
    archives = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".archive"))
    assert archives == [named.name]  # the loser's archive is gone, not orphaned
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_replacing_a_cache_removes_its_old_archive_only(env, tmp_path, capsys):
    out = tmp_path / "o.kvc"
    base = ["prefill", env.docs[0], "-o", out, "--model", env.model, *KV, "--recall", "64", "-q"]
    assert cli(capsys, *base)[0] == 0
    first = read_frame(out)[1]["archive"]["file"]
    (tmp_path / "o.kvc.archive").write_bytes(b"an archive of an older kvtool, named by no cache here")
    assert cli(capsys, *base, "--force")[0] == 0
    second = read_frame(out)[1]["archive"]["file"]
    assert first != second and not (tmp_path / first).exists() and (tmp_path / second).is_file()
    assert (tmp_path / "o.kvc.archive").exists()  # not what the replaced cache named: kept
    assert cli(capsys, "prefill", env.docs[0], "-o", out, "--model", env.model, *KV, "-q", "--force")[0] == 0
    assert not (tmp_path / second).exists()  # replaced by a cache without an archive


# -- d. leftovers of a kill -9 are cleaned by the next write into the directory -----------------------------------
def test_stale_temporaries_and_orphan_archives_are_cleaned(env, tmp_path, capsys):
    old = time.time() - 2 * 3600
    stale = [
        ".out.kvc.kvtool-abcd1234.tmp",
        ".out.kvc.0123456789abcdef.archive.kvtool-wxyz9876.tmp",
        "out.kvc.0123456789abcdef.archive",
        "gone.kvc.fedcba9876543210.archive",
    ]
    keep = [".young.kvc.kvtool-abcd1234.tmp", ".notes.txt.12345678.tmp", "mine.txt", "out.kvc.archive"]
    for name in stale + keep:
        (tmp_path / name).write_bytes(b"left behind")
    for name in stale + keep[1:]:
        os.utime(tmp_path / name, (old, old))
    out = tmp_path / "out.kvc"
    assert cli(capsys, "prefill", env.docs[0], "-o", out, "--model", env.model, *KV, "--recall", "64", "-q")[0] == 0
    names = set(os.listdir(tmp_path))
    assert not names & set(stale), names & set(stale)
    assert set(keep) <= names
    assert read_frame(out)[1]["archive"]["file"] in names


# -- e. the metadata checksum is required -------------------------------------------------------------------------
def test_metadata_without_its_checksum_is_refused(env, tmp_path, capsys):
    def edit(meta):
        del meta["meta_sha256"]
        meta["document"]["name"] = "something else.txt"

    bad = rewrite(env.kvc, tmp_path / "nosum.kvc", edit, rehash=False)
    for args in (["inspect", bad], ["ask", bad, "q", "--model", env.model]):
        rc, _, err = cli(capsys, *args)
        assert rc == 2 and "truncated or corrupted" in one_error_line(err)


# -- f. invalid archive settings: a warning, never a crash -----------------------------------------------------------
@pytest.mark.parametrize(
    "edit",
    [
        {"page_size": 0},
        {"page_size": -3},
        {"page_size": "32"},
        {"page_size": 2**40},
        {"dtype": "int4"},
        {"file": 7},
        {"recall": 2**40},
    ],
)
def test_invalid_archive_settings_answer_without_recall(env, tmp_path, capsys, edit):
    kvc, _ = copy_pair(env, tmp_path)
    bad = rewrite(kvc, tmp_path / "bad.kvc", lambda m: m["archive"].update(edit))
    rc, data, err = ask(env, capsys, bad, "--recall", "64")
    assert rc == 0 and "answering without recall" in err and "Traceback" not in err, err
    assert data["stats"]["recalled_pages"] == 0
    rc, data, err = ask(env, capsys, bad)  # nothing from the broken section becomes a setting
    assert rc == 0, err


# -- g. a failed archive load detaches the archive ------------------------------------------------------------------
def test_failed_archive_load_detaches_and_answers_keep_evicting(env, tmp_path, capsys):
    kvc, arch = copy_pair(env, tmp_path)
    raw = bytearray(arch.read_bytes())
    raw[-5] ^= 0xFF  # the last group's rows: earlier groups were already appended when the checksum fails
    arch.write_bytes(bytes(raw))
    from kvtool.runtime import store
    from kvtool.runtime.session import Session
    from kvtool.runtime.settings import resolve_settings

    session = Session(
        resolve_settings(
            None,
            {
                "model": env.model,
                "policy": "h2o",
                "budget": "40",
                "block_size": 16,
                "device": "cpu",
                "recall": "64",
                "max_new_tokens": 4,
            },
        )
    )
    read = store.load_cache(kvc, session)
    assert all(g.archive is None for g in read.cache.groups())  # detached, not closed and left attached
    answer = session.ask(read, "castle")
    assert answer.tokens > 0
    for _ in session.engine.steps(read.cache, torch.arange(64) % 50, logits_rows=None):
        pass  # reading on evicts with the question unpinned: an attached, closed archive would be appended to
    assert read.cache.counters.evicted_tokens > 0
    rc, _, err = cli(capsys, "ask", kvc, "what is the castle", "--model", env.model, "--max-new-tokens", "4")
    assert rc == 0 and "missing or damaged" in err and "Traceback" not in err, err


# -- h. saving and loading an archive streams it --------------------------------------------------------------------
class CountingStore:
    """A MemoryStore that records the most rows one call reads or appends."""

    def __init__(self, inner) -> None:
        self.inner, self.most_read, self.most_appended = inner, 0, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def read(self, index):
        self.most_read = max(self.most_read, int(index.numel()))
        return self.inner.read(index)

    def append(self, rows):
        self.most_appended = max(self.most_appended, int(rows.shape[0]))
        self.inner.append(rows)


def test_archive_save_and_load_stream_in_chunks(tmp_path, monkeypatch):
    import safetensors.torch

    from kvtool.core import recall
    from kvtool.core.archive_stores import FILES_PER_GROUP, MemoryStore
    from kvtool.kvc import archive as kvc_archive
    from kvtool.kvc import write as kvc_write
    from tests.helpers import VOCAB, make_engine, stream_logits, tiny_llama

    engine = make_engine(tiny_llama(), "h2o", 32, block_size=16)
    counting: list[CountingStore] = []

    def store_factory(row_bytes):
        s = CountingStore(MemoryStore(row_bytes))
        counting.append(s)
        return s

    def with_archive():
        cache = engine.new_cache()
        recall.attach(cache, 16, 8, None, store_factory)
        return cache

    cache = with_archive()
    stream_logits(engine, torch.arange(1500) % VOCAB, cache=cache)
    rows = {id(g.archive): g.archive.store.rows for g in cache.groups()}
    row_bytes = next(g.archive.store.row_bytes for g in cache.groups())
    assert min(rows.values()) > 1000
    chunk_rows = 64
    monkeypatch.setattr(kvc_write, "CHUNK_BYTES", chunk_rows * row_bytes)

    def whole(*a, **k):
        raise AssertionError("the archive was read or written whole")

    monkeypatch.setattr(safetensors.torch, "save_file", whole)
    monkeypatch.setattr(safetensors.torch, "load_file", whole)
    saved = list(counting)
    info = kvc_archive.save_archive(str(tmp_path / "c.kvc"), cache)
    assert info is not None and 0 < max(s.most_read for s in saved[::FILES_PER_GROUP]) <= chunk_rows  # key parts
    loaded = with_archive()
    loaded.load(*cache.snapshot())  # the kept tokens and counters, as load_into restores them before the archive
    fresh = counting[len(saved) :]
    assert kvc_archive.load_archive(str(tmp_path / "c.kvc"), {"archive": info}, loaded) is None
    assert 0 < max(s.most_appended for s in fresh[::FILES_PER_GROUP]) <= chunk_rows
    for ga, gb in zip(cache.groups(), loaded.groups(), strict=True):  # the oracle: an exact round trip
        a, b = ga.archive.state_dict("x"), gb.archive.state_dict("x")
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert gb.archive.length == ga.archive.length and torch.equal(gb.archive.tail, ga.archive.tail)


# -- i. a .kvc remembers its archive settings -----------------------------------------------------------------------
def test_kvc_archive_settings_are_the_defaults_when_asking(env, tmp_path, capsys):
    out = tmp_path / "b.kvc"
    assert (
        cli(
            capsys,
            "prefill",
            env.docs[0],
            "-o",
            out,
            "--model",
            env.model,
            *KV,
            "--recall",
            "64",
            "--archive-dtype",
            "int8",
            "--recall-page",
            "16",
            "-q",
        )[0]
        == 0
    )
    for extra in ((), ("--recall", "64")):
        rc, data, err = ask(env, capsys, out, *extra)
        assert rc == 0 and "without recall" not in err, err
        stats = data["stats"]
        assert stats["recall_tokens"] == 64 and stats["archive_dtype"] == "int8" and stats["recall_page"] == 16
        assert stats["recalled_pages"] > 0
    rc, data, err = ask(env, capsys, out, "--recall-page", "32")  # an explicit conflicting flag: a warning
    assert rc == 0 and "pages of 16 tokens" in err and data["stats"]["recalled_pages"] > 0, err
    rc, data, err = ask(env, capsys, out, "--recall", "off")
    assert rc == 0 and data["stats"]["recalled_pages"] == 0


# -- j. a full disk is exit 1 with the path and the free space, for the cache and its archive ---------------------
@pytest.mark.parametrize("recall", [False, True])
def test_full_disk_is_a_runtime_error_naming_path_and_free_space(env, tmp_path, capsys, monkeypatch, recall):
    import errno

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    out = tmp_path / "full.kvc"
    monkeypatch.setattr(os, "fsync", full)
    extra = ["--recall", "64"] if recall else []
    rc, _, err = cli(capsys, "prefill", env.docs[0], "-o", out, "--model", env.model, *KV, *extra, "-q")
    monkeypatch.undo()
    line = one_error_line(err)
    assert rc == 1 and str(out) in line and "free in" in line, line
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(("full.kvc", ".full.kvc"))]
