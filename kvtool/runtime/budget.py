"""Budgets and sizes as the user writes them: ``--budget 4k`` or ``512MiB``, ``--recall``, ``--memory``.

A byte budget becomes tokens per KV head only once the model's dimensions are known
(``resolve_budget_and_recall``, with ``core/costs.py``'s ``CacheCosts``: the bytes of a token); with recall on,
it holds the kept and the recalled tokens together. Every count is capped so that it stays a 64-bit integer
wherever torch meets it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtool.core.costs import CacheCosts, dtype_bytes
from kvtool.errors import UsageError, shown
from kvtool.numbers import LIMITS, capped
from kvtool.runtime.memory import format_bytes
from kvtool.runtime.memory_cache import kv_bytes_at_budget


@dataclass(frozen=True)
class Budget:
    """A parsed ``--budget``: exactly one of ``tokens`` (per KV head) and ``nbytes`` is set."""

    tokens: int | None
    nbytes: int | None
    text: str


# Token multipliers are binary on purpose: "4k" = 4096 tokens, "1m" = 1048576 tokens, which is how
# context lengths are usually quoted. Byte units follow the usual convention: SI (KB = 1000) and
# binary (KiB = 1024). A bare "k"/"m" is a token count, anything ending in "B" is a size.
_TOKEN_UNITS = {"": 1, "k": 1024, "m": 1024**2}
_BYTE_UNITS = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_NUM_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


_BUDGET_HELP = "budget must be a token count like 4096 or 4k, or a size like 512MiB"
_SIZE_HELP = "size must be a number of bytes like 8GiB, 512MiB, 2GB or 123B"


def _split_number(text: str) -> tuple[float, str] | None:
    m = _NUM_RE.match(text)
    if not m:
        return None
    value = float(m.group(1))
    if not math.isfinite(value):
        return None
    return value, m.group(2).lower()


def _in_range(name: str, value: int, key: str, raw: str) -> int:
    """``value`` (what ``raw`` says, units applied) within ``LIMITS[key]``; the message quotes ``raw``."""
    try:
        return capped(name, value, LIMITS[key])
    except UsageError as e:
        raise UsageError(f"{str(e).rsplit(': got ', 1)[0]}: got {shown(raw)}") from None


def parse_budget(text: str | int) -> Budget:
    """Parse a KV budget: tokens per KV head ("4096", "4k" = 4096, "1.5k" = 1536, "1m") or a
    byte size for the whole cache ("512MiB", "2GB", "1.5GiB"; SI GB = 1e9, binary GiB = 2**30).

    Fractional results are rounded down. The result must be at least one token / one byte.
    """
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise UsageError(f"{_BUDGET_HELP}: got {shown(text)}")
    raw = str(text).strip()
    parts = _split_number(raw)
    if parts is None:
        raise UsageError(f"{_BUDGET_HELP}: got {shown(raw)}")
    value, unit = parts
    if unit in _TOKEN_UNITS:
        tokens = _in_range("budget", int(value * _TOKEN_UNITS[unit]), "budget_tokens", raw)
        return Budget(tokens=tokens, nbytes=None, text=raw)
    if unit in _BYTE_UNITS:
        nbytes = _in_range("budget", int(value * _BYTE_UNITS[unit]), "budget_bytes", raw)
        return Budget(tokens=None, nbytes=nbytes, text=raw)
    raise UsageError(f"{_BUDGET_HELP}: got {shown(raw)}")


#: what ``--recall auto`` (the default) recalls per KV head when ``ask`` archives (docs/results.md)
DEFAULT_RECALL = 256


def parse_recall(text: str | int) -> int:
    """Recall budget in tokens per KV head: "off" or "0" (no archive), "512", "4k"; "auto" is
    ``DEFAULT_RECALL`` (whether ``auto`` recalls at all is the session's choice: ``recall_choice``)."""
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise UsageError(f"recall must be auto, off or a token count like 512 or 4k: got {shown(text)}")
    raw = str(text).strip().lower()
    if raw in ("off", "0", "none", "no"):
        return 0
    if raw == "auto":
        return DEFAULT_RECALL
    parts = _split_number(raw)
    if parts is None or parts[1] not in _TOKEN_UNITS:
        raise UsageError(f"recall must be auto, off or a token count like 512 or 4k: got {shown(raw)}")
    return _in_range("recall", int(parts[0] * _TOKEN_UNITS[parts[1]]), "recall", raw)


def parse_size(text: str | int) -> int:
    """Parse a memory size ("8GiB", "512MiB", "2GB", "123B"; a bare number is bytes) into bytes."""
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise UsageError(f"{_SIZE_HELP}: got {shown(text)}")
    raw = str(text).strip()
    parts = _split_number(raw)
    if parts is None or (parts[1] and parts[1] not in _BYTE_UNITS):
        raise UsageError(f"{_SIZE_HELP}: got {shown(raw)}")
    value, unit = parts
    return _in_range("size", int(value * _BYTE_UNITS.get(unit, 1)), "memory", raw)


def resolve_budget_and_recall(settings: Any, dims: Mapping[str, int],
                              dtype: Any) -> tuple[int | None, int, str | None]:
    """(kept tokens per KV head, tokens per KV head recall may add, a byte budget's conversion line) of a run's
    ``settings`` (``runtime/settings.py``'s ``Settings``) for a model's ``dims`` and compute ``dtype``.

    A token budget is what the cache keeps; recall's slots come on top (the plan shows them). A byte budget is the
    memory K/V may take: kept and recalled tokens together stay inside it (``CacheCosts.kept_and_recalled``), and
    the line says how it is split. The session and the plan resolve their budget here, both with ``CacheCosts``.
    Policy ``full`` has no budget (None, 0, None): it evicts nothing, so nothing is recalled either.
    """
    if settings.policy.strip().lower() == "full":
        return None, 0, None
    recall = parse_recall(settings.recall)
    b = settings.parsed_budget
    if b.tokens is not None:
        return b.tokens, recall, None
    assert b.nbytes is not None
    kv = settings.kv_dtype
    costs = CacheCosts.of(dims, dtype_bytes(dtype), kv)
    tokens, recall = costs.kept_and_recalled(b.nbytes, recall, settings.recall == "auto")
    stored = str(dtype).removeprefix("torch.") if kv == "auto" else kv
    if not recall:
        note = f"budget {b.text} = {tokens} tokens per KV head ({costs.kv_token} bytes of K+V per token in {stored})"
    else:
        kept = kv_bytes_at_budget(dims, dtype, tokens, 0, kv_dtype=kv)["promised"]
        note = (f"budget {b.text} = {tokens} tokens per KV head kept ({format_bytes(kept)}) + {recall} recalled while "
                f"answering ({format_bytes(costs.recall_kv(recall))}; {costs.kv_token} bytes of K+V per token in "
                f"{stored})")
    return tokens, recall, note + sliding_note(dims)


def sliding_note(dims: Any) -> str:
    """The part of a byte budget's conversion line about a hybrid model's sliding-window layers."""
    sliding = int(dims.get("sliding_layers", 0))
    if not sliding:
        return ""
    return (f"; {sliding} of {dims['num_layers']} layers slide over a {dims['sliding_window']}-token window and hold "
            f"at most {int(dims['sliding_window']) - 1} tokens, the rest of the bytes go to the other layers")
