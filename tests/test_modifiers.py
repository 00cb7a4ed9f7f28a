"""Score modifiers: VATP (eq. 4), CAOTE (eq. 8, 21, 22, App. B) and FastCAOTE (eq. 23).

Pure tensor tests: a stub base policy returns given scores, contexts are built by hand, and every
closed form is checked against a brute-force eviction (remove tokens, renormalise the row, compare
the attention outputs).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import Tensor

from kvtool.core.contract import REGISTRY, Policy, PolicyEnv, ScoreContext, keep_top, normalise
from kvtool.errors import UsageError
from kvtool.policies.modifiers.caote import CAOTE, greedy_evict, joint_eviction_error
from kvtool.policies.modifiers.fastcaote import FastCAOTE
from kvtool.policies.modifiers.vatp import VATP
from kvtool.policies.spec import _construct
from tests.helpers import token_state

F64 = torch.float64


class StubBase(Policy):
    """An attention-based base policy that returns fixed scores."""

    name = "stub"

    def __init__(self, scores: Tensor) -> None:
        self.scores = scores

    def query_rows(self, block_len: int) -> int:
        return 1

    def score(self, ctx: ScoreContext) -> Tensor:
        return self.scores


def make_ctx(
    values: Tensor,
    capacity: int | None = None,
    protected: Tensor | None = None,
    first_pos: int = 0,
    policy: Policy | None = None,
):
    """A context over ``values``; with ``policy``, its per-token constants in the state, as the cache has them."""
    h, n, d = values.shape
    positions = (torch.arange(n) + first_pos).expand(h, n).clone()
    keys = torch.zeros(h, n, d, dtype=values.dtype)
    return ScoreContext(
        layer_idx=0,
        heads=list(range(h)),
        keys=keys,
        values=values,
        positions=positions,
        query_positions=positions[0, -1:].clone(),
        probs=None,
        state={} if policy is None else token_state(policy, keys, values),
        protected=torch.zeros(h, n, dtype=torch.bool) if protected is None else protected,
        capacity=n if capacity is None else capacity,
        block_len=1,
    )


def random_case(gen: torch.Generator, h: int, n: int, d: int, temp: float = 2.0) -> tuple[Tensor, Tensor]:
    """Attention rows (softmax of random logits) and random values, float64."""
    alpha = torch.softmax(temp * torch.randn(h, n, generator=gen, dtype=F64), dim=-1)
    values = torch.randn(h, n, d, generator=gen, dtype=F64)
    return alpha, values


def output_after_evicting(alpha: Tensor, values: Tensor, evicted: list[int]) -> Tensor:
    """Brute force for one head: drop ``evicted``, renormalise the row, recompute ``Σ α'_i v_i``."""
    keep = torch.ones(alpha.shape[-1], dtype=torch.bool)
    keep[evicted] = False
    a = alpha[keep] / alpha[keep].sum()
    return a @ values[keep]


def brute_joint_error(alpha: Tensor, values: Tensor, evicted: list[int]) -> float:
    """``‖X − X''‖₂`` for one head, by actually evicting the set."""
    return float(torch.linalg.vector_norm(alpha @ values - output_after_evicting(alpha, values, evicted)))


# -- CAOTE (eq. 8, 21, 22) ------------------------------------------------------------------------


def test_caote_closed_form_is_the_eviction_error():
    """Theorem 3.2: c_j equals the output change when j alone is evicted and the row renormalised."""
    gen = torch.Generator().manual_seed(0)
    h, n, d = 3, 12, 8
    alpha, values = random_case(gen, h, n, d)
    caote = CAOTE(base=StubBase(alpha))
    c = caote.modify(make_ctx(values), alpha)
    assert c.shape == (h, n) and c.dtype == F64
    for k in range(h):
        brute = torch.tensor([brute_joint_error(alpha[k], values[k], [j]) for j in range(n)], dtype=F64)
        torch.testing.assert_close(c[k], brute, rtol=1e-10, atol=1e-12)
    # End to end through Modifier.score (float32, as the engine calls it).
    torch.testing.assert_close(caote.score(make_ctx(values.float())), c.float(), rtol=1e-4, atol=1e-6)


