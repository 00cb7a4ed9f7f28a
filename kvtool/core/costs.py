"""What a token, a slot, a layer and a block of the bounded cache cost, in bytes: the one home of these figures.

    element     a dtype's bytes (``dtype_bytes``); whether ``--kv-dtype`` stores K/V coded (``coded_kv``)
    token-head  K (or V) of one token in one KV head, as stored: codes and scale (``kv_token_head_bytes``)
    K+V         of one token in a head, a layer (every KV head), the model (``CacheCosts.kv_head``, ``kv_layer``,
                ``kv_token``)
    slot-head   what one slot of a head group holds: K and V (and the key's original copy under compact
                positions), the int64 stream and RoPE positions, the policy's float32 state; a snapshot holds as
                much per stored token (``slot_head_bytes``)
    layer       a bounded layer's slots: the budget plus one block (the block is appended, then evicted)
    eviction    one eviction's temporaries: scores and ranks of every (head, slot), then the copy of one buffer's kept
                tokens (``eviction_layer_bytes``); a stack of layers evicts ``evict_chunk_layers`` at a time

The engine reads it where it sizes its own work (``core/storage.py``'s slots, ``core/stacks.py``'s eviction chunks);
the memory plan (``runtime/memory.py``, ``runtime/memory_cache.py``) prices every buffer with it, the byte budget
(``runtime/budget.py``) turns bytes into tokens with it, and ``kvtool profile --doc`` compares the measured peak with
the plan built on it. Plain integers, no torch: a plan from a ``config.json`` alone loads no model code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtool.config import DTYPE_BYTES, KV_WINDOW_TOKENS, dtype_name
from kvtool.errors import UsageError

#: an int64 position (each slot holds two: the stream position and the RoPE position its key holds)
POSITION_BYTES = 8
#: a float32 policy state field, per slot
STATE_BYTES = 4
#: the scoring temporaries of one eviction per (KV head, slot), at most: the policy's float32 score (and a modifier's
#: float32 work beside it), the protection's four masks and int32 ranks, ``keep_top``'s int64 keys and kept indices,
#: the dropped tokens' int64 indices. Measured 27 to 44 bytes over sink, h2o, tova, snapkv, keydiff, h2o+vatp and
#: tova+caote (tests/test_evict_memory.py holds every policy to it).
SCORE_SLOT_BYTES = 48
#: an eviction's small tensors besides (each chunk's row offsets, scalars), at most
EVICTION_FIXED_BYTES = 1 << 12
#: a stack of layers (``core/stacks.py``) evicts its layers in at most this many chunks: the kernel launches of
#: an eviction stay those of a few layers, however many the model has
EVICT_CHUNKS = 8
#: ...and a chunk's temporaries may reach this much before it is split (a small cache evicts every layer at once,
#: as many launches as one layer)
EVICT_CHUNK_BYTES = 1 << 20


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a ``torch.dtype``, a dtype name ("bfloat16") or an int (returned as is)."""
    if isinstance(dtype, bool):
        raise TypeError(f"not a dtype: {dtype!r}")
    if isinstance(dtype, int):
        if dtype < 1:
            raise ValueError(f"element size must be >= 1 byte: {dtype}")
        return dtype
    itemsize = getattr(dtype, "itemsize", None)
    if isinstance(itemsize, int):
        return itemsize
    if isinstance(dtype, str):
        with contextlib.suppress(ValueError):
            return DTYPE_BYTES[dtype_name(dtype.lower())]
    raise TypeError(f"not a dtype: {dtype!r}")


def coded_kv(elem: Any, kv_dtype: str) -> bool:
    """Whether ``--kv-dtype`` stores K/V in another format than the compute dtype ``elem`` (decoded to read)."""
    if kv_dtype == "auto":
        return False
    if kv_dtype in ("int8", "int4"):
        return True
    name = None
    with contextlib.suppress(ValueError, TypeError):
        name = dtype_name(elem)
    return name != kv_dtype if name is not None else DTYPE_BYTES[kv_dtype] != dtype_bytes(elem)


