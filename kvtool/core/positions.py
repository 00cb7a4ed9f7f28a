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
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvtool.errors import UsageError

# Rope types whose frequencies do not depend on the sequence length, so a fixed inv_freq is exact.
STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}


def _rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
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

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> Rotator:
        config = model.config
        rope = None
        for mod in model.modules():
            if hasattr(mod, "inv_freq") and "rotary" in type(mod).__name__.lower():
                rope = mod
                break
        if rope is None:
            raise UsageError(
                f"--positions compact needs a RoPE model; {type(model).__name__} has no rotary embedding "
                "(use --positions absolute)"
            )
        rtype = _rope_type(config)
        if rtype not in STATIC_ROPE_TYPES:
            raise UsageError(
                f"--positions compact does not support rope type {rtype!r} (frequencies depend on length); "
                "use --positions absolute"
            )
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(rope.inv_freq, head_dim)

    def rotate(self, keys: Tensor, delta: Tensor) -> Tensor:
        """keys [h, n, d] rotated by delta [h, n] (or [n]) positions, returned in keys' dtype."""
        inv = self.inv_freq.to(keys.device)
        angles = delta.to(torch.float32).unsqueeze(-1) * inv  # [h, n, d/2]
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        k = keys.float()
        half = k.shape[-1] // 2
        rotated_half = torch.cat((-k[..., half:], k[..., :half]), dim=-1)
        return (k * cos + rotated_half * sin).to(keys.dtype)
