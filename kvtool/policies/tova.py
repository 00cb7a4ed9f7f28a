"""``tova``: Token Omission Via Attention — rank tokens by the attention of the newest query."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvtool.core.contract import Policy, ScoreContext, register


@register
@dataclass
class TOVA(Policy):
    """TOVA (Oren et al., 2024): the score of token j is the attention the *last* query gives it.

    CAOTE §2: ``f_score,j = A^l_{-1,j}``; KeyDiff App. A.1: ``φ_TOVA(A) = A_{-1,:}``. Only the
    block's last query row is needed (``query_rows = 1``), and it sees every stored token (causal:
    the last row sees all n columns). No running state: TOVA's memory of the past is which tokens
    survived earlier evictions. Per-KV-head probabilities are the mean over the query heads that
    share the KV head (the engine's GQA rule, as in KeyDiff App. B.2).
    """

    name = "tova"
    description = "TOVA: attention of the block's last query (one row, no state)"
    paper = "Oren et al. 2024, Transformers are Multi-State RNNs (CAOTE §2, KeyDiff App. A.1)"

    def query_rows(self, block_len: int) -> int:
        return 1

    def score(self, ctx: ScoreContext) -> Tensor:
        assert ctx.probs is not None, "tova needs attention probabilities"
        return ctx.probs[:, -1, :].to(torch.float32, copy=True)  # a copy: modifiers may edit in place
