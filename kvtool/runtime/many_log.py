"""``-o FILE.jsonl`` of a many-document run: an append-only log of records that a rerun resumes from.

Each record is one JSON line, written with one ``write`` and flushed to the disk (``fsync``) as soon as
its answer is complete, so an interrupted run (Ctrl-C, ``kill -9``, a power cut) loses at most the answer
being computed. Running the same command again reads the file first: the (document, question) pairs
already answered under the same settings fingerprint are skipped, and a torn last line (a write cut
short, of any length) is cut off, so the file stays valid JSON Lines and its pair is done again. Nothing
is ever answered twice: the file is locked while a run writes it (a second run on the same file is
refused), and a document is known by its resolved path (:func:`document_key`), so ``./a.txt``, ``a.txt``
and a symbolic link to it are one document, in one run and across runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
from dataclasses import dataclass, field
from typing import Any

from kvtool.errors import UsageError, json_text

#: how every record's line starts (``path`` is each record's first key): the mark of a torn line that may be cut
RECORD_START = b'{"path": '
#: the longest line a kvtool record file may hold (an answer with its citations and stats is a few KiB)
MAX_LINE_BYTES = 16 * 1024 * 1024


def document_key(path: str) -> str:
    """What identifies a document in a run and in the resume log: its resolved path (absolute, symbolic
    links and ``.``/``..`` followed), so the same file named two ways is one document. A path that does not
    exist (yet) resolves as far as it can; never raises."""
    return os.path.realpath(path)


def record_line(record: dict[str, Any]) -> str:
    """``record`` as one JSON line (no newline), as every JSON kvtool prints (``json_text``): UTF-8 as is, but
    every control and bidi character of a file name or an answer, and every byte of a path that is not UTF-8
    (a surrogate escape), is a ``\\uXXXX`` escape, which reads back to the same string."""
    return json_text(record)


def record_key(record: dict[str, Any]) -> tuple[str, str] | None:
    """The (document, what) a record completes: a question's answer, a summary, a saved cache; None for an
    error record (a failed document is tried again by the next run)."""
    path = record.get("path")
    if not isinstance(path, str) or "error" in record:
        return None
    if isinstance(record.get("question"), str) and "answer" in record:
        return path, record["question"]
    if "summary" in record:
        return path, "summary"
    if "output" in record:
        return path, "prefill"
    return None


@dataclass
class Resumed:
    """What an existing output file already holds, as seen by this run's settings."""

    done: set[tuple[str, str]] = field(default_factory=set)  # (document_key, what) answered under this fingerprint
    records: int = 0  # complete lines kept
    other_settings: int = 0  # records made under another fingerprint (kept; their pairs are done again)
    errors: int = 0  # error records (their documents are tried again)
    torn_bytes: int = 0  # bytes of a torn last line that were cut off


class ResultLog:
    """The output file of a many-document run, open and locked for appending from :meth:`open` to
    :meth:`close` (also a context manager): the descriptor is closed when the run releases it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: int | None = None
        self.written = 0

    def open(self, fingerprint: str) -> Resumed:
        """Check, lock and read the file (created if missing): the pairs it holds for ``fingerprint``.

        Refused (a one-line ``UsageError``): a directory, a missing parent directory, something that is not
        a regular file, a file another run is writing, a file that is not kvtool records.
        """
        path = self.path
        if os.path.isdir(path):
            raise UsageError(f"output {path} is a directory; give a file (e.g. {os.path.join(path, 'answers.jsonl')})")
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise UsageError(f"cannot write {path}: directory {parent} does not exist")
        try:
            # non-blocking: a FIFO named by mistake is refused below instead of waiting for a writer
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
        except OSError as e:
            raise UsageError(f"cannot write {path}: {e.strerror or e}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UsageError(f"output {path} is not a regular file (leave out -o to write to stdout)")
            os.set_blocking(fd, True)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise UsageError(f"{path} is being written by another kvtool run; wait for it to end or choose "
                                 "another -o") from None
            resumed = _read(fd, path, fingerprint)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        return resumed

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one line and flush it to the disk before returning."""
        assert self.fd is not None, "ResultLog.write before open"
        data = (record_line(record) + "\n").encode("utf-8")
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        os.fsync(self.fd)
        self.written += 1

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)  # the lock goes with the descriptor

    def __enter__(self) -> ResultLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read(fd: int, path: str, fingerprint: str) -> Resumed:
    """Read the records of an open file; cut a torn last line off (the file is ours: it is locked)."""
    out = Resumed()
    size = os.fstat(fd).st_size
    good = 0  # end of the last complete, valid line
    keys: dict[str, str] = {}  # a record's path -> its document_key (a document has a record per question)
    with open(fd, "rb", closefd=False) as f:
        f.seek(0)
        number = 0
        while True:
            line = f.readline(MAX_LINE_BYTES + 1)
            if not line:
                break
            number += 1
            if len(line) > MAX_LINE_BYTES:
                raise UsageError(f"{path} line {number} is longer than {MAX_LINE_BYTES >> 20} MiB: not a kvtool "
                                 "output file; choose another -o")
            record = _parse(line)
            if record is None or not line.endswith(b"\n"):
                # a write cut short (kill -9, a full disk, a power cut) is cut off and its pair redone; only what
                # a cut write leaves is cut, never the last line of a file that is not kvtool's
                if f.tell() >= size and not line.endswith(b"\n") and _torn(line):
                    break
                raise UsageError(f"{path} line {number} is not a kvtool record: not a kvtool output file; choose "
                                 "another -o")
            good = f.tell()
            out.records += 1
            key = record_key(record)
            if "error" in record:
                out.errors += 1
            elif record.get("settings") != fingerprint:
                out.other_settings += 1
            elif key is not None:
                if key[0] not in keys:
                    keys[key[0]] = document_key(key[0])
                out.done.add((keys[key[0]], key[1]))
    if good < size:
        out.torn_bytes = size - good
        os.ftruncate(fd, good)
        os.fsync(fd)
    return out


def _torn(line: bytes) -> bool:
    """Whether an unterminated last line is what a record's write cut short leaves: a start of a record of any
    length (``{``, ``{"pa``, ``{"path": "a.t``), possibly followed by the NUL bytes a power cut leaves where
    the file grew before its data reached the disk (or NUL bytes alone)."""
    body = line.rstrip(b"\0")
    return body.startswith(RECORD_START) or RECORD_START.startswith(body)


def _parse(line: bytes) -> dict[str, Any] | None:
    """A record (a JSON object with a string ``path``), or None."""
    with contextlib.suppress(ValueError):
        record = json.loads(line)
        if isinstance(record, dict) and isinstance(record.get("path"), str):
            return record
    return None
