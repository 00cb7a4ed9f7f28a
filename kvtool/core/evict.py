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


def protection_rank(pos: Tensor, sinks: Tensor, pinned: Tensor, recent: Tensor) -> Tensor:
    """[h, n] int64 ranks: the highest grade a token has, then newest first (sinks: oldest first)."""
    grade = torch.where(sinks, GRADE_SINK, torch.where(pinned, GRADE_PINNED, torch.where(recent, GRADE_RECENT, 0)))
    order = torch.where(sinks, SPAN - 1 - pos, pos)
    return grade * SPAN + order


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
            ctx.priority = torch.where(ctx.protected, ctx.priority, GRADE_POLICY * SPAN + ctx.positions)
        ctx.protected = ctx.protected | extra
    if not g.policy.observe_every_step:
        g.policy.observe(ctx)
    keep = g.policy.select(ctx)
    timer.stop("score", t0)
    t1 = timer.start()
    n, c = g.length, keep.shape[1]
    if archive is not None and n > c:
        archive(g, dropped_indices(keep, n))
    g.gather(keep)
    timer.stop("evict", t1)
    return n - c
