"""Files kvtool writes or reads beside the document: atomic replacement, confined and private paths.

Standard library only, importable from every layer. The rules: a file appears whole or not at all
(temp file in the same directory, fsync, rename, fsync the directory); a name read from a file is a
plain basename inside a known directory, opened without following links and checked to be a regular
file; a directory shared with other users' processes is private (0700, ours, not a link).
"""

from __future__ import annotations

import contextlib
import os
import stat

from kvtool.errors import UsageError


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename inside ``directory`` durable (best effort: some filesystems refuse directory fsync)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def confined_name(name: object, what: str) -> str:
    """``name`` if it is a plain file name (no directory part, not ``.``/``..``, no NUL); else a UsageError."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\0" in name \
            or (os.sep != "/" and os.sep in name):
        raise UsageError(f"{what} must be a plain file name in the same directory: got {name!r:.80}")
    return name


def open_regular(path: str | os.PathLike[str], dir_fd: int | None = None, follow: bool = False) -> int:
    """Open ``path`` read-only without following a final symlink (unless ``follow``) and without blocking on a
    FIFO; the descriptor is returned only for a regular file (``OSError`` otherwise, the descriptor closed)."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{os.fspath(path)} is not a regular file")
        if hasattr(os, "O_NONBLOCK"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def private_dir(path: str | os.PathLike[str]) -> str:
    """Create (if needed) and check a per-user directory: not a symlink, owned by us, mode 0700.

    A directory that fails the check (made by someone else, a link, group/world access) is refused with
    ``OSError``; its contents are never trusted. Returns the path.
    """
    p = os.fspath(path)
    with contextlib.suppress(FileExistsError):
        os.mkdir(p, 0o700)
    st = os.lstat(p)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{p} is not a directory (a link or another file is there)")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise OSError(f"{p} belongs to another user")
    if st.st_mode & 0o077:
        raise OSError(f"{p} is open to other users (mode {stat.S_IMODE(st.st_mode):o}); expected 0700")
    return p


def read_capped(path: str | os.PathLike[str], cap: int, what: str) -> bytes:
    """The bytes of a small file kvtool reads whole (a profile, a calibration), at most ``cap`` of them.

    A FIFO or device is refused instead of waited on, and a larger file (or a sparse one claiming a GiB)
    is refused after reading ``cap + 1`` bytes: what it holds never decides how much is read. Every
    failure is a one-line ``UsageError`` naming ``what``.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise UsageError(f"cannot read {what} {os.fspath(path)}: {e.strerror or e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(f"{what} {os.fspath(path)} is not a regular file")
        if hasattr(os, "O_NONBLOCK"):
            os.set_blocking(fd, True)
        chunks, got = [], 0
        while got <= cap:
            chunk = os.read(fd, min(1 << 20, cap + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except OSError as e:
        raise UsageError(f"cannot read {what} {os.fspath(path)}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if got > cap:
        raise UsageError(f"{what} {os.fspath(path)} is larger than {cap >> 10:,} KiB, far more than such a file "
                         "needs; refused")
    return b"".join(chunks)
