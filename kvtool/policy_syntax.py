"""The ``--policy`` spelling, checked without torch: ``base[+modifier...]`` with optional inline options.

The policies themselves (``kvtool.policies``) import torch, so a spec checked there costs the torch
import (seconds) before a typo is reported. This module knows the grammar and the names only, so the
CLI and the settings reject ``+caote``, ``snapkv++caote``, ``h2o+tova`` or ``h2oo`` in milliseconds;
:func:`kvtool.policies.build_policy` parses with the same :func:`split_spec` and then checks what
needs the policy classes (options, modifiers on attention-free bases).
"""

from __future__ import annotations

import re

from kvtool.errors import UsageError

#: every base policy's name (the registry in kvtool.policies must hold exactly these; a test checks it)
BASES = ("full", "h2o", "keydiff", "razor", "scissorhands", "sink", "snapkv", "tova")
#: every modifier's name
MODIFIERS = ("caote", "fastcaote", "vatp")

_COMPONENT = re.compile(r"\s*([A-Za-z0-9_]+)\s*(?:\((.*)\))?\s*")


def valid_list() -> str:
    """The names a spec may use, for error messages."""
    return f"bases: {', '.join(BASES)}; modifiers: {', '.join(MODIFIERS)}"


def split_component(part: str) -> tuple[str, dict[str, str]]:
    """``caote(greedy=true;objective=joint)`` → ("caote", {...}): options inside a spec, for lists of policies."""
    m = _COMPONENT.fullmatch(part)
    if m is None:
        raise UsageError(f"cannot parse policy component {part!r}: use name or name(key=value;key=value)")
    opts: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in (m.group(2) or "").split(";"))):
        if "=" not in item:
            raise UsageError(f"policy option {item!r} in {part!r} must be key=value")
        key, value = item.split("=", 1)
        opts[key.strip()] = value.strip()
    return m.group(1).lower(), opts


def split_spec(spec: str) -> list[tuple[str, dict[str, str]]]:
    """The components of ``base+mod(k=v)+...`` in order, each with its inline options (grammar only)."""
    if not spec.strip():
        raise UsageError(f"empty policy; valid {valid_list()}")
    parts = []
    for raw in (p.strip() for p in spec.split("+")):
        if not raw:
            raise UsageError(f"policy {spec!r} has an empty component (a stray '+'); write base+modifier+...")
        parts.append(split_component(raw))
    return parts


def check_spec(spec: str) -> None:
    """Grammar and names of a spec: known names, one base first (or a bare modifier), each modifier once."""
    names = [name for name, _ in split_spec(spec)]
    for i, name in enumerate(names):
        if name not in BASES and name not in MODIFIERS:
            kind = "policy" if i == 0 else "modifier"
            raise UsageError(f"unknown {kind} {name!r} in {spec!r}; valid {valid_list()}")
        if i and name in BASES:
            first = names[0]
            raise UsageError(f"policy {spec!r} names two bases ({first!r} and {name!r}): one base per policy, "
                             "then modifiers")
        if name in names[:i]:
            raise UsageError(f"modifier {name!r} appears twice in {spec!r}; each modifier may be applied once")
