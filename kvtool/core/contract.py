"""The policy contract: what a policy needs, the per-token state it keeps, and the score it returns.

The engine never imports a concrete policy. It asks a policy three things:

* which of the block's query rows it needs attention probabilities for (``query_rows``); the
  attention function computes those rows only, and none at all when the answer is 0;
* how to lay out each layer's KV heads (``layer_groups``): uniform policies use one group of all
  heads with capacity = budget; RazorAttention splits heads into groups of different capacities;
* a score per (KV head, token) for the tokens of a group (``score``); the engine keeps the top
  ``capacity`` tokens (protected tokens always kept) and gathers K, V, positions and per-token
  state in one pass.

Running per-token state (e.g. H2O's accumulated attention) is declared in ``state_fields`` and
lives in the cache next to K/V, so eviction gathers it and ``.kvc`` files save it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor


@dataclass
class ScoreContext:
    """Everything a policy may look at for one (layer, head group) at one step.

    Shapes use ``h`` = KV heads in the group, ``n`` = tokens stored in the group *including* the
    block just appended (the block is the last ``m`` tokens), ``r`` = query rows requested.
    """

    layer_idx: int
    heads: list[int]  # KV head indices (within the layer) of this group
    keys: Tensor  # [h, n, d], stored post-RoPE keys
    values: Tensor  # [h, n, d]
    positions: Tensor  # [h, n] int64, original position of each token in the stream
    query_positions: Tensor  # [m] int64, original positions of the block's queries
    probs: Tensor | None  # [h, r, n] float32 attention probs of the block's last r query rows,
    #                        averaged over the query heads sharing each KV head (engine GQA rule)
    state: dict[str, Tensor]  # name -> [h, n] float32 per-token state (views: in-place updates persist)
    # [h, n] bool, tokens the engine always keeps (sinks, recent, pinned); None on a step that only observes
    # (``observe`` without eviction: nothing is selected, so no protection is built)
    protected: Tensor | None
    capacity: int  # tokens the group keeps after eviction
    block_len: int  # m
    seen: int = 0  # tokens seen before this block (position counter)
    # [h, n] int64 rank among protected tokens when they exceed the capacity (higher kept first:
    # sinks, then the pinned question and recalled tokens, then recent, then the policy's own)
    priority: Tensor | None = None

    @property
    def n(self) -> int:
        return self.keys.shape[1]

    @property
    def n_evict(self) -> int:
        """How many tokens this step removes (0 when the group is within capacity)."""
        return max(0, self.n - self.capacity)


@dataclass
class GroupSpec:
    """A set of KV heads of one layer that share a capacity and a scoring policy.

    ``capacity`` is in tokens per head (``None``: unbounded, the dense reference). With
    ``compensation`` the group also holds one compensation token per head (RazorAttention eq. 4),
    which counts as one token of the capacity promise. ``window``: the group belongs to a
    sliding-window layer (see ``core/families.py``): queries see only keys less than ``window``
    positions back, and the attention function masks by that distance.
    """

    heads: list[int]
    capacity: int | None
    policy: Policy
    compensation: bool = False
    window: int | None = None


@dataclass
class PolicyEnv:
    """What a policy may know about the run when it is built."""

    num_layers: int
    num_kv_heads: int
    num_attention_heads: int
    head_dim: int
    budget: int | None
    block_size: int = 128
    sinks: int = 4
    recent: int = 8
    # Returns the retrieval-head map (layer -> list of KV heads); used by RazorAttention only.
    retrieval_heads: Callable[[], dict[int, list[int]]] | None = None


class Policy:
    """Base class: one file per subclass under ``kvtool/policies/``.

    Subclasses set ``name``, ``description``, ``paper`` and override ``score``; attention-based
    policies also override ``query_rows``. Options are dataclass fields (set from
    ``--policy-opt key=value`` and profiles).
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    is_modifier: ClassVar[bool] = False
    #: per-token float32 state kept in the cache and gathered on eviction (read it on the instance:
    #: a policy may compute it from its options, as Scissorhands does)
    state_fields: ClassVar[tuple[str, ...]] = ()
    #: True if ``observe`` must run on every block (running statistics), not only when evicting
    observe_every_step: ClassVar[bool] = False
    #: True if ``observe`` is tensor work on ``probs`` and ``state`` alone (no host value such as ``seen``, no
    #: slicing by one): the fixed-shape decode step (``kvtool/core/decode_step.py``) then runs it over every slot,
    #: unfilled ones with probability 0, inside a captured graph. A policy that observes and leaves this False
    #: decodes with the eager step
    observe_fixed: ClassVar[bool] = False
    #: True if ``layer_groups`` lays out heads itself (RazorAttention's retrieval/other groups); a modifier
    #: may wrap such a base only if it forwards the layout (``Modifier.forwards_layout``)
    own_layout: ClassVar[bool] = False
    #: True if ``score`` reads the probabilities only summed over their rows (``probs.sum(dim=1)``), so the
    #: engine may hand it the row sums ([h, 1, n]) instead of every row
    rows_summed: ClassVar[bool] = False
    #: True if ``score``/``select`` treat every head alone and never depend on the layer: the engine may then
    #: score every layer of a layout at once at the end of a block, heads of all layers flattened
    #: (``[layers · h, n]``), with ``layer_idx`` −1
    batchable: ClassVar[bool] = True

    env: PolicyEnv | None = None

    # -- what the policy needs -------------------------------------------------------------
    def query_rows(self, block_len: int) -> int:
        """Number of the block's *last* query rows whose attention probabilities are needed."""
        return 0

    def score_rows(self, block_len: int) -> int:
        """Rows of ``ctx.probs`` that ``score``/``select`` read when the block evicts: those of ``query_rows``,
        unless ``observe`` consumed them already on every block (running state: none are read later)."""
        return 0 if self.observe_every_step else self.query_rows(block_len)

    @property
    def needs_attention(self) -> bool:
        """Whether this policy ever asks for attention probabilities."""
        return self.query_rows(128) > 0

    def protected_recent(self, capacity: int) -> int:
        """Extra most-recent tokens this policy always keeps (on top of the engine's window)."""
        return 0

    def score_slot_bytes(self, head_dim: int) -> int:
        """Bytes per (KV head, stored token) that ``score``/``select`` allocate beyond one float32 score and a few
        masks (``core/costs.py``'s ``SCORE_SLOT_BYTES``, which the engine's part of an eviction fits in): a policy
        that works over each token's value vector says so here. The eviction's chunks and the memory plan add it."""
        return 0

    def extra_protected(self, ctx: ScoreContext) -> Tensor | None:
        """Tokens this policy always keeps beyond the engine's set ([h, n] bool), e.g. VATP's first F.

        The engine ORs this into ``ctx.protected`` before ``select``, so modifiers stacked on top see
        them as protected instead of as +inf scores they would have to special-case.
        """
        return None

    def layer_groups(self, layer_idx: int, env: PolicyEnv) -> list[GroupSpec]:
        """Head layout of one layer: by default one group of all KV heads at the budget."""
        return [GroupSpec(heads=list(range(env.num_kv_heads)), capacity=env.budget, policy=self)]

    # -- running state and score -------------------------------------------------------------
    def constants(self, keys: Tensor, values: Tensor) -> dict[str, Tensor]:
        """Per-token constants of tokens being stored: ``[h, m, d]`` keys/values → {field: ``[h, m]``}.

        For quantities of a token's own key or value that never change (KeyDiff's inverse key norm,
        VATP's ‖v‖₁): computed once when the token is appended (or recalled), kept in a
        ``state_fields`` entry and gathered with it, instead of recomputed over the whole cache at every
        eviction. Fields not returned start at 0 (running state).
        """
        return {}

    def observe(self, ctx: ScoreContext) -> None:
        """Update running per-token state from this block (called before ``score``).

        A policy with ``observe_every_step`` observes right after the layer's attention, on every block,
        through a context holding ``probs``, ``state``, ``positions``, ``seen`` and ``block_len`` only: its
        ``keys``, ``values`` and ``protected`` are empty there (they are for ``score`` and ``select``).
        """

    def score(self, ctx: ScoreContext) -> Tensor:
        """Return a fresh [h, n] tensor of retention scores: higher is kept.

        Protected tokens need no special care. Never return a state tensor itself: modifiers may
        edit the score in place. ``select`` is only called when the group exceeds its capacity.
        """
        raise NotImplementedError

    def select(self, ctx: ScoreContext) -> Tensor:
        """Return [h, capacity] sorted indices of the tokens to keep.

        Default: top-``capacity`` of ``score`` with protected tokens forced in. Policies whose
        choice is not a fixed ranking (CAOTE's greedy joint eviction) override this.
        """
        assert ctx.protected is not None, "select runs only on evicting steps, which carry the protection"
        return keep_top(self.score(ctx).float(), ctx.protected, ctx.capacity, ctx.priority)

    # -- persistence of non-per-token state -----------------------------------------------------
    def options(self) -> dict[str, Any]:
        """The policy's options, for stats, metadata and ``.kvc`` files."""
        from dataclasses import fields, is_dataclass

        if not is_dataclass(self):
            return {}
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name in ("base", "env") or f.name.startswith("_"):
                continue
            out[f.name] = getattr(self, f.name)
        return out

    @property
    def spec(self) -> str:
        return self.name


