"""The memory plan's lines for the cache itself: K/V at a budget, positions, policy state, the snapshot, an eviction's
temporaries, and recall's slots, growth and archive appends.

Each prices what ``kvtool/core`` allocates with the unit costs of ``kvtool/core/costs.py`` (a token, a slot, a layer,
an eviction's chunk), the figures the engine sizes its own work with; ``runtime/memory.py`` sums them with the
scratch of a block's forward into ``predict_peak``. ``dims`` as there (``memory.dims_from_config``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtool.core.costs import (
    EVICTION_FIXED_BYTES,
    POSITION_BYTES,
    STATE_BYTES,
    CacheCosts,
    coded_kv,
    dtype_bytes,
    evict_chunk_layers,
    eviction_layer_bytes,
)
from kvtool.core.layout import window_capacity

Dims = Mapping[str, int]


def layer_split(dims: Dims, budget_tokens: int | None) -> dict[str, int]:
    """Global and sliding layers, and the tokens per KV head each kind holds at ``budget_tokens`` (None: no
    budget, a sliding layer holds its window)."""
    sliding = int(dims.get("sliding_layers", 0))
    window = int(dims.get("sliding_window", 0))
    return {
        "global_layers": dims["num_layers"] - sliding,
        "sliding_layers": sliding,
        "global_tokens": budget_tokens,
        "sliding_tokens": window_capacity(window, budget_tokens) if sliding else 0,
    }


def kv_bytes_per_token(dims: Dims, elem: Any, kv_dtype: str = "auto") -> dict[str, int]:
    """Bytes of K plus V for one token: per (layer, KV head), per layer, and for the whole model
    (``CacheCosts``; ``kv_dtype``: how the cache stores them, int8 / int4 with their float16 scales)."""
    c = CacheCosts.of(dims, dtype_bytes(elem), kv_dtype)
    return {"per_layer_per_head": c.kv_head, "per_layer": c.kv_layer, "total": c.kv_token}


def kv_bytes_at_budget(
    dims: Dims, elem: Any, budget_tokens: int, block_size: int, original_keys: bool = False, kv_dtype: str = "auto"
) -> dict[str, Any]:
    """KV memory at a budget of ``budget_tokens`` per KV head.

    ``promised``: what the budget guarantees after every eviction, the same for every policy
    (per-head capacities that sum to budget x heads promise the same bytes). ``allocated``: the
    preallocated buffers, capacity plus one block of scratch that the incoming block is appended to
    before eviction brings the cache back to capacity. A hybrid model's sliding layers hold
    ``min(W - 1, budget)`` tokens instead; ``by_layer_kind`` then splits both figures.

    ``original_keys`` (see ``keeps_original_keys``): every buffer slot also holds the key at its
    original position, one more key per token, so ``allocated`` is 1.5x; ``promised`` stays the
    budget's K+V (what a byte budget buys), the copy being bookkeeping of the positions mode.
    int4's full-precision window (``CacheCosts.window_layer``) counts in both, once per layer.
    """
    c = CacheCosts.of(dims, dtype_bytes(elem), kv_dtype)
    per_slot = c.kv_layer + (c.token_head * c.kv_heads if original_keys else 0)
    s = layer_split(dims, budget_tokens)

    def kind(layers: int, tokens: int) -> dict[str, int]:
        return {
            "promised": layers * (tokens * c.kv_layer + c.window_layer),
            "allocated": layers * ((tokens + block_size) * per_slot + c.window_layer),
        }

    glob = kind(s["global_layers"], budget_tokens)
    if not s["sliding_layers"]:
        return dict(glob)
    slide = kind(s["sliding_layers"], s["sliding_tokens"])
    out: dict[str, Any] = {k: glob[k] + slide[k] for k in glob}
    out["by_layer_kind"] = {"global": glob, "sliding": slide}
    return out


def positions_bytes(dims: Dims, budget_tokens: int, block_size: int) -> int:
    """The int64 stream and RoPE positions of every slot (capacity + one block per KV head), in every layer."""
    s = layer_split(dims, budget_tokens)
    slots = s["global_layers"] * (budget_tokens + block_size) + s["sliding_layers"] * (s["sliding_tokens"] + block_size)
    return 2 * POSITION_BYTES * slots * dims["num_kv_heads"]


def snapshot_bytes(
    dims: Dims, elem: Any, tokens: int, n_fields: int, kv_dtype: str = "auto", original_keys: bool = False
) -> int:
    """A copy of ``tokens`` stored tokens per KV head: what a slot holds (``costs.slot_head_bytes``: K and V as stored,
    int64 stream and RoPE positions, float32 policy state) (``BoundedCache.snapshot``); ``original_keys``: the keys'
    original copy too, as the cache keeps it (``keeps_original_keys``), so a restore gives it back instead of
    rounding it again."""
    c = CacheCosts.of(dims, dtype_bytes(elem), kv_dtype)
    return tokens * c.slot_head(n_fields, original_keys) * dims["num_kv_heads"] * dims["num_layers"]


def snapshot_copy_bytes(dims: Dims, elem: Any, tokens: int, kv_dtype: str = "auto") -> int:
    """What a snapshot (or a ``.kvc`` save) holds on the device while it copies a GPU's cache to the host: one
    layer's stored keys made contiguous (``BoundedCache.snapshot`` copies buffer by buffer, layer by layer)."""
    c = CacheCosts.of(dims, dtype_bytes(elem), kv_dtype)
    return tokens * max(c.token_head, POSITION_BYTES) * dims["num_kv_heads"]


