"""Recall on every path it is the default for: what each path must keep, read or bound, by exact oracles.

Archive scoring reads key bytes only; recall's temporaries are chunked and its query log holds only the
layers and rows it scores with; a question near the model's range is scored in the frame it is fed in;
int4's 16-bit window is read by position; a restore keeps the compact keys' original copy; ``--cite``
keeps the passage recall brought back; H2O builds its protection only when it evicts.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtool.core import archive, recall
from kvtool.core.archive import GroupArchive
from kvtool.core.archive_stores import MemoryStore
from tests.helpers import VOCAB, make_engine, tiny_checkpoint, tiny_family, tiny_llama


class CountingStore:
    """A store that counts the bytes read from it."""

    def __init__(self, inner: MemoryStore) -> None:
        self.inner = inner
        self.row_bytes, self.where = inner.row_bytes, inner.where
        self.bytes_read = 0

    @property
    def rows(self) -> int:
        return self.inner.rows

    def read(self, index: torch.Tensor) -> torch.Tensor:
        out = self.inner.read(index)
        self.bytes_read += out.numel()
        return out

    def append(self, rows: torch.Tensor) -> None:
        self.inner.append(rows)

    def close(self) -> None:
        self.inner.close()


def _counting_archive(dtype: torch.dtype, h: int = 3, d: int = 16, page: int = 4) -> tuple[GroupArchive, list]:
    made: list[CountingStore] = []

    def factory(row_bytes: int) -> CountingStore:
        made.append(CountingStore(MemoryStore(row_bytes)))
        return made[-1]

    return GroupArchive(h, d, dtype, page, factory), made


def test_scoring_reads_the_key_half_of_the_rows_only():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.int8):
        arch, made = _counting_archive(dtype)
        h, d, n = arch.h, arch.d, 40
        keys, values = torch.randn(h, n, d), torch.randn(h, n, d)
        arch.append(keys, values, torch.arange(n).expand(h, n))
        q = torch.randn(h, 5, d)
        scored = torch.cat([s for _, s in arch.scores(q, torch.arange(arch.pages).expand(h, -1))], dim=2)
        # the oracle: q·k of the keys as archived (exact for a float archive, the dequantized keys for int8)
        archived = arch.read(torch.arange(n).expand(h, n))[0]
        torch.testing.assert_close(scored, q @ archived.float().transpose(1, 2), rtol=0, atol=1e-5)
        kv_read = sum(s.bytes_read for s in made if s not in (arch.index, arch.summaries)) - n * arch.store.row_bytes
        # the ``read`` above took whole rows; scoring took the key half of each archived token's row
        assert kv_read == n * arch.store.row_bytes // 2, dtype


# -- recall's temporaries: bounded, and only what recall scores with ------------------------------------------
def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _read(engine, n: int, seed: int):
    cache = engine.new_cache()
    engine.feed(cache, [_ids(n, seed)], progress=False)
    return cache, cache.snapshot()


def _recalled(monkeypatch) -> list[list[torch.Tensor]]:
    """Spy on ``recall.insert``: per question, the positions inserted into each group."""
    chosen: list[list[torch.Tensor]] = []
    real = recall.insert

    def spy(g, keys, values, positions, ranking=None):
        chosen[-1].append(positions.clone())
        real(g, keys, values, positions, ranking)

    monkeypatch.setattr(recall, "insert", spy)
    return chosen


def test_recall_scores_in_chunks_of_bounded_size_with_the_same_choice(monkeypatch):
    """Oracle: what comes back is exactly what unchunked scoring brings back, and no score matrix of kept or
    archived tokens is larger than ``SCORE_BYTES`` (or one page's, the smallest unit)."""
    model = tiny_llama()
    engine = make_engine(model, "h2o", 40, block_size=16, recall=16, page_size=8)
    cache, snap = _read(engine, 300, 1)
    question = _ids(12, 2)
    chosen = _recalled(monkeypatch)
    largest: list[int] = []
    real_bmm, real_recall = torch.bmm, recall.recall

    def bmm(a, b, **kw):  # every score matrix recall computes is a bmm
        out = real_bmm(a, b, **kw)
        largest.append(out.numel() * out.element_size())
        return out

    def scoring(*args, **kw):
        monkeypatch.setattr(torch, "bmm", bmm)
        try:
            return real_recall(*args, **kw)
        finally:
            monkeypatch.setattr(torch, "bmm", real_bmm)

    monkeypatch.setattr(recall, "recall", scoring)
    for limit in (1 << 30, 1024):
        monkeypatch.setattr(archive, "SCORE_BYTES", limit, raising=False)
        monkeypatch.setattr(recall, "SCORE_BYTES", limit, raising=False)
        chosen.append([])
        largest.clear()
        engine.feed_question(cache, question, lambda: cache.restore(snap), focus=slice(2, 10))
    h, rows = 2, 2 * 8  # KV heads, and their query rows: 2 query heads per KV head x 8 focus rows
    assert max(largest) <= max(1024, 4 * h * rows * 8)
    assert len(chosen[0]) == len(chosen[1]) == 2
    assert all(torch.equal(a, b) for a, b in zip(chosen[0], chosen[1], strict=True))


def test_the_query_log_holds_the_focus_rows_of_the_layers_that_recall(monkeypatch):
    """A hybrid model (a sliding layer between global ones): only the global layers archive, so only their
    queries are kept, and of each only the question's rows — counted exactly."""
    model = tiny_family("gemma3")
    engine = make_engine(model, "h2o", 96, block_size=16, recall=16, page_size=8)
    cache, snap = _read(engine, 300, 3)
    logs: list = []
    real = recall.recall

    def spy(cache, log, *args, **kw):
        logs.append(list(log))
        return real(cache, log, *args, **kw)

    monkeypatch.setattr(recall, "recall", spy)
    question = _ids(40, 4)  # three blocks of 16: the focus rows 10..29 span the first two
    engine.feed_question(cache, question, lambda: cache.restore(snap), focus=slice(10, 30))
    globals_ = {li for li, layer in enumerate(cache.layers) if layer.groups[0].window is None}
    assert globals_ == {1}  # gemma3's tiny layout: sliding, global, sliding
    (log,) = logs
    assert {li for li, _, _ in log} == globals_
    heads, d = model.config.get_text_config().num_attention_heads, cache.head_dim
    assert [tuple(q.shape) for _, q, _ in log] == [(1, heads, 6, d), (1, heads, 14, d)]  # rows 10-15, 16-29
    # the recorded rows are the rows the question attended with: a plain log of every row, cut afterwards
    full: list = []
    cache.restore(snap)
    engine.pin(cache, question.numel())
    cache.query_log = full
    engine.feed(cache, [question], progress=False)
    cache.query_log = None
    whole = torch.cat([q for li, q, _ in full if li == 1], dim=2)
    assert torch.equal(torch.cat([q for _, q, _ in log], dim=2), whole[:, :, 10:30])


# -- positions auto: a question that passes the model's range is scored in the frame it is fed in --------------
def test_a_question_past_the_range_is_recorded_scored_and_placed_at_compact_positions(monkeypatch):
    """The document fits the model's 200 positions, document + question does not: the question is fed at
    compact positions from its first token, both times, so recall scores its compact queries against keys
    landed at compact positions and places the selection by relevance, as compact positions do."""
    model = tiny_llama(max_positions=200)
    engine = make_engine(model, "h2o", 80, block_size=16, positions="auto", recall=16, page_size=8)
    cache, snap = _read(engine, 180, 5)
    assert not cache.compact and cache.seen == 180
    frames: dict[str, list[bool]] = {"recorded": [], "scored": [], "relevance": []}
    real_append, real_recall, real_insert = recall.QueryLog.append, recall.recall, recall.insert

    def append(self, entry):
        frames["recorded"].append(cache.compact)
        real_append(self, entry)

    def scoring(c, *args, **kw):
        frames["scored"].append(c.compact)
        return real_recall(c, *args, **kw)

    def insert(g, keys, values, positions, ranking=None):
        frames["relevance"].append(ranking is not None)
        real_insert(g, keys, values, positions, ranking)

    monkeypatch.setattr(recall.QueryLog, "append", append)
    monkeypatch.setattr(recall, "recall", scoring)
    monkeypatch.setattr(recall, "insert", insert)
    engine.feed_question(cache, _ids(30, 6), lambda: cache.restore(snap))
    assert frames["recorded"] and all(frames["recorded"])  # every block of the first pass
    assert frames["scored"] == [True] and frames["relevance"] == [True, True]
    assert cache.compact and cache.seen == 210
    # inside the range nothing moves: a question that fits is fed and scored at absolute positions
    frames = {k: [] for k in frames}
    cache2, snap2 = _read(engine, 120, 5)
    engine.feed_question(cache2, _ids(30, 6), lambda: cache2.restore(snap2))
    assert not cache2.compact and frames["scored"] == [False] and frames["relevance"] == [False, False]


# -- int4: the newest document tokens keep their 16-bit window beside a recalled selection --------------------
def test_int4_kept_tokens_read_the_same_values_after_a_relevance_placed_recall(monkeypatch):
    """Oracle: recall adds tokens and moves none of the kept ones' K/V codes or window rows, so every kept token
    reads bit-identical values after the recall — the document's newest ones from their 16-bit window, though
    the recalled selection now sits after them (compact positions place it by relevance)."""
    engine = make_engine(
        tiny_llama(), "h2o", 160, block_size=16, positions="compact", recall=128, page_size=8, kv_dtype="int4"
    )
    cache, snap = _read(engine, 400, 7)
    before: list[dict[int, torch.Tensor]] = []
    after: list[dict[int, torch.Tensor]] = []
    real = recall.recall

    def by_position(c) -> list[dict[int, torch.Tensor]]:
        out = []
        for g in c.groups():
            values, pos = g.stored_values(), g.positions[:, : g.length]
            out.append(
                {(h, int(p)): values[h, i].clone() for h in range(g.num_heads) for i, p in enumerate(pos[h].tolist())}
            )
        return out

    def spy(c, *args, **kw):
        before.extend(by_position(c))
        result = real(c, *args, **kw)
        after.extend(by_position(c))
        return result

    monkeypatch.setattr(recall, "recall", spy)
    placed: list[bool] = []
    real_insert = recall.insert
    monkeypatch.setattr(
        recall,
        "insert",
        lambda g, k, v, p, ranking=None: (placed.append(ranking is not None), real_insert(g, k, v, p, ranking)),
    )
    engine.feed_question(cache, _ids(10, 8), lambda: cache.restore(snap))
    assert placed == [True, True]
    window = cache.groups()[0].recent
    assert window is not None and window.size == 128
    newest = 0
    for kept, now in zip(before, after, strict=True):
        assert set(kept) < set(now)  # the recalled tokens came on top
        for key, value in kept.items():
            assert torch.equal(now[key], value), key
            newest += key[1] >= 400 - 128
    assert newest > 0  # the window's tokens were among them


# -- a restore gives back the compact keys' original copy the document left, not a re-quantized one ----------
@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "bfloat16"])
def test_a_restore_keeps_the_original_keys_copy_bit_identical(kv_dtype):
    """Oracle: after questions (each restores the post-document cache twice and re-packs it), a restore gives
    back exactly the original-position keys the document left, so every question starts from them."""
    engine = make_engine(
        tiny_llama(), "h2o", 64, block_size=16, positions="compact", recall=16, page_size=8, kv_dtype=kv_dtype
    )
    cache, snap = _read(engine, 250, 9)

    def originals() -> list[torch.Tensor]:
        return [g.origin_keys(g.length).clone() for g in cache.groups()]

    left = originals()
    assert all(o is not None and o.numel() for o in left)
    for seed in (10, 11):
        engine.feed_question(cache, _ids(12, seed), lambda: cache.restore(snap))
        cache.restore(snap)
        assert all(torch.equal(a, b) for a, b in zip(originals(), left, strict=True))


