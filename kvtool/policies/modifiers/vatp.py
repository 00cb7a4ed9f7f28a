"""``vatp``: Value-Aware Token Pruning — a base score times the L1 norm of each token's value."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvtool.core.contract import Modifier, Policy, ScoreContext, register

#: F when neither ``first`` nor the engine's sink count is known (the engine's own default).
DEFAULT_FIRST = 4


@register
@dataclass
class VATP(Modifier):
    """VATP (Guo et al., 2024), eq. 4: ``I_k = S_k · ‖v_k‖₁``.

    The attention output is ``Σ a_i v_i`` (eq. 1), so a token's influence depends on both its
    attention score ``S_k`` (the base policy's score: H2O's accumulated attention, eq. 2, or a
    windowed sum, eq. 3) and the size of its value vector. The L1 norm is used because the paper
    finds it better than L2 (App. B).

    Attention-sink tokens have large attention but tiny value norms, so eq. 4 would rank them low
    although removing them shifts the attention distribution of every other token (§3.2). The
    paper therefore "intentionally keeps the first F tokens": tokens whose absolute position is
    below ``first`` are protected through ``extra_protected`` (``first=None`` uses the engine's sink count, the paper's
    choice of F equal to StreamingLLM's sinks in App. A; 4 when no environment is set).
    """

    base: Policy | None = None
    first: int | None = None

    name = "vatp"
    default_base = "h2o"  # VATP's main variant is "H2O w/ VATP" (Fig. 2)
    description = "VATP: base score × L1 norm of the value vector; first F tokens always kept"
    paper = "Guo et al. 2024, Attention Score is not All You Need for Token Importance Indicator in KV Cache Reduction"

    @property
    def first_tokens(self) -> int:
        """F, the number of leading stream tokens that are always kept."""
        if self.first is not None:
            return max(0, int(self.first))
        return self.env.sinks if self.env is not None else DEFAULT_FIRST

    own_fields = ("v_l1",)  # ‖v_k‖₁, a per-token constant

    def own_constants(self, keys: Tensor, values: Tensor) -> dict[str, Tensor]:
        return {"v_l1": values.float().abs().sum(dim=-1)}

    def modify(self, ctx: ScoreContext, scores: Tensor) -> Tensor:
        return scores * ctx.state["v_l1"]  # [h, n] · ‖v_k‖₁ (computed once per token, at append)

    def extra_protected(self, ctx: ScoreContext) -> Tensor | None:
        mine = ctx.positions < self.first_tokens
        theirs = self.base.extra_protected(ctx) if self.base is not None else None
        return mine if theirs is None else mine | theirs
