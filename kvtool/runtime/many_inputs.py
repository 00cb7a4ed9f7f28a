"""The documents of a many-document run: files, directories (walked), and ``--files-from`` lists.

Only paths are gathered here (a ``stat`` each, no file is opened but the list itself): a run over ten
thousand documents holds ten thousand strings, not ten thousand descriptors, and each document is opened
when its turn comes (as a regular file only, without waiting: see ``open_document(regular_only=True)``). A
directory contributes the files whose extension names a format kvtool reads; the other files are skipped
and counted. Hidden files and directories (a leading dot: ``.git``) are left out, symbolic links to
directories are not followed inside a walk (no loops), and the run's own output file is never walked. A
document is known by its resolved path (:func:`~kvtool.runtime.many_log.document_key`): named twice, in any
spelling, it is read once. A path longer than :data:`MAX_PATH_BYTES` (no system call accepts it) is refused
where it is read.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from kvtool.errors import UsageError, short_path
from kvtool.runtime.many_log import document_key

#: the extensions a directory walk reads: every document format kvtool knows
DOCUMENT_SUFFIXES = (".txt", ".text", ".md", ".markdown", ".html", ".htm", ".xhtml", ".pdf", ".epub", ".docx")
#: a saved cache: ``ask`` and ``summarize`` read it, ``prefill`` does not
KVC_SUFFIX = ".kvc"
#: a ``--files-from`` list: at most this many bytes (a million paths of 64 characters)
MAX_LIST_BYTES = 64 * 1024 * 1024
#: the longest path a document may have, in bytes: Linux's PATH_MAX (``open`` refuses longer ones anyway)
MAX_PATH_BYTES = 4096


@dataclass
class Inputs:
    """What a run will read, in order, and what the walk left out."""

    paths: list[str] = field(default_factory=list)
    skipped: int = 0  # files in a walked directory whose extension kvtool does not read
    duplicates: int = 0  # the same document named twice (``docs/ docs/a.txt``): read once
    directories: int = 0  # directories walked
    unreadable: int = 0  # subdirectories a walk could not list (permissions)

    def describe_skipped(self) -> str | None:
        """One line about what was left out, or None."""
        parts = []
        if self.skipped:
            parts.append(f"{self.skipped:,} file(s) of other formats skipped")
        if self.duplicates:
            parts.append(f"{self.duplicates:,} duplicate(s) read once")
        if self.unreadable:
            parts.append(f"{self.unreadable:,} unreadable director(y/ies) skipped")
        return "; ".join(parts) or None


def collect(args: Iterable[str], files_from: str | None = None, kvc: bool = True, output: str | None = None,
            notify: Callable[[str], None] | None = None) -> Inputs:
    """The documents named by ``args`` (files, directories) and the ``files_from`` list, in that order.

    A file named explicitly is kept whatever its extension (and even when it does not exist: reading it
    then fails with its own error record); ``kvc`` says whether a walk keeps ``.kvc`` caches. ``output`` (the
    run's ``-o`` file) is left out of every walk, so that a rerun finds the same documents as the first run
    did; named explicitly, it is the caller's to refuse. ``notify`` hears that a list comes from a FIFO or a
    terminal (the read waits for its writer).
    """
    out = Inputs()
    seen: set[str] = set()
    ours = document_key(output) if output is not None else None
    suffixes = DOCUMENT_SUFFIXES + ((KVC_SUFFIX,) if kvc else ())
    listed = _read_list(files_from, notify) if files_from is not None else ()
    for item in _chain(args, listed):
        if item == "-":
            raise UsageError("'-' (stdin) cannot be one of many documents: save it to a file, or give it alone")
        _check_length(item, "document")
        walked = os.path.isdir(item)
        if walked:
            out.directories += 1
            found = _walk(item, suffixes, out)
        else:
            found = iter((item,))
        for path in found:
            key = document_key(path)
            if walked and key == ours:
                continue  # the records this run appends to: not a document, now or when the run is resumed
            if key in seen:
                out.duplicates += 1
                continue
            seen.add(key)
            out.paths.append(path)
    return out


def _check_length(path: str, what: str) -> None:
    """A path longer than :data:`MAX_PATH_BYTES` is refused (one line naming its start and length)."""
    if len(path) <= MAX_PATH_BYTES // 4:  # 4 bytes a character at most
        return
    try:
        size = len(os.fsencode(path))
    except UnicodeEncodeError:  # a lone surrogate no file name holds
        size = len(path.encode("utf-8", "surrogatepass"))
    if size > MAX_PATH_BYTES:
        raise UsageError(f"{what} {short_path(path, 60)} is {size:,} bytes long; a path has at most "
                         f"{MAX_PATH_BYTES:,} (PATH_MAX)")


def _chain(*groups: Iterable[str]) -> Iterator[str]:
    for group in groups:
        yield from group


def _walk(top: str, suffixes: tuple[str, ...], out: Inputs) -> Iterator[str]:
    """Files under ``top`` with one of ``suffixes``, depth first in name order; others counted in ``out``."""

    def failed(e: OSError) -> None:
        if os.path.normpath(str(e.filename)) == os.path.normpath(top):
            raise UsageError(f"cannot read directory {short_path(top)}: {e.strerror or e}")
        out.unreadable += 1  # a subdirectory: the rest of the walk goes on

    for root, dirs, files in os.walk(top, onerror=failed):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.startswith("."):
                continue
            path = os.path.join(root, name)
            # a FIFO or a device found in a walk would wait or never end: only regular files (named ones are read)
            if name.lower().endswith(suffixes) and os.path.isfile(path):
                yield path
            else:
                out.skipped += 1


def _read_list(source: str, notify: Callable[[str], None] | None = None) -> list[str]:
    """The paths of a ``--files-from`` list (``-``: stdin): NUL-separated when it holds a NUL
    (``find -print0``), else one per line; empty entries are ignored. Bounded whatever the file is: at most
    :data:`MAX_LIST_BYTES`, each entry at most :data:`MAX_PATH_BYTES` (a longer "line" is not a path: the
    list is refused, naming the entry). A FIFO (``--files-from <(find ...)``) or a terminal is read like a
    file, once ``notify`` has said that the read waits for its writer."""
    what = "--files-from"
    shown = short_path(source)
    try:
        if source == "-":
            if sys.stdin is None:
                raise UsageError(f"{what} -: stdin is closed")
            if notify is not None and sys.stdin.isatty():
                notify(f"reading the list of documents ({what} -) from the terminal: one path per line, then Ctrl-D")
            data = sys.stdin.buffer.read(MAX_LIST_BYTES + 1)
        else:
            if os.path.isdir(source):
                raise UsageError(f"{what} {shown} is a directory; give a file listing one path per line")
            if notify is not None and os.path.exists(source) and not os.path.isfile(source):
                notify(f"waiting for input on {what} {shown} (not a regular file: the list is read once its writer "
                       "sends it; Ctrl-C to stop)")
            with open(source, "rb") as f:
                data = f.read(MAX_LIST_BYTES + 1)
    except OSError as e:
        raise UsageError(f"cannot read {what} {shown}: {e.strerror or e}") from None
    if len(data) > MAX_LIST_BYTES:
        raise UsageError(f"{what} {shown} is larger than {MAX_LIST_BYTES >> 20} MiB; split the list")
    sep = b"\0" if b"\0" in data else b"\n"
    items = data.split(sep)
    for number, item in enumerate(items, 1):
        if len(item) > MAX_PATH_BYTES:
            entry = "entry" if sep == b"\0" else "line"
            raise UsageError(f"{what} {shown} {entry} {number:,} is {len(item):,} bytes long: not a path (a path "
                             f"has at most {MAX_PATH_BYTES:,} bytes); is it a list of paths?")
    if sep == b"\n":
        items = [line.rstrip(b"\r") for line in items]
    return [os.fsdecode(p) for p in items if p.strip()]


def kvc_names(paths: list[str], directory: str) -> dict[str, str]:
    """Where ``prefill DOC... -o DIR/`` writes each document's cache: ``DIR/<file name>.kvc``.

    The whole file name is kept (``a.txt`` and ``a.md`` give ``a.txt.kvc`` and ``a.md.kvc``); documents of
    the run that share a file name (``x/a.txt``, ``y/a.txt``) each get a short hash of their path added,
    ``a.txt-1f3a9c2e.kvc``, so no two can collide and the same run always picks the same names.
    """
    by_name: dict[str, list[str]] = {}
    for p in paths:
        by_name.setdefault(os.path.basename(os.path.normpath(p)).lower(), []).append(p)
    out = {}
    for p in paths:
        base = os.path.basename(os.path.normpath(p)) or "document"
        if len(by_name[base.lower()]) > 1:
            tag = hashlib.sha256(os.path.normpath(os.path.abspath(p)).encode("utf-8", "surrogateescape"))
            base = f"{base}-{tag.hexdigest()[:8]}"
        out[p] = os.path.join(directory, base + KVC_SUFFIX)
    return out
