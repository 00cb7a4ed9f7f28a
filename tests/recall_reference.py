"""The host path recall took before it scored on the cache's device, kept as an oracle.

Every group's queries go to the host (``.float().cpu()``), the archive is scored there
(``GroupArchive.candidate_pages``, ``GroupArchive.scores``) in two passes past ``SCAN`` tokens, and the
relevance is a host tensor. ``kvtool.core.recall.recall`` must choose the same
positions and give the same answer (tests/test_recall_device.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial

import torch
from torch import Tensor

from kvtool.config import DEFAULT_RECALL_PLACEMENT, SCAN_BYTES
from kvtool.core import recall as recall_module
from kvtool.core.cache import BoundedCache, HeadGroup
from kvtool.core.recall import RecallResult, _group_queries, grown, passage_ranking


@torch.inference_mode()
def host_recall(cache: BoundedCache, log: Iterable[tuple[int, Tensor, float]], tokens: int,
                focus: slice | None = None, placement: str = DEFAULT_RECALL_PLACEMENT,
                trace=None, select: frozenset[str] = frozenset()) -> RecallResult:
    """``recall.recall`` as it was, scored on the host (no trace: the tests compare what is chosen)."""
    assert trace is None
    by_layer: dict[int, list[Tensor]] = {}
    scaling: dict[int, float] = {}
    for layer_idx, q, scale in log:
        by_layer.setdefault(layer_idx, []).append(q)
        scaling[layer_idx] = scale
    relevance = torch.zeros(cache.seen + 1)
    own_relevance: dict[int, Tensor] = {}
    per_layer = "layer" in select
    chosen: list[tuple[int, HeadGroup, int]] = []
    for li, layer in enumerate(cache.layers):
        entries = by_layer.get(li)
        for g in layer.groups:
            a = g.archive
            if a is None or a.length == 0 or not entries:
                continue
            q = _group_queries(g, entries, focus or slice(None)).float().cpu()
            hold = max(a.page_size, min(recall_module.SCAN, SCAN_BYTES // (4 * q.shape[0] * q.shape[1])))
            pages = a.candidate_pages(q, None if cache.compact else hold)
            place = _landing(g, cache.compact)
            own = own_relevance.setdefault(li, torch.zeros(cache.seen + 1)) if per_layer else None
            pool = "sum" if "sum" in select else "max"
            # the softmax over kept and scored tokens is recall's own (tested against brute force in test_recall)
            for positions, probs in recall_module._attention(g, q, partial(a.scores, q, pages, place), scaling[li],
                                                             hold, pool):
                relevance.scatter_add_(0, positions.flatten(), probs.flatten())
                if own is not None:
                    own.scatter_add_(0, positions.flatten(), probs.flatten())
            chosen.append((li, g, min(grown(tokens, a.length) if "grow" in select else tokens, a.length)))
    ranking = passage_ranking(relevance)
    out = RecallResult()
    layer_ranking = {li: passage_ranking(rel) for li, rel in own_relevance.items()} if "layer" in select else {}
    for li, g, T in chosen:
        a = g.archive
        g.make_room(T)
        rank = layer_ranking.get(li, ranking)
        idx = a.top_by_position(rank, T)
        keys, values, pos = a.read(idx)
        by_relevance = placement == "relevance" and cache.compact and idx.shape[1] < a.length
        recall_module.insert(g, keys, values, pos, rank if by_relevance else None)
        cache.rope.settle(g)
        out.tokens = max(out.tokens, idx.shape[1])
        out.pages += a.touched(idx)
    return out


def _landing(g: HeadGroup, compact: bool) -> Callable[[Tensor, Tensor], Tensor] | None:
    if not compact:
        return None
    kept = g.positions[:, : g.length].cpu().contiguous()
    floor, rotator = g.rotary_floor, g.rotator

    def place(keys: Tensor, positions: Tensor) -> Tensor:
        return rotator.rotate(keys, floor + torch.searchsorted(kept, positions.contiguous()) - positions)

    return place
