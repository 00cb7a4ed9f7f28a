"""RoPE re-rotation for ``--positions compact`` (StreamingLLM §3.2 "rolling" positions).

Keys are stored after RoPE. When a key's slot position changes by δ, rotating it by δ gives exactly
the key RoPE would have produced at the new position, because RoPE rotations compose:
R(p + δ) = R(δ) · R(p). We rotate in float32 from the model's own ``inv_freq`` (which already holds
linear / llama3 / YaRN frequency scaling), so scaled-RoPE configs work; YaRN's attention factor
multiplies cos/sin once at the original rotation and must not be applied again, which is why the
rotation is built from ``inv_freq`` and not from the module's cos/sin output.

Chosen over "store un-rotated keys and rotate at attention time": rotating by δ touches only the keys
whose slot moved, once per re-pack (see ``CompactPositions.after_evict``), while rotate-at-attention
re-rotates the whole cache in every layer for every block and decoded token; ``bench/positions.py``
prints both costs. A 16-bit cache keeps each key at its original position too (``HeadGroup.origin``)
and rotates from it, so a key is rounded once however many re-packs it lives through. An int8 / int4
cache (``--kv-dtype``) does the same with a quantized copy: a re-pack decodes the original key, rotates it
and encodes the result, so every stored key is at most two quantizations from the model's key, however
many re-packs it lived through (decode → rotate → encode of the stored key itself would add one rounding
per re-pack, a drift that is worst for the sinks, which every re-pack rotates); angles are
computed in float64 (positions past 2^24 are exact, and ``δ · θ`` keeps its low bits).

Models with one RoPE per layer type (Gemma 3: base 10 000 on local layers, 1 000 000 with linear
scaling on global ones) get one rotator per type; ``Rotator.for_layer`` hands each layer its own, so
a re-pack rotates every key with the frequencies it was rotated with in the first place.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import Tensor

from kvtool.config import ROTATE_CHUNK
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

    def __init__(self, inv_freq: Tensor, head_dim: int, work: RotationWork | None = None) -> None:
        if inv_freq.numel() * 2 != head_dim:
            raise UsageError(
                f"compact positions support full-dimension RoPE only (rotary dim {inv_freq.numel() * 2} "
                f"!= head dim {head_dim}); use absolute positions", field="positions")
        self.inv_freq = inv_freq.detach().float()
        self._inv64: Tensor | None = None
        self.work = work if work is not None else RotationWork()
        self.calls = 0  # rotations performed (tests count them)
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
                f"compact positions need a RoPE model; {type(model).__name__} has no rotary embedding "
                "(use absolute positions)", field="positions")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if hasattr(rope, "inv_freq"):
            _check_static(_rope_type(config))
            return cls(rope.inv_freq, head_dim)
        # one RoPE per layer type (Gemma 3): ``{layer_type}_inv_freq`` buffers
        types = list(getattr(config, "layer_types", None) or [])
        per_type: dict[str, Rotator] = {}
        work = RotationWork()  # one layer rotates at a time: the rotators share their buffers
        for t in dict.fromkeys(types):
            inv = getattr(rope, f"{t}_inv_freq", None)
            if not isinstance(inv, Tensor):
                raise UsageError(f"compact positions: no RoPE frequencies for layer type {t!r}; "
                                 "use absolute positions", field="positions")
            _check_static(_rope_type(config, t))
            per_type[t] = cls(inv, head_dim, work)
        if not per_type:
            raise UsageError("compact positions: the rotary embedding has no plain inv_freq and the model no "
                             "layer types; use absolute positions", field="positions")
        first = per_type[types[0]]
        out = cls(first.inv_freq, head_dim, work)
        out.layers = [per_type[t] for t in types[: config.num_hidden_layers]]
        return out

    def rotate(self, keys: Tensor, delta: Tensor) -> Tensor:
        """keys [h, n, d] rotated by delta [h, n] (or [n]) positions, in keys' dtype.

        Returns a view of the rotator's output buffer (``RotationWork``), valid until its next call: every
        caller copies it (into the cache, the archive) or consumes it first. Works ``ROTATE_CHUNK`` tokens at
        a time in the shared buffers, so a re-pack, a block's or a decoded token's rotation allocates nothing.
        """
        self.calls += 1
        h, n, d = keys.shape
        if self._inv64 is None or self._inv64.device != keys.device:
            self._inv64 = self.inv_freq.to(keys.device, torch.float64)
        out, steps = self.work.views(h, n, d, keys.dtype, keys.device)
        delta = delta.expand(h, n)  # a shared [n] delta too: every out= below has its exact shape
        half, whole = d // 2, len(steps) == 1
        for s, e, angles, cos, sin, t1, t2, k32, o32, o1, o2 in steps:
            dk = (delta, keys) if whole else (delta[..., s:e], keys[:, s:e])
            # each angle serves both halves; cos and sin in float64, rounded to float32 once. The angles are
            # made twice (a product) rather than held twice: a float64 result cast to float32 would need a
            # temporary of its own
            cos.copy_(angles.copy_(dk[0].unsqueeze(-1)).mul_(self._inv64).cos_())
            sin.copy_(angles.copy_(dk[0].unsqueeze(-1)).mul_(self._inv64).sin_())
            k = dk[1] if k32 is None else k32.copy_(dk[1])  # a 16-bit key turns in float32
            k1, k2 = k[..., :half], k[..., half:]
            torch.sub(torch.mul(k1, cos, out=t1), torch.mul(k2, sin, out=t2), out=o1)  # rotate_half:
            torch.add(torch.mul(k2, cos, out=t1), torch.mul(k1, sin, out=t2), out=o2)  # (k1, k2) → (−k2, k1)
            if o32 is not None:
                out[:, s:e].copy_(o32)  # rounded once, to the key's dtype
        return out


#: one step of ``Rotator.rotate``: its token range, float64 angles, float32 cos, sin and two terms, the key's
#: float32 copy and result (None for a float32 key, which is rotated straight into the output) and the two
#: halves of where the float32 result is written
Step = tuple[int, int, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor, Tensor]


class RotationWork:
    """The buffers ``Rotator.rotate`` works in, per device and dtype, grown to the largest call and never
    per call: the rotated keys (as many as the largest rotation: a group's slots, a recall's scan chunk)
    and one step's float64 angles and float32 terms. The views of a call's shape are made once."""

    #: shapes whose views are kept (a cache's rotations come in a few shapes: a block, a token, a group)
    MAX_SHAPES = 64

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype, torch.device], Tensor] = {}
        self.shapes: dict[tuple[int, int, int, torch.dtype, torch.device], tuple[Tensor, list[Step]]] = {}

    def views(self, h: int, n: int, d: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, list[Step]]:
        """The output [h, n, d] in ``dtype`` and the steps of a rotation of that shape."""
        key = (h, n, d, dtype, device)
        got = self.shapes.get(key)
        if got is None:
            half, c = d // 2, max(1, min(n, ROTATE_CHUNK))
            out = self._buffer("out", (h, n, d), dtype, device)
            angles = self._buffer("angles", (h, c, half), torch.float64, device)
            cos, sin, t1, t2 = (self._buffer(name, (h, c, half), torch.float32, device)
                                for name in ("cos", "sin", "t1", "t2"))
            wide = dtype != torch.float32
            k32, o32 = ((self._buffer(name, (h, c, d), torch.float32, device) for name in ("k32", "o32")) if wide
                        else (None, None))
            steps: list[Step] = []
            for s in range(0, n, c):
                w = min(n, s + c) - s
                k, o = (None, None) if k32 is None or o32 is None else (k32[:, :w], o32[:, :w])
                res = out[:, s : s + w] if o is None else o
                steps.append((s, s + w, angles[:, :w], cos[:, :w], sin[:, :w], t1[:, :w], t2[:, :w], k, o,
                              res[..., :half], res[..., half:]))
            if len(self.shapes) >= self.MAX_SHAPES:
                self.shapes.clear()
            got = self.shapes[key] = (out, steps)
        return got

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """Buffer ``name`` viewed as ``shape`` (contents undefined); replacing one drops the views made of it."""
        numel = math.prod(shape)
        key = (name, dtype, device)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            with torch.inference_mode(False):  # a normal tensor: written in and out of inference mode alike
                buf = self.buffers[key] = torch.empty(numel, dtype=dtype, device=device)
            self.shapes.clear()
        return buf[:numel].view(shape)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


def _check_static(rtype: str) -> None:
    if rtype not in STATIC_ROPE_TYPES:
        raise UsageError(
            f"compact positions do not support rope type {rtype!r} (frequencies depend on length); "
            "use absolute positions", field="positions")


class Packable(Protocol):
    """What compact re-packing needs from a head group (``kvtool/core/storage.py``'s ``HeadGroup``)."""

    length: int
    num_heads: int
    rotary_floor: int
    window: int | None
    rotator: Rotator | None

    @property
    def positions(self) -> Tensor: ...

    @property
    def rotary(self) -> Tensor: ...

    def origin_keys(self, n: int) -> Tensor | None: ...

    def stored_keys(self) -> Tensor: ...

    def write_keys(self, keys: Tensor) -> None: ...

    def keep_origin(self) -> None: ...

    def rotate_compensation(self, rotator: Rotator | None, delta: int) -> None: ...


class CompactPositions:
    """The position counter of compact mode and the re-packing of stored keys.

    Every key records the RoPE position it holds (``HeadGroup.rotary``). The query position advances
    with every block like an absolute one, so an eviction only leaves holes; a group is re-packed —
    its keys moved to ``next − len + r`` for rank r, right up to the next query — once its holes
    exceed one block (the slack). So no query ever sees a distance above capacity + 2 blocks, and a
    re-pack rotates only the keys older than the newest hole (with a sink + window policy: just the
    sinks). During decoding, one-token holes accumulate for a block's worth of steps before one
    re-pack. When the next block would pass the model's range, everything shifts down at once
    (``renormalize``): once every (range − capacity) tokens. A sliding-window group holds contiguous
    keys already packed, so it is never rotated except by a renormalisation.
    """

    def __init__(self, mode: str, max_positions: int | None, block_size: int, device: torch.device) -> None:
        self.mode = mode  # "absolute" | "compact" | "auto"
        self.compact = mode == "compact"  # whether keys are currently at compact positions
        self.since: int | None = 0 if self.compact else None
        self.max_positions = max_positions
        self.block_size = block_size
        self.device = device
        self.next = 0  # compact mode: rotary position of the next token
        # Whether re-packing may read tensor data on the host: free on CPU (no device queue to wait
        # for), a pipeline stall per layer on an accelerator (see ``rotate``).
        self.host_reads = device.type == "cpu"

    @property
    def limit(self) -> int:
        """Compact rotary positions stay below this (the trained range; 32K if the model does not say)."""
        return self.max_positions or 32768

    @property
    def lazy_limit(self) -> int:
        """Most tokens a group may hold while decoding lazily: with compact positions the next query
        must stay inside the model's range after a renormalisation."""
        return self.limit - 1 if self.mode != "absolute" else 1 << 62

    def begin(self, groups: list[Packable], seen: int, m: int) -> Tensor:
        """Rotary position ids for a block of ``m`` tokens starting at stream position ``seen``."""
        self.prepare(groups, seen, m)
        if self.compact:
            if self.next + m > self.limit:
                self.renormalize(groups)
            return torch.arange(self.next, self.next + m, device=self.device)
        return torch.arange(seen, seen + m, device=self.device)

    def prepare(self, groups: list[Packable], seen: int, m: int) -> bool:
        """``auto``: switch to compact positions now if ``m`` tokens from stream position ``seen`` would pass the
        model's range; whether it switched. ``begin`` asks per block; a question asks for its whole length
        before it is fed, so all of it is fed, and recall scores it, in one frame."""
        if self.compact or self.mode != "auto" or self.max_positions is None or seen + m <= self.max_positions:
            return False
        self.switch(groups, seen)
        return True

    def first_rotary(self, seen: int) -> int:
        """The rotary position the next appended token gets."""
        return self.next if self.compact else seen

    def switch(self, groups: list[Packable], seen: int) -> None:
        """Re-rotate every stored key from its original position to a packed compact position."""
        if not groups or groups[0].rotator is None:
            raise RuntimeError("compact positions need a RoPE rotator")
        P = max(g.length for g in groups)
        for g in groups:
            g.keep_origin()
            self.pack(g, P)
            g.rotate_compensation(g.rotator, P - seen)  # same frame shift as the query
        self.next = P
        self.compact = True
        self.since = seen

    def start(self, groups: list[Packable]) -> None:
        """An empty cache in compact mode from the first token: keep keys' originals (16-bit caches)."""
        if self.compact:
            for g in groups:
                g.keep_origin()

    def renormalize(self, groups: list[Packable]) -> None:
        """Shift every rotary position down so the next query sits at the longest group's length."""
        shift = max(g.length for g in groups) - self.next
        if shift == 0:
            return
        for g in groups:
            n = g.length
            if n:
                self.rotate(g, torch.full((g.num_heads, n), shift, device=self.device))
                g.rotary[:, :n] += shift
            g.rotary_floor += shift
            g.rotate_compensation(g.rotator, shift)
        self.next += shift

    def after_evict(self, g: Packable, evicted: bool, m: int) -> None:
        """After a block's eviction step (compact mode): re-pack the group if its holes exceed the slack.

        The compensation token moves with the query, keeping its dropped keys at the distance they
        had when dropped.
        """
        if not self.compact:
            return
        g.rotate_compensation(g.rotator, m)
        if not evicted or g.length == 0:
            return
        next_q = self.next + m  # the block's first rotary position is ``next`` (a Python int)
        if g.window is not None:  # the newest tokens, contiguous: already packed, the floor is exact
            g.rotary_floor = next_q - g.length
            return
        if next_q - g.rotary_floor > g.length + self.block_size:
            self.pack(g, next_q)

    def settle(self, g: Packable) -> None:
        """Compact mode: pack a group whose tokens were merged at their original positions (recall)."""
        if self.compact:
            self.pack(g, self.next)

    def pack(self, g: Packable, next_q: int) -> None:
        """Move the group's keys to ``next_q − len + r`` (rank r)."""
        n = g.length
        if n == 0:
            return
        target = (next_q - n) + torch.arange(n, device=self.device)
        self.rotate(g, target.unsqueeze(0) - g.rotary[:, :n], target)
        g.rotary[:, :n] = target
        g.rotary_floor = next_q - n

    def rotate(self, g: Packable, delta: Tensor, target: Tensor | None = None) -> None:
        """Rotate stored keys by ``delta`` [h, n] (a zero delta leaves a key bit-identical).

        With ``g.origin`` the keys are rotated from their original positions to ``rotary + delta``
        (rounded once). With ``host_reads`` (CPU: reading host tensors stalls no device queue) only
        the prefix up to the last moved key is rotated — for a sink + window policy just the sinks.
        On an accelerator every stored key is rotated instead: finding the last moved one would be a
        host sync in every layer, and a re-pack happens at most once per block.
        """
        assert g.rotator is not None
        end = delta.shape[1]
        if self.host_reads:
            moved = (delta != 0).any(0).nonzero()
            if moved.numel() == 0:
                return
            end = int(moved[-1]) + 1
        origin = g.origin_keys(end)
        if origin is None:
            g.write_keys(g.rotator.rotate(g.stored_keys()[:, :end], delta[:, :end]))
            return
        to = (g.rotary[:, :end] + delta[:, :end]) if target is None else target[:end]
        g.write_keys(g.rotator.rotate(origin, to - g.positions[:, :end]))

    def original_keys(self, g: Packable, idx: Tensor, positions: Tensor, out: Tensor, delta: Tensor) -> Tensor:
        """Keys of stored tokens ``idx`` [h, k] at their original positions ``positions`` [h, k] (what the
        archive holds), gathered into ``out`` [h, k, d]; ``delta`` [h, k] (int64) is where compact keys'
        way back is computed. Returns ``out``, or the rotator's buffer for keys turned back."""
        expand = idx.unsqueeze(-1).expand(-1, -1, out.shape[-1])
        origin = g.origin_keys(g.length)
        if origin is not None:
            return torch.gather(origin, 1, expand, out=out)
        keys = torch.gather(g.stored_keys(), 1, expand, out=out)
        if not self.compact:
            return keys
        assert g.rotator is not None
        rotary = torch.gather(g.rotary[:, : g.length], 1, idx, out=delta)
        return g.rotator.rotate(keys, torch.sub(positions, rotary, out=delta))

    def state(self) -> dict[str, object]:
        return {"rotary_next": self.next, "compact": self.compact, "compact_since": self.since,
                "positions_mode": self.mode}

    def load(self, scalars: dict[str, object], groups: list[Packable]) -> None:
        self.next = int(scalars.get("rotary_next", 0) or 0)  # type: ignore[call-overload]
        self.compact = bool(scalars["compact"])
        self.since = scalars.get("compact_since")  # type: ignore[assignment]
        self.start(groups)
