"""The memory an eviction, a snapshot and a growth take: bounded, priced by the plan, and the same tokens kept.

A stack of layers evicts a chunk of layers at a time (``core/costs.py``'s ``evict_chunk_layers``); its scores and ranks
are int64 keys and int32 ranks instead of float64 ones. The oracles: the float64 ``keep_top`` and int64 ranks this
replaced (kept here, verbatim), the whole stack evicted at once, and allocations measured by torch's allocator.
"""

from __future__ import annotations

import pytest
import torch

import kvtool.core.cache as cache_mod
import kvtool.core.contract as contract
import kvtool.core.costs as costs
from kvtool.core.evict import SPAN, SPAN32, protection_rank
from kvtool.errors import UsageError
from kvtool.runtime.memory_cache import eviction_scratch_bytes, snapshot_bytes
from tests.helpers import VOCAB, make_engine, tensor_peak, tiny_llama

POLICIES = ["sink", "h2o", "tova", "snapkv", "keydiff", "scissorhands", "h2o+vatp", "tova+caote", "snapkv+fastcaote"]


def float64_keep_top(scores, protected, capacity, priority=None):
    """``keep_top`` as it was: float64 keys, a protected token at (priority + 1) · 1e100."""
    if priority is not None:
        keyed = torch.nan_to_num(scores.double(), nan=float("-inf"), posinf=1e99)
        forced = torch.where(protected, (priority.double() + 1.0) * 1e100, keyed)
    else:
        forced = scores.masked_fill(protected, float("inf"))
        forced = torch.nan_to_num(forced, nan=float("-inf"), posinf=float("inf"))
    idx = torch.topk(forced, capacity, dim=-1, sorted=False).indices
    return torch.sort(idx, dim=-1).values


def int64_rank(pos, sinks, pinned, recent, end=0):
    """``protection_rank`` as it was: int64, grade · 2^40 + order."""
    grade = torch.where(sinks, 4, torch.where(pinned, 3, torch.where(recent, 2, 0)))
    order = torch.where(sinks, SPAN - 1 - pos, pos)
    return grade * SPAN + order


def _scores(kind: int, h: int, n: int, g: torch.Generator) -> torch.Tensor:
    if kind == 0:
        return torch.randn(h, n, generator=g)
    if kind == 1:  # many ties
        return torch.randint(-3, 3, (h, n), generator=g).float()
    if kind == 2:  # +0.0 and -0.0, which tie
        s = torch.zeros(h, n)
        s[:, ::3] = -0.0
        return s
    s = torch.randint(-2, 2, (h, n), generator=g).float()
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 3.4e38, -3.4e38])
    mask = torch.rand(h, n, generator=g) < 0.4
    s[mask] = special[torch.randint(0, len(special), (int(mask.sum()),), generator=g)]
    return s


def test_keep_top_keeps_what_float64_keys_kept():
    """Ties, nan, ±inf, ±0, more protected tokens than the capacity, int32 and int64 priorities: the same indices."""
    g = torch.Generator().manual_seed(0)
    for trial in range(1200):
        h, n = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(2, 300, (1,), generator=g))
        c = int(torch.randint(1, n, (1,), generator=g))
        scores = _scores(trial % 4, h, n, g)
        protected = torch.rand(h, n, generator=g) < float(torch.rand(1, generator=g))
        priority = torch.stack([torch.randperm(n, generator=g) for _ in range(h)]) * 7 + 5
        for pri in (priority, priority.int(), None):
            want = float64_keep_top(scores, protected, c, pri)
            assert torch.equal(contract.keep_top(scores.clone(), protected, c, pri), want), (trial, pri is None)


def test_int32_ranks_order_protected_tokens_as_int64_ranks():
    g = torch.Generator().manual_seed(1)
    for end in (300, SPAN32):
        pos = torch.randint(0, end, (4, 257), generator=g)
        pos[:, :3] = torch.arange(3)
        sinks, pinned, recent = pos < 4, torch.rand(4, 257, generator=g) < 0.3, pos >= end - 20
        ours = protection_rank(pos, sinks, pinned, recent, end)
        assert ours.dtype == torch.int32
        ref = int64_rank(pos, sinks, pinned, recent)
        assert torch.equal(torch.argsort(ours, dim=1, stable=True), torch.argsort(ref, dim=1, stable=True))
    assert protection_rank(pos, sinks, pinned, recent, SPAN32 + 1).dtype == torch.int64


def _run(policy: str, layers: int = 6, recall: int = 0, tokens: int = 260):
    torch.manual_seed(0)
    engine = make_engine(tiny_llama(num_hidden_layers=layers), policy, 48, block_size=16, recall=recall)
    cache = engine.new_cache()
    ids = torch.randint(0, VOCAB, (tokens,), generator=torch.Generator().manual_seed(3))
    logits = engine.feed(cache, [ids], progress=False)
    kept = [g.positions[:, : g.length].clone() for g in cache.groups()]
    return logits, kept, cache


@pytest.mark.parametrize("policy", POLICIES)
def test_chunked_int_keyed_eviction_keeps_the_tokens_whole_stack_float64_eviction_kept(policy, monkeypatch):
    """The reference: every layer of the stack in one chunk, ``keep_top`` and ranks as they were (float64, int64).
    Ours: one layer per chunk, and the default chunks; the same tokens in every layer, the same logits."""
    with monkeypatch.context() as m:
        m.setattr(costs, "EVICT_CHUNK_BYTES", 1 << 60)
        m.setattr(contract, "keep_top", float64_keep_top)
        m.setattr(cache_mod, "protection_rank", int64_rank)
        ref_logits, ref_kept, cache = _run(policy)
        assert cache.stacks and cache.stacks[0].chunk_layers() == 6  # one stack of every layer, in one chunk
    for chunks, per_chunk in ((6, 0), (costs.EVICT_CHUNKS, costs.EVICT_CHUNK_BYTES)):
        with monkeypatch.context() as m:
            m.setattr(costs, "EVICT_CHUNKS", chunks)
            m.setattr(costs, "EVICT_CHUNK_BYTES", per_chunk)
            logits, kept, cache = _run(policy)
            assert cache.stacks[0].chunk_layers() == (1 if chunks == 6 else 6)
        assert torch.equal(logits, ref_logits)
        for a, b in zip(kept, ref_kept, strict=True):
            assert torch.equal(a, b)


