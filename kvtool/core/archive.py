"""The archive: a second level of memory for what eviction drops (ArkVale, Quest, InfLLM).

Every head of a group keeps exactly ``capacity`` tokens, so every eviction drops the same number of
tokens per head and a group's archive grows in lockstep across its heads::

    GroupArchive (one per bounded head group), append-only stores
      store        rows [archived, 2·h·d] in the model dtype: K (post-RoPE at the ORIGINAL position) then V,
                   the key part and the value part of each row in two stores (``SplitRows``)
      index        rows [archived, h] int32: the original stream position of each archived token
      summaries    rows [completed pages, 2·h·d] float16: key minima then maxima, rounded outward
      tail         the open page's summary (the only part held in memory, on the keys' device)

Tokens are cut into pages of ``page_size`` consecutive archived tokens. A page's summary is the
per-channel minimum and maximum of its keys, so for any query q (Quest, ICML 2024)
``Σ_d max(q_d·min_d, q_d·max_d) = relu(q)·max + min(q, 0)·min ≥ q·k`` for every key k of the page:
two matrix products score every page of a head against every query row.

The backing store is pluggable (``kvtool/core/archive_stores.py``): :class:`MemoryStore` (a growing
host tensor, tests) or :class:`FileStore` (an unlinked temporary file), so the process RSS stays flat
however long the document (positions and summaries live in the files too, not in host memory). The
owner closes the descriptors when its cache is released (``recall.attach`` registers the close).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from functools import partial

import torch
from torch import Tensor

from kvtool.config import SCAN_CHUNK, SCORE_BYTES
from kvtool.core.archive_stores import ArchiveStore, SplitRows
from kvtool.core.archive_work import SUMMARY_DTYPE, AppendWork
from kvtool.core.staging import to_device
from kvtool.errors import UsageError

DEFAULT_PAGE_SIZE = 32
#: byte alignment of each part of an append's packed bytes (so each part can be viewed in its dtype)
ALIGN = 16
#: completed pages whose summaries are read at once while bounding
SUMMARY_CHUNK = 4096


class GroupArchive:
    """The archived tokens of one head group, in lockstep across its heads, with page summaries.

    Append-only stores (files on a real run), so host memory does not grow with the document:
    ``store`` the K/V rows (their key and value parts in two stores: scoring reads the keys alone),
    ``index`` each token's original position per head (int32), ``summaries`` each completed page's
    per-channel key minima then maxima (float16, rounded outward). Only the open
    (last, incomplete) page's summary, ``tail``, is held in memory, on the keys' device.

    Appending runs once per layer and block, so it makes no host sync and allocates nothing once the
    first (largest) block is through. The data flow of one append::

        keys, values, positions (model device)
          → K/V rows (dtype cast or int8 quantization), positions as int32, summaries of the pages the
            keys complete: written straight into ONE packed byte buffer (``AppendWork``, on that
            device); the new open page's summary into ``open_page``
          → copied with ONE copy into ``staging``, a host buffer kept on the archive and grown
            geometrically (pinned and non-blocking when the device is CUDA, a CUDA event marks the
            copy's end)
          → :meth:`flush` writes the staged bytes to the stores (``pwrite`` for files)

    The flush is deferred: the next append (or any read: ``read``, ``positions_of``, ``all_positions``,
    ``page_summaries``, ``state_dict``) does it first, so the copy overlaps the next block's compute
    and the wait for its event is normally already over. ``nbytes`` counts the staged bytes without
    writing them. ``close`` drops them with the stores, which nothing can read any more.
    """

    def __init__(self, num_heads: int, head_dim: int, dtype: torch.dtype, page_size: int,
                 new_store: Callable[[int], ArchiveStore], work: AppendWork | None = None) -> None:
        if page_size < 1:
            raise UsageError(f"archive page size must be at least 1 (got {page_size})")
        self.h = num_heads
        self.d = head_dim
        self.dtype = dtype
        self.page_size = page_size
        self.part_bytes = self.row_bytes(num_heads, head_dim, dtype) // 2  # a row's key part, or its value part
        self.store = SplitRows(new_store(self.part_bytes), new_store(self.part_bytes), *_row_columns(
            num_heads, head_dim, dtype))
        self.index = new_store(4 * num_heads)
        self.summaries = new_store(2 * num_heads * head_dim * SUMMARY_DTYPE.itemsize)
        self.work = work if work is not None else AppendWork()
        self.length = 0  # archived tokens per head
        self.empty = _empty_page(num_heads, head_dim)  # never written to: shared by every fresh open page
        self.tail = self.empty  # [2, h, d]: min, max of the open page's keys (``empty`` or ``open_page``)
        self.open_page: Tensor | None = None  # where appends write the open page's summary (keys' device)
        self.open_pages: Tensor | None = None  # the [L, 2, h, d] tensor ``open_page`` is a row of (``append_layers``)
        self.staging = torch.empty(0, dtype=torch.uint8)  # the last append's bytes, on their way to the stores
        self.pinned = False  # whether ``staging`` is pinned memory
        self.staged: tuple[int, ...] | None = None  # rows staged per part (``parts``; None: none)
        self.copied: torch.cuda.Event | None = None  # recorded after the staging copy (CUDA only)
        # as the first archive of a stack of layers (``append_layers``): the host bytes every layer's row of an
        # append is staged in, and the event marking their copy's end
        self.stack_host = torch.empty(0, dtype=torch.uint8)
        self.stack_event: torch.cuda.Event | None = None
        # writing behind (``AppendWork.background``): a second buffer and event, so the next append stages while
        # the writer still reads the last one; each buffer's write job, waited for before it is staged in again
        self.stack_spare: tuple[Tensor, torch.cuda.Event | None] = (torch.empty(0, dtype=torch.uint8), None)
        self.stack_jobs: list[Future | None] = [None, None]

    @staticmethod
    def row_bytes(num_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes per archived token: K and V of every head (int8: plus a float32 scale per head for each)."""
        if dtype == torch.int8:
            return 2 * num_heads * (head_dim + 4)
        return 2 * num_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    @property
    def pages(self) -> int:
        return -(-self.length // self.page_size)

    @property
    def parts(self) -> tuple[ArchiveStore, ...]:
        """The stores an append writes, in the order of its packed bytes: key parts, value parts, positions,
        summaries of the pages it completes."""
        return self.store.keys, self.store.values, self.index, self.summaries

    def nbytes(self) -> int:
        """Bytes held: K/V rows, positions and page summaries (in the stores, staged or being written behind) and
        the open page. Counted from the archived tokens: no flush (and no sync) to report a size, and no read of
        a store the writer thread is appending to."""
        rows = self.length * (self.store.row_bytes + self.index.row_bytes)
        pages = self.length // self.page_size * self.summaries.row_bytes
        return rows + pages + self.tail.numel() * self.tail.element_size()

    def _offsets(self, counts: tuple[int, ...]) -> list[int]:
        """Where each part's rows (``parts``) start in the packed bytes, and their end."""
        at, out = 0, []
        for st, k in zip(self.parts, counts, strict=True):
            out.append(at)
            at += -(-k * st.row_bytes // ALIGN) * ALIGN
        return [*out, at]

    # -- appending (in inference mode, as the engine runs: every buffer written here is an inference tensor) --
    def append(self, keys: Tensor, values: Tensor, positions: Tensor) -> None:
        """Archive ``n`` tokens per head: keys/values [h, n, d] (keys at original positions), positions [h, n].

        Computed on the keys' device into ``work`` and staged (class docstring): no host sync, no new
        buffer once the largest block has been through; the stores get the bytes at the next append or read.
        """
        append_layers([self], keys.unsqueeze(0), values.unsqueeze(0), positions.unsqueeze(0))

    def stack_staging(self, nbytes: int, device: torch.device) -> tuple[Tensor, torch.cuda.Event | None]:
        """Host bytes (pinned when ``device`` is CUDA) for an append of the stack this archive leads, and the CUDA
        event marking the copy's end (None on CPU). Its own per stack: another stack's append, before this one's
        archives flush, must not write over their staged bytes. Grown geometrically; the archives that staged in
        the old buffer keep it alive."""
        cuda = device.type == "cuda"
        if nbytes > self.stack_host.numel() or (cuda and not self.stack_host.is_pinned()):
            self.stack_host = torch.empty(max(nbytes, 2 * self.stack_host.numel(), 1 << 16), dtype=torch.uint8,
                                          pin_memory=cuda)
        if cuda and self.stack_event is None:
            self.stack_event = torch.cuda.Event()
        return self.stack_host[:nbytes], self.stack_event if cuda else None

    def _stage(self, packed: Tensor, counts: tuple[int, ...], total: int) -> None:
        """Copy the first ``total`` packed bytes of an append into ``staging`` with one copy; :meth:`flush`
        writes them. ``staging`` is sized like ``packed`` (for the most pages a block can complete)."""
        cuda = packed.device.type == "cuda"
        if packed.numel() > self.staging.numel() or (cuda and not self.pinned):
            self.staging = torch.empty(max(packed.numel(), 2 * self.staging.numel(), 1 << 16), dtype=torch.uint8,
                                       pin_memory=cuda)
            self.pinned = cuda
        self.staging[:total].copy_(packed[:total], non_blocking=cuda)
        if cuda:
            if self.copied is None:
                self.copied = torch.cuda.Event()
            self.copied.record(torch.cuda.current_stream(packed.device))
        self.staged = counts

    @torch.inference_mode()
    def flush(self) -> None:
        """Write the staged bytes of the last append to the stores, once their copy has landed, after every write
        the writer thread still has queued (``AppendWork.wait``).

        The staged rows are taken first, so a failed write (a full disk) is not repeated by the next call.
        """
        self.work.wait()
        self._flush_staged()

    def _flush_staged(self) -> None:
        if self.staged is None:
            return
        counts, self.staged = self.staged, None
        if self.copied is not None:
            self.copied.synchronize()
        self._write(self.staging, counts)

    def _write(self, staging: Tensor, counts: tuple[int, ...]) -> None:
        """One append's staged bytes (laid out by ``_offsets(counts)``) into the stores."""
        at = self._offsets(counts)
        for st, k, start in zip(self.parts, counts, at[:-1], strict=True):
            if k:
                st.append(staging[start : start + k * st.row_bytes].view(k, st.row_bytes))

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
        """Upper bound of q·k over each page, maximised over the query rows: [h, pages], on the queries' device.

        ``queries`` [h, r, d] (float, original-position frame), all rows of the query heads that share
        each KV head. Completed pages' summaries are read ``SUMMARY_CHUNK`` pages at a time and sent to the
        queries' device with one copy each (``to_device``); the open page's summary is already there.
        """
        self.flush()
        q = queries.float()
        pos, neg = q.clamp(min=0), q.clamp(max=0)
        out = torch.empty(self.h, self.pages, device=q.device)
        done = self.summaries.rows
        for first in range(0, self.pages, SUMMARY_CHUNK):
            last = min(first + SUMMARY_CHUNK, self.pages)
            stop = min(last, done)
            rows = self.summaries.read(torch.arange(first, stop)) if stop > first else torch.empty(
                0, self.summaries.row_bytes, dtype=torch.uint8)
            (rows,) = to_device([rows], q.device)
            s = rows.view(SUMMARY_DTYPE).view(-1, 2, self.h, self.d).permute(1, 2, 0, 3)  # [2, h, pages, d]
            if last > done:  # the open page
                s = torch.cat((s, self.tail.to(q.device).unsqueeze(2)), dim=2)
            bound = torch.bmm(pos, s[1].float().transpose(1, 2)) + torch.bmm(neg, s[0].float().transpose(1, 2))
            out[:, first:last] = bound.nan_to_num_(nan=float("inf")).amax(1)
        return out

    def candidate_pages(self, queries: Tensor, scan: int | None) -> Tensor:
        """The pages to score exactly, per head [h, k] in file order: all of them (on the host), or (an archive
        longer than ``scan`` tokens) the ``scan // P`` whose Quest bound is highest (on the queries' device: the
        caller reads every group's back at once), so the work per question stays bounded.

        ``scan=None``: all pages whatever the length. The bound holds only where the queries and the
        summaries share a frame (absolute positions); compact-mode recall passes None (``recall.recall``).
        """
        if scan is None or self.length <= scan:
            return torch.arange(self.pages).expand(self.h, -1)
        order = torch.argsort(self.page_scores(queries), dim=1, descending=True, stable=True)  # [h, pages]
        return torch.sort(order[:, : max(1, scan // self.page_size)], dim=1).values  # file order: reads run forwards

    def scores(self, queries: Tensor, pages: Tensor,
               place: Callable[[Tensor, Tensor], Tensor] | None = None) -> Iterator[tuple[Tensor, Tensor]]:
        """Exact ``q·k`` of the tokens on ``pages`` [h, k] (host), ``SCAN_CHUNK`` pages at a time (fewer for many
        rows), on the queries' device.

        Yields the tokens' original positions [h, a] and their scores per query row [h, r, a] (−inf for
        a tail page's missing tokens): the transient buffer is one chunk, at most ``SCORE_BYTES`` (or one
        page's), however many pages. Each chunk's keys, positions and validity are read on the host and
        sent with one copy (``to_device``) as stored: int8 rows are dequantized on the queries' device, so a GPU
        receives a quarter of the float32 bytes and the host converts nothing.
        ``place(keys, positions)`` moves keys into the queries' frame first (compact positions).
        """
        P = self.page_size
        q = queries.float()
        span = torch.arange(min(P, self.length))  # a page longer than the archive holds only what was archived
        step = max(1, min(SCAN_CHUNK, SCORE_BYTES // (4 * self.h * max(q.shape[1], 1) * P)))
        heads = torch.arange(self.h, device=q.device).unsqueeze(1)
        for lo in range(0, pages.shape[1], step):
            idx = (pages[:, lo : lo + step].unsqueeze(-1) * P + span).reshape(self.h, -1)
            valid = idx < self.length
            rows, _, inverse, pos = self._rows(idx.clamp(max=self.length - 1), values=False)
            rows, inverse, pos, valid = to_device([rows, inverse, pos, valid], q.device)
            keys = self._decode(rows)[inverse, heads]  # [h, a, d], as ``read`` gives them
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
        """Keys, values [h, T, d] (None unless ``values``) and positions [h, T] of archive indices ``index`` [h, T].

        Without ``values`` only the key parts are read (and dequantized): scoring reads half the bytes."""
        krows, vrows, inverse, pos = self._rows(index, values)
        heads = torch.arange(self.h).unsqueeze(1)
        keys = self._decode(krows)[inverse, heads]
        return keys, None if vrows is None else self._decode(vrows)[inverse, heads], pos

    def _rows(self, index: Tensor, values: bool) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """The stored rows of archive indices ``index`` [h, T] as the stores hold them (host): the key parts
        [u, part_bytes] of the u distinct rows, their value parts (None unless ``values``), where each index's
        row is among them [h, T] and the positions [h, T]. Every head's i-th token shares row i: one read each."""
        self.flush()
        uniq, inverse = torch.unique(index, return_inverse=True)
        vrows = self.store.read_values(uniq) if values else None
        return self.store.read_keys(uniq), vrows, inverse, self._positions(uniq, inverse)

    def _decode(self, part: Tensor) -> Tensor:
        """Key (or value) parts [u, part_bytes] → [u, h, d]: int8 dequantized to float32, else viewed in the dtype."""
        if self.dtype == torch.int8:
            return _dequantize(part, self.h, self.d)
        return part.view(self.dtype).view(-1, self.h, self.d)

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
        self.index.append(pos.t().contiguous().view(torch.uint8))  # [n, 4·h] bytes
        # archives saved before the summaries were float16 hold float32 ones: rounded outward, as on append
        x = torch.stack((kmin.float(), kmax.float())).permute(2, 0, 1, 3).contiguous()  # [pages, 2, h, d]
        summ = _round_outward(x, AppendWork(), x.shape[0])
        done = n // page_size
        if done:
            self.summaries.append(summ[:done].view(done, -1).view(torch.uint8))
        self.tail = summ[done].clone() if n % page_size else self.empty
        self.length = n

    def close(self) -> None:
        """Close the stores once the writer thread is done with them; staged bytes are dropped with them (nothing
        can read either afterwards)."""
        self.work.close()
        self.staged = None
        self.staging = torch.empty(0, dtype=torch.uint8)  # a copy still in flight keeps its pinned block
        for st in (self.store, self.index, self.summaries):
            st.close()


@torch.inference_mode()
def append_layers(archives: list[GroupArchive], keys: Tensor, values: Tensor, positions: Tensor) -> None:
    """Archive ``n`` tokens per head in each of ``archives`` at once: keys/values [L, h, n, d] (keys at original
    positions) and positions [L, h, n], layer ``l``'s to ``archives[l]``.

    The archives of a stack of layers hold the same number of tokens (every layer evicts as many per block),
    so one append computes every layer's K/V rows, positions and page summaries with one launch each, packs
    them into ``[L, stride]`` bytes and stages them with one copy: each archive's ``staging`` is its row of
    the stack's staging buffer (``GroupArchive.stack_staging``). One archive (``GroupArchive.append``) is the
    case L = 1, staged in its own buffer. No host sync, and nothing allocated once the largest block has been through.
    """
    a0, L, n = archives[0], len(archives), keys.shape[2]
    if n == 0:
        return
    behind = len(archives) > 1 and a0.work.writes_behind(keys.device)
    if behind:
        a0.work.raise_failed()  # a write that failed since (a full disk) stops the read here
    for a in archives:  # the previous append's bytes: their copy has overlapped the compute since
        if behind:
            a._flush_staged()  # bytes an append of this archive alone staged; the stack's are the writer's
        else:
            a.flush()
    if any(a.length != a0.length for a in archives):
        raise ValueError("archives appended together must hold the same number of tokens")
    h, d, P, device, work = a0.h, a0.d, a0.page_size, keys.device, a0.work
    lead = a0.length % P
    pages, done = -(-(lead + n) // P), (lead + n) // P  # pages the keys touch, and complete
    counts = (n, n, n, done)  # the parts: key rows, value rows, positions, completed pages' summaries
    at = a0._offsets(counts)  # the same layout in every layer's row of ``packed``
    most = -(-(at[3] + (n // P + 1) * a0.summaries.row_bytes) // ALIGN) * ALIGN  # the most an append of n needs
    stride = at[-1]  # rows packed back to back: the staging copy below is of one contiguous range on both sides
    packed = work.get("packed", (L * most,), torch.uint8, device)[: L * stride].view(L, stride)  # sized for the most
    pb = a0.part_bytes
    _write_rows(a0.dtype, packed[:, at[0] : at[0] + n * pb].view(L, n, pb), packed[:, at[1] : at[1] + n * pb].view(
        L, n, pb), keys.detach(), values.detach(), work)
    packed[:, at[2] : at[2] + n * a0.index.row_bytes].view(torch.int32).view(L, n, h).copy_(positions.transpose(1, 2))
    opens = _open_pages(archives, device)
    summ = _summarise(keys.detach(), P, lead, pages, opens if lead else None, work)  # [L, pages, 2, h, d] in work
    packed[:, at[3] : at[3] + done * a0.summaries.row_bytes].view(SUMMARY_DTYPE).view(L, done, 2, h, d).copy_(
        summ[:, :done])
    if done < pages:
        opens.copy_(summ[:, done])
    for layer, a in enumerate(archives):
        a.tail = opens[layer] if done < pages else a.empty
        a.length += n
    if L == 1:
        a0._stage(packed[0], counts, at[-1])
        return
    if behind:  # the buffer two appends back: its write is done by now, or waited for here
        a0.stack_host, a0.stack_event, a0.stack_spare = *a0.stack_spare, (a0.stack_host, a0.stack_event)
        a0.stack_jobs.reverse()
        if (job := a0.stack_jobs[0]) is not None:
            wait_for([job])  # a failure raises from ``AppendWork`` (its queue), once
    staging, event = a0.stack_staging(L * stride, device)
    # both sides contiguous: a device-to-pinned copy of a strided tensor would go through a pageable temporary
    # (a hidden host sync each block), and a strided copy on the host walks row by row
    staging.copy_(packed.view(L * stride), non_blocking=device.type == "cuda")
    if event is not None:
        event.record(torch.cuda.current_stream(device))
    if behind:
        a0.stack_jobs[0] = a0.work.submit(partial(_write_behind, archives, staging, event, counts, stride))
        return
    for layer, a in enumerate(archives):
        a.staging, a.pinned, a.copied, a.staged = staging[layer * stride : (layer + 1) * stride], False, event, counts


@torch.inference_mode()  # thread-local: the writer thread enters it itself
def _write_behind(archives: list[GroupArchive], staging: Tensor, event: torch.cuda.Event | None,
                  counts: tuple[int, ...], stride: int) -> None:
    """On the writer thread: once the staging copy has landed, each layer's row of ``staging`` into its stores."""
    if event is not None:
        event.synchronize()
    for layer, a in enumerate(archives):
        a._write(staging[layer * stride : (layer + 1) * stride], counts)


def _open_pages(archives: list[GroupArchive], device: torch.device) -> Tensor:
    """The archives' open-page summaries as one [L, 2, h, d] tensor on ``device`` that each archive's
    ``open_page`` views (made once: later appends of the same archives find it in place)."""
    opens = archives[0].open_pages
    if (opens is not None and opens.device == device and opens.shape[0] == len(archives)
            and all(a.open_pages is opens and a.open_page is not None and a.open_page.data_ptr() == opens[i].data_ptr()
                    for i, a in enumerate(archives))):
        return opens
    a0 = archives[0]
    opens = torch.empty(len(archives), 2, a0.h, a0.d, dtype=SUMMARY_DTYPE, device=device)
    for layer, a in enumerate(archives):  # once per stack (or after a load): a copy of each open page so far
        if a.tail is a.empty:  # filled where it lives: a copy from pageable host memory would be a host sync
            opens[layer, 0].fill_(float("inf"))
            opens[layer, 1].fill_(float("-inf"))
        else:
            opens[layer].copy_(a.tail)
        a.open_page, a.open_pages = opens[layer], opens
    return opens


def _write_rows(dtype: torch.dtype, krows: Tensor, vrows: Tensor, keys: Tensor, values: Tensor,
                work: AppendWork) -> None:
    """K/V of ``n`` tokens per layer into their key and value parts ``krows``, ``vrows`` [L, n, part_bytes]: cast,
    or int8 quantized symmetrically per token and head (absmax / 127; a key's error is at most half its scale per
    channel), codes [n, h, d] then float32 scales [n, h] in each part."""
    L, h, n, d = keys.shape
    if dtype != torch.int8:
        krows.view(dtype).view(L, n, h, d).copy_(keys.transpose(1, 2))
        vrows.view(dtype).view(L, n, h, d).copy_(values.transpose(1, 2))
        return
    kv = work.get("kv32", (L, n, 2, h, d), torch.float32, keys.device)
    kv[:, :, 0].copy_(keys.transpose(1, 2))
    kv[:, :, 1].copy_(values.transpose(1, 2))
    magnitude = torch.abs(kv, out=work.get("abs32", (L, n, 2, h, d), torch.float32, keys.device))
    scale = work.get("scale32", (L, n, 2, h, 1), torch.float32, keys.device)
    top = work.constants(keys.device).top
    torch.amax(magnitude, -1, keepdim=True, out=scale).div_(top).clamp_(min=torch.finfo(torch.float32).tiny)
    kv.div_(scale).round_().clamp_(-127, 127)
    for i, rows in enumerate((krows, vrows)):
        rows[..., : h * d].view(torch.int8).view(L, n, h, d).copy_(kv[:, :, i])
        rows[..., h * d :].copy_(scale[:, :, i].view(L, n, h).view(torch.uint8))


def _summarise(keys: Tensor, P: int, lead: int, pages: int, tails: Tensor | None, work: AppendWork) -> Tensor:
    """Summaries [L, pages, 2, h, d] (``SUMMARY_DTYPE``, rounded outward, in ``work``) of the pages that ``keys``
    [L, h, n, d] touch in pages of ``P``, ``lead`` tokens into the open page: the open one (its summary so far
    is ``tails`` [L, 2, h, d]; none when the last block ended on a page boundary), the whole pages after it,
    and a new open page with what is left."""
    L, h, n, d = keys.shape
    device = keys.device
    kf = work.get("keys32", (L, h, n, d), torch.float32, device).copy_(keys)
    most = n // P + 2  # the most pages n keys can touch: every buffer is sized for it, so none grows later
    x = work.get("summ32", (L * most, 2, h, d), torch.float32, device)[: L * pages].view(L, pages, 2, h, d)
    tail = work.get("tail32", (L, 2, h, d), torch.float32, device)
    first = min(n, P - lead) if lead else 0
    full = (n - first) // P
    p = 0
    if first:  # the open page so far, in float32 (the tail may be on the CPU when just loaded)
        assert tails is not None
        tail.copy_(tails, non_blocking=True)
        torch.minimum(torch.amin(kf[:, :, :first], 2, out=x[:, 0, 0]), tail[:, 0], out=x[:, 0, 0])
        torch.maximum(torch.amax(kf[:, :, :first], 2, out=x[:, 0, 1]), tail[:, 1], out=x[:, 0, 1])
        p = 1
    if full:
        body = kf[:, :, first : first + full * P].view(L, h, full, P, d)
        torch.amin(body, 3, out=x[:, p : p + full, 0].transpose(1, 2))
        torch.amax(body, 3, out=x[:, p : p + full, 1].transpose(1, 2))
        p += full
    if p < pages:
        torch.amin(kf[:, :, first + full * P :], 2, out=x[:, p, 0])
        torch.amax(kf[:, :, first + full * P :], 2, out=x[:, p, 1])
    return _round_outward(x.view(L * pages, 2, h, d), work, L * most).view(L, pages, 2, h, d)


def _empty_page(h: int, d: int) -> Tensor:
    """The summary of a page with no keys yet: min +inf, max −inf ([2, h, d])."""
    return torch.stack((torch.full((h, d), float("inf")), torch.full((h, d), float("-inf")))).to(SUMMARY_DTYPE)


def _dequantize(part: Tensor, h: int, d: int) -> Tensor:
    """The inverse of ``GroupArchive._write_rows``'s int8 key (or value) parts: [u, h·d + 4·h] bytes → [u, h, d]
    float32."""
    q = part[:, : h * d].view(torch.int8).view(-1, h, d)
    scale = part[:, h * d :].contiguous().view(torch.float32).view(-1, h, 1)
    return q.float() * scale


def _row_columns(h: int, d: int, dtype: torch.dtype) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The byte ranges of a whole row (the ``.kvc`` archive's layout) that make up its key part and its value
    part: K then V in the dtype; int8 codes of K, of V, then float32 scales of K, of V."""
    if dtype == torch.int8:
        return [(0, h * d), (2 * h * d, 2 * h * d + 4 * h)], [(h * d, 2 * h * d), (2 * h * d + 4 * h, 2 * h * (d + 4))]
    half = GroupArchive.row_bytes(h, d, dtype) // 2
    return [(0, half)], [(half, 2 * half)]


def _round_outward(x: Tensor, work: AppendWork, most: int) -> Tensor:
    """Summaries ``x`` [pages, 2, h, d] float32 (minima, then maxima) in ``SUMMARY_DTYPE``, rounded outward,
    computed in ``work``'s buffers sized for ``most`` pages (the result is one of them).

    Minima round down and maxima up, so the bound still holds for every key. Past float16's range a
    value becomes ±inf, which only loosens the bound (``page_scores`` turns the 0·inf of a zero query
    channel back into a valid bound).
    """
    pages, shape, device = x.shape[0], x.shape[1:], x.device
    c = work.constants(device)

    def buffer(name: str, dtype: torch.dtype) -> Tensor:
        return work.get(name, (most, *shape), dtype, device)[:pages]

    r = buffer("summ16", SUMMARY_DTYPE).copy_(x)
    back = buffer("back32", torch.float32).copy_(r).sub_(x).mul_(c.sign)
    wrong = torch.lt(back, c.zero, out=buffer("wrong", torch.bool))  # rounded inward
    step = torch.nextafter(r, c.limit.expand_as(r), out=buffer("step16", SUMMARY_DTYPE))
    return torch.where(wrong, step, r, out=r)


def dropped_indices(keep: Tensor, n: int) -> Tensor:
    """The complement of ``keep`` [h, c] in range(n), ascending: [h, n − c] (no host sync)."""
    h, c = keep.shape
    mask = torch.ones(h, n, dtype=torch.uint8, device=keep.device)
    mask.scatter_(1, keep, 0)
    return torch.sort(mask, dim=1, descending=True, stable=True).indices[:, : n - c]
