"""``keydiff``: KeyDiff — keep the keys least similar to the mean key direction (attention-free)."""

from __future__ import annotations

from dataclasses import dataclass

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
    keys, whatever their storage dtype.
    """

    name = "keydiff"
    description = "KeyDiff: negative cosine similarity of each key to the mean normalised key (attention-free)"
    paper = "Park et al. 2025, KeyDiff: Key Similarity-Based KV Cache Eviction (eq. 8)"

    def score(self, ctx: ScoreContext) -> Tensor:
        keys = ctx.keys.float()  # [h, n, d]
        unit = keys / keys.norm(dim=-1, keepdim=True).clamp_min(_EPS)
        anchor = unit.mean(dim=1, keepdim=True)  # [h, 1, d]: µ(K̂)
        anchor = anchor / anchor.norm(dim=-1, keepdim=True).clamp_min(_EPS)
        return -(unit @ anchor.transpose(1, 2)).squeeze(-1)  # [h, n]: −cos(k_i, µ(K̂))
