"""Which layers of a model are global and which slide, read from its config: no torch needed.

Split from :mod:`kvtool.core.families` so that memory plans and up-front model checks (run before
torch is imported or any weight is loaded) can use it; ``families`` builds the cache layout from it.
"""

from __future__ import annotations

from typing import Any

from kvtool.errors import UsageError

FULL = "full_attention"
SLIDING = "sliding_attention"


def text_config(config: Any) -> Any:
    """The language model's config (multimodal configs wrap it)."""
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def layer_windows(config: Any) -> list[int | None]:
    """Per layer: its sliding window ``W`` (query ``t`` sees keys ``t - W < p <= t``), or None (global).

    Mirrors how transformers' attention modules pick ``sliding_window``: with ``layer_types`` only the
    ``sliding_attention`` layers slide (Gemma 2/3, Qwen2/3); without them a configured
    ``sliding_window`` applies to every layer (Mistral, Phi-3). ``kvtool_attention`` checks every
    call against this table, so a model that disagrees fails loudly instead of computing wrongly.
    """
    c = text_config(config)
    n = int(c.num_hidden_layers)
    window = getattr(c, "sliding_window", None)
    types = getattr(c, "layer_types", None)
    if types:
        return [int(window) if t == SLIDING and window else None for t in types[:n]]
    return [int(window) if window else None] * n


def window_capacity(window: int, budget: int | None) -> int:
    """Tokens a sliding layer keeps after a block: ``W - 1`` (exact), or fewer under a smaller budget."""
    cap = window - 1
    return cap if budget is None else max(1, min(cap, budget))


def layer_kinds(config: Any, budget: int | None) -> dict[str, Any]:
    """How many layers are global / sliding and what a sliding layer keeps (for memory plans)."""
    windows = layer_windows(config)
    sliding = [w for w in windows if w is not None]
    window = max(sliding) if sliding else 0
    return {
        "global_layers": len(windows) - len(sliding),
        "sliding_layers": len(sliding),
        "sliding_window": window,
        "sliding_capacity": window_capacity(window, budget) if sliding else 0,
    }


SINK_MODEL_TYPES = frozenset({"gpt_oss"})
SINKS_MESSAGE = "attention-sink logits (s_aux, as in gpt-oss) are not supported by kvtool"


def check_config(config: Any) -> None:
    """The config-level part of ``check_supported`` (runs before any weight is loaded)."""
    c = text_config(config)
    kind = getattr(c, "model_type", None) or type(c).__name__
    if kind in SINK_MODEL_TYPES:
        raise UsageError(f"{kind}: {SINKS_MESSAGE}")
    if getattr(c, "attention_chunk_size", None):
        raise UsageError(f"{kind}: chunked local attention (attention_chunk_size) is not supported by kvtool")
    if getattr(c, "cross_attention_layers", None):
        raise UsageError(f"{kind}: cross-attention layers (cross_attention_layers) are not supported by kvtool (they "
                         "hold no cache for a document, and kvtool plans and keeps one per layer)")
    if getattr(c, "use_bidirectional_attention", False):
        raise UsageError(f"{kind}: bidirectional attention is not supported by kvtool (it streams causally)")
    types = getattr(c, "layer_types", None) or []
    other = sorted({t for t in types if t not in (FULL, SLIDING)})
    if other:
        raise UsageError(f"{kind}: layer type {other[0]!r} is not supported by kvtool (only full and sliding "
                         "attention)")
    v_dim = getattr(c, "v_head_dim", None)
    qk_dim = getattr(c, "qk_head_dim", None) or getattr(c, "head_dim", None)
    if v_dim is not None and qk_dim is not None and v_dim != qk_dim:
        raise UsageError(f"{kind}: keys and values of different widths (multi-head latent attention) are not "
                         "supported by kvtool")
