"""``h2o``: Heavy-Hitter Oracle — keep the tokens with the largest accumulated attention."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvtool.core.contract import Policy, ScoreContext, register
from kvtool.errors import UsageError


@register
@dataclass
class H2O(Policy):
    """H2O (Zhang et al., 2023): accumulated attention, VATP eq. 2, ``S_k^t = Σ_{k≤j≤t} a_k^j``.

    The same score is CAOTE §2 (``f_score,j = Σ_i A_{i,j}`` over the block's rows) and KeyDiff
    App. A.1 (``φ_H2O(A) = A_prev + Aᵀ1``): the running sum ``A_prev`` is the per-token state field
    ``acc``, and every block adds ``Aᵀ1``, the column sums of *all* the block's query rows
    (``query_rows(m) = m``). Because the running sum must see every query, ``observe`` runs on every
    block, not only when evicting. New tokens start at 0 (the engine zero-fills their state) and an
    evicted token's sum leaves with it, so ``acc`` of a kept token is exactly the attention it has
    received from every query processed since it was appended.

    Following VATP App. A, a budget of k tokens is split into k/2 heavy hitters and a local window
    of k/2 recent tokens: ``recent_ratio`` (default 0.5) sets that window,
    ``protected_recent(capacity) = int(capacity * recent_ratio)``.
    """

    name = "h2o"
    description = "H2O: accumulated attention (heavy hitters) + a recent window of recent_ratio*budget"
    paper = "Zhang et al. 2023, H2O: Heavy-Hitter Oracle (VATP eq. 2, CAOTE §2, KeyDiff App. A.1)"
    state_fields = ("acc",)
    observe_every_step = True
    observe_fixed = True  # one add of the row sums: the decode step runs it over every slot
    rows_summed = True  # ``observe`` adds Aᵀ1 only

    recent_ratio: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.recent_ratio <= 1.0:
            raise UsageError(f"h2o option recent_ratio={self.recent_ratio} must be between 0 and 1")

    def query_rows(self, block_len: int) -> int:
        return block_len

    def protected_recent(self, capacity: int) -> int:
        return int(capacity * self.recent_ratio)

    def observe(self, ctx: ScoreContext) -> None:
        assert ctx.probs is not None, "h2o needs attention probabilities"
        ctx.state["acc"].add_(ctx.probs.sum(dim=1, dtype=ctx.state["acc"].dtype))

    def score(self, ctx: ScoreContext) -> Tensor:
        # A copy: a modifier that rescales the score in place must not touch the running sums.
        return ctx.state["acc"].clone()
