"""Budgets and sizes as the user writes them: ``--budget 4k`` or ``512MiB``, ``--recall``, ``--memory``.

A byte budget becomes tokens per KV head only once the model's dimensions are known
(``budget_tokens_from_bytes``); with recall on, it holds the kept and the recalled tokens together
(``budget_with_recall``). Every count is capped so that it stays a 64-bit integer wherever torch meets it.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from typing import Any

from kvtool.config import kv_token_head_bytes, kv_window_bytes
from kvtool.errors import UsageError, shown
from kvtool.numbers import LIMITS, capped


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


def budget_tokens_from_bytes(nbytes: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
                             sliding_layers: int = 0, sliding_window: int = 0,
                             token_head_bytes: int | None = None, window_bytes: int = 0) -> int:
    """Tokens per KV head such that K and V of every layer and KV head fit in ``nbytes``.

    ``token_head_bytes``: bytes of one token's key (or value) in one head as stored (``--kv-dtype``:
    ``config.kv_token_head_bytes``, scales included); by default ``head_dim · dtype_bytes``. So int8 holds
    2·d/(d + 2) times the tokens of a 16-bit cache in the same bytes. ``window_bytes``: what every layer and
    KV head holds whatever the budget (int4's full-precision window, ``config.kv_window_bytes``), taken
    off first.

    This is the budget's promise (see ``memory.kv_bytes_at_budget``), not the preallocated buffers,
    so "--budget 2GiB" means the same thing whatever the block size. A hybrid model's sliding layers
    hold at most ``W - 1`` tokens whatever the budget, so the bytes they do not need go to the
    global layers: the largest ``t`` with ``global·t + sliding·min(W − 1, t) <= nbytes / token-layer``.
    """
    per_head = head_dim * dtype_bytes if token_head_bytes is None else token_head_bytes
    per_token = 2 * num_layers * num_kv_heads * per_head
    fixed = num_layers * num_kv_heads * window_bytes
    if fixed and nbytes < fixed + per_token:
        raise UsageError(f"budget of {nbytes} bytes holds no token: the full-precision window of every layer and"
                         f" KV head takes {fixed} bytes, one token of K+V {per_token} more")
    nbytes -= fixed
    tokens = nbytes // per_token if per_token > 0 else 0
    glob = num_layers - sliding_layers
    if sliding_layers and glob > 0 and tokens > sliding_window - 1 > 0:
        units = nbytes // (2 * num_kv_heads * per_head)  # tokens x layers that fit
        tokens = (units - sliding_layers * (sliding_window - 1)) // glob
    if tokens < 1:
        raise UsageError(
            f"budget of {nbytes} bytes holds no token: one token of K+V for all layers and KV heads"
            f" takes {per_token} bytes"
        )
    return int(tokens)


def budget_tokens_for(nbytes: int, dims: Any, compute_bytes: int, kv_dtype: str = "auto") -> int:
    """``budget_tokens_from_bytes`` for a model's ``dims`` (``memory.DIM_KEYS``) and a ``--kv-dtype``: the
    stored size of a token and int4's window come from ``config``."""
    d = int(dims["head_dim"])
    return budget_tokens_from_bytes(nbytes, int(dims["num_layers"]), int(dims["num_kv_heads"]), d, compute_bytes,
                                    int(dims.get("sliding_layers", 0)), int(dims.get("sliding_window", 0)),
                                    kv_token_head_bytes(kv_dtype, d, compute_bytes),
                                    kv_window_bytes(kv_dtype, d, compute_bytes))


def budget_with_recall(nbytes: int, dims: Any, compute_bytes: int, kv_dtype: str, recall: int,
                       auto: bool) -> tuple[int, int]:
    """(kept, recalled) tokens per KV head of a byte budget that must hold both.

    A byte budget is what the user's memory allows K/V: the tokens the cache keeps and the ones recall adds
    for an answer (in every global layer; sliding-window layers never recall) together stay inside it.
    ``auto`` (``--recall auto``) recalls at most half of what the bytes hold, so a small budget still keeps
    as many tokens as it recalls; an explicit ``--recall N`` takes its N and leaves the rest to kept tokens.
    """
    whole = budget_tokens_for(nbytes, dims, compute_bytes, kv_dtype)
    recall = min(recall, whole // 2) if auto else recall
    layers = int(dims["num_layers"]) - int(dims.get("sliding_layers", 0))
    per_recalled = 2 * layers * int(dims["num_kv_heads"]) * kv_token_head_bytes(kv_dtype, int(dims["head_dim"]),
                                                                                  compute_bytes)
    if recall <= 0 or per_recalled == 0:
        return whole, max(recall, 0)
    left = nbytes - recall * per_recalled
    kept = 0
    if left > 0:
        with contextlib.suppress(UsageError):
            kept = budget_tokens_for(left, dims, compute_bytes, kv_dtype)
    if kept < 1:
        raise UsageError(f"budget of {nbytes} bytes holds {whole} tokens per KV head, and --recall {recall} takes "
                         f"them all while answering: lower the recall or raise the budget", field="budget")
    return kept, recall


def sliding_note(dims: Any) -> str:
    """The part of a byte budget's conversion line about a hybrid model's sliding-window layers."""
    sliding = int(dims.get("sliding_layers", 0))
    if not sliding:
        return ""
    return (f"; {sliding} of {dims['num_layers']} layers slide over a {dims['sliding_window']}-token window and hold "
            f"at most {int(dims['sliding_window']) - 1} tokens, the rest of the bytes go to the other layers")
