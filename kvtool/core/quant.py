"""How a head group stores K/V when not in the model's compute dtype: a narrower float, or int8 / int4.

    store:  x [.., d] (compute dtype) ──rotate──▶ x·H ──encode──▶ data [.., d'] + scale [..] (float16)
    read:   data, scale ──decode──▶ (q · scale)·H into a reused scratch [h, slots, d] ──▶ attention

Integer codes are symmetric, one scale per token and KV head (for keys and values alike), taken after an
orthonormal Walsh–Hadamard rotation ``H`` of the head dimension (in blocks of the largest power of two
dividing it; ``H`` is its own inverse): ``y = x·H``, ``scale = absmax(y) / qmax`` (qmax = 127 for int8, 7
for int4), ``q = round(y / scale)``, read back as ``(q · scale)·H``. In the rotated frame every element
comes back within half a step (``scale / 2``) of ``y``; ``H`` is orthogonal, so the error's L2 norm per
token is the same in the model's frame. int4 packs two codes per byte (``q + 8`` in each nibble), so
``d' = d / 2``. The scale is stored in float16 (nearest; ``|y| / scale`` may pass qmax by 0.05%, which the
clamp absorbs within the half step) and floored at float16's smallest normal number. In float32, encoding
what was decoded gives the same codes and scale back (recall re-inserts archived tokens losslessly); a
16-bit compute dtype's rounding of the decoded values can move a few codes by a step.

Why the rotation: keys have outlier channels; a per-token scale must cover them, leaving a coarse step
for every other channel. ``H`` spreads each channel over all of them (QuaRot; llama.cpp's rotated
q4_0), so the scale fits the token's norm instead of its largest channel: on SmolLM2-135M it halves the
attention error of int8 and of int4, to what KIVI's per-channel keys reach (``bench/kv_quant_error.py``,
figures in docs/performance.md).

Why per token and head rather than KIVI's per-channel keys: the bounded cache evicts single tokens. A
per-token scale moves with its token through every gather, permute and ``.kvc`` save; a scale shared by
a group of tokens along a channel would be left describing tokens that eviction has separated, forcing a
re-quantization of the survivors on every eviction step (with its error each time).

Everything is quantized on insert, the block being fed and the recent window included: one code path,
and the block's own queries see the K/V every later query will see.
"""

from __future__ import annotations

import functools
import math
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


@functools.lru_cache(maxsize=16)
def hadamard_matrix(d: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The orthonormal Walsh–Hadamard matrix [d, d], block-diagonal in blocks of ``b`` = the largest power of
    two dividing ``d`` (symmetric, its own inverse); built once per (d, dtype, device)."""
    b = d & -d
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.block_diag(*[h / math.sqrt(b)] * (d // b)).to(dtype=dtype, device=device)


def hadamard(x: Tensor) -> Tensor:
    """``x·H`` over the last dimension (a new tensor)."""
    return x @ hadamard_matrix(x.shape[-1], x.dtype, x.device)


@dataclass(frozen=True)
class KVCodec:
    """A K/V storage format other than the compute dtype: ``name`` ∈ float32, bfloat16, float16, int8, int4.

    ``rotate``: integer codes are taken in the Hadamard-rotated frame (the default; False only for
    ``bench/kv_quant_error.py``'s comparison)."""

    name: str
    rotate: bool = True

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
        xf = hadamard(x.float()) if self.rotate else x.float()
        absmax = xf.abs().amax(-1)
        # nearest float16: |x| / scale ≤ qmax · (1 + 2⁻¹¹) < qmax + ½, so the clamp stays within half a step;
        # re-encoding a decoded row finds the same scale (rounding up would move it one ulp each time)
        scale = (absmax / self.qmax).clamp_(_SCALE_MIN, _SCALE_MAX).to(SCALE_DTYPE)
        q = torch.round(xf / scale.float().unsqueeze(-1)).clamp_(-self.qmax, self.qmax)
        if self.name == "int8":
            return q.to(torch.int8), scale
        u = (q + 8).to(torch.uint8)
        return u[..., 0::2] | (u[..., 1::2] << 4), scale

    def decode(self, data: Tensor, scale: Tensor | None, out: Tensor, work: Tensor | None = None) -> Tensor:
        """Write the values ``data`` (and ``scale``) stand for into ``out`` [h, n, d] (any float dtype); returns it.

        ``work``: a tensor of ``out``'s shape and dtype where rotated codes are scaled before one batched
        product with ``H`` writes ``out`` (None: allocated here; the scratch passes its own)."""
        if not self.integer:
            return out.copy_(data)
        assert scale is not None
        scaled = out
        if self.rotate:
            scaled = work if work is not None else torch.empty_like(out)
        if self.name == "int8":
            scaled.copy_(data).mul_(scale.unsqueeze(-1))
        else:  # in place (no temporaries): low nibble = byte mod 16, high nibble = byte // 16
            pairs = scaled.unflatten(-1, (-1, 2))  # [.., d/2, 2]: the even and odd elements of each byte
            pairs[..., 0].copy_(data).remainder_(16)
            pairs[..., 1].copy_(data).div_(16, rounding_mode="floor")
            scaled.sub_(8).mul_(scale.unsqueeze(-1))
        if not self.rotate:
            return out
        h = hadamard_matrix(out.shape[-1], out.dtype, out.device)
        if out.dim() != 3:  # not the cache's [h, n, d] (a caller's own tensor): one product, allocated
            return out.copy_(scaled @ h)
        return torch.bmm(scaled, h.expand(out.shape[0], -1, -1), out=out)  # writes a strided ``out`` in place


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
    grown only when a group's slots grow, never per block or token; plus one more such buffer where rotated
    integer codes are scaled before the product with ``H`` writes the decoded K (or V).
    """

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.device = device
        self.keys = torch.empty(0, dtype=dtype, device=device)
        self.values = torch.empty(0, dtype=dtype, device=device)
        self.scaled = torch.empty(0, dtype=dtype, device=device)

    def views(self, h: int, slots: int, d: int) -> tuple[Tensor, Tensor]:
        """Key and value buffers viewed as [h, slots, d] (contents undefined until decoded into)."""
        numel = h * slots * d
        if _too_small(self.keys, numel):
            self.keys = torch.empty(numel, dtype=self.dtype, device=self.device)
            self.values = torch.empty(numel, dtype=self.dtype, device=self.device)
        return self.keys[:numel].view(h, slots, d), self.values[:numel].view(h, slots, d)

    def work(self, shape: torch.Size) -> Tensor:
        """A buffer of ``shape`` in the compute dtype where ``KVCodec.decode`` scales rotated codes."""
        numel = shape.numel()
        if _too_small(self.scaled, numel):
            self.scaled = torch.empty(max(numel, self.keys.numel()), dtype=self.dtype, device=self.device)
        return self.scaled[:numel].view(shape)

    def nbytes(self) -> int:
        return (2 * self.keys.numel() + self.scaled.numel()) * self.keys.element_size()


def _too_small(buf: Tensor, numel: int) -> bool:
    """Whether ``buf`` must be replaced to hold ``numel`` elements now: too small, or made under inference
    mode and read outside it (a read after the engine's step cannot write an inference tensor)."""
    return numel > buf.numel() or (buf.is_inference() and not torch.is_inference_mode_enabled())