def test_caote_normalises_base_scores():
    """Eq. 22: H2O-like scores (sums > 1) are divided by their sum; a constant factor changes nothing."""
    gen = torch.Generator().manual_seed(1)
    h, n, d = 2, 10, 6
    rows = torch.softmax(torch.randn(h, 5, n, generator=gen, dtype=F64), dim=-1)
    h2o = rows.sum(dim=1)  # accumulated attention: each head sums to 5
    values = torch.randn(h, n, d, generator=gen, dtype=F64)
    ctx = make_ctx(values)
    c = CAOTE(base=StubBase(h2o)).modify(ctx, h2o)

    hn = h2o / h2o.sum(dim=-1, keepdim=True)
    x = torch.einsum("hn,hnd->hd", hn, values)
    expected = hn / (1 - hn) * torch.linalg.vector_norm(x[:, None, :] - values, dim=-1)
    torch.testing.assert_close(c, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(CAOTE(base=StubBase(h2o)).modify(ctx, 7.3 * h2o), c, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(normalise(h2o).sum(-1), torch.ones(h, dtype=F64))


def test_caote_guards_a_token_holding_all_the_mass():
    values = torch.randn(1, 5, 4, dtype=F64, generator=torch.Generator().manual_seed(2))
    alpha = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0]], dtype=F64)
    c = CAOTE(base=StubBase(alpha)).modify(make_ctx(values), alpha)
    assert not torch.isnan(c).any()
    assert torch.isposinf(c[0, 1]) and (c[0, [0, 2, 3, 4]] == 0).all()


def test_caote_default_select_is_top_capacity_of_the_score():
    gen = torch.Generator().manual_seed(3)
    alpha, values = random_case(gen, 2, 10, 4)
    alpha, values = alpha.float(), values.float()
    protected = torch.zeros(2, 10, dtype=torch.bool)
    protected[:, 0] = True
    ctx = make_ctx(values, capacity=6, protected=protected)
    caote = CAOTE(base=StubBase(alpha))
    kept = caote.select(ctx)
    torch.testing.assert_close(kept, keep_top(caote.score(ctx), protected, 6))
    assert (kept[:, 0] == 0).all()


# -- FastCAOTE (eq. 23) -----------------------------------------------------------------------


def test_fastcaote_matches_eq23_by_brute_force():
    gen = torch.Generator().manual_seed(4)
    h, n, d = 2, 9, 5
    base = torch.rand(h, n, generator=gen, dtype=F64) * 3  # not normalised
    values = torch.randn(h, n, d, generator=gen, dtype=F64)
    c = FastCAOTE(base=StubBase(base)).modify(make_ctx(values), base)
    for k in range(h):
        hk = base[k] / base[k].sum()
        mean = sum(values[k, i] for i in range(n)) / n
        for j in range(n):
            expected = hk[j] / (1 - hk[j]) * torch.linalg.vector_norm(mean - values[k, j])
            assert float(c[k, j]) == pytest.approx(float(expected), rel=1e-12, abs=1e-14)
    assert FastCAOTE.modify is CAOTE.modify  # one shared implementation, only the centre differs


# -- VATP (eq. 4) ---------------------------------------------------------------------------------


def test_vatp_is_score_times_l1_norm_and_keeps_the_first_tokens():
    gen = torch.Generator().manual_seed(5)
    h, n, d = 2, 10, 4
    scores = torch.rand(h, n, generator=gen, dtype=F64)
    values = torch.randn(h, n, d, generator=gen, dtype=F64)
    values[:, :3] *= 1e-6  # sink tokens: tiny value norms
    vatp = VATP(base=StubBase(scores), first=3)
    ctx = make_ctx(values, capacity=5, policy=vatp)
    out = vatp.modify(ctx, scores)
    torch.testing.assert_close(out, scores * values.abs().sum(-1), rtol=1e-6, atol=0)  # ‖v‖₁ kept in float32
    first = vatp.extra_protected(ctx)
    assert first[:, :3].all() and not first[:, 3:].any()
    ctx.protected = ctx.protected | first  # what the engine does before select
    kept = vatp.select(ctx)
    assert (kept[:, :3] == torch.arange(3)).all()  # kept although their score × norm is tiny

    # F defaults to the engine's sink count, 4 without an environment; positions are absolute.
    env = PolicyEnv(num_layers=1, num_kv_heads=h, num_attention_heads=h, head_dim=d, budget=5, sinks=2)
    with_env = VATP(base=StubBase(scores))
    with_env.env = env
    assert with_env.extra_protected(ctx).sum(-1).tolist() == [2, 2]
    assert VATP(base=StubBase(scores)).extra_protected(ctx).sum(-1).tolist() == [4, 4]
    later = make_ctx(values, first_pos=100, policy=vatp)
    assert not VATP(base=StubBase(scores)).extra_protected(later).any()


