"""Parse ``--policy base+modifier(k=v)+...`` into a policy object (the registry lives in core.contract).

This module knows no concrete policy: ``kvtool/policies/__init__.py`` imports every policy module,
whose ``@register`` fills the registry before anything is parsed.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

from kvtool.core.contract import REGISTRY, Policy, PolicyEnv
from kvtool.errors import UsageError, shown
from kvtool.policy_syntax import split_spec

#: the largest integer a policy option may hold (a window, a count): a policy checks its own, tighter range
MAX_OPTION = 2**40


def _valid_list() -> str:
    return f"bases: {', '.join(sorted(REGISTRY.bases))}; modifiers: {', '.join(sorted(REGISTRY.modifiers))}"


def _convert(value: Any, target: Any, key: str) -> Any:
    """Turn a CLI/profile string into the option's declared type."""
    if not isinstance(value, str):
        return value
    origin = typing.get_origin(target)
    args = [a for a in typing.get_args(target) if a is not type(None)]
    if origin is not None and args:
        target = args[0]
    try:
        if target is bool:
            low = value.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if target is int:
            number = int(value)
            if abs(number) > MAX_OPTION:
                raise UsageError(f"policy option {key}={shown(value)} is out of range (at most {MAX_OPTION:,})")
            return number
        if target is float:
            real = float(value)
            if not math.isfinite(real):
                raise ValueError(value)
            return real
    except ValueError:
        raise UsageError(f"policy option {key}={shown(value)} is not a valid {target.__name__}") from None
    return value


def _construct(cls: type[Policy], opts: dict[str, Any], used: set[str], prefix: str, **extra: Any) -> Policy:
    kwargs: dict[str, Any] = dict(extra)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else []:
        if f.name in ("base", "env") or f.name.startswith("_"):
            continue
        for key in (f"{prefix}.{f.name}", f.name):
            if key in opts:
                kwargs[f.name] = _convert(opts[key], hints.get(f.name, str), key)
                used.add(key)
                break
    return cls(**kwargs)


def build_policy(spec: str, options: dict[str, Any] | None, env: PolicyEnv) -> Policy:
    """Build ``base+mod+mod`` with options ``{"window": "32", "caote.greedy": "true"}``.

    Options may also sit inside the spec: ``tova+caote(greedy=true)`` (handy in lists of policies).

    An unprefixed option applies to every component that has it; ``name.option`` targets one.
    Unknown names, unknown options and modifiers on attention-free bases are usage errors.
    """
    options = dict(options or {})
    parts = []
    for name, inline in split_spec(spec):  # the grammar, shared with the torch-free check
        parts.append(name)
        options.update({f"{name}.{k}": v for k, v in inline.items()})
    if not parts:
        raise UsageError(f"empty policy; valid {_valid_list()}")
    if parts[0] in REGISTRY.modifiers:
        # a bare modifier means its paper's own setting, e.g. "caote" = "tova+caote" (CAOTE eq. 8 scores
        # with the newest query's attention, which is exactly TOVA's score)
        parts.insert(0, REGISTRY.modifiers[parts[0]].default_base)
    base_name, mod_names = parts[0], parts[1:]
    if base_name not in REGISTRY.bases:
        raise UsageError(f"unknown policy {base_name!r}; valid {_valid_list()}")
    used: set[str] = set()
    policy: Policy = _construct(REGISTRY.bases[base_name], options, used, base_name)
    policy.env = env
    for i, name in enumerate(mod_names):
        if name in REGISTRY.bases:
            raise UsageError(f"policy {spec!r} names two bases ({base_name!r} and {name!r}): one base per policy, "
                             "then modifiers")
        if name in mod_names[:i]:
            raise UsageError(f"modifier {name!r} appears twice in {spec!r}; each modifier may be applied once")
        if name not in REGISTRY.modifiers:
            raise UsageError(f"unknown modifier {name!r} in {spec!r}; valid {_valid_list()}")
        modifier = REGISTRY.modifiers[name]
        if policy.own_layout and not modifier.forwards_layout:
            raise UsageError(
                f"modifier {name!r} cannot wrap {policy.spec!r}: it lays out its own head groups, which {name!r} "
                f"would lose; put the modifier on its fallback instead (policy option fallback=h2o+{name})",
                field="policy_opt")
        if not policy.needs_attention:
            attn = sorted(n for n, c in REGISTRY.bases.items() if c().needs_attention)
            raise UsageError(
                f"modifier {name!r} needs attention scores but {policy.spec!r} is attention-free; "
                f"use it with one of: {', '.join(attn)}"
            )
        policy = _construct(modifier, options, used, name, base=policy)
        policy.env = env
    unknown = sorted(set(options) - used)
    if unknown:
        valid = sorted(_option_names(parts))
        raise UsageError(
            f"unknown policy option(s) {', '.join(unknown)} for {spec!r}; valid: {', '.join(valid) or 'none'}"
        )
    return policy


def check_policy(spec: str, options: dict[str, Any] | None) -> None:
    """Validate a policy spec and its options before any model is loaded (fast failure)."""
    build_policy(spec, options, PolicyEnv(num_layers=1, num_kv_heads=1, num_attention_heads=1, head_dim=2, budget=None))


def _option_names(parts: list[str]) -> set[str]:
    names: set[str] = set()
    for p in parts:
        cls = REGISTRY.bases.get(p) or REGISTRY.modifiers.get(p)
        if cls is not None and dataclasses.is_dataclass(cls):
            names |= {
                f.name for f in dataclasses.fields(cls) if f.name not in ("base", "env") and not f.name.startswith("_")
            }
    return names
