"""Choosing the next token on the device: greedy or nucleus sampling, with a guard against loops.

A small model decoding greedily tends to loop ("The answer is 42. The answer is 42. ..."). The blanket
CTRL repetition penalty that used to stop it also penalises every token the answer already wrote,
which cuts exact strings: the second ``4`` of ``60494`` is penalised, and the answer comes out as
``6049``. The default guard is narrower: an answer never repeats one of its own n-grams (a
no-repeat n-gram rule, as in Paulus et al. 2018 and transformers' ``no_repeat_ngram_size``), and an
n-gram with no letter in it (digits, punctuation, spaces: ``,000``) may always repeat, so numbers
and codes come out whole. The document's tokens are never counted: an answer may quote them.

The answer's tokens live in a device buffer and the greedy choice, the guard and the penalty are tensor
operations on it: choosing a token never reads one back, so the engine reads the answer only when it
needs it (to stream it, to stop at an end token), on a GPU once every few tokens when nothing streams.
Sampling reads each token's distribution back: a seeded CPU generator gives the same answer on every device.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: answer tokens the device buffer holds at first (it doubles when an answer is longer)
FIRST_ROOM = 1024


class Chooser:
    """The tokens of one answer, chosen one at a time from the model's logits into ``ids`` (on the device).

    ``letters`` [vocab] (bool): which tokens spell a letter (or a piece of a multi-byte character); an
    n-gram is a word n-gram, which the guard stops, when one of its tokens does. None: every n-gram is.
    """

    def __init__(self, max_new_tokens: int, device: torch.device | str, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, repetition_penalty: float = 1.0, no_repeat_ngram: int = 0,
                 letters: Tensor | None = None) -> None:
        # grown with the answer (doubling), never sized by the option alone: a long limit costs nothing until used
        self.limit = max(1, max_new_tokens)
        self.ids = torch.zeros(min(self.limit, FIRST_ROOM), dtype=torch.long, device=device)
        self.temperature = temperature
        self.top_p = top_p
        self.penalty = repetition_penalty
        self.n = no_repeat_ngram
        self.letters = None if letters is None else letters.to(device)
        self.gen = torch.Generator().manual_seed(seed) if temperature > 0 else None
        self.sampled: list[int] = []  # sampling: the tokens, already on the host
        self.works: dict[str, Tensor] = {}  # ``_work``'s buffers (a decode step hands its own)

    @property
    def reads_each_token(self) -> bool:
        """Sampling reads every token's distribution back to the host (greedy choice reads nothing)."""
        return self.gen is not None

    def __call__(self, logits: Tensor, t: int) -> Tensor:
        """Choose the answer's token ``t`` from ``logits`` [vocab]; returns it as a [1] view of ``ids``."""
        if t >= self.ids.numel():
            self._grow()
        logits = self.guarded(self.penalised(logits, t), t)
        out = self.ids[t : t + 1]
        if self.gen is None:
            torch.argmax(logits, dim=-1, keepdim=True, out=out)  # the best token the guard allows
        else:
            self.sampled.append(self._sample(logits))
            out.fill_(self.sampled[-1])
        return out

    def choose_at(self, logits: Tensor, t: Tensor, out: Tensor) -> None:
        """``__call__``'s greedy choice at a device index ``t`` [1], written to ``ids[t]`` and ``out`` (any shape of
        one element): the decode step's form (``kvtool/core/decode_step.py``). The guard and the penalty read the
        whole of ``ids`` with the tokens at ``t`` and after masked out, so no shape depends on ``t``, nothing is
        read back and the same ops replay at every token; ``ids`` must have room for ``t``."""
        best = torch.argmax(self.guarded_at(self.penalised_at(logits, t), t), dim=-1, keepdim=True)
        self.ids.index_copy_(0, t, best)
        out.view(1).copy_(best)

    def penalised_at(self, logits: Tensor, t: Tensor) -> Tensor:
        """``penalised`` over the whole buffer, tokens from ``t`` on left out (none before the first token)."""
        if self.penalty == 1.0:
            return logits
        logits = logits.float()
        written = (self._work("slots", self.ids.numel()) < t).float()
        hit = self._work("hit", logits.numel(), torch.float32).zero_().scatter_reduce_(0, self.ids, written, "amax") > 0
        return torch.where(hit, torch.where(logits > 0, logits / self.penalty, logits * self.penalty), logits)

    def guarded_at(self, logits: Tensor, t: Tensor) -> Tensor:
        """``guarded`` over every n-gram of the whole buffer, those not wholly before ``t`` allowed."""
        n = self.n
        if n < 1 or self.ids.numel() < n:
            return logits
        grams = self.ids.unfold(0, n, 1)  # [R − n + 1, n]
        written = self._work("slots", grams.shape[0]) <= t - n  # the gram ends before token t
        last = self.ids.index_select(0, (self._work("slots", n - 1) + (t - n + 1)).clamp_(min=0))
        repeat = (grams[:, :-1] == last).all(-1) & written
        if self.letters is not None:
            repeat &= self.letters[grams].any(-1)
        ban = torch.where(repeat, float("-inf"), float("inf"))
        return logits.float().scatter_reduce(0, grams[:, -1], ban, "amin")

    def _work(self, name: str, n: int, dtype: torch.dtype | None = None) -> Tensor:
        """A reused buffer of ``n`` elements: ``0 … n − 1`` (``dtype`` None, int64) or a float32 one to overwrite;
        made once (before a capture), so a step allocates none."""
        store = self.works.get(name)
        if store is None or store.numel() < n:
            store = torch.arange(n, device=self.ids.device) if dtype is None else torch.empty(n, dtype=dtype,
                                                                                                device=self.ids.device)
            self.works[name] = store
        return store[:n]

    def _grow(self) -> None:
        """Twice the room for the answer's tokens (at most ``limit``): a copy once per doubling, so a few per answer."""
        n = self.ids.numel()
        ids = torch.zeros(min(2 * n, self.limit), dtype=torch.long, device=self.ids.device)
        ids[:n].copy_(self.ids)
        self.ids = ids

    def read(self, start: int, stop: int) -> list[int]:
        """Tokens ``start:stop`` of the answer on the host: one read of the device buffer (none when sampling,
        whose tokens were read to be chosen)."""
        return self.sampled[start:stop] if self.gen is not None else self.ids[start:stop].tolist()

    def penalised(self, logits: Tensor, t: int) -> Tensor:
        """CTRL-style repetition penalty on the answer's own tokens (Keskar et al. 2019, eq. in §4.1):
        a positive logit is divided by the penalty, a negative one multiplied. Off (1.0) by default."""
        if self.penalty == 1.0 or t == 0:
            return logits
        logits, seen = logits.float(), self.ids[:t]
        picked = logits.gather(0, seen)
        return logits.scatter(0, seen, torch.where(picked > 0, picked / self.penalty, picked * self.penalty))

    def guarded(self, logits: Tensor, t: int) -> Tensor:
        """``logits`` with −inf for each token that would repeat one of the answer's word n-grams.

        Every n-gram of the answer so far is compared with its last n − 1 tokens at once (an unfolded view
        of ``ids``, a few small kernels, no host read): those that match ban their last token.
        """
        n = self.n
        if n < 1 or t < n:
            return logits
        grams = self.ids[:t].unfold(0, n, 1)  # [t − n + 1, n]: every n-gram the answer has written
        repeat = (grams[:, :-1] == self.ids[t - n + 1 : t]).all(-1)
        if self.letters is not None:
            repeat &= self.letters[grams].any(-1)
        ban = torch.where(repeat, float("-inf"), float("inf"))
        return logits.float().scatter_reduce(0, grams[:, -1], ban, "amin")

    def _sample(self, logits: Tensor) -> int:
        """Temperature + nucleus sampling on the host with the seeded generator (one read per token).

        In float64, from the logits less their largest: any temperature in range gives finite probabilities
        (the best token's is exp(0) = 1 before normalising, however small the temperature). The nucleus always
        holds the most likely token, so any top-p in (0, 1] samples (a top-p below the best token's
        probability, even 1e-300, is greedy), never an all-zero distribution.
        """
        logits = logits.double().cpu()
        best = logits.max()
        if not torch.isfinite(best):  # every token banned (−inf) or a broken model (NaN): the greedy choice
            return int(torch.argmax(torch.nan_to_num(logits, nan=float("-inf"))))
        probs = torch.exp((logits - best) / self.temperature)
        if self.top_p < 1.0:
            sorted_p, order = torch.sort(probs / probs.sum(), descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < self.top_p
            keep[0] = True
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs / probs.sum(), 1, generator=self.gen))
