"""Hostile inputs to a many-document run, round 5: a file that turns into a FIFO after the walk, a list whose
"line" is 60 MB, a list that is a FIFO, a deleted current directory, ``-o`` inside the walked folder, a dangling
``.kvc`` link in ``prefill -o DIR/``, one document spelled two ways, and a resume log torn after a few bytes.
Each ends in bounded time with one line (or one error record) and the documented exit code."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.cli.app import app
from kvtool.documents import open_document
from kvtool.errors import EXIT_PARTIAL, UsageError, short_path
from kvtool.kvc.format import is_kvc
from kvtool.runtime.many_inputs import MAX_PATH_BYTES, collect
from kvtool.runtime.many_log import ResultLog, record_line
from tests.helpers import tiny_checkpoint

REPO = str(Path(__file__).resolve().parents[1])
runner = CliRunner()


def run(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tiny_checkpoint(tmp_path_factory.mktemp("hostile-many") / "tiny"))


def flags(model_dir: str, answers: bool = True) -> list[str]:
    return [
        "--model",
        model_dir,
        "--budget",
        "160",
        "--block-size",
        "32",
        "--threads",
        "1",
        *(["--max-new-tokens", "4"] if answers else []),
    ]


def folder_of(where: Path, n: int = 3) -> list[Path]:
    where.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        p = where / f"doc{i}.txt"
        p.write_text(" ".join(f"The cat number {i}{j} sat on mat {j}." for j in range(20)), encoding="utf-8")
        paths.append(p)
    return paths


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail (instead of hanging the suite) when the body blocks longer than ``seconds``."""

    def expired(signum, frame):
        raise TimeoutError(f"blocked for more than {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def kvtool(
    args: list[str], cwd: str | Path | None = None, timeout: int = 120, prelude: str = "", **kw
) -> subprocess.CompletedProcess:
    """kvtool in a fresh process (``prelude`` runs first in it); a run past ``timeout`` fails the test."""
    code = f"import sys\n{prelude}\nfrom kvtool.cli.app import main\nsys.exit(main({args!r}))\n"
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout, **kw
    )


# -- a file that is a FIFO when its turn comes ------------------------------------------------------------------
def test_a_walked_file_replaced_by_a_fifo_is_one_error_record_and_the_run_goes_on(model_dir, tmp_path):
    docs = folder_of(tmp_path / "docs")
    prelude = (
        "import os\nimport kvtool.runtime.many_inputs as mi\nreal = mi.collect\n"
        "def collect(*a, **k):\n"
        "    out = real(*a, **k)\n"
        "    os.unlink(out.paths[1]); os.mkfifo(out.paths[1])  # after the walk, before the read\n"
        "    return out\n"
        "mi.collect = collect\n"
    )
    started = time.monotonic()
    r = kvtool(
        ["ask", str(tmp_path / "docs"), "--question", "Who sat?", *flags(model_dir)], prelude=prelude, timeout=90
    )
    assert time.monotonic() - started < 90
    assert r.returncode == EXIT_PARTIAL, r.stderr
    out = records(r.stdout)
    errors = [x for x in out if "error" in x]
    assert [x["path"] for x in errors] == [str(docs[1])], out
    assert "is a FIFO, not a regular file" in errors[0]["error"] and errors[0]["exit_code"] == 2
    assert sorted(x["path"] for x in out if "answer" in x) == [str(docs[0]), str(docs[2])]


def test_a_document_opened_for_a_run_of_many_never_waits_on_a_fifo(tmp_path):
    fifo = tmp_path / "f.txt"
    os.mkfifo(fifo)
    with deadline(20), pytest.raises(UsageError, match="f.txt is a FIFO, not a regular file"):
        open_document(str(fifo), regular_only=True)
    with deadline(20):  # a name that was a regular file when it was looked at, a FIFO when it is opened
        real_isfile = os.path.isfile
        try:
            os.path.isfile = lambda p: True
            assert not is_kvc(fifo)
        finally:
            os.path.isfile = real_isfile


