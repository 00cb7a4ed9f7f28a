"""RoPE re-rotation for ``--positions compact`` (StreamingLLM §3.2 "rolling" positions).

Keys are stored after RoPE. When a key's slot position changes by δ, rotating it by δ gives exactly
the key RoPE would have produced at the new position, because RoPE rotations compose:
R(p + δ) = R(δ) · R(p). We rotate in float32 from the model's own ``inv_freq`` (which already holds
linear / llama3 / YaRN frequency scaling), so scaled-RoPE configs work; YaRN's attention factor
multiplies cos/sin once at the original rotation and must not be applied again, which is why the
rotation is built from ``inv_freq`` and not from the module's cos/sin output.

Chosen over "store un-rotated keys and rotate at attention time": rotating by δ touches only the keys
whose slot moved, once per re-pack (see ``BoundedCache.compact_group``), while rotate-at-attention
re-rotates the whole cache in every layer for every block and decoded token; ``bench/positions.py``
prints both costs.

Models with one RoPE per layer type (Gemma 3: base 10 000 on local layers, 1 000 000 with linear
scaling on global ones) get one rotator per type; ``Rotator.for_layer`` hands each layer its own, so
a re-pack rotates every key with the frequencies it was rotated with in the first place.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvtool.errors import UsageError

# Rope types whose frequencies do not depend on the sequence length, so a fixed inv_freq is exact.
STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}


def _rope_type(config, layer_type: str | None = None) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if layer_type is not None and isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    if isinstance(params, dict):
        return str(params.get("rope_type", params.get("type", "default")) or "default")
    return "default"


class Rotator:
    """Rotates stored keys by per-token position deltas."""

    def __init__(self, inv_freq: Tensor, head_dim: int) -> None:
        if inv_freq.numel() * 2 != head_dim:
            raise UsageError(
                f"--positions compact supports full-dimension RoPE only (rotary dim {inv_freq.numel() * 2} "
                f"!= head dim {head_dim}); use --positions absolute"
            )
        self.inv_freq = inv_freq.detach().float()
        self.layers: list[Rotator] | None = None  # per-layer rotators when layer types use different RoPEs

    def for_layer(self, layer_idx: int) -> Rotator:
        """The rotator of one layer (itself unless the model has one RoPE per layer type)."""
        return self if self.layers is None else self.layers[layer_idx]

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> Rotator:
        config = model.config
        get_text = getattr(config, "get_text_config", None)
        config = get_text() if callable(get_text) else config
        rope = None
        for mod in model.modules():
            names = [n for n, _ in mod.named_buffers(recurse=False) if n.endswith("inv_freq")]
            if names and "rotary" in type(mod).__name__.lower():
                rope = mod
                break
        if rope is None:
            raise UsageError(
                f"--positions compact needs a RoPE model; {type(model).__name__} has no rotary embedding "
                "(use --positions absolute)"
            )
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if hasattr(rope, "inv_freq"):
            _check_static(_rope_type(config))
            return cls(rope.inv_freq, head_dim)
        # one RoPE per layer type (Gemma 3): ``{layer_type}_inv_freq`` buffers
        types = list(getattr(config, "layer_types", None) or [])
        per_type: dict[str, Rotator] = {}
        for t in dict.fromkeys(types):
            inv = getattr(rope, f"{t}_inv_freq", None)
            if not isinstance(inv, Tensor):
                raise UsageError(f"--positions compact: no RoPE frequencies for layer type {t!r}; "
                                 "use --positions absolute")
            _check_static(_rope_type(config, t))
            per_type[t] = cls(inv, head_dim)
        if not per_type:
            raise UsageError("--positions compact: the rotary embedding has no plain inv_freq and the model no "
                             "layer types; use --positions absolute")
        first = per_type[types[0]]
        out = cls(first.inv_freq, head_dim)
        out.layers = [per_type[t] for t in types[: config.num_hidden_layers]]
        return out

    def rotate(self, keys: Tensor, delta: Tensor) -> Tensor:
        """keys [h, n, d] rotated by delta [h, n] (or [n]) positions, returned in keys' dtype."""
        inv = self.inv_freq.to(keys.device)
        angles = delta.to(torch.float32).unsqueeze(-1) * inv  # [h, n, d/2]: each angle serves both halves
        cos, sin = angles.cos(), angles.sin()
        k = keys.float()
        half = k.shape[-1] // 2
        k1, k2 = k[..., :half], k[..., half:]
        out = torch.empty_like(k)
        torch.sub(k1 * cos, k2 * sin, out=out[..., :half])  # rotate_half: (k1, k2) → (−k2, k1)
        torch.add(k2 * cos, k1 * sin, out=out[..., half:])
        return out.to(keys.dtype)


def _check_static(rtype: str) -> None:
    if rtype not in STATIC_ROPE_TYPES:
        raise UsageError(
            f"--positions compact does not support rope type {rtype!r} (frequencies depend on length); "
            "use --positions absolute"
        )
