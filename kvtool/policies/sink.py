"""``sink``: StreamingLLM — attention sinks plus a sliding window of the most recent tokens."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvtool.core.contract import Policy, ScoreContext, register


@register
@dataclass
class Sink(Policy):
    """StreamingLLM (Xiao et al., 2024; summarised in KeyDiff App. A.2 and CAOTE §5).

    Keeps the first S tokens (the engine's ``sinks`` option, protected for every policy) and the
    most recent ``capacity − S`` tokens: the score of a token is its position, so top-k keeps the
    newest. Attention-free.
    """

    name = "sink"
    description = "StreamingLLM: first S sink tokens + the most recent tokens (attention-free)"
    paper = "Xiao et al. 2024, Efficient Streaming Language Models with Attention Sinks"

    def score(self, ctx: ScoreContext) -> Tensor:
        return ctx.positions.float()
