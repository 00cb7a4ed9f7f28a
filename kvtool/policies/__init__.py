"""The policies: one file per base policy, modifiers/ and razor/; the registry and the spec parser.

Adding a policy is one new file with a ``@register``-ed class plus its import line below; neither the
engine nor the parser changes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvtool.core.contract import (
    REGISTRY,
    GroupSpec,
    Modifier,
    Policy,
    PolicyEnv,
    ScoreContext,
    keep_top,
    register,
)
from kvtool.policies import full, h2o, keydiff, scissorhands, sink, snapkv, tova  # noqa: F401 - registers
from kvtool.policies.modifiers import caote, fastcaote, vatp  # noqa: F401 - registers
from kvtool.policies.razor import policy as _razor  # noqa: F401 - registers
from kvtool.policies.spec import build_policy, check_policy

__all__ = [
    "REGISTRY",
    "GroupSpec",
    "Modifier",
    "Policy",
    "PolicyEnv",
    "ScoreContext",
    "build_policy",
    "check_policy",
    "describe_policies",
    "keep_top",
    "register",
]


def describe_policies() -> list[dict[str, Any]]:
    """One entry per base and modifier: name, kind, description, paper, needs attention, options."""
    rows = []
    for kind, table in (("base", REGISTRY.bases), ("modifier", REGISTRY.modifiers)):
        for name in sorted(table):
            cls = table[name]
            if cls.is_modifier:
                needs = True
                opts = {f.name: f.default for f in dataclasses.fields(cls) if f.name not in ("base", "env")}
            else:
                inst = cls()
                needs = inst.needs_attention
                opts = inst.options()
            rows.append(
                {
                    "name": name,
                    "kind": kind,
                    "description": cls.description,
                    "paper": cls.paper,
                    "needs_attention": needs,
                    "options": {k: v for k, v in opts.items() if not callable(v)},
                }
            )
    return rows
