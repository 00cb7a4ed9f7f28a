"""Policy scores against brute-force float64 references built from the papers' definitions.

Pure tensors, no model: a tiny stand-in for the engine streams random q/k through a policy block
by block (append, observe, select, gather K/positions/state) exactly as the contract describes.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvtool.policies import PolicyEnv, ScoreContext, build_policy, keep_top
from kvtool.policies.h2o import H2O
from kvtool.policies.keydiff import KeyDiff
from kvtool.policies.scissorhands import Scissorhands
from kvtool.policies.snapkv import SnapKV
from kvtool.policies.tova import TOVA
from tests.helpers import token_state

H, D = 2, 8
SINKS = 2


def qk(t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = 2.0 * torch.randn(H, t, D, generator=g)
    k = torch.randn(H, t, D, generator=g)
    return q, k


def dense(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[h, T, T] float64 causal attention of every query over every key (no eviction)."""
    q, k = q.double(), k.double()
    t = q.shape[1]
    logits = q @ k.transpose(1, 2) / math.sqrt(D)
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    return logits.masked_fill(mask, float("-inf")).softmax(-1)


def stream(policy, q, k, block, capacity, on_step=None):
    """Mini engine. Returns final positions, state, the last ctx and A: [h, T, T] float64, the
    probabilities the policy was given, placed at (query position, key position)."""
    h, t, d = k.shape
    pos = torch.empty(h, 0, dtype=torch.long)
    state = {f: torch.zeros(h, 0) for f in policy.state_fields}
    seen = torch.zeros(h, t, t, dtype=torch.float64)
    ctx = None
    for s in range(0, t, block):
        qp = torch.arange(s, min(s + block, t))
        m = len(qp)
        pos = torch.cat([pos, qp.expand(h, m)], 1)
        block_keys = k[:, qp]
        fresh = token_state(policy, block_keys, block_keys)  # values = keys in this mini engine
        state = {f: torch.cat([v, fresh[f]], 1) for f, v in state.items()}
        n = pos.shape[1]
        keys = torch.gather(k, 1, pos.unsqueeze(-1).expand(h, n, d))
        r = min(policy.query_rows(m), m)
        probs = None
        if r:
            rows = qp[-r:]
            logits = q[:, rows] @ keys.transpose(1, 2) / math.sqrt(d)
            probs = logits.masked_fill(pos[:, None, :] > rows[None, :, None], float("-inf")).softmax(-1)
            for i in range(h):
                seen[i, rows[:, None], pos[i][None, :]] = probs[i].double()
        protected = pos < SINKS
        recent = policy.protected_recent(capacity)
        if recent:
            protected[:, -recent:] = True
        ctx = ScoreContext(
            layer_idx=0,
            heads=list(range(h)),
            keys=keys,
            values=keys,
            positions=pos,
            query_positions=qp,
            probs=probs,
            state=state,
            protected=protected,
            capacity=capacity,
            block_len=m,
            seen=s,
        )
        evict = n > capacity
        if policy.observe_every_step or evict:
            policy.observe(ctx)
        if on_step is not None:
            on_step(ctx, seen)
        if evict:
            idx = policy.select(ctx)
            assert idx.shape == (h, capacity)
            assert bool((idx[:, 1:] > idx[:, :-1]).all()), "indices sorted, unique"
            assert bool(torch.gather(protected, 1, idx).sum() == protected.sum()), "protected kept"
            pos = torch.gather(pos, 1, idx)
            state = {f: torch.gather(v, 1, idx) for f, v in state.items()}
    return pos, state, ctx, seen


# -- H2O -----------------------------------------------------------------------------------------
def test_h2o_running_sums_equal_dense_column_sums():
    q, k = qk(40)
    pos, state, _, _ = stream(H2O(), q, k, block=7, capacity=10_000)
    assert torch.equal(pos, torch.arange(40).expand(H, 40))
    ref = dense(q, k).sum(dim=1)  # column sums over all queries: VATP eq. 2 at t = T-1
    torch.testing.assert_close(state["acc"].double(), ref, rtol=1e-5, atol=1e-5)


