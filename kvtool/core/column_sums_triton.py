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
    hi = tl.minimum(n, n_old + tl.minimum(pid_m * BLOCK_M + BLOCK_M, m))  # past the tile's last visible key
    lo = 0
    if WINDOWED:
        lo = tl.maximum(0, n_old + pid_m * BLOCK_M - window + 1) // BLOCK_N * BLOCK_N
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        k = tl.load(K + kvh * sk_h + cols[:, None] * sk_n + dims[None, :] * sk_d,
                    mask=(cols[:, None] < n) & (dims[None, :] < D), other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        dist = n_old + rows[:, None] - cols[None, :]
        seen = (dist >= 0) & (cols[None, :] < n)
        if WINDOWED:
            seen = seen & (dist < window)
        s = tl.where(seen, s * scale2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kvh * sv_h + cols[:, None] * sv_n + vdims[None, :] * sv_d,
                    mask=(cols[:, None] < n) & (vdims[None, :] < DV), other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # padding rows past m
    out = acc / l_safe[:, None]
    tl.store(Out + hq * so_h + rows[:, None] * so_m + vdims[None, :] * so_d, out.to(Out.dtype.element_ty),
             mask=(rows[:, None] < m) & (vdims[None, :] < DV))
    tl.store(LSE + hq * m + rows, (m_i + tl.log2(l_safe)) / 1.4426950408889634, mask=rows < m)


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
    acc = tl.zeros([BLOCK_N], tl.float32)
    first = tl.maximum(row0, pid_n * BLOCK_N - n_old)  # earlier rows see none of this tile's keys
    last = m
    if WINDOWED:
        last = tl.minimum(m, pid_n * BLOCK_N + BLOCK_N - 1 - n_old + window)
    for j in range(0, q_per_kv):
        hq = kvh * q_per_kv + j
        for r0 in range(first, last, BLOCK_M):
            rows = r0 + tl.arange(0, BLOCK_M)
            live = rows < last
            q = tl.load(Q + hq * sq_h + rows[:, None] * sq_m + dims[None, :] * sq_d,
                        mask=live[:, None] & (dims[None, :] < D), other=0.0)
            lse2 = tl.load(LSE + hq * m + rows, mask=live, other=float("inf")) * 1.4426950408889634
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            dist = n_old + rows[:, None] - cols[None, :]
            seen = (dist >= 0) & live[:, None] & (cols[None, :] < n)
            if WINDOWED:
                seen = seen & (dist < window)
            p = tl.where(seen, tl.exp2(s * scale2 - lse2[:, None]), 0.0)
            acc += tl.sum(p, 0)
    tl.store(OUT + kvh * n + cols, acc * inv_group, mask=cols < n)


def _tiles(d: int) -> tuple[dict, dict]:
    """Launch shapes of (forward, column sums) for head dimension ``d`` (Triton's fused-attention tutorial's
    choices: 128-row query tiles up to d = 128, smaller tiles for d = 256's shared memory)."""
    if d <= 64:
        return (dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
                dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3))
    if d <= 128:
        return (dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
                dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=3))
    return (dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
            dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2))


def _width(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def forward(q: Tensor, k: Tensor, v: Tensor, scaling: float, vis: Visibility, lse: Tensor,
            out: Tensor | None = None, tiles: dict | None = None) -> Tensor:
    """Pass 1 (``column_sums.forward``'s contract): output ``[1, H, m, dv]``, natural log-sum-exp into ``lse``.

    A fresh output is laid out ``[1, m, H, dv]`` and returned as its ``[1, H, m, dv]`` view, so the attention
    function's transpose back to transformers' layout is free. ``tiles`` overrides the launch shape (tests)."""
    H, m, d = q.shape[1], q.shape[2], q.shape[3]
    h, n, dv = k.shape[1], k.shape[2], v.shape[3]
    if out is None:
        out = torch.empty(1, m, H, dv, dtype=v.dtype, device=q.device).transpose(1, 2)
    cfg = dict(tiles or _tiles(d)[0])
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), H)
    _forward_kernel[grid](q, k, v, out, lse, q.stride(1), q.stride(2), q.stride(3), k.stride(1), k.stride(2),
                          k.stride(3), v.stride(1), v.stride(2), v.stride(3), out.stride(1), out.stride(2),
                          out.stride(3), m, n, vis.n_old, vis.window or 0, H // h, scaling * LOG2E, d, dv,
                          BLOCK_D=_width(d), BLOCK_DV=_width(dv), WINDOWED=vis.window is not None,
                          IEEE=q.dtype == torch.float32, **cfg)
    return out


def column_sums(q: Tensor, k: Tensor, lse: Tensor, scaling: float, vis: Visibility, row0: int, out: Tensor,
                tiles: dict | None = None) -> Tensor:
    """Pass 2 (``column_sums.column_sums``'s contract): ``out`` ``[h, n]`` float32, contiguous."""
    H, m, d = q.shape[1], q.shape[2], q.shape[3]
    h, n = k.shape[1], k.shape[2]
    cfg = dict(tiles or _tiles(d)[1])
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), h)
    _column_sums_kernel[grid](q, k, lse, out, q.stride(1), q.stride(2), q.stride(3), k.stride(1), k.stride(2),
                              k.stride(3), m, n, vis.n_old, vis.window or 0, row0, H // h, scaling * LOG2E,
                              1.0 / (H // h), d, BLOCK_D=_width(d), WINDOWED=vis.window is not None,
                              IEEE=q.dtype == torch.float32, **cfg)
    return out
