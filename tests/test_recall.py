"""Archive and recall (kvtool/core/archive.py, kvtool/core/recall.py) on tiny random models.

Oracles: with a recall budget that brings back every archived token, a question's logits equal the
``full`` policy's (dense transformers) — archive and recall lose nothing; recalled K/V equal what was
evicted (bit-identical in absolute positions, after re-rotation in compact); page summaries bound
q·k for every key of their page; a head never holds more than budget + recall + block.
"""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch

from kvtool.core import archive as archive_module
from kvtool.core import recall
from kvtool.core import stacks as stacks_module
from kvtool.core.archive import GroupArchive, dropped_indices
from kvtool.core.archive_stores import FileStore, MemoryStore
from kvtool.core.cache import BoundedCache
from kvtool.core.engine import Engine, EngineConfig, model_env
from kvtool.errors import KvtoolError, UsageError
from kvtool.policies import build_policy
from tests.helpers import VOCAB, dense_logits, tiny_llama, tiny_qwen2


def recall_engine(
    model,
    policy: str,
    budget: int,
    recall_tokens: int,
    positions: str = "absolute",
    block_size: int = 16,
    page_size: int = 8,
    archive_dir: str | None = None,
    archive_dtype: torch.dtype | None = None,
    placement: str = "relevance",
) -> Engine:
    cfg = EngineConfig(
        budget=budget,
        block_size=block_size,
        positions=positions,
        recall=recall_tokens,
        page_size=page_size,
        archive_dir=archive_dir,
        archive_dtype=archive_dtype,
        recall_placement=placement,
    )
    env = model_env(model, cfg)
    # SnapKV's observation window (32 by default) is always kept: at the tests' budget of 40 it would leave
    # no room for the pinned question (the engine refuses that), so these tests observe 8 queries.
    options = {"window": "8"} if policy.startswith("snapkv") else {}
    return Engine(model, build_policy(policy, options, env), cfg, env=env)


