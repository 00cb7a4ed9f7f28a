"""``razor``: RazorAttention — full-ish cache for retrieval heads, sinks + window + compensation for the rest."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from kvtool.core.contract import GroupSpec, Policy, PolicyEnv, ScoreContext, register
from kvtool.errors import KvtoolError, UsageError
from kvtool.policies.sink import Sink
from kvtool.policies.spec import build_policy


@register
@dataclass
class Razor(Policy):
    """RazorAttention (Tang et al.), Algorithm 1 under a strict per-head budget.

    Retrieval heads (top ``induction`` ∪ top ``echo`` fraction of query heads by the random-repeat
    probe of §3.3, mapped to KV heads by the GQA rule of §4.1.1; see ``kvtool.policies.razor.calibrate``) keep as
    many tokens as the budget allows; the other heads keep the ``sinks`` first tokens, the most
    recent ``window`` tokens and one compensation token (eq. 4: mean K and V of everything they
    dropped, attended with weight N_d as in eq. 5).

    Budget: a layer holds ``B × Hkv`` tokens (``B`` = per-head budget). Non-retrieval heads cost
    ``c_n = sinks + window + 1`` (the GroupSpec capacity is ``sinks + window`` with
    ``compensation=True``: the cache's promise is capacity + 1 per compensated head). Retrieval heads
    share the rest: ``c_r = floor((B·Hkv − n_non·c_n) / n_ret)``; the floor remainder (< n_ret
    tokens) is unused. ``window`` defaults to ``min(max(64, budget // 4), budget // 2)`` (room for a
    question, a quarter of the budget, never more than half). A layer without
    retrieval heads gives every head ``B − 1`` tokens + compensation (window ``B − sinks − 1``); a
    layer of only retrieval heads gives each ``B``. ``c_r < c_n`` (i.e. ``B < sinks + window + 1``)
    is a usage error. Inside retrieval heads tokens are evicted by the ``fallback`` policy (KeyDiff
    by default); the non-retrieval heads rank by position (StreamingLLM), the engine protects sinks.

    The head map comes from ``env.retrieval_heads()`` (the session runs or loads the calibration).
    If that callable accepts ``induction_frac``/``echo_frac`` keywords (or ``**kwargs``) it is given
    this policy's ``induction``/``echo`` options.
    """

    own_layout = True
    name = "razor"
    description = "RazorAttention: retrieval heads keep most of the budget; others sinks+window+compensation"
    paper = "Tang et al. 2024, RazorAttention: Efficient KV Cache Compression Through Retrieval Heads"

    induction: float = 0.14
    echo: float = 0.01
    window: int | None = None
    fallback: str = "keydiff"

    _heads: dict[int, list[int]] | None = field(default=None, init=False, repr=False, compare=False)
    _fallback_policy: Policy | None = field(default=None, init=False, repr=False, compare=False)
    _other_policy: Policy | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for key, frac in (("induction", self.induction), ("echo", self.echo)):
            if not 0.0 <= frac <= 1.0:
                raise UsageError(f"razor option {key}={frac} must be between 0 and 1")
        if self.window is not None and self.window < 1:
            raise UsageError(f"razor option window={self.window} must be >= 1")
        if self.fallback.strip().lower().split("+")[0] == self.name:
            raise UsageError("razor option fallback cannot be razor itself")

    # -- the policies of the groups ----------------------------------------------------------------
    def _env(self, env: PolicyEnv | None = None) -> PolicyEnv:
        env = self.env if self.env is not None else env
        if env is None:
            raise KvtoolError("razor needs calibration: no run environment was given to the policy")
        return env

    def fallback_policy(self, env: PolicyEnv | None = None) -> Policy:
        """The policy that evicts inside retrieval heads (built on first use)."""
        if self._fallback_policy is None:
            self._fallback_policy = build_policy(self.fallback, {}, self._env(env))
        return self._fallback_policy

    def other_policy(self, env: PolicyEnv | None = None) -> Policy:
        """Position scorer of the non-retrieval heads (newest kept; sinks protected by the engine)."""
        if self._other_policy is None:
            self._other_policy = Sink()
            self._other_policy.env = self._env(env)
        return self._other_policy

    def query_rows(self, block_len: int) -> int:
        # Attention-free with the default (KeyDiff) fallback; an attention-based fallback needs rows.
        if self.env is None:
            return 0
        return self.fallback_policy().query_rows(block_len)

    # -- head map ----------------------------------------------------------------------------------
    def retrieval_heads(self, env: PolicyEnv | None = None) -> dict[int, list[int]]:
        """Layer → sorted retrieval KV heads (from the calibration; cached after the first call)."""
        if self._heads is None:
            e = self._env(env)
            fn = e.retrieval_heads
            if fn is None:
                raise KvtoolError("razor needs calibration: the session gave no retrieval-head map")
            heads = fn(**self._calibration_kwargs(fn))
            if heads is None:
                raise KvtoolError("razor needs calibration: the retrieval-head map is empty")
            out: dict[int, list[int]] = {}
            for layer, hs in dict(heads).items():
                kv = sorted({int(h) for h in hs})
                if any(h < 0 or h >= e.num_kv_heads for h in kv):
                    raise KvtoolError(
                        f"razor: calibration lists KV heads {kv} for layer {layer} but the model has "
                        f"{e.num_kv_heads}; recalibrate"
                    )
                out[int(layer)] = kv
            self._heads = out
        return self._heads

    def _calibration_kwargs(self, fn: Any) -> dict[str, Any]:
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            return {}
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return {"induction_frac": self.induction, "echo_frac": self.echo}
        return {k: v for k, v in (("induction_frac", self.induction), ("echo_frac", self.echo)) if k in params}

    # -- layout ------------------------------------------------------------------------------------
    def _window(self, env: PolicyEnv) -> int:
        assert env.budget is not None
        return self.window if self.window is not None else min(max(64, env.budget // 4), env.budget // 2)

    def _split(self, layer_idx: int, env: PolicyEnv) -> dict[str, Any]:
        B = env.budget
        if B is None:
            raise UsageError("razor needs a KV budget: it splits B × KV heads tokens per layer", field="budget")
        hkv = env.num_kv_heads
        ret = [h for h in self.retrieval_heads(env).get(layer_idx, []) if h < hkv]
        other = [h for h in range(hkv) if h not in ret]
        sinks = env.sinks
        if not ret:
            window = B - sinks - 1
            if window < 1:
                raise UsageError(
                    f"razor: budget {B} is too small: a head needs sinks ({sinks}) + a window of at least 1 "
                    f"+ 1 compensation token; use a budget >= {sinks + 2}"
                )
            c_n, c_r = B, 0
        elif not other:
            window, c_n, c_r = 0, 0, B
        else:
            window = self._window(env)
            c_n = sinks + window + 1
            c_r = (B * hkv - len(other) * c_n) // len(ret)
            if c_r < c_n:  # equivalent to B < c_n
                how = "window" if self.window is not None else "window = min(max(64, budget // 4), budget // 2)"
                raise UsageError(
                    f"razor: budget {B} is too small to split layer {layer_idx}: non-retrieval heads need "
                    f"sinks ({sinks}) + {how} ({window}) + 1 compensation = {c_n} tokens and retrieval heads at "
                    f"least as many; use a budget >= {c_n} (or a smaller razor window)"
                )
        total = len(ret) * c_r + len(other) * c_n
        unused = B * hkv - total
        assert 0 <= unused < max(1, len(ret)), (unused, B, hkv, c_r, c_n)
        return {
            "layer": layer_idx,
            "retrieval_heads": ret,
            "retrieval_capacity": c_r if ret else 0,
            "other_heads": other,
            "other_capacity": c_n if other else 0,  # includes the compensation token
            "sinks": sinks if other else 0,
            "window": window if other else 0,
            "total_tokens": total,
            "budget_tokens": B * hkv,
            "unused_tokens": unused,
        }

    def layer_groups(self, layer_idx: int, env: PolicyEnv) -> list[GroupSpec]:
        """Retrieval group first (fallback policy), then the compensated sink+window group."""
        s = self._split(layer_idx, env)
        groups: list[GroupSpec] = []
        if s["retrieval_heads"]:
            groups.append(
                GroupSpec(
                    heads=s["retrieval_heads"], capacity=s["retrieval_capacity"], policy=self.fallback_policy(env)
                )
            )
        if s["other_heads"]:
            # capacity excludes the compensation slot; the cache adds it (promise: capacity + 1).
            groups.append(
                GroupSpec(
                    heads=s["other_heads"],
                    capacity=s["other_capacity"] - 1,
                    policy=self.other_policy(env),
                    compensation=True,
                )
            )
        return groups

    def budget_split(self, env: PolicyEnv | None = None) -> list[dict[str, Any]]:
        """Per layer: heads and capacities of both groups, tokens used, the budget and the unused floor remainder."""
        e = self._env(env)
        return [self._split(layer, e) for layer in range(e.num_layers)]

    def score(self, ctx: ScoreContext) -> Tensor:  # never called: each group has its own policy
        raise AssertionError("razor scores through its groups' policies (fallback / sink)")
