"""Do distinctive keys receive high attention? KeyDiff's observation, measured per layer on a real read.

KeyDiff (Park et al. 2025, §3.1, Figure 2) evicts the keys most similar to the mean normalised key,
on the observation that keys unlike the others receive high attention. This module measures that
relation on a model without any eviction:

* a key's **distinctiveness** is ``1 − cos(k_j, µ(K̂))`` with ``µ(K̂)`` the mean of its head's
  normalised keys (KeyDiff eq. 8's anchor; the stored, post-RoPE keys that ``keydiff`` scores);
* the **attention it receives** is the mean, over the queries that can see it (causal: ``i ≥ j``),
  of its attention probability, the query heads sharing a KV head averaged (the engine's GQA rule);
  keys seen by fewer than ``min_queries`` queries are left out (a mean over a handful of queries is noise);
* per layer, the Spearman and Pearson correlations of the two over a head's keys, averaged over the
  layer's KV heads.

A positive correlation supports the observation. ``measure_window`` runs one dense forward of the
model (eager attention for the probabilities, restored afterwards) over a window of tokens;
callers bootstrap the per-layer figures over windows (``kvtool.eval.stats.bootstrap_mean``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

_EPS = 1e-6


def distinctiveness(keys: Tensor) -> Tensor:
    """``1 − cos(k_j, µ(K̂))`` per key: keys ``[heads, tokens, dim]`` → ``[heads, tokens]`` (float64)."""
    k = keys.double()
    unit = k / k.norm(dim=-1, keepdim=True).clamp_min(_EPS)
    anchor = unit.mean(dim=1, keepdim=True)  # [h, 1, d]
    anchor = anchor / anchor.norm(dim=-1, keepdim=True).clamp_min(_EPS)
    return 1.0 - (unit * anchor).sum(dim=-1)


def received_attention(probs: Tensor, kv_heads: int) -> Tensor:
    """Mean attention each key receives from the queries at or after it.

    ``probs`` ``[query_heads, queries, keys]`` (row i attends to keys ≤ i; queries = keys) →
    ``[kv_heads, keys]`` float64; the query heads of a KV head (consecutive groups, GQA) are averaged.
    """
    hq, n, _ = probs.shape
    if hq % kv_heads:
        raise ValueError(f"{hq} query heads do not split into {kv_heads} KV heads")
    p = probs.double().reshape(kv_heads, hq // kv_heads, n, n).mean(dim=1)  # [kv, queries, keys]
    seen_by = torch.arange(n, 0, -1, dtype=torch.float64)  # key j is visible to the n − j queries i ≥ j
    return p.sum(dim=1) / seen_by


def _ranks(x: Tensor) -> Tensor:
    """Average ranks (ties share the mean of their ranks), as Spearman's coefficient needs."""
    order = torch.argsort(x, stable=True)
    ranks = torch.empty_like(x, dtype=torch.float64)
    ranks[order] = torch.arange(len(x), dtype=torch.float64)
    values, inverse = torch.unique(x, return_inverse=True)
    if len(values) < len(x):  # ties: each gets the mean rank of its group
        sums = torch.zeros(len(values), dtype=torch.float64).index_add_(0, inverse, ranks)
        counts = torch.zeros(len(values), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(ranks))
        ranks = (sums / counts)[inverse]
    return ranks


def pearson(x: Tensor, y: Tensor) -> float:
    """Pearson's correlation of two 1-D tensors (0 when either is constant)."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denom = float(x.norm() * y.norm())
    return float((x * y).sum()) / denom if denom > 0 else 0.0


def spearman(x: Tensor, y: Tensor) -> float:
    """Spearman's rank correlation: Pearson's of the average ranks."""
    return pearson(_ranks(x), _ranks(y))


def layer_correlation(keys: Tensor, probs: Tensor, min_queries: int = 32) -> dict[str, float]:
    """One layer: Spearman and Pearson of distinctiveness vs received attention, averaged over KV heads.

    ``keys`` ``[kv_heads, n, dim]``, ``probs`` ``[query_heads, n, n]``; only the first
    ``n − min_queries + 1`` keys (each seen by at least ``min_queries`` queries) are compared.
    """
    n = keys.shape[1]
    keep = n - min_queries + 1
    if keep < 3:
        raise ValueError(f"a window of {n} tokens leaves fewer than 3 keys seen by {min_queries} queries")
    dist = distinctiveness(keys)[:, :keep]
    recv = received_attention(probs, keys.shape[0])[:, :keep]
    heads = range(keys.shape[0])
    return {"spearman": sum(spearman(dist[h], recv[h]) for h in heads) / keys.shape[0],
            "pearson": sum(pearson(dist[h], recv[h]) for h in heads) / keys.shape[0]}


def _layer_keys(cache: Any, layer: int) -> Tensor:
    """Keys of one layer from a transformers cache (``[1, kv_heads, n, dim]``)."""
    layers = getattr(cache, "layers", None)
    return layers[layer].keys if layers is not None else cache.key_cache[layer]


@torch.no_grad()
def measure_window(model: Any, ids: Tensor, min_queries: int = 32) -> list[dict[str, float]]:
    """Per layer, the correlations of one dense forward over ``ids`` (``[n]`` token ids)."""
    previous = getattr(model.config, "_attn_implementation", None) or "sdpa"
    model.set_attn_implementation("eager")  # the probabilities are materialised only by eager attention
    try:
        out = model(ids.view(1, -1).to(model.device), use_cache=True, output_attentions=True)
    finally:
        model.set_attn_implementation(previous)
    cache = out["past_key_values"]
    return [layer_correlation(_layer_keys(cache, i)[0], att[0], min_queries) for i, att in enumerate(out.attentions)]
