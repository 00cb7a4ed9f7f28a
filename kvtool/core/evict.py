"""The eviction step of one head group: let the policy observe, choose what to keep, archive the rest, gather.

    ctx (scores' inputs, protection) → policy.observe → policy.select (keep_top) → archive dropped → gather

The policy scores and picks the ``capacity`` tokens to keep per head (protected ones always kept);
the dropped tokens go to the group's archive (recall) at their original positions, then every
per-token buffer of the group is gathered with the same index (``TokenBuffers.gather``).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from kvtool.core.archive import dropped_indices
from kvtool.core.contract import ScoreContext
from kvtool.core.storage import HeadGroup

#: archives the dropped tokens of a group: (group, dropped indices [h, n − c])
Archiver = Callable[[HeadGroup, Tensor], None]


def evict_step(g: HeadGroup, ctx: ScoreContext, evicting: bool, archive: Archiver | None,
               clock: Callable[[], float]) -> tuple[int, float, float]:
    """Observe the block and, when ``evicting``, bring ``g`` down to its capacity.

    Returns (tokens evicted per head, seconds scoring, seconds evicting).
    """
    t0 = clock()
    extra = g.policy.extra_protected(ctx)
    if extra is not None:
        ctx.protected = ctx.protected | extra
    g.policy.observe(ctx)
    keep = g.policy.select(ctx) if evicting else None
    t1 = clock()
    if keep is None:
        return 0, t1 - t0, 0.0
    n, c = g.length, keep.shape[1]
    if archive is not None and n > c:
        archive(g, dropped_indices(keep, n))
    g.gather(keep)
    return n - c, t1 - t0, clock() - t1
