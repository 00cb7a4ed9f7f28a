"""Engine invariants on tiny random Llama and Qwen2 (GQA) models.

1. Nothing evicted ⇒ logits equal dense transformers (any block size, any policy).
2. Per (layer, head group) the cache never holds more than its capacity after a step.
3. After eviction, outputs equal an independent masking reference: dense attention over the whole
   sequence where each query sees exactly the tokens the cache held when it was processed.
4. Protected tokens (sinks, recent window, pinned question) are never evicted.
5. Attention-free policies never compute attention probabilities.
"""

from __future__ import annotations

import pytest
import torch

from kvtool.core import cache as cache_module
from kvtool.core import stacks as stacks_module
from kvtool.errors import UsageError
from tests.helpers import (
    ALL_POLICIES,
    VOCAB,
    dense_logits,
    make_engine,
    masking_reference_logits,
    record_visibility,
    stream_logits,
    tiny_llama,
    tiny_qwen2,
)

MODELS = {"llama": tiny_llama, "qwen2": tiny_qwen2}


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("block_size", [1, 7, 128])
@pytest.mark.parametrize("policy", ["full", "sink"])
def test_no_eviction_reproduces_dense_logits(family, block_size, policy):
    model = MODELS[family]()
    ids = torch.randint(0, VOCAB, (150,), generator=torch.Generator().manual_seed(1))
    dense = dense_logits(model, ids)
    engine = make_engine(model, policy, None if policy == "full" else 256, block_size=block_size)
    got, cache = stream_logits(engine, ids)
    torch.testing.assert_close(got, dense, atol=1e-5, rtol=1e-5)
    assert cache.counters.evicted_tokens == 0


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_every_policy_reproduces_dense_logits_when_budget_covers_document(family, policy):
    model = MODELS[family]()
    ids = torch.randint(0, VOCAB, (90,), generator=torch.Generator().manual_seed(2))
    dense = dense_logits(model, ids)
    engine = make_engine(model, policy, 200, block_size=16)
    got, _ = stream_logits(engine, ids)
    torch.testing.assert_close(got, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("policy", [p for p in ALL_POLICIES if p != "full"])
@pytest.mark.parametrize("factor", [1, 3, 10])
def test_cache_never_exceeds_budget_prefill_and_decode(monkeypatch, policy, factor):
    model = tiny_qwen2()
    budget = 48
    ids = torch.randint(0, VOCAB, (budget * factor,), generator=torch.Generator().manual_seed(3))
    engine = make_engine(model, policy, budget, block_size=16)
    seen_max = []

    def check(cache):
        for g in cache.groups():
            assert g.length <= g.capacity
        seen_max.append(max(cache.lengths()))

    _, cache = stream_logits(engine, ids, check=check)
    # decoding evicts lazily: at most capacity + block at every step, exactly capacity after an eviction
    settled: list[int] = []
    step = cache_module.evict_step

    def spy(target, *args):  # a group, or every layer's group of a stack at once
        out = step(target, *args)
        settled.append(target.length)
        return out

    monkeypatch.setattr(cache_module, "evict_step", spy)
    monkeypatch.setattr(stacks_module, "evict_step", spy)
    logits = engine.step(cache, torch.tensor([5]), 1)

    def each_token(tok):
        for g in cache.groups():
            assert g.length <= g.capacity + 16

    ids_out, _ = engine.generate(cache, logits, 40, eos_ids=set(), on_token=each_token)
    assert settled and set(settled) == {budget}  # 40 decoded tokens pass the 16-token spare region
    for g in cache.groups():
        assert g.length <= g.capacity + 16
    assert cache.counters.max_cached <= budget
    assert cache.counters.max_stored <= budget + 16  # capacity + one block, never more
    assert cache.seen == ids.numel() + 1 + 39
    # a block after decoding first fills the spare region (and evicts), then fits
    engine.step(cache, torch.randint(0, VOCAB, (16,)), 1)
    for g in cache.groups():
        assert g.length <= g.capacity


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("policy", ["sink", "keydiff", "h2o", "tova", "snapkv+caote", "scissorhands+vatp"])
def test_outputs_after_eviction_equal_masking_reference(monkeypatch, family, policy):
    model = MODELS[family]()
    ids = torch.randint(0, VOCAB, (120,), generator=torch.Generator().manual_seed(4))
    visibility = record_visibility(monkeypatch)
    engine = make_engine(model, policy, 40, block_size=8, options={"window": "8"} if "snapkv" in policy else None)
    got, cache = stream_logits(engine, ids)
    assert cache.counters.evicted_tokens > 0
    ref = masking_reference_logits(model, ids, visibility)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("policy", ["sink", "keydiff", "h2o", "tova", "snapkv", "scissorhands", "tova+caote"])
def test_protected_tokens_are_never_evicted(policy):
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (200,), generator=torch.Generator().manual_seed(5))
    engine = make_engine(model, policy, 40, block_size=8, sinks=4, recent=8)

    def check(cache):
        end = cache.seen
        for g in cache.groups():
            pos = g.positions[:, : g.length]
            for h in range(pos.shape[0]):
                present = set(pos[h].tolist())
                assert {0, 1, 2, 3} <= present  # sinks
                assert set(range(end - 8, end)) <= present  # recent window

    stream_logits(engine, ids, check=check)