# -- h2o observes every step, but protection is built only when a group evicts --------------------------------
@pytest.mark.parametrize("policy", ["h2o", "h2o+vatp"])
def test_protection_is_built_only_on_evicting_steps_and_results_are_bit_identical(policy, monkeypatch):
    """Oracle: the number of protection builds equals the number of evictions exactly (one per group evicted
    alone, one per stack of layers evicted together), and the logits of a read and of decoded tokens are
    bit-identical to a run whose every observed step builds it too."""
    from kvtool.core import cache as cache_module
    from kvtool.core import stacks as stacks_module
    from kvtool.core.cache import BoundedCache

    model = tiny_llama()
    doc = _ids(150, 12)

    def run() -> tuple[torch.Tensor, list[int], int, int]:
        engine = make_engine(model, policy, 40, block_size=16)
        cache = engine.new_cache()
        logits = torch.cat([x for x in engine.steps(cache, doc, logits_rows=None)])
        ids, _ = engine.generate(cache, logits[-1:], 40, set())
        return logits, ids, built[0], evictions[0]

    built, evictions = [0], [0]
    protection, evict_step = BoundedCache.protection, cache_module.evict_step

    def counting_protection(self, pos, g):
        built[0] += 1
        return protection(self, pos, g)

    def counting_evictions(*args):
        evictions[0] += 1
        return evict_step(*args)

    monkeypatch.setattr(BoundedCache, "protection", counting_protection)
    monkeypatch.setattr(cache_module, "evict_step", counting_evictions)
    monkeypatch.setattr(stacks_module, "evict_step", counting_evictions)
    logits, ids, n_built, n_evicting = run()
    assert n_evicting > 0 and n_built == n_evicting
    built[0] = evictions[0] = 0
    observation = BoundedCache.observation

    def protected_observation(self, layer_idx, g, probs):
        ctx = observation(self, layer_idx, g, probs)
        protected, priority = self.protection(ctx.positions, g)
        return dataclasses.replace(ctx, protected=protected, priority=priority)

    monkeypatch.setattr(BoundedCache, "observation", protected_observation)
    ref_logits, ref_ids, every, _ = run()
    assert every > n_built  # the reference built it on every step h2o observed
    assert torch.equal(logits, ref_logits) and ids == ref_ids