class Modifier(Policy):
    """A policy that transforms the score of a base policy (VATP, CAOTE, FastCAOTE).

    Everything but the score is delegated to the base, so a modifier works with any
    attention-based base and its running state.
    """

    is_modifier = True
    base: Policy
    #: True if this modifier keeps its base's head layout (and may wrap an ``own_layout`` base)
    forwards_layout: ClassVar[bool] = False
    #: the base a bare ``--policy <modifier>`` applies to (the modifier paper's own setting)
    default_base: ClassVar[str] = "tova"

    #: this modifier's own per-token state fields, after its base's
    own_fields: ClassVar[tuple[str, ...]] = ()

    @property
    def state_fields(self) -> tuple[str, ...]:  # type: ignore[override]
        base = tuple(self.base.state_fields)
        return base + tuple(f for f in self.own_fields if f not in base)

    @property
    def observe_every_step(self) -> bool:  # type: ignore[override]
        return self.base.observe_every_step

    @property
    def observe_fixed(self) -> bool:  # type: ignore[override]
        return self.base.observe_fixed and type(self).observe is Modifier.observe

    @property
    def own_layout(self) -> bool:  # type: ignore[override]
        return self.forwards_layout and self.base.own_layout

    @property
    def rows_summed(self) -> bool:  # type: ignore[override]
        return self.base.rows_summed

    @property
    def batchable(self) -> bool:  # type: ignore[override]
        return self.base.batchable

    def score_rows(self, block_len: int) -> int:
        return self.base.score_rows(block_len)

    def layer_groups(self, layer_idx: int, env: PolicyEnv) -> list[GroupSpec]:
        if self.forwards_layout:
            return self.base.layer_groups(layer_idx, env)
        return super().layer_groups(layer_idx, env)

    def query_rows(self, block_len: int) -> int:
        return self.base.query_rows(block_len)

    def protected_recent(self, capacity: int) -> int:
        return self.base.protected_recent(capacity)

    def score_slot_bytes(self, head_dim: int) -> int:
        return self.base.score_slot_bytes(head_dim) + self.own_slot_bytes(head_dim)

    def own_slot_bytes(self, head_dim: int) -> int:
        """This modifier's own ``score_slot_bytes``."""
        return 0

    def observe(self, ctx: ScoreContext) -> None:
        self.base.observe(ctx)

    def constants(self, keys: Tensor, values: Tensor) -> dict[str, Tensor]:
        return {**self.base.constants(keys, values), **self.own_constants(keys, values)}

    def own_constants(self, keys: Tensor, values: Tensor) -> dict[str, Tensor]:
        """This modifier's own per-token constants (named in ``own_fields``)."""
        return {}

    def extra_protected(self, ctx: ScoreContext) -> Tensor | None:
        return self.base.extra_protected(ctx)

    def score(self, ctx: ScoreContext) -> Tensor:
        return self.modify(ctx, self.base.score(ctx).float())

    def modify(self, ctx: ScoreContext, scores: Tensor) -> Tensor:
        raise NotImplementedError

    def options(self) -> dict[str, Any]:
        return {**self.base.options(), **{f"{self.name}.{k}": v for k, v in super().options().items()}}

    @property
    def spec(self) -> str:
        return f"{self.base.spec}+{self.name}"


