"""Attention column sums in two passes, without the probability matrix: the torch form, and which form runs.

H2O (and SnapKV's observation window) reads, per stored token, the attention probability it received summed over
a block's query rows, averaged over the query heads that share its KV head (the engine's GQA rule). A
probability needs its row's normaliser, which is known only once the row has seen every key, so the exact
statistic takes two passes:

1. **forward**: the block's attention output and each query row's log-sum-exp ``lse`` (``[query heads, m]``,
   float32) — the normaliser a flash-attention forward computes anyway;
2. **column sums**: key-major — each key tile is held while the query tiles of every query head of its KV
   head are streamed past it, summing ``exp(q·k·scale − lse)`` over the visible rows. Each key tile is
   summed by one owner (no atomics); values are never read.

Neither pass writes a ``[heads, rows, keys]`` matrix. Visibility is arithmetic (``Visibility``): query row
``r`` of the block is stream token ``n_old + r`` of the group's ``n`` stored tokens (``n_old = n − m``), so it
sees key ``j`` iff ``j ≤ n_old + r`` and, in a sliding-window layer, ``n_old + r − j < window``. A logit
softcap or RazorAttention's compensation slot is not part of it: those layers keep the explicit path
(``core/attention.py``).

This module is the torch form of both passes: the reference the Triton kernels (``column_sums_triton.py``,
imported only where they run) are tested against, and the form any device can run. ``forward`` and
``column_sums`` work in bounded chunks (``PROBS_CHUNK_BYTES`` of float32 scores at a time: rows for the
forward, key tiles for the sums), so the torch form needs no more memory than the explicit path's chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvtool.config import PROBS_CHUNK_BYTES

#: the fewest query rows a block needs before the two passes replace the explicit one: a decoded token's single
#: row costs two launches for what one small explicit row gives (and its citing mass reads that row anyway)
MIN_ROWS = 16


@dataclass(frozen=True)
class Visibility:
    """Which keys a block's query rows see: row ``r`` is token ``n_old + r``; it sees key ``j`` iff
    ``j ≤ n_old + r`` and, with a ``window``, ``n_old + r − j < window`` (``core/attention.py``'s masks)."""

    n_old: int
    window: int | None = None

    def mask(self, rows: Tensor, cols: Tensor) -> Tensor:
        """``[len(rows), len(cols)]`` bool: whether block row ``rows[i]`` sees key ``cols[j]``."""
        dist = rows.unsqueeze(1) + self.n_old - cols.unsqueeze(0)
        seen = dist >= 0
        return seen & (dist < self.window) if self.window is not None else seen


def triton_available() -> bool:
    """Whether the Triton kernels can be imported here (Triton is a third-party package torch's CUDA builds ship)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def default_form(device: torch.device) -> str | None:
    """The two-pass form a cache on ``device`` uses for column sums: ``"triton"`` on CUDA where Triton imports,
    else None (the explicit one-pass path: on a CPU it is the faster one, docs/performance.md)."""
    return "triton" if device.type == "cuda" and triton_available() else None


def _rows_per_chunk(heads: int, width: int) -> int:
    return max(1, PROBS_CHUNK_BYTES // (heads * max(width, 1) * 4))


def forward(
    q: Tensor, k: Tensor, v: Tensor, scaling: float, vis: Visibility, lse: Tensor, out: Tensor | None = None
) -> Tensor:
    """Pass 1: attention output ``[1, H, m, dv]`` (``v``'s dtype) of ``q`` ``[1, H, m, d]`` over ``k``, ``v``
    ``[1, h, n, d]`` (``H = h · q_per_kv``, query head ``i`` on KV head ``i // q_per_kv``), each row's natural
    log-sum-exp written into ``lse`` ``[H, m]`` (float32). Rows in chunks of ``PROBS_CHUNK_BYTES`` of scores."""
    H, m, d = q.shape[1], q.shape[2], q.shape[3]
    h, n, dv = k.shape[1], k.shape[2], v.shape[3]
    qk = H // h
    if out is None:  # laid out [1, m, H, dv]: transformers' layout, so the attention function's transpose is free
        out = torch.empty(1, m, H, dv, dtype=v.dtype, device=q.device).transpose(1, 2)
    kf, vf = k[0].float(), v[0].float()
    cols = torch.arange(n, device=q.device)
    chunk = _rows_per_chunk(H, n)
    for r0 in range(0, m, chunk):
        r1 = min(m, r0 + chunk)
        rows = torch.arange(r0, r1, device=q.device)
        qg = q[0, :, r0:r1].float().reshape(h, qk * (r1 - r0), d)
        scores = torch.bmm(qg, kf.transpose(1, 2)).mul_(scaling).view(h, qk, r1 - r0, n)
        scores.masked_fill_(~vis.mask(rows, cols), float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [h, qk, rows]
        lse[:, r0:r1].copy_(row_lse.view(H, r1 - r0))
        probs = scores.sub_(row_lse.unsqueeze(-1)).exp_().view(h, qk * (r1 - r0), n)
        out[0, :, r0:r1].copy_(torch.bmm(probs, vf).view(H, r1 - r0, dv))
    return out


def column_sums(q: Tensor, k: Tensor, lse: Tensor, scaling: float, vis: Visibility, row0: int, out: Tensor) -> Tensor:
    """Pass 2: ``out`` ``[h, n]`` (float32) = for each key, ``exp(q·k·scale − lse)`` summed over block rows
    ``row0 … m − 1`` it is visible to and over the query heads of its KV head, divided by their number.

    Key-major, as the kernel: one key tile at a time (as many keys as ``PROBS_CHUNK_BYTES`` of scores over the
    rows allows), every row of every query head of the tile's KV head against it; the rows that cannot see any
    key of the tile (causal: ``r < first key − n_old``) are skipped."""
    H, m, d = q.shape[1], q.shape[2], q.shape[3]
    h, n = k.shape[1], k.shape[2]
    qk = H // h
    rows_all = torch.arange(m, device=q.device)
    tile = _rows_per_chunk(H, m - row0)
    for c0 in range(0, n, tile):
        c1 = min(n, c0 + tile)
        first = max(row0, c0 - vis.n_old)  # earlier rows see none of keys c0 … c1 − 1
        last = m if vis.window is None else min(m, max(first, c1 - 1 - vis.n_old + vis.window))
        if first >= last:
            out[:, c0:c1].zero_()
            continue
        qg = q[0, :, first:last].float().reshape(h, qk * (last - first), d)
        scores = torch.bmm(qg, k[0, :, c0:c1].float().transpose(1, 2)).mul_(scaling).view(h, qk, last - first, c1 - c0)
        scores.sub_(lse[:, first:last].view(h, qk, last - first, 1)).exp_()
        scores.masked_fill_(~vis.mask(rows_all[first:last], torch.arange(c0, c1, device=q.device)), 0.0)
        torch.sum(scores, dim=(1, 2), out=out[:, c0:c1]).div_(qk)
    return out
