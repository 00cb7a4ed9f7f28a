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

Everything is quantized on insert, the block being fed included: one code path. int4 also keeps its newest
``config.KV_WINDOW_TOKENS`` tokens in 16 bits beside their codes (``RecentWindow``, KIVI's full-precision
residual): most of a query's attention goes to its nearest tokens, and int4's step on them is what cost
+16% perplexity at equal tokens; with the window it is within 1% (docs/results.md).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from kvtool.config import KV_WINDOW_TOKENS
from kvtool.core.costs import kv_token_head_bytes
from kvtool.errors import UsageError

#: a layer's RoPE rotation: keys [h, n, d] turned by [h, n] positions (``positions.Rotator.rotate``)
Rotate = Callable[[Tensor, Tensor], Tensor]
#: ``Scratch.encoder``'s views: rotated values, a second float32 buffer, the scales, int4's codes and high nibbles
EncoderViews = tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]
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

    @property
    def window(self) -> int:
        """Newest tokens also kept in 16 bits (``RecentWindow``; 0: none)."""
        return KV_WINDOW_TOKENS.get(self.name, 0)

    def tail(self, head_dim: int) -> int:
        """Stored elements per token and head (int4: two codes per byte)."""
        return head_dim // 2 if self.name == "int4" else head_dim

    def bytes_per_token_head(self, head_dim: int) -> int:
        """Bytes of one token's key (or value) in one head, its scale included."""
        return kv_token_head_bytes(self.name, head_dim, self.storage_dtype.itemsize)

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """``x`` [.., d] → (codes [.., d'], scale [..] float16, or None for a float format), newly allocated
        (tests and benches; the cache writes through ``encode_into``)."""
        data = torch.empty(*x.shape[:-1], self.tail(x.shape[-1]), dtype=self.storage_dtype, device=x.device)
        scale = torch.empty(x.shape[:-1], dtype=SCALE_DTYPE, device=x.device) if self.integer else None
        self.encode_into(x, data, scale, Scratch(x.dtype, x.device))
        return data, scale

    def encode_into(self, x: Tensor, data: Tensor, scale: Tensor | None, scratch: Scratch,
                    chunk: int | None = None) -> None:
        """Encode ``x`` [.., m, d] into ``data`` [.., m, d'] and ``scale`` [.., m] (None for a float format),
        which may be strided views of the cache's own buffers.

        The float32 work runs in ``scratch``'s encode buffers, ``chunk`` tokens at a time (None: all at
        once). The cache passes its block size, so writing a block, a decoded token or a longer passage
        (a recalled one, a long question) allocates nothing once the buffers exist."""
        if not self.integer:
            data.copy_(x)
            return
        assert scale is not None
        m = x.shape[-2]
        c = max(1, m if chunk is None else chunk)
        for a in range(0, m, c):
            n = min(c, m - a)
            self._encode_chunk(x.narrow(-2, a, n), data.narrow(-2, a, n), scale.narrow(-1, a, n), scratch)

    def _encode_chunk(self, x: Tensor, data: Tensor, scale: Tensor, scratch: Scratch) -> None:
        y, work, s, nibbles, high = scratch.encoder(tuple(x.shape), self.name == "int4")
        if self.rotate:
            src = x if x.dtype == torch.float32 else work.copy_(x)
            torch.matmul(src, hadamard_matrix(x.shape[-1], torch.float32, x.device), out=y)
        else:
            y.copy_(x)
        torch.amax(torch.abs(y, out=work), -1, out=s)  # the largest |y| of each token and head
        # nearest float16: |x| / scale ≤ qmax · (1 + 2⁻¹¹) < qmax + ½, so the clamp stays within half a step;
        # re-encoding a decoded row finds the same scale (rounding up would move it one ulp each time)
        scale.copy_(s.div_(self.qmax).clamp_(_SCALE_MIN, _SCALE_MAX))
        s.copy_(scale)  # the codes are taken against the stored (float16) scale
        q = torch.div(y, s.unsqueeze(-1), out=work).round_().clamp_(-self.qmax, self.qmax)
        if nibbles is None or high is None:
            data.copy_(q)
            return
        nibbles.copy_(q.add_(8))
        torch.bitwise_or(nibbles[..., 0::2], torch.bitwise_left_shift(nibbles[..., 1::2], 4, out=high), out=data)

    def decode(self, data: Tensor, scale: Tensor | None, out: Tensor, work: Tensor | None = None,
               scratch: Scratch | None = None) -> Tensor:
        """Write the values ``data`` (and ``scale``) stand for into ``out`` [h, n, d] (any float dtype); returns it.

        ``work``: a tensor of ``out``'s shape and dtype where rotated codes are scaled before one batched
        product with ``H`` writes ``out`` (None: allocated here; the scratch passes its own). ``scratch``:
        where int4's nibbles are split (None: allocated here)."""
        if not self.integer:
            return out.copy_(data)
        assert scale is not None
        scaled = out
        if self.rotate:
            scaled = work if work is not None else torch.empty_like(out)
        if self.name == "int8":
            scaled.copy_(data).mul_(scale.unsqueeze(-1))
        else:  # the nibbles split in uint8 (a float remainder and floor division cost 4× the whole decode)
            low = torch.empty_like(data) if scratch is None else scratch.buffer("low", tuple(data.shape), data.dtype)
            high = torch.empty_like(data) if scratch is None else scratch.buffer("high", tuple(data.shape), data.dtype)
            pairs = scaled.unflatten(-1, (-1, 2))  # [.., d/2, 2]: the even and odd elements of each byte
            pairs[..., 0].copy_(torch.bitwise_and(data, 15, out=low))
            pairs[..., 1].copy_(torch.bitwise_right_shift(data, 4, out=high))
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
    integer codes are scaled before the product with ``H`` writes the decoded K (or V). Integer codes are
    also taken here (``encoder``): float32 work for one block of tokens at most.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.device = device
        self.keys = torch.empty(0, dtype=dtype, device=device)
        self.values = torch.empty(0, dtype=dtype, device=device)
        self.scaled = torch.empty(0, dtype=dtype, device=device)
        self.extra: dict[str, Tensor] = {}  # int4's window reads (``RecentWindow``) and the encoder's, by name
        self.encoders: dict[tuple[tuple[int, ...], bool], EncoderViews] = {}  # ``encoder``'s, by chunk shape

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

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """A named buffer viewed as ``shape`` (contents undefined), grown only when a larger one is asked for."""
        numel = math.prod(shape)
        buf = self.extra.get(name)
        if buf is None or buf.dtype != dtype or _too_small(buf, numel):
            buf = self.extra[name] = torch.empty(numel, dtype=dtype, device=self.device)
            self.encoders.clear()  # views of the buffer replaced are stale
        return buf[:numel].view(shape)

    def encoder(self, shape: tuple[int, ...], int4: bool) -> EncoderViews:
        """``KVCodec.encode_into``'s work for a chunk of ``shape`` [.., m, d]: the rotated values and a second
        float32 buffer, a float32 scale per token, and for int4 the unpacked codes and shifted high nibbles.
        The views are made once per chunk shape (a block, a decoded token), until a buffer is replaced."""
        views = self.encoders.get((shape, int4))
        if views is None or _too_small(views[0], 0):
            half = (*shape[:-1], shape[-1] // 2)
            views = (self.buffer("enc_y", shape, torch.float32), self.buffer("enc_work", shape, torch.float32),
                     self.buffer("enc_scale", shape[:-1], torch.float32),
                     self.buffer("enc_nibbles", shape, torch.uint8) if int4 else None,
                     self.buffer("enc_high", half, torch.uint8) if int4 else None)
            self.encoders[(shape, int4)] = views
        return views

    def nbytes(self) -> int:
        extra = sum(b.numel() * b.element_size() for b in self.extra.values())
        return (2 * self.keys.numel() + self.scaled.numel()) * self.keys.element_size() + extra


def _too_small(buf: Tensor, numel: int) -> bool:
    """Whether ``buf`` must be replaced to hold ``numel`` elements now: too small, or made under inference
    mode and read outside it (a read after the engine's step cannot write an inference tensor)."""
    return numel > buf.numel() or (buf.is_inference() and not torch.is_inference_mode_enabled())


class RecentWindow:
    """The K/V of a group's newest ``size`` appended tokens in 16 bits, beside their codes (KIVI's residual).

    Rows are indexed by original position modulo ``size`` and remember the position they hold, so eviction's
    gathers, recall's merges and re-packs, which move slots, never touch it: a read decodes every stored
    token from its codes, then a stored token whose position its row holds (one of the newest ``size``)
    reads the row instead. Keys are kept at their original positions (the model's own rotation) and turned
    to the RoPE position a token holds now when read, so a compact re-pack costs the window nothing.
    Recalled tokens (older positions) never enter it. Kept in the compute dtype when it is 16-bit, in
    bfloat16 for a float32 model (its rounding is 50× finer than int4's step).
    """

    def __init__(self, heads: int, size: int, head_dim: int, compute: torch.dtype, device: torch.device) -> None:
        dtype = torch.bfloat16 if compute.itemsize > 2 else compute
        self.size = size
        self.keys = torch.zeros(heads, size, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.pos = torch.full((heads, size), -1, dtype=torch.long, device=device)

    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size() + self.pos.numel() * self.pos.element_size()

    def record(self, keys: Tensor, values: Tensor, positions: Tensor, scratch: Scratch) -> None:
        """Remember appended tokens: ``keys`` [h, m, d] at their original positions, ``positions`` [h, m]
        consecutive and the newest (only the last ``size`` of a longer block)."""
        m = min(keys.shape[1], self.size)
        rows = torch.remainder(positions[0, -m:], self.size, out=scratch.buffer("rows", (m,), torch.long))
        self.keys.index_copy_(1, rows, keys[:, -m:].to(self.keys.dtype))
        self.values.index_copy_(1, rows, values[:, -m:].to(self.values.dtype))
        self.pos.index_copy_(1, rows, positions[:, -m:])

    def overlay(self, name: str, out: Tensor, positions: Tensor, shift: Tensor | None, rotate: Rotate | None,
                scratch: Scratch) -> None:
        """Write the window's K (``name`` "keys" or "origin") or V ("values") over the stored tokens of
        ``out`` [h, w, d] (the newest w ≤ ``size`` stored tokens, at ``positions`` [h, w]) it holds.

        ``shift`` [h, w]: RoPE position minus original position of those tokens, ``rotate`` the layer's
        rotation, for keys read at compact positions (None: keys read at their original positions).
        Works in ``scratch``'s shared buffers: a read allocates nothing (but the rotation's)."""
        h, w = positions.shape
        table = self.values if name == "values" else self.keys
        rows = torch.remainder(positions, self.size, out=scratch.buffer("rows", (h, w), torch.long))
        held = torch.gather(self.pos, 1, rows, out=scratch.buffer("held", (h, w), torch.long))
        ok = torch.eq(held, positions, out=scratch.buffer("ok", (h, w), torch.bool))
        src = scratch.buffer("rows16", (h, w, table.shape[-1]), table.dtype)
        torch.gather(table, 1, rows.unsqueeze(-1).expand(-1, -1, table.shape[-1]), out=src)
        row = src if name != "keys" or rotate is None or shift is None else rotate(src, shift)
        torch.where(ok.unsqueeze(-1), row, out, out=out)

    def reset(self) -> None:
        self.pos.fill_(-1)

    def state(self) -> dict[str, Tensor]:
        return {"window_keys": self.keys, "window_values": self.values, "window_pos": self.pos}

    def load(self, tensors: dict[str, Tensor]) -> None:
        """Restore from ``state()``'s tensors; a file without them reads every token from its codes."""
        if "window_pos" not in tensors or tensors["window_pos"].shape != self.pos.shape:
            self.reset()
            return
        for name, t in self.state().items():
            t.copy_(tensors[name])
