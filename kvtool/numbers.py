"""Numbers read from the command line or from a file: one parser, and the range of every one of them.

A count that sizes something (an answer buffer, a list of trials, a per-layer list of a model config) is
a request for memory: ``--max-new-tokens 1000000000`` used to zero 8 GB before the first token, and
``num_hidden_layers: 1e9`` in a config built a billion-entry list. So every number a user or a file gives
kvtool passes :func:`capped` where it is parsed, against its entry in :data:`LIMITS`: far above any real
use, far below what would exhaust a machine. A number outside is one ``UsageError`` line that names the
setting and its range (``--max-new-tokens must be at most 1,048,576 tokens: got 1000000000``).

Standard library only (the CLI checks flags with it before torch is imported); docs/cli.md lists the ranges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvtool.errors import UsageError, shown


@dataclass(frozen=True)
class Range:
    """The numbers a setting takes: ``low`` to ``high`` (``low`` itself excluded when ``open_low``); integers
    only when ``integer``. ``unit`` follows the number in messages ("tokens")."""

    low: int | float
    high: int | float
    integer: bool = True
    open_low: bool = False
    unit: str = ""

    def describe(self) -> str:
        """What the setting takes, for a message: "an integer from 1 to 1,048,576", "a number in (0, 1]"."""
        if self.integer:
            return f"an integer from {self.span()}"
        return f"a number {'in' if self.open_low else 'from'} {self.span()}"

    def span(self) -> str:
        """The range alone, as docs/cli.md's table of limits writes it: "1 to 1,048,576 tokens", "(0, 1]"."""
        if self.open_low:
            return f"({_num(self.low)}, {_num(self.high)}]{self._unit}"
        return f"{_num(self.low)} to {_num(self.high)}{self._unit}"

    @property
    def _unit(self) -> str:
        return f" {self.unit}" if self.unit else ""


def _num(x: int | float) -> str:
    return f"{x:,}" if isinstance(x, int) or float(x).is_integer() and abs(x) >= 1000 else f"{x:g}"


def capped(name: str, value: Any, rng: Range) -> Any:
    """``value`` checked against ``rng``: an int (integer ranges) or a float; else one ``UsageError`` line that
    names ``name`` (a flag or a file's key) and the range.

    A bool is not a number here (YAML's ``yes``), nor is NaN or an infinity; an integral float is not an
    integer (``1e9`` in a YAML profile is a float: say ``1000000000``).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (rng.integer and not isinstance(value, int)):
        raise UsageError(f"{name} must be {rng.describe()}: got {shown(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(f"{name} must be {rng.describe()}: got {value}")
    if value < rng.low or (rng.open_low and value == rng.low):
        op = ">" if rng.open_low else ">="
        raise UsageError(f"{name} must be {op} {_num(rng.low)}: got {shown(value)}")
    if value > rng.high:
        raise UsageError(f"{name} must be at most {_num(rng.high)}{rng._unit}: got {shown(value)}")
    return value if rng.integer else float(value)


#: the largest count a token setting may hold (a budget, a document length): no document comes near it,
#: and every count stays a 64-bit integer wherever torch meets it
MAX_COUNT = 2**40
#: the longest answer: its token buffer on the device is 8 bytes a token (8 MiB at the cap)
MAX_NEW_TOKENS = 1 << 20
#: the longest document an evaluation builds (needle haystacks, perplexity windows): its token list is in memory
MAX_EVAL_TOKENS = 1 << 22
#: the largest archive page (as a ``.kvc`` may record; the engine's pages are tens of tokens)
MAX_RECALL_PAGE = 1 << 20
#: the most CPU threads ``--threads`` may ask for
MAX_THREADS = 4096
#: torch's generators take seeds in [-2**63, 2**64)
SEED_RANGE = Range(-(2**63), 2**64 - 1)

#: every number kvtool reads, by the name its settings, flags and profile keys use (docs/cli.md lists them)
LIMITS: dict[str, Range] = {
    # settings (flags and profile keys)
    # (a block, the sinks and the recent window are held only as far as the document goes: capped as a budget)
    "block_size": Range(1, MAX_COUNT, unit="tokens"),
    "sinks": Range(0, MAX_COUNT, unit="tokens"),
    "recent": Range(0, MAX_COUNT, unit="tokens"),
    "recall_page": Range(1, MAX_RECALL_PAGE, unit="tokens"),
    "max_new_tokens": Range(1, MAX_NEW_TOKENS, unit="tokens"),
    "temperature": Range(0.0, 100.0, integer=False),
    "top_p": Range(0.0, 1.0, integer=False, open_low=True),
    "repetition_penalty": Range(1.0, 100.0, integer=False),
    "no_repeat_ngram": Range(0, 256, unit="tokens"),
    "seed": SEED_RANGE,
    "threads": Range(1, MAX_THREADS),
    # sizes written with a unit (4k, 512MiB), checked once the unit is applied
    "budget_tokens": Range(1, MAX_COUNT, unit="tokens"),
    "budget_bytes": Range(1, 2**60, unit="bytes"),
    "recall": Range(0, 1 << 24, unit="tokens per KV head"),
    "memory": Range(1, 2**60, unit="bytes"),
    # options of one command
    "doc_tokens": Range(1, MAX_COUNT, unit="tokens"),
    "workers": Range(1, 1024),
    "trials": Range(1, 10_000),
    "samples": Range(1, 10_000),
    "first_tokens": Range(1, MAX_NEW_TOKENS, unit="tokens"),
    "eval_tokens": Range(1, MAX_EVAL_TOKENS, unit="tokens"),
    "calibrate_k": Range(2, 16_384, unit="tokens"),
    "head_share": Range(0.0, 1.0, integer=False),
}

#: the largest value a config dimension may take beside the tighter ones below (a C ``int``)
MAX_DIM = 2**31 - 1
#: every dimension a checkpoint's ``config.json`` may name (in transformers' spelling; a family's own spelling,
#: ``n_layer`` for GPT-2, is checked under the same range): checked before anything is built from the config,
#: since a family's config builds per-layer lists as long as its layer count
CONFIG_LIMITS: dict[str, Range] = {
    "num_hidden_layers": Range(1, 1024),
    "num_attention_heads": Range(1, 4096),
    "num_key_value_heads": Range(1, 4096),
    "hidden_size": Range(1, 1 << 18),
    "head_dim": Range(1, 4096),
    "intermediate_size": Range(1, 1 << 20),
    "moe_intermediate_size": Range(1, 1 << 20),
    "vocab_size": Range(1, 1 << 24),
    "max_position_embeddings": Range(1, MAX_DIM),
    "sliding_window": Range(0, MAX_DIM),
    "num_experts": Range(1, 4096),
    "num_local_experts": Range(1, 4096),
    "num_experts_per_tok": Range(1, 4096),
    # GPT-2 and OPT style spellings that no attribute map names
    "n_inner": Range(1, 1 << 20),
    "n_ctx": Range(1, MAX_DIM),
    "ffn_dim": Range(1, 1 << 20),
}
