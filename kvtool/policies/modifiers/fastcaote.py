"""``fastcaote``: FastCAOTE — CAOTE with the mean of the values in place of the attention output."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvtool.core.contract import register
from kvtool.policies.modifiers.caote import OutputErrorModifier, mean_value


@register
@dataclass
class FastCAOTE(OutputErrorModifier):
    """FastCAOTE (Goel et al., 2025, §3.3), eq. 23: ``c_j = h_j/(1 − h_j)·‖(1/n) Σ_i v_i − v_j‖₂``.

    Identical to CAOTE (normalised base score ``h``, eq. 22, same ``α/(1 − α)`` factor and
    ``1 − α`` guard) except that the pre-eviction output ``X_attn = V Hᵀ`` is replaced by the plain
    mean of the values, which needs no weighted sum over the cache; the paper reports a Spearman
    correlation ≥ 0.8 with CAOTE (Table 8) and negligible accuracy loss. Independent selection only.
    """

    name = "fastcaote"
    description = "FastCAOTE: CAOTE with the mean value in place of the attention output (eq. 23)"
    paper = "Goel et al. 2025, CAOTE: KV Caching through Attention Output Error based Token Eviction"

    def centre(self, alpha: Tensor, values: Tensor) -> Tensor:
        return mean_value(alpha, values)
