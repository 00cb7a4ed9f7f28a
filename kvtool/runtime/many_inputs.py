"""The documents of a many-document run: files, directories (walked), and ``--files-from`` lists.

Only paths are gathered here (a ``stat`` each, no file is opened but the list itself): a run over ten
thousand documents holds ten thousand strings, not ten thousand descriptors, and each document is opened
when its turn comes. A directory contributes the files whose extension names a format kvtool reads; the
other files are skipped and counted. Hidden files and directories (a leading dot: ``.git``) are left
out, and symbolic links to directories are not followed inside a walk (no loops).
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kvtool.errors import UsageError

#: the extensions a directory walk reads: every document format kvtool knows
DOCUMENT_SUFFIXES = (".txt", ".text", ".md", ".markdown", ".html", ".htm", ".xhtml", ".pdf", ".epub", ".docx")
#: a saved cache: ``ask`` and ``summarize`` read it, ``prefill`` does not
KVC_SUFFIX = ".kvc"
#: a ``--files-from`` list: at most this many bytes (a million paths of 64 characters)
MAX_LIST_BYTES = 64 * 1024 * 1024


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


def collect(args: Iterable[str], files_from: str | None = None, kvc: bool = True) -> Inputs:
    """The documents named by ``args`` (files, directories) and the ``files_from`` list, in that order.

    A file named explicitly is kept whatever its extension (and even when it does not exist: reading it
    then fails with its own error record); ``kvc`` says whether a walk keeps ``.kvc`` caches.
    """
    out = Inputs()
    seen: set[str] = set()
    suffixes = DOCUMENT_SUFFIXES + ((KVC_SUFFIX,) if kvc else ())
    for item in _chain(args, _read_list(files_from) if files_from is not None else ()):
        if item == "-":
            raise UsageError("'-' (stdin) cannot be one of many documents: save it to a file, or give it alone")
        if os.path.isdir(item):
            out.directories += 1
            found = _walk(item, suffixes, out)
        else:
            found = iter((item,))
        for path in found:
            key = os.path.normpath(os.path.abspath(path))
            if key in seen:
                out.duplicates += 1
                continue
            seen.add(key)
            out.paths.append(path)
    return out


def _chain(*groups: Iterable[str]) -> Iterator[str]:
    for group in groups:
        yield from group


def _walk(top: str, suffixes: tuple[str, ...], out: Inputs) -> Iterator[str]:
    """Files under ``top`` with one of ``suffixes``, depth first in name order; others counted in ``out``."""

    def failed(e: OSError) -> None:
        if os.path.normpath(str(e.filename)) == os.path.normpath(top):
            raise UsageError(f"cannot read directory {top}: {e.strerror or e}")
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


def _read_list(source: str) -> list[str]:
    """The paths of a ``--files-from`` list (``-``: stdin): NUL-separated when it holds a NUL
    (``find -print0``), else one per line; empty entries are ignored. Bounded whatever the file is."""
    what = "--files-from"
    try:
        if source == "-":
            if sys.stdin is None:
                raise UsageError(f"{what} -: stdin is closed")
            data = sys.stdin.buffer.read(MAX_LIST_BYTES + 1)
        else:
            if os.path.isdir(source):
                raise UsageError(f"{what} {source} is a directory; give a file listing one path per line")
            with open(source, "rb") as f:
                data = f.read(MAX_LIST_BYTES + 1)
    except OSError as e:
        raise UsageError(f"cannot read {what} {source}: {e.strerror or e}") from None
    if len(data) > MAX_LIST_BYTES:
        raise UsageError(f"{what} {source} is larger than {MAX_LIST_BYTES >> 20} MiB; split the list")
    if b"\0" in data:
        items = data.split(b"\0")
    else:
        items = [line.rstrip(b"\r") for line in data.split(b"\n")]
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
