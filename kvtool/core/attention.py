"""The attention function kvtool registers with transformers (``attn_implementation="kvtool"``).

transformers calls it once per layer with the block's queries after ``BoundedCache.update`` has
appended the block's keys/values. For each head group of the layer it

1. attends the group's query heads over the group's stored tokens (cache + block) with a block-causal
   mask — through SDPA unless the policy needs every row's probabilities, in which case the same
   probabilities give the output (no double work);
2. computes attention probabilities only for the query rows the policy asked for (none for
   attention-free policies), averaged over the query heads that share a KV head (the engine's GQA
   rule, ``mean``; ``max`` is available);
3. hands them to the layer, which lets the policy score and evicts down to capacity — right away,
   so at most one layer's probabilities exist at a time.

A policy that reads its rows' probabilities only summed (``rows_summed``: H2O, SnapKV's window) gets, on a cache
whose ``two_pass`` is set (a CUDA cache where Triton imports), the output and those column sums from two passes
that never hold a probability matrix (``core/column_sums.py``: a forward that returns each row's log-sum-exp,
then a key-major sum of ``exp(q·k·scale − lse)``); blocks under ``column_sums.MIN_ROWS`` rows, softcapped layers
and RazorAttention's compensated groups keep the explicit path.

SDPA gets no ``enable_gqa``: the query heads that share a KV head are folded into the query length
(``[1, kv_heads, q_per_kv · m, d]``) and the mask is repeated along the folded axis, as an additive
mask in the queries' dtype whose rows are 16-element aligned. On CUDA, masked GQA (``enable_gqa`` with
an explicit mask) is served only by the math backend (float32 scores for the whole block); the
folded problem is plain multi-head attention with a mask, which the memory-efficient kernel takes
without padding or converting the mask on every call. The folded mask is built once per block and
shared by every layer.

Sliding-window layers (``HeadGroup.window``, see ``core/families.py``) hold contiguous tokens, so
their mask is arithmetic: query row ``r`` sees column ``j`` iff ``0 <= r + n_old - j < W``. Logit
softcapping (Gemma 2: ``softcap=``) is ``tanh(s / c) · c`` on the scaled scores; SDPA cannot do it, so
a softcapped layer always takes the explicit-probability path.

Without the engine's cache (a plain ``model(input_ids)`` after an ``Engine`` was built) both the
attention and the mask function fall through to transformers' SDPA (or, with softcapping, to the
same explicit computation), so the model stays usable.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from kvtool.config import probs_chunk_rows
from kvtool.core import column_sums
from kvtool.core.cache import BoundedCache, BoundedLayer, HeadGroup
from kvtool.core.column_sums import MIN_ROWS, Visibility
from kvtool.errors import UsageError

NAME = "kvtool"


def _block_mask(cache: BoundedCache, m: int, n_total: int, off: int, bias: float | None, dtype: torch.dtype,
                device: torch.device) -> Tensor | None:
    """Mask [m, off + n_total]: cached tokens visible, block causal, compensation slot biased by log N_d."""
    key = (m, n_total, off)
    masks = cache.step.masks
    if key in masks and bias is None:
        return masks[key]
    n_old = n_total - m
    cols = torch.arange(n_total, device=device)
    rows = torch.arange(m, device=device)
    visible = (cols.unsqueeze(0) < n_old) | (cols.unsqueeze(0) - n_old <= rows.unsqueeze(1))
    if off == 0:
        mask = None if m == 1 else visible
        masks[key] = mask  # type: ignore[assignment]
        return mask
    # float mask: compensation column gets log N_d (eq. 5), others 0 / -inf
    fmask = torch.zeros(m, off + n_total, dtype=dtype, device=device)
    fmask[:, off:].masked_fill_(~visible, float("-inf"))
    fmask[:, 0] = bias if bias is not None else float("-inf")
    return fmask


def _window_mask(cache: BoundedCache, m: int, n_total: int, window: int, device: torch.device) -> Tensor | None:
    """Mask [m, n_total] of a sliding group (contiguous tokens): block causal and distance < window."""
    if n_total <= window:  # no pair is a window apart: the plain block-causal mask
        return _block_mask(cache, m, n_total, 0, None, torch.bool, device)
    key = (m, n_total, 0, window)
    masks = cache.step.masks
    if key not in masks:
        n_old = n_total - m
        dist = torch.arange(m, device=device).unsqueeze(1) + n_old - torch.arange(n_total, device=device)
        masks[key] = (dist >= 0) & (dist < window)
    return masks[key]


def _probs(q: Tensor, k: Tensor, mask: Tensor | None, scaling: float, softcap: float | None = None,
           scratch: Tensor | None = None, cache: BoundedCache | None = None) -> Tensor:
    """Softmax(cap(q kᵀ · scale) + mask) in float32, grouped by KV head: [h, q_per_kv, r, n].

    Query heads sharing a KV head are batched against it, so K is never repeated per query head.
    ``softcap`` (Gemma 2) caps the scaled scores with ``tanh(s / c) · c`` before the mask, as
    transformers' eager attention does.

    The softmax runs in place on one buffer (``scratch``, the cache's reusable float32 storage, or a
    fresh one): a matmul into it, the mask added, then torch's fused softmax with ``out=`` the same
    buffer — no second ``[h, q_per_kv·r, n]`` tensor. The result lives in ``scratch`` until its next use.

    Why not SDPA's log-sum-exp: CPU's fused kernel
    (``_scaled_dot_product_flash_attention_for_cpu``) returns the row normaliser, but it needs K and V
    expanded to every query head, and the column sums a policy wants still need ``exp(q kᵀ − lse)``
    for every entry — a second ``q kᵀ`` matmul and an exp pass, which costs more than the one
    in-place softmax here. Writing into ``scratch`` rather than a fresh tensor avoids allocating
    (and page-faulting) a new ``[h, q_per_kv·r, n]`` buffer per layer and block. ``cache``: the product's
    batch is evened out for the CPU's threads (``_head_bmm``).
    """
    h, n, d = k.shape[1], k.shape[2], k.shape[3]
    r = q.shape[2]
    q_per_kv = q.shape[1] // h
    qg = q[0].float().reshape(h, q_per_kv * r, d)
    if scratch is None:
        scratch = torch.empty(h, q_per_kv * r, n, dtype=torch.float32, device=q.device)
    scores = _head_bmm(cache, qg, k[0].float(), scratch, "keys", transposed=True).mul_(scaling)
    grouped = scores.view(h, q_per_kv, r, n)
    if softcap is not None:
        scores.div_(softcap).tanh_().mul_(softcap)
    if mask is not None:
        if mask.dtype == torch.bool:
            grouped.masked_fill_(~mask, float("-inf"))
        else:
            grouped.add_(mask.float())
    torch.softmax(scores, dim=-1, out=scores)  # one fused kernel, in place: each row is read before it is written
    return grouped


def _head_bmm(cache: BoundedCache | None, a: Tensor, b: Tensor, out: Tensor | None, name: str,
              transposed: bool = False) -> Tensor:
    """``a @ b`` per KV head ([h, M, K] × [h, K, N]; ``transposed``: ``b`` given as [h, N, K]).

    torch's CPU ``bmm`` gives whole batch entries to its threads, so 3 KV heads on 2 threads leave one idle a
    third of the time (SmolLM2's QK and PV at block 128: 2.42 → 1.85 ms a layer once evened out). With
    ``cache.batch_split(h, M)`` = s > 1, each head's M rows are cut in s parts, each multiplied by its own copy
    of the head's ``b`` (a reused buffer, ``name``): a batch of h·s entries, the same products.
    """
    h, m = a.shape[0], a.shape[1]
    parts = 1 if cache is None else cache.batch_split(h, m)
    if parts == 1:
        return torch.bmm(a, b.transpose(1, 2) if transposed else b, out=out)
    copies = cache.buffer(name, b.dtype, h, parts, b.shape[1], b.shape[2])  # type: ignore[union-attr]
    copies.copy_(b.unsqueeze(1).expand_as(copies))
    copies = copies.view(h * parts, b.shape[1], b.shape[2])
    res = torch.bmm(a.reshape(h * parts, m // parts, a.shape[2]), copies.transpose(1, 2) if transposed else copies,
                    out=None if out is None else out.view(h * parts, m // parts, out.shape[2]))
    return res.view(h, m, res.shape[2])


def _additive(cache: BoundedCache, mask: Tensor, key: tuple | None) -> Tensor:
    """A boolean visibility mask as float32 0 / −inf for the explicit probabilities (cached per block by ``key``,
    so layers add it instead of inverting and filling it each)."""
    full_key = None if key is None else (*key, "f32")
    masks = cache.step.masks
    if full_key is not None and full_key in masks:
        return masks[full_key]
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    if full_key is not None:
        masks[full_key] = out  # type: ignore[index]
    return out


def _decode_mass(q: Tensor, k: Tensor, mask: Tensor | None, scaling: float, off: int) -> Tensor:
    """One decode query's probabilities summed over the query heads of each KV head: [h, n] (citations).

    Scores in the cache's dtype (no float32 copy of K, unlike :func:`_probs`), softmax in float32. The
    query is scaled before the product: in float16 an unscaled ``q·k`` can pass 65504 (inf) where the
    scaled score is well within range.
    """
    h, d = k.shape[1], k.shape[3]
    scores = torch.bmm(q[0].reshape(h, -1, d) * scaling, k[0].transpose(1, 2)).float()  # [h, q_per_kv, n]
    if mask is not None:  # a single query row: only RazorAttention's float mask (compensation bias)
        scores = scores + mask.float()
    return torch.softmax(scores, dim=-1)[..., off:].sum(1)


def _sdpa_mask(cache: BoundedCache, mask: Tensor, q_per_kv: int, dtype: torch.dtype,
               key: tuple | None) -> Tensor:
    """``mask`` [m, n] as SDPA's folded additive mask [q_per_kv · m, n] in ``dtype`` (cached per block by ``key``).

    Row ``j · m + r`` is query head ``j`` of a KV head at block row ``r``: the mask repeated along the
    folded axis. Rows are allocated 16 elements wide (then sliced), so the memory-efficient CUDA kernel
    takes it without a padded copy; a boolean mask becomes 0 / −inf once here instead of in every call.
    """
    full_key = None if key is None else (*key, q_per_kv, str(dtype), "sdpa")
    masks = cache.step.masks
    if full_key is not None and full_key in masks:
        return masks[full_key]
    m, n = mask.shape
    width = -(-n // 16) * 16
    folded = torch.zeros(q_per_kv, m, width, dtype=dtype, device=mask.device)[..., :n]
    if mask.dtype == torch.bool:
        folded.masked_fill_(~mask, float("-inf"))
    else:
        folded.copy_(mask.expand(q_per_kv, m, n))
    out = folded.view(q_per_kv * m, n)
    if full_key is not None:
        masks[full_key] = out  # type: ignore[index]
    return out


def _sdpa(cache: BoundedCache, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, key: tuple | None,
          scaling: float) -> Tensor:
    """Output [1, h · q_per_kv, m, d] of SDPA with the query heads of each KV head folded into the query length.

    Equal to ``enable_gqa=True`` with the mask broadcast over heads, but an efficient kernel can run it
    (see the module docstring). A single query row with no mask needs no mask after folding either.
    """
    h, m, d = k.shape[1], q.shape[2], q.shape[3]
    q_per_kv = q.shape[1] // h
    folded_q = q.reshape(1, h, q_per_kv * m, d)  # a view for decode rows and for index-selected groups
    folded_mask = None if mask is None else _sdpa_mask(cache, mask, q_per_kv, q.dtype, key)
    out = F.scaled_dot_product_attention(folded_q, k, v, attn_mask=folded_mask, scale=scaling)
    # a CUDA kernel may return its output as [1, q_per_kv · m, h, d] transposed: then unfolding the heads copies it
    return out.reshape(1, h * q_per_kv, m, v.shape[-1])


def _explicit_chunked(cache: BoundedCache, g: HeadGroup, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                      scaling: float, softcap: float | None, want: bool,
                      output: bool = True) -> tuple[Tensor | None, Tensor | None]:
    """The block's output from explicit probabilities (``output``), ``probs_chunk_rows`` query rows at a time, and
    (``want``) the probabilities summed over every row, [h, 1, n] (a policy that reads them only so:
    ``rows_summed``).

    One chunk when the block fits (a CPU block, or a short budget): the same work as one pass.
    """
    h, qk, m, n, dv = k.shape[1], g.q_per_kv, q.shape[2], k.shape[2], v.shape[-1]
    chunk = min(m, probs_chunk_rows(h * qk, n))
    out = sums = None
    if chunk == m:
        attn = _probs(q, k, mask, scaling, softcap, cache.scratch(h, qk * m, n), cache)
        if output:
            out = _head_bmm(cache, attn.view(h, qk * m, n).to(v.dtype), v[0], None, "values").view(1, h * qk, m, dv)
        if want:
            sums = attn[..., g.off :].sum((1, 2)).div_(qk).unsqueeze(1)
        return out, sums
    if output:
        out = torch.empty(1, h * qk, m, dv, dtype=v.dtype, device=v.device)
    if want:
        sums = torch.zeros(h, 1, n - g.off, dtype=torch.float32, device=v.device)
    for r0 in range(0, m, chunk):
        r1 = min(m, r0 + chunk)
        attn = _probs(q[:, :, r0:r1], k, None if mask is None else mask[r0:r1], scaling, softcap,
                      cache.scratch(h, qk * (r1 - r0), n), cache)
        if out is not None:
            part = _head_bmm(cache, attn.view(h, qk * (r1 - r0), n).to(v.dtype), v[0], None, "values")
            out[0, :, r0:r1].copy_(part.view(h * qk, r1 - r0, dv))
        if sums is not None:
            sums[:, 0].add_(attn[..., g.off :].sum((1, 2)))
    if sums is not None:
        sums.div_(qk)
    return out, sums


def _two_pass(cache: BoundedCache, g: HeadGroup, q: Tensor, k: Tensor, v: Tensor, scaling: float,
              rows: int) -> tuple[Tensor, Tensor]:
    """The block's output and the column sums of its last ``rows`` query rows ([h, 1, n]) without the probability
    matrix (``core/column_sums.py``): the forward returns each row's log-sum-exp, then a key-major pass sums
    ``exp(q·k·scale − lse)``. ``cache.two_pass``: ``"triton"`` (the kernels; a CUDA cache) or ``"torch"``.

    Only the second pass is the statistic's cost (timed as ``probs``): the first is the block's attention."""
    h, n, m = k.shape[1], k.shape[2], q.shape[2]
    vis = Visibility(n - m, g.window)
    impl = column_sums if cache.two_pass == "torch" else _kernels()
    lse = cache.buffer("lse", torch.float32, q.shape[1], m)
    out = impl.forward(q, k, v, scaling, vis, lse)
    t0 = cache.timer.start()
    sums = impl.column_sums(q, k, lse, scaling, vis, m - rows, cache.buffer("column_sums", torch.float32, h, n))
    cache.counters.prob_rows += rows
    cache.timer.stop("probs", t0)
    return out, sums.unsqueeze(1)


def _kernels() -> Any:
    """The Triton kernels' module, imported on first use: only a cache whose ``two_pass`` is ``"triton"`` asks."""
    from kvtool.core import column_sums_triton

    return column_sums_triton


def _reduce_gqa(p: Tensor, off: int) -> Tensor:
    """[h, q_per_kv, r, off + n] → [h, r, n]: the engine's one rule for query heads sharing a KV head (mean)."""
    return p[..., off:].mean(1)


def _attend_group(layer: BoundedLayer, g: HeadGroup, query: Tensor, scaling: float,
                  softcap: float | None = None) -> Tensor:
    cache = layer.owner
    m = query.shape[2]
    q = query if g.all_heads else query.index_select(1, g.q_index)
    k, v = g.kv()
    n = g.length
    policy = g.policy
    evicting = g.evicts_now(cache.lazy, cache.lazy_limit)
    rows = min(policy.query_rows(m), m) if (evicting or policy.observe_every_step) else 0
    if rows and cache.two_pass is not None and policy.rows_summed and m >= MIN_ROWS and softcap is None and not g.off:
        out, sums = _two_pass(cache, g, q, k, v, scaling, rows)  # no probability matrix, no mask tensor
        layer.after_attention(g, sums)
        return out
    bias = g.comp_bias() if g.off else None
    if g.window is not None:
        mask = _window_mask(cache, m, n, g.window, q.device)
        mask_key: tuple | None = (m, n, 0, g.window)
    else:
        mask = _block_mask(cache, m, n, g.off, bias, q.dtype, q.device)
        mask_key = (m, n, g.off) if bias is None else None  # the compensation bias is per group: not shared
    probs = None
    if (rows or softcap is not None) and mask is not None and mask.dtype == torch.bool:
        mask = _additive(cache, mask, mask_key)  # float32 0 / −inf, once per block: one add per layer
    if rows == m or softcap is not None:
        t0 = cache.timer.start() if rows > 0 else None  # a softcapped block that reads no probabilities: untimed
        attn = None
        if cache.fused_output and softcap is None and rows == m and policy.rows_summed:
            # a GPU: the output from SDPA's fused kernel (what transformers computes, bit for bit), the column
            # sums from float32 probabilities alone: a third of the passes over the [h, rows, n] matrix
            out = _sdpa(cache, q, k, v, mask, mask_key, scaling)
            probs = _explicit_chunked(cache, g, q, k, v, mask, scaling, None, True, output=False)[1]
        elif (rows == m and policy.rows_summed) or rows == 0:  # bounded: chunks of rows, their sums kept
            out, probs = _explicit_chunked(cache, g, q, k, v, mask, scaling, softcap, rows > 0)
        else:
            attn = _probs(q, k, mask, scaling, softcap, cache.scratch(len(g.heads), g.q_per_kv * m, k.shape[2]),
                          cache)
            # every row: the probabilities give the output too
            h, qk, _, nk = attn.shape
            out = _head_bmm(cache, attn.view(h, qk * m, nk).to(v.dtype), v[0], None, "values").view(
                1, h * qk, m, v.shape[-1])
            if rows > 0:
                probs = _reduce_gqa(attn[:, :, m - rows :], g.off)
        if t0 is not None:
            cache.counters.prob_rows += rows
            cache.timer.stop("probs", t0)
    else:
        out = _sdpa(cache, q, k, v, mask, mask_key, scaling)
        if rows > 0:
            t0 = cache.timer.start()
            sub_mask = None if mask is None else mask[-rows:]
            scratch = cache.scratch(len(g.heads), g.q_per_kv * rows, k.shape[2])
            attn = _probs(q[:, :, -rows:], k, sub_mask, scaling, None, scratch, cache)
            probs = _reduce_gqa(attn, g.off)
            cache.counters.prob_rows += rows
            cache.timer.stop("probs", t0)
    if g.mass is not None and m == 1:  # citing: this decode step's attention over the stored tokens
        g.mass[:, :n].addcmul_(attn[..., g.off :].sum((1, 2)) if rows == 1 and attn is not None else _decode_mass(
            q, k, mask, scaling, g.off), cache.mass_gate)
    layer.after_attention(g, probs)
    return out


def kvtool_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Attention over the bounded cache; returns ``[batch, m, heads, d]`` like transformers' SDPA path."""
    step = kwargs.get("kvtool_step")
    if step is not None:  # the fixed-shape decode step (kvtool/core/decode_step.py): every slot, masked
        return step.attend(module, query, query.shape[-1] ** -0.5 if scaling is None else scaling,
                           kwargs.get("softcap")), None
    cache = kwargs.get("kvtool_cache")
    softcap = kwargs.get("softcap")
    if kwargs.get("s_aux") is not None:  # check_supported refuses these models up front; never compute wrongly
        raise UsageError("attention-sink logits (s_aux) are not supported by kvtool")
    if not isinstance(cache, BoundedCache):
        # A plain forward of the same model (no engine cache): transformers' own SDPA path, so the
        # model stays usable for everything else after an Engine was built on it.
        if softcap is not None:
            return _explicit_attention(query, key, value, attention_mask, scaling, softcap,
                                       kwargs.get("sliding_window")), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    layer: BoundedLayer = cache.layers[module.layer_idx]  # type: ignore[assignment]
    window = kwargs.get("sliding_window")
    if window != layer.groups[0].window:  # the layer table (families.layer_windows) disagrees with the model
        raise UsageError(f"layer {module.layer_idx}: the model attends with sliding_window={window}, kvtool's "
                         f"cache expected {layer.groups[0].window}; this model's layer layout is not supported")
    if cache.query_log is not None:  # recall scores archive pages against the question's own queries
        cache.query_log.append((module.layer_idx, query, scaling))
    if len(layer.groups) == 1:
        out = _attend_group(layer, layer.groups[0], query, scaling, softcap)
    else:
        out = torch.empty_like(query)
        for g in layer.groups:
            out.index_copy_(1, g.q_index, _attend_group(layer, g, query, scaling, softcap))
    return out.transpose(1, 2).contiguous(), None


def _explicit_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scaling: float | None,
                        softcap: float, window: int | None) -> Tensor:
    """Softcapped attention of a plain forward (no engine cache), like transformers' eager path.

    The SDPA mask function returns None where SDPA's own causal flag would do; then the causal (and
    sliding-window) mask is built here, the queries being the last ``q`` of the ``k`` positions.
    """
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if mask is None and query.shape[2] > 1:
        q_len, k_len = query.shape[2], key.shape[2]
        dist = torch.arange(k_len - q_len, k_len, device=query.device)[:, None] - torch.arange(k_len,
                                                                                             device=query.device)
        mask = (dist >= 0) & (dist < window) if window is not None else dist >= 0
    rep = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(rep, dim=1)
    v = value.repeat_interleave(rep, dim=1)
    scores = torch.matmul(query.float(), k.float().transpose(-1, -2)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.float()
    out = torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
    return out.transpose(1, 2).contiguous()


def kvtool_mask(*args: Any, **kwargs: Any) -> Tensor | None:
    """transformers' SDPA mask, used only by a plain forward (no engine cache).

    With the engine's cache the attention function ignores it and masks each head group itself (the
    shared mask transformers builds from the first layer cannot describe per-group caches).
    """
    return sdpa_mask(*args, **kwargs)


_registered = False


def register() -> None:
    """Register the attention and mask functions with transformers (idempotent)."""
    global _registered
    if not _registered:
        AttentionInterface.register(NAME, kvtool_attention)
        AttentionMaskInterface.register(NAME, kvtool_mask)
        _registered = True