def test_pinned_question_survives_until_answer():
    model = tiny_llama()
    engine = make_engine(model, "tova", 40, block_size=8)
    cache = engine.new_cache()
    doc = torch.randint(0, VOCAB, (100,), generator=torch.Generator().manual_seed(6))
    engine.feed(cache, [doc], progress=False)
    question = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(7))
    start = cache.seen
    engine.pin(cache, question.numel())
    logits = engine.feed(cache, [question], progress=False)
    engine.generate(cache, logits, 6, eos_ids=set())
    for g in cache.groups():
        for h in range(g.num_heads):
            assert set(range(start, start + 20)) <= set(g.positions[h, : g.length].tolist())
    with pytest.raises(UsageError):
        engine.pin(cache, 39)


@pytest.mark.parametrize("policy", ["sink", "keydiff"])
def test_attention_free_policies_compute_no_probabilities(policy):
    model = tiny_llama()
    engine = make_engine(model, policy, 32, block_size=8)
    ids = torch.randint(0, VOCAB, (120,), generator=torch.Generator().manual_seed(8))
    _, cache = stream_logits(engine, ids)
    assert cache.counters.evicted_tokens > 0
    assert cache.counters.prob_rows == 0


def test_attention_policies_compute_only_rows_they_ask_for():
    model = tiny_llama()
    engine = make_engine(model, "tova", 32, block_size=8)
    ids = torch.randint(0, VOCAB, (64,), generator=torch.Generator().manual_seed(9))
    _, cache = stream_logits(engine, ids)
    # TOVA asks for one row per layer, and only on blocks that evict: 32 tokens fit, 4 blocks evict
    assert cache.counters.prob_rows == 1 * 2 * 4


def test_budget_validation():
    model = tiny_llama()
    with pytest.raises(UsageError):
        make_engine(model, "sink", 12, sinks=4, recent=8)
    with pytest.raises(UsageError):
        make_engine(model, "snapkv", 30)  # snapkv keeps its last 32 tokens: needs more
    with pytest.raises(UsageError):
        make_engine(model, "sink", 64, block_size=0)


def test_snapshot_restore_gives_identical_answers():
    model = tiny_llama()
    engine = make_engine(model, "h2o", 40, block_size=8)
    cache = engine.new_cache()
    engine.feed(cache, [torch.randint(0, VOCAB, (100,), generator=torch.Generator().manual_seed(10))], progress=False)
    snap = cache.snapshot()
    q = torch.tensor([3, 4, 5, 6])
    first = engine.feed(cache, [q], progress=False)
    a, _ = engine.generate(cache, first, 8, eos_ids=set())
    cache.restore(snap)
    second = engine.feed(cache, [q], progress=False)
    b, _ = engine.generate(cache, second, 8, eos_ids=set())
    torch.testing.assert_close(first, second)
    assert a == b


@pytest.mark.parametrize("policy,budget", [("full", None), ("h2o", 32)])
def test_a_cache_is_freed_with_its_last_reference(policy, budget):
    """No reference cycle runs through a cache: it goes when its last reference does, not whenever Python's
    cyclic GC happens to run (a dense cache is hundreds of MB; an eval of 30 dense 8K reads grew to 15 GB)."""
    import gc
    import weakref

    engine = make_engine(tiny_llama(), policy, budget)
    cache = engine.new_cache()
    engine.feed(cache, [torch.randint(0, 100, (80,), generator=torch.Generator().manual_seed(0))], progress=False)
    engine.generate(cache, engine.feed(cache, [torch.tensor([1, 2, 3])], progress=False), 4, eos_ids=set())
    gone = weakref.ref(cache)
    gc.disable()
    try:
        del cache
        assert gone() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("fused", [False, True])
def test_h2o_in_chunks_and_from_sdpa_equals_the_one_pass(monkeypatch, fused):
    """A GPU-sized block scores H2O's probabilities a few rows at a time (``probs_chunk_rows``), and on CUDA takes
    the output from SDPA (``BoundedCache.fused_output``): both forced here on the CPU, the logits, H2O's
    accumulated attention and what each head keeps equal the one-pass path's."""
    from kvtool.core import attention

    model = tiny_qwen2()
    ids = torch.randint(0, VOCAB, (160,), generator=torch.Generator().manual_seed(11))

    def run(chunk_rows, fused_output):
        monkeypatch.setattr(attention, "probs_chunk_rows", chunk_rows)
        engine = make_engine(model, "h2o", 48, block_size=32)
        cache = engine.new_cache()
        cache.fused_output = fused_output
        logits, _ = stream_logits(engine, ids, cache)
        g = cache.layers[-1].groups[0]
        return logits, g.state[0, :, : g.length].clone(), g.positions[:, : g.length].clone(), cache

    ref_logits, ref_acc, ref_pos, _ = run(attention.probs_chunk_rows, False)
    logits, acc, pos, cache = run(lambda heads, keys: 5, fused)  # 32-row blocks in chunks of 5 rows
    assert cache.counters.evicted_tokens > 0
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(acc, ref_acc, atol=1e-5, rtol=1e-5)
    assert torch.equal(pos, ref_pos)
