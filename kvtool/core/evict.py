"""The eviction step of one head group: let the policy observe, choose what to keep, archive the rest, gather.

    ctx (scores' inputs, protection) → policy.observe → policy.select (keep_top) → archive dropped → gather

The policy scores and picks the ``capacity`` tokens to keep per head (protected ones always kept);
the dropped tokens go to the group's archive (recall) at their original positions, then every
per-token buffer of the group is gathered with the same index (``TokenBuffers.gather``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from kvtool.core.archive import dropped_indices
from kvtool.core.contract import Policy, ScoreContext
from kvtool.core.timing import SectionTimer

#: protection grades (higher kept first); a token's rank is grade · SPAN + its order within the grade
GRADE_SINK, GRADE_PINNED, GRADE_RECENT, GRADE_POLICY = 4, 3, 2, 1
SPAN = 1 << 40
#: the span of int32 ranks: exact while every position is below it (5 grades · 2^28 < 2^31)
SPAN32 = 1 << 28


def rank_span(end: int) -> tuple[int, torch.dtype]:
    """(SPAN, dtype) of the ranks of a cache that has seen ``end`` tokens: int32 while every position fits its span
    (any document below 268M tokens), int64 past it. Both order the same tokens the same way."""
    return (SPAN32, torch.int32) if end <= SPAN32 else (SPAN, torch.int64)


def protection_rank(pos: Tensor, sinks: Tensor, pinned: Tensor, recent: Tensor, end: int) -> Tensor:
    """[h, n] ranks: the highest grade a token has, then newest first (sinks: oldest first); ``end``: tokens seen,
    which decides the dtype (``rank_span``). Built from the positions with three ``where``s, a rank wide at a time."""
    span, dtype = rank_span(end)
    order = pos.to(dtype)
    rank = torch.where(recent, order + GRADE_RECENT * span, order)
    rank = torch.where(pinned, order + GRADE_PINNED * span, rank)
    return torch.where(sinks, (GRADE_SINK + 1) * span - 1 - order, rank)


#: archives the dropped tokens of a group (or of a stack of groups): (target, dropped indices [h, n − c])
Archiver = Callable[[Any, Tensor], None]


class Target(Protocol):
    """What eviction acts on: a head group, or the groups of every layer of a stack (heads flattened)."""

    policy: Policy
    length: int

    def gather(self, keep: Tensor) -> None: ...


def evict_step(g: Target, ctx: ScoreContext, archive: Archiver | None, timer: SectionTimer) -> int:
    """Bring ``g`` down to its capacity: the policy observes (unless it observed the block already, at its
    attention: ``observe_every_step``), selects the tokens to keep, the others go to the archive, ``gather``.

    Returns the tokens evicted per head; ``timer`` gets the scoring ("score") and the rest ("evict").
    """
    t0 = timer.start()
    extra = g.policy.extra_protected(ctx)
    if extra is not None:
        if ctx.priority is not None:  # the policy's own protection ranks below the engine's
            span = SPAN32 if ctx.priority.dtype == torch.int32 else SPAN
            ctx.priority = torch.where(
                ctx.protected, ctx.priority, ctx.positions.to(ctx.priority.dtype) + GRADE_POLICY * span
            )
        ctx.protected = ctx.protected | extra
    if not g.policy.observe_every_step:
        g.policy.observe(ctx)
    keep = g.policy.select(ctx)
    ctx.protected = ctx.priority = None  # gone before the gather's copy: the two are an eviction's peak apart
    timer.stop("score", t0)
    t1 = timer.start()
    n, c = g.length, keep.shape[1]
    if archive is not None and n > c:
        archive(g, dropped_indices(keep, n))
    g.gather(keep)
    timer.stop("evict", t1)
    return n - c
