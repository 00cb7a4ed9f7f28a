"""Per-token buffers that move together: one registry, one slot count, every operation applied to all.

A head group (``kvtool/core/storage.py``) keeps K/V, positions, policy state and the rest as entries here,
so eviction's gather, recall's merge, growth and ``.kvc`` loading move all of them with the same index.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class TokenBuffer:
    """One per-token tensor: ``data`` with its token axis (the head axis precedes it) and fixed leading slots."""

    data: Tensor
    axis: int
    lead: int = 0

    def tokens(self, start: int, stop: int) -> Tensor:
        """The view of tokens ``start`` … ``stop`` − 1 (the leading slots excluded)."""
        return self.data.narrow(self.axis, self.lead + start, stop - start)

    def index(self, idx: Tensor) -> Tensor:
        """``idx`` [h, c] shaped and expanded to gather this buffer's tokens along its axis."""
        shape = [1] * self.data.dim()
        shape[self.axis - 1], shape[self.axis] = idx.shape
        size = list(self.data.shape)
        size[self.axis] = idx.shape[1]
        return idx.view(shape).expand(size)


class TokenBuffers:
    """A registry of per-token buffers sharing one slot count; every operation applies to all of them."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.items: dict[str, TokenBuffer] = {}

    def add(self, name: str, head_shape: tuple[int, ...], tail: tuple[int, ...], dtype: torch.dtype,
            device: torch.device, lead: int = 0) -> Tensor:
        """Register a zeroed buffer ``[*head_shape, lead + slots, *tail]`` (``head_shape`` ends with the heads)."""
        data = torch.zeros(*head_shape, lead + self.slots, *tail, dtype=dtype, device=device)
        self.items[name] = TokenBuffer(data, len(head_shape), lead)
        return data

    def remove(self, name: str) -> None:
        self.items.pop(name, None)

    def __contains__(self, name: str) -> bool:
        return name in self.items

    def __getitem__(self, name: str) -> Tensor:
        return self.items[name].data

    def bytes_per_slot(self) -> int:
        return sum(b.data.numel() // max(1, b.data.shape[b.axis]) * b.data.element_size()
                   for b in self.items.values())

    def resize(self, slots: int, keep: int) -> None:
        """Reallocate every buffer with ``slots`` slots, keeping the first ``keep`` tokens (and leading slots)."""
        for b in self.items.values():
            shape = list(b.data.shape)
            shape[b.axis] = b.lead + slots
            data = torch.zeros(shape, dtype=b.data.dtype, device=b.data.device)
            n = b.lead + keep
            data.narrow(b.axis, 0, n).copy_(b.data.narrow(b.axis, 0, n))
            b.data = data
        self.slots = slots

    def write(self, start: int, values: dict[str, Tensor | float], written: Collection[str] = ()) -> int:
        """Write tokens at ``start`` (``values``: name -> [.., h, m, ..] or a scalar); others get zeros, but
        those in ``written`` (already filled by the caller, e.g. encoded K/V) are left as they are.

        Returns m, taken from the first tensor value.
        """
        m = next(v.shape[self.items[k].axis] for k, v in values.items() if isinstance(v, Tensor))
        for name, b in self.items.items():
            if name in written:
                continue
            dst = b.tokens(start, start + m)
            v = values.get(name, 0.0)
            if isinstance(v, Tensor):
                dst.copy_(v)
            else:
                dst.fill_(v)
        return m

    def gather(self, keep: Tensor, n: int) -> None:
        """Keep tokens ``keep`` [h, c] (indices into the first ``n``) as tokens 0 … c − 1 of every buffer."""
        c = keep.shape[1]
        for b in self.items.values():
            if b.data.numel() == 0:
                continue
            b.tokens(0, c).copy_(b.tokens(0, n).gather(b.axis, b.index(keep)))

    def permute(self, order: Tensor) -> None:
        """Reorder the first ``order.shape[1]`` tokens of every buffer by ``order`` [h, n] (a permutation)."""
        self.gather(order, order.shape[1])

    def saved(self, name: str, n: int) -> Tensor:
        """The leading slots and first ``n`` tokens of a buffer, contiguous (snapshots, ``.kvc``)."""
        b = self.items[name]
        return b.data.narrow(b.axis, 0, b.lead + n).contiguous()

    def load(self, name: str, t: Tensor, n: int) -> None:
        b = self.items[name]
        b.data.narrow(b.axis, 0, b.lead + n).copy_(t)
