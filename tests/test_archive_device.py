"""The archive appends on the keys' device with one staged copy and no host sync (kvtool/core/archive.py).

Oracles: (a) the stores' bytes, ``page_summaries`` and ``read`` equal the implementation that computed
everything on the host (kept here verbatim as ``HostArchive``) and a brute force over every archived
key (per-page minima and maxima rounded outward; int8 within half a scale step); (b) on the CPU,
``append`` calls nothing that syncs (``cpu``, ``item``, ``tolist``, ``numpy``, truth values): only
the deferred ``flush`` reads bytes; (c) on CUDA the rows equal the CPU's, the staging buffer is pinned
and ``append`` passes ``torch.cuda``'s sync debug mode; (d) staged bytes are never lost to a read and
closing or dropping an archive leaves no descriptor open; (e) once the largest block is through, appends
allocate nothing (the profiler's memory events), also with a cache's archives sharing their buffers.
"""

from __future__ import annotations

import gc
import os
from concurrent import futures

import pytest
import torch
from torch import Tensor

from kvtool.core.archive import SUMMARY_DTYPE, AppendWork, GroupArchive
from kvtool.core.archive_stores import FILES_PER_GROUP, FileStore, MemoryStore

CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
H, D, P = 3, 8, 8
#: block sizes that start and end mid-page, on a page boundary, span pages, and archive nothing
BLOCKS = (3, 5, 0, 8, 13, 1, 16, 7, 2, 0, 24, 4, 9)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8)


