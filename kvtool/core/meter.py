"""Memory measurement: process RSS on CPU, the CUDA allocator's figures on GPU.

``ru_maxrss`` is a lifetime peak (it would include model conversion), so the peak of a phase is
tracked by a light sampling thread that can be reset: ``with meter.track(): ...``. It wakes every
50 ms (one ``/proc`` read): a much faster sampler would steal time slices from the compute threads
on a machine with few cores, and every block/step event samples too (``sample``), so block-boundary peaks are seen.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import torch

from kvtool.core.events import MemorySample


class MemoryMeter:
    """Current and peak memory for one device."""

    def __init__(self, device: torch.device, interval: float = 0.05) -> None:
        self.device = device
        self.interval = interval
        self._proc = psutil.Process()
        self.peak_rss = self.rss()
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def rss(self) -> int:
        return int(self._proc.memory_info().rss)

    def sample(self) -> MemorySample:
        rss = self.rss()
        self.peak_rss = max(self.peak_rss, rss)
        s = MemorySample(rss_bytes=rss, peak_rss_bytes=self.peak_rss)
        if self.device.type == "cuda":
            s.cuda_allocated_bytes = int(torch.cuda.memory_allocated(self.device))
            s.cuda_reserved_bytes = int(torch.cuda.memory_reserved(self.device))
            s.cuda_peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
        return s

    def reset_peak(self) -> None:
        self.peak_rss = self.rss()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int:
        """The figure reported as peak memory: CUDA max allocated on GPU, RSS peak on CPU."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        self.peak_rss = max(self.peak_rss, self.rss())
        return self.peak_rss

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(self.interval):
            self.peak_rss = max(self.peak_rss, self.rss())

    @contextmanager
    def track(self, reset: bool = True) -> Iterator[MemoryMeter]:
        """Sample RSS in the background while the block runs (catches short spikes between events)."""
        if reset:
            self.reset_peak()
        stop = threading.Event()
        thread = threading.Thread(target=self._run, args=(stop,), daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()
            self.peak_rss = max(self.peak_rss, self.rss())
