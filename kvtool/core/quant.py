"""How a head group stores K/V when not in the model's compute dtype: a narrower float, or int8 / int4.

    store:  x [.., d] (compute dtype) ──encode──▶ data [.., d'] + scale [..] (float16, integers only)
    read:   data, scale ──decode──▶ a reused scratch [h, slots, d] in the compute dtype ──▶ attention

Integer codes are symmetric, one scale per token and KV head (for keys and values alike):
``scale = absmax / qmax`` (qmax = 127 for int8, 7 for int4), ``q = round(x / scale)``, read back as
``q · scale``. Every element comes back within half a step (``scale / 2``) of the original. int4 packs two
codes per byte (``q + 8`` in each nibble), so ``d' = d / 2``. The scale is stored in float16, rounded *up*
so that ``|x| / scale`` never passes qmax (no clipping) and floored at float16's smallest normal number.
Encoding what was decoded gives the same codes and scale back (recall re-inserts archived tokens losslessly).

Why per token and head rather than KIVI's per-channel keys: the bounded cache evicts single tokens. A
per-token scale moves with its token through every gather, permute and ``.kvc`` save; a scale shared by
a group of tokens along a channel would be left describing tokens that eviction has separated, forcing a
re-quantization of the survivors on every eviction step (with its error each time). Keys with outlier
channels pay for it with a coarser step on the other channels of that token: on SmolLM2-135M per-channel
keys would halve the attention error (``bench/kv_quant_error.py``; the figures are in docs/performance.md),
and int8 per token stays within a few percent of full precision at every layer.

Everything is quantized on insert, the block being fed and the recent window included: one code path,
and the block's own queries see the K/V every later query will see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvtool.config import kv_token_head_bytes
from kvtool.errors import UsageError

#: ``--kv-dtype`` values that store integer codes (the others are float dtypes)
INTEGER_KV = {"int8": 127, "int4": 7}
#: the scales' dtype (2 bytes per token, head and K/V)
SCALE_DTYPE = torch.float16
_SCALE_MIN = 2.0**-14  # float16's smallest normal number
_SCALE_MAX = 65504.0
_FLOATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class KVCodec:
    """A K/V storage format other than the compute dtype: ``name`` ∈ float32, bfloat16, float16, int8, int4."""

    name: str

    @property
    def qmax(self) -> int:
        return INTEGER_KV.get(self.name, 0)

    @property
    def integer(self) -> bool:
        return self.name in INTEGER_KV

    @property
    def storage_dtype(self) -> torch.dtype:
        if self.name == "int8":
            return torch.int8
        if self.name == "int4":
            return torch.uint8
        return _FLOATS[self.name]

    def tail(self, head_dim: int) -> int:
        """Stored elements per token and head (int4: two codes per byte)."""
        return head_dim // 2 if self.name == "int4" else head_dim

    def bytes_per_token_head(self, head_dim: int) -> int:
        """Bytes of one token's key (or value) in one head, its scale included."""
        return kv_token_head_bytes(self.name, head_dim, self.storage_dtype.itemsize)

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """``x`` [.., d] → (codes [.., d'], scale [..] float16, or None for a float format)."""
        if not self.integer:
            return x.to(self.storage_dtype), None
        xf = x.float()
        absmax = xf.abs().amax(-1)
        exact = (absmax / self.qmax).clamp_(_SCALE_MIN, _SCALE_MAX)
        scale = exact.to(SCALE_DTYPE)  # rounded up to float16, so |x| / scale <= qmax: no clipping
        scale = torch.where(scale.float() < exact, torch.nextafter(scale, torch.full_like(scale, _SCALE_MAX)), scale)
        q = torch.round(xf / scale.float().unsqueeze(-1)).clamp_(-self.qmax, self.qmax)
        if self.name == "int8":
            return q.to(torch.int8), scale
        u = (q + 8).to(torch.uint8)
        return u[..., 0::2] | (u[..., 1::2] << 4), scale

    def decode(self, data: Tensor, scale: Tensor | None, out: Tensor) -> Tensor:
        """Write the values ``data`` (and ``scale``) stand for into ``out`` [.., d] (any float dtype); returns it."""
        if not self.integer:
            return out.copy_(data)
        assert scale is not None
        if self.name == "int8":
            return out.copy_(data).mul_(scale.unsqueeze(-1))
        # in place on ``out`` (no temporaries): low nibble = byte mod 16, high nibble = byte // 16
        pairs = out.unflatten(-1, (-1, 2))  # [.., d/2, 2]: the even and odd elements of each byte
        pairs[..., 0].copy_(data).remainder_(16)
        pairs[..., 1].copy_(data).div_(16, rounding_mode="floor")
        return out.sub_(8).mul_(scale.unsqueeze(-1))


def codec_for(kv_dtype: str | None, compute: torch.dtype, head_dim: int) -> KVCodec | None:
    """The codec of a ``--kv-dtype`` setting, or None when K/V stay in the compute dtype (auto, or the same)."""
    if kv_dtype is None or kv_dtype == "auto" or _FLOATS.get(kv_dtype) == compute:
        return None
    if kv_dtype not in INTEGER_KV and kv_dtype not in _FLOATS:
        raise UsageError(f"unknown kv dtype {kv_dtype!r}", field="kv_dtype")
    if kv_dtype == "int4" and head_dim % 2:
        raise UsageError(f"--kv-dtype int4 packs two values per byte: head dim {head_dim} is odd", field="kv_dtype")
    return KVCodec(kv_dtype)


class Scratch:
    """One growing pair of compute-dtype buffers the stored K/V are decoded into, shared by a cache's groups.

    Attention, the policy's scores and the archive read a group's K/V within one layer's step; every layer
    decodes into the same storage, so its size is one group's K/V at full precision (the largest group),
    grown only when a group's slots grow, never per block or token.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.device = device
        self.keys = torch.empty(0, dtype=dtype, device=device)
        self.values = torch.empty(0, dtype=dtype, device=device)

    def views(self, h: int, slots: int, d: int) -> tuple[Tensor, Tensor]:
        """Key and value buffers viewed as [h, slots, d] (contents undefined until decoded into)."""
        numel = h * slots * d
        # a buffer made under inference mode cannot be written outside it (a read after the engine's step)
        if numel > self.keys.numel() or (self.keys.is_inference() and not torch.is_inference_mode_enabled()):
            self.keys = torch.empty(numel, dtype=self.dtype, device=self.device)
            self.values = torch.empty(numel, dtype=self.dtype, device=self.device)
        return self.keys[:numel].view(h, slots, d), self.values[:numel].view(h, slots, d)

    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()