def test_h2o_kept_tokens_keep_their_sums_after_eviction():
    q, k = qk(60, seed=1)
    policy = H2O()
    pos, state, ctx, seen = stream(policy, q, k, block=8, capacity=16)
    assert pos.shape == (H, 16)
    assert bool((pos[:, -8:] == torch.arange(52, 60)).all()), "recent_ratio*capacity newest kept"
    # each kept token's sum is every attention it received since it was appended, evictions included
    ref = torch.stack([seen[i, :, pos[i]].sum(dim=0) for i in range(H)])
    torch.testing.assert_close(state["acc"].double(), ref, rtol=1e-5, atol=1e-5)
    # score is a copy: editing it (as a modifier might) leaves the running sums alone
    before = ctx.state["acc"].clone()
    policy.score(ctx).mul_(0)
    assert torch.equal(ctx.state["acc"], before)


def test_h2o_protected_recent_ratio():
    assert H2O().protected_recent(100) == 50
    assert H2O(recent_ratio=0.25).protected_recent(10) == 2
    assert H2O().query_rows(37) == 37 and H2O.observe_every_step


# -- TOVA ----------------------------------------------------------------------------------------
def test_tova_is_dense_last_row():
    q, k = qk(30, seed=2)
    policy = TOVA()
    assert policy.query_rows(128) == 1
    _, _, ctx, _ = stream(policy, q, k, block=8, capacity=10_000)
    assert ctx.probs.shape == (H, 1, 30)
    torch.testing.assert_close(policy.score(ctx).double(), dense(q, k)[:, -1, :], rtol=1e-5, atol=1e-6)


# -- SnapKV --------------------------------------------------------------------------------------
def _pool_by_hand(x: torch.Tensor, kernel: int) -> torch.Tensor:
    """Average over the existing neighbours within kernel//2 (padding not counted)."""
    half = kernel // 2
    out = torch.empty_like(x)
    for j in range(x.shape[-1]):
        lo, hi = max(0, j - half), min(x.shape[-1], j + half + 1)
        out[..., j] = x[..., lo:hi].sum(-1) / (hi - lo)
    return out


@pytest.mark.parametrize(("window", "block"), [(5, 12), (16, 12)])
def test_snapkv_is_pooled_sum_of_last_window_rows(window, block):
    t = 40
    q, k = qk(t, seed=3)
    policy = SnapKV(window=window)
    _, _, ctx, _ = stream(policy, q, k, block=block, capacity=10_000)
    m = ctx.block_len
    rows = min(window, m)
    assert ctx.probs.shape[1] == rows and policy.protected_recent(64) == window
    summed = dense(q, k)[:, t - rows :, :].sum(dim=1)
    cut = t - window
    ref = summed.clone()
    ref[:, :cut] = _pool_by_hand(summed[:, :cut], 7)
    torch.testing.assert_close(policy.score(ctx).double(), ref, rtol=1e-5, atol=1e-6)


def test_snapkv_kernel_one_is_plain_sum_and_even_kernel_rejected():
    q, k = qk(20, seed=4)
    policy = SnapKV(window=4, kernel=1)
    _, _, ctx, _ = stream(policy, q, k, block=10, capacity=10_000)
    torch.testing.assert_close(policy.score(ctx).double(), dense(q, k)[:, -4:, :].sum(1), rtol=1e-5, atol=1e-6)
    with pytest.raises(Exception, match="odd"):
        SnapKV(kernel=4)


