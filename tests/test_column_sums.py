"""Attention column sums in two passes (kvtool/core/column_sums.py and its Triton kernels) against brute force.

Oracles: (a) the statistic H2O and SnapKV's window read — each key's probability summed over the block's rows
(from ``row0``) and averaged over the query heads of its KV head — and the block's output, from the whole
probability matrix in float64; (b) through the engine, a read with the two passes equals the explicit path's
(logits, H2O's running sums, the kept tokens), transformers' dense forward when nothing is evicted, and the
float64 masking reference after eviction. The Triton kernels run under ``TRITON_INTERPRET=1`` on a CPU (float32
and float16: the interpreter has no bfloat16) and natively on CUDA; without Triton their tests skip.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtool.core.column_sums import MIN_ROWS, Visibility, column_sums, forward
from tests.helpers import (
    VOCAB,
    dense_logits,
    make_engine,
    masking_reference_logits,
    record_visibility,
    stream_logits,
    tiny_family,
    tiny_qwen2,
)

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
#: (KV heads, query heads per KV head, block rows, tokens before the block, head dim, window)
SHAPES = [
    (2, 3, 40, 60, 16, None),  # GQA, a block over a filled cache
    (1, 1, 33, 0, 8, None),  # the first block: nothing before it, head dim under a tile's 16
    (3, 2, 24, 50, 20, 7),  # a sliding window shorter than the block; head dim not a power of two
    (2, 4, 17, 90, 16, 40),  # a window longer than the block, shorter than the cache
    (2, 2, 48, 20, 32, 500),  # a window longer than everything: plain causal
]


def brute_force(q, k, v, scaling: float, vis: Visibility, row0: int = 0):
    """(column sums [h, n], output [1, H, m, dv], natural log-sum-exp [H, m]) from the float64 probability matrix."""
    H, m = q.shape[1], q.shape[2]
    h, n = k.shape[1], k.shape[2]
    qk = H // h
    kk, vv = (t[0].double().repeat_interleave(qk, dim=0) for t in (k, v))
    scores = (q[0].double() @ kk.transpose(1, 2)) * scaling
    scores = scores.masked_fill(~vis.mask(torch.arange(m), torch.arange(n)).to(q.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    sums = probs[:, row0:].sum(1).view(h, qk, n).mean(1)
    return sums, (probs @ vv).unsqueeze(0), torch.logsumexp(scores, dim=-1)


def make(shape, dtype, seed=0, strided=True):
    """q [1, H, m, d] (a transposed view, as transformers passes it), k, v [1, h, n, d] (slices of longer buffers,
    as the cache's views are), float64-exact in ``dtype``."""
    h, qk, m, n_old, d, window = shape
    g = torch.Generator().manual_seed(seed)
    n = n_old + m
    q = (2 * torch.randn(1, m, h * qk, d, generator=g)).to(dtype).transpose(1, 2)
    k = torch.randn(1, h, n + 5, d, generator=g).to(dtype)[:, :, :n]
    v = torch.randn(1, h, n + 5, d, generator=g).to(dtype)[:, :, :n]
    if not strided:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), Visibility(n_old, window)


