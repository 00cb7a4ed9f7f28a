"""Choosing the next token: greedy or nucleus sampling, with a guard against loops.

A small model decoding greedily tends to loop ("The answer is 42. The answer is 42. ..."). The blanket
CTRL repetition penalty that used to stop it also penalises every token the answer already wrote,
which cuts exact strings: the second ``4`` of ``60494`` is penalised, and the answer comes out as
``6049``. The default guard is narrower: an answer never repeats one of its own n-grams (a
no-repeat n-gram rule, as in Paulus et al. 2018 and transformers' ``no_repeat_ngram_size``), and an
n-gram with no letter in it (digits, punctuation, spaces: ``,000``) may always repeat, so numbers
and codes come out whole. The document's tokens are never counted: an answer may quote them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

#: ``sampler(logits of the next token [vocab], the answer's tokens so far) → the next token``
Sampler = Callable[[Tensor, list[int]], int]
#: ``wordy(token ids) → whether their text has a letter``: such n-grams are the ones the guard stops
Wordy = Callable[[tuple[int, ...]], bool]


def greedy(logits: Tensor, generated: list[int] | None = None) -> int:
    return int(torch.argmax(logits))


def penalise(logits: Tensor, generated: list[int], penalty: float) -> Tensor:
    """CTRL-style repetition penalty on the answer's own tokens (Keskar et al. 2019, eq. in §4.1):
    a positive logit is divided by ``penalty``, a negative one multiplied. Off (1.0) by default."""
    if penalty == 1.0 or not generated:
        return logits
    logits = logits.float().clone()
    idx = torch.tensor(sorted(set(generated)), device=logits.device)
    picked = logits[idx]
    logits[idx] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


class RepeatGuard:
    """The tokens that would make the answer repeat one of its own word n-grams.

    n-grams are indexed by their first ``n − 1`` tokens as the answer grows (each token is indexed
    once: constant work per decoded token); ``wordy`` is asked only when a repeat is about to happen.
    """

    def __init__(self, n: int, wordy: Wordy | None = None) -> None:
        self.n = n
        self.wordy = wordy
        self.next_of: dict[tuple[int, ...], set[int]] = {}
        self.indexed = 0  # n-grams starting before this index of the answer are in ``next_of``

    def banned(self, generated: list[int]) -> list[int]:
        """The tokens that must not come next (an empty list almost always)."""
        n = self.n
        if n < 1 or len(generated) < n - 1:
            return []
        while self.indexed + n <= len(generated):
            gram = generated[self.indexed : self.indexed + n]
            self.next_of.setdefault(tuple(gram[:-1]), set()).add(gram[-1])
            self.indexed += 1
        prefix = tuple(generated[len(generated) - n + 1 :]) if n > 1 else ()
        followers = self.next_of.get(prefix)
        if not followers:
            return []
        return [t for t in followers if self.wordy is None or self.wordy((*prefix, t))]


def _first_allowed(logits: Tensor, banned: list[int]) -> int:
    """The best token that is not banned (``banned`` is non-empty)."""
    top = torch.topk(logits, min(len(banned) + 1, logits.shape[-1])).indices.tolist()
    return next((t for t in top if t not in banned), top[0])


def make_sampler(temperature: float, top_p: float, seed: int, repetition_penalty: float = 1.0,
                 no_repeat_ngram: int = 0, wordy: Wordy | None = None) -> Sampler:
    """Greedy at temperature 0; otherwise temperature + nucleus sampling with a seeded generator.

    ``no_repeat_ngram`` > 0: the answer never repeats a word n-gram of its own (``RepeatGuard``).
    One sampler per answer: the guard remembers the answer it has seen.
    """
    guard = RepeatGuard(no_repeat_ngram, wordy) if no_repeat_ngram > 0 else None
    if temperature <= 0:
        def pick(logits: Tensor, generated: list[int]) -> int:
            logits = penalise(logits, generated, repetition_penalty)
            tok = greedy(logits)
            if guard is None:
                return tok
            banned = guard.banned(generated)
            return _first_allowed(logits, banned) if tok in banned else tok

        return pick
    gen = torch.Generator().manual_seed(seed)

    def sample(logits: Tensor, generated: list[int]) -> int:
        logits = penalise(logits, generated, repetition_penalty)
        banned = guard.banned(generated) if guard is not None else []
        if banned:
            logits = logits.float().clone()
            logits[banned] = float("-inf")
        probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
        if top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))

    return sample
