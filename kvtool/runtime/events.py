"""Events the runtime emits besides the engine's (:mod:`kvtool.core.events`): the CLI's dashboard draws them.

Plain data, no terminal: a session calls its listener, whoever listens decides what to show.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class CalibrationProgress:
    """RazorAttention's one-time head calibration for a model: ``done`` of ``total`` steps (total None: unknown)."""

    done: int
    total: int | None
    what: str = "razor: calibrating retrieval heads"


@dataclass
class DecodeStarting:
    """Sent right before an answer's first token is handed to the caller (nothing of it is written yet).

    A live view on the terminal the answer streams to stops here, so that no redraw lands on the answer.
    """

    label: str = ""


@dataclass
class PhaseProgress:
    """A slow step outside prefill and decode (loading or converting the model, writing or loading a cache).

    Sent when the step starts (``done`` 0), as it advances where it can count, and when it ends
    (``done == total``). ``total`` None: unknown. ``unit``: what is counted (``"bytes"``, ``"steps"``).
    """

    name: str
    done: int
    total: int | None
    unit: str = "steps"

    @property
    def finished(self) -> bool:
        return self.total is not None and self.done >= self.total


def phase_counter(emit: Callable[[PhaseProgress], None] | None, name: str,
                  unit: str = "bytes") -> Callable[[int, int], None] | None:
    """A ``progress(done, total)`` callback for the lower layers (they know no events) that emits
    :class:`PhaseProgress` under ``name``; None when nobody listens."""
    if emit is None:
        return None
    return lambda done, total: emit(PhaseProgress(name, done, total, unit))
