"""Sharing the CPU cores with the other kvtool processes of this user on this machine.

kvtool's per-layer work is many small operations; with more intra-op threads than free cores they
wait on each other in every one of them, so two processes that each take every core run at well
under half the speed of one.

So each kvtool process that was not given ``--threads`` registers itself in a private directory (one
entry per process, named by its pid, holding the cores it may run on) and, before each block or decoded
token but at most every ``interval`` seconds, takes ``its cores // (1 + live peers sharing a core)``
threads. ``torch.set_num_threads`` must be called from the thread that runs the model (OpenMP's thread
count is per calling thread), hence a hook the engine calls between forwards rather than a background
thread.

Nothing in the directory is trusted. It is private (``fileio.private_dir``: 0700, ours, not a link),
under ``$XDG_RUNTIME_DIR`` where set, else the temporary directory. Liveness is proven by a lock, not a
pid: each process holds an ``flock`` on its own entry for as long as it is registered, so an entry whose
lock can be taken belongs to no running kvtool (killed, or not a kvtool file at all) and is removed.
Entries are opened with ``fileio.open_regular`` (no links followed, no FIFO blocked on, regular files
only); anything else is ignored.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import tempfile
import time
from pathlib import Path

import torch

from kvtool.fileio import open_regular, private_dir
from kvtool.runtime.model import usable_cores

#: the most bytes of an entry that are read (a core list; anything longer is not ours)
MAX_ENTRY_BYTES = 64 * 1024


def default_directory() -> Path:
    """Per-user registry shared by every kvtool of that user (whatever its ``KVTOOL_HOME``)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "").strip()
    if runtime and os.path.isabs(runtime) and os.path.isdir(runtime):
        return Path(runtime) / "kvtool" / "procs"
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"kvtool-{uid}" / "procs"


def _private_tree(directory: Path) -> None:
    """``directory`` and, when it is kvtool's own ``kvtool*/procs``, its parent: both private (OSError if not)."""
    for d in ([directory.parent] if directory.parent.name.startswith("kvtool") else []) + [directory]:
        _tighten(d)
        private_dir(d)


def _tighten(directory: Path) -> None:
    """Make a directory of ours that earlier kvtool versions created 0755 private (0700).

    Only a real directory (not followed through a link) that this user owns is changed; 0755 let no one
    else write into it, so its contents are still ours. Anything else is left for ``private_dir`` to refuse.
    """
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC
    try:
        fd = os.open(directory, flags)
    except OSError:
        return
    try:
        st = os.fstat(fd)
        if st.st_uid == os.getuid() and st.st_mode & 0o022 == 0 and st.st_mode & 0o077:
            os.fchmod(fd, 0o700)
    except OSError:
        pass
    finally:
        os.close(fd)


class CoreShare:
    """One process's registration; ``rebalance()`` between forwards keeps its thread count fair."""

    def __init__(self, directory: Path | None = None, interval: float = 0.5) -> None:
        self.directory = Path(directory) if directory is not None else default_directory()
        self.interval = interval
        self.cores = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(usable_cores()))
        self.pid = os.getpid()
        self.path: Path | None = None
        self.threads = torch.get_num_threads()
        self.peers = 0
        self.min_threads = self.threads
        self._next = 0.0
        self._dir_fd: int | None = None
        self._entry_fd: int | None = None
        try:
            self._register()
        except OSError:  # no private directory to be had: no sharing, all usable cores (the default)
            self.close()

    def _register(self) -> None:
        """Create the entry locked, under a temporary name, and rename it into place: a named entry is
        always locked by its live owner."""
        _private_tree(self.directory)
        flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC
        self._dir_fd = os.open(self.directory, flags)
        tmp, name = f".{self.pid}.tmp", str(self.pid)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=self._dir_fd)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=self._dir_fd)
        self._entry_fd = fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, ",".join(str(c) for c in sorted(self.cores)).encode())
            os.rename(tmp, name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._dir_fd)
            raise
        self.path = self.directory / name

    def count_peers(self) -> int:
        """Live kvtool processes other than this one that may run on one of this process's cores."""
        if self.path is None or self._dir_fd is None:
            return 0
        try:
            names = [e.name for e in os.scandir(self._dir_fd)]
        except OSError:
            return 0
        peers = 0
        for name in names:
            if name.isdigit() and int(name) != self.pid and self._shares_a_core(name):
                peers += 1
        return peers

    def _shares_a_core(self, name: str) -> bool:
        """Whether entry ``name`` is a live peer on one of our cores; a stale entry is removed."""
        assert self._dir_fd is not None
        try:
            fd = open_regular(name, dir_fd=self._dir_fd)
        except OSError:  # gone, a link, a FIFO, a directory: not a registration
            return False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # its owner holds it: a live kvtool
                return self._cores_of(fd) & self.cores != set()
            self._remove_stale(name, fd)
            return False
        finally:
            os.close(fd)

    def _cores_of(self, fd: int) -> set[int]:
        try:
            text = os.pread(fd, MAX_ENTRY_BYTES, 0).decode("ascii")
            return {int(c) for c in text.split(",") if c.strip()}
        except (OSError, ValueError):
            return set(self.cores)  # unreadable: assume it shares

    def _remove_stale(self, name: str, fd: int) -> None:
        """Unlink ``name`` if the directory still names the inode ``fd`` found unlocked."""
        with contextlib.suppress(OSError):
            st = os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
            mine = os.fstat(fd)
            if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                os.unlink(name, dir_fd=self._dir_fd)

    def fair_threads(self) -> int:
        self.peers = self.count_peers()
        return max(1, len(self.cores) // (1 + self.peers))

    def rebalance(self) -> None:
        """Set torch's thread count to this process's fair share; cheap between checks (one clock read)."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval
        n = self.fair_threads()
        if n != self.threads:
            torch.set_num_threads(n)
            self.threads = n
            self.min_threads = min(self.min_threads, n)

    def close(self) -> None:
        """Remove the entry and close every descriptor the registration holds (idempotent)."""
        if self.path is not None and self._dir_fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path.name, dir_fd=self._dir_fd)
        self.path = None
        for attr in ("_entry_fd", "_dir_fd"):
            fd = getattr(self, attr)
            setattr(self, attr, None)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)


_SHARE: CoreShare | None = None


def process_share() -> CoreShare:
    """This process's one registration (created on first use, removed at exit)."""
    global _SHARE
    if _SHARE is None:
        _SHARE = CoreShare()
        atexit.register(_SHARE.close)
    return _SHARE
