"""``caote``: CAOTE — rank tokens by the change of the attention output their eviction causes.

Also holds the code FastCAOTE (``fastcaote.py``) shares: the normalisation of a base score into
attention-like weights (eq. 22), the closed-form eviction error (eq. 8/21/23), the joint error of
evicting a set (eq. 31) and the greedy joint eviction of App. B.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvtool.core.contract import Modifier, Policy, ScoreContext, normalise, register
from kvtool.errors import UsageError

#: Guard for ``1 − α``: a token (or set) holding all but ``EPS`` of the mass is never cheap to evict.
EPS = 1e-6


def caote_weights(scores: Tensor) -> tuple[Tensor, Tensor]:
    """Base scores ``[h, n]`` -> (``α`` summing to one per head, eq. 22; ``forced`` bool mask).

    CAOTE needs weights that behave like one attention row (eq. 20–21); any non-negative score can
    be mapped there by dividing by its sum without changing its order (eq. 22; e.g. H2O's
    accumulated scores sum to more than one). A +inf score is another modifier's "always keep"
    (VATP's first tokens): such tokens get weight 0 here and are reported in ``forced`` so the
    caller keeps them. NaN counts as 0 (least worth keeping, as in ``keep_top``).
    """
    forced = torch.isposinf(scores)
    clean = torch.nan_to_num(scores.masked_fill(forced, 0.0), nan=0.0, posinf=0.0, neginf=0.0)
    return normalise(clean), forced


def attention_output(alpha: Tensor, values: Tensor) -> Tensor:
    """``X_attn = V Aᵀ`` (eq. 10): ``[..., n]`` weights and ``[..., n, d]`` values -> ``[..., d]``."""
    return torch.einsum("...n,...nd->...d", alpha, values)


def mean_value(alpha: Tensor, values: Tensor) -> Tensor:
    """``(1/n) Σ v_i`` (eq. 23), FastCAOTE's stand-in for ``X_attn``; ``alpha`` is unused."""
    return values.mean(dim=-2)


def eviction_error(alpha: Tensor, values: Tensor, centre: Tensor, eps: float = EPS) -> Tensor:
    """``c_j = α_j / (1 − α_j) · ‖centre − v_j‖₂`` for every token (eq. 8, 21; eq. 23 with the mean).

    With ``centre = X_attn`` this is exactly ``‖X_attn − X'_attn,j‖₂``, the change of the output
    when token ``j`` is removed and the row renormalised (Theorem 3.1/3.2). ``1 − α_j`` is clamped
    at ``eps``; a token holding essentially all the mass (``1 − α_j ≤ eps``) gets +inf, since the
    output after its eviction is undefined (0/0) rather than unchanged.
    """
    rest = 1.0 - alpha
    dist = torch.linalg.vector_norm(centre.unsqueeze(-2) - values, dim=-1)
    err = alpha / rest.clamp_min(eps) * dist
    return err.masked_fill(rest <= eps, float("inf"))


def joint_eviction_error(alpha: Tensor, values: Tensor, evicted: Tensor, eps: float = EPS) -> Tensor:
    """Joint error of evicting a set of tokens at once (CAOTE App. B, eq. 31).

    ``c_[S] = 1 / (1 − Σ_S α_i) · ‖Σ_S α_i (X_attn − v_i)‖₂`` for ``alpha`` ``[n]``, ``values``
    ``[n, d]`` and ``evicted`` the indices of S. It equals ``‖X_attn − X''_attn,S‖₂`` with ``X''``
    the output after removing S and renormalising (eq. 26–27). Leading batch dimensions on all
    three arguments are allowed (``evicted`` ``[..., m]``). An empty set has error 0; a set holding
    all the mass (``1 − Σ_S α ≤ eps``) has error +inf.
    """
    x = attention_output(alpha, values)
    a = alpha.gather(-1, evicted)  # [..., m]
    v = values.gather(-2, evicted.unsqueeze(-1).expand(*evicted.shape, values.shape[-1]))  # [..., m, d]
    diff = torch.einsum("...m,...md->...d", a, x.unsqueeze(-2) - v)
    rest = 1.0 - a.sum(dim=-1)
    err = torch.linalg.vector_norm(diff, dim=-1) / rest.clamp_min(eps)
    return err.masked_fill(rest <= eps, float("inf"))


GREEDY_OBJECTIVES = ("step", "joint")


def greedy_evict(
    alpha: Tensor,
    values: Tensor,
    m: int,
    protected: Tensor | None = None,
    objective: str = "step",
    eps: float = EPS,
) -> tuple[Tensor, Tensor]:
    """Greedy joint eviction (CAOTE App. B, eq. 24–31), vectorised over heads.

    ``alpha`` ``[h, n]`` (rows sum to one), ``values`` ``[h, n, d]``, ``protected`` ``[h, n]``.
    Evicts ``m`` tokens one at a time, then updates the reduced output and weights,
    ``X' = (X' − α'_j v_j)/(1 − α'_j)`` and ``α'_i = α'_i/(1 − α'_j)`` (eq. 25–28), so later
    choices see the effect of earlier ones (independent selection does not). Each step picks the
    unprotected token with the smallest

    * ``objective="step"``: error *given the current (already reduced) output*,
      ``α'_j/(1 − α'_j)·‖X' − v_j‖₂`` = ``‖X' − X''_j‖₂`` (eq. 24, 28, 29 as written);
    * ``objective="joint"``: joint error of the evicted set grown by j, measured from the
      original output, ``‖Σ_{S∪j} α_i (X − v_i)‖₂ / (1 − Σ_{S∪j} α_i)`` (eq. 30–31). The paper
      presents eq. 30 as the closed form of eq. 29, but eq. 30/31 equal ``‖X − X''‖₂`` while eq. 29
      is ``‖X' − X''‖₂``; "joint" greedily minimises the quantity eq. 31 defines.

    The reduced state is kept in the equivalent closed form of eq. 27: with ``A = Σ α_i`` and
    ``D = Σ α_i v_i`` over the tokens evicted so far, ``α'_i = α_i/(1 − A)`` and
    ``X' = (X − D)/(1 − A)``, so no rounding accumulates over steps; eq. 31's sum is ``A·X − D``.

    "joint" is expanded into per-token scalars, so its step touches ``[h, n]`` vectors only, never
    an ``[h, n, d]`` tensor: with ``xv_j = X·v_j`` and ``‖X − v_j‖²`` computed once and ``dv_j = D·v_j``
    updated by one matrix-vector product per step (``dv += α_j V v_j``), and ``u = A·X − D``,
    ``‖u + α_j(X − v_j)‖² = ‖u‖² + 2α_j(u·X − A·xv_j + dv_j) + α_j²‖X − v_j‖²``, which is cheaper
    than forming the ``[h, n, d]`` difference every step. "step" keeps the direct ``‖X' − v_j‖₂`` over
    the values: its expansion (``‖X'‖² − 2X'·v_j + ‖v_j‖²``) needs one more product per step and so
    does not pay off; the step loop is sequential by nature, so what can shrink is the number and
    size of its kernels.

    Protected tokens are evicted only when a head has no other token left. Returns (``[h, m]``
    evicted indices in eviction order, ``[h]`` joint error of the evicted set, eq. 31).
    """
    if objective not in GREEDY_OBJECTIVES:
        raise ValueError(f"objective must be one of {GREEDY_OBJECTIVES}, not {objective!r}")
    h, n = alpha.shape
    if not 0 <= m <= n:
        raise ValueError(f"cannot evict {m} of {n} tokens")
    if protected is None:
        protected = torch.zeros_like(alpha, dtype=torch.bool)
    big = torch.finfo(alpha.dtype).max
    x = attention_output(alpha, values)  # [h, d]
    joint_terms = _joint_terms(alpha, values, x) if objective == "joint" else None
    tier = protected.to(alpha.dtype)  # 0 usable, 1 protected, 2 removed: the lowest tier present is eligible
    mass = alpha.new_zeros(h, 1)  # A
    taken = torch.zeros_like(x)  # D
    order = torch.empty(h, m, dtype=torch.long, device=alpha.device)
    for step in range(m):
        err = _candidate_errors(alpha, values, x, mass, taken, joint_terms, eps)
        j = _pick_next(err, tier, big)  # [h, 1]
        a_j = alpha.gather(1, j)  # [h, 1]
        v_j = values.gather(1, j.unsqueeze(-1).expand(h, 1, values.shape[-1]))  # [h, 1, d]
        mass = mass + a_j
        taken = taken + a_j * v_j[:, 0]
        if joint_terms is not None:
            xv, far, dv = joint_terms
            joint_terms = (xv, far, dv + a_j * (values @ v_j.transpose(1, 2)).squeeze(-1))
        tier.scatter_(1, j, 2.0)
        order[:, step : step + 1] = j
    rest = 1.0 - mass[:, 0]
    joint = torch.linalg.vector_norm(mass * x - taken, dim=-1) / rest.clamp_min(eps)
    joint = joint.masked_fill(rest <= eps, float("inf"))  # eq. 31: ‖Σ α_i (X − v_i)‖ / (1 − A)
    return order, joint


def _joint_terms(alpha: Tensor, values: Tensor, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The per-token scalars of the "joint" expansion: ``X·v_j``, ``‖X − v_j‖²`` and ``D·v_j`` (zero)."""
    xv = (values @ x.unsqueeze(-1)).squeeze(-1)  # [h, n]: X·v_j
    far = (x * x).sum(-1, keepdim=True) - 2.0 * xv + (values * values).sum(-1)  # ‖X − v_j‖²
    return xv, far, torch.zeros_like(alpha)  # D·v_j


def _candidate_errors(
    alpha: Tensor,
    values: Tensor,
    x: Tensor,
    mass: Tensor,
    taken: Tensor,
    joint_terms: tuple[Tensor, Tensor, Tensor] | None,
    eps: float,
) -> Tensor:
    """``[h, n]`` error of evicting each token next, given ``A`` (``mass``) and ``D`` (``taken``) so far.

    Without ``joint_terms`` the "step" error ``α'_j / (1 − α'_j) · ‖X' − v_j‖``; with them the
    "joint" error of the evicted set grown by j. A token whose eviction would leave no mass is +inf.
    """
    rest = 1.0 - mass  # [h, 1], mass left after the evictions so far
    left = rest - alpha  # 1 − A − α_j = (1 − A)(1 − α'_j)
    if joint_terms is None:
        current = (x - taken) / rest.clamp_min(eps)  # X'
        dist = torch.linalg.vector_norm(current.unsqueeze(-2) - values, dim=-1)
        err = alpha / left.clamp_min(eps) * dist  # α'_j / (1 − α'_j) · ‖X' − v_j‖
    else:
        xv, far, dv = joint_terms
        u = mass * x - taken  # Σ_S α_i (X − v_i)
        sq = (u * u).sum(-1, keepdim=True) + 2.0 * alpha * ((u * x).sum(-1, keepdim=True) - mass * xv + dv)
        err = sq.addcmul_(alpha * alpha, far).clamp_min_(0.0).sqrt_() / left.clamp_min(eps)
    return err.masked_fill(left <= eps, float("inf"))


def _pick_next(err: Tensor, tier: Tensor, big: float) -> Tensor:
    """``[h, 1]`` index of the token to evict next in each head: the smallest error in the lowest tier.

    Finite errors rank first, then +inf ones (still valid), never a removed token; unprotected tokens
    are preferred, protected ones taken only when nothing else is left.
    """
    err = torch.nan_to_num(err, nan=-big, posinf=big)
    usable = tier == tier.amin(dim=-1, keepdim=True)
    return err.masked_fill_(~usable, float("inf")).argmin(dim=-1, keepdim=True)


@dataclass
class OutputErrorModifier(Modifier):
    """Shared body of CAOTE and FastCAOTE: normalise the base score (eq. 22) and return the
    closed-form eviction error ``α_j/(1 − α_j)·‖centre − v_j‖₂`` as the retention score (larger
    error = more worth keeping). Subclasses choose ``centre`` (``X_attn`` or the mean value)."""

    base: Policy | None = None

    def centre(self, alpha: Tensor, values: Tensor) -> Tensor:
        raise NotImplementedError

    def weights(self, ctx: ScoreContext) -> tuple[Tensor, Tensor, Tensor]:
        """(``α`` ``[h, n]``, values ``[h, n, d]`` in ``α``'s dtype, forced-keep mask ``[h, n]``).

        Used by ``select`` overrides; keeps float64 base scores in float64 (``Modifier.score``
        casts to float32)."""
        scores = self.base.score(ctx)
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
        alpha, forced = caote_weights(scores)
        return alpha, ctx.values.to(alpha.dtype), forced

    def own_slot_bytes(self, head_dim: int) -> int:
        """The values in float32 (a copy from a 16-bit cache) and their distance to the centre: [h, n, d] each."""
        return 2 * 4 * head_dim

    def modify(self, ctx: ScoreContext, scores: Tensor) -> Tensor:
        alpha, forced = caote_weights(scores)
        values = ctx.values.to(alpha.dtype)  # no copy for float32 storage (the CPU default)
        err = eviction_error(alpha, values, self.centre(alpha, values))
        return err.masked_fill(forced, float("inf"))


@register
@dataclass
class CAOTE(OutputErrorModifier):
    """CAOTE (Goel et al., 2025): the retention score of token j is its eviction error.

    The base score is normalised per KV head to sum to one (eq. 22), giving ``h_j``; with
    ``X = V Hᵀ`` the score is ``c_j = h_j/(1 − h_j)·‖X − v_j‖₂`` (eq. 8, 21), which equals the
    change of the attention output when j alone is evicted and the row renormalised
    (Theorem 3.2). Tokens with the smallest error are evicted.

    Default: independent selection, the paper's choice for multi-token eviction (App. A): all
    ``n_evict`` tokens are ranked by their single-token error. ``greedy=true`` evicts one token
    at a time and updates the output and weights after each eviction (App. B eq. 24–28,
    ``greedy_evict``), which accounts for the interplay between evicted tokens; the joint error
    of the chosen set (eq. 31) is left in ``last_joint_error[layer_idx]`` (``[h]``, the layer's last
    ``select``; one policy object serves every layer, so one shared value would only tell the last layer's).
    ``objective`` picks what each greedy step minimises: ``step``, the error given the current
    reduced output (eq. 29), or ``joint``, the eq. 31 error of the grown set (see ``greedy_evict``).
    """

    greedy: bool = False
    objective: str = "step"

    name = "caote"
    description = "CAOTE: base score -> eviction error of the attention output (greedy=true: joint, App. B)"
    paper = "Goel et al. 2025, CAOTE: KV Caching through Attention Output Error based Token Eviction"


    @property
    def batchable(self) -> bool:  # type: ignore[override]
        """Greedy selection records each layer's joint error: it runs layer by layer."""
        return self.base.batchable and not self.greedy

    def __post_init__(self) -> None:
        # layer -> [h] eq. 31 error of that layer's last greedy selection (an attribute, not an option)
        self.last_joint_error: dict[int, Tensor] = {}
        if self.objective not in GREEDY_OBJECTIVES:
            raise UsageError(f"caote.objective must be one of {', '.join(GREEDY_OBJECTIVES)}, not {self.objective!r}")

    def centre(self, alpha: Tensor, values: Tensor) -> Tensor:
        return attention_output(alpha, values)

    def select(self, ctx: ScoreContext) -> Tensor:
        if not self.greedy:
            return super().select(ctx)
        n, m = ctx.n, ctx.n_evict
        h = ctx.values.shape[0]
        if m == 0:
            return torch.arange(n, device=ctx.values.device).expand(h, n)
        alpha, values, forced = self.weights(ctx)
        assert ctx.protected is not None  # select runs only on evicting steps, which carry the protection
        evicted, self.last_joint_error[ctx.layer_idx] = greedy_evict(alpha, values, m, ctx.protected | forced,
                                                                     self.objective)
        keep = torch.ones(h, n, dtype=torch.bool, device=alpha.device)
        keep.scatter_(1, evicted, False)
        # Exactly ``capacity`` kept per row: evicted slots sort to the end (no ``nonzero``, whose
        # size the host would have to read).
        idx = torch.arange(n, device=alpha.device).expand(h, n).masked_fill(~keep, n)
        return torch.sort(idx, dim=-1).values[:, : n - m]


__all__ = [
    "CAOTE",
    "EPS",
    "GREEDY_OBJECTIVES",
    "OutputErrorModifier",
    "attention_output",
    "caote_weights",
    "eviction_error",
    "greedy_evict",
    "joint_eviction_error",
    "mean_value",
]