def test_vatp_below_caote_keeps_its_first_tokens_and_gives_no_nan():
    gen = torch.Generator().manual_seed(6)
    alpha, values = random_case(gen, 2, 10, 4)
    stacked = CAOTE(base=VATP(base=StubBase(alpha.float()), first=2))
    ctx = make_ctx(values.float(), capacity=5, policy=stacked)
    c = stacked.score(ctx)
    assert torch.isfinite(c).all()  # VATP protects through extra_protected, not +inf scores
    ctx.protected = ctx.protected | stacked.extra_protected(ctx)
    assert (stacked.select(ctx)[:, :2] == torch.arange(2)).all()
    stacked.greedy = True
    assert (stacked.select(ctx)[:, :2] == torch.arange(2)).all()


# -- greedy joint eviction (App. B, eq. 24–31) -----------------------------------------------------


def test_joint_eviction_error_is_eq31():
    gen = torch.Generator().manual_seed(7)
    alpha, values = random_case(gen, 1, 10, 6)
    for evicted in ([3], [0, 5], [1, 2, 9], [4, 6, 7, 8]):
        got = joint_eviction_error(alpha[0], values[0], torch.tensor(evicted))
        assert float(got) == pytest.approx(brute_joint_error(alpha[0], values[0], evicted), rel=1e-10)
    # batched form agrees with the per-head one
    alpha, values = random_case(gen, 4, 10, 6)
    sets = torch.stack([torch.randperm(10, generator=gen)[:3] for _ in range(4)])
    batched = joint_eviction_error(alpha, values, sets)
    for k in range(4):
        assert float(batched[k]) == pytest.approx(brute_joint_error(alpha[k], values[k], sets[k].tolist()), rel=1e-10)


@pytest.mark.parametrize("objective", ["step", "joint"])
def test_greedy_reports_the_joint_error_of_its_set(objective):
    gen = torch.Generator().manual_seed(8)
    alpha, values = random_case(gen, 6, 16, 8)
    evicted, joint = greedy_evict(alpha, values, 5, objective=objective)
    assert evicted.shape == (6, 5)
    for k in range(6):
        assert len(set(evicted[k].tolist())) == 5
        assert float(joint[k]) == pytest.approx(brute_joint_error(alpha[k], values[k], evicted[k].tolist()), rel=1e-9)


@pytest.mark.parametrize("objective", ["step", "joint"])
def test_greedy_single_eviction_is_the_exhaustive_optimum(objective):
    gen = torch.Generator().manual_seed(9)
    alpha, values = random_case(gen, 8, 12, 6)
    evicted, joint = greedy_evict(alpha, values, 1, objective=objective)
    independent = CAOTE(base=StubBase(alpha)).modify(make_ctx(values), alpha).argmin(-1)
    assert evicted[:, 0].tolist() == independent.tolist()
    for k in range(8):
        errors = [brute_joint_error(alpha[k], values[k], [j]) for j in range(12)]
        assert int(evicted[k, 0]) == min(range(12), key=errors.__getitem__)
        assert float(joint[k]) == pytest.approx(min(errors), rel=1e-10)


@pytest.mark.parametrize("objective", ["step", "joint"])
@pytest.mark.parametrize("m", [2, 3])
def test_greedy_against_exhaustive_search(m, objective):
    gen = torch.Generator().manual_seed(10 + m)
    h, n = 20, 8
    alpha, values = random_case(gen, h, n, 4)
    _, joint = greedy_evict(alpha, values, m, objective=objective)
    subsets = torch.tensor(list(itertools.combinations(range(n), m)))  # [C, m]
    best = torch.stack(
        [
            joint_eviction_error(alpha[k].expand(len(subsets), n), values[k].expand(len(subsets), n, 4), subsets).min()
            for k in range(h)
        ]
    )
    assert (joint >= best * (1 - 1e-9)).all()
    optimal = int((joint <= best * (1 + 1e-9)).sum())
    print(
        f"\n[greedy {objective}, n={n}, m={m}] optimal in {optimal}/{h} cases; "
        f"mean greedy/optimum error ratio {float((joint / best).mean()):.4f}"
    )


def test_greedy_beats_independent_selection_on_average():
    gen = torch.Generator().manual_seed(12)
    cases, n, m, d = 200, 24, 6, 8
    alpha, values = random_case(gen, cases, n, d)  # one case per "head": the greedy is vectorised over heads
    c = CAOTE(base=StubBase(alpha)).modify(make_ctx(values), alpha)
    independent = joint_eviction_error(alpha, values, c.topk(m, dim=-1, largest=False).indices)
    _, step = greedy_evict(alpha, values, m, objective="step")
    _, joint = greedy_evict(alpha, values, m, objective="joint")
    print(
        f"\n[{cases} cases, n={n}, m={m}] mean eq. 31 error: independent {float(independent.mean()):.6f}, "
        f"greedy step {float(step.mean()):.6f}, greedy joint {float(joint.mean()):.6f}; "
        f"greedy step <= independent in {int((step <= independent * (1 + 1e-12)).sum())}/{cases}"
    )
    assert step.mean() <= independent.mean()
    assert joint.mean() <= independent.mean()


