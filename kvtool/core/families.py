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
or bidirectional attention, layer types other than full/sliding attention, cross-attention layers, keys
and values of different widths) is refused up front by ``check_supported`` with one line naming the feature,
instead of running with silently wrong results.

Interleaved RoPE (Cohere, GLM, GPT-J, ERNIE 4.5, Helium: each rotated pair is two neighbouring
dimensions, ``rotate_half`` takes ``x[..., ::2]`` and ``x[..., 1::2]``) works at absolute positions, where
stored keys are never touched again; compact positions re-rotate stored keys by splitting them into
halves (``core/positions.py``), which would be silently wrong for it. ``check_supported`` therefore
refuses such a model whenever compact positions are possible (``compact`` or ``auto``). It knows the
families by name and by the config's ``rope_interleave`` flag, and probes the modeling module's own
``rotate_half`` on one vector, so that a family added to transformers later is caught too.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvtool.core.contract import GroupSpec, Policy, PolicyEnv, ScoreContext
from kvtool.core.layout import SINKS_MESSAGE, check_config, text_config, window_capacity
from kvtool.errors import UsageError


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


#: transformers model types whose ``rotate_half`` pairs neighbouring dimensions (rotate-every-two).
INTERLEAVED_ROPE_MODEL_TYPES = frozenset({
    "blt", "codegen", "cohere", "cohere2", "cohere2_moe", "deepseek_v4", "ernie4_5", "ernie4_5_moe",
    "ernie4_5_vl_moe", "glm", "glm4", "glm4v", "glm_ocr", "gptj", "helium", "hy_v4_vl",
})
#: Position modes in which stored keys may be re-rotated (``auto`` switches to compact past the model's range).
COMPACT_MODES = ("compact", "auto")


def interleaved_rope(model: torch.nn.Module) -> bool:
    """Whether ``model`` rotates neighbouring dimension pairs (Cohere-style) instead of the two halves."""
    c = text_config(model.config)
    if getattr(c, "model_type", None) in INTERLEAVED_ROPE_MODEL_TYPES or getattr(c, "rope_interleave", False):
        return True
    names = {type(model).__module__} | {type(m).__module__ for m in model.modules()
                                         if "rotary" in type(m).__name__.lower()}
    x = torch.arange(1.0, 5.0)
    for name in sorted(names):
        rotate_half = getattr(sys.modules.get(name), "rotate_half", None)
        if not callable(rotate_half):
            continue
        try:
            rotated = rotate_half(x)
        except (RuntimeError, TypeError, ValueError, IndexError):  # an unusual signature: the name list decides
            continue
        if not torch.equal(rotated, torch.tensor([-3.0, -4.0, 1.0, 2.0])):
            return True
    return False


def check_supported(model: torch.nn.Module, positions: str = "absolute") -> None:
    """Refuse, with one line naming the missing feature, a model whose attention kvtool cannot reproduce.

    ``positions`` is the engine's position mode: interleaved RoPE is refused only where compact
    positions are possible (see the module docstring). Per-head sink logits (``s_aux``) are found on
    the loaded modules; the config-level checks (``check_config``) also run before weights are read.
    """
    c = text_config(model.config)
    kind = getattr(c, "model_type", None) or type(model).__name__
    for mod in model.modules():
        sinks = getattr(mod, "sinks", None)
        if isinstance(sinks, torch.Tensor) and hasattr(mod, "layer_idx"):
            raise UsageError(f"{kind}: {SINKS_MESSAGE}")
    check_config(model.config)
    if positions in COMPACT_MODES and interleaved_rope(model):
        raise UsageError(f"{kind}: interleaved RoPE (rotate-every-two pairs, as in Cohere) cannot be re-rotated at "
                         f"compact positions; set positions to absolute for this model (got {positions!r})",
                         field="positions")