#: what a protected token's int64 key adds to its priority: every key of an unprotected token's score is below it
PROTECTED_KEY = 1 << 31


def keep_top(scores: Tensor, protected: Tensor, capacity: int, priority: Tensor | None = None) -> Tensor:
    """Indices [h, capacity], ascending, of the protected tokens plus the best-scored others.

    ``priority`` ([h, n] int32 or int64, distinct per head among protected tokens) orders the protected tokens
    when more of them than ``capacity`` exist, so which are kept is defined (the same on every device) rather
    than topk's tie-break among equal +inf keys. Every token then gets one exact int64 key: a float32 score's
    bits turned into an int32 of the same order (-0.0 made +0.0 first: the two tie, as floats do; nan one below
    -inf), a protected token ``PROTECTED_KEY`` + its priority, above every score (+inf included): no float64
    copies, and the order (ties included) of the float64 keys this replaced.
    """
    if priority is None:
        keys = torch.nan_to_num(scores.masked_fill(protected, float("inf")), nan=float("-inf"), posinf=float("inf"))
    else:
        keys = _keyed(scores.float(), protected, priority)
    del scores  # the caller's own copy when it handed its score over (``Policy.select``): gone before the top-k
    idx = torch.topk(keys, capacity, dim=-1, sorted=False).indices
    del keys
    return torch.sort(idx, dim=-1).values