def brute_greedy(alpha: Tensor, values: Tensor, m: int, objective: str) -> list[int]:
    """App. B literally, for one head: at each step evict the token whose removal (row renormalised,
    output recomputed from the tokens left) changes the current output least ("step") or moves the
    output furthest from the original least ("joint")."""
    evicted: list[int] = []
    x = alpha @ values
    for _ in range(m):
        current = output_after_evicting(alpha, values, evicted)
        best, best_err = -1, float("inf")
        for j in range(alpha.shape[-1]):
            if j in evicted:
                continue
            after = output_after_evicting(alpha, values, [*evicted, j])
            err = float(torch.linalg.vector_norm((current if objective == "step" else x) - after))
            if err < best_err:
                best, best_err = j, err
        evicted.append(best)
    return evicted


@pytest.mark.parametrize("objective", ["step", "joint"])
def test_greedy_equals_the_literal_step_by_step_eviction(objective):
    """The closed forms (eq. 27, and the expanded "joint" objective) pick the same tokens, in the
    same order, as evicting and recomputing the output at every step."""
    gen = torch.Generator().manual_seed(21)
    h, n, d, m = 5, 14, 6, 9
    alpha, values = random_case(gen, h, n, d)
    evicted, _ = greedy_evict(alpha, values, m, objective=objective)
    for k in range(h):
        assert evicted[k].tolist() == brute_greedy(alpha[k], values[k], m, objective)


def test_greedy_never_evicts_protected_tokens():
    gen = torch.Generator().manual_seed(13)
    h, n, d = 4, 12, 4
    alpha, values = random_case(gen, h, n, d)
    protected = torch.rand(h, n, generator=gen) < 0.4
    # make protected tokens the cheapest to evict, so an unguarded greedy would take them
    alpha = torch.where(protected, alpha * 1e-6, alpha)
    alpha = alpha / alpha.sum(-1, keepdim=True)
    m = int(n - protected.sum(-1).max())  # every head still has enough unprotected tokens
    for objective in ("step", "joint"):
        evicted, _ = greedy_evict(alpha, values, m, protected, objective=objective)
        assert not protected.gather(1, evicted).any()

    capacity = n - m
    caote = CAOTE(base=StubBase(alpha.float()), greedy=True)
    ctx = make_ctx(values.float(), capacity=capacity, protected=protected)
    kept = caote.select(ctx)
    assert kept.shape == (h, capacity)
    assert (kept[:, 1:] > kept[:, :-1]).all()  # sorted, distinct
    assert protected.gather(1, kept).sum(-1).tolist() == protected.sum(-1).tolist()
    assert list(caote.last_joint_error) == [ctx.layer_idx] and caote.last_joint_error[ctx.layer_idx].shape == (h,)
    # the recorded error is eq. 31 for the complement of what was kept
    evicted = torch.stack([torch.tensor(sorted(set(range(n)) - set(kept[k].tolist()))) for k in range(h)])
    torch.testing.assert_close(
        caote.last_joint_error[ctx.layer_idx],
        joint_eviction_error(normalise(alpha.float()), values.float(), evicted),
        rtol=1e-4,
        atol=1e-6,
    )


# -- factory compatibility ------------------------------------------------------------------------


def test_modifiers_are_registered_and_built_from_options():
    assert {"vatp", "caote", "fastcaote"} <= set(REGISTRY.modifiers)
    stub = StubBase(torch.ones(1, 1))
    used: set[str] = set()
    caote = _construct(CAOTE, {"caote.greedy": "true", "objective": "joint"}, used, "caote", base=stub)
    assert caote.greedy is True and caote.objective == "joint" and caote.base is stub
    assert used == {"caote.greedy", "objective"}
    assert caote.options() == {"caote.greedy": True, "caote.objective": "joint"}
    assert caote.spec == "stub+caote"
    with pytest.raises(UsageError):
        _construct(CAOTE, {"objective": "best"}, set(), "caote", base=stub)
    assert _construct(VATP, {"vatp.first": "20"}, set(), "vatp", base=stub).first == 20
    assert _construct(FastCAOTE, {}, set(), "fastcaote", base=stub).options() == {}