def ids_of(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def read(engine: Engine, doc: torch.Tensor):
    cache = engine.new_cache()
    engine.feed(cache, [doc], progress=False)
    return cache, cache.snapshot()


# -- the archive itself -------------------------------------------------------------------------------
def test_archive_appends_in_order_and_page_bounds_hold():
    torch.manual_seed(0)
    h, d, P = 3, 8, 5
    arch = GroupArchive(h, d, torch.float32, P, MemoryStore)
    ks, vs, ps = [], [], []
    for n in (3, 7, 1, 12, 2, 10):  # appends that start and end mid-page, or on a page boundary
        k, v = torch.randn(h, n, d), torch.randn(h, n, d)
        p = torch.randint(0, 1000, (h, n))
        arch.append(k, v, p)
        ks.append(k), vs.append(v), ps.append(p)
    K, V, Pos = torch.cat(ks, 1), torch.cat(vs, 1), torch.cat(ps, 1)
    assert arch.length == K.shape[1] and arch.pages == -(-K.shape[1] // P)
    every = torch.arange(arch.length).expand(h, -1)
    k2, v2, p2 = arch.read(every)
    assert torch.equal(k2, K) and torch.equal(v2, V) and torch.equal(p2, Pos)
    q = torch.randn(h, 6, d)
    kmin, kmax = arch.page_summaries()
    assert kmin.shape == (h, arch.pages, d) and arch.summaries.rows == arch.length // P  # the open page: in memory
    bound = torch.bmm(q.clamp(min=0), kmax.float().transpose(1, 2)) + torch.bmm(
        q.clamp(max=0), kmin.float().transpose(1, 2)
    )  # [h, r, pages]
    assert torch.equal(arch.page_scores(q), bound.amax(1))
    exact = torch.bmm(q, K.transpose(1, 2))  # [h, r, n]
    page_of = torch.arange(arch.length) // P
    assert (bound[:, :, page_of] >= exact - 1e-5).all()
    # brute-force summaries: min/max over each page's keys, rounded outward to float16 (one step at most)
    for p in range(arch.pages):
        sl = K[:, p * P : (p + 1) * P]
        lo, hi = kmin[:, p], kmax[:, p]
        assert (lo.float() <= sl.amin(1)).all() and (hi.float() >= sl.amax(1)).all()
        assert (torch.nextafter(lo, torch.full_like(lo, float("inf"))).float() >= sl.amin(1)).all()
        assert (torch.nextafter(hi, torch.full_like(hi, float("-inf"))).float() <= sl.amax(1)).all()


def test_page_bound_holds_past_float16_range():
    h, d, P = 1, 4, 4
    arch = GroupArchive(h, d, torch.float32, P, MemoryStore)
    k = torch.zeros(h, P, d)
    k[0, 1, 0], k[0, 2, 1] = 1e6, -1e6  # beyond float16's 65504
    arch.append(k, k.clone(), torch.arange(P).unsqueeze(0))
    q = torch.tensor([[[1.0, -1.0, 0.0, 0.0]]])
    bound = arch.page_scores(q)
    assert not bound.isnan().any() and (bound >= torch.bmm(q, k.transpose(1, 2)).amax()).all()


def _scored(arch: GroupArchive, q: torch.Tensor, scan: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every chunk of ``arch.scores`` on the candidate pages, joined: positions [h, A], scores [h, r, A]."""
    chunks = list(arch.scores(q, arch.candidate_pages(q, scan)))
    return torch.cat([p for p, _ in chunks], 1), torch.cat([s for _, s in chunks], 2)


def test_candidates_are_scored_exactly_whole_or_by_the_bound_beyond_the_scan(monkeypatch):
    """Brute force: every archived token's q·k when the archive fits the scan (or no scan is given);
    beyond it, the pages with the highest Quest bound (computed by hand), still scored exactly."""
    from kvtool.core import archive

    monkeypatch.setattr(archive, "SCAN_CHUNK", 2)  # several chunks
    h, d, P, n = 2, 4, 4, 18
    arch = GroupArchive(h, d, torch.float32, P, MemoryStore)
    K = torch.randn(h, n, d, generator=torch.Generator().manual_seed(3))
    arch.append(K, torch.randn(h, n, d), torch.arange(n).expand(h, -1))
    q = torch.randn(h, 3, d)
    exact = torch.bmm(q, K.transpose(1, 2))  # [h, r, n]
    for scan in (64, None):
        idx, scores = _scored(arch, q, scan)  # positions = archive indices here
        for head in range(h):
            seen = {}
            for j, i in enumerate(idx[head].tolist()):
                if scores[head, 0, j] > float("-inf"):
                    seen[i] = scores[head, :, j]
            assert sorted(seen) == list(range(n))  # everything, each once (the tail page's padding is −inf)
            for i, s in seen.items():
                assert torch.allclose(s, exact[head, :, i], atol=1e-5)
    idx, scores = _scored(arch, q, 2 * P)  # two pages of five
    kmin, kmax = arch.page_summaries()
    bound = torch.bmm(q.clamp(min=0), kmax.float().transpose(1, 2)) + torch.bmm(
        q.clamp(max=0), kmin.float().transpose(1, 2)
    )
    for head in range(h):
        want = sorted(torch.topk(bound[head].amax(0), 2).indices.tolist())
        assert sorted(set((idx[head] // P).tolist())) == want


@pytest.mark.parametrize("hold", [100, 3])
def test_attention_of_candidates_is_the_softmax_beside_the_kept_tokens(hold):
    """Brute force: each candidate's probability in the softmax over [kept, candidates] (a padded −inf
    candidate gets 0), maximised over the question rows — with the scores held (one pass) or computed
    again in a second pass (more candidates than ``hold``)."""
    from types import SimpleNamespace

    h, d, n, A = 2, 8, 5, 7
    gen = torch.Generator().manual_seed(4)
    g = SimpleNamespace(keys=torch.randn(1, h, 2 + n, d, generator=gen), off=2, length=n)
    g.stored_keys = lambda: g.keys[0, :, g.off : g.off + g.length]
    q, archived = torch.randn(h, 3, d, generator=gen), torch.randn(h, A, d, generator=gen)
    scores = torch.bmm(q, archived.transpose(1, 2))
    scores[:, :, -1] = float("-inf")
    want = torch.softmax(torch.cat((torch.bmm(q, g.keys[0, :, 2:].transpose(1, 2)), scores), 2) * 0.3, 2)[:, :, n:]
    calls = []

    def chunks():  # two chunks of candidates, fresh copies each time (the scores are consumed in place)
        calls.append(1)
        pos = torch.arange(A).expand(h, -1)
        return iter([(pos[:, :4], scores[:, :, :4].clone()), (pos[:, 4:], scores[:, :, 4:].clone())])

    out = list(recall._attention(g, q, chunks, 0.3, hold))
    got = torch.cat([p for _, p in out], 1)
    assert torch.equal(torch.cat([p for p, _ in out], 1), torch.arange(A).expand(h, -1))
    assert torch.allclose(got, want.amax(1), atol=1e-6) and (got[:, -1] == 0).all()
    assert len(calls) == (1 if hold >= A else 2)


def test_compact_recall_scores_every_archived_token_past_the_scan(monkeypatch):
    """Compact positions: the bound's summaries (original positions) and the question (compact ones) are
    in different frames, so no page is pre-selected by it — what comes back does not depend on SCAN.
    With absolute positions a small SCAN pre-selects pages (and the choice may change)."""
    chosen: dict[str, list[torch.Tensor]] = {}
    real = recall.insert

    def spy(g, keys, values, positions, ranking=None):
        chosen[key].append(positions.clone())
        real(g, keys, values, positions, ranking)

    monkeypatch.setattr(recall, "insert", spy)
    model = tiny_llama(max_positions=64)
    for positions in ("compact", "absolute"):
        for scan in (10_000, 8):
            key = f"{positions}-{scan}"
            chosen[key] = []
            monkeypatch.setattr(recall, "SCAN", scan)
            engine = recall_engine(model, "sink", 24, 8, positions=positions)
            cache, snap = read(engine, ids_of(150, 5))
            assert min(a.length for a in recall.archives(cache)) > 2 * 8  # past the scan: pages chosen by bound
            engine.feed_question(cache, ids_of(6, 6), functools.partial(cache.restore, snap))
    assert all(torch.equal(a, b) for a, b in zip(chosen["compact-10000"], chosen["compact-8"], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(chosen["absolute-10000"], chosen["absolute-8"], strict=True))


def test_compact_recall_scores_the_archive_once_when_its_scores_fit(monkeypatch):
    """Compact positions score every archived token: past ``SCAN`` they are held (one read and rotation of the
    archive per group) while their scores fit ``SCAN_BYTES``, and read a second time only when not. The same
    tokens come back either way."""
    model = tiny_llama(max_positions=64)
    monkeypatch.setattr(recall, "SCAN", 8)
    real, insert = GroupArchive.scores, recall.insert
    runs: dict[int, tuple[int, list[torch.Tensor]]] = {}
    for scan_bytes in (64 << 20, 64):  # 64 bytes: fewer than one page's scores, so a second pass
        monkeypatch.setattr(recall, "SCAN_BYTES", scan_bytes)
        reads, chosen = [0], []

        def scores(self, *args, reads=reads, **kw):
            reads[0] += 1
            return real(self, *args, **kw)

        def spy(g, keys, values, positions, ranking=None, chosen=chosen):
            chosen.append(positions.clone())
            insert(g, keys, values, positions, ranking)

        monkeypatch.setattr(GroupArchive, "scores", scores)
        monkeypatch.setattr(recall, "insert", spy)
        engine = recall_engine(model, "sink", 24, 8, positions="compact")
        cache, snap = read(engine, ids_of(150, 5))
        assert min(a.length for a in recall.archives(cache)) > 8
        engine.feed_question(cache, ids_of(6, 6), functools.partial(cache.restore, snap))
        monkeypatch.setattr(recall, "insert", insert)
        runs[scan_bytes] = (reads[0], chosen)
    groups = len(runs[64][1])
    assert groups and runs[64 << 20][0] == groups and runs[64][0] == 2 * groups
    assert all(torch.equal(a, b) for a, b in zip(runs[64 << 20][1], runs[64][1], strict=True))


def test_every_head_recalls_the_span_around_the_relevant_positions():
    """One ranking (by stream position) for every head, whatever order each archived its tokens in; the
    tokens after a match (the rest of its sentence) and a few before come with it."""
    h, d, P, n = 2, 4, 4, 64
    arch = GroupArchive(h, d, torch.float32, P, MemoryStore)
    pos = torch.stack([torch.arange(n), torch.arange(n).flip(0)])  # the heads archived in different orders
    arch.append(torch.zeros(h, n, d), torch.zeros(h, n, d), pos)
    relevance = torch.zeros(n + 1)
    relevance[40] = 1.0
    best = recall.F.max_pool1d(recall.F.pad(relevance.view(1, 1, -1), (24, 8)), 33, stride=1).view(-1)
    idx = arch.top_by_position(best + recall.TIE * relevance, 12)
    for head in range(h):
        got = pos[head, idx[head]].tolist()
        assert 40 in got and set(got) <= set(range(32, 65))  # the match and what surrounds it
        assert idx[head].tolist() == sorted(idx[head].tolist())


def test_placement_puts_passages_in_ascending_relevance_each_in_document_order():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        h, n = 3, 60
        positions = torch.stack([torch.randperm(n, generator=g)[:12] for _ in range(h)])  # any order per head
        ranking = torch.rand(n, generator=g)
        order = recall._placement(positions, ranking)
        for head in range(h):
            placed = positions[head, order[head]].tolist()
            runs: list[list[int]] = []  # brute force: passages of consecutive positions, by best ranking
            for p in sorted(positions[head].tolist()):
                if runs and p == runs[-1][-1] + 1:
                    runs[-1].append(p)
                else:
                    runs.append([p])
            runs.sort(key=lambda r: max(float(ranking[p]) for p in r))
            assert placed == [p for r in runs for p in r]


def _placed_recall(model) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A one-layer model's question logits after a compact read recalls a selection (``sink`` 40, recall 16, the
    default placement), and per group what the question saw: each [h, n] original positions and compact slots,
    checked to be one order in every head with the 16 recalled tokens last, not in document order."""
    doc, question = ids_of(150, 31), ids_of(10, 32)
    engine = recall_engine(model, "sink", 40, 16, positions="compact")
    assert engine.config.recall_placement == EngineConfig(budget=40).recall_placement == "relevance"  # the default
    cache, snap = read(engine, doc)
    placed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per group, as the question will see them
    real = cache.rope.settle

    def spy(g):
        real(g)
        placed[id(g)] = (g.positions[:, : g.length].clone(), g.rotary[:, : g.length].clone())

    cache.rope.settle = spy
    logits, res = engine.feed_question(cache, question, lambda: cache.restore(snap))
    assert res is not None and res.tokens == 16 and len(placed) == len(cache.groups())
    for g in cache.groups():
        pos, rot = placed[id(g)]
        assert bool((pos == pos[0]).all() and (rot == rot[0]).all())  # one order in every head
        recalled = torch.isin(pos[0], g.recalled[0]).nonzero().flatten().tolist()
        assert recalled == list(range(pos.shape[1] - 16, pos.shape[1]))  # after every kept token
        assert pos[0, recalled].tolist() != sorted(pos[0, recalled].tolist())  # not in document order here
    return logits, list(placed.values())


def _dense_over(model, pos: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """The model's last logits over the document's tokens in the placed order at their compact slots, then the
    question (``_placed_recall``'s document and question)."""
    doc, question = ids_of(150, 31), ids_of(10, 32)
    ids = torch.cat([doc[pos[0]], question])
    at = torch.cat([rot[0], torch.arange(10) + int(rot[0, -1]) + 1])
    with torch.no_grad():
        return model(input_ids=ids[None], position_ids=at[None]).logits[0, -1]


def test_compact_recall_of_a_selection_is_the_dense_model_over_the_placed_order():
    """Oracle (one layer: its K/V depend on the tokens only, so any order can be recomputed densely): with
    compact positions a recalled selection sits after the kept tokens, passage by passage, the most relevant
    last; the question's logits are the dense model's over the document's tokens in that order at their
    compact positions, then the question. ``sink`` keeps the same tokens in every head: one order."""
    model = tiny_llama(num_hidden_layers=1)
    logits, placed = _placed_recall(model)
    for pos, rot in placed:
        torch.testing.assert_close(logits[-1], _dense_over(model, pos, rot), atol=2e-4, rtol=2e-4)


@pytest.mark.bf16
def test_bf16_compact_recall_of_a_selection_is_within_transformers_own_bf16_error():
    """The same oracle in bfloat16 (16-bit caches re-rotate each key from its original copy): kvtool's error
    against the float32 dense model over the placed order stays within 1.5× transformers' own bfloat16 error
    there, plus 0.002 (the bound of tests/test_bf16.py). Measured: 0.0024 against transformers' 0.0019 (logits
    of magnitude ≤ 0.49)."""
    model = tiny_llama(num_hidden_layers=1)
    logits, placed = _placed_recall(copy.deepcopy(model).to(torch.bfloat16))
    reference = _dense_over(model, *placed[0])
    theirs = _dense_over(copy.deepcopy(model).to(torch.bfloat16), *placed[0])
    assert logits.dtype == torch.bfloat16
    ours = float((logits[-1].float() - reference).abs().max())
    their_err = float((theirs.float() - reference).abs().max())
    assert ours <= 1.5 * their_err + 0.002, (ours, their_err)


def test_compact_recall_in_document_placement_merges_a_selection_in_document_order():
    """``--recall-placement document``: with compact positions a recalled selection is merged among the kept
    tokens in document order (each token's compact slot follows its original position), as with absolute
    positions."""
    model = tiny_llama(num_hidden_layers=1)
    engine = recall_engine(model, "sink", 40, 16, positions="compact", placement="document")
    cache, snap = read(engine, ids_of(150, 31))
    placed: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = cache.rope.settle

    def spy(g):
        real(g)
        placed.append((g.positions[:, : g.length].clone(), g.rotary[:, : g.length].clone()))

    cache.rope.settle = spy
    _, res = engine.feed_question(cache, ids_of(10, 32), lambda: cache.restore(snap))
    assert res is not None and res.tokens == 16 and placed
    for pos, rot in placed:
        assert torch.equal(pos, pos.sort(dim=1).values)  # merged in document order
        assert bool((rot[:, 1:] > rot[:, :-1]).all())  # compact slots ascend with it


def test_dropped_indices_is_the_complement():
    keep = torch.tensor([[0, 2, 5], [1, 3, 4]])
    assert dropped_indices(keep, 6).tolist() == [[1, 3, 4], [0, 2, 5]]


def test_file_store_leaves_no_file_and_round_trips(tmp_path):
    store = FileStore(8, tmp_path)
    assert os.listdir(tmp_path) == []  # unlinked at creation: Ctrl-C/SIGTERM/SIGKILL leave nothing
    rows = torch.arange(40, dtype=torch.uint8).view(5, 8)
    store.append(rows)
    store.append(rows[:2])
    assert torch.equal(store.read(torch.tensor([6, 0, 3])), rows[[1, 0, 3]])
    store.close()
    assert os.listdir(tmp_path) == []


def test_unwritable_archive_location_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="cannot create the recall archive"):
        FileStore(8, tmp_path / "missing" / "dir")


def test_interrupt_during_archiving_leaves_no_file(tmp_path, monkeypatch):
    model = tiny_llama()
    engine = recall_engine(model, "keydiff", 32, 64, archive_dir=str(tmp_path))
    cache = engine.new_cache()
    calls = {"n": 0}
    real = archive_module.append_layers

    def interrupted(*a):  # every append goes through it: one layer's, or a stack's
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(archive_module, "append_layers", interrupted)
    monkeypatch.setattr(stacks_module, "append_layers", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.feed(cache, [ids_of(120, 1)], progress=False)
    assert os.listdir(tmp_path) == []


# -- recall through the engine ----------------------------------------------------------------------------
# A streamed document's later tokens are computed under eviction in every layer above the first,
# so their archived K/V are what the bounded run computed, not what ``full`` computes. The oracle
# therefore (a) feeds the document in one block (every hidden state exact, then eviction to the
# budget archives the rest), and (b) streams it in small blocks through a one-layer model (layer-0
# K/V depend on the tokens only). Either way, recalling every archived token must give ``full``.
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("positions", ["absolute", "compact"])
@pytest.mark.parametrize("policy", ["keydiff", "snapkv", "sink"])
@pytest.mark.parametrize("layout", ["one_block", "one_layer_streamed"])
def test_full_recall_equals_full_policy(family, positions, policy, layout):
    kw = {"num_hidden_layers": 1} if layout == "one_layer_streamed" else {}
    model = {"llama": tiny_llama, "qwen2": tiny_qwen2}[family](**kw)
    doc, question = ids_of(150, 3), ids_of(10, 4)
    ref = dense_logits(model, torch.cat([doc, question]))[-1]
    block = 160 if layout == "one_block" else 16
    engine = recall_engine(model, policy, 40, 256, positions=positions, block_size=block)
    cache, snap = read(engine, doc)
    assert recall.archived_tokens(cache) > 0
    logits, res = engine.feed_question(cache, question, lambda: cache.restore(snap))
    assert res is not None and res.tokens == 150 - 40
    torch.testing.assert_close(logits[-1], ref, atol=2e-4, rtol=2e-4)
    # without recall the same cache answers differently (the document is longer than the budget)
    plain = recall_engine(model, policy, 40, 0, positions=positions, block_size=block)
    c2, s2 = read(plain, doc)
    l2, r2 = plain.feed_question(c2, question, lambda: c2.restore(s2))
    assert r2 is None and not torch.allclose(l2[-1], ref, atol=1e-3)


@pytest.mark.parametrize("positions", ["absolute", "compact"])
def test_recalled_kv_equal_what_was_evicted(positions, monkeypatch):
    model = tiny_llama()
    engine = recall_engine(model, "keydiff", 32, 512, positions=positions)
    cache = engine.new_cache()
    evicted: dict[tuple[int, int], tuple] = {}  # (layer, head) → (k, v, pos) at eviction, original positions
    real = BoundedCache.evict_deferred
    assert all(g.stack is not None for g in cache.groups())  # every eviction waits for the block's end

    def spy(self):
        before = [
            (
                g.keys[0, :, g.off : g.off + g.length].clone(),
                g.values[0, :, g.off : g.off + g.length].clone(),
                g.positions[:, : g.length].clone(),
                g.rotary[:, : g.length].clone(),
            )
            for g in self.groups()
        ]
        real(self)
        for li, (g, (k_all, v_all, p_all, r_all)) in enumerate(zip(self.groups(), before, strict=True)):
            kept = g.positions[:, : g.length]
            for h in range(g.num_heads):
                gone = ~torch.isin(p_all[h], kept[h])
                k = k_all[h, gone]
                if positions == "compact":
                    delta = p_all[h, gone] - r_all[h, gone]
                    k = cache.rotator.rotate(k.unsqueeze(0), delta.unsqueeze(0))[0].clone()  # a view of its buffer
                for kk, vv, pp in zip(k, v_all[h, gone], p_all[h, gone], strict=True):
                    evicted[(li, h, int(pp))] = (kk, vv)

    monkeypatch.setattr(BoundedCache, "evict_deferred", spy)
    engine.feed(cache, [ids_of(100, 5)], progress=False)
    monkeypatch.setattr(BoundedCache, "evict_deferred", real)
    for li, layer in enumerate(cache.layers):
        g = layer.groups[0]
        a = g.archive
        k, v, pos = a.read(torch.arange(a.length).expand(g.num_heads, -1))
        for h in range(g.num_heads):
            for t in range(a.length):
                ek, ev = evicted[(li, h, int(pos[h, t]))]
                if positions == "absolute":
                    assert torch.equal(k[h, t], ek) and torch.equal(v[h, t], ev)
                else:
                    torch.testing.assert_close(k[h, t], ek, atol=1e-5, rtol=1e-5)
                    assert torch.equal(v[h, t], ev)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_narrow_archive_dtype_costs_only_its_rounding(dtype):
    """--archive-dtype: archived K/V are the evicted ones rounded to ``dtype`` (and back to the
    cache's dtype when recalled); the archive file is half the size of a float32 one."""
    model = tiny_llama()
    doc = ids_of(100, 5)
    wide = recall_engine(model, "keydiff", 32, 512)
    narrow = recall_engine(model, "keydiff", 32, 512, archive_dtype=dtype)
    cw, _ = read(wide, doc)
    cn, _ = read(narrow, doc)
    for gw, gn in zip(cw.groups(), cn.groups(), strict=True):
        aw, an = gw.archive, gn.archive
        assert an.dtype == dtype and an.length == aw.length > 0
        assert an.store.rows * an.store.row_bytes * 2 == aw.store.rows * aw.store.row_bytes
        idx = torch.arange(aw.length).expand(gw.num_heads, -1)
        kw, vw, pw = aw.read(idx)
        kn, vn, pn = an.read(idx)
        assert torch.equal(pw, pn)
        assert torch.equal(kn, kw.to(dtype)) and torch.equal(vn, vw.to(dtype))  # exactly the rounding
    assert recall.archive_dtype(cn) == str(dtype).removeprefix("torch.")


def test_int8_archive_is_within_half_a_step_per_channel():
    """--archive-dtype int8: each archived key/value row is stored as int8 with its own scale
    (absmax / 127); every recalled channel is within half a step of the evicted value, and the
    file is a quarter of a float32 one plus the scales."""
    model = tiny_llama()
    doc = ids_of(100, 5)
    cw, _ = read(recall_engine(model, "keydiff", 32, 512), doc)
    cq, _ = read(recall_engine(model, "keydiff", 32, 512, archive_dtype=torch.int8), doc)
    for gw, gq in zip(cw.groups(), cq.groups(), strict=True):
        aw, aq = gw.archive, gq.archive
        h, d = aw.h, aw.d
        assert aq.store.row_bytes == 2 * h * (d + 4) and aq.length == aw.length > 0
        idx = torch.arange(aw.length).expand(h, -1)
        for w, q in zip(aw.read(idx)[:2], aq.read(idx)[:2], strict=True):
            step = w.abs().amax(-1, keepdim=True) / 127
            assert ((q - w).abs() <= step / 2 + 1e-6).all()
    assert recall.archive_dtype(cq) == "int8"


def test_page_size_sets_the_summaries_and_the_unit_of_recall():
    model = tiny_llama()
    for page in (4, 16):
        cache, _ = read(recall_engine(model, "sink", 32, 512, page_size=page), ids_of(100, 5))
        for g in cache.groups():
            assert g.archive.page_size == page and g.archive.pages == -(-g.archive.length // page)


def test_recalled_tokens_stay_for_the_whole_answer():
    """The question and the answer displace the policy's own tokens, never the ones recalled for them:
    `sink` would otherwise evict the oldest — the recalled — first. The next restore drops them."""
    model = tiny_llama()
    engine = recall_engine(model, "sink", 32, 24, block_size=16)
    cache, snap = read(engine, ids_of(200, 6))
    recalled: dict[int, list] = {}
    real = recall.insert

    def spy(g, keys, values, positions, ranking=None):
        recalled[id(g)] = positions.tolist()
        real(g, keys, values, positions, ranking)

    recall.insert = spy
    try:
        logits, res = engine.feed_question(cache, ids_of(12, 7), lambda: cache.restore(snap))
    finally:
        recall.insert = real
    assert res is not None and res.tokens == 24 and recalled
    engine.generate(cache, logits, 40, eos_ids=set())  # past the spare region: lazy evictions run
    for g in cache.groups():
        if id(g) in recalled:
            held = g.positions[:, : g.length].tolist()
            for head, pos in enumerate(recalled[id(g)]):
                assert set(pos) <= set(held[head])
    cache.restore(snap)
    assert all(g.recalled is None for g in cache.groups())


def test_recall_stays_within_budget_plus_recall_plus_block_and_restores():
    model = tiny_qwen2()
    budget, rec, block = 32, 24, 16
    engine = recall_engine(model, "keydiff", budget, rec, block_size=block)
    cache, snap = read(engine, ids_of(200, 6))
    before = {k: v.clone() for k, v in cache.state_dict().items()}
    for seed in (7, 8):  # each question recalls for itself
        q = ids_of(12, seed)
        logits, res = engine.feed_question(cache, q, lambda: cache.restore(snap))
        assert res is not None and res.tokens == rec and res.pages > 0
        for g in cache.groups():
            assert g.length <= budget + rec + block
        out, _ = engine.generate(cache, logits, 30, eos_ids=set())
        for g in cache.groups():
            assert g.length <= budget + rec + block  # decoding evicts lazily, once per block of tokens
            assert g.slots == budget + rec + block
        assert cache.counters.max_stored <= budget + rec + block
        cache.pin_start = None
        cache.restore(snap)
        after = cache.state_dict()
        assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
        assert all(g.capacity == budget for g in cache.groups())


def test_focus_ranks_by_the_question_rows_only():
    """Oracle: recall focused on rows a..b of the question chooses exactly what recall chooses from a
    log holding only those rows' queries (the instruction's rows do not vote)."""
    model = tiny_llama()
    engine = recall_engine(model, "h2o", 32, 16)
    cache, snap = read(engine, ids_of(240, 11))
    q = ids_of(12, 12)
    cache.query_log = []
    engine.pin(cache, q.numel(), None)
    engine.feed(cache, [q], progress=False)
    log, cache.query_log = cache.query_log, None
    chosen: list[list] = []
    real = recall.insert

    def spy(g, keys, values, positions, ranking=None):
        chosen[-1].append(positions.tolist())
        real(g, keys, values, positions, ranking)

    recall.insert = spy
    try:
        for entries, focus in ((log, slice(4, 9)), ([(li, x[:, :, 4:9], s) for li, x, s in log], None), (log, None)):
            cache.restore(snap)
            chosen.append([])
            recall.recall(cache, entries, 16, focus)
    finally:
        recall.insert = real
    assert chosen[0] == chosen[1]
    assert chosen[0] != chosen[2]  # the other rows did change the choice: focus is not a no-op here


def test_focus_rows_are_the_question_tokens():
    from kvtool.runtime import prompt
    from tests.helpers import tiny_tokenizer

    tok = tiny_tokenizer()
    question = "what is the pass key?"
    suffix = prompt.question_suffix(tok, question)
    rows = prompt.focus_rows(tok, suffix, question)
    ids = prompt.encode(tok, suffix)
    assert rows is not None and tok.decode(ids[rows]).strip() == question
    assert prompt.focus_rows(tok, suffix, "not in there") is None


def test_recall_does_not_archive_the_answer():
    model = tiny_llama()
    engine = recall_engine(model, "keydiff", 32, 32)
    cache, snap = read(engine, ids_of(120, 9))
    archived = recall.archived_tokens(cache)
    logits, _ = engine.feed_question(cache, ids_of(10, 10), lambda: cache.restore(snap))
    engine.generate(cache, logits, 40, eos_ids=set())
    assert recall.archived_tokens(cache) == archived


# -- the CLI: ask with recall, .kvc with its archive -----------------------------------------------------
@pytest.fixture(scope="module")
def kvenv(tmp_path_factory):
    from tests.test_store import WORDS, _checkpoint

    root = tmp_path_factory.mktemp("recall")
    rng = __import__("random").Random(2)
    doc = root / "doc.txt"
    doc.write_text(" ".join(rng.choice(WORDS[20:]) for _ in range(300)) + "\n", encoding="utf-8")
    return {"root": root, "model": str(_checkpoint(root / "tiny")), "doc": doc}


KV_SETTINGS = ["--policy", "h2o", "--budget", "40", "--block-size", "16", "--device", "cpu", "--max-new-tokens", "6"]


def run_cli(capsys, *args):
    from kvtool.cli.app import main

    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_kvc_round_trip_keeps_the_archive(kvenv, tmp_path, capsys, monkeypatch):
    import json

    monkeypatch.setenv("KVTOOL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KVTOOL_ARCHIVE_DIR", str(tmp_path))
    base = ["--model", kvenv["model"], *KV_SETTINGS, "--recall", "64", "--json", "-q"]
    q = ["what is the castle", "where is the ship"]
    rc, from_doc, err = run_cli(capsys, "ask", kvenv["doc"], *q, *base)
    assert rc == 0, err
    doc_stats = json.loads(from_doc)["stats"]
    assert doc_stats["recall_tokens"] == 64 and doc_stats["archive_bytes"] > 0
    assert doc_stats["recalled_pages"] > 0 and doc_stats["recall_seconds"] > 0
    assert doc_stats["archive_path"].startswith(str(tmp_path))

    out = tmp_path / "doc.kvc"
    rc, _, err = run_cli(
        capsys, "prefill", kvenv["doc"], "-o", out, "--model", kvenv["model"], *KV_SETTINGS[:8], "--recall", "64", "-q"
    )
    assert rc == 0, err
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("kvtool-archive-")] == []  # temp: unlinked
    rc, info, _ = run_cli(capsys, "inspect", out, "--json")
    arch = json.loads(info)["archive"]
    archive = tmp_path / arch["file"]  # doc.kvc.<unique id>.archive: a cache and its archive belong together
    assert archive.is_file() and arch["file"].startswith("doc.kvc.") and arch["file"].endswith(".archive")
    assert arch["tokens"] == doc_stats["archived_tokens"] and arch["pages"] > 0
    rc, text, _ = run_cli(capsys, "inspect", out)
    assert arch["file"] in text and "pages of 32 tokens" in text

    kvc_args = ["--model", kvenv["model"], "--recall", "64", "--max-new-tokens", "6", "--json", "-q"]
    rc, from_kvc, err = run_cli(capsys, "ask", out, *q, *kvc_args)
    assert rc == 0, err
    a_doc, a_kvc = json.loads(from_doc), json.loads(from_kvc)
    assert a_doc["answers"] == a_kvc["answers"]  # same archive, same recall, same answers
    assert a_kvc["stats"]["recalled_pages"] == doc_stats["recalled_pages"]

    # a truncated archive, then a missing one: answers without recall and a warning, exit 0
    no_recall = ["--model", kvenv["model"], "--recall", "off", "--max-new-tokens", "6", "--json", "-q"]
    rc, plain, _ = run_cli(capsys, "ask", out, *q, *no_recall)
    data = archive.read_bytes()
    archive.write_bytes(data[: len(data) // 2])
    rc, damaged, err = run_cli(capsys, "ask", out, *q, *kvc_args[:-2], "--json")
    assert rc == 0, err
    assert "missing or damaged" in err and "Traceback" not in err
    assert json.loads(damaged)["answers"] == json.loads(plain)["answers"]
    assert json.loads(damaged)["stats"]["recalled_pages"] == 0
    archive.unlink()
    rc, missing, err = run_cli(capsys, "ask", out, *q, *kvc_args[:-2], "--json")
    assert rc == 0 and "missing or damaged" in err
    assert json.loads(missing)["answers"] == json.loads(plain)["answers"]


def test_kvc_without_archive_answers_with_a_note(kvenv, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVTOOL_HOME", str(tmp_path / "home"))
    out = tmp_path / "plain.kvc"
    rc, _, err = run_cli(
        capsys, "prefill", kvenv["doc"], "-o", out, "--model", kvenv["model"], *KV_SETTINGS[:8], "--recall", "off", "-q"
    )
    assert rc == 0, err
    assert not list(tmp_path.glob("plain.kvc*.archive"))
    rc, stdout, err = run_cli(
        capsys, "ask", out, "what is the castle", "--model", kvenv["model"], "--recall", "64", "--max-new-tokens", "4"
    )
    assert rc == 0 and stdout.strip()
    assert "no archive of evicted tokens" in err


@pytest.mark.parametrize("flag", [("--recall", "lots"), ("--recall-placement", "first")])
def test_bad_recall_value_is_a_usage_error(kvenv, capsys, flag):
    rc, _, err = run_cli(capsys, "ask", kvenv["doc"], "q", "--model", kvenv["model"], *flag)
    assert rc == 2 and err.startswith("kvtool: error: ") and "recall" in err and len(err.strip().splitlines()) == 1


def test_unwritable_archive_dir_exits_2(kvenv, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVTOOL_ARCHIVE_DIR", str(tmp_path / "nope"))
    rc, _, err = run_cli(
        capsys, "ask", kvenv["doc"], "what", "--model", kvenv["model"], *KV_SETTINGS, "--recall", "64", "-q"
    )
    assert rc == 2 and "cannot create the recall archive" in err and "Traceback" not in err


def test_disk_full_while_archiving_is_a_clear_error(tmp_path, monkeypatch):
    import errno

    store = FileStore(8, tmp_path)

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(KvtoolError, match="the disk is full") as err:  # exit 1, as for a .kvc on a full disk
        store.append(torch.zeros(2, 8, dtype=torch.uint8))
    assert err.value.exit_code == 1 and "MiB free" in str(err.value)
    store.close()
    assert os.listdir(tmp_path) == []


def test_profile_plans_the_recall_slots(kvenv, tmp_path, capsys, monkeypatch):
    import json

    monkeypatch.setenv("KVTOOL_HOME", str(tmp_path / "home"))
    args = [
        "profile",
        "--model",
        kvenv["model"],
        "--budget",
        "40",
        "--block-size",
        "16",
        "--device",
        "cpu",
        "--json",
        "-q",
    ]
    rc, plain, err = run_cli(capsys, *args, "--recall", "0")
    assert rc == 0, err
    rc, with_recall, err = run_cli(capsys, *args, "--recall", "24", "--archive-dtype", "auto")
    assert rc == 0, err
    p, r = json.loads(plain), json.loads(with_recall)
    per_token = r["kv_bytes_per_token"]["total"]
    assert "recall_tokens" not in p and r["recall_tokens"] == 24
    heads = r["kv_bytes_per_token"]["per_layer"] // r["kv_bytes_per_token"]["per_layer_per_head"]
    layers = per_token // r["kv_bytes_per_token"]["per_layer"]
    # budget + recall + block per head: K and V, two int64 positions, and the policy's state (h2o: one float32 field)
    assert r["recall_slots_bytes"] == 24 * (per_token + (16 + 4) * heads * layers)
    assert r["recall_kv_bytes"] == 24 * per_token

    def peak(plan):  # the runtime baseline is a measured RSS: it differs between the two runs
        return plan["predicted_peak_bytes"] - plan["runtime_baseline_bytes"]

    # with compact positions (auto, past the range) a group holding its recalled tokens is re-packed whole
    # (24 more float32 keys, and 24 more tokens in the step's 12 B per dimension of float work)
    rotated = r["rotation_scratch_bytes"] - p["rotation_scratch_bytes"]
    heads_x_dim = r["kv_bytes_per_token"]["per_layer"] // (2 * 4)  # K and V of float32 per KV head and dim
    assert r["dtype"] == "float32" and rotated == 24 * heads_x_dim * (4 + 12)
    # a query sees 24 more keys while answering (the policy's probabilities, SDPA's scratch), and scoring the
    # archive has its temporaries
    seen = sum(r[k] - p[k] for k in ("attention_scratch_bytes", "sdpa_scratch_bytes"))
    assert seen > 0 and r["recall_scratch_bytes"] > 0
    # a recalling layer evicts alone, over its recalled slots too; making room holds the old keys a moment; the
    # archive's appends have their buffers
    evict = r["eviction_scratch_bytes"] - p["eviction_scratch_bytes"]
    assert peak(r) - peak(p) == (
        r["recall_slots_bytes"]
        + rotated
        + seen
        + r["recall_scratch_bytes"]
        + evict
        + r["recall_growth_bytes"]
        + r["archive_work_bytes"]
    )
    assert r["archive_bytes_per_evicted_token"]["file"] == per_token  # the model's dtype
    rc, default, err = run_cli(capsys, *args)  # recall auto: 256 slots, an int8 archive
    assert rc == 0, err
    d = json.loads(default)
    assert d["recall_tokens"] == 256 and d["archive_dtype"] == "int8"
    assert d["archive_bytes_per_evicted_token"]["file"] == per_token // 4 + 2 * 4 * 2 * 2  # + a scale per head, K/V
    rc, narrow, err = run_cli(capsys, *args, "--recall", "24", "--archive-dtype", "float16", "--recall-page", "64")
    assert rc == 0, err
    n = json.loads(narrow)
    assert n["archive_dtype"] == "float16" and n["recall_page"] == 64
    assert n["archive_bytes_per_evicted_token"]["file"] == per_token // 2
    assert n["archive_bytes_per_evicted_token"]["index"] < r["archive_bytes_per_evicted_token"]["index"]
    for bad in (["--archive-dtype", "int4"], ["--recall-page", "0"]):
        rc, _, err = run_cli(capsys, *args, "--recall", "24", *bad)
        assert rc == 2 and err.startswith("kvtool: error: ") and "Traceback" not in err


def test_kvc_archive_in_another_dtype_answers_without_recall(kvenv, tmp_path, capsys, monkeypatch):
    import json

    monkeypatch.setenv("KVTOOL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KVTOOL_ARCHIVE_DIR", str(tmp_path))
    out = tmp_path / "half.kvc"
    rc, _, err = run_cli(
        capsys,
        "prefill",
        kvenv["doc"],
        "-o",
        out,
        "--model",
        kvenv["model"],
        *KV_SETTINGS[:8],
        "--recall",
        "64",
        "--archive-dtype",
        "float16",
        "-q",
    )
    assert rc == 0, err
    rc, info, _ = run_cli(capsys, "inspect", out, "--json")
    assert json.loads(info)["archive"]["dtype"] == "float16"
    ask = [
        "ask",
        out,
        "what is the castle",
        "--model",
        kvenv["model"],
        "--recall",
        "64",
        "--max-new-tokens",
        "4",
        "--json",
    ]
    rc, same, err = run_cli(capsys, *ask, "--archive-dtype", "float16")
    assert rc == 0 and "answering without recall" not in err, err
    assert json.loads(same)["stats"]["recalled_pages"] > 0 and json.loads(same)["stats"]["archive_dtype"] == "float16"
    rc, other, err = run_cli(capsys, *ask, "--archive-dtype", "float32")  # the file's dtype is the default
    assert rc == 0 and "stores keys/values in float16" in err and "--archive-dtype float16" in err
    assert json.loads(other)["stats"]["recalled_pages"] == 0


def test_a_question_the_template_rewrites_is_ranked_by_every_row_and_said(kvenv, tmp_path, monkeypatch):
    """``focus_rows`` finds the question by its text; a template that rewrites it falls back, with a note."""
    from kvtool.core.events import Note
    from kvtool.documents import open_document
    from kvtool.runtime import prompt
    from kvtool.runtime.session import Session
    from kvtool.runtime.settings import resolve_settings

    monkeypatch.setenv("KVTOOL_ARCHIVE_DIR", str(tmp_path))
    notes: list[str] = []
    s = Session(
        resolve_settings(
            None,
            {
                "model": kvenv["model"],
                "policy": "h2o",
                "budget": "40",
                "block_size": 16,
                "recall": "64",
                "max_new_tokens": 2,
            },
        ),
        listener=lambda e: notes.append(e.message) if isinstance(e, Note) else None,
    )
    read = s.read(open_document(str(kvenv["doc"])))
    s.ask(read, "where is the ship")
    assert not any("not verbatim" in n for n in notes)
    real = prompt.question_suffix
    monkeypatch.setattr(prompt, "question_suffix", lambda tok, q: real(tok, q.upper()))
    s.ask(read, "where is the ship")
    assert sum("not verbatim" in n for n in notes) == 1


def test_a_session_and_its_last_read_go_with_the_last_reference(kvenv, tmp_path, monkeypatch):
    """No cycle through the session (its callbacks are weak): an eval that builds one session per policy
    frees each run's last read as soon as the next run starts, not whenever the cyclic GC runs."""
    import gc
    import weakref

    from kvtool.documents import open_document
    from kvtool.runtime.session import Session
    from kvtool.runtime.settings import resolve_settings

    monkeypatch.setenv("KVTOOL_ARCHIVE_DIR", str(tmp_path))
    s = Session(
        resolve_settings(
            None,
            {
                "model": kvenv["model"],
                "policy": "h2o",
                "budget": "40",
                "block_size": 16,
                "recall": "64",
                "max_new_tokens": 2,
            },
        ),
        listener=lambda e: None,
    )
    s.ask(s.read(open_document(str(kvenv["doc"]))), "where is the ship")
    session, cache = weakref.ref(s), weakref.ref(s.last_read.cache)
    gc.disable()
    try:
        del s
        assert session() is None and cache() is None
    finally:
        gc.enable()