# -- the reference: the host-side append as it was, verbatim ----------------------------------------------
def _old_as_rows(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    out = torch.empty(t.shape, dtype=dtype or t.dtype)
    out.copy_(t)
    return out.view(t.shape[0], -1).view(torch.uint8)


def _old_quantize(keys: Tensor, values: Tensor) -> Tensor:
    n = keys.shape[1]
    kv = torch.stack((keys, values)).detach().float().cpu()
    scale = kv.abs().amax(-1, keepdim=True).div_(127.0).clamp_(min=torch.finfo(torch.float32).tiny)
    q = kv.div(scale).round_().clamp_(-127, 127).to(torch.int8)
    data = q.permute(2, 0, 1, 3).reshape(n, -1).view(torch.uint8)
    scales = scale.squeeze(-1).permute(2, 0, 1).reshape(n, -1).contiguous().view(torch.uint8)
    return torch.cat((data, scales), dim=1)


_OUTWARD = torch.tensor([-1.0, 1.0]).view(1, 2, 1, 1)
_OUTWARD_LIMIT = (_OUTWARD * float("inf")).to(SUMMARY_DTYPE)


def _old_round_outward(x: Tensor) -> Tensor:
    r = x.to(SUMMARY_DTYPE)
    wrong = (r.float() - x).mul_(_OUTWARD) < 0
    step = torch.nextafter(r, _OUTWARD_LIMIT.expand_as(r))
    return torch.where(wrong, step, r)


class HostArchive(GroupArchive):
    """The archive whose ``append`` copied to the host three times and wrote at once."""

    def append(self, keys: Tensor, values: Tensor, positions: Tensor) -> None:
        n = keys.shape[1]
        if n == 0:
            return
        if self.dtype == torch.int8:
            rows = _old_quantize(keys, values)
        else:
            kv = torch.empty(n, 2, self.h, self.d, dtype=self.dtype)
            kv[:, 0].copy_(keys.transpose(0, 1))
            kv[:, 1].copy_(values.transpose(0, 1))
            rows = kv.view(n, -1).view(torch.uint8)
        self.store.append(rows)
        self.index.append(_old_as_rows(positions.t(), torch.int32))
        P, lead = self.page_size, self.length % self.page_size
        kf = keys.detach().float().cpu()
        first = min(n, P - lead) if lead else 0
        full = (n - first) // P
        body = kf[:, first : first + full * P].reshape(self.h, full, P, self.d)
        lo, hi = [body.amin(2)], [body.amax(2)]
        if first:
            lo.insert(0, torch.minimum(kf[:, :first].amin(1), self.tail[0].float()).unsqueeze(1))
            hi.insert(0, torch.maximum(kf[:, :first].amax(1), self.tail[1].float()).unsqueeze(1))
        last = kf[:, first + full * P :]
        if last.shape[1]:
            lo.append(last.amin(1, keepdim=True))
            hi.append(last.amax(1, keepdim=True))
        summ = _old_round_outward(torch.stack((torch.cat(lo, 1), torch.cat(hi, 1)), dim=1))
        done = (lead + n) // P
        if done:
            self.summaries.append(_old_as_rows(summ[:, :, :done].permute(2, 1, 0, 3)))
        pages = summ.shape[2]
        self.tail = summ[:, :, done].transpose(0, 1).contiguous() if done < pages else self.empty
        self.length += n


# -- helpers ----------------------------------------------------------------------------------------------
def blocks(in_dtype: torch.dtype, seed: int = 0, sizes: tuple[int, ...] = BLOCKS):
    g = torch.Generator().manual_seed(seed)
    for n in sizes:
        k = (torch.randn(H, n, D, generator=g) * 3).to(in_dtype)
        v = torch.randn(H, n, D, generator=g).to(in_dtype)
        yield k, v, torch.randint(0, 1 << 20, (H, n), generator=g)


def store_bytes(arch: GroupArchive) -> list[Tensor]:
    arch.flush()
    return [st.read(torch.arange(st.rows)) for st in (arch.store, arch.index, arch.summaries)]


def assert_same(ours: GroupArchive, ref: GroupArchive) -> None:
    assert ours.length == ref.length and ours.pages == ref.pages
    assert ours.nbytes() == ref.nbytes()  # staged bytes counted before they are written
    for a, b in zip(store_bytes(ours), store_bytes(ref), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(ours.page_summaries(), ref.page_summaries(), strict=True):
        assert torch.equal(a, b)
    idx = torch.randint(0, ours.length, (H, 17), generator=torch.Generator().manual_seed(1))
    for a, b in zip(ours.read(idx), ref.read(idx), strict=True):
        assert torch.equal(a, b)


def brute_force(arch: GroupArchive, keys: Tensor, values: Tensor, positions: Tensor) -> None:
    """Page summaries bound every key of their page and are float16's nearest such bounds; rows read back."""
    n = keys.shape[1]
    kmin, kmax = arch.page_summaries()
    assert kmin.dtype == SUMMARY_DTYPE and kmin.shape == (H, -(-n // P), D)
    kf = keys.float()
    for p in range(kmin.shape[1]):
        lo, hi = kf[:, p * P : (p + 1) * P].amin(1), kf[:, p * P : (p + 1) * P].amax(1)
        assert (kmin[:, p].float() <= lo).all() and (kmax[:, p].float() >= hi).all()
        up = torch.nextafter(kmin[:, p], torch.tensor(float("inf"), dtype=SUMMARY_DTYPE)).float()
        down = torch.nextafter(kmax[:, p], torch.tensor(float("-inf"), dtype=SUMMARY_DTYPE)).float()
        assert (up > lo).all() and (down < hi).all()  # no looser than one float16 step
    k, v, pos = arch.read(torch.arange(n).expand(H, -1))
    assert torch.equal(pos, positions)
    if arch.dtype == torch.int8:
        for got, want in ((k, keys), (v, values)):
            half_step = want.float().abs().amax(-1, keepdim=True) / 127 / 2
            assert ((got - want.float()).abs() <= half_step * 1.0001 + 1e-30).all()
    else:
        assert torch.equal(k, keys.to(arch.dtype)) and torch.equal(v, values.to(arch.dtype))


# -- a. oracle: the reference implementation and a brute force ------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_appends_equal_the_host_reference_and_a_brute_force(dtype, in_dtype):
    ours = GroupArchive(H, D, dtype, P, MemoryStore)
    ref = HostArchive(H, D, dtype, P, MemoryStore)
    ks, vs, ps = [], [], []
    for k, v, p in blocks(in_dtype):
        ours.append(k, v, p)
        ref.append(k, v, p)
        ks.append(k), vs.append(v), ps.append(p)
    assert ours.staged is not None  # the last append is still staged: every read below must flush it
    assert_same(ours, ref)
    brute_force(ours, torch.cat(ks, 1), torch.cat(vs, 1), torch.cat(ps, 1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reads_between_appends_see_every_row(dtype, tmp_path):
    """A read after each block (a flush mid-stream) and files as stores: the same bytes as the reference."""
    ours = GroupArchive(H, D, dtype, P, lambda rb: FileStore(rb, tmp_path))
    ref = HostArchive(H, D, dtype, P, MemoryStore)
    ks, vs, ps = [], [], []
    for k, v, p in blocks(torch.float32, seed=2):
        ours.append(k, v, p)
        ref.append(k, v, p)
        ks.append(k), vs.append(v), ps.append(p)
        if ours.length:
            assert_same(ours, ref)
            brute_force(ours, torch.cat(ks, 1), torch.cat(vs, 1), torch.cat(ps, 1))
    a, b = ours.state_dict("x"), ref.state_dict("x")
    assert all(torch.equal(a[key], b[key]) for key in b)
    ours.close()


def test_a_loaded_archive_appends_like_the_reference():
    """An archive loaded mid-page (its open page on the CPU) goes on exactly as the reference does."""
    first, rest = list(blocks(torch.float32, seed=3))[:5], list(blocks(torch.float32, seed=4))
    src = GroupArchive(H, D, torch.float16, P, MemoryStore)
    for k, v, p in first:
        src.append(k, v, p)
    assert src.length % P
    saved = src.state_dict("x")
    ours = GroupArchive(H, D, torch.float16, P, MemoryStore)
    ref = HostArchive(H, D, torch.float16, P, MemoryStore)
    ours.load_state_dict(saved, "x", P)
    ref.load_state_dict(saved, "x", P)
    for k, v, p in rest:
        ours.append(k, v, p)
        ref.append(k, v, p)
    assert_same(ours, ref)


# -- b. no host sync in append --------------------------------------------------------------------------------
SYNCING = ("cpu", "item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__array__")


def test_append_makes_no_host_sync(monkeypatch, tmp_path):
    """Spied on the CPU: only the deferred flush (pwrite needs the bytes) reads a tensor's values."""
    calls: list[tuple[str, bool]] = []
    state = {"flushing": False}

    def spy(name):
        real = getattr(torch.Tensor, name)

        def wrapper(self, *a, **k):
            calls.append((name, state["flushing"]))
            return real(self, *a, **k)

        return wrapper

    real_flush = GroupArchive.flush

    def flush(self):
        state["flushing"] = True
        try:
            real_flush(self)
        finally:
            state["flushing"] = False

    archives = [GroupArchive(H, D, dt, P, lambda rb: FileStore(rb, tmp_path)) for dt in DTYPES]
    data = list(blocks(torch.float32, seed=5))
    monkeypatch.setattr(GroupArchive, "flush", flush)
    for name in SYNCING:
        monkeypatch.setattr(torch.Tensor, name, spy(name))
    for k, v, p in data:
        for arch in archives:
            arch.append(k, v, p)
    monkeypatch.undo()
    assert calls and all(in_flush for _, in_flush in calls), calls
    assert ("numpy", True) in calls  # the spy saw the flush's pwrite: it would have seen append's too
    for arch in archives:
        arch.close()


def _staging_copies(monkeypatch, archives: list[GroupArchive], data: list[tuple[Tensor, Tensor, Tensor]]) -> list:
    """Every ``copy_`` that writes into a staging buffer (the stack's or an archive's own) while ``data``'s blocks
    are appended to ``archives`` together: (destination contiguous, source contiguous, bytes)."""
    from kvtool.core.archive import append_layers

    seen: list[tuple[bool, bool, int]] = []
    real = torch.Tensor.copy_

    def copy_(self, src, *a, **k):
        hosts = {t.untyped_storage().data_ptr() for a0 in archives for t in (a0.stack_host, a0.staging) if t.numel()}
        if self.untyped_storage().data_ptr() in hosts and self.device.type == "cpu":
            seen.append((self.is_contiguous(), src.is_contiguous(), self.numel()))
        return real(self, src, *a, **k)

    for k, v, p in data:
        for a in archives:
            a.flush()  # outside the spy: each append's staging buffers already exist before it runs
        if not archives[0].stack_host.numel():  # the first append sizes the buffers: not spied
            append_layers(archives, k, v, p)
            continue
        monkeypatch.setattr(torch.Tensor, "copy_", copy_)
        try:
            append_layers(archives, k, v, p)
        finally:
            monkeypatch.undo()
    return seen


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[cuda, pytest.mark.cuda])])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_staging_copy_is_one_contiguous_range_on_both_sides(monkeypatch, dtype, device):
    """A stack of layers stages every layer's bytes with one copy, and both sides of it are contiguous even when the
    block fills less than the most an append of its size may need (a strided device-to-pinned copy goes
    through a pageable temporary: a hidden sync per block, which neither the sync debug mode nor an op trace
    shows). The bytes still equal the reference's; on CUDA the staging buffer is pinned."""
    work = AppendWork()
    L = 3
    ours = [GroupArchive(H, D, dtype, P, MemoryStore, work) for _ in range(L)]
    refs = [HostArchive(H, D, dtype, P, MemoryStore) for _ in range(L)]
    sizes = (16, 5, 3, 9, 13, 1, 16)  # most start mid-page and complete fewer pages than a block of theirs may
    g = torch.Generator().manual_seed(12)
    data = []
    for n in sizes:
        k, v = torch.randn(L, H, n, D, generator=g) * 3, torch.randn(L, H, n, D, generator=g)
        data.append((k, v, torch.randint(0, 1 << 20, (L, H, n), generator=g)))
    copies = _staging_copies(monkeypatch, ours, [tuple(t.to(device) for t in block) for block in data])
    assert len(copies) == len(sizes) - 1  # one staging copy per append
    assert all(dst and src for dst, src, _ in copies), copies
    assert ours[0].stack_host.is_pinned() == (device == "cuda")
    for layer, (ref, arch) in enumerate(zip(refs, ours, strict=True)):
        for k, v, p in data:
            ref.append(k[layer], v[layer], p[layer])
        assert_same(arch, ref)


# -- c. on CUDA ---------------------------------------------------------------------------------------------
@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_append_equals_cpu_and_stages_in_pinned_memory(dtype):
    ours = GroupArchive(H, D, dtype, P, MemoryStore)
    cpu = GroupArchive(H, D, dtype, P, MemoryStore)
    for k, v, p in blocks(torch.bfloat16, seed=6):
        on_device = k.cuda(), v.cuda(), p.cuda()
        ours.flush()  # the flush waits on the copy (a sync by design): append itself must not sync
        torch.cuda.set_sync_debug_mode("error")
        try:
            ours.append(*on_device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        cpu.append(k, v, p)
    assert sum(BLOCKS) % P and ours.tail.device.type == "cuda"  # the open page stays on the device
    assert ours.staging.is_pinned() and ours.staged is not None
    assert_same(ours, cpu)


# -- d. closing and releasing with staged bytes -------------------------------------------------------------
def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_close_and_release_with_staged_bytes_leave_no_descriptor(tmp_path):
    before = _open_descriptors()
    arch = GroupArchive(H, D, torch.float16, P, lambda rb: FileStore(rb, tmp_path))
    for k, v, p in blocks(torch.float32, seed=7, sizes=(5, 11)):
        arch.append(k, v, p)
    assert arch.staged is not None and _open_descriptors() == before + FILES_PER_GROUP
    staged_bytes = arch.nbytes()
    assert arch.all_positions().shape == (H, 16) and arch.store.rows == 16  # a read writes the staged rows
    assert arch.nbytes() == staged_bytes
    for k, v, p in blocks(torch.float32, seed=8, sizes=(3,)):
        arch.append(k, v, p)
    arch.close()  # staged rows are dropped with the files: nothing can read them
    assert arch.staged is None and _open_descriptors() == before and os.listdir(tmp_path) == []

    dropped = GroupArchive(H, D, torch.int8, P, lambda rb: FileStore(rb, tmp_path))
    for k, v, p in blocks(torch.float32, seed=9, sizes=(6,)):
        dropped.append(k, v, p)
    assert dropped.staged is not None
    del dropped
    gc.collect()
    assert _open_descriptors() == before and os.listdir(tmp_path) == []


# -- d2. written behind: the stack's stores written by the writer thread while the next block computes -----------
class _Gate:
    """A store factory whose stores' appends run on whichever thread calls them, noted, and can be held back
    (``hold``) or made to fail once (``fail``): what the writer thread meets in a real file store."""

    def __init__(self, tmp_path) -> None:
        import threading

        self.tmp_path = tmp_path
        self.threads: set[str] = set()
        self.open = threading.Event()
        self.open.set()
        self.fail = False

    def __call__(self, row_bytes: int) -> FileStore:
        store, real, gate = FileStore(row_bytes, self.tmp_path), FileStore.append, self

        def append(rows: Tensor) -> None:
            import threading

            gate.threads.add(threading.current_thread().name)
            assert gate.open.wait(10)
            if gate.fail:
                gate.fail = False
                raise OSError(28, "No space left on device")
            real(store, rows)

        store.append = append  # type: ignore[method-assign]
        return store


def _stack(gate: _Gate, dtype: torch.dtype, layers: int = 3) -> list[GroupArchive]:
    work = AppendWork(background=True)
    return [GroupArchive(H, D, dtype, P, gate, work) for _ in range(layers)]


def _layers(sizes: tuple[int, ...], layers: int = 3, seed: int = 13) -> list[tuple[Tensor, Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(layers, H, n, D, generator=g) * 3), torch.randn(layers, H, n, D, generator=g),
             torch.randint(0, 1 << 20, (layers, H, n), generator=g)) for n in sizes]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_stack_written_behind_stores_what_writing_between_blocks_stores(dtype, tmp_path):
    """Written on the writer thread (``AppendWork(background=True)``, CUDA's default), with reads between appends:
    every layer's stores, summaries and reads equal the host reference's, and no append waited for a write."""
    from kvtool.core.archive import append_layers

    gate = _Gate(tmp_path)
    ours = _stack(gate, dtype)
    refs = [HostArchive(H, D, dtype, P, MemoryStore) for _ in range(3)]
    data = _layers(STEADY)
    for i, (k, v, p) in enumerate(data):
        for layer, ref in enumerate(refs):
            ref.append(k[layer], v[layer], p[layer])
        gate.open.clear()  # this append's writes cannot run yet
        append_layers(ours, k, v, p)  # returns all the same: nothing waited for them
        assert [a.nbytes() for a in ours] == [r.nbytes() for r in refs]  # rows on their way are counted
        gate.open.set()
        futures.wait(list(ours[0].work.jobs))  # before the next append stages in the buffer two appends back
        if i % 4 == 3:  # a read waits for every queued write first
            assert torch.equal(ours[1].all_positions(), refs[1].all_positions())
    assert gate.threads == {"kvtool-archive_0"}  # every store write ran on the writer thread
    for arch, ref in zip(ours, refs, strict=True):
        assert_same(arch, ref)
    for arch in ours:
        arch.close()
    assert ours[0].work.writer is None and os.listdir(tmp_path) == []


def test_a_failed_write_behind_stops_the_read_at_a_later_append_once(tmp_path):
    """A write that fails on the writer thread (a full disk) raises from the next append that finds it done, once;
    the appends after it go on (the failed rows are not written again)."""
    from kvtool.core.archive import append_layers

    gate = _Gate(tmp_path)
    ours = _stack(gate, torch.int8)
    data = _layers((8, 8, 8, 8))
    append_layers(ours, *data[0])
    ours[0].work.wait()
    gate.fail = True
    append_layers(ours, *data[1])
    ours[0].work.jobs[0].exception(timeout=10)  # the failed write has run
    with pytest.raises(OSError, match="No space left"):
        append_layers(ours, *data[2])
    append_layers(ours, *data[3])
    ours[0].work.wait()  # nothing raises twice
    assert ours[0].store.rows == 3 * 8 - 8  # one append's rows were lost with the failure, the others written
    for arch in ours:
        arch.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_closing_a_stack_with_writes_queued_waits_for_them_and_leaves_nothing_open(tmp_path):
    import threading

    from kvtool.core.archive import append_layers

    before, writers = _open_descriptors(), {t for t in threading.enumerate() if t.name.startswith("kvtool-archive")}
    gate = _Gate(tmp_path)
    ours = _stack(gate, torch.float16)
    for k, v, p in _layers((5, 11, 16)):
        append_layers(ours, k, v, p)
    gate.open.clear()
    append_layers(ours, *_layers((7,), seed=3)[0])
    threading.Timer(0.2, gate.open.set).start()  # the queued write finishes while close waits for it
    for arch in ours:
        arch.close()
    assert not ours[0].work.jobs and ours[0].work.writer is None
    assert _open_descriptors() == before and os.listdir(tmp_path) == []
    assert {t for t in threading.enumerate() if t.name.startswith("kvtool-archive")} == writers  # its writer stopped


# -- e. no allocation per block ----------------------------------------------------------------------------------
#: the largest block first, then blocks that start mid-page and complete the most pages a block can
STEADY = (16, 5, 16, 15, 1, 16, 3, 9, 16, 7)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_appends_after_the_largest_block_allocate_nothing_and_shared_buffers_keep_each_archive_exact(dtype, tmp_path):
    """Two archives share one ``AppendWork`` (as a cache's layers do) and append in turn; after the first
    block, the profiler sees no allocation in ``append`` (flushes to files included), and each archive's
    bytes still equal the host reference."""
    from torch.profiler import ProfilerActivity, profile

    work = AppendWork()
    ours = [GroupArchive(H, D, dtype, P, lambda rb: FileStore(rb, tmp_path), work) for _ in range(2)]
    refs = [HostArchive(H, D, dtype, P, MemoryStore) for _ in range(2)]
    data = [list(blocks(torch.bfloat16, seed=10 + i, sizes=STEADY)) for i in range(2)]

    def step(i: int) -> None:
        for arch, ref, d in zip(ours, refs, data, strict=True):
            arch.append(*d[i])
            ref.append(*d[i])

    step(0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for i in range(1, len(STEADY)):
            for arch, d in zip(ours, data, strict=True):
                arch.append(*d[i])
    allocations = [(e.name, e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage > 0]
    assert prof.events() and allocations == []
    for i in range(1, len(STEADY)):
        for ref, d in zip(refs, data, strict=True):
            ref.append(*d[i])
    for arch, ref in zip(ours, refs, strict=True):
        assert_same(arch, ref)
        arch.close()


@pytest.mark.parametrize("positions", ["absolute", "compact"])
def test_a_read_with_recall_archives_each_block_without_allocating(positions, tmp_path, monkeypatch):
    """The engine's whole archive path (gathering a block's evicted K/V and positions, turning compact keys
    back to their original positions, appending) allocates nothing in the second half of a read, and every
    layer's archive shares one ``AppendWork``."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from kvtool.core import stacks
    from kvtool.core.cache import BoundedCache
    from kvtool.core.engine import Engine, EngineConfig, model_env
    from kvtool.policies import build_policy
    from tests.helpers import VOCAB, tiny_llama

    model = tiny_llama(max_positions=64)
    cfg = EngineConfig(budget=40, block_size=8, positions=positions, recall=16, page_size=8, archive_dir=str(tmp_path))
    env = model_env(model, cfg)
    engine = Engine(model, build_policy("h2o", {}, env), cfg, env=env)

    def labelled(real):  # a layer's archive path, and a stack's (every layer's at once)
        def run(self, target, dropped):
            with record_function("archive_dropped"):
                real(self, target, dropped)

        return run

    monkeypatch.setattr(BoundedCache, "archive_dropped", labelled(BoundedCache.archive_dropped))
    monkeypatch.setattr(stacks, "archive_stack", labelled(stacks.archive_stack))
    ids = torch.randint(0, VOCAB, (400,), generator=torch.Generator().manual_seed(3))
    cache = engine.new_cache()
    for s in range(0, 200, 8):
        engine.step(cache, ids[s : s + 8], 1)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for s in range(200, 400, 8):
            engine.step(cache, ids[s : s + 8], 1)

    def chain(e) -> list[str]:  # an op and its callers: whether it ran for the archive, and where
        names = []
        while e is not None:
            names.append(e.name)
            e = e.cpu_parent
        return names

    events = [(chain(e), e.cpu_memory_usage) for e in prof.events() if e.name != "archive_dropped"]
    archived = [(names, used) for names, used in events if "archive_dropped" in names]
    assert len(archived) > 40  # the archive path ran, for every block
    assert [(names, used) for names, used in archived if used > 0] == []
    works = {id(g.archive.work) for layer in cache.layers for g in layer.groups if g.archive is not None}
    assert len(works) == 1 and all(g.archive.length > 0 for layer in cache.layers for g in layer.groups)