# -- --cite keeps the passage recall brought back ---------------------------------------------------------------
def test_a_recalled_needle_is_cited_at_its_section(tmp_path, monkeypatch):
    """A Markdown document whose "Secret" section holds the needle, read under a budget that evicts it; recall
    is steered to bring that section back (a random model would not choose it). Oracles: the source map holds
    every document position the answer attended to, recalled ones included, and the attention the recalled
    tokens received is cited at the needle's section, with the needle's text."""
    from kvtool.core.cache import BoundedCache
    from kvtool.documents import open_document
    from kvtool.runtime.citations import cite
    from kvtool.runtime.session import Session
    from kvtool.runtime.settings import resolve_settings

    model_dir = tiny_checkpoint(tmp_path / "model")
    filler = "the cache is small and hello world. " * 60
    doc = tmp_path / "doc.md"
    doc.write_text(f"# Intro\n\n{filler}\n\n# Secret\n\nThe pass key is 12345.\n\n# Outro\n\n{filler}\n")
    monkeypatch.setenv("KVTOOL_ARCHIVE_DIR", str(tmp_path))
    s = Session(
        resolve_settings(
            None, {"model": str(model_dir), "budget": "160", "block_size": 16, "recall": "32", "max_new_tokens": 6}
        )
    )
    read = s.read(open_document(str(doc)))
    source = read.source
    first = source.first_position
    secret = torch.tensor(
        [
            int(p)
            for p, (a, _) in zip(source.positions, source.spans, strict=True)
            if source.section_at(int(a)).title == "Secret"
        ]
    )
    held = torch.cat([g.positions[:, : g.length].reshape(-1) for g in read.cache.groups()])
    assert secret.numel(), "the source map forgot the evicted needle's section"
    assert not torch.isin(secret, held).any()  # the needle's section was evicted everywhere

    def steered(relevance: torch.Tensor) -> torch.Tensor:  # what recall ranks first: the needle's section
        out = torch.zeros_like(relevance)
        out[secret] = 1.0
        return out

    monkeypatch.setattr(recall, "_ranking", steered)
    attended: list[tuple[torch.Tensor, torch.Tensor]] = []
    stop = BoundedCache.stop_mass

    def spy(self):
        attended.append(stop(self))
        return attended[-1]

    monkeypatch.setattr(BoundedCache, "stop_mass", spy)
    s.ask(read, "what is the pass key?", cite_spans=True)
    ((positions, mass),) = attended
    recalled = torch.isin(positions, secret)
    assert recalled.any() and float(mass[recalled].sum()) > 0  # the answer attended to the recalled passage
    document = (positions >= first) & (positions < first + source.count)
    assert torch.isin(positions[document], source.positions).all()  # every attended token is in the map
    cited = cite(source, positions[recalled], mass[recalled], s.tokenizer)
    assert cited and cited[0].section == "Secret" and cited[0].label == "\u00a7 \u201cSecret\u201d"
    assert "12345" in cited[0].text
    read.close()