def widest_token_bytes(dims: Dims, elem: Any, kv_dtype: str = "auto", n_fields: int = 0) -> int:
    """The widest per-token buffer of a head group, per KV head: a key (or value) as stored, the policy's state, or a
    position (``LayerStack.widest_token_bytes``)."""
    return max(CacheCosts.of(dims, dtype_bytes(elem), kv_dtype).token_head, STATE_BYTES * n_fields, POSITION_BYTES)


def layers_evicted_together(
    dims: Dims,
    elem: Any,
    budget: int,
    block: int,
    *,
    kv_dtype: str = "auto",
    n_fields: int = 0,
    stacked: bool = True,
    policy_slot_bytes: int = 0,
) -> int:
    """The layers one eviction takes at once: a stack's chunk (``costs.evict_chunk_layers``) when the layers share one
    layout (``stacked``: a batchable policy of its own layout, K/V in the compute dtype), else one."""
    layers = int(dims["num_layers"]) - int(dims.get("sliding_layers", 0))
    if not stacked or layers < 2 or coded_kv(elem, kv_dtype):
        return 1
    layer = eviction_layer_bytes(
        int(dims["num_kv_heads"]),
        budget + block,
        budget,
        widest_token_bytes(dims, elem, kv_dtype, n_fields),
        policy_slot_bytes,
    )
    return evict_chunk_layers(layers, layer)


def eviction_scratch_bytes(
    dims: Dims,
    elem: Any,
    budget: int,
    block: int,
    *,
    kv_dtype: str = "auto",
    n_fields: int = 0,
    stacked: bool = True,
    policy_slot_bytes: int = 0,
    recall: int = 0,
) -> int:
    """The temporaries of an eviction (``core/costs.py``'s ``eviction_layer_bytes`` of one layer: the scoring of its
    budget + block (+ recall) slots, or the copy of its widest buffer's kept tokens) times the layers evicted
    together (``layers_evicted_together``; one while an answer holds recalled tokens: those layers evict alone)."""
    layer = eviction_layer_bytes(
        int(dims["num_kv_heads"]),
        budget + block + recall,
        budget + recall,
        widest_token_bytes(dims, elem, kv_dtype, n_fields),
        policy_slot_bytes,
    )
    together = (
        1
        if recall
        else layers_evicted_together(
            dims,
            elem,
            budget,
            block,
            kv_dtype=kv_dtype,
            n_fields=n_fields,
            stacked=stacked,
            policy_slot_bytes=policy_slot_bytes,
        )
    )
    return layer * together + EVICTION_FIXED_BYTES