# -- Scissorhands --------------------------------------------------------------------------------
def _bucket_rule_queries(t_last: int, g: int, buckets: int) -> list[int]:
    newest = t_last // g
    return [j for j in range(t_last + 1) if j // g > newest - buckets]


@pytest.mark.parametrize(("block", "capacity"), [(5, 10_000), (5, 12), (20, 12), (3, 12)])
def test_scissorhands_equals_bucket_rule(block, capacity):
    window, buckets, t = 12, 4, 61
    g = 3
    policy = Scissorhands(window=window, buckets=buckets, local=3)
    assert policy.bucket_size == g and policy.state_fields == ("b0", "b1", "b2", "b3")
    checked = {"steps": 0, "aligned": 0}

    def check(ctx, seen):
        t_last = int(ctx.query_positions[-1])
        queries = _bucket_rule_queries(t_last, g, buckets)
        if t_last + 1 >= window:  # enough history: (G-1)g < Q <= Gg, here = window when aligned
            assert (buckets - 1) * g < len(queries) <= buckets * g
        if (t_last + 1) % g == 0 and t_last + 1 >= window:
            assert queries == list(range(t_last + 1 - window, t_last + 1)), "aligned: exactly the last w"
            checked["aligned"] += 1
        ref = torch.stack([seen[i, queries][:, ctx.positions[i]].sum(dim=0) for i in range(H)])
        torch.testing.assert_close(policy.score(ctx).double(), ref, rtol=1e-5, atol=1e-5)
        checked["steps"] += 1

    q, k = qk(t, seed=5)
    stream(policy, q, k, block=block, capacity=capacity, on_step=check)
    assert checked["steps"] == math.ceil(t / block)
    if block == 3:
        assert checked["aligned"] > 0


def test_scissorhands_no_eviction_matches_dense_and_exact_window_when_g_is_1():
    window, t = 6, 25
    policy = Scissorhands(window=window, buckets=window, local=2)  # g = 1: VATP eq. 3 exactly
    q, k = qk(t, seed=6)
    _, _, ctx, _ = stream(policy, q, k, block=4, capacity=10_000)
    ref = dense(q, k)[:, t - window :, :].sum(dim=1)
    torch.testing.assert_close(policy.score(ctx).double(), ref, rtol=1e-5, atol=1e-5)


def test_scissorhands_memory_is_g_floats_per_token():
    shapes = []
    for t in (30, 120):
        policy = Scissorhands(window=12, buckets=4, local=3)
        q, k = qk(t, seed=7)
        pos, state, _, _ = stream(policy, q, k, block=6, capacity=12)
        shapes.append({f: tuple(v.shape) for f, v in state.items()})
        assert pos.shape == (H, 12)
    assert shapes[0] == shapes[1] == {f"b{i}": (H, 12) for i in range(4)}


# -- KeyDiff -------------------------------------------------------------------------------------
def test_keydiff_topk_equals_eq8_and_needs_no_probs():
    g = torch.Generator().manual_seed(8)
    n, cap = 50, 17
    keys = (torch.randn(H, n, D, generator=g) + 0.7).to(torch.float16)  # shared direction, half storage
    policy = KeyDiff()
    assert policy.query_rows(128) == 0 and not policy.needs_attention
    ctx = ScoreContext(
        layer_idx=0,
        heads=list(range(H)),
        keys=keys,
        values=keys,
        positions=torch.arange(n).expand(H, n),
        query_positions=torch.arange(n - 8, n),
        probs=None,
        state=token_state(policy, keys, keys),
        protected=torch.zeros(H, n, dtype=torch.bool),
        capacity=cap,
        block_len=8,
    )
    k64 = keys.double()
    unit = k64 / k64.norm(dim=-1, keepdim=True)
    anchor = unit.mean(dim=1, keepdim=True)
    ref = -(unit * anchor).sum(-1) / anchor.norm(dim=-1)  # s_i = -CosSim(mu(K_hat), k_i)
    score = policy.score(ctx)
    assert score.dtype == torch.float32
    torch.testing.assert_close(score.double(), ref, rtol=1e-5, atol=1e-5)
    want = torch.sort(torch.topk(ref, cap, dim=-1).indices, dim=-1).values
    assert torch.equal(policy.select(ctx), want)


def test_keydiff_streams_without_attention():
    q, k = qk(40, seed=9)
    pos, _, ctx, _ = stream(KeyDiff(), q, k, block=8, capacity=12)
    assert ctx.probs is None and pos.shape == (H, 12)
    assert bool((pos < SINKS).sum(dim=1).eq(SINKS).all())


# -- keep_top and registry -----------------------------------------------------------------------
def test_keep_top_forces_protected_and_sorts():
    scores = torch.tensor([[5.0, 1.0, float("nan"), 4.0, 0.5, 3.0], [0.0, 9.0, 8.0, 7.0, 6.0, float("nan")]])
    protected = torch.tensor([[False, True, False, False, True, False], [True, False, False, False, False, True]])
    idx = keep_top(scores, protected, 4)
    assert idx.tolist() == [[0, 1, 3, 4], [0, 1, 2, 5]]
    none = torch.zeros(1, 3, dtype=torch.bool)
    assert keep_top(torch.tensor([[1.0, float("nan"), 0.0]]), none, 2).tolist() == [[0, 2]]


def test_registry_builds_each_policy_with_options():
    env = PolicyEnv(num_layers=1, num_kv_heads=H, num_attention_heads=H, head_dim=D, budget=64)
    sc = build_policy("scissorhands", {"buckets": "5", "window": "20"}, env)
    assert sc.state_fields == tuple(f"b{i}" for i in range(5)) and sc.bucket_size == 4
    assert build_policy("snapkv", {"window": "16"}, env).query_rows(128) == 16
    assert build_policy("h2o", {"recent_ratio": "0.25"}, env).protected_recent(64) == 16
    assert build_policy("tova", {}, env).needs_attention
    assert not build_policy("keydiff", {}, env).needs_attention