# -- lists of paths: a 60 MB "line", a FIFO -----------------------------------------------------------------------
def test_a_60_mb_line_in_files_from_is_refused_in_one_short_line(model_dir, tmp_path):
    listing = tmp_path / "list.txt"
    folder_of(tmp_path / "docs", 1)
    with open(listing, "wb") as f:
        f.write(f"{tmp_path / 'docs' / 'doc0.txt'}\n".encode())
        f.write(b"x" * 60_000_000 + b"\n")
    with pytest.raises(UsageError, match="line 2 is 60,000,000 bytes long: not a path"):
        collect([], str(listing))
    r = kvtool(["ask", "--files-from", str(listing), "--question", "q", *flags(model_dir)])
    assert r.returncode == 2 and not r.stdout and len(r.stderr) < 600, r.stderr[:300]
    assert r.stderr.count("\n") == 1 and "not a path" in r.stderr, r.stderr[:300]


def test_paths_are_capped_where_they_are_read_and_shortened_where_they_are_shown(model_dir, tmp_path):
    long_arg = "y" * (MAX_PATH_BYTES + 1)
    r = kvtool(["ask", long_arg, "b.txt", "--question", "q", *flags(model_dir)], cwd=tmp_path)
    assert r.returncode == 2 and not r.stdout and len(r.stderr) < 600 and "(PATH_MAX)" in r.stderr, r.stderr[:300]
    deep = tmp_path / ("d" * 200) / ("e" * 200) / "missing.txt"  # a path that can be, but names nothing
    good = folder_of(tmp_path / "docs", 1)[0]
    r = kvtool(["ask", str(deep), str(good), "--question", "q", *flags(model_dir)])
    assert r.returncode == EXIT_PARTIAL, r.stderr
    assert max(len(line) for line in r.stderr.splitlines()) < 800, r.stderr
    assert short_path(str(deep)) in r.stderr and "missing.txt" in short_path(str(deep))
    assert [x["path"] for x in records(r.stdout) if "error" in x] == [str(deep)]  # the record keeps the key whole


@contextlib.contextmanager
def feeding(fifo: Path, text: str) -> Iterator[None]:
    """A thread writes ``text`` into ``fifo`` while the body runs; a writer still waiting for a reader when
    the body ends (the body failed before reading) is released, so nothing is left blocked."""

    def writer() -> None:
        with contextlib.suppress(OSError), open(fifo, "w") as f:
            time.sleep(0.5)
            f.write(text)

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        yield
    finally:
        if t.is_alive():
            with contextlib.suppress(OSError):
                fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
                t.join(5)
                os.close(fd)
        t.join(5)


def test_a_fifo_files_from_is_read_after_a_note(model_dir, tmp_path):
    doc = folder_of(tmp_path / "docs", 2)
    fifo = tmp_path / "list"
    os.mkfifo(fifo)
    listing = "\n".join(map(str, doc)) + "\n"
    notes: list[str] = []
    with feeding(fifo, listing), deadline(30):
        got = collect([], str(fifo), notify=notes.append)
    assert got.paths == [str(d) for d in doc]
    assert len(notes) == 1 and "waiting for input on --files-from" in notes[0] and "writer" in notes[0], notes
    with feeding(fifo, listing):
        r = kvtool(["ask", "--files-from", str(fifo), "--question", "q", *flags(model_dir)])
    assert r.returncode == 0 and len(records(r.stdout)) == 2, r.stderr
    assert "waiting for input on --files-from" in r.stderr.splitlines()[0], r.stderr


