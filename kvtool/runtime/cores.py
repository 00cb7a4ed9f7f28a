"""Sharing the CPU cores with the other kvtool processes on this machine (issue 15).

kvtool's per-layer work is many small operations; with more intra-op threads than free cores they
wait on each other in every one of them. Two processes that each take every core (``xargs -P 2
kvtool prefill ...`` on a 2-core machine) measured 0.23× of one process's speed each — half the
throughput of running them one after the other — while the same pair at one thread each kept ~0.7×.

So each kvtool process that was not given ``--threads`` registers itself in a small directory (one
file per process, named by its pid, holding the cores it may run on) and, before each block or decoded
token but at most every ``interval`` seconds, takes ``its cores // (1 + live peers sharing a core)``
threads. A process that starts or ends is seen by the others within ``interval``; a file whose
process died (SIGKILL) is removed by whoever notices. ``torch.set_num_threads`` must be called from
the thread that runs the model (OpenMP's thread count is per calling thread), hence a hook the
engine calls between forwards rather than a background thread.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import tempfile
import time
from pathlib import Path

import torch

from kvtool.runtime.model import usable_cores


def default_directory() -> Path:
    """Per-user registry shared by every kvtool of that user (whatever its ``KVTOOL_HOME``)."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"kvtool-{uid}" / "procs"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class CoreShare:
    """One process's registration; ``rebalance()`` between forwards keeps its thread count fair."""

    def __init__(self, directory: Path | None = None, interval: float = 0.5) -> None:
        self.directory = directory or default_directory()
        self.interval = interval
        self.cores = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(usable_cores()))
        self.pid = os.getpid()
        self.path: Path | None = None
        self.threads = torch.get_num_threads()
        self.peers = 0
        self.min_threads = self.threads
        self._next = 0.0
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / f".{self.pid}.tmp"
            tmp.write_text(",".join(str(c) for c in sorted(self.cores)))
            tmp.replace(self.directory / str(self.pid))
            self.path = self.directory / str(self.pid)
        except OSError:  # an unwritable temp directory: no sharing, all usable cores (the old default)
            self.path = None

    def count_peers(self) -> int:
        """Live kvtool processes other than this one that may run on one of this process's cores."""
        if self.path is None:
            return 0
        peers = 0
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            return 0
        for entry in entries:
            if not entry.name.isdigit() or int(entry.name) == self.pid:
                continue
            pid = int(entry.name)
            if not _alive(pid):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                continue
            try:
                theirs = {int(c) for c in Path(entry.path).read_text().split(",") if c.strip()}
            except (OSError, ValueError):
                theirs = self.cores  # unreadable: assume it shares
            if theirs & self.cores:
                peers += 1
        return peers

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
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()
            self.path = None


_SHARE: CoreShare | None = None


def process_share() -> CoreShare:
    """This process's one registration (created on first use, removed at exit)."""
    global _SHARE
    if _SHARE is None:
        _SHARE = CoreShare()
        atexit.register(_SHARE.close)
    return _SHARE
