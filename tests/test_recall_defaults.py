"""Recall's defaults and limits: descriptors closed with their cache, global groups only, slots sized
by what the document can fill."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvtool.core import recall
from kvtool.core.engine import Engine, EngineConfig, model_env
from kvtool.errors import UsageError
from kvtool.policies import build_policy
from tests.helpers import VOCAB, dense_logits, tiny_family, tiny_llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def recall_engine(
    model,
    policy: str,
    budget: int | None,
    rec: int,
    positions: str = "absolute",
    block_size: int = 16,
    archive_dir: str | None = None,
    retrieval=None,
) -> Engine:
    cfg = EngineConfig(budget=budget, block_size=block_size, positions=positions, recall=rec, archive_dir=archive_dir)
    env = model_env(model, cfg, retrieval_heads=retrieval)
    return Engine(model, build_policy(policy, {}, env), cfg, env=env)


def ids_of(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def test_archive_descriptors_close_with_their_cache_under_a_low_fd_limit(tmp_path):
    """Fifteen reads with a file-backed archive in one process under ``ulimit -n 64``: each read opens
    three files per bounded group; the count of open descriptors stays flat."""
    script = textwrap.dedent(f"""
        import os, resource, sys, torch
        sys.path.insert(0, {ROOT!r})
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        from tests.test_recall_defaults import recall_engine, ids_of
        from tests.helpers import tiny_llama
        engine = recall_engine(tiny_llama(), "h2o", 32, 16, archive_dir={str(tmp_path)!r})
        def fds():
            return len(os.listdir("/proc/self/fd"))
        counts = []
        for i in range(15):
            cache = engine.new_cache()
            engine.feed(cache, [ids_of(64, i)], progress=False)
            snap = cache.snapshot()
            engine.feed_question(cache, ids_of(6, 99), lambda: cache.restore(snap))
            del cache, snap
            counts.append(fds())
        print(counts[0], counts[-1])
        assert counts[-1] <= counts[0], counts
    """)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


def test_explicit_close_releases_the_files(tmp_path):
    engine = recall_engine(tiny_llama(), "sink", 32, 16, archive_dir=str(tmp_path))
    cache = engine.new_cache()
    engine.feed(cache, [ids_of(80, 1)], progress=False)
    stores = [st for a in recall.archives(cache) for st in a.parts]  # key rows, value rows, positions, summaries
    assert stores and all(st.fd is not None for st in stores)
    recall.close(cache)
    assert all(st.fd is None for st in stores) and recall.archives(cache) == []


# -- recall touches global groups only ------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
@pytest.mark.parametrize("positions", ["absolute", "compact"])
def test_full_recall_equals_full_with_sliding_layers(family, positions):
    """The document fed in one block (every hidden state exact), evicted to the budget in the global
    layers and to the window in the sliding ones: recalling every archived token gives ``full``."""
    model = tiny_family(family)
    doc, question = ids_of(150, 3), ids_of(10, 4)
    ref = dense_logits(model, torch.cat([doc, question]))[-1]
    engine = recall_engine(model, "keydiff", 40, 256, positions=positions, block_size=160)
    cache = engine.new_cache()
    engine.feed(cache, [doc], progress=False)
    snap = cache.snapshot()
    assert all(g.archive is None for g in cache.groups() if g.window is not None)
    logits, _ = engine.feed_question(cache, question, lambda: cache.restore(snap))
    torch.testing.assert_close(logits[-1], ref, atol=2e-4, rtol=2e-4)


def test_razor_compensated_heads_do_not_recall():
    model = tiny_llama()
    engine = recall_engine(model, "razor", 48, 64, retrieval=lambda **_: {0: [1], 1: [0]})
    cache = engine.new_cache()
    assert any(g.compensation for g in cache.groups())
    assert all(g.archive is None for g in cache.groups() if g.compensation)
    assert any(g.archive is not None for g in cache.groups())


def test_a_huge_recall_allocates_only_what_the_document_archived():
    """recall = 10M tokens per head: nothing is allocated for it up front; at the question the slots grow
    by what was archived (the document's evicted tokens), not by the setting."""
    model = tiny_llama()
    engine = recall_engine(model, "sink", 32, 10_000_000)
    cache = engine.new_cache()
    assert all(g.slots <= 32 + 16 for g in cache.groups())
    engine.feed(cache, [ids_of(120, 5)], progress=False)
    snap = cache.snapshot()
    archived = max(a.length for a in recall.archives(cache))
    _, res = engine.feed_question(cache, ids_of(6, 6), lambda: cache.restore(snap))
    assert res is not None and res.tokens == archived
    assert all(g.slots <= 32 + 16 + archived for g in cache.groups())


def test_recall_beyond_free_memory_is_a_usage_error_with_the_figure(monkeypatch):
    from kvtool.core import storage

    engine = recall_engine(tiny_llama(), "sink", 32, 64)
    cache = engine.new_cache()
    engine.feed(cache, [ids_of(120, 5)], progress=False)
    snap = cache.snapshot()
    monkeypatch.setattr(storage, "free_device_bytes", lambda device: 100)
    with pytest.raises(UsageError, match="GiB free; lower the recall") as e:
        engine.feed_question(cache, ids_of(6, 6), lambda: cache.restore(snap))
    assert e.value.field == "recall"
