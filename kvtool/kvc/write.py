"""Writing ``.kvc`` files (and the archive beside one): streamed, checksummed, atomic, no-clobber.

A file is written to a temporary file of kvtool's own naming in the target directory
(``.<name>.kvtool-XXXXXXXX.tmp``), fsynced, renamed into place and the directory fsynced, so a reader sees
the old file or the new one, never half of one. Tensor data is streamed in chunks and hashed as it goes;
the header, written first with a placeholder checksum of the same length, is rewritten in place at the
end, so the memory a write needs does not grow with the file.

Replacing a cache also removes the archive the replaced cache named (after the rename, under a lock on
the directory, so two writers racing for one output each remove only what they replaced). The first
write into a directory also removes stale leftovers of kvtool's own naming there: temporaries and
archives no cache names, owned by this user and untouched for ``STALE_SECONDS`` (a ``kill -9`` mid-write).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtool import __version__
from kvtool.errors import KvtoolError, UsageError, first_line
from kvtool.fileio import fsync_dir
from kvtool.kvc.format import (
    FORMAT,
    FORMAT_VERSION,
    META_KEY,
    ST_BYTES,
    ST_NAMES,
    TensorDigest,
    is_archive_name,
    jsonable,
    meta_digest,
    read_header,
)

if TYPE_CHECKING:
    from torch import Tensor

#: leftovers of kvtool's own naming older than this are removed by the next write into their directory
STALE_SECONDS = 3600
#: bytes of tensor data handed to the file (and the checksum) at once
CHUNK_BYTES = 8 << 20
#: ``progress(done, total)``: how far a long write or read has come, for the runtime to turn into events
Progress = Callable[[int, int], None]
_TMP_MARK = ".kvtool-"
_TMP_RE = re.compile(r"\..+\.kvtool-[A-Za-z0-9_]{8}\.tmp")
_ARCHIVE_RE = re.compile(r"(.+)\.[0-9a-f]{16}\.archive")
_PLACEHOLDER = "0" * 64  # a SHA-256 in hex: the header's length does not change when the real one is set


@dataclass
class Entry:
    """One tensor to write: its safetensors dtype code and shape, and its bytes as an iterable of chunks."""

    name: str
    code: str
    shape: list[int]
    chunks: Callable[[], Iterable[bytes | memoryview]]

    @property
    def nbytes(self) -> int:
        n = ST_BYTES[self.code]
        for s in self.shape:
            n *= int(s)
        return n


def check_output(path: str | os.PathLike[str], force: bool = False, source: str | None = None) -> str:
    """Validate an output path before any work is done; returns it as a string.

    Refuses an existing file without ``force``, a directory, a missing or non-directory parent, an
    unwritable directory, and the input document itself.
    """
    path = os.fspath(path)
    if not path or path.endswith(os.sep):
        raise UsageError(f"output path {path!r} is not a file name")
    if os.path.isdir(path):
        raise UsageError(f"output {path} is a directory")
    if source is not None and source != "-" and os.path.exists(source) and os.path.exists(path):
        with contextlib.suppress(OSError):
            if os.path.samefile(source, path):
                raise UsageError(f"output {path} is the input document; choose another -o")
    if os.path.lexists(path) and not force:
        if not os.path.exists(path):
            raise UsageError(f"output {path} is a symbolic link to nothing; remove it, or use --force to replace it")
        raise UsageError(f"output {path} already exists; use --force to overwrite it")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(parent):
        raise UsageError(f"cannot write {path}: directory {parent} does not exist")
    if not os.path.isdir(parent):
        raise UsageError(f"cannot write {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write {path}: directory {parent} is not writable")
    return path


# -- tensors -> entries ---------------------------------------------------------------------------------------------
def st_code(dtype: Any) -> str:
    """The safetensors code of a torch dtype."""
    name = str(dtype).removeprefix("torch.")
    for code, n in ST_NAMES.items():
        if n == name:
            return code
    raise ValueError(f"no safetensors code for {name}")


def tensor_bytes(t: Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    import torch

    flat = t.reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def tensor_entry(name: str, t: Tensor) -> Entry:
    """An entry for a tensor already in memory (CPU, contiguous)."""
    return Entry(name, st_code(t.dtype), list(t.shape), lambda: (tensor_bytes(t),))


def tensors_digest(tensors: dict[str, Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order (detects damaged data)."""
    digest = TensorDigest()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        digest.begin(name, st_code(t.dtype), list(t.shape))
        digest.update(tensor_bytes(t))
    return digest.hexdigest()