def archive_work_bytes(
    dims: Dims, elem: Any, block: int, page: int, archive_dtype: str = "auto", together: int = 1
) -> int:
    """What recall's archive appends a block's evicted tokens through (``core/archive.py``'s ``AppendWork``, shared by
    the cache's archives, and each archive's staged rows, kept until written): for the ``together`` layers
    appended at once (``layers_evicted_together``), their dropped keys, values and positions gathered, the keys in
    float32 for the page summaries (and, for an int8 archive, K and V twice in float32 with their scales), the
    summaries' work, the packed rows; and the packed rows of every global layer, staged for the file."""
    h, d, e = dims["num_kv_heads"], dims["head_dim"], dtype_bytes(elem)
    int8 = archive_dtype == "int8"
    stored = e if archive_dtype == "auto" else 1 if int8 else dtype_bytes(archive_dtype)
    row = 2 * d * stored + (2 * 4 if int8 else 0) + 4  # a token's K/V row part in one head, its scales, its position
    gathered = POSITION_BYTES + 2 * d * e + 4 * d + row + (2 * (2 * d * 4 + 4) if int8 else 0)
    summaries = (block // page + 2) * 2 * d * (4 + 4 + 2 + 2 + 1)  # float32 min/max, back32, float16 twice, a mask
    layers = dims["num_layers"] - int(dims.get("sliding_layers", 0))
    return h * (together * (block * gathered + summaries) + layers * block * row)


def recall_growth_bytes(
    dims: Dims, elem: Any, budget: int, block: int, *, kv_dtype: str = "auto", n_fields: int = 0, stacked: bool = True
) -> int:
    """What making room for recall holds for a moment (``HeadGroup.make_room``): its buffers are reallocated one at a
    time, each old one freed once copied, so the largest at its old size (budget + block slots) is held twice; a
    stack's holds every layer (``LayerStack.resize``)."""
    layers = int(dims["num_layers"]) - int(dims.get("sliding_layers", 0)) if stacked else 1
    return layers * dims["num_kv_heads"] * (budget + block) * widest_token_bytes(dims, elem, kv_dtype, n_fields)


def recall_slots_bytes(
    dims: Dims, elem: Any, recall: int, original_keys: bool = False, kv_dtype: str = "auto", n_fields: int = 0
) -> int:
    """The slots recall adds to every global layer's groups for an answer (``HeadGroup.make_room``): ``recall``
    tokens per KV head of what a slot holds (``costs.slot_head_bytes``: K and V as stored, with the original keys'
    copy when the cache keeps one, the int64 positions, the policy's float32 state). Sliding-window layers never
    recall."""
    c = CacheCosts.of(dims, dtype_bytes(elem), kv_dtype)
    return recall * c.slot_head(n_fields, original_keys) * dims["num_kv_heads"] * c.global_layers


def recall_kv_bytes(dims: Dims, elem: Any, recall: int, kv_dtype: str = "auto") -> int:
    """K+V of ``recall`` recalled tokens per KV head in every global layer: what recall adds to the budget's
    promise (a byte budget holds it; a token budget's plan shows it)."""
    return CacheCosts.of(dims, dtype_bytes(elem), kv_dtype).recall_kv(recall)


def policy_state_bytes(dims: Dims, budget: int, block: int, n_fields: int) -> int:
    """Per-token float32 policy state (``Policy.state_fields``) kept next to K/V, in the same
    capacity-plus-one-block buffers, for every KV head of every global layer (sliding layers have
    no policy)."""
    layers = dims["num_layers"] - int(dims.get("sliding_layers", 0))
    return n_fields * STATE_BYTES * (budget + block) * dims["num_kv_heads"] * layers


def cache_parts(
    dims: Dims,
    elem: Any,
    budget: int,
    block: int,
    *,
    kv_dtype: str = "auto",
    n_fields: int = 0,
    original_keys: bool = False,
    stacked: bool = True,
    policy_slot_bytes: int = 0,
    recall: int = 0,
) -> dict[str, int]:
    """The cache's lines of ``memory.predict_peak``: K/V promised and allocated, the policy state, the positions, and
    an eviction's temporaries (the larger of a stack's chunk and a recalling layer's own, ``recall`` slots more)."""
    kv = kv_bytes_at_budget(dims, elem, budget, block, original_keys, kv_dtype)
    evict = {"kv_dtype": kv_dtype, "n_fields": n_fields, "policy_slot_bytes": policy_slot_bytes}
    return {
        "kv_promised_bytes": kv["promised"],
        "kv_allocated_bytes": kv["allocated"],
        "policy_state_bytes": policy_state_bytes(dims, budget, block, n_fields),
        "positions_bytes": positions_bytes(dims, budget, block),
        "eviction_scratch_bytes": max(
            eviction_scratch_bytes(dims, elem, budget, block, stacked=stacked, **evict),
            eviction_scratch_bytes(dims, elem, budget, block, stacked=False, recall=recall, **evict),
        ),
    }


def recall_parts(
    dims: Dims,
    elem: Any,
    budget: int,
    block: int,
    recall: int,
    *,
    kv_dtype: str = "auto",
    n_fields: int = 0,
    original_keys: bool = False,
    stacked: bool = True,
    policy_slot_bytes: int = 0,
    page: int = 32,
    archive_dtype: str = "auto",
) -> dict[str, int]:
    """Recall's cache lines of ``memory.predict_peak``: its archive's appends, making room for it, its slots."""
    together = layers_evicted_together(
        dims,
        elem,
        budget,
        block,
        kv_dtype=kv_dtype,
        n_fields=n_fields,
        stacked=stacked,
        policy_slot_bytes=policy_slot_bytes,
    )
    return {
        "archive_work_bytes": archive_work_bytes(dims, elem, block, page, archive_dtype, together),
        "recall_growth_bytes": recall_growth_bytes(
            dims,
            elem,
            budget,
            block,
            kv_dtype=kv_dtype,
            n_fields=n_fields,
            stacked=stacked and not coded_kv(elem, kv_dtype),
        ),
        "recall_slots_bytes": recall_slots_bytes(dims, elem, recall, original_keys, kv_dtype, n_fields),
    }