# -- a byte budget is a ceiling with recall on; the plan suggests a budget that fits ----------------------------
HAND = {
    "num_layers": 4,
    "num_kv_heads": 2,
    "num_attention_heads": 4,
    "head_dim": 16,
    "hidden_size": 64,
    "intermediate_size": 96,
    "vocab_size": 100,
}


@pytest.mark.parametrize("dims", [HAND, {**HAND, "sliding_layers": 2, "sliding_window": 33}], ids=["plain", "hybrid"])
@pytest.mark.parametrize("kv_dtype", ["auto", "int4"])
@pytest.mark.parametrize("recall_setting", ["auto", "40"])
def test_a_byte_budget_holds_the_kept_and_the_recalled_tokens(dims, kv_dtype, recall_setting):
    """Oracle by hand: K+V of the kept tokens (every layer; a sliding layer holds min(W - 1, kept)) plus int4's
    window, plus K+V of the recalled ones (global layers only), fit the bytes — and one more kept token would
    not. ``auto`` recalls at most half of what the bytes hold."""
    from kvtool.core.costs import CacheCosts, kv_token_head_bytes, kv_window_bytes
    from kvtool.runtime.profiling import ModelInfo, plan
    from kvtool.runtime.settings import resolve_settings

    info = ModelInfo(name="hand", dims=dims, num_params=1000, dtype="float32")
    per = 2 * dims["num_kv_heads"] * kv_token_head_bytes(kv_dtype, 16, 4)  # K+V of a token in one layer
    window = dims["num_layers"] * dims["num_kv_heads"] * kv_window_bytes(kv_dtype, 16, 4)
    sliding, w = dims.get("sliding_layers", 0), dims.get("sliding_window", 0)
    glob = dims["num_layers"] - sliding

    def held(kept: int, recalled: int) -> int:
        return glob * (kept + recalled) * per + sliding * min(w - 1, kept) * per + window

    for text, nbytes in (("100KiB", 100 << 10), ("200KiB", 200 << 10), ("1MiB", 1 << 20)):
        p = plan(info, resolve_settings(None, {"budget": text, "recall": recall_setting, "kv_dtype": kv_dtype}))
        kept, recalled = p["budget_tokens"], p["recall_tokens"]
        whole = CacheCosts.of(dims, 4, kv_dtype).budget_tokens(nbytes)
        assert recalled == (min(256, whole // 2) if recall_setting == "auto" else 40)
        assert held(kept, recalled) <= nbytes < held(kept + 1, recalled), text
        assert p["recall_kv_bytes"] == glob * recalled * per
        assert f"{kept} tokens per KV head kept" in p["budget_conversion"]
        assert f"+ {recalled} recalled while answering" in p["budget_conversion"]
    # a token budget keeps its meaning: the tokens kept; the plan shows what recall adds on top
    p = plan(info, resolve_settings(None, {"budget": "100", "recall": recall_setting, "kv_dtype": kv_dtype}))
    assert p["budget_tokens"] == 100 and p["recall_kv_bytes"] == glob * p["recall_tokens"] * per


def test_a_recall_larger_than_the_byte_budget_is_refused_with_the_figures():
    from kvtool.errors import UsageError
    from kvtool.runtime.profiling import ModelInfo, plan
    from kvtool.runtime.settings import resolve_settings

    info = ModelInfo(name="hand", dims=HAND, num_params=1000, dtype="float32")
    with pytest.raises(UsageError, match="holds 64 tokens per KV head, and --recall 64 takes them all"):
        plan(info, resolve_settings(None, {"budget": "64KiB", "recall": "64"}))


@pytest.mark.parametrize(
    "settings",
    [
        {"recall": "auto"},
        {"recall": "512", "positions": "compact"},
        {"recall": "auto", "kv_dtype": "int8", "policy": "keydiff"},
    ],
)
def test_the_largest_budget_of_a_memory_limit_fits_with_recall_on(settings):
    """``profile --memory``: the budget it suggests, planned with recall on, fits the limit; one more does not."""
    from kvtool.runtime.profiling import ModelInfo, plan
    from kvtool.runtime.settings import resolve_settings

    info = ModelInfo(name="hand", dims=HAND, num_params=1000, dtype="bfloat16", rows=16, n_fields=1, weights_bytes=5000)
    limit = 6_000_000
    base = {"block_size": 16, "budget": "64", "policy": "h2o", **settings}
    best = plan(info, resolve_settings(None, base), doc_tokens=20_000, memory=limit)["memory"]["largest_budget_tokens"]
    at, over = (
        plan(info, resolve_settings(None, {**base, "budget": str(b)}), doc_tokens=20_000, memory=limit)
        for b in (best, best + 1)
    )
    assert at["memory"]["fits"] is True and at["predicted_peak_bytes"] <= limit < over["predicted_peak_bytes"]
    assert at["recall_tokens"] and at["recall_slots_bytes"] and at["recall_scratch_bytes"]


def test_a_session_with_a_byte_budget_holds_kept_and_recalled_tokens_inside_it(tmp_path, monkeypatch):
    """Measured on a run: while answering with recall, the K/V every group holds room for (its capacity, raised
    by what it recalled) stays inside the byte budget; the stats and the note say how it is split."""
    from kvtool.documents import open_document
    from kvtool.runtime.session import Session
    from kvtool.runtime.settings import resolve_settings

    model_dir = tiny_checkpoint(tmp_path / "model")
    doc = tmp_path / "doc.txt"
    doc.write_text("the cache is small and hello world. " * 80)
    monkeypatch.setenv("KVTOOL_ARCHIVE_DIR", str(tmp_path))
    s = Session(
        resolve_settings(
            None, {"model": str(model_dir), "budget": "128KiB", "block_size": 16, "policy": "tova", "max_new_tokens": 4}
        )
    )
    assert (s.budget_tokens, s.recall_tokens) == (128, 128)  # 256 tokens of 512 bytes: half kept, half recalled
    during: list[int] = []
    real = recall.recall

    def spy(cache, *args, **kw):
        out = real(cache, *args, **kw)
        during.append(sum((g.capacity + g.off) * g.num_heads * 2 * g.bytes_per_token_head() for g in cache.groups()))
        return out

    monkeypatch.setattr(recall, "recall", spy)
    with s.read(open_document(str(doc))) as read:
        s.ask(read, "what is the pass key?")
        stats = s.stats(read)
    assert during and during[0] == 128 << 10  # kept + recalled: the whole budget, not more
    assert stats["kv_budget_bytes"] + stats["recall_kv_bytes"] == 128 << 10
    assert (
        "128 tokens per KV head kept (64.0 KiB) + 128 recalled while answering (64.0 KiB" in stats["budget_conversion"]
    )


def test_a_kvc_budget_in_bytes_matches_with_the_recall_it_was_split_for():
    """A ``.kvc`` prefilled with a byte budget and recall stores the kept tokens; the same bytes spelled
    another way still name it (converted with the archive's recall inside them), other bytes do not."""
    from kvtool.core.costs import CacheCosts
    from kvtool.runtime import store

    kept, recalled = CacheCosts.of(HAND, 4).kept_and_recalled(100 << 10, 256, auto=True)
    stored = {"budget_tokens": kept, "budget": "100KiB", "dtype": "float32", "kv_dtype": "auto"}
    meta = {"model": {"dims": HAND}, "archive": {"recall": recalled}}
    assert store._same_budget("102400B", stored, meta)
    assert not store._same_budget("99KiB", stored, meta)
    assert store._same_budget(str(kept), stored, meta)


# -- stacks of layers stage their appends apart ------------------------------------------------------------------
def test_two_stacks_appending_in_turn_keep_their_own_staged_bytes():
    """Two stacks of archives of different widths share one ``AppendWork`` (as a cache's do: RazorAttention's
    groups, a hybrid model's layers) and append in turn, each before the other's bytes are flushed. Oracle:
    every archive reads back exactly the positions and keys it was given (a staging buffer shared by the
    stacks let the second append write over the first's bytes: garbage positions at recall)."""
    from kvtool.core.archive import AppendWork, append_layers

    work = AppendWork()
    stacks = {h: [GroupArchive(h, 8, torch.float32, 4, MemoryStore, work) for _ in range(3)] for h in (2, 3)}
    given: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {2: [], 3: []}
    gen = torch.Generator().manual_seed(0)
    for block in range(4):
        for h, archives in stacks.items():
            n = 5 + block
            keys, values = torch.randn(3, h, n, 8, generator=gen), torch.randn(3, h, n, 8, generator=gen)
            positions = (torch.arange(n) + 100 * block + 1000 * h).expand(3, h, n).contiguous()
            append_layers(archives, keys, values, positions)
            given[h].append((keys, positions))
    for h, archives in stacks.items():
        for layer, a in enumerate(archives):
            want_pos = torch.cat([p[layer] for _, p in given[h]], dim=1)
            want_keys = torch.cat([k[layer] for k, _ in given[h]], dim=1)
            assert torch.equal(a.all_positions(), want_pos)
            index = torch.arange(a.length).expand(h, -1)
            keys, _, pos = a.read(index, values=False)
            assert torch.equal(pos, want_pos) and torch.equal(keys, want_keys)