def kv_token_head_bytes(kv_dtype: str, head_dim: int, compute_bytes: int) -> int:
    """Bytes one token's key (or value) takes in one KV head as the cache stores it (``--kv-dtype``).

    ``auto`` is the compute dtype (``compute_bytes`` per element); int8 is one byte per element and int4
    half a byte, each with a 2-byte float16 scale per token and head.
    """
    if kv_dtype == "auto":
        return head_dim * compute_bytes
    if kv_dtype == "int8":
        return head_dim + 2
    if kv_dtype == "int4":
        return (head_dim + 1) // 2 + 2
    return head_dim * DTYPE_BYTES[dtype_name(kv_dtype)]


def kv_window_bytes(kv_dtype: str, head_dim: int, compute_bytes: int) -> int:
    """Bytes of K plus V of the full-precision window in one layer and KV head (0 without one): kept in the
    compute dtype when it is 16-bit, in bfloat16 for a float32 model."""
    return 2 * KV_WINDOW_TOKENS.get(kv_dtype, 0) * head_dim * min(compute_bytes, 2)


def slot_head_bytes(token_head: int, n_fields: int, original_keys: bool = False) -> int:
    """What one slot of a head group holds per KV head: K and V of ``token_head`` bytes each (and the key's original
    copy when ``original_keys``), two int64 positions and ``n_fields`` float32 policy state fields. A snapshot holds
    as much per stored token and head."""
    return (3 if original_keys else 2) * token_head + 2 * POSITION_BYTES + STATE_BYTES * n_fields


def eviction_layer_bytes(heads: int, slots: int, kept: int, copy_token_bytes: int, policy_slot_bytes: int = 0) -> int:
    """One layer's eviction temporaries at most: the scoring of ``slots`` tokens per head (``SCORE_SLOT_BYTES``, and
    ``policy_slot_bytes``: ``Policy.score_slot_bytes``), or the copy of one buffer's ``kept`` tokens per head,
    ``copy_token_bytes`` each (the widest per-token buffer: the keys), whichever is larger: the scoring's
    temporaries are gone before the gather (which holds the kept indices and their flat index, int64 each), and
    buffers are gathered one after the other."""
    return heads * max(slots * (SCORE_SLOT_BYTES + policy_slot_bytes), kept * (copy_token_bytes + 2 * POSITION_BYTES))