# -- a. the torch form --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("row0", [0, 5])
def test_torch_two_passes_equal_the_probability_matrix(shape, row0, monkeypatch):
    """Rows and key tiles in several chunks (a tiny chunk budget) and in one."""
    from kvtool.core import column_sums as mod

    q, k, v, vis = make(shape, torch.float32)
    d = q.shape[-1]
    want_sums, want_out, want_lse = brute_force(q, k, v, d**-0.5, vis, row0)
    for chunk in (mod.PROBS_CHUNK_BYTES, 4 * q.shape[1] * 7):
        monkeypatch.setattr(mod, "PROBS_CHUNK_BYTES", chunk)
        lse = torch.empty(q.shape[1], q.shape[2], device=DEVICE)
        out = forward(q, k, v, d**-0.5, vis, lse)
        sums = column_sums(q, k, lse, d**-0.5, vis, row0, torch.empty(k.shape[1], k.shape[2], device=DEVICE))
        torch.testing.assert_close(sums.double(), want_sums, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


# -- b. the Triton kernels ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kernels():
    pytest.importorskip("triton")
    if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it: set to something else
        pytest.skip("Triton kernels on a CPU need TRITON_INTERPRET=1")
    from kvtool.core import column_sums_triton

    return column_sums_triton


#: the interpreter has no bfloat16; on a GPU each dtype and tile shape is a compilation (float32 runs in the engine
#: tests there), so a GPU checks its own dtypes at the launch shapes it uses
KERNEL_DTYPES = [torch.float16, torch.bfloat16] if CUDA else [torch.float32, torch.float16]
#: (forward tiles, column-sum tiles): several partial tiles of the small shapes, and the launch shapes a GPU uses
TILES = ([] if CUDA else [(dict(BLOCK_M=16, BLOCK_N=16), dict(BLOCK_M=16, BLOCK_N=32))]) + [(None, None)]
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


@pytest.mark.parametrize("tiles", TILES, ids=["small tiles", "default tiles"][-len(TILES) :])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernels_equal_the_probability_matrix(kernels, shape, dtype, tiles):
    """Brute force over the same (rounded) inputs in float64: the sums within float32's reach in every dtype (the
    scores accumulate in float32), the output within the dtype's (the probabilities meet V in it)."""
    q, k, v, vis = make(shape, dtype, seed=1)
    d = q.shape[-1]
    for row0 in (0, q.shape[2] // 3):
        want_sums, want_out, want_lse = brute_force(q, k, v, d**-0.5, vis, row0)
        lse = torch.empty(q.shape[1], q.shape[2], device=DEVICE)
        out = kernels.forward(q, k, v, d**-0.5, vis, lse, tiles=tiles[0])
        sums = kernels.column_sums(
            q, k, lse, d**-0.5, vis, row0, torch.empty(k.shape[1], k.shape[2], device=DEVICE), tiles=tiles[1]
        )
        assert out.dtype == dtype and out.transpose(1, 2).is_contiguous()  # transformers' layout underneath
        torch.testing.assert_close(sums.double(), want_sums, atol=2e-6 if dtype == torch.float32 else 2e-5, rtol=1e-4)
        torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(out.double(), want_out, atol=atol, rtol=rtol)


def test_kernels_equal_the_torch_form_on_contiguous_and_strided_inputs(kernels):
    shape = (2, 3, 40, 60, 16, None)
    for strided in (True, False):
        q, k, v, vis = make(shape, torch.float32, seed=2, strided=strided)
        lse_t, lse_k = (torch.empty(q.shape[1], q.shape[2], device=DEVICE) for _ in range(2))
        sums_t, sums_k = (torch.empty(k.shape[1], k.shape[2], device=DEVICE) for _ in range(2))
        torch.testing.assert_close(
            kernels.forward(q, k, v, 0.25, vis, lse_k), forward(q, k, v, 0.25, vis, lse_t), atol=1e-5, rtol=1e-5
        )
        kernels.column_sums(q, k, lse_k, 0.25, vis, 3, sums_k)
        column_sums(q, k, lse_t, 0.25, vis, 3, sums_t)
        torch.testing.assert_close(sums_k, sums_t, atol=1e-6, rtol=1e-5)


# -- c. through the engine ----------------------------------------------------------------------------------------
@pytest.fixture(params=["torch", "triton"])
def form(request) -> str:
    """The two-pass form a cache is set to: the torch one, or the kernels (skipped without Triton)."""
    if request.param == "triton":
        request.getfixturevalue("kernels")
    return request.param


def _read(model, policy: str, ids, form: str | None, budget: int | None = 48, block: int = 32):
    """A read on ``DEVICE`` (kernels native on CUDA, interpreted on a CPU) with ``form``; logits on the CPU."""
    engine = make_engine(model.to(DEVICE), policy, budget, block_size=block)
    cache = engine.new_cache()
    cache.two_pass = form
    logits, _ = stream_logits(engine, ids.to(DEVICE), cache)
    return logits.cpu(), cache


def _spy_two_pass(monkeypatch) -> list[int]:
    """Counts the attention function's two-pass calls."""
    from kvtool.core import attention

    calls: list[int] = []
    real = attention._two_pass

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(attention, "_two_pass", spy)
    return calls


def _kept(cache):
    out = []
    for layer in cache.layers:
        for g in layer.groups:
            n = g.length
            out.append((g.positions[:, :n].clone(), g.state[:, :, :n].clone()))
    return out


@pytest.mark.parametrize(
    ("family", "policy"),
    [("qwen2", "h2o"), ("llama3", "snapkv(window=8)"), ("gemma3", "h2o"), ("qwen2", "h2o+vatp"), ("llama3", "h2o")],
)
def test_a_read_with_two_passes_equals_the_explicit_path(monkeypatch, family, policy, form):
    """The same logits, the same running sums and the same kept tokens in every layer (GQA; Gemma 3's global
    layer between sliding ones, which evict by distance and read no probabilities), every block wide enough
    for the two passes."""
    model = tiny_qwen2() if family == "qwen2" else tiny_family(family)
    ids = torch.randint(0, VOCAB, (160,), generator=torch.Generator().manual_seed(11))
    ref_logits, ref = _read(model, policy, ids, None)
    calls = _spy_two_pass(monkeypatch)
    logits, cache = _read(model, policy, ids, form)
    assert calls and cache.counters.evicted_tokens > 0 and ref.counters.evicted_tokens > 0
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    for (pos, state), (ref_pos, ref_state) in zip(_kept(cache), _kept(ref), strict=True):
        assert torch.equal(pos, ref_pos)
        torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=1e-5)


def test_two_passes_without_eviction_equal_transformers_dense_forward(form):
    model = tiny_family("llama3")
    ids = torch.randint(0, VOCAB, (96,), generator=torch.Generator().manual_seed(4))
    logits, cache = _read(model, "h2o", ids, form, budget=None)
    assert cache.counters.prob_rows == 96 * len(cache.layers)  # every row's statistic, through the two passes
    torch.testing.assert_close(logits, dense_logits(model.cpu(), ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama3", "gemma3"])
def test_two_passes_after_eviction_equal_the_masking_reference(monkeypatch, family, form):
    model = tiny_family(family)
    ids = torch.randint(0, VOCAB, (128,), generator=torch.Generator().manual_seed(5))
    seen = record_visibility(monkeypatch)
    logits, cache = _read(model, "h2o", ids, form, budget=40, block=16)
    monkeypatch.undo()
    assert cache.counters.evicted_tokens > 0
    torch.testing.assert_close(logits, masking_reference_logits(model.cpu(), ids, seen), atol=2e-5, rtol=1e-4)


def test_short_blocks_and_decoded_tokens_keep_the_explicit_path(monkeypatch):
    """Below ``MIN_ROWS`` rows (a decoded token, a short last block) the two passes are not worth their launches."""
    from kvtool.core import attention

    calls = []
    monkeypatch.setattr(attention, "_two_pass", lambda *a, **k: calls.append(1))
    model = tiny_qwen2()
    engine = make_engine(model, "h2o", 48, block_size=MIN_ROWS - 1)
    cache = engine.new_cache()
    cache.two_pass = "torch"
    stream_logits(engine, torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(6)), cache)
    assert calls == []


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", ["llama3", "qwen2", "gemma3"])
def test_cuda_two_passes_after_eviction_equal_the_masking_reference(monkeypatch, family, dtype):
    """A CUDA cache's default (the Triton kernels) in the model's dtype, against the float64 masking reference of
    the same weights, by tests/test_cuda.py's rule: within twice transformers' own error in that dtype, + 0.004."""
    model = tiny_qwen2() if family == "qwen2" else tiny_family(family)
    ids = torch.randint(0, VOCAB, (128,), generator=torch.Generator().manual_seed(7))
    seen = record_visibility(monkeypatch)
    calls = _spy_two_pass(monkeypatch)
    engine = make_engine(model.to("cuda", dtype), "h2o", 40, block_size=16)
    got, cache = stream_logits(engine, ids.cuda())
    assert cache.two_pass == "triton" and calls and cache.counters.evicted_tokens > 0
    noisy = dense_logits(model, ids.cuda())
    monkeypatch.undo()
    exact = model.to("cpu", torch.float64)
    err = float((got.float().cpu() - masking_reference_logits(exact, ids, seen).float()).abs().max())
    noise = float((noisy.float().cpu() - dense_logits(exact, ids).float()).abs().max())
    assert err <= 2.0 * noise + 0.004


def test_a_cpu_read_needs_no_triton():
    """Triton is a package torch's CUDA wheels ship, not a dependency: in a fresh interpreter where ``import
    triton`` fails, a CPU cache keeps the explicit path and a whole read never asks for Triton (``triton_available``
    is not called) nor loads the kernels' module. (Where Triton is installed torch itself imports it, so the
    check is on kvtool's own asks.)"""
    code = (
        "import sys\n"
        "sys.modules['triton'] = None\n"
        "import torch\n"
        "from kvtool.core import column_sums\n"
        "def refuse():\n"
        "    raise AssertionError('triton asked for on a CPU')\n"
        "column_sums.triton_available = refuse\n"
        "from tests.helpers import make_engine, stream_logits, tiny_qwen2\n"
        "engine = make_engine(tiny_qwen2(), 'h2o', 24, block_size=16)\n"
        "cache = engine.new_cache()\n"
        "assert cache.two_pass is None\n"
        "stream_logits(engine, torch.randint(0, 50, (80,)), cache)\n"
        "assert 'kvtool.core.column_sums_triton' not in sys.modules\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
