"""Events the runtime emits besides the engine's (:mod:`kvtool.core.events`): the CLI's dashboard draws them.

Plain data, no terminal: a session calls its listener, whoever listens decides what to show.
"""

from __future__ import annotations

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
