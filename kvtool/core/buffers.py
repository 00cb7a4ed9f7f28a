"""Per-token buffers that move together: one registry, one slot count, every operation applied to all.

A head group (``kvtool/core/storage.py``) keeps K/V, positions, policy state and the rest as entries here,
so eviction's gather, recall's merge, growth and ``.kvc`` loading move all of them with the same index.

Head groups of the same layout in every layer (a uniform policy: one group of all KV heads per layer) keep
their buffers in a :class:`LayerStack`: each buffer is ONE tensor with a layer axis right before the heads'
(``[L, h, slots, d]`` for keys, ``[F, L, h, slots]`` for policy state), and each group's registry holds views
of its layer. A block's eviction then gathers every layer with one ``gather`` per buffer instead of one per
layer (the engine's launch count per layer stays near transformers' own: ``bench/launches.py``). Buffers a
group registers later (the original keys' copy, citation mass) stay the group's own.
"""

from __future__ import annotations

import weakref
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
        """``idx`` [..., h, c] shaped and expanded to gather this buffer's tokens along its axis (the axes of
        ``idx`` but the last are the ones right before the token axis: heads, and layers in a stack)."""
        k = idx.dim() - 1
        shape = [1] * self.data.dim()
        shape[self.axis - k : self.axis + 1] = idx.shape
        size = list(self.data.shape)
        size[self.axis] = idx.shape[-1]
        return idx.view(shape).expand(size)


class TokenBuffers:
    """A registry of per-token buffers sharing one slot count; every operation applies to all of them.

    In a :class:`LayerStack` (``stack``, ``layer``) the buffers added with ``shared=True`` are views of the
    stack's tensors, and growth resizes the whole stack.
    """

    def __init__(self, slots: int, stack: LayerStack | None = None, layer: int = 0) -> None:
        self._slots = slots
        self.items: dict[str, TokenBuffer] = {}
        # weak: the stack holds its registries, a strong reference back would make a cycle that keeps every
        # layer's K/V alive until Python's cyclic collector runs
        self._stack = weakref.ref(stack) if stack is not None else None
        self.layer = layer

    @property
    def stack(self) -> LayerStack | None:
        return self._stack() if self._stack is not None else None

    @property
    def slots(self) -> int:
        return self.stack.slots if self.stack is not None else self._slots

    def add(self, name: str, head_shape: tuple[int, ...], tail: tuple[int, ...], dtype: torch.dtype,
            device: torch.device, lead: int = 0, shared: bool = False) -> Tensor:
        """Register a zeroed buffer ``[*head_shape, lead + slots, *tail]`` (``head_shape`` ends with the heads).

        ``shared``: in a stack, one tensor for every layer (each registry holds its layer's view); else this
        registry's own."""
        if shared and self.stack is not None:
            self.items[name] = self.stack.add(name, head_shape, tail, dtype, device, lead, self.layer)
            return self.items[name].data
        data = torch.zeros(*head_shape, lead + self.slots, *tail, dtype=dtype, device=device)
        self.items[name] = TokenBuffer(data, len(head_shape), lead)
        return data

    def remove(self, name: str) -> None:
        """Drop a buffer of this registry's own (a stack's shared buffers stay)."""
        if self.stack is None or name not in self.stack.items:
            self.items.pop(name, None)

    def own(self) -> list[TokenBuffer]:
        """The buffers that are this registry's own (all of them outside a stack)."""
        if self.stack is None:
            return list(self.items.values())
        return [b for name, b in self.items.items() if name not in self.stack.items]

    def __contains__(self, name: str) -> bool:
        return name in self.items

    def __getitem__(self, name: str) -> Tensor:
        return self.items[name].data

    def bytes_per_slot(self) -> int:
        return sum(_slot_bytes(b) for b in self.items.values())

    def resize_bytes(self, slots: int) -> int:
        """The most ``resize(slots)`` holds beyond the buffers it had (``resize_peak``): every buffer of this registry
        or, in a stack, of every layer (the stacked tensors and each layer's own buffers)."""
        if self.stack is not None:
            return self.stack.resize_bytes(slots)
        return resize_peak(self.items.values(), slots)

    def resize(self, slots: int, keep: int) -> None:
        """Reallocate every buffer with ``slots`` slots, keeping the first ``keep`` tokens (and leading slots).

        In a stack the whole stack grows (its layers fill in lockstep), every layer's own buffers with it."""
        if self.stack is not None:
            self.stack.resize(slots)
            return
        _resize(self.items.values(), slots, keep)
        self._slots = slots

    def renew(self, slots: int) -> None:
        """Every buffer zeroed with ``slots`` slots, nothing kept (an emptied cache given back its first size); each
        old tensor is let go before its new one is made, so the memory in use never holds both."""
        if self.stack is not None:
            self.stack.renew(slots)
            return
        _renew(self.items.values(), slots)
        self._slots = slots

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
        """The leading slots and first ``n`` tokens of a buffer, a view (snapshots and ``.kvc`` copy it)."""
        b = self.items[name]
        return b.data.narrow(b.axis, 0, b.lead + n)

    def load(self, name: str, t: Tensor, n: int) -> None:
        b = self.items[name]
        b.data.narrow(b.axis, 0, b.lead + n).copy_(t)


