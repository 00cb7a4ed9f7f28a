"""``scissorhands``: attention received within a history window of recent queries (bucketed)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvtool.core.contract import Policy, ScoreContext, register
from kvtool.errors import UsageError

#: the most buckets (per-token floats of history) a cache may keep: 1024 floats a token and head already cost
#: several times its keys and values; the exact window of the paper's default (400 queries) fits
MAX_BUCKETS = 1024


@register
@dataclass
class Scissorhands(Policy):
    """Scissorhands (Liu et al., 2023) in the form of VATP eq. 3: ``S_k^t = Σ_{max(t−w,k)≤j≤t} a_k^j``.

    The score of a token is the attention it received from the queries of a history window of
    ``window`` (w = 400, VATP App. A) recent queries; a local window of the ``local`` (10) most
    recent tokens is always kept (``protected_recent``). (The original paper counts how often a
    token's attention fell below a threshold; VATP eq. 3, used here, sums the attention instead.)

    Bounded memory (an approximation of eq. 3): the exact window sum needs every token's attention
    from each of the last w queries. Instead the history is kept in G = ``buckets`` buckets of
    g = ceil(w / G) consecutive queries, one float per bucket per token (state fields ``b0`` ..
    ``b{G−1}``): G floats per token whatever the document length, gathered with K/V on eviction.
    The query at absolute position t belongs to bucket t // g, stored in slot (t // g) % G. On each
    block (all rows, ``observe_every_step``) the rows are split at bucket boundaries; a chunk that
    starts a bucket (t % g == 0) first zeroes its slot (dropping the bucket G ids older), then its
    column sums are added. Everything derives from ``query_positions``: no counter to save.

    ``score`` = sum of the slots = the attention received from the last Q queries, where Q covers
    the current (partial) bucket and the G − 1 full ones before it: (G−1)·g < Q ≤ G·g. When G
    divides w (the defaults: g = 50) that is w − g < Q ≤ w; G = w gives the exact eq. 3 window.
    """

    name = "scissorhands"
    description = "Scissorhands: attention from the last ~window queries (G buckets) + `local` recent tokens"
    paper = "Liu et al. 2023, Scissorhands (VATP eq. 3 and App. A)"
    observe_every_step = True

    window: int = 400
    buckets: int = 8
    local: int = 10

    def __post_init__(self) -> None:
        if self.window < 1:
            raise UsageError(f"scissorhands option window={self.window} must be at least 1")
        if not 1 <= self.buckets <= min(self.window, MAX_BUCKETS):
            raise UsageError(f"scissorhands option buckets={self.buckets} must be between 1 and window (at most "
                             f"{MAX_BUCKETS}: each bucket is one float per cached token and head)")
        if self.local < 0:
            raise UsageError(f"scissorhands option local={self.local} must be non-negative")

    @property
    def state_fields(self) -> tuple[str, ...]:  # type: ignore[override]
        """One field per bucket: G floats per token (depends on the ``buckets`` option)."""
        return tuple(f"b{i}" for i in range(self.buckets))

    @property
    def bucket_size(self) -> int:
        """g = ceil(w / G) queries per bucket."""
        return -(-self.window // self.buckets)

    def query_rows(self, block_len: int) -> int:
        return block_len

    def protected_recent(self, capacity: int) -> int:
        return self.local

    def observe(self, ctx: ScoreContext) -> None:
        assert ctx.probs is not None, "scissorhands needs attention probabilities"
        r = ctx.probs.shape[1]
        if r == 0:
            return
        g, n_buckets = self.bucket_size, self.buckets
        # The rows are the block's last r queries, at stream positions seen + m − r .. seen + m − 1
        # (Python ints the cache already knows: reading query_positions would sync the host).
        qpos = range(ctx.seen + ctx.block_len - r, ctx.seen + ctx.block_len)
        last_id = qpos[-1] // g
        start = 0
        while start < r:
            bucket = qpos[start] // g
            end = start + 1
            while end < r and qpos[end] // g == bucket:
                end += 1
            # A bucket G ids older than the newest is overwritten later in this same block.
            if bucket > last_id - n_buckets:
                slot = ctx.state[f"b{bucket % n_buckets}"]
                if qpos[start] % g == 0:
                    slot.zero_()
                slot.add_(ctx.probs[:, start:end].sum(dim=1, dtype=slot.dtype))
            start = end

    def score(self, ctx: ScoreContext) -> Tensor:
        return torch.stack([ctx.state[f] for f in self.state_fields]).sum(dim=0, dtype=torch.float32)
