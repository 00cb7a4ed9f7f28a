"""The recall archive beside a ``.kvc``: what eviction dropped, saved and loaded in chunks.

The archive file ``<cache>.<id>.archive`` is a ``.kvc``-format file (its own ``tensors_sha256``) with, per
head group ``l{layer}.g{group}`` that archived anything: ``.rows`` (uint8 [archived, row bytes]), ``.positions``
(int32 [h, archived]) and ``.kmin``/``.kmax`` (page summaries [h, pages, d]). The cache names it in its
metadata (``archive.file``), with the archive's checksum and settings, and is renamed into place only
after the archive is complete and fsynced, so a cache and its archive always belong together.

Saving and loading stream the rows (nearly all the bytes) in chunks of ``CHUNK_BYTES``; a group's
positions and page summaries (a few bytes per archived token) are handled whole, one group at a time.
Loading never fails a run: a missing, foreign, damaged or unusable archive is detached from the cache,
which then answers without recall, and the caller is told why in one line that echoes nothing of the file.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvtool.config import ARCHIVE_DTYPES
from kvtool.errors import KvtoolError, UsageError
from kvtool.fileio import confined_name, open_regular
from kvtool.kvc import write as kvc_write
from kvtool.kvc.format import KvcHeader, TensorDigest, is_int, new_archive_name, read_header
from kvtool.kvc.write import Entry, Progress, st_code, tensor_bytes

if TYPE_CHECKING:
    from torch import Tensor

    from kvtool.core.archive import GroupArchive
    from kvtool.core.cache import BoundedCache

#: largest archive page size a file may claim (the engine's pages are tens of tokens)
MAX_PAGE_SIZE = 1 << 20
#: the largest recall size a file may record (recall slots are sized by what the archive holds, at most
#: this: a bound for a hostile value, not a limit anyone meets)
MAX_RECALL = 1 << 24
_PARTS = ("kmax", "kmin", "positions", "rows")  # name order: the order of the checksum


class ArchiveUnusable(Exception):
    """Why an archive cannot be used; the message is kvtool's own words, never bytes from the file."""


def groups_with_archive(cache: BoundedCache) -> list[tuple[str, GroupArchive]]:
    """``(prefix, archive)`` of every group that archived something, in tensor-name order."""
    out = [(f"l{li}.g{gi}", g.archive) for li, layer in enumerate(cache.layers) for gi, g in enumerate(layer.groups)
           if g.archive is not None and g.archive.length]
    return sorted(out, key=lambda item: item[0])


