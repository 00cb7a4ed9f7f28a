"""The two passes of ``column_sums.py`` as Triton kernels: imported only where they run (a CUDA cache whose
Triton imports, or a test under ``TRITON_INTERPRET=1``).

* ``_forward_kernel``: flash-attention forward of one tile of query rows of one query head (online softmax over
  key tiles, base-2 exponentials), writing the output and the row's log-sum-exp. Key tiles past the tile's
  last visible key are not visited (causal), nor those before a sliding window's first.
* ``_column_sums_kernel``: one program per (key tile, KV head), the key tile held for the whole program; it
  streams the query tiles of every query head of that KV head (the GQA group folded in), sums
  ``exp2(q·k·scale·log2(e) − lse·log2(e))`` over the visible rows and writes the tile's sums once: no atomics,
  no reads of V. Query rows that cannot see the tile (causal: ``r < first key − n_old``; past a window) are
  skipped.

Both take strided tensors (transformers' queries are a transposed view; K/V are slices of the cache's
buffers), so nothing is copied before a launch. The dot products take the inputs' dtype and accumulate in
float32; a float32 input multiplies in IEEE float32 (not TF32), as the torch form does.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvtool.core.column_sums import Visibility

LOG2E = 1.0 / math.log(2.0)


# The kernels keep their argument lists packed: one argument a line would take them past 80 lines.
# fmt: off
@triton.jit
def _forward_tile(acc, m_i, l_i, q, Kh, Vh, start, rows, dims, vdims, n, n_old, window, scale2, sk_n, sk_d, sv_n, sv_d,
                  D, DV, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, WINDOWED: tl.constexpr, IEEE: tl.constexpr):
    """One key tile of the online softmax; ``MASKED`` False for a tile every row of the query tile sees whole."""
    cols = start + tl.arange(0, BLOCK_N)
    k = tl.load(Kh + cols[:, None] * sk_n + dims[None, :] * sk_d, mask=(cols[:, None] < n) & (dims[None, :] < D),
                other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale2
    else:
        s = tl.dot(q, tl.trans(k)) * scale2
    if MASKED:
        dist = n_old + rows[:, None] - cols[None, :]
        seen = (dist >= 0) & (cols[None, :] < n)
        if WINDOWED:
            seen = seen & (dist < window)
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    v = tl.load(Vh + cols[:, None] * sv_n + vdims[None, :] * sv_d, mask=(cols[:, None] < n) & (vdims[None, :] < DV),
                other=0.0)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _forward_kernel(Q, K, V, Out, LSE, sq_h, sq_m, sq_d, sk_h, sk_n, sk_d, sv_h, sv_n, sv_d, so_h, so_m, so_d,
                    m, n, n_old, window, q_per_kv, scale2, D, DV, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    hq = tl.program_id(1)
    kvh = hq // q_per_kv
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    vdims = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + hq * sq_h + rows[:, None] * sq_m + dims[None, :] * sq_d,
                mask=(rows[:, None] < m) & (dims[None, :] < D), other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    Kh, Vh = K + kvh * sk_h, V + kvh * sv_h
    hi = tl.minimum(n, n_old + tl.minimum(pid_m * BLOCK_M + BLOCK_M, m))  # past the tile's last visible key
    if WINDOWED:  # every tile masked, from the first the window lets the tile's first row see
        lo = tl.maximum(0, n_old + pid_m * BLOCK_M - window + 1) // BLOCK_N * BLOCK_N
        for start in range(lo, hi, BLOCK_N):
            acc, m_i, l_i = _forward_tile(acc, m_i, l_i, q, Kh, Vh, start, rows, dims, vdims, n, n_old, window,
                                          scale2, sk_n, sk_d, sv_n, sv_d, D, DV, BLOCK_N, True, True, IEEE)
    else:  # keys up to the tile's first row's own are seen by every row: those whole tiles need no mask
        mid = tl.minimum(hi, (n_old + pid_m * BLOCK_M + 1) // BLOCK_N * BLOCK_N)
        for start in range(0, mid, BLOCK_N):
            acc, m_i, l_i = _forward_tile(acc, m_i, l_i, q, Kh, Vh, start, rows, dims, vdims, n, n_old, window,
                                          scale2, sk_n, sk_d, sv_n, sv_d, D, DV, BLOCK_N, False, False, IEEE)
        for start in range(mid, hi, BLOCK_N):
            acc, m_i, l_i = _forward_tile(acc, m_i, l_i, q, Kh, Vh, start, rows, dims, vdims, n, n_old, window,
                                          scale2, sk_n, sk_d, sv_n, sv_d, D, DV, BLOCK_N, True, False, IEEE)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # padding rows past m
    out = acc / l_safe[:, None]
    tl.store(Out + hq * so_h + rows[:, None] * so_m + vdims[None, :] * so_d, out.to(Out.dtype.element_ty),
             mask=(rows[:, None] < m) & (vdims[None, :] < DV))
    tl.store(LSE + hq * m + rows, (m_i + tl.log2(l_safe)) / 1.4426950408889634, mask=rows < m)


@triton.jit
def _sum_rows(acc, Qh, LSEh, k, r0, cols, last, n_old, window, scale2, sq_m, sq_d, dims, D,
              BLOCK_M: tl.constexpr, MASKED: tl.constexpr, WINDOWED: tl.constexpr, IEEE: tl.constexpr):
    """One query tile's ``exp2(q·k·scale − lse)`` summed into the key tile's ``acc``. Rows past ``last`` read
    ``lse = +inf`` (they add 0); ``MASKED`` False for a query tile whose every row sees the whole key tile."""
    rows = r0 + tl.arange(0, BLOCK_M)
    live = rows < last
    q = tl.load(Qh + rows[:, None] * sq_m + dims[None, :] * sq_d, mask=live[:, None] & (dims[None, :] < D), other=0.0)
    lse2 = tl.load(LSEh + rows, mask=live, other=float("inf")) * 1.4426950408889634
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    p = tl.exp2(s * scale2 - lse2[:, None])
    if MASKED:
        dist = n_old + rows[:, None] - cols[None, :]
        seen = dist >= 0
        if WINDOWED:
            seen = seen & (dist < window)
        p = tl.where(seen, p, 0.0)
    return acc + tl.sum(p, 0)


@triton.jit
def _column_sums_kernel(Q, K, LSE, OUT, sq_h, sq_m, sq_d, sk_h, sk_n, sk_d,
                        m, n, n_old, window, row0, q_per_kv, scale2, inv_group, D,
                        BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        WINDOWED: tl.constexpr, IEEE: tl.constexpr):
    pid_n = tl.program_id(0)
    kvh = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    k = tl.load(K + kvh * sk_h + cols[:, None] * sk_n + dims[None, :] * sk_d,
                mask=(cols[:, None] < n) & (dims[None, :] < D), other=0.0)
    acc = tl.zeros([BLOCK_N], tl.float32)  # columns past n sum garbage: never stored
    first = tl.maximum(row0, pid_n * BLOCK_N - n_old)  # earlier rows see none of this tile's keys
    if WINDOWED:
        last = tl.minimum(m, pid_n * BLOCK_N + BLOCK_N - 1 - n_old + window)
        diag = last  # every query tile masked
    else:
        last = m
        # rows from the tile's last key's own on see the whole tile: their query tiles need no mask
        diag = first + tl.maximum(0, tl.minimum(n, pid_n * BLOCK_N + BLOCK_N) - 1 - n_old - first + BLOCK_M - 1) \
            // BLOCK_M * BLOCK_M
        diag = tl.minimum(diag, last)
    for j in range(0, q_per_kv):
        hq = kvh * q_per_kv + j
        for r0 in range(first, diag, BLOCK_M):
            acc = _sum_rows(acc, Q + hq * sq_h, LSE + hq * m, k, r0, cols, last, n_old, window, scale2, sq_m, sq_d,
                            dims, D, BLOCK_M, True, WINDOWED, IEEE)
        for r0 in range(diag, last, BLOCK_M):
            acc = _sum_rows(acc, Q + hq * sq_h, LSE + hq * m, k, r0, cols, last, n_old, window, scale2, sq_m, sq_d,
                            dims, D, BLOCK_M, False, WINDOWED, IEEE)
    tl.store(OUT + kvh * n + cols, acc * inv_group, mask=cols < n)
# fmt: on


def _tiles(d: int) -> tuple[dict, dict]:
    """Launch shapes of (forward, column sums) for head dimension ``d`` (Triton's fused-attention tutorial's
    choices: 128-row query tiles up to d = 128, smaller tiles for d = 256's shared memory)."""
    if d <= 64:
        return (
            dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
            dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
        )
    if d <= 128:
        return (
            dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
            dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=3),
        )
    return (
        dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
        dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2),
    )


