"""``full``: no eviction at all — the dense reference every other policy is compared with."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvtool.core.contract import GroupSpec, Policy, PolicyEnv, ScoreContext, register


@register
@dataclass
class Full(Policy):
    """Keep every token: the cache grows with the document (what dense transformers do)."""

    name = "full"
    description = "no eviction: the dense reference (memory grows with the document)"
    paper = "-"

    def layer_groups(self, layer_idx: int, env: PolicyEnv) -> list[GroupSpec]:
        return [GroupSpec(heads=list(range(env.num_kv_heads)), capacity=None, policy=self)]

    def score(self, ctx: ScoreContext) -> Tensor:  # never called: capacity is unbounded
        raise AssertionError("full never evicts")
