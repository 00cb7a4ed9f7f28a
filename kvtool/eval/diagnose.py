"""Why a needle was found or missed (``kvtool eval needle --diagnose``): a compact record per trial.

For each needle sentence of the trial (the asked one first), from the recall's trace
(:class:`kvtool.core.recall.RecallTrace`):

* ``rank``: where the shared ranking put the needle: 1 + the passages ranked above its best token (a
  passage is a run of consecutive document positions ranked above it, outside the needle's own
  span); ``score`` its ranking value, ``top`` the best value of all, ``cutoff`` the median over KV
  heads of the value of the last token each head recalled (the needle comes back where
  ``score`` ≥ a head's cut-off);
* ``layer_ranks``: the same rank in the ranking each voting layer alone would make (its heads'
  attention summed), and its best and median — where layers disagree, a per-layer recall would choose
  differently;
* ``held``: the share of (KV head, needle token) pairs held after the recall (kept or recalled) over
  the recalling layers; ``layers_in`` the layers where every head holds every token of it,
  ``layers_out`` those where some head holds less than half of it.

And for the answer, ``copied``: the recalled passages (runs of consecutive recalled positions, over
every head) it shares the longest token spans with, longest first (at least two tokens; ``needle``
names the needle sentence a passage contains), and ``needle_copy``: the longest span it shares with
each needle sentence. Without recall only ``held`` is recorded (what the heads kept of the needle).
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from torch import Tensor

from kvtool.core.recall import SPAN, RecallTrace, passage_ranking
from kvtool.runtime.citations import SourceMap

#: copied passages reported per answer, and the shortest common span that counts as copying
COPIED = 3
MIN_COPY = 2


def passage_rank(ranking: Tensor, needle: Tensor, first: int) -> int:
    """1 + the number of passages whose ranking is above ``needle``'s best: maximal runs of consecutive
    positions from ``first`` on (the document) ranked higher, the needle's own span (its tokens, the
    ``SPAN`` before and after them, which share its peak) left out."""
    score = ranking[needle].max()
    above = ranking > score
    above[:first] = False
    above[max(0, int(needle.min()) - SPAN[0]) : int(needle.max()) + SPAN[1] + 1] = False
    starts = above.clone()
    starts[1:] &= ~above[:-1]
    return 1 + int(starts.sum())


def longest_common(a: list[int], b: list[int]) -> tuple[int, int]:
    """The longest run of tokens ``a`` and ``b`` share: (length, its end in ``a``)."""
    best, end = 0, 0
    prev = [0] * (len(b) + 1)
    for i, x in enumerate(a, 1):
        cur = [0] * (len(b) + 1)
        for j, y in enumerate(b, 1):
            if x == y:
                cur[j] = prev[j - 1] + 1
                if cur[j] > best:
                    best, end = cur[j], i
        prev = cur
    return best, end


def runs(positions: Tensor) -> list[tuple[int, int]]:
    """Sorted unique ``positions`` as [start, end) runs of consecutive positions."""
    out: list[tuple[int, int]] = []
    for p in positions.tolist():
        if out and p == out[-1][1]:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


def _layers(trace: RecallTrace, cols: slice) -> tuple[float, list[int], list[int]]:
    """(share of held (head, token) pairs, layers where every head holds all, layers where one holds < half)."""
    per_layer: dict[int, list[Tensor]] = {}
    for gt in trace.groups:
        per_layer.setdefault(gt.layer, []).append(gt.held[:, cols].float().mean(1))
    if not per_layer:
        return 0.0, [], []
    share = torch.cat([torch.cat(v) for v in per_layer.values()]).mean()
    inside = [li for li, v in sorted(per_layer.items()) if bool((torch.cat(v) == 1).all())]
    out = [li for li, v in sorted(per_layer.items()) if bool((torch.cat(v) < 0.5).any())]
    return round(float(share), 4), inside, out


def needle_record(trace: RecallTrace, cols: slice, first: int) -> dict[str, Any]:
    """The record of one needle sentence (``trace.watch[cols]``: its positions)."""
    needle = trace.watch[cols]
    held, inside, out = _layers(trace, cols)
    rec: dict[str, Any] = {"positions": [int(needle.min()), int(needle.max()) + 1], "tokens": needle.numel(),
                           "held": held, "layers_in": inside, "layers_out": out}
    if trace.ranking is None:
        return rec
    cutoffs = torch.cat([gt.cutoff for gt in trace.groups]) if trace.groups else torch.zeros(0)
    layer_ranks = [passage_rank(passage_ranking(rel), needle, first) for _, rel in sorted(
        trace.layer_relevance.items())]
    rec.update(rank=passage_rank(trace.ranking, needle, first), score=_r(trace.ranking[needle].max()),
               top=_r(trace.ranking[first:].max()), cutoff=_r(cutoffs.median()) if cutoffs.numel() else None,
               layer_ranks=layer_ranks,
               layer_rank={"best": min(layer_ranks), "median": statistics.median(layer_ranks)} if layer_ranks else None)
    return rec


def copied_from(trace: RecallTrace, needles: list[Tensor], source: SourceMap, answer_ids: list[int],
                tokenizer: Any) -> tuple[list[dict[str, Any]], list[int]]:
    """The recalled passages the answer shares its longest token spans with, and the longest span shared with
    each needle sentence (see the module docstring)."""
    needle_ids = [source.ids_at(n).tolist() for n in needles]
    needle_copy = [longest_common(answer_ids, ids)[0] for ids in needle_ids]
    if trace.ranking is None or not trace.groups:
        return [], needle_copy
    recalled = torch.unique(torch.cat([gt.recalled.reshape(-1) for gt in trace.groups]))
    passages = runs(recalled)
    best = [float(trace.ranking[a:b].max()) for a, b in passages]
    order = sorted(range(len(passages)), key=lambda k: -best[k])
    rank = {k: r for r, k in enumerate(order, 1)}
    found: list[dict[str, Any]] = []
    for k, (a, b) in enumerate(passages):
        n, end = longest_common(answer_ids, source.ids_at(torch.arange(a, b)).tolist())
        if n < MIN_COPY:
            continue
        holds = [i for i, pos in enumerate(needles) if bool(((pos >= a) & (pos < b)).any())]
        found.append({"start": a, "end": b, "rank": rank[k], "needle": holds[0] if holds else None, "tokens": n,
                      "text": tokenizer.decode(answer_ids[end - n : end])})
    found.sort(key=lambda f: (-f["tokens"], f["rank"]))
    return found[:COPIED], needle_copy


def diagnose(trace: RecallTrace, needles: list[Tensor], source: SourceMap, answer_ids: list[int],
             tokenizer: Any) -> dict[str, Any]:
    """The trial's record: one entry per needle sentence (positions ``needles``, in ``trace.watch`` order), and
    what the answer copied."""
    out: dict[str, Any] = {"needles": []}
    at = 0
    for pos in needles:
        out["needles"].append(needle_record(trace, slice(at, at + pos.numel()), source.first_position))
        at += pos.numel()
    copied, needle_copy = copied_from(trace, needles, source, answer_ids, tokenizer)
    if trace.ranking is not None:
        out["copied"] = copied
    out["needle_copy"] = needle_copy
    return out


def _r(x: Tensor) -> float:
    """Four significant digits (relevance is a sum of attention over heads: its scale varies with the model)."""
    return float(f"{float(x):.4g}")
