"""Metrics of the eval tasks: pure functions on tensors and strings (no model, no I/O).

Conventions (docs/evaluation.md documents them):

* logits are ``[T, V]`` (one row per predicted position), computed in float32 whatever their dtype;
* ``p`` is always the dense reference and ``q`` the evicted run: ``KL(p ‖ q)``;
* ``normalised_error(a, b)`` is ``‖a − b‖₂ / ‖a‖₂`` per head (over the head dimension), then the mean
  over heads and every leading dimension (tokens), ``a`` being the dense attention output;
* answers are scored by containment after whitespace normalisation, case-insensitively by default.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import Tensor

_WS = re.compile(r"\s+")


def _rows(logits: Tensor) -> Tensor:
    if logits.dim() != 2:
        raise ValueError(f"expected logits [T, V], got shape {tuple(logits.shape)}")
    return logits.float()


def mean_nll(logits: Tensor, targets: Tensor) -> float:
    """Mean negative log-likelihood (nats) of ``targets`` [T] under ``logits`` [T, V]."""
    logits = _rows(logits)
    targets = targets.reshape(-1).to(logits.device, torch.long)
    if targets.numel() != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logit rows but {targets.numel()} targets")
    if targets.numel() == 0:
        raise ValueError("no targets")
    return float(F.cross_entropy(logits, targets, reduction="mean"))


def perplexity(logits: Tensor, targets: Tensor) -> float:
    """exp(mean NLL): the perplexity of ``targets`` [T] under next-token ``logits`` [T, V]."""
    return math.exp(mean_nll(logits, targets))


def kl_divergence(p_logits: Tensor, q_logits: Tensor) -> float:
    """Mean over positions of KL(p ‖ q) in nats, p = softmax(p_logits) (the dense reference)."""
    p, q = _rows(p_logits), _rows(q_logits).to(p_logits.device)
    if p.shape != q.shape:
        raise ValueError(f"shape mismatch: {tuple(p.shape)} vs {tuple(q.shape)}")
    logp = F.log_softmax(p, dim=-1)
    logq = F.log_softmax(q, dim=-1)
    kl = (logp.exp() * (logp - logq)).sum(-1).clamp_min(0.0)  # ≥ 0: only rounding makes it negative
    return float(kl.mean())


def top1_agreement(p_logits: Tensor, q_logits: Tensor) -> float:
    """Fraction of positions where both distributions have the same most likely token."""
    p, q = _rows(p_logits), _rows(q_logits).to(p_logits.device)
    if p.shape != q.shape:
        raise ValueError(f"shape mismatch: {tuple(p.shape)} vs {tuple(q.shape)}")
    return float((p.argmax(-1) == q.argmax(-1)).float().mean())


def normalised_error(a: Tensor, b: Tensor, eps: float = 1e-12) -> float:
    """Mean over heads (and leading dims) of ‖a − b‖₂ / ‖a‖₂ taken over the last dim (head_dim).

    ``a`` is the dense attention output ``[..., H, d]``, ``b`` the evicted one, same shape.
    A head whose dense output is exactly zero counts as error 0 if ``b`` is zero too (``eps`` guard).
    """
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}")
    a, b = a.float(), b.float().to(a.device)
    num = torch.linalg.vector_norm(a - b, dim=-1)
    den = torch.linalg.vector_norm(a, dim=-1).clamp_min(eps)
    return float((num / den).mean())


def normalise_text(text: str) -> str:
    """Collapse every run of whitespace to one space and strip the ends."""
    return _WS.sub(" ", text).strip()


def contains_answer(text: str, answer: str, case_sensitive: bool = False) -> bool:
    """True when ``answer`` occurs in ``text`` after whitespace normalisation of both.

    Case-insensitive by default ("Paris" matches "paris"); passkeys are digits, so case never matters
    for the default needle. An empty answer never matches.
    """
    a = normalise_text(answer)
    t = normalise_text(text)
    if not a:
        return False
    if not case_sensitive:
        a, t = a.casefold(), t.casefold()
    return a in t


# --------------------------------------------------------------------------------------------- answer agreement
_TOKEN = re.compile(r"\w+", re.UNICODE)


def answer_tokens(text: str) -> list[str]:
    """Lower-cased word tokens (SQuAD-style normalisation without the English article list)."""
    return _TOKEN.findall(text.casefold())


def exact_match(reference: str, candidate: str) -> bool:
    """Same words in the same order (case, punctuation and whitespace ignored)."""
    return answer_tokens(reference) == answer_tokens(candidate)


def token_f1(reference: str, candidate: str) -> float:
    """Harmonic mean of word precision and recall over the bag of words (SQuAD's F1).

    Two empty answers agree (1.0); one empty answer against a non-empty one scores 0.
    """
    ref, cand = answer_tokens(reference), answer_tokens(candidate)
    if not ref or not cand:
        return float(ref == cand)
    common: dict[str, int] = {}
    counts: dict[str, int] = {}
    for w in ref:
        counts[w] = counts.get(w, 0) + 1
    for w in cand:
        if counts.get(w, 0) > 0:
            counts[w] -= 1
            common[w] = common.get(w, 0) + 1
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(cand), overlap / len(ref)
    return 2 * precision * recall / (precision + recall)


def _lcs(a: list[str], b: list[str]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(reference: str, candidate: str) -> float:
    """ROUGE-L F-measure (β = 1): longest common word subsequence over both lengths."""
    ref, cand = answer_tokens(reference), answer_tokens(candidate)
    if not ref or not cand:
        return float(ref == cand)
    lcs = _lcs(ref, cand)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(cand), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)