def test_chunked_eviction_archives_what_the_whole_stack_archived(monkeypatch):
    """With recall on, every layer's archive holds the same tokens whether its stack evicts at once or a layer at a
    time (each chunk appends its layers' dropped tokens together)."""
    with monkeypatch.context() as m:
        m.setattr(costs, "EVICT_CHUNK_BYTES", 1 << 60)
        _, ref_kept, ref = _run("h2o", recall=32)
    with monkeypatch.context() as m:
        m.setattr(costs, "EVICT_CHUNKS", 6)
        m.setattr(costs, "EVICT_CHUNK_BYTES", 0)
        _, kept, ours = _run("h2o", recall=32)
    for a, b in zip(kept, ref_kept, strict=True):
        assert torch.equal(a, b)
    for ga, gb in zip(ours.groups(), ref.groups(), strict=True):
        assert ga.archive.length == gb.archive.length > 0
        a, b = ga.archive.state_dict("a"), gb.archive.state_dict("a")
        for key in a:
            assert torch.equal(a[key], b[key]), key


def _eviction_peak(cache, engine, ids) -> int:
    """Tracked bytes allocated by the end-of-block eviction of the next block."""
    seen = {}
    evict = cache_mod.BoundedCache.evict_deferred

    def measured(self):
        with tensor_peak() as t:
            evict(self)
        seen["peak"] = t["peak"]

    cache.evict_deferred = measured.__get__(cache)
    engine.feed(cache, [ids], progress=False, logits_rows=0)
    return seen["peak"]


def test_a_stack_evicts_in_chunks_of_a_few_layers_and_the_plan_prices_them(monkeypatch):
    """16 layers, budget 4K, block 256: the end-of-block eviction allocated as much as the whole cache when every
    layer was scored and gathered at once (19.2 MiB against a 17.0 MiB cache); a chunk of 2 layers now, within
    the plan's ``eviction_scratch_bytes``."""
    budget, block, layers = 4096, 256, 16
    engine = make_engine(tiny_llama(num_hidden_layers=layers), "h2o", budget, block_size=block)
    cache = engine.new_cache()
    ids = torch.randint(0, VOCAB, (budget + 2 * block,), generator=torch.Generator().manual_seed(4))
    engine.feed(cache, [ids[:budget]], progress=False, logits_rows=0)
    peak = _eviction_peak(cache, engine, ids[budget : budget + block])
    dims = {"num_layers": layers, "num_kv_heads": 2, "head_dim": 16}
    planned = eviction_scratch_bytes(dims, 4, budget, block, n_fields=1)
    allocated = cache.allocated_bytes()
    print(
        f"\nstacked eviction, 16 layers at 4K: {peak / 2**20:.2f} MiB allocated (plan {planned / 2**20:.2f} MiB), "
        f"cache {allocated / 2**20:.1f} MiB"
    )
    assert cache.stacks[0].chunk_layers() == 2
    assert peak <= planned <= allocated / 8


def test_growing_a_stack_checks_the_memory_of_every_layer(monkeypatch):
    """A stacked group's growth reallocates the buffers of every layer of its stack: the free-memory check prices
    all of them (it priced one layer's added slots, 16x under on 16 layers)."""
    monkeypatch.setattr("kvtool.core.storage.LAZY_START_SLOTS", 16)
    engine = make_engine(tiny_llama(num_hidden_layers=16), "sink", 10**9, block_size=16)
    cache = engine.new_cache()
    g = cache.groups()[0]
    assert g.stack is not None and g.slots == 16
    one_layer = (32 - 16) * g.buffers.bytes_per_slot()
    need = g.buffers.resize_bytes(32)
    assert need >= 16 * one_layer + 16 * g.buffers["keys"].numel() * 4  # every layer grows; the old keys are held
    monkeypatch.setattr("kvtool.core.storage.free_device_bytes", lambda device: need - 1)
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(5))
    with pytest.raises(UsageError, match="GiB free; lower the budget"):
        engine.feed(cache, [ids], progress=False)


def test_a_snapshot_allocates_its_copy_and_nothing_beside_it():
    """``snapshot`` copies each buffer straight into its own storage: on a CPU it allocates the snapshot's bytes (the
    plan's ``snapshot_bytes``) and no second copy of the cache (it made a contiguous copy of every layer first)."""
    layers, budget = 8, 512
    engine = make_engine(tiny_llama(num_hidden_layers=layers), "h2o", budget, block_size=64)
    cache = engine.new_cache()
    engine.feed(
        cache,
        [torch.randint(0, VOCAB, (budget + 200,), generator=torch.Generator().manual_seed(6))],
        progress=False,
        logits_rows=0,
    )
    with tensor_peak() as t:
        snap = cache.snapshot()
    dims = {"num_layers": layers, "num_kv_heads": 2, "head_dim": 16}
    planned = snapshot_bytes(dims, 4, budget, 1)
    held = sum(x.numel() * x.element_size() for x in snap[0].values())
    assert held <= planned
    assert t["peak"] <= held + 64 * 1024
