"""Where recall's archive goes, and whether it fits there: the check behind recall's default.

``--recall auto`` (the default) turns recall on for ``ask`` when the archive of the document's
evicted tokens fits the archive directory with room to spare. The archive's size is predicted
before reading (evicted tokens × bytes per archived token); a document whose length is unknown
until it is read (stdin) or whose estimate was low is watched while it is read: when the disk
runs short the archive is dropped and the answers go without recall, with one line that says so.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from kvtool.core.archive_stores import filesystem_bytes
from kvtool.runtime.memory import format_bytes

#: the archive leaves at least this much of its filesystem free ...
RESERVE_BYTES = 1 << 30
#: ... and this share of it, up to RESERVE_CAP
RESERVE_SHARE = 0.05
RESERVE_CAP = 16 << 30
#: a prediction must fit this many times over (a streamed document's length is an estimate)
MARGIN = 1.25
#: while reading, free space is looked at again after this much archive growth
WATCH_STEP = 64 << 20


def archive_dir() -> str:
    """KVTOOL_ARCHIVE_DIR, else the system's temporary directory (TMPDIR)."""
    return os.environ.get("KVTOOL_ARCHIVE_DIR") or tempfile.gettempdir()


@dataclass(frozen=True)
class Disk:
    """Free and total bytes of a directory's filesystem, and what the archive must leave free there."""

    free: int
    total: int

    @property
    def reserve(self) -> int:
        return max(RESERVE_BYTES, min(RESERVE_CAP, int(RESERVE_SHARE * self.total)))

    @property
    def usable(self) -> int:
        return max(0, self.free - self.reserve)


def disk(directory: str) -> Disk | None:
    """The filesystem of ``directory`` (None when it cannot be read: then nothing is promised)."""
    fs = filesystem_bytes(directory)
    return None if fs is None else Disk(free=fs[0], total=fs[1])


def fits(predicted: int, directory: str) -> tuple[bool, str]:
    """Whether an archive of ``predicted`` bytes fits ``directory`` with the margin, and why (one line)."""
    d = disk(directory)
    if d is None:
        return False, f"the free space of {directory} cannot be read"
    need = int(predicted * MARGIN)
    where = f"{directory} has {format_bytes(d.free)} free and keeps {format_bytes(d.reserve)}"
    if need > d.usable:
        return False, f"its archive (~{format_bytes(predicted)}) does not fit: {where}"
    return True, f"archive ~{format_bytes(predicted)} on disk ({where})"


class DiskWatch:
    """Looks at free space again after every ``WATCH_STEP`` bytes of archive growth (one ``statvfs``)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.checked = 0  # archive bytes at the last look

    def short(self, archive_bytes: int) -> str | None:
        """None while the disk keeps its reserve; else the reason, in words."""
        if archive_bytes - self.checked < WATCH_STEP:
            return None
        self.checked = archive_bytes
        d = disk(self.directory)
        if d is None or d.free >= d.reserve:
            return None
        return (f"{self.directory} is down to {format_bytes(d.free)} free (the archive keeps "
                f"{format_bytes(d.reserve)}) after {format_bytes(archive_bytes)} of archive")