def as_saved(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The tensors as a ``.kvc`` stores them: on the CPU, contiguous, positions in int32 where they fit."""
    import torch

    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        small = t.numel() == 0 or (int(t.max()) < 2**31 and int(t.min()) >= -(2**31))
        if name.endswith((".positions", ".rotary")) and t.dtype == torch.long and small:
            t = t.to(torch.int32)  # stream and RoPE positions fit int32: 4 bytes per token and head saved
        out[name] = t
    return out


def write_kvc(path: str | os.PathLike[str], tensors: dict[str, Tensor], meta: dict[str, Any],
              force: bool = False, progress: Progress | None = None) -> int:
    """Write tensors + ``meta`` as a ``.kvc`` file, atomically; returns the file size.

    Without ``force`` the final step is a hard link, which fails if the path appeared meanwhile (never
    clobbers). On any failure the temp file is removed and ``path`` is untouched. ``progress``: see
    :func:`write_entries`.
    """
    saved = as_saved(tensors)
    return write_entries(path, [tensor_entry(n, t) for n, t in saved.items()], meta, force=force,
                         progress=progress)


# -- the streamed, atomic write ---------------------------------------------------------------------------------
def write_entries(path: str | os.PathLike[str], entries: list[Entry], meta: dict[str, Any],
                  force: bool = False, progress: Progress | None = None) -> int:
    """Write ``entries`` (in name order) and ``meta`` as a ``.kvc``-format file at ``path``; returns its size.

    ``meta`` gets ``format``, ``format_version``, ``kvtool_version``, ``tensors_sha256`` (computed while the
    data streams) and ``meta_sha256``. ``progress(done, total)``: tensor bytes written and hashed so far,
    0 first, then after every chunk, ``total`` last once the file is fsynced and in place.
    """
    path = check_output(path, force)
    directory = os.path.dirname(os.path.abspath(path))
    clean_stale(directory)
    entries = sorted(entries, key=lambda e: e.name)
    meta = dict(meta)
    meta.update(format=FORMAT, format_version=FORMAT_VERSION, tensors_sha256=_PLACEHOLDER)
    meta.setdefault("kvtool_version", __version__)
    meta = jsonable(meta)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}{_TMP_MARK}", suffix=".tmp", dir=directory)
    except OSError as e:
        raise write_error(path, e) from None
    try:
        try:
            _stream(fd, entries, meta, progress)
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; a cache file is an ordinary file
            os.fsync(fd)
        finally:
            os.close(fd)
        archive = meta.get("archive")
        _place(tmp, path, force, directory, archive.get("file") if isinstance(archive, dict) else None)
        if progress is not None:
            total = sum(e.nbytes for e in entries)
            progress(total, total)
    except KvtoolError:
        raise
    except OSError as e:
        raise write_error(path, e) from None
    except Exception as e:  # a failure while producing the data: one line, never a traceback
        raise KvtoolError(f"cannot write {path}: {type(e).__name__}: {first_line(e, 200)}") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return os.path.getsize(path)


def _header(entries: list[Entry], meta: dict[str, Any]) -> bytes:
    """The safetensors header for ``entries`` laid out in order, padded with spaces to 8 bytes."""
    meta = {**meta, "meta_sha256": meta_digest(meta)}
    head: dict[str, Any] = {"__metadata__": {"format": FORMAT, "format_version": str(meta["format_version"]),
                                             META_KEY: json.dumps(meta, sort_keys=True)}}
    offset = 0
    for e in entries:
        head[e.name] = {"dtype": e.code, "shape": [int(s) for s in e.shape],
                        "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def _stream(fd: int, entries: list[Entry], meta: dict[str, Any], progress: Progress | None = None) -> None:
    """Header with a placeholder checksum, then the data chunk by chunk (hashed), then the real header.

    ``progress`` hears of the data bytes written, never of ``total`` (the caller says when the file is placed).
    """
    first = _header(entries, meta)
    _write_all(fd, first, 0)
    offset = len(first)
    total = sum(e.nbytes for e in entries)
    if progress is not None:
        progress(0, total)
    digest = TensorDigest()
    for e in entries:
        digest.begin(e.name, e.code, e.shape)
        written = 0
        for chunk in e.chunks():
            view = memoryview(chunk).cast("B")
            digest.update(view)
            _write_all(fd, view, offset)
            offset += len(view)
            written += len(view)
            if progress is not None:
                progress(max(0, min(offset - len(first), total - 1)), total)  # the last byte waits for the rename
        if written != e.nbytes:
            raise ValueError(f"tensor {e.name} produced {written} bytes, {e.nbytes} expected")
    meta["tensors_sha256"] = digest.hexdigest()
    final = _header(entries, meta)
    assert len(final) == len(first)  # the checksums are fixed-length hex: the data offsets stand
    _write_all(fd, final, 0)


def _write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _place(tmp: str, path: str, force: bool, directory: str, ours: str | None) -> None:
    """Move the finished temp file to ``path``; replacing a cache removes the archive it named, unless it is
    ``ours`` (the archive the new file names)."""
    with _dir_lock(directory):
        old_archive = _archive_of(path) if force else None
        if force:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise UsageError(f"output {path} already exists; use --force to overwrite it") from None
            except OSError as e:  # no hard links on this filesystem: best effort no-clobber
                if os.path.lexists(path):
                    raise UsageError(f"output {path} already exists; use --force to overwrite it") from None
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise
                os.replace(tmp, path)
        fsync_dir(directory)
        if old_archive and old_archive != ours:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, old_archive))


@contextlib.contextmanager
def _dir_lock(directory: str) -> Iterator[None]:
    """An exclusive ``flock`` on the directory itself (no lock file); best effort where it is refused."""
    try:
        import fcntl

        fd = os.open(directory, os.O_RDONLY)
    except (ImportError, OSError):
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _recorded_archive(path: str) -> str | None:
    """The archive file name the header of the cache at ``path`` records, None when it records none.

    Raises ``UsageError``/``OSError`` when the header cannot be read; each caller decides what an
    unreadable cache means for it.
    """
    info = read_header(path).meta.get("archive")
    name = info.get("file") if isinstance(info, dict) else None
    return name if isinstance(name, str) else None


def _archive_of(path: str) -> str | None:
    """The archive the cache at ``path`` names, if it is one of kvtool's names for it; None otherwise."""
    if not os.path.isfile(path):
        return None
    try:
        name = _recorded_archive(path)
    except (UsageError, OSError):
        return None
    return name if name is not None and is_archive_name(os.path.basename(path), name) else None


def write_error(path: str, e: OSError) -> KvtoolError:
    """The one line for a failed write: a full disk is a runtime condition (exit 1, with the free space);
    a path the user cannot write is a usage error (exit 2)."""
    why = e.strerror or str(e)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        directory = os.path.dirname(os.path.abspath(path))
        try:
            free = f"{shutil.disk_usage(directory).free / 2**20:,.1f} MiB free in {directory}"
        except OSError:
            free = f"free space in {directory} unknown"
        return KvtoolError(f"cannot write {path}: {why} ({free})")
    if isinstance(e, (PermissionError, FileNotFoundError, NotADirectoryError, IsADirectoryError)):
        return UsageError(f"cannot write {path}: {why}")
    return KvtoolError(f"cannot write {path}: {why}")


# -- leftovers of interrupted writes -----------------------------------------------------------------------------
def clean_stale(directory: str, now: float | None = None) -> list[str]:
    """Remove kvtool's stale leftovers in ``directory``; returns the names removed.

    Candidates are regular files (never followed links) owned by this user and untouched for
    ``STALE_SECONDS``: temporaries named ``.<name>.kvtool-XXXXXXXX.tmp``, and archives
    ``<cache>.<id>.archive`` that ``<cache>`` does not name (it is gone, or names another archive).
    An unreadable cache keeps its archives. Never raises: cleaning is a courtesy, not the write.
    """
    now = time.time() if now is None else now
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    uid = os.getuid() if hasattr(os, "getuid") else None
    for name in names:
        tmp = _TMP_RE.fullmatch(name)
        arch = _ARCHIVE_RE.fullmatch(name)
        if not (tmp or arch):
            continue
        full = os.path.join(directory, name)
        try:
            st = os.lstat(full)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or (uid is not None and st.st_uid != uid) \
                or now - st.st_mtime < STALE_SECONDS:
            continue
        if arch and not _orphan(directory, arch.group(1), name):
            continue
        with contextlib.suppress(OSError):
            os.unlink(full)
            removed.append(name)
    return removed


def _orphan(directory: str, cache_name: str, name: str) -> bool:
    """Whether the archive ``name`` belongs to no cache: ``cache_name`` is gone or names another archive."""
    cache = os.path.join(directory, cache_name)
    if not os.path.lexists(cache):
        return True
    try:
        return _recorded_archive(cache) != name
    except (UsageError, OSError):
        return False
