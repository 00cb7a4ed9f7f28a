"""Seconds per part of the block loop: the whole step, the policy's probabilities, scoring, eviction.

On a CPU an operator returns when its work is done, so the host clock around a section is the section's
time. On a GPU it returns when the kernel is queued: the host clock measures launches, and making it honest
by synchronising around every section (``sync``, a benchmark's debugging mode) stalls the queue a few
hundred times per block. So on an accelerator a section is a pair of device events recorded on the current
stream, and the time between them is read only when the totals are asked for. Reading never waits for the
device unless asked to (``totals(wait=True)``, once, at the end of a read); a progress event takes what the
device has finished, one block or so behind.

Events come from a pool and go back to it when read, so a steady loop creates none. At most
``MAX_PENDING`` pairs wait unread: past that the oldest is read as new ones are recorded (the device has
long finished it: the launch queue keeps the host at most about a thousand kernels ahead).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["MAX_PENDING", "PARTS", "SECTIONS", "Mark", "SectionTimer", "time_split"]

#: the policy's parts of a step: attention probabilities, scoring, eviction (with gather and archiving)
PARTS = ("probs", "score", "evict")
#: the sections the engine times: ``step`` holds the parts (what is left of it is the model's own forward)
SECTIONS = ("step", *PARTS)
#: unread event pairs held at most (a few layers' worth of sections per block, for a few hundred blocks)
MAX_PENDING = 1024

Mark = Any  # a host time (float) or a recorded device event


class SectionTimer:
    """Adds up seconds per named section; ``start`` gives a mark, ``stop(section, mark)`` adds its time.

    ``mode``: "host" (the host clock: a CPU), "events" (device events: a GPU), "sync" (synchronise, then
    the host clock: exact per section, at a sync per mark). ``event`` makes one timing event; the default
    is ``torch.Event`` on ``device``.
    """

    def __init__(self, device: torch.device, sync: bool = False,
                 event: Callable[[], Any] | None = None) -> None:
        accelerator = device.type != "cpu"
        sync = sync and device.type == "cuda"  # the benchmarks' CUDA debugging mode
        self.mode = "sync" if sync else "events" if accelerator or event is not None else "host"
        self.device = device
        self._event = event or (lambda: torch.Event(device=device, enable_timing=True))
        self._totals = dict.fromkeys(SECTIONS, 0.0)
        self._pending: deque[tuple[str, Any, Any]] = deque()
        self._pool: list[Any] = []

    def now(self) -> float:
        """The host clock, after the device's queued work where ``mode`` is "sync" (a span with host work,
        such as recall's ranking, is timed this way: its device-to-host copies synchronise it anyway)."""
        if self.mode == "sync":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> Mark:
        if self.mode != "events":
            return self.now()
        ev = self._pool.pop() if self._pool else self._event()
        ev.record()
        return ev

    def stop(self, section: str, mark: Mark) -> None:
        if self.mode != "events":
            self._totals[section] = self._totals.get(section, 0.0) + self.now() - mark
            return
        end = self._pool.pop() if self._pool else self._event()
        end.record()
        self._pending.append((section, mark, end))
        if len(self._pending) > MAX_PENDING:
            self._pending[0][2].synchronize()  # long finished, in practice: see the module's docstring
            self._read()

    def totals(self, wait: bool = False) -> dict[str, float]:
        """Seconds per section so far. ``wait``: every recorded section (waits for the device once);
        otherwise those the device has finished."""
        if wait and self._pending:
            self._pending[-1][2].synchronize()  # one stream: the newest done, all are
        self._read()
        return dict(self._totals)

    def reset(self) -> None:
        """Start again from zero (another document); unread events are dropped back into the pool."""
        for _, a, b in self._pending:
            self._pool += [a, b]
        self._pending.clear()
        self._totals = dict.fromkeys(SECTIONS, 0.0)

    def _read(self) -> None:
        """Add up the oldest pairs the device has finished (``query`` does not wait), in order."""
        while self._pending:
            section, a, b = self._pending[0]
            if not b.query():
                return
            self._pending.popleft()
            self._totals[section] = self._totals.get(section, 0.0) + a.elapsed_time(b) / 1000.0
            self._pool += [a, b]


def time_split(totals: dict[str, float]) -> dict[str, float]:
    """Seconds of the model's own forward, the probabilities, scoring and eviction (they add up to the
    steps' time): ``totals`` from ``SectionTimer.totals``."""
    parts = {k: totals.get(k, 0.0) for k in PARTS}
    return {"forward": max(0.0, totals.get("step", 0.0) - sum(parts.values())), **parts}
