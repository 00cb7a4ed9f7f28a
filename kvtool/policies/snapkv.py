"""``snapkv``: SnapKV — attention from an observation window of recent queries, smoothed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kvtool.core.contract import Policy, ScoreContext, register
from kvtool.errors import UsageError

#: the widest pooling kernel (tokens): SnapKV pools over 7; the work per token grows with the kernel
MAX_KERNEL = 1023


@register
@dataclass
class SnapKV(Policy):
    """SnapKV (Li et al., 2024), as stated in KeyDiff App. A.1: ``φ_SnapKV(A) = (Aᵀ1) * K``.

    ``A`` is the attention of the block's last ``window`` query rows (the observation window,
    ``query_rows = min(window, m)``), ``Aᵀ1`` its column sums, and ``* K`` a 1-D average pooling
    along the tokens with kernel ``kernel`` (KeyDiff App. B.2: kernel 7, the most recent 32 tokens
    always kept, so ``protected_recent = window``). No running state.

    Pooling details (choices, documented):

    * stride 1, padding ``kernel // 2``, so the score has one value per token (``kernel`` must be
      odd); ``count_include_pad=False``, so the first and last tokens of a run are averaged over
      the neighbours that exist instead of being pulled towards 0 by padding.
    * As in the reference SnapKV code, only the candidates are pooled: the last ``window`` tokens
      are always kept, so the tokens before them are pooled among themselves and the protected
      tail keeps its raw column sums. Pooling across the boundary would let the observation
      window's large attention to itself (the causal diagonal) leak into its 3 left neighbours.
    * The observation window is the current block's last ``min(window, m)`` queries (kvtool streams
      blocks; SnapKV itself scores once, at the end of the prompt). With ``--block-size`` below
      ``window`` it is the whole block, and while decoding (blocks of one token) it is the single
      newest query, i.e. SnapKV then scores like TOVA pooled. Keeping older queries would cost a
      per-layer query cache; the protected tail stays ``window`` tokens in every case (tested).
    """

    name = "snapkv"
    description = "SnapKV: attention from the last `window` queries, avg-pooled (kernel), last `window` kept"
    paper = "Li et al. 2024, SnapKV: LLM Knows What You Are Looking For (KeyDiff App. A.1, B.2)"

    rows_summed = True  # the score reads Aᵀ1 only

    window: int = 32
    kernel: int = 7

    def __post_init__(self) -> None:
        if self.window < 1:
            raise UsageError(f"snapkv option window={self.window} must be at least 1")
        if self.kernel < 1 or self.kernel % 2 == 0 or self.kernel > MAX_KERNEL:
            raise UsageError(f"snapkv option kernel={self.kernel} must be a positive odd number, at most {MAX_KERNEL} "
                             "(pooling costs kernel operations per cached token)")

    def query_rows(self, block_len: int) -> int:
        return min(self.window, block_len)

    def protected_recent(self, capacity: int) -> int:
        return self.window

    def score(self, ctx: ScoreContext) -> Tensor:
        assert ctx.probs is not None, "snapkv needs attention probabilities"
        summed = ctx.probs.sum(dim=1, dtype=torch.float32)  # [h, n]: Aᵀ1 over the window rows
        cut = max(ctx.n - self.window, 0)  # candidates [0, cut); the protected tail [cut, n)
        out = summed.clone()
        if cut > 0 and self.kernel > 1:
            out[:, :cut] = F.avg_pool1d(
                summed[:, :cut].unsqueeze(1),
                kernel_size=self.kernel,
                stride=1,
                padding=self.kernel // 2,
                count_include_pad=False,
            ).squeeze(1)
        return out
