"""Recall scored on the cache's device (kvtool/core/recall.py, ``GroupArchive.scores``): the same choice as the
host path it replaced, with a number of host syncs per question that does not grow with the layers.

Oracles: ``tests/recall_reference.host_recall`` (the host path, kept as it was): the positions recalled into
every group and the question's logits are equal, across policies, positions and ``--recall-select``
variants; ``tests/host_syncs.HostSyncs`` counts the syncs a CUDA run would make.
"""

from __future__ import annotations

import functools

import pytest
import torch

from kvtool.core import recall
from tests.helpers import tiny_llama
from tests.host_syncs import HostSyncs
from tests.recall_reference import host_recall
from tests.test_recall import ids_of, read, recall_engine


def _question(monkeypatch, engine, cache, snap, fn, select=frozenset()):
    """The logits of one question and the positions recalled into each group, with recall done by ``fn``."""
    chosen: list[torch.Tensor] = []
    real_insert = recall.insert

    def spy(g, keys, values, positions, ranking=None):
        chosen.append(positions.cpu().clone())
        real_insert(g, keys, values, positions, ranking)

    def run(*args, **kw):
        kw["select"] = select  # (cache, log, tokens, focus, placement, trace) as the engine passed them
        return fn(*args[:6], **kw)

    monkeypatch.setattr(recall, "insert", spy)
    monkeypatch.setattr(recall, "recall", run)
    logits, res = engine.feed_question(cache, ids_of(12, 6), functools.partial(cache.restore, snap))
    monkeypatch.setattr(recall, "recall", fn)
    monkeypatch.setattr(recall, "insert", real_insert)
    assert res is not None and chosen
    return logits, chosen, (res.tokens, res.pages)


@pytest.mark.parametrize("positions", ["absolute", "compact"])
@pytest.mark.parametrize("policy,select", [("h2o", ()), ("sink", ("layer",)), ("keydiff", ("sum", "grow"))])
def test_device_recall_chooses_what_the_host_path_chose(monkeypatch, positions, policy, select):
    model = tiny_llama(max_positions=4096)
    monkeypatch.setattr(recall, "SCAN", 64)  # past the scan: candidate pages chosen by the bound (absolute)
    device_recall = recall.recall
    engine = recall_engine(model, policy, 32, 16, positions=positions)
    cache, snap = read(engine, ids_of(300, 5))
    want = _question(monkeypatch, engine, cache, snap, host_recall, frozenset(select))
    cache.restore(snap)
    got = _question(monkeypatch, engine, cache, snap, device_recall, frozenset(select))
    assert got[2] == want[2]
    assert len(got[1]) == len(want[1]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
    assert torch.equal(got[0], want[0])


def _syncs(monkeypatch, layers: int, positions: str, host_reads: bool = False) -> HostSyncs:
    """The syncs of one question's recall; ``host_reads`` False: as a cache on an accelerator runs (no read back
    of where compact keys moved)."""
    model = tiny_llama(num_hidden_layers=layers)
    monkeypatch.setattr(recall, "SCAN", 64)
    engine = recall_engine(model, "h2o", 32, 16, positions=positions)
    cache, snap = read(engine, ids_of(300, 5))
    cache.host_reads = host_reads
    real = recall.recall
    seen: list[HostSyncs] = []

    def counted(*args, **kw):
        with HostSyncs() as s:
            out = real(*args, **kw)
        seen.append(s)
        return out

    monkeypatch.setattr(recall, "recall", counted)
    engine.feed_question(cache, ids_of(12, 6), functools.partial(cache.restore, snap))
    monkeypatch.setattr(recall, "recall", real)
    (s,) = seen
    return s


@pytest.mark.parametrize("positions", ["absolute", "compact"])
def test_host_syncs_per_question_do_not_grow_with_the_layers(monkeypatch, positions):
    """Absolute positions past the scan: the candidate pages of every group read back at once, then the
    rankings: 2 per question at any depth (the host path made ~5 per layer). Compact positions: the rankings'
    one; re-rotating the recalled keys (``CompactPositions.settle``) rotates every stored key on an accelerator
    and reads nothing back."""
    two, four = _syncs(monkeypatch, 2, positions), _syncs(monkeypatch, 4, positions)
    assert four.count == (2 if positions == "absolute" else 1), four.where
    assert two.where == four.where


def test_cpu_compact_recall_reads_back_where_keys_moved(monkeypatch):
    """On the CPU (``host_reads``) a re-pack rotates only up to the last moved key: it reads that back, twice
    per recalling layer (reading host memory stalls no device queue). The accelerator path above does not."""
    s = _syncs(monkeypatch, 4, "compact", host_reads=True)
    settle = {k: v for k, v in s.where.items() if k.startswith("positions.py")}
    assert sum(settle.values()) == 2 * 4, s.where
