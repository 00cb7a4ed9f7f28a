"""Where an archive's rows live: append-only rows of bytes, in memory or in an unlinked file.

:class:`MemoryStore` (a growing host tensor: tests, small documents) and :class:`FileStore` (an unlinked
temporary file written with ``pwrite`` and read through a short-lived ``mmap``): the process RSS stays
flat however long the document, and the file vanishes with the process, even on Ctrl-C, SIGTERM or
SIGKILL, because it has no name after it is created. ``reserve_descriptors`` makes sure the files a
read's archives keep open can be opened before reading starts.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import tempfile
import weakref
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from kvtool.errors import KvtoolError, UsageError


class ArchiveStore(Protocol):
    """Append-only rows of bytes (one row per archived token of a group)."""

    row_bytes: int
    rows: int
    where: str

    def append(self, rows: Tensor) -> None: ...  # [n, row_bytes] uint8 on the CPU

    def read(self, index: Tensor) -> Tensor: ...  # [k] row numbers → [k, row_bytes] uint8

    def close(self) -> None: ...


class MemoryStore:
    """Rows in a host tensor that doubles when full (tests, small documents)."""

    def __init__(self, row_bytes: int) -> None:
        self.row_bytes = row_bytes
        self.rows = 0
        self.where = "memory"
        self.buf = torch.empty(0, row_bytes, dtype=torch.uint8)

    def append(self, rows: Tensor) -> None:
        n = rows.shape[0]
        if self.rows + n > self.buf.shape[0]:
            grown = torch.empty(max(2 * self.buf.shape[0], self.rows + n, 256), self.row_bytes, dtype=torch.uint8)
            grown[: self.rows] = self.buf[: self.rows]
            self.buf = grown
        self.buf[self.rows : self.rows + n] = rows
        self.rows += n

    def read(self, index: Tensor) -> Tensor:
        return self.buf[: self.rows].index_select(0, index)

    def close(self) -> None:
        self.buf = torch.empty(0, self.row_bytes, dtype=torch.uint8)
        self.rows = 0


def filesystem_bytes(directory: str) -> tuple[int, int] | None:
    """(free, total) bytes of ``directory``'s filesystem for an unprivileged writer; None when unreadable."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def _free(directory: str) -> str:
    """Free space of ``directory``'s filesystem, as text ("unknown" when it cannot be read)."""
    fs = filesystem_bytes(directory)
    return "unknown" if fs is None else f"{fs[0] / 2**20:,.0f} MiB"


#: files a group's archive keeps open with ``FileStore``: rows, their positions, page summaries
FILES_PER_GROUP = 3
#: descriptors left free for the rest of a run (model files, /proc reads, output) beside the archive's
DESCRIPTOR_MARGIN = 16


def reserve_descriptors(needed: int) -> None:
    """Make sure ``needed`` more files can be opened for the archive, or refuse with the figures.

    The soft ``RLIMIT_NOFILE`` is raised towards the hard limit when that is all it takes (what a
    shell's ``ulimit -n`` can do too); past the hard limit the run stops before reading, with one line
    that says how many files recall keeps open, instead of failing mid-read on whatever opens next.
    """
    import resource

    fd_dir = "/proc/self/fd"
    if not os.path.isdir(fd_dir):
        return
    in_use = len(os.listdir(fd_dir))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = in_use + needed + DESCRIPTOR_MARGIN
    if soft == resource.RLIM_INFINITY or want <= soft:
        return
    if hard != resource.RLIM_INFINITY and want > hard:
        raise UsageError(f"recall keeps {needed} archive files open ({FILES_PER_GROUP} per layer), but only "
                         f"{max(0, hard - in_use - DESCRIPTOR_MARGIN)} more may be opened (open-file limit "
                         f"{hard}, ulimit -n): raise the limit or turn recall off", field="recall")
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


class FileStore:
    """Rows appended to an unlinked temporary file in ``directory`` (nothing is left behind, ever)."""

    def __init__(self, row_bytes: int, directory: str | os.PathLike[str]) -> None:
        self.row_bytes = row_bytes
        self.rows = 0
        self.where = str(directory)
        try:
            fd, path = tempfile.mkstemp(prefix="kvtool-archive-", suffix=".tmp", dir=directory)
        except OSError as e:
            raise UsageError(f"cannot create the recall archive in {directory}: {e.strerror or e}",
                             field="recall") from None
        os.unlink(path)  # the descriptor keeps the data; the name is gone before anything is written
        self.fd: int | None = fd
        self._release = weakref.finalize(self, os.close, fd)  # a store dropped unclosed still closes its file

    def append(self, rows: Tensor) -> None:
        assert self.fd is not None
        data = memoryview(rows.numpy()).cast("B")  # no copy: the rows' own bytes
        offset = self.rows * self.row_bytes
        try:
            written = os.pwrite(self.fd, data, offset)
            while written < len(data):
                written += os.pwrite(self.fd, data[written:], offset + written)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):  # a full disk is a runtime condition (exit 1)
                raise KvtoolError(f"cannot write the recall archive in {self.where}: the disk is full "
                                  f"({_free(self.where)} free; free some space or turn recall off)") from None
            raise UsageError(f"cannot write the recall archive in {self.where}: {e.strerror or e} "
                             "(turn recall off or choose another temp directory)", field="recall") from None
        self.rows += rows.shape[0]

    def read(self, index: Tensor) -> Tensor:
        assert self.fd is not None
        if self.rows == 0:
            return torch.empty(0, self.row_bytes, dtype=torch.uint8)
        mm = mmap.mmap(self.fd, self.rows * self.row_bytes, access=mmap.ACCESS_READ)
        view = None
        try:
            view = np.frombuffer(mm, dtype=np.uint8).reshape(self.rows, self.row_bytes)
            return torch.from_numpy(view[index.numpy()])  # fancy indexing copies: nothing points into the map
        finally:
            # the view goes before the map closes, also when a signal (SIGTERM, Ctrl-C) interrupts the copy: a map
            # closed under a live view raises BufferError, which would replace the interruption
            del view
            with contextlib.suppress(BufferError):
                mm.close()

    def close(self) -> None:
        if self.fd is not None:
            self._release()  # closes the descriptor once, whoever asks first
            self.fd = None
        self.rows = 0
