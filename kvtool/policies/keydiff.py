"""``keydiff``: KeyDiff — keep the keys least similar to the mean key direction (attention-free)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvtool.core.contract import Policy, ScoreContext, register

_EPS = 1e-6  # guards the division of an all-zero key (or a zero anchor)


@register
@dataclass
class KeyDiff(Policy):
    """KeyDiff (Park et al., 2025), the efficient form, eq. 8: ``s_i = −CosSim(µ(K̂), k_i)``.

    ``k̂_i = k_i / ‖k_i‖`` and the anchor ``µ(K̂)`` is the mean of the normalised keys over the
    group's tokens — the cache and the block just appended, all n — per KV head. Keeping the
    top-``capacity`` scores keeps the most distinctive keys; eq. 8 is the O(n) relaxation of
    minimising the pairwise key cosine similarity of the kept set (eq. 7, 9). Attention-free
    (``query_rows = 0``): the score never reads ``ctx.probs`` (None for this policy), so attention
    can run without materialising probabilities. Computed in float32 from the stored (post-RoPE)
    keys, whatever their storage dtype; each key's inverse norm is a per-token constant kept in the
    state (RoPE rotations preserve it), so a score is two matrix-vector products.
    """

    name = "keydiff"
    description = "KeyDiff: negative cosine similarity of each key to the mean normalised key (attention-free)"
    paper = "Park et al. 2025, KeyDiff: Key Similarity-Based KV Cache Eviction (eq. 8)"
    state_fields = ("inv_norm",)  # 1/‖k_i‖, a per-token constant (``constants``)

    def constants(self, keys: Tensor, values: Tensor) -> dict[str, Tensor]:
        return {"inv_norm": 1.0 / keys.float().norm(dim=-1).clamp_min(_EPS)}

    def score(self, ctx: ScoreContext) -> Tensor:
        # cos(k_i, µ) = (k_i · µ) / ‖k_i‖ with µ = Σ_i k_i/‖k_i‖ up to a positive factor (which does
        # not change the ranking, but is divided out to return the cosine itself): two matrix-vector
        # products over the stored keys, no normalised copy of them.
        keys = ctx.keys.float()  # [h, n, d] (no copy for float32 storage)
        inv = ctx.state["inv_norm"]  # [h, n]
        anchor = torch.bmm(inv.unsqueeze(1), keys)  # [h, 1, d]: n · µ(K̂)
        anchor = anchor / anchor.norm(dim=-1, keepdim=True).clamp_min(_EPS)
        return torch.bmm(keys, anchor.transpose(1, 2)).squeeze(-1).mul_(inv).neg_()  # [h, n]: −cos(k_i, µ(K̂))