# -- saving -----------------------------------------------------------------------------------------------------
def _row_chunks(a: GroupArchive) -> Iterator[memoryview]:
    import torch

    step = max(1, kvc_write.CHUNK_BYTES // a.store.row_bytes)
    for lo in range(0, a.store.rows, step):
        yield tensor_bytes(a.store.read(torch.arange(lo, min(lo + step, a.store.rows))))


def _entries(prefix: str, a: GroupArchive) -> list[Entry]:
    """The four tensors of one group archive, produced only when the writer reaches them."""
    import torch

    a.flush()  # the last append's staged rows: the store is read directly below

    from kvtool.core.archive import SUMMARY_DTYPE

    def summary(which: int) -> tuple[memoryview]:
        return (tensor_bytes(a.page_summaries()[which].contiguous()),)

    code = st_code(SUMMARY_DTYPE)
    return [
        Entry(f"{prefix}.rows", "U8", [a.store.rows, a.store.row_bytes], lambda: _row_chunks(a)),
        Entry(f"{prefix}.positions", "I32", [a.h, a.length],
              lambda: (tensor_bytes(a.all_positions().to(torch.int32).contiguous()),)),
        Entry(f"{prefix}.kmin", code, [a.h, a.pages, a.d], lambda: summary(0)),
        Entry(f"{prefix}.kmax", code, [a.h, a.pages, a.d], lambda: summary(1)),
    ]


def save_archive(cache_path: str, cache: BoundedCache, progress: Progress | None = None) -> dict[str, Any] | None:
    """Write ``cache``'s archive beside ``cache_path`` under a fresh name; returns the cache's ``archive``
    metadata (None when nothing was archived). The caller writes the cache after this returns.
    ``progress(done, total)``: bytes written (``kvc_write.write_entries``)."""
    groups = groups_with_archive(cache)
    if not groups:
        return None
    directory = os.path.dirname(os.path.abspath(cache_path))
    name = new_archive_name(os.path.basename(cache_path))
    apath = os.path.join(directory, name)
    entries = [e for prefix, a in groups for e in _entries(prefix, a)]
    size = kvc_write.write_entries(apath, entries, {"archive_of": os.path.basename(cache_path)}, progress=progress)
    first = groups[0][1]
    return {
        "file": name,
        "tensors_sha256": read_header(apath).meta["tensors_sha256"],
        "bytes": int(size),
        "page_size": int(first.page_size),
        "dtype": str(first.dtype).removeprefix("torch."),
        "tokens": sum(a.length * a.h for _, a in groups),
        "pages": sum(a.pages * a.h for _, a in groups),
    }


def remove(cache_path: str, info: dict[str, Any] | None) -> None:
    """Remove the archive ``info`` names beside ``cache_path`` (a cache that was not written keeps none)."""
    if info:
        with contextlib.suppress(OSError, UsageError):
            os.unlink(os.path.join(os.path.dirname(os.path.abspath(cache_path)), confined_name(info["file"], "")))


# -- loading ------------------------------------------------------------------------------------------------------
def settings_of(info: Any) -> tuple[str, int, str | None, int | None]:
    """(file name, page size, dtype or None, recall size or None) of the ``archive`` metadata, checked.

    Raises ``ArchiveUnusable`` for anything a loader cannot use: a name with a directory part, a page size
    outside 1..``MAX_PAGE_SIZE``, an unknown dtype, a recall size outside 1..``MAX_RECALL`` (the default,
    256, is larger than a short document: recall slots are sized by what the archive holds), a missing
    checksum.
    """
    if not isinstance(info, dict):
        raise ArchiveUnusable("its archive metadata is not an object")
    try:
        name = confined_name(info.get("file"), "the archive name")
    except UsageError:
        raise ArchiveUnusable("its archive name is not a plain file name in the same directory") from None
    page, dtype, recall = info.get("page_size"), info.get("dtype"), info.get("recall")
    if not is_int(page, 1, MAX_PAGE_SIZE):
        raise ArchiveUnusable("its archive page size is invalid")
    if dtype is not None and (dtype not in ARCHIVE_DTYPES or dtype == "auto"):
        raise ArchiveUnusable("its archive dtype is invalid")
    if recall is not None and not is_int(recall, 1, MAX_RECALL):
        raise ArchiveUnusable("its recall size is invalid")
    if not isinstance(info.get("tensors_sha256"), str):
        raise ArchiveUnusable("its archive has no checksum")
    return name, page, dtype, recall


def load_archive(path: str, meta: dict[str, Any], cache: BoundedCache, progress: Progress | None = None) -> str | None:
    """Fill ``cache``'s (empty) group archives from the archive the ``.kvc`` at ``path`` names.

    Returns None, or a one-line warning when the questions will be answered without recall: then every
    group archive is closed and detached (the cache keeps evicting, archiving nothing).
    ``progress(done, total)``: archived row bytes read and hashed, ``total`` once all are checked.
    """
    info = meta.get("archive")
    if not info:
        detach(cache)
        return f"{path} has no archive of evicted tokens: answering without recall (prefill with --recall)"
    try:
        name, page_size, saved, _ = settings_of(info)
    except ArchiveUnusable as e:
        detach(cache)
        return f"{path}: {e}: answering without recall"
    ours = next((str(g.archive.dtype).removeprefix("torch.") for g in cache.groups() if g.archive is not None), None)
    if saved is not None and ours is not None and saved != ours:  # rows of another width: decided before reading
        detach(cache)
        return (f"{path}'s archive stores keys/values in {saved}, this run archives in {ours}: answering "
                f"without recall (pass --archive-dtype {saved})")
    apath = os.path.join(os.path.dirname(os.path.abspath(path)), name)
    try:
        _load(apath, info["tensors_sha256"], page_size, cache, progress)
    except ArchiveUnusable as e:
        detach(cache)
        return f"the archive {apath} is missing or damaged ({e}): answering without recall"
    return None


def detach(cache: BoundedCache) -> None:
    """Close every group archive and take it off its group: a cache without an archive, as with recall off."""
    for g in cache.groups():
        if g.archive is not None:
            g.archive.close()
            g.archive = None


def _load(apath: str, want: str, page_size: int, cache: BoundedCache, progress: Progress | None = None) -> None:
    try:
        fd = open_regular(apath)
    except OSError:
        raise ArchiveUnusable("no such regular file") from None
    try:
        try:
            header = read_header(apath, fd=fd)
        except KvtoolError:
            raise ArchiveUnusable("not a kvtool archive, or its header is damaged") from None
        if header.meta.get("tensors_sha256") != want:
            raise ArchiveUnusable("it belongs to another cache: its checksum differs")
        targets = dict(groups_of(cache))
        prefixes = _check_names(header, targets)
        digest = TensorDigest()
        total = sum(_row_bytes(header, prefix) for prefix in prefixes)
        count = _Counter(progress, total)
        for prefix in prefixes:
            _load_group(fd, header, prefix, targets[prefix], page_size, digest, count, cache.seen)
        if digest.hexdigest() != want:
            raise ArchiveUnusable("its data does not match its checksum")
        _check_seen(cache, targets)
        if progress is not None:
            progress(total, total)
    except OSError:
        raise ArchiveUnusable("it cannot be read") from None
    finally:
        os.close(fd)


def groups_of(cache: BoundedCache) -> list[tuple[str, GroupArchive]]:
    """``(prefix, archive)`` of every group with an archive, archived tokens or not."""
    return [(f"l{li}.g{gi}", g.archive) for li, layer in enumerate(cache.layers) for gi, g in enumerate(layer.groups)
            if g.archive is not None]


def _check_names(header: KvcHeader, targets: dict[str, GroupArchive]) -> list[str]:
    """The group prefixes in the file, in name order; each must be a group of this cache with all four parts."""
    prefixes = sorted({name.rsplit(".", 1)[0] for name in header.tensors})
    expected = {f"{p}.{part}" for p in prefixes for part in _PARTS}
    if set(header.tensors) != expected or any(p not in targets for p in prefixes):
        raise ArchiveUnusable("its tensors are not this cache's head groups")
    return prefixes


class _Deferred:
    """Stands in for a group archive's row store while ``load_state_dict`` takes the small tensors: the
    rows, nearly all the bytes, are appended to the real store in chunks instead (zero-width here)."""

    row_bytes = 0
    rows = 0
    where = "deferred"

    def append(self, rows: Tensor) -> None:
        pass

    def read(self, index: Tensor) -> Tensor:
        raise RuntimeError("a deferred store holds nothing")

    def close(self) -> None:
        pass


def _row_bytes(header: KvcHeader, prefix: str) -> int:
    start, end = header.tensors[f"{prefix}.rows"]["data_offsets"]
    return max(0, int(end) - int(start))


class _Counter:
    """Adds up the row bytes read across groups for a ``progress`` callback; never says ``total`` itself
    (the caller does, once the checksum matched)."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress, self.total, self.done = progress, total, 0
        if progress is not None:
            progress(0, total)

    def add(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(max(0, min(self.done, self.total - 1)), self.total)


def _check_seen(cache: BoundedCache, targets: dict[str, GroupArchive]) -> None:
    """Every token the cache says it has seen is kept or archived in each group that archives: recall sizes
    its per-position relevance by ``seen``, so a ``seen`` no file backs (2^30 over a short archive) is refused."""
    kept = {f"l{li}.g{gi}": g.length for li, layer in enumerate(cache.layers) for gi, g in enumerate(layer.groups)}
    for prefix, a in targets.items():
        if a.length and cache.seen > kept.get(prefix, 0) + a.length:
            raise ArchiveUnusable(f"it and the cache hold {kept.get(prefix, 0) + a.length:,} tokens of a head, but the "
                                  f"cache says {cache.seen:,} were read")


def _load_group(fd: int, header: KvcHeader, prefix: str, a: GroupArchive, page_size: int,
                digest: TensorDigest, count: _Counter | None = None, seen: int | None = None) -> None:
    """One group: its summaries and positions whole, then its rows in chunks, every byte hashed in order.

    Archived positions must lie before ``seen`` (recall indexes its relevance by position)."""
    import torch

    shape = header.tensors[f"{prefix}.positions"]["shape"]
    n = shape[1] if len(shape) == 2 else -1
    info = header.tensors[f"{prefix}.rows"]
    if shape != [a.h, n] or info["dtype"] != "U8" or info["shape"] != [n, a.store.row_bytes]:
        raise ArchiveUnusable("its shapes are not this cache's: another archive dtype or head layout")
    small = {part: _read_tensor(fd, header, f"{prefix}.{part}", digest) for part in _PARTS[:3]}
    pos = small["positions"]
    if seen is not None and pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= seen):
        raise ArchiveUnusable("its positions lie outside the tokens the cache has read")
    real = a.store
    a.store = _Deferred()  # type: ignore[assignment]
    try:
        tensors = {f"{prefix}.rows": torch.empty(n, 0, dtype=torch.uint8),
                   **{f"{prefix}.{part}": t for part, t in small.items()}}
        a.load_state_dict(tensors, prefix, page_size)
    except (ValueError, RuntimeError, KeyError) as e:
        raise ArchiveUnusable("its shapes are not this cache's archive shapes") from e
    finally:
        a.store = real
    digest.begin(f"{prefix}.rows", "U8", info["shape"])
    step = max(1, kvc_write.CHUNK_BYTES // a.store.row_bytes)
    start = header.data_start + info["data_offsets"][0]
    for lo in range(0, n, step):
        rows = min(step, n - lo)
        buf = _pread_exact(fd, rows * a.store.row_bytes, start + lo * a.store.row_bytes)
        digest.update(buf)
        if count is not None:
            count.add(len(buf))
        a.store.append(torch.frombuffer(buf, dtype=torch.uint8).view(rows, a.store.row_bytes))


def _read_tensor(fd: int, header: KvcHeader, name: str, digest: TensorDigest) -> Tensor:
    """A small tensor of the file, whole, hashed (float16/float32 summaries, int32 positions)."""
    import torch

    from kvtool.kvc.format import ST_NAMES

    info = header.tensors[name]
    if info["dtype"] not in ("F16", "F32", "I32"):
        raise ArchiveUnusable("it has tensors of an unexpected type")
    digest.begin(name, info["dtype"], info["shape"])
    start, stop = info["data_offsets"]
    buf = _pread_exact(fd, stop - start, header.data_start + start)
    digest.update(buf)
    dtype = getattr(torch, ST_NAMES[info["dtype"]])
    if stop == start:
        return torch.empty(info["shape"], dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).view(info["shape"]).clone()


def _pread_exact(fd: int, n: int, offset: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = os.preadv(fd, [view[got:]], offset + got)
        if k <= 0:
            raise ArchiveUnusable("it is shorter than its header says")
        got += k
    return buf