def resize_peak(buffers: Collection[TokenBuffer], slots: int) -> int:
    """The most reallocating ``buffers`` to ``slots`` slots holds beyond what they held: they are reallocated one by
    one, each old one freed once copied, so every buffer's growth plus, at most, the largest old buffer."""
    sizes = [(_slot_bytes(b) * (b.lead + slots), b.data.numel() * b.data.element_size()) for b in buffers]
    return sum(new - old for new, old in sizes) + max((old for _, old in sizes), default=0)


def _slot_bytes(b: TokenBuffer) -> int:
    """Bytes one slot of buffer ``b`` takes (every head, and every layer of a stacked buffer)."""
    return b.data.numel() // max(1, b.data.shape[b.axis]) * b.data.element_size()


def _resize(buffers: Collection[TokenBuffer], slots: int, keep: int) -> None:
    """Reallocate ``buffers`` in place with ``slots`` slots, keeping their first ``keep`` tokens."""
    for b in buffers:
        shape = list(b.data.shape)
        shape[b.axis] = b.lead + slots
        data = torch.zeros(shape, dtype=b.data.dtype, device=b.data.device)
        n = b.lead + min(keep, b.data.shape[b.axis] - b.lead)
        data.narrow(b.axis, 0, n).copy_(b.data.narrow(b.axis, 0, n))
        b.data = data


def _renew(buffers: Collection[TokenBuffer], slots: int) -> None:
    """Replace ``buffers`` with zeroed ones of ``slots`` slots, each old tensor let go first (nothing else may hold
    it: a stack's views are dropped before)."""
    for b in buffers:
        shape, dtype, device = list(b.data.shape), b.data.dtype, b.data.device
        shape[b.axis] = b.lead + slots
        b.data = b.data.new_empty(0)
        b.data = torch.zeros(shape, dtype=dtype, device=device)


