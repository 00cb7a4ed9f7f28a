"""What kvtool knows about model families: sliding-window layers, and the features it refuses.

Sliding-window layers (Mistral v0.1-style configs, Phi-3, Gemma 2/3's local layers, Qwen2/3 with
``use_sliding_window``) only ever attend to the last ``W`` tokens: transformers' mask lets query
``t`` see key ``p`` iff ``0 <= t - p < W``. Such a layer needs no policy: after a block it keeps
the ``W - 1`` newest tokens — exactly what the next query can still see — and drops the rest
(``WindowPolicy``). Within a block, earlier queries see older keys than later ones, so a sliding
group holds ``W - 1 + block`` slots while a block is in, and ``core/attention.py`` masks each
query row by distance. The budget and the policy apply to the global (full-attention) layers only.

If the budget is smaller than ``W - 1``, a sliding layer keeps the ``budget`` newest tokens (a
narrower window; never more than the budget per KV head and layer, the core invariant). The
window mask still applies, so the result equals the model run with that narrower window.

A model whose attention needs something kvtool does not implement (attention-sink logits, chunked
or bidirectional attention, layer types other than full/sliding attention, keys and values of
different widths) is refused up front by ``check_supported`` with one line naming the feature,
instead of running with silently wrong results.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from kvtool.core.contract import GroupSpec, Policy, PolicyEnv, ScoreContext
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


@dataclass
class WindowPolicy(Policy):
    """Policy-free eviction for sliding-window layers: keep the ``capacity`` newest tokens.

    Attention-free and stateless; ignores the engine's sinks, recent window and pins on purpose:
    tokens that left the window are invisible to the model, so keeping them would change nothing
    but the memory.
    """

    name = "window"
    description = "sliding-window layer: keeps the newest W - 1 tokens (exact)"
    window: int = 0
    _keep: dict[tuple[int, int, int], Tensor] = field(default_factory=dict, repr=False)

    def select(self, ctx: ScoreContext) -> Tensor:
        """The last ``capacity`` of ``n`` stored tokens; one index per (n, capacity), reused every block."""
        h, n, c = ctx.positions.shape[0], ctx.n, ctx.capacity
        key = (h, n, c)
        if key not in self._keep:
            self._keep[key] = torch.arange(n - c, n, device=ctx.positions.device).unsqueeze(0).expand(h, c)
        return self._keep[key]


def window_specs(window: int, env: PolicyEnv) -> list[GroupSpec]:
    """The head layout of a sliding layer: every KV head in one group at the window's capacity."""
    return [GroupSpec(heads=list(range(env.num_kv_heads)), capacity=window_capacity(window, env.budget),
                      policy=WindowPolicy(window=window), window=window)]


#: Families whose attention adds learned per-head sink logits (``s_aux``), known from the config alone so that
#: loading can refuse them before reading weights; ``check_supported`` also finds them on a loaded model.
SINK_MODEL_TYPES = frozenset({"gpt_oss"})
SINKS_MESSAGE = "attention-sink logits (s_aux, as in gpt-oss) are not supported by kvtool"


def check_supported(model: torch.nn.Module) -> None:
    """Refuse, with one line naming the missing feature, a model whose attention kvtool cannot reproduce."""
    c = text_config(model.config)
    kind = getattr(c, "model_type", None) or type(model).__name__
    for mod in model.modules():
        sinks = getattr(mod, "sinks", None)
        if isinstance(sinks, torch.Tensor) and hasattr(mod, "layer_idx"):
            raise UsageError(f"{kind}: {SINKS_MESSAGE}")
    check_config(model.config)


def check_config(config: Any) -> None:
    """The config-level part of ``check_supported`` (runs before any weight is loaded)."""
    c = text_config(config)
    kind = getattr(c, "model_type", None) or type(c).__name__
    if kind in SINK_MODEL_TYPES:
        raise UsageError(f"{kind}: {SINKS_MESSAGE}")
    if getattr(c, "attention_chunk_size", None):
        raise UsageError(f"{kind}: chunked local attention (attention_chunk_size) is not supported by kvtool")
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
