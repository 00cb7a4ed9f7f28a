"""Head groups of one layout in every layer, evicted together at the end of a block.

A uniform policy lays out every layer alike (one group of all KV heads at the budget). Such groups share their
buffers in a :class:`~kvtool.core.buffers.LayerStack`, and when every layer of the stack evicts in a block,
the cache (``BoundedCache.evict_deferred``) scores them in one context — the heads of several layers flattened,
``[layers · h, n]`` — keeps the top tokens with one top-k and gathers every buffer of those layers with one
``gather``; what they drop is archived for those layers with one append (``archive.append_layers``). It does so a
chunk of layers at a time (``costs.evict_chunk_layers``: at most a few chunks, each at least a megabyte of work):
an eviction's scores and kept-token copy are then a chunk's, not the whole cache's, and its launches those of a few
layers. Results are those of evicting layer by layer right after each layer's attention (each layer's cache is its
own; the next block is the first to read it); the per-layer launches of eviction are gone (``bench/launches.py``).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor

from kvtool.core.archive import append_layers
from kvtool.core.buffers import LayerStack
from kvtool.core.contract import GroupSpec, ScoreContext
from kvtool.core.costs import evict_chunk_layers, eviction_layer_bytes
from kvtool.core.evict import evict_step
from kvtool.core.storage import HeadGroup


class Stack:
    """Head groups of one layout, one per layer, sharing their buffers (``kvtool/core/buffers.py``): when
    every one of them evicts in a block, they are scored and gathered at once at its end.

    ``probs`` keeps each layer's attention rows its policy still reads at eviction (``Policy.score_rows``;
    summed over the rows when ``rows_summed``) from the layer's attention to the block's end.
    """

    def __init__(self, buffers: LayerStack, groups: list[HeadGroup]) -> None:
        self.buffers = buffers
        self.groups = groups
        self.pending: list[HeadGroup] = []
        self.probs: Tensor | None = None

    @property
    def policy(self) -> Any:
        return self.groups[0].policy

    def reset(self) -> None:
        """Forget a block that never reached its end (a document that failed in a layer's forward): no layer
        waits for its eviction, none keeps the probabilities it stashed for it."""
        self.pending = []
        for g in self.groups:
            g.deferred_probs = None

    def chunk_layers(self) -> int:
        """Layers evicted together at a block's end (``costs.evict_chunk_layers``): their temporaries are the
        scoring of every slot of their heads and the copy of one buffer's kept tokens (the widest per token)."""
        g = self.groups[0]
        widest = self.buffers.widest_token_bytes(g.num_heads)
        layer = eviction_layer_bytes(g.num_heads, g.usable_slots, g.capacity or g.usable_slots, widest,
                                     self.policy.score_slot_bytes(g.head_dim))
        return evict_chunk_layers(len(self.groups), layer)

    def keep_probs(self, layer: int, probs: Tensor | None, block_len: int) -> Tensor | None:
        """Stash layer ``layer``'s probabilities [h, r, n] for its eviction at the block's end; returns the
        stacked [L, h, r', n] buffer's view of that layer (None when the policy reads none)."""
        rows = self.policy.score_rows(block_len)
        if rows == 0 or probs is None:
            return None
        probs = probs[:, -rows:]
        if self.policy.rows_summed and rows > 1:
            probs = probs.sum(dim=1, keepdim=True)
        shape = (len(self.groups), *probs.shape)
        if self.probs is None or self.probs.numel() < math.prod(shape):
            self.probs = torch.empty(math.prod(shape), dtype=torch.float32, device=probs.device)
        stacked = self.probs[: math.prod(shape)].view(shape)
        stacked[layer].copy_(probs)
        return stacked


class StackedGroups:
    """Layers ``first`` … ``first + layers − 1`` of a :class:`Stack` as one eviction target (``evict.evict_step``):
    their heads flattened, ``gather`` moving their buffers with one index."""

    def __init__(self, stack: Stack, first: int, layers: int, heads: int) -> None:
        self.stack = stack
        self.first = first
        self.groups = stack.groups[first : first + layers]
        self.h = heads
        self.layers = layers
        self.policy = stack.policy
        self.length = self.groups[0].length

    def gather(self, keep: Tensor) -> None:
        c = keep.shape[1]
        self.stack.buffers.gather(keep.view(self.layers, self.h, c), self.length, self.first)
        for g in self.groups:
            g.length = c
        self.length = c


def stack_layout(layer_specs: list[list[GroupSpec]]) -> dict[tuple[int, int], tuple[LayerStack, int]]:
    """Which groups share a :class:`~kvtool.core.buffers.LayerStack`: (layer, group) → (stack, position in it).

    Groups of the same heads, capacity, window and policy object in two or more layers, when the policy may
    be scored across layers (``Policy.batchable``) and keeps no per-group extra (RazorAttention's
    compensation token, its own per-layer layout)."""
    by_layout: dict[tuple, list[tuple[int, int]]] = {}
    for li, specs in enumerate(layer_specs):
        for gi, spec in enumerate(specs):
            if spec.compensation or spec.policy.own_layout or not spec.policy.batchable:
                continue
            key = (tuple(spec.heads), spec.capacity, spec.window, id(spec.policy))
            by_layout.setdefault(key, []).append((li, gi))
    out: dict[tuple[int, int], tuple[LayerStack, int]] = {}
    for members in by_layout.values():
        if len(members) < 2:
            continue
        stack = LayerStack(len(members))
        for i, member in enumerate(members):
            out[member] = (stack, i)
    return out


def evict_stack(cache: Any, st: Stack) -> None:
    """Score the layers of ``st`` in one context (heads of all layers flattened) and gather them together, a chunk
    of layers at a time (``Stack.chunk_layers``): the temporaries are those of a chunk, not of the whole stack."""
    gs = st.groups
    L, h, step = len(gs), gs[0].num_heads, st.chunk_layers()
    dropped = 0
    for first in range(0, L, step):
        dropped = _evict_layers(cache, st, first, min(step, L - first))
    c = cache.counters
    c.evicted_tokens += dropped * h * L
    c.max_cached = max(c.max_cached, gs[0].length)
    t0 = cache.timer.start()
    for g in gs:
        g.deferred_probs = None
        cache.rope.after_evict(g, True, cache.step.length)
    cache.timer.stop("evict", t0)


def _evict_layers(cache: Any, st: Stack, first: int, layers: int) -> int:
    """Evict layers ``first`` … ``first + layers − 1`` of ``st`` together; returns the tokens dropped per head."""
    g0 = st.groups[first]
    archive = functools.partial(archive_stack, cache) if g0.archive is not None and cache.pin_start is None else None
    return evict_step(StackedGroups(st, first, layers, g0.num_heads), _context(cache, st, first, layers), archive,
                      cache.timer)


def _context(cache: Any, st: Stack, first: int, layers: int) -> ScoreContext:
    """What the policy sees of layers ``first`` … ``first + layers − 1``: their heads flattened, ``[layers · h, n]``
    (only the context holds its protection: ``evict_step`` lets it go before the gather)."""
    g0 = st.groups[first]
    h, n = g0.num_heads, g0.length
    b = st.buffers.items
    flat, at = layers * h, slice(first, first + layers)

    def tokens(name: str) -> Tensor:
        return b[name].tokens(0, n)[at]

    pos = tokens("positions").reshape(flat, n)
    probs = g0.deferred_probs
    protected, priority = cache.protection(pos, g0)
    return ScoreContext(layer_idx=-1, heads=list(range(flat)), keys=tokens("keys").reshape(flat, n, -1),
                        values=tokens("values").reshape(flat, n, -1), positions=pos,
                        query_positions=cache.step_original_positions,
                        probs=None if probs is None else probs[at].reshape(flat, *probs.shape[2:]),
                        state={name: b["state"].tokens(0, n)[i][at].reshape(flat, n)
                               for i, name in enumerate(g0.state_fields)},
                        protected=protected, priority=priority, capacity=g0.capacity or n,
                        block_len=cache.step.length, seen=cache.seen)


def archive_stack(cache: Any, target: StackedGroups, dropped: Tensor) -> None:
    """Archive tokens ``dropped`` [L · h, k] of a stack: gathered from every layer at once and appended to
    the layers' archives together (``archive.append_layers``). With compact positions each layer's keys
    turn back to their original positions first, group by group."""
    gs, L, h, at = target.groups, target.layers, target.h, slice(target.first, target.first + target.layers)
    if cache.rope.compact:
        for layer, g in enumerate(gs):
            cache.archive_dropped(g, dropped[layer * h : (layer + 1) * h])
        return
    n, k, d = target.length, dropped.shape[1], gs[0].head_dim
    b = target.stack.buffers.items
    work = gs[0].archive.work  # type: ignore[union-attr]
    idx = dropped.view(L, h, k)
    rows = idx.unsqueeze(-1).expand(L, h, k, d)
    dev, dt = dropped.device, gs[0].dtype
    positions = torch.gather(b["positions"].tokens(0, n)[at], 2, idx, out=work.get("positions", (L, h, k), torch.long,
                                                                                     dev))
    values = torch.gather(b["values"].tokens(0, n)[at], 2, rows, out=work.get("values", (L, h, k, d), dt, dev))
    keys = torch.gather(b["keys"].tokens(0, n)[at], 2, rows, out=work.get("keys", (L, h, k, d), dt, dev))
    append_layers([g.archive for g in gs], keys, values, positions)  # type: ignore[misc]