def _keyed(scores: Tensor, protected: Tensor, priority: Tensor) -> Tensor:
    """int64 keys: a protected token's priority above every score, nan scores (e.g. 0/0) "least worth keeping",
    never keep-me (``keep_top``)."""
    bits = torch.nan_to_num(scores, nan=-math.inf, posinf=math.inf, neginf=-math.inf).add_(0.0).view(torch.int32)
    bits ^= (bits >> 31) & 0x7FFFFFFF  # negative floats' bits count down: flip them to count up
    bits -= scores.isnan().view(torch.uint8)  # nan one below -inf (the int32 keys below -inf's are free)
    keys = priority.long().add_(PROTECTED_KEY)
    return torch.where(protected, keys, bits, out=keys)


def normalise(scores: Tensor, eps: float = 1e-12) -> Tensor:
    """Scale non-negative scores per head to sum to one (CAOTE eq. 22)."""
    scores = scores.clamp_min(0)
    return scores / scores.sum(dim=-1, keepdim=True).clamp_min(eps)


@dataclass
class _Registry:
    bases: dict[str, type[Policy]] = field(default_factory=dict)
    modifiers: dict[str, type[Modifier]] = field(default_factory=dict)


REGISTRY = _Registry()


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy available to ``--policy`` by its ``name``."""
    table = REGISTRY.modifiers if cls.is_modifier else REGISTRY.bases
    table[cls.name] = cls  # type: ignore[assignment]
    return cls