class LayerStack:
    """The shared buffers of ``layers`` head groups of one layout, one per layer (module docstring)."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.slots = 0
        self.items: dict[str, TokenBuffer] = {}  # the stacked tensors: the layer axis right before the heads'
        self.views: list[TokenBuffers] = []
        self._rows: dict[tuple[int, ...], Tensor] = {}  # [L', h, 1]: each (layer, head)'s row in a run of L' layers

    def registry(self, layer: int, slots: int) -> TokenBuffers:
        """Layer ``layer``'s registry (the first one sets the stack's slot count; all must agree)."""
        if not self.views:
            self.slots = slots
            self.views = [TokenBuffers(slots, self, i) for i in range(self.layers)]
        if slots != self.slots:
            raise ValueError(f"layer {layer} wants {slots} slots, its stack has {self.slots}")
        return self.views[layer]

    def add(self, name: str, head_shape: tuple[int, ...], tail: tuple[int, ...], dtype: torch.dtype,
            device: torch.device, lead: int, layer: int) -> TokenBuffer:
        """The stacked buffer ``name`` (made zeroed by the first layer that adds it), viewed at ``layer``."""
        if name not in self.items:
            *outer, heads = head_shape
            data = torch.zeros(*outer, self.layers, heads, lead + self.slots, *tail, dtype=dtype, device=device)
            self.items[name] = TokenBuffer(data, len(head_shape) + 1, lead)
        return self._view(self.items[name], layer)

    @staticmethod
    def _view(b: TokenBuffer, layer: int) -> TokenBuffer:
        return TokenBuffer(b.data.select(b.axis - 2, layer), b.axis - 1, b.lead)

    def resize_bytes(self, slots: int) -> int:
        """The most ``resize(slots)`` holds beyond the stack's buffers (``resize_peak``): the stacked tensors and every
        layer's own buffers, one after the other."""
        return resize_peak([*self.items.values(), *(b for view in self.views for b in view.own())], slots)

    def resize(self, slots: int) -> None:
        """Every layer's buffers with ``slots`` slots (contents kept), the views re-pointed: one stacked tensor at a
        time, its views re-pointed before the next, so the old one is freed once copied (the stack's largest
        buffer, not all of them, is held twice)."""
        for name, b in self.items.items():
            _resize([b], slots, self.slots)
            for layer, view in enumerate(self.views):
                if name in view.items:
                    view.items[name] = self._view(b, layer)
        for view in self.views:
            _resize(view.own(), slots, self.slots)
        self.slots = slots

    def renew(self, slots: int) -> None:
        """Every layer's buffers zeroed with ``slots`` slots (``TokenBuffers.renew``), the views re-pointed."""
        for view in self.views:  # the layers' views hold the stacked tensors too: let them go first
            for name in self.items:
                if name in view.items:
                    view.items[name] = TokenBuffer(view.items[name].data.new_empty(0), 0)
            _renew(view.own(), slots)
        _renew(self.items.values(), slots)
        for layer, view in enumerate(self.views):
            for name, b in self.items.items():
                if name in view.items:
                    view.items[name] = self._view(b, layer)
        self.slots = slots

    def widest_token_bytes(self, heads: int) -> int:
        """The most bytes one token of one (layer, head) takes in a stacked buffer (the keys, or the values)."""
        return max((b.data.numel() * b.data.element_size() // (self.layers * heads * b.data.shape[b.axis])
                    for b in self.items.values() if b.data.numel()), default=0)

    def gather(self, keep: Tensor, n: int, first: int = 0) -> None:
        """Keep tokens ``keep`` [L', h, c] (indices into the first ``n`` of each layer) in layers ``first`` … ``first
        + L' − 1`` at once; each layer's own buffers with its slice.

        A stacked buffer is contiguous, so the (layer, head, token) axes of a run of its layers flatten into one
        and the kept tokens are whole rows of it: ``index_select`` copies them as rows (K/V: 64 or 128 values
        each), where ``gather`` with an index expanded over the head dimension reads an index per element (2.5×
        the time for K/V on a CPU). One flat index serves every buffer of the same slot count and leading slots.
        The copy of one buffer's kept rows is the only temporary, and it is gone before the next buffer's."""
        layers, c = keep.shape[0], keep.shape[-1]
        rows = self._rows.get(keep.shape[:2])
        if rows is None or rows.device != keep.device:
            rows = self._rows[keep.shape[:2]] = torch.arange(layers * keep.shape[1], device=keep.device).view(
                *keep.shape[:2], 1)
        flat: dict[tuple[int, int], Tensor] = {}
        for b in self.items.values():
            axis = b.axis
            data = b.data.narrow(axis - 2, first, layers)
            size = data.shape[axis]
            idx = flat.get((size, b.lead))
            if idx is None:  # row of (layer, head) · slots per row + leading slots + the kept token
                idx = flat[size, b.lead] = torch.add(keep if b.lead == 0 else keep + b.lead, rows, alpha=size).view(-1)
            kept = data.flatten(axis - 2, axis).index_select(axis - 2, idx)
            data.narrow(axis, b.lead, c).copy_(kept.view(*data.shape[: axis - 2], *keep.shape, *data.shape[axis + 1 :]))
            del kept
        for layer, view in enumerate(self.views[first : first + layers]):
            for b in view.own():
                if b.data.numel():
                    b.tokens(0, c).copy_(b.tokens(0, n).gather(b.axis, b.index(keep[layer])))