def evict_chunk_layers(layers: int, layer_bytes: int) -> int:
    """Layers of a stack evicted together: a few chunks at most (``EVICT_CHUNKS``), each as many layers as fit
    ``EVICT_CHUNK_BYTES`` of temporaries when that is more (``layer_bytes``: ``eviction_layer_bytes`` of one)."""
    by_count = -(-layers // EVICT_CHUNKS)
    by_bytes = EVICT_CHUNK_BYTES // max(1, layer_bytes)
    return max(1, min(layers, max(by_count, by_bytes)))


@dataclass(frozen=True)
class CacheCosts:
    """The unit costs of one model's cache under one ``--kv-dtype``: K/V per token at each scale, what a slot holds,
    and the byte budget's conversion to tokens per KV head (``of`` reads a model's ``dims``).

    A hybrid model's ``sliding_layers`` hold at most ``sliding_window - 1`` tokens whatever the budget, never recall,
    and keep no policy state (``core/families.py``)."""

    layers: int
    kv_heads: int
    head_dim: int
    compute_bytes: int
    kv_dtype: str = "auto"
    sliding_layers: int = 0
    sliding_window: int = 0

    @classmethod
    def of(cls, dims: Mapping[str, int], compute_bytes: int, kv_dtype: str = "auto") -> CacheCosts:
        """From a model's ``dims`` (``runtime/memory.py``'s ``dims_from_config``) and its compute dtype's size."""
        return cls(
            int(dims["num_layers"]),
            int(dims["num_kv_heads"]),
            int(dims["head_dim"]),
            int(compute_bytes),
            kv_dtype,
            int(dims.get("sliding_layers", 0)),
            int(dims.get("sliding_window", 0)),
        )

    @property
    def global_layers(self) -> int:
        """The layers that hold the budget, archive and recall (all but the sliding ones)."""
        return self.layers - self.sliding_layers

    @property
    def token_head(self) -> int:
        """K (or V) of one token in one KV head, as stored."""
        return kv_token_head_bytes(self.kv_dtype, self.head_dim, self.compute_bytes)

    @property
    def kv_head(self) -> int:
        """K + V of one token in one KV head."""
        return 2 * self.token_head

    @property
    def kv_layer(self) -> int:
        """K + V of one token in one layer (every KV head)."""
        return self.kv_head * self.kv_heads

    @property
    def kv_token(self) -> int:
        """K + V of one token in every layer."""
        return self.kv_layer * self.layers

    @property
    def window_layer(self) -> int:
        """int4's full-precision window in one layer (every KV head), held whatever the budget; 0 without one."""
        return kv_window_bytes(self.kv_dtype, self.head_dim, self.compute_bytes) * self.kv_heads

    def slot_head(self, n_fields: int = 0, original_keys: bool = False) -> int:
        """``slot_head_bytes`` of this cache."""
        return slot_head_bytes(self.token_head, n_fields, original_keys)

    def budget_tokens(self, nbytes: int) -> int:
        """Tokens per KV head such that K and V of every layer and KV head fit in ``nbytes``: the budget's promise
        (``runtime/memory.py``'s ``kv_bytes_at_budget``), not the preallocated buffers, so "--budget 2GiB" means the
        same whatever the block size. int4's window (``window_layer``) is taken off first. A hybrid model's sliding
        layers hold at most ``W - 1`` tokens, so the bytes they do not need go to the global layers: the largest
        ``t`` with ``global·t + sliding·min(W − 1, t) <= nbytes / (K+V of a token in a layer)``."""
        per_token, fixed = self.kv_token, self.window_layer * self.layers
        if fixed and nbytes < fixed + per_token:
            raise UsageError(
                f"budget of {nbytes} bytes holds no token: the full-precision window of every layer and"
                f" KV head takes {fixed} bytes, one token of K+V {per_token} more"
            )
        nbytes -= fixed
        tokens = nbytes // per_token if per_token > 0 else 0
        sliding, window = self.sliding_layers, self.sliding_window
        if sliding and self.global_layers > 0 and tokens > window - 1 > 0:
            units = nbytes // self.kv_layer  # tokens x layers that fit
            tokens = (units - sliding * (window - 1)) // self.global_layers
        if tokens < 1:
            raise UsageError(
                f"budget of {nbytes} bytes holds no token: one token of K+V for all layers and KV heads"
                f" takes {per_token} bytes"
            )
        return int(tokens)

    def recall_kv(self, recall: int) -> int:
        """K + V of ``recall`` recalled tokens per KV head in every global layer (what recall adds to the promise)."""
        return recall * self.kv_layer * self.global_layers

    def kept_and_recalled(self, nbytes: int, recall: int, auto: bool) -> tuple[int, int]:
        """(kept, recalled) tokens per KV head of a byte budget that must hold both.

        A byte budget is what the user's memory allows K/V: the tokens the cache keeps and the ones recall adds for
        an answer (in every global layer; sliding-window layers never recall) together stay inside it. ``auto``
        (``--recall auto``) recalls at most half of what the bytes hold, so a small budget still keeps as many
        tokens as it recalls; an explicit ``--recall N`` takes its N and leaves the rest to kept tokens."""
        whole = self.budget_tokens(nbytes)
        recall = min(recall, whole // 2) if auto else recall
        if recall <= 0 or self.recall_kv(1) == 0:
            return whole, max(recall, 0)
        left, kept = nbytes - self.recall_kv(recall), 0
        if left > 0:
            try:
                kept = self.budget_tokens(left)
            except UsageError:
                kept = 0
        if kept < 1:
            raise UsageError(
                f"budget of {nbytes} bytes holds {whole} tokens per KV head, and --recall {recall} takes "
                f"them all while answering: lower the recall or raise the budget",
                field="budget",
            )
        return kept, recall
