"""The archive: a second level of memory for what eviction drops (ArkVale, Quest, InfLLM).

Every head of a group keeps exactly ``capacity`` tokens, so every eviction drops the same number of
tokens per head and a group's archive grows in lockstep across its heads::

    GroupArchive (one per bounded head group), three append-only stores
      store        rows [archived, 2·h·d] in the model dtype: K (post-RoPE at the ORIGINAL position) then V
      index        rows [archived, h] int32: the original stream position of each archived token
      summaries    rows [completed pages, 2·h·d] float16: key minima then maxima, rounded outward
      tail         the open page's summary (the only part held in memory, on the keys' device)

Tokens are cut into pages of ``page_size`` consecutive archived tokens. A page's summary is the
per-channel minimum and maximum of its keys, so for any query q (Quest, ICML 2024)
``Σ_d max(q_d·min_d, q_d·max_d) = relu(q)·max + min(q, 0)·min ≥ q·k`` for every key k of the page:
two matrix products score every page of a head against every query row.

The backing store is pluggable: :class:`MemoryStore` (a growing host tensor, tests) or
:class:`FileStore` (an unlinked temporary file written with ``pwrite`` and read through a short-lived
``mmap``): the process RSS stays flat however long the document (positions and summaries live in
the files too, not in host memory), and the file vanishes with the process, even on Ctrl-C, SIGTERM
or SIGKILL, because it has no name after it is created. The owner closes the descriptors when its
cache is released (``recall.attach`` registers the close).
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import tempfile
import weakref
from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from kvtool.errors import KvtoolError, UsageError

DEFAULT_PAGE_SIZE = 32
#: page summaries in float16 (rounded outward): half the host memory per evicted token of float32
SUMMARY_DTYPE = torch.float16
#: archived tokens per head whose exact scores recall holds at once; past it, with absolute positions
#: only the pages Quest's bound ranks best are scored (bounded work per question), and with compact
#: positions every token is, in two passes (the bound's summaries sit at original positions, the
#: question at compact ones, so the bound does not hold across the two frames)
SCAN = 32768
#: the held scores ([h, rows, scanned] float32) are recall's largest transient buffer: a long
#: question holds fewer tokens' scores rather than allocate more than this
SCAN_BYTES = 64 << 20
#: pages whose keys are read at once while scanning
SCAN_CHUNK = 16
#: completed pages whose summaries are read at once while bounding
SUMMARY_CHUNK = 4096


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
        with mmap.mmap(self.fd, self.rows * self.row_bytes, access=mmap.ACCESS_READ) as mm:
            view = np.frombuffer(mm, dtype=np.uint8).reshape(self.rows, self.row_bytes)
            out = torch.from_numpy(view[index.numpy()])  # fancy indexing copies: nothing points into the map
            del view
        return out

    def close(self) -> None:
        if self.fd is not None:
            self._release()  # closes the descriptor once, whoever asks first
            self.fd = None
        self.rows = 0


class GroupArchive:
    """The archived tokens of one head group, in lockstep across its heads, with page summaries.

    Three append-only stores (files on a real run), so host memory does not grow with the document:
    ``store`` the K/V rows, ``index`` each token's original position per head (int32), ``summaries``
    each completed page's per-channel key minima then maxima (float16, rounded outward). Only the open
    (last, incomplete) page's summary, ``tail``, is held in memory, on the keys' device.

    Appending runs once per layer and block, so it makes no host sync. The data flow of one append::

        keys, values, positions (model device)
          → K/V rows (dtype cast or int8 quantization), positions as int32, summaries of the pages the
            keys complete, new tail                                      all on that device
          → packed into ONE byte buffer, copied with ONE copy into ``staging``, a host buffer kept on
            the archive and grown geometrically (pinned and non-blocking when the device is CUDA,
            a CUDA event marks the copy's end)
          → :meth:`flush` writes the staged bytes to the three stores (``pwrite`` for files)

    The flush is deferred: the next append (or any read: ``read``, ``positions_of``, ``all_positions``,
    ``page_summaries``, ``state_dict``) does it first, so the copy overlaps the next block's compute
    and the wait for its event is normally already over. ``nbytes`` counts the staged bytes without
    writing them. ``close`` drops them with the stores, which nothing can read any more.
    """

    def __init__(self, num_heads: int, head_dim: int, dtype: torch.dtype, page_size: int,
                 new_store: Callable[[int], ArchiveStore]) -> None:
        if page_size < 1:
            raise UsageError(f"archive page size must be at least 1 (got {page_size})")
        self.h = num_heads
        self.d = head_dim
        self.dtype = dtype
        self.page_size = page_size
        self.store = new_store(self.row_bytes(num_heads, head_dim, dtype))
        self.index = new_store(4 * num_heads)
        self.summaries = new_store(2 * num_heads * head_dim * SUMMARY_DTYPE.itemsize)
        self.length = 0  # archived tokens per head
        self.empty = _empty_page(num_heads, head_dim)  # never written to: shared by every fresh open page
        self.tail = self.empty  # [2, h, d]: min, max of the open page's keys
        self.staging = torch.empty(0, dtype=torch.uint8)  # the last append's bytes, on their way to the stores
        self.pinned = False  # whether ``staging`` is pinned memory
        self.staged: tuple[int, int, int] | None = None  # rows staged for store, index, summaries (None: none)
        self.copied: torch.cuda.Event | None = None  # recorded after the staging copy (CUDA only)

    @staticmethod
    def row_bytes(num_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes per archived token: K and V of every head (int8: plus a float32 scale per head for each)."""
        if dtype == torch.int8:
            return 2 * num_heads * (head_dim + 4)
        return 2 * num_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    @property
    def pages(self) -> int:
        return -(-self.length // self.page_size)

    def nbytes(self) -> int:
        """Bytes held: K/V rows, positions and page summaries (in the stores or staged) and the open page."""
        stores = (self.store, self.index, self.summaries)
        staged = self.staged or (0, 0, 0)  # counted, not written: no flush (and no sync) to report a size
        held = sum((st.rows + k) * st.row_bytes for st, k in zip(stores, staged, strict=True))
        return held + self.tail.numel() * self.tail.element_size()

    # -- appending (in inference mode, as the engine runs: every buffer written here is an inference tensor) --
    @torch.inference_mode()
    def append(self, keys: Tensor, values: Tensor, positions: Tensor) -> None:
        """Archive ``n`` tokens per head: keys/values [h, n, d] (keys at original positions), positions [h, n].

        Computed on the keys' device and staged (class docstring): no host sync, the stores get the
        bytes at the next append or read.
        """
        n = keys.shape[1]
        if n == 0:
            return
        self.flush()  # the previous append's bytes: their copy has overlapped the compute since
        keys, values = keys.detach(), values.detach()
        if self.dtype == torch.int8:
            rows = _quantize(keys, values)
        else:
            kv = torch.empty(n, 2, self.h, self.d, dtype=self.dtype, device=keys.device)  # one copy each
            kv[:, 0].copy_(keys.transpose(0, 1))
            kv[:, 1].copy_(values.transpose(0, 1))
            rows = kv.view(n, -1).view(torch.uint8)
        summ, done = self._summarise(keys)  # [h, 2, pages, d]
        self._stage(rows, _as_rows(positions.t(), torch.int32), _as_rows(summ[:, :, :done].permute(2, 1, 0, 3)))
        self.tail = summ[:, :, done].transpose(0, 1).contiguous() if done < summ.shape[2] else self.empty
        self.length += n

    def _summarise(self, keys: Tensor) -> tuple[Tensor, int]:
        """Summaries [h, 2, pages, d] of the pages ``keys`` [h, n, d] touch (on their device), and how many
        of those pages they complete.

        The pages are the open one (its summary so far is ``tail``; none when the last block ended on a
        page boundary), the whole pages after it, and a new open page with what is left (views of the
        keys: no padding). One pass per statistic, rounded once.
        """
        n, P, lead = keys.shape[1], self.page_size, self.length % self.page_size
        kf = keys.float()
        first = min(n, P - lead) if lead else 0
        full = (n - first) // P
        body = kf[:, first : first + full * P].reshape(self.h, full, P, self.d)
        lo, hi = [body.amin(2)], [body.amax(2)]
        if first:
            tail = self.tail.to(kf.device, non_blocking=True).float()  # already there unless just loaded
            lo.insert(0, torch.minimum(kf[:, :first].amin(1), tail[0]).unsqueeze(1))
            hi.insert(0, torch.maximum(kf[:, :first].amax(1), tail[1]).unsqueeze(1))
        last = kf[:, first + full * P :]
        if last.shape[1]:
            lo.append(last.amin(1, keepdim=True))
            hi.append(last.amax(1, keepdim=True))
        summ = _round_outward(torch.stack((torch.cat(lo, 1), torch.cat(hi, 1)), dim=1))
        return summ, (lead + n) // P

    def _stage(self, *parts: Tensor) -> None:
        """Copy the rows for ``store``, ``index`` and ``summaries`` (uint8 [rows, row bytes] each, on one
        device) into ``staging`` with one copy, packed in that order; :meth:`flush` writes them."""
        flat = [p.reshape(-1) for p in parts]
        total = sum(p.numel() for p in flat)
        device = flat[0].device
        cuda = device.type == "cuda"
        if total > self.staging.numel() or (cuda and not self.pinned):
            self.staging = torch.empty(max(total, 2 * self.staging.numel(), 1 << 16), dtype=torch.uint8,
                                       pin_memory=cuda)
            self.pinned = cuda
        dest = self.staging[:total]
        if device.type == "cpu":
            torch.cat(flat, out=dest)
        else:
            dest.copy_(torch.cat(flat), non_blocking=cuda)
        if cuda:
            if self.copied is None:
                self.copied = torch.cuda.Event()
            self.copied.record(torch.cuda.current_stream(device))
        self.staged = (parts[0].shape[0], parts[1].shape[0], parts[2].shape[0])

    @torch.inference_mode()
    def flush(self) -> None:
        """Write the staged bytes of the last append to the stores, once their copy has landed.

        The staged rows are taken first, so a failed write (a full disk) is not repeated by the next call.
        """
        if self.staged is None:
            return
        counts, self.staged = self.staged, None
        if self.copied is not None:
            self.copied.synchronize()
        at = 0
        for st, k in zip((self.store, self.index, self.summaries), counts, strict=True):
            if k:
                st.append(self.staging[at : at + k * st.row_bytes].view(k, st.row_bytes))
            at += k * st.row_bytes

    def page_summaries(self, first: int = 0, last: int | None = None) -> tuple[Tensor, Tensor]:
        """Key minima and maxima [h, pages, d] (float16, CPU) of pages ``first`` … ``last`` − 1 (default: all)."""
        self.flush()
        last = self.pages if last is None else last
        done = min(last, self.summaries.rows)
        rows = self.summaries.read(torch.arange(first, done)) if done > first else torch.empty(
            0, self.summaries.row_bytes, dtype=torch.uint8)
        s = rows.view(SUMMARY_DTYPE).view(-1, 2, self.h, self.d).permute(1, 2, 0, 3)  # [2, h, pages, d]
        if last > self.summaries.rows:  # the open page
            s = torch.cat((s, self.tail.cpu().unsqueeze(2)), dim=2)
        return s[0], s[1]

    def positions_of(self, index: Tensor) -> Tensor:
        """Original positions [h, T] (int64) of archive indices ``index`` [h, T]."""
        self.flush()
        uniq, inverse = torch.unique(index, return_inverse=True)
        return self._positions(uniq, inverse)

    def _positions(self, uniq: Tensor, inverse: Tensor) -> Tensor:
        rows = self.index.read(uniq).view(torch.int32)  # [u, h]
        return rows[inverse, torch.arange(self.h).unsqueeze(1)].long()

    def all_positions(self) -> Tensor:
        """Every archived token's original position per head: [h, archived] int64."""
        self.flush()
        return self.index.read(torch.arange(self.length)).view(torch.int32).t().long()

    # -- recall -------------------------------------------------------------------------------------
    def page_scores(self, queries: Tensor) -> Tensor:
        """Upper bound of q·k over each page, maximised over the query rows: [h, pages].

        ``queries`` [h, r, d] (float, original-position frame), all rows of the query heads that share
        each KV head. Summaries are read ``SUMMARY_CHUNK`` pages at a time.
        """
        q = queries.float().cpu()
        pos, neg = q.clamp(min=0), q.clamp(max=0)
        out = torch.empty(self.h, self.pages)
        for first in range(0, self.pages, SUMMARY_CHUNK):
            last = min(first + SUMMARY_CHUNK, self.pages)
            kmin, kmax = self.page_summaries(first, last)
            bound = torch.bmm(pos, kmax.float().transpose(1, 2)) + torch.bmm(neg, kmin.float().transpose(1, 2))
            out[:, first:last] = bound.nan_to_num_(nan=float("inf")).amax(1)
        return out

    def candidate_pages(self, queries: Tensor, scan: int | None) -> Tensor:
        """The pages to score exactly, per head [h, k] in file order: all of them, or (an archive longer than
        ``scan`` tokens) the ``scan // P`` whose Quest bound is highest, so the work per question stays bounded.

        ``scan=None``: all pages whatever the length. The bound holds only where the queries and the
        summaries share a frame (absolute positions); compact-mode recall passes None (``recall.recall``).
        """
        if scan is None or self.length <= scan:
            return torch.arange(self.pages).expand(self.h, -1)
        order = torch.argsort(self.page_scores(queries), dim=1, descending=True, stable=True)  # [h, pages]
        return torch.sort(order[:, : max(1, scan // self.page_size)], dim=1).values  # file order: reads run forwards

    def scores(self, queries: Tensor, pages: Tensor,
               place: Callable[[Tensor, Tensor], Tensor] | None = None) -> Iterator[tuple[Tensor, Tensor]]:
        """Exact ``q·k`` of the tokens on ``pages`` [h, k], ``SCAN_CHUNK`` pages at a time.

        Yields the tokens' original positions [h, a] and their scores per query row [h, r, a] (−inf for
        a tail page's missing tokens): the transient buffer is one chunk, however many pages.
        ``place(keys, positions)`` moves keys into the queries' frame first (compact positions).
        """
        P = self.page_size
        q = queries.float().cpu()
        for lo in range(0, pages.shape[1], SCAN_CHUNK):
            idx = (pages[:, lo : lo + SCAN_CHUNK].unsqueeze(-1) * P + torch.arange(P)).reshape(self.h, -1)
            valid = idx < self.length
            keys, _, pos = self.read(idx.clamp(max=self.length - 1), values=False)
            if place is not None:
                keys = place(keys, pos)
            yield pos, torch.bmm(q, keys.float().transpose(1, 2)).masked_fill_(~valid.unsqueeze(1), float("-inf"))

    def top_by_position(self, relevance: Tensor, tokens: int) -> Tensor:
        """The ``min(tokens, archived)`` archived tokens per head whose positions rank best in ``relevance``.

        ``relevance`` [stream positions] is shared by every head of every layer; returns ascending
        archive indices [h, T] (a group's heads must hold equal counts).
        """
        key = relevance[self.all_positions()]
        top = torch.topk(key, min(tokens, self.length), dim=1, sorted=False).indices
        return torch.sort(top, dim=1).values

    def touched(self, index: Tensor) -> int:
        """Pages that archive indices ``index`` [h, T] fall in, summed over heads."""
        pages = torch.zeros(self.h, self.pages, dtype=torch.bool)
        pages.scatter_(1, index // self.page_size, True)
        return int(pages.sum())

    def read(self, index: Tensor, values: bool = True) -> tuple[Tensor, Tensor | None, Tensor]:
        """Keys, values [h, T, d] (None unless ``values``) and positions [h, T] of archive indices ``index`` [h, T]."""
        self.flush()
        uniq, inverse = torch.unique(index, return_inverse=True)
        rows = self.store.read(uniq)
        rows = _dequantize(rows, self.h, self.d) if self.dtype == torch.int8 else rows.view(self.dtype).view(
            -1, 2, self.h, self.d)
        heads = torch.arange(self.h).unsqueeze(1)
        keys = rows[:, 0][inverse, heads]
        vals = rows[:, 1][inverse, heads] if values else None
        return keys, vals, self._positions(uniq, inverse)  # the same rows: one unique, not two

    # -- persistence (kvtool/runtime/store.py writes these into a sibling of the .kvc) ------------------
    def state_dict(self, prefix: str) -> dict[str, Tensor]:
        """Rows, positions [h, n] and page summaries [h, pages, d] of the archived tokens (reads the stores)."""
        self.flush()
        kmin, kmax = self.page_summaries()
        return {
            f"{prefix}.rows": self.store.read(torch.arange(self.store.rows)),
            f"{prefix}.positions": self.all_positions().to(torch.int32),
            f"{prefix}.kmin": kmin.contiguous(),
            f"{prefix}.kmax": kmax.contiguous(),
        }

    def load_state_dict(self, tensors: dict[str, Tensor], prefix: str, page_size: int) -> None:
        """Append a saved archive to this empty one (page size as saved: the summaries depend on it)."""
        if self.length:
            raise ValueError("an archive can only be loaded into an empty one")
        rows, pos = tensors[f"{prefix}.rows"], tensors[f"{prefix}.positions"].to(torch.int32)
        kmin, kmax = tensors[f"{prefix}.kmin"], tensors[f"{prefix}.kmax"]
        n = pos.shape[1]
        if (rows.shape != (n, self.store.row_bytes) or pos.shape[0] != self.h
                or kmin.shape != (self.h, -(-n // page_size), self.d) or kmax.shape != kmin.shape):
            raise ValueError(f"{prefix}: archive shapes do not match this cache")
        self.page_size = page_size
        self.store.append(rows.contiguous())
        self.index.append(_as_rows(pos.t()))
        # archives saved before the summaries were float16 hold float32 ones: rounded outward, as on append
        summ = _round_outward(torch.stack((kmin.float(), kmax.float()), dim=1))
        done = n // page_size
        if done:
            self.summaries.append(_as_rows(summ[:, :, :done].permute(2, 1, 0, 3)))
        self.tail = summ[:, :, done].transpose(0, 1).contiguous() if n % page_size else self.empty
        self.length = n

    def close(self) -> None:
        """Close the stores; staged bytes are dropped with them (nothing can read either afterwards)."""
        self.staged = None
        self.staging = torch.empty(0, dtype=torch.uint8)  # a copy still in flight keeps its pinned block
        for st in (self.store, self.index, self.summaries):
            st.close()


def _as_rows(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``t`` [n, …] as store rows [n, bytes], in ``dtype`` (default: its own), on ``t``'s device.

    One dense copy does both (transposed views cannot be viewed as bytes).
    """
    out = torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device)
    out.copy_(t)
    return out.view(torch.uint8).view(t.shape[0], math.prod(t.shape[1:]) * out.element_size())


def _empty_page(h: int, d: int) -> Tensor:
    """The summary of a page with no keys yet: min +inf, max −inf ([2, h, d])."""
    return torch.stack((torch.full((h, d), float("inf")), torch.full((h, d), float("-inf")))).to(SUMMARY_DTYPE)


def _quantize(keys: Tensor, values: Tensor) -> Tensor:
    """int8 rows: K and V [h, n, d] → [n, 2·h·d] int8 then [n, 2·h] float32 scales, as bytes.

    Symmetric per token and head (absmax / 127): a key's error is at most half its scale per channel.
    """
    n = keys.shape[1]
    kv = torch.stack((keys, values)).detach().float()  # [2, h, n, d], on their device
    scale = kv.abs().amax(-1, keepdim=True).div_(127.0).clamp_(min=torch.finfo(torch.float32).tiny)
    q = kv.div(scale).round_().clamp_(-127, 127).to(torch.int8)
    data = q.permute(2, 0, 1, 3).reshape(n, -1).view(torch.uint8)
    scales = scale.squeeze(-1).permute(2, 0, 1).reshape(n, -1).contiguous().view(torch.uint8)
    return torch.cat((data, scales), dim=1)


def _dequantize(rows: Tensor, h: int, d: int) -> Tensor:
    """The inverse of :func:`_quantize`: [u, row_bytes] bytes → [u, 2, h, d] float32."""
    q = rows[:, : 2 * h * d].view(torch.int8).view(-1, 2, h, d)
    scale = rows[:, 2 * h * d :].contiguous().view(torch.float32).view(-1, 2, h, 1)
    return q.float() * scale


def _round_outward(x: Tensor) -> Tensor:
    """Summaries ``x`` [h, 2, pages, d] (minima, then maxima) in ``SUMMARY_DTYPE``, rounded outward.

    Minima round down and maxima up, so the bound still holds for every key. Past float16's range a
    value becomes ±inf, which only loosens the bound (``page_scores`` turns the 0·inf of a zero query
    channel back into a valid bound).
    """
    outward = torch.arange(-1.0, 2.0, 2.0, device=x.device).view(1, 2, 1, 1)  # minima down, maxima up
    r = x.to(SUMMARY_DTYPE)
    wrong = (r.float() - x).mul_(outward) < 0  # rounded inward
    step = torch.nextafter(r, outward.mul(float("inf")).to(SUMMARY_DTYPE).expand_as(r))
    return torch.where(wrong, step, r)


def dropped_indices(keep: Tensor, n: int) -> Tensor:
    """The complement of ``keep`` [h, c] in range(n), ascending: [h, n − c] (no host sync)."""
    h, c = keep.shape
    mask = torch.ones(h, n, dtype=torch.uint8, device=keep.device)
    mask.scatter_(1, keep, 0)
    return torch.sort(mask, dim=1, descending=True, stable=True).indices[:, : n - c]