def _width(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scaling: float,
    vis: Visibility,
    lse: Tensor,
    out: Tensor | None = None,
    tiles: dict | None = None,
) -> Tensor:
    """Pass 1 (``column_sums.forward``'s contract): output ``[1, H, m, dv]``, natural log-sum-exp into ``lse``.

    A fresh output is laid out ``[1, m, H, dv]`` and returned as its ``[1, H, m, dv]`` view, so the attention
    function's transpose back to transformers' layout is free. ``tiles`` overrides the launch shape (tests)."""
    H, m, d = q.shape[1], q.shape[2], q.shape[3]
    h, n, dv = k.shape[1], k.shape[2], v.shape[3]
    if out is None:
        out = torch.empty(1, m, H, dv, dtype=v.dtype, device=q.device).transpose(1, 2)
    cfg = dict(tiles or _tiles(d)[0])
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), H)
    _forward_kernel[grid](
        q,
        k,
        v,
        out,
        lse,
        q.stride(1),
        q.stride(2),
        q.stride(3),
        k.stride(1),
        k.stride(2),
        k.stride(3),
        v.stride(1),
        v.stride(2),
        v.stride(3),
        out.stride(1),
        out.stride(2),
        out.stride(3),
        m,
        n,
        vis.n_old,
        vis.window or 0,
        H // h,
        scaling * LOG2E,
        d,
        dv,
        BLOCK_D=_width(d),
        BLOCK_DV=_width(dv),
        WINDOWED=vis.window is not None,
        IEEE=q.dtype == torch.float32,
        **cfg,
    )
    return out


def column_sums(
    q: Tensor,
    k: Tensor,
    lse: Tensor,
    scaling: float,
    vis: Visibility,
    row0: int,
    out: Tensor,
    tiles: dict | None = None,
) -> Tensor:
    """Pass 2 (``column_sums.column_sums``'s contract): ``out`` ``[h, n]`` float32, contiguous."""
    H, m, d = q.shape[1], q.shape[2], q.shape[3]
    h, n = k.shape[1], k.shape[2]
    cfg = dict(tiles or _tiles(d)[1])
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), h)
    _column_sums_kernel[grid](
        q,
        k,
        lse,
        out,
        q.stride(1),
        q.stride(2),
        q.stride(3),
        k.stride(1),
        k.stride(2),
        k.stride(3),
        m,
        n,
        vis.n_old,
        vis.window or 0,
        row0,
        H // h,
        scaling * LOG2E,
        1.0 / (H // h),
        d,
        BLOCK_D=_width(d),
        WINDOWED=vis.window is not None,
        IEEE=q.dtype == torch.float32,
        **cfg,
    )
    return out