# -- the process's surroundings ------------------------------------------------------------------------------------
@pytest.mark.parametrize("many", [False, True])
def test_a_deleted_current_directory_is_one_line_and_exit_2(model_dir, tmp_path, many):
    doc = folder_of(tmp_path / "docs", 2)
    gone = tmp_path / "gone"
    gone.mkdir()
    args = ["ask", str(doc[0]), *(["doc1.txt", "--question"] if many else []), "q", *flags(model_dir)]
    code = f"import sys\nfrom kvtool.cli.app import main\nsys.exit(main({args!r}))\n"
    r = subprocess.run(
        ["sh", "-c", 'cd "$1" && rmdir "$1" && exec "$2" -c "$3"', "sh", str(gone), sys.executable, code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 2 and not r.stdout, (r.returncode, r.stderr)
    assert r.stderr == (
        "kvtool: error: the current directory no longer exists (it was deleted): cd to an existing "
        "directory and run kvtool again\n"
    ), r.stderr


# -- the output and what counts as done ----------------------------------------------------------------------------
def test_an_output_file_inside_the_walked_folder_resumes(model_dir, tmp_path):
    folder_of(tmp_path / "docs", 2)
    out = tmp_path / "docs" / "answers.txt"  # a name the walk would read as a document
    args = ["ask", tmp_path / "docs", "--question", "Who sat?", *flags(model_dir), "-o", out]
    first = run(*args)
    assert first.exit_code == 0, first.output
    full = out.read_text(encoding="utf-8")
    assert len(records(full)) == 2
    again = run(*args)
    assert again.exit_code == 0, again.output
    assert out.read_text(encoding="utf-8") == full and "2 of 2 documents already done" in again.stderr
    named = run("ask", tmp_path / "docs" / "doc0.txt", out, "--question", "q", *flags(model_dir), "-o", out)
    assert named.exit_code == 2 and "is one of the documents" in named.stderr  # named, it is still refused


def test_a_dangling_kvc_link_in_prefill_dir_is_not_done(model_dir, tmp_path):
    docs = folder_of(tmp_path / "docs", 2)
    caches = tmp_path / "caches"
    caches.mkdir()
    (caches / "doc0.txt.kvc").symlink_to(tmp_path / "nowhere.kvc")
    (caches / "doc1.txt.kvc").write_text("not a cache", encoding="utf-8")
    r = run("prefill", tmp_path / "docs", *flags(model_dir, answers=False), "-o", caches)
    assert r.exit_code == 2, r.output  # neither counts as done; neither is overwritten without --force
    errors = {x["path"]: x["error"] for x in records(r.stdout)}
    assert "symbolic link to nothing" in errors[str(docs[0])] and "already exists" in errors[str(docs[1])], errors
    assert "already done" not in r.stderr
    r = run("prefill", tmp_path / "docs", *flags(model_dir, answers=False), "-o", caches, "--force")
    assert r.exit_code == 0, r.output
    assert all(is_kvc(caches / f"doc{i}.txt.kvc") for i in range(2))
    assert not (caches / "doc0.txt.kvc").is_symlink()
    r = run("prefill", tmp_path / "docs", *flags(model_dir, answers=False), "-o", caches)
    assert r.exit_code == 0 and "2 of 2 documents already done" in r.stderr and not r.stdout, r.output


def test_one_document_spelled_two_ways_is_read_once_and_resumed(model_dir, tmp_path, monkeypatch):
    folder_of(tmp_path, 2)
    (tmp_path / "link.txt").symlink_to(tmp_path / "doc0.txt")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "answers.jsonl"
    r = run(
        "ask", "doc0.txt", "./doc0.txt", "link.txt", "doc1.txt", "--question", "Who sat?", *flags(model_dir), "-o", out
    )
    assert r.exit_code == 0, r.output
    assert "2 duplicate(s) read once" in r.stderr
    full = out.read_text(encoding="utf-8")
    assert [x["path"] for x in records(full)] == ["doc0.txt", "doc1.txt"]
    r = run("ask", "./doc0.txt", str(tmp_path / "doc1.txt"), "--question", "Who sat?", *flags(model_dir), "-o", out)
    assert r.exit_code == 0 and out.read_text(encoding="utf-8") == full, r.output
    assert "2 of 2 documents already done" in r.stderr


# -- the resume log: a torn last line of any length ---------------------------------------------------------------
@pytest.mark.parametrize("torn", [b"{", b'{"pa', b'{"path":', b'{"path": "c.t', b"\0\0\0\0\0\0", b'{"pat\0\0\0'])
def test_a_torn_last_line_of_any_length_is_cut_and_the_run_resumes(tmp_path, torn):
    path = tmp_path / "out.jsonl"
    answer = {"path": "a.txt", "question": "q", "answer": "x", "stats": {}, "settings": "fp"}
    for before in (b"", (record_line(answer) + "\n").encode()):
        path.write_bytes(before + torn)
        log = ResultLog(str(path))
        try:
            resumed = log.open("fp")
        finally:
            log.close()
        assert resumed.torn_bytes == len(torn) and path.read_bytes() == before
        assert resumed.done == ({(os.path.realpath("a.txt"), "q")} if before else set())


@pytest.mark.parametrize("content", [b"hello", b"id,name\n1,x", b'{"path": "a"}\nhello\n', b'{"path": "a"}\n{"x"'])
def test_a_file_that_is_not_kvtool_records_is_still_refused(tmp_path, content):
    path = tmp_path / "notes.jsonl"
    path.write_bytes(content)
    with pytest.raises(UsageError, match="not a kvtool output file"):
        ResultLog(str(path)).open("fp")
    assert path.read_bytes() == content  # nothing cut from a file that is not ours
