"""Events the engine emits while it works; dashboards and benchmarks subscribe to them.

The engine only calls ``emit(event)``: it never imports rich or any front end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class MemorySample:
    """Process memory at one moment. On CUDA the ``cuda_*`` fields are filled too."""

    rss_bytes: int
    peak_rss_bytes: int
    cuda_allocated_bytes: int | None = None
    cuda_reserved_bytes: int | None = None
    cuda_peak_bytes: int | None = None


@dataclass
class PrefillProgress:
    """Sent after every prefill block."""

    tokens_done: int
    tokens_total: int | None  # estimate while the document is still being read
    seconds: float
    cache_min: int  # tokens per KV head, min / mean / max over layers and head groups
    cache_mean: float
    cache_max: int
    evicted_total: int  # tokens evicted so far, summed over layers and KV heads
    memory: MemorySample
    time_split: dict[str, float] = field(default_factory=dict)  # forward / probs / score / evict s (sum: the steps')
    parts_done: int | None = None  # pages / chapters / sections of the document read so far (set by the runtime)
    parts_total: int | None = None
    parts_unit: str = ""  # "page", "chapter" or "section"


@dataclass
class DecodeProgress:
    """Sent after every generated token."""

    tokens: int
    seconds: float
    text: str = ""  # the newly decoded piece


@dataclass
class Note:
    """A one-line notice for the user (e.g. the switch to compact positions)."""

    message: str


@dataclass
class RunSummary:
    """Sent once at the end with the same figures as ``--json`` stats."""

    stats: dict[str, Any]


Event = PrefillProgress | DecodeProgress | Note | RunSummary
Listener = Callable[[Event], None]
