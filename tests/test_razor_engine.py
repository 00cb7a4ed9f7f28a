"""RazorAttention inside the engine: per-head capacities, real memory savings, compensation token."""

from __future__ import annotations

import math

import pytest
import torch

from kvtool.core.attention import _block_mask, _probs
from kvtool.core.cache import HeadGroup
from kvtool.policies import GroupSpec
from kvtool.policies.sink import Sink
from tests.helpers import VOCAB, dense_logits, make_engine, stream_logits, tiny_llama, tiny_qwen2

HEADS = {0: [1], 1: [0]}  # layer -> retrieval KV heads (tiny models have 2 KV heads)


def razor(model, budget, block_size=8, positions="absolute", heads=HEADS, **opts):
    return make_engine(
        model,
        "razor",
        budget,
        block_size=block_size,
        positions=positions,
        options={k: str(v) for k, v in opts.items()},
        retrieval=lambda **_: heads,
    )


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2])
def test_razor_reproduces_dense_logits_when_budget_covers_document(make):
    model = make()
    ids = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(0))
    dense = dense_logits(model, ids)
    got, cache = stream_logits(razor(model, 128, window=100), ids)
    torch.testing.assert_close(got, dense, atol=1e-5, rtol=1e-5)
    assert cache.counters.evicted_tokens == 0


def test_per_head_capacities_hold_and_allocated_bytes_match_the_promise():
    model = tiny_llama()
    budget = 48
    engine = razor(model, budget, window=16)
    ids = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(1))

    def check(cache):
        for g in cache.groups():
            assert g.length <= g.capacity

    _, cache = stream_logits(engine, ids, check=check)
    groups = cache.groups()
    assert {len(g.heads) for g in groups} == {1}  # one retrieval + one compensated head per layer
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    per_token_head = 2 * head_dim * 4  # K+V float32
    promised = cache.promised_bytes()
    assert promised == budget * c.num_key_value_heads * c.num_hidden_layers * per_token_head
    # buffers hold the promised tokens plus one block of scratch per head, nothing more
    block_scratch = 8 * sum(g.num_heads for g in groups) * per_token_head
    assert cache.allocated_bytes() == promised + block_scratch
    retrieval = [g for g in groups if not g.compensation]
    other = [g for g in groups if g.compensation]
    assert all(g.capacity == 2 * budget - (4 + 16 + 1) for g in retrieval)
    assert all(g.capacity == 4 + 16 for g in other)
    assert all(g.comp_count > 0 for g in other)


def _comp_group(h=2, d=8, cap=6):
    spec = GroupSpec(heads=list(range(h)), capacity=cap, policy=Sink(), compensation=True)
    return HeadGroup(
        spec, num_kv_heads=h, q_per_kv=2, head_dim=d, block_size=4, dtype=torch.float64, device=torch.device("cpu")
    )


def test_compensation_attention_equals_eq5_by_brute_force():
    gen = torch.Generator().manual_seed(2)
    h, d = 2, 8
    g = _comp_group(h, d)
    keys = torch.randn(1, h, 10, d, generator=gen, dtype=torch.float64)
    values = torch.randn(1, h, 10, d, generator=gen, dtype=torch.float64)
    g.append(keys, values, torch.arange(10))
    keep = torch.tensor([[0, 1, 6, 7, 8, 9]] * h)
    dropped = [2, 3, 4, 5]
    g.gather(keep)
    assert g.comp_count == 4
    q = torch.randn(1, 2 * h, 1, d, generator=gen, dtype=torch.float64)
    k, v = g.kv()
    mask = _block_mask_for(g)
    p = _probs(q, k, mask, 1.0)  # [h, q_per_kv, 1, 1 + 6]
    out = (p.double().view(h, 2, 7) @ v[0]).view(2 * h, d)
    # eq. 5: N_d·exp(q·k̂)·v̂ + Σ_kept exp(q·k_n)·v_n over N_d·exp(q·k̂) + Σ_kept exp(q·k_n)
    for qh in range(2 * h):
        kv = qh // 2
        k_hat = keys[0, kv, dropped].mean(0)
        v_hat = values[0, kv, dropped].mean(0)
        kept = keep[kv]
        num = 4 * torch.exp(q[0, qh, 0] @ k_hat) * v_hat
        den = 4 * torch.exp(q[0, qh, 0] @ k_hat)
        for n in kept.tolist():
            w = torch.exp(q[0, qh, 0] @ keys[0, kv, n])
            num, den = num + w * values[0, kv, n], den + w
        torch.testing.assert_close(out[qh], num / den, atol=1e-5, rtol=1e-5)


def _block_mask_for(g: HeadGroup):
    class _Step:
        masks: dict = {}

    class _Cache:
        step = _Step()

    return _block_mask(_Cache(), 1, g.length, g.off, g.comp_bias(), torch.float64, torch.device("cpu"))


def test_compensation_is_exact_attention_when_nothing_was_dropped():
    gen = torch.Generator().manual_seed(3)
    g = _comp_group()
    keys = torch.randn(1, 2, 5, 8, generator=gen, dtype=torch.float64)
    values = torch.randn(1, 2, 5, 8, generator=gen, dtype=torch.float64)
    g.append(keys, values, torch.arange(5))
    assert g.comp_bias() == -math.inf
    q = torch.randn(1, 4, 1, 8, generator=gen, dtype=torch.float64)
    k, v = g.kv()
    p = _probs(q, k, _block_mask_for(g), 1.0)
    assert torch.all(p[..., 0] == 0)  # the empty compensation slot gets no weight
    exact = torch.softmax(q[0].view(2, 2, 8) @ keys[0].transpose(1, 2), -1)
    torch.testing.assert_close(p[..., 1:].view(2, 2, 5).double(), exact, atol=1e-6, rtol=1e-5)


def test_razor_with_compact_positions_and_decoding_stays_bounded():
    model = tiny_qwen2(max_positions=64)
    engine = razor(model, 40, positions="auto", window=12)
    ids = torch.randint(0, VOCAB, (200,), generator=torch.Generator().manual_seed(4))
    _, cache = stream_logits(engine, ids)
    logits = engine.step(cache, torch.tensor([1]), 1)
    engine.generate(cache, logits, 10, eos_ids=set())
    assert cache.compact
    for g in cache.groups():  # decoding evicts lazily: at most one block over capacity
        assert g.length <= g.capacity + engine.config.block_size
    assert cache.counters.max_cached <= max(g.capacity for g in cache.groups())
    assert int(cache.begin_step(1)[0]) < 64
