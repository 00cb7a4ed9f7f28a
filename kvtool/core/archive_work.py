"""The buffers and the writer thread recall's archive appends work with (``kvtool/core/archive.py``).

``AppendWork`` is shared by a cache's archives (``recall.attach``): the device buffers an append computes in,
made once and grown to the largest block, its constants, and on CUDA the thread that writes a stack's staged
rows to the stores while the next blocks compute.
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from typing import NamedTuple

import torch
from torch import Tensor

#: page summaries in float16 (rounded outward): half the host memory per evicted token of float32
SUMMARY_DTYPE = torch.float16


class Constants(NamedTuple):
    """``AppendWork.constants``: outward rounding's signs [1, 2, 1, 1] (minima −1, maxima +1, float32) and
    limits (−inf, +inf in ``SUMMARY_DTYPE``), zero, and int8's largest code, as float32 tensors."""

    sign: Tensor
    limit: Tensor
    zero: Tensor
    top: Tensor


class AppendWork:
    """The buffers archive appends compute in, per device: grown to the largest block, never per block.

    One append's packed bytes (K/V rows, positions, the summaries of the pages it completes) and the
    float32 work of its summaries and int8 quantization, sized for the most pages a block can touch. A
    cache's archives share one (``recall.attach``): layers append in turn, and on CUDA the copy out of
    ``packed`` is queued before the next layer's kernels overwrite it.
    """

    def __init__(self, background: bool | None = None) -> None:
        self.buffers: dict[tuple[str, torch.device], Tensor] = {}
        self.limits: dict[torch.device, Constants] = {}
        # whether a stack's staged bytes are written to the stores by a writer thread while the next block
        # computes (None: on CUDA, where the host would otherwise wait for the copy and write between blocks)
        self.background = background
        self.writer: ThreadPoolExecutor | None = None
        self.jobs: collections.deque[Future] = collections.deque()  # in submission order (one writer thread)

    def writes_behind(self, device: torch.device) -> bool:
        """Whether appends on ``device`` leave their stores' writes to the writer thread."""
        return device.type == "cuda" if self.background is None else self.background

    def submit(self, fn: Callable[[], None]) -> Future:
        """Queue ``fn`` (one staged append's writes) on the cache's writer thread, made on first use."""
        if self.writer is None:
            self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtool-archive")
        job = self.writer.submit(fn)
        self.jobs.append(job)
        return job

    def raise_failed(self) -> None:
        """Forget the finished writes; the first that failed raises here (once), a block or two after it ran."""
        while self.jobs and self.jobs[0].done():
            self.jobs.popleft().result()

    def wait(self) -> None:
        """Every queued write done (before the stores are read); the first that failed raises (once)."""
        while self.jobs:
            self.jobs.popleft().result()

    def close(self) -> None:
        """Let the queued writes finish (their stores are about to close; failures no longer matter) and stop
        the writer thread; a later append starts another."""
        on_writer = threading.current_thread().name.startswith("kvtool-archive")  # a finalizer run by the writer
        if not on_writer:
            wait_for(list(self.jobs))
        self.jobs.clear()
        if self.writer is not None:
            self.writer.shutdown(wait=not on_writer)
            self.writer = None

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """Buffer ``name`` viewed as ``shape`` in ``dtype`` (contents undefined); replaced only when too small."""
        nbytes = math.prod(shape) * dtype.itemsize
        key = (name, device)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = self.buffers[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes].view(dtype).view(shape)

    def constants(self, device: torch.device) -> Constants:
        """The append's constants on ``device``, made once (a Python number would be wrapped and cast per call)."""
        got = self.limits.get(device)
        if got is None:
            sign = torch.ones(1, 2, 1, 1, device=device)  # filled on the device: no copy from the host
            sign[:, 0] = -1.0
            got = self.limits[device] = Constants(sign, (sign * float("inf")).to(SUMMARY_DTYPE),
                                                  torch.zeros((), device=device), torch.full((), 127.0, device=device))
        return got
