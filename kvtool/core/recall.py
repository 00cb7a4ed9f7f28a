"""Recall: bring the archive pages a question points at back into the cache for one answer.

    attach(cache)            every bounded group gets an archive and ``recall`` extra slots
    feed(question)           with ``cache.query_log`` set: each layer's queries are recorded
    restore(snapshot)        back to the cache as it was after the document
    recall(cache, log, N)    per layer and KV head: top pages by Quest's bound, ≤ N tokens, merged
                             beside the kept tokens in position order (compact mode re-packs them)
    feed(question) again     the question's own hidden states now see what was recalled

A group holds at most ``capacity + recall + block`` tokens per head during an answer (its slots are
allocated once, at ``attach``); ``capacity`` is raised by the recalled count for that answer only and
lowered again by the next restore (``HeadGroup.load_state_dict``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from kvtool.core.archive import ArchiveStore, GroupArchive
from kvtool.core.cache import BoundedCache, HeadGroup

StoreFactory = Callable[[int], ArchiveStore]  # row bytes → a fresh store


@dataclass
class RecallResult:
    tokens: int = 0  # largest number of tokens recalled into one head
    pages: int = 0  # pages touched, summed over layers and KV heads
    seconds: float = 0.0


def attach(cache: BoundedCache, recall: int, page_size: int, dtype: torch.dtype | None, store: StoreFactory) -> None:
    """Give every bounded group an archive and room for ``recall`` more tokens per head (cache still empty).

    ``dtype``: how archived K/V are stored (None: as the cache holds them); recalled tokens are cast
    back to the cache's dtype, so a narrower archive costs only its rounding (``--archive-dtype``).
    """
    for g in cache.groups():
        if g.capacity is None:
            continue
        dt = dtype or g.keys.dtype
        rb = GroupArchive.row_bytes(g.num_heads, g.keys.shape[-1], dt)
        g.archive = GroupArchive(g.num_heads, g.keys.shape[-1], dt, page_size, store(rb))
        if g.max_slots is not None:
            g.max_slots += recall
        _reserve(g, g.slots + recall)


def _reserve(g: HeadGroup, slots: int) -> None:
    """Reallocate an empty group's buffers with ``slots`` token slots (done once, before the first block)."""
    assert g.length == 0
    h, d, dev = g.num_heads, g.keys.shape[-1], g.keys.device
    g.keys = torch.zeros(1, h, g.off + slots, d, dtype=g.keys.dtype, device=dev)
    g.values = torch.zeros_like(g.keys)
    g.positions = torch.zeros(h, slots, dtype=torch.long, device=dev)
    g.rotary = torch.zeros_like(g.positions)
    g.state = torch.zeros(g.state.shape[0], h, slots, dtype=torch.float32, device=dev)


def archives(cache: BoundedCache) -> list[GroupArchive]:
    return [g.archive for g in cache.groups() if g.archive is not None]


def archive_dtype(cache: BoundedCache) -> str | None:
    """How archived K/V are stored ("float16", …), or None without an archive."""
    return next((str(a.dtype).removeprefix("torch.") for a in archives(cache)), None)


def archive_bytes(cache: BoundedCache) -> int:
    return sum(a.nbytes() for a in archives(cache))


def archived_tokens(cache: BoundedCache) -> int:
    """Archived tokens summed over groups and heads."""
    return sum(a.length * a.h for a in archives(cache))


def close(cache: BoundedCache) -> None:
    for a in archives(cache):
        a.close()


def _group_queries(g: HeadGroup, entries: list[tuple[Tensor, int]], rotator) -> Tensor:
    """The group's query rows in the original-position frame: [h, q_per_kv · rows, d]."""
    parts = []
    for q, shift in entries:
        q = q[0] if g.all_heads else q[0].index_select(0, g.q_index)  # [hq, m, d]
        if shift:
            q = rotator.rotate(q, torch.full((q.shape[1],), shift, device=q.device))
        parts.append(q)
    q = torch.cat(parts, dim=1)
    return q.reshape(g.num_heads, -1, q.shape[-1])


def insert(g: HeadGroup, keys: Tensor, values: Tensor, positions: Tensor) -> None:
    """Merge recalled tokens ([h, T, d] keys at original positions) with the kept ones, in position order."""
    n, o, T = g.length, g.off, keys.shape[1]
    if T == 0:
        return
    dev = g.keys.device
    pos = torch.cat((g.positions[:, :n], positions.to(dev)), dim=1)
    order = torch.argsort(pos, dim=1, stable=True)
    d = g.keys.shape[-1]
    idx = order.unsqueeze(-1).expand(-1, -1, d)
    k = torch.cat((g.keys[0, :, o : o + n], keys.to(dev, g.keys.dtype)), dim=1).gather(1, idx)
    v = torch.cat((g.values[0, :, o : o + n], values.to(dev, g.values.dtype)), dim=1).gather(1, idx)
    rot = torch.cat((g.rotary[:, :n], positions.to(dev)), dim=1).gather(1, order)
    g.keys[0, :, o : o + n + T] = k
    g.values[0, :, o : o + n + T] = v
    g.positions[:, : n + T] = pos.gather(1, order)
    g.rotary[:, : n + T] = rot
    if g.state.shape[0]:
        fresh = torch.zeros(g.state.shape[0], g.num_heads, T, device=dev)
        fresh[:] = g.new_state(keys.to(dev, g.keys.dtype), values.to(dev, g.values.dtype))  # recalled: constants again
        st = torch.cat((g.state[:, :, :n], fresh), dim=2)
        g.state[:, :, : n + T] = st.gather(2, order.unsqueeze(0).expand(g.state.shape[0], -1, -1))
    g.length = n + T
    if g.capacity is not None:
        g.capacity = g.capacity + T
    g.recalled = torch.sort(positions.to(dev), dim=1).values  # protected until the next restore


@torch.inference_mode()
def recall(cache: BoundedCache, log: list[tuple[int, Tensor, int]], tokens: int) -> RecallResult:
    """Load each group's best archive pages (≤ ``tokens`` per head) beside its kept tokens."""
    t0 = cache.clock()
    by_layer: dict[int, list[tuple[Tensor, int]]] = {}
    for layer_idx, q, shift in log:
        by_layer.setdefault(layer_idx, []).append((q, shift))
    out = RecallResult()
    for li, layer in enumerate(cache.layers):
        entries = by_layer.get(li)
        for g in layer.groups:  # type: ignore[attr-defined]
            a = g.archive
            if a is None or a.length == 0 or not entries:
                continue
            room = g.usable_slots - g.length - cache.block_size
            idx, pages = a.select(_group_queries(g, entries, g.rotator), min(tokens, room))
            keys, values, pos = a.read(idx)
            insert(g, keys, values, pos)
            if cache.compact:
                cache._pack(g, cache.rotary_next)
            out.tokens = max(out.tokens, idx.shape[1])
            out.pages += pages
    out.seconds = cache.clock() - t0
    return out
