"""Quantized K/V inside the bounded cache (``--kv-dtype``, kvtool/core/quant.py) on tiny random models.

Oracles: every decoded element is within half a quantization step of the original in the rotated frame (brute force, per
element); attention over decoded K/V is within the analytic bound of full-precision attention over the
same tokens; with nothing evicted, logits are within a measured tolerance of dense transformers; every
policy and recall run on int8 and int4 caches, and scores see the K/V attention reads; a byte budget
holds 2·d/(d + 2) times the tokens of bfloat16 in int8 (the float16 scale per token); ``.kvc``
round trips and refusals; the CLI end to end.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvtool.config import KV_WINDOW_TOKENS
from kvtool.core import quant, recall
from kvtool.core.cache import BoundedLayer
from kvtool.core.engine import Engine, EngineConfig, model_env
from kvtool.core.quant import KVCodec, codec_for, hadamard
from kvtool.errors import UsageError
from kvtool.policies import build_policy
from tests.helpers import ALL_POLICIES, VOCAB, dense_logits, stream_logits, tiny_llama, tiny_qwen2

MODELS = {"llama": tiny_llama, "qwen2": tiny_qwen2}
INTS = ["int8", "int4"]


def kv_engine(
    model,
    policy: str,
    budget: int | None,
    kv_dtype: str,
    block_size: int = 16,
    positions: str = "absolute",
    recall_tokens: int = 0,
    retrieval=None,
) -> Engine:
    cfg = EngineConfig(
        budget=budget, block_size=block_size, positions=positions, kv_dtype=kv_dtype, recall=recall_tokens, page_size=8
    )
    env = model_env(model, cfg, retrieval_heads=retrieval)
    options = {"window": "8"} if policy.startswith("snapkv") else {}
    return Engine(model, build_policy(policy, options, env), cfg, env=env)


def ids_of(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


# -- the codec ------------------------------------------------------------------------------------
@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize("name", INTS)
def test_encoding_in_place_matches_the_formula_in_chunks_without_new_buffers(name, rotate):
    """``encode_into`` writes into strided views of a cache buffer what the formula gives (scale = absmax/qmax
    in float16, codes = round(y / scale) clamped, int4 nibbles low-first), ``chunk`` tokens at a time; a
    second write reuses the scratch's buffers."""
    codec = KVCodec(name, rotate=rotate)
    h, m, d, chunk = 3, 2 * 32 + 13, 16, 32
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(h, m, d, generator=gen) * torch.logspace(-3, 3, m).view(1, m, 1)
    y = hadamard(x) if rotate else x  # the oracle, written out
    ref_scale = (y.abs().amax(-1) / codec.qmax).clamp(2.0**-14, 65504.0).to(torch.float16)
    q = torch.round(y / ref_scale.float().unsqueeze(-1)).clamp(-codec.qmax, codec.qmax).to(torch.int64)
    ref = q if name == "int8" else (q[..., 0::2] + 8) | ((q[..., 1::2] + 8) << 4)
    data = torch.zeros(h, m + 7, codec.tail(d), dtype=codec.storage_dtype)  # a buffer with slots around
    scale = torch.zeros(h, m + 7, dtype=torch.float16)
    scratch = quant.Scratch(torch.float32, torch.device("cpu"))
    codec.encode_into(x, data[:, 5 : 5 + m], scale[:, 5 : 5 + m], scratch, chunk)
    assert torch.equal(scale[:, 5 : 5 + m], ref_scale)
    assert torch.equal(data[:, 5 : 5 + m].to(torch.int64), ref)
    assert not data[:, :5].any() and not data[:, 5 + m :].any()  # nothing written outside the view
    held = {k: b.data_ptr() for k, b in scratch.extra.items()}
    assert all(b.shape[0] <= h * chunk * d for b in scratch.extra.values())
    codec.encode_into(x, data[:, 5 : 5 + m], scale[:, 5 : 5 + m], scratch, chunk)
    assert {k: b.data_ptr() for k, b in scratch.extra.items()} == held
    assert torch.equal(codec.encode(x)[0], data[:, 5 : 5 + m])  # the allocating form is the same code


@pytest.mark.parametrize("name", INTS)
def test_every_element_comes_back_within_half_a_step(name):
    """In the rotated frame (x·H, where the codes are taken) every element is within half a step; H is
    orthonormal and its own inverse, so decode(encode(x))·H is that frame."""
    codec = KVCodec(name)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, 16, generator=gen) * torch.logspace(-6, 4, 40).view(1, 40, 1)  # tiny to huge rows
    x[0, 0] = 0.0  # an all-zero row
    x[1, 1, 3] = 500.0  # an outlier channel
    data, scale = codec.encode(x)
    assert data.dtype == codec.storage_dtype and data.shape[-1] == codec.tail(16) and scale.dtype == torch.float16
    got = codec.decode(data, scale, torch.empty_like(x))
    rx, rgot = hadamard(x.double()), hadamard(got.double())
    step = scale.double()
    for h in range(3):  # brute force, element by element
        for t in range(40):
            s = float(step[h, t])
            for j in range(16):
                assert abs(float(rgot[h, t, j]) - float(rx[h, t, j])) <= s / 2 * (1 + 1e-5) + 1e-30, (h, t, j)
                code = round(float(rgot[h, t, j]) / s)
                assert -codec.qmax <= code <= codec.qmax
                assert abs(float(rgot[h, t, j]) - code * s) <= 1e-5 * s * codec.qmax
    again, rescale = codec.encode(got)  # decoded values encode to the same codes: recall is lossless
    assert torch.equal(again, data) and torch.equal(rescale, scale)


def test_hadamard_is_orthonormal_and_its_own_inverse():
    for d in (16, 64, 80, 96):  # 80 and 96: blocks of 16 and 32
        x = torch.randn(2, 5, d, dtype=torch.float64)
        b = d & -d
        h = torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(b)] for i in range(b)], dtype=torch.float64)
        reference = (x.unflatten(-1, (d // b, b)) @ h / math.sqrt(b)).flatten(-2)  # Sylvester's matrix, by bits
        torch.testing.assert_close(hadamard(x), reference)
        torch.testing.assert_close(hadamard(hadamard(x)), x)


@pytest.mark.parametrize("name", INTS)
def test_rotation_lowers_the_error_of_keys_with_outlier_channels(name):
    """Keys whose few channels are 30× the others (as real models' keys are): the rotated codes err less."""
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(4, 256, 64, generator=gen)
    k[..., :2] *= 30.0

    def error(codec: KVCodec) -> float:
        data, scale = codec.encode(k)
        return float((codec.decode(data, scale, torch.empty_like(k)) - k).norm() / k.norm())

    assert error(KVCodec(name)) < 0.5 * error(KVCodec(name, rotate=False))


@pytest.mark.bf16
@pytest.mark.parametrize("name", INTS)
def test_a_16_bit_decode_is_the_exact_decode_within_bfloat16_rounding(name):
    """In bfloat16 the codes are scaled and rotated by one batched product: the result differs from the
    float64 decode by bfloat16's own rounding of the values (its 8-bit mantissa is as coarse as int8's
    step), at most 1.5 times what the unrotated codes' bfloat16 decode shows; the scratch's work buffer
    gives the same result as a fresh one."""
    from kvtool.core.quant import Scratch

    codec = KVCodec(name)
    x = torch.randn(3, 50, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    data, scale = codec.encode(x)
    exact = codec.decode(data, scale, torch.empty(x.shape, dtype=torch.float64))
    scratch = Scratch(torch.bfloat16, torch.device("cpu"))
    k, _ = scratch.views(3, 50, 64)
    got = codec.decode(data, scale, k, scratch.work(k.shape))
    step = scale.double().unsqueeze(-1)
    plain = KVCodec(name, rotate=False)
    p_data, p_scale = plain.encode(x)
    p_exact = plain.decode(p_data, p_scale, torch.empty(x.shape, dtype=torch.float64))
    p_err = (plain.decode(p_data, p_scale, torch.empty_like(x)).double() - p_exact) / p_scale.double().unsqueeze(-1)
    err = (got.double() - exact) / step  # measured (int8): RMS 0.12 step, max 0.66; unrotated 0.08, 0.46
    assert err.pow(2).mean().sqrt() <= 1.5 * p_err.pow(2).mean().sqrt() + 1e-3 and err.abs().max() < 1.0
    assert torch.equal(codec.decode(data, scale, torch.empty_like(x)), got)


def test_codec_choice_and_refusals():
    assert codec_for("auto", torch.float32, 64) is None
    assert codec_for("float32", torch.float32, 64) is None  # the compute dtype: stored as is
    assert codec_for("bfloat16", torch.float32, 64) == KVCodec("bfloat16")
    with pytest.raises(UsageError, match="odd"):
        codec_for("int4", torch.float32, 63)
    assert KVCodec("int8").bytes_per_token_head(64) == 66 and KVCodec("int4").bytes_per_token_head(64) == 34


# -- attention over decoded K/V -------------------------------------------------------------------
def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """Dense causal attention in float64 (the query block is the whole sequence), K/V repeated per query head."""
    rep, n = q.shape[1] // k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    s = (q.double() @ k.transpose(-1, -2)) * scaling
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return torch.softmax(s.masked_fill(~causal, float("-inf")), -1) @ v


@pytest.mark.parametrize("name", INTS)
def test_attention_error_is_within_the_quantization_bound(name, monkeypatch):
    """Each layer's output equals softmax(q K̂ᵀ) V̂ over the decoded K/V, and differs from full precision
    over the same tokens by at most (e^{2ε} − 1)·max|V| + max δv per element, where ε bounds the
    score error: scaling · Σ_d |q_d| · (key half-step) (softmax ratios move by at most e^{±2ε}).
    int4's 16-bit window is switched off here: this bounds the codes."""
    monkeypatch.setattr(quant, "KV_WINDOW_TOKENS", {})
    codec = KVCodec(name)
    seen, block_kv = _one_block_attention(monkeypatch, name, 64)
    for layer, q, out, scaling in seen:
        k, v = block_kv[layer]
        kq, ks = codec.encode(k)
        vq, vs = codec.encode(v)
        k_hat, v_hat = codec.decode(kq, ks, torch.empty_like(k)), codec.decode(vq, vs, torch.empty_like(v))
        rep = q.shape[1] // k.shape[1]
        torch.testing.assert_close(out.double(), causal_attention(q, k_hat, v_hat, scaling), atol=1e-5, rtol=1e-5)
        # the codes' frame is rotated: q·Δk = (q·H)·(Δk·H), and every element of Δk·H is within a half step
        dk = (ks.float() / 2).repeat_interleave(rep, 1)  # [1, H, n] key half-steps
        q_abs = hadamard(q.float()).abs().sum(-1, keepdim=True)
        eps = scaling * (q_abs * dk.unsqueeze(2)).amax(-1)  # [1, H, m]
        d = v.shape[-1]
        # a value element is a sum of d rotated errors ≤ half a step, each weighted by 1/√d
        bound = (torch.exp(2 * eps) - 1) * v.abs().amax() + vs.float().amax() / 2 * math.sqrt(d & -d)
        err = (out.double() - causal_attention(q, k, v, scaling)).abs().amax(-1)
        assert (err <= bound.double() + 1e-5).all()
        assert err.max() > 0  # the quantization did something


def _one_block_attention(monkeypatch, kv_dtype: str, n: int) -> tuple[list, dict]:
    """Feed ``n`` tokens to the tiny Llama as one block with nothing evicted; returns each layer's (layer,
    query, attention output, scaling) and the block's model K/V per layer."""
    from kvtool.core import attention

    seen, block_kv = [], {}
    real_attend, real_update = attention._attend_group, BoundedLayer.update

    def update(self, k, v, *a, **kw):
        block_kv[self.layer_idx] = (k.clone(), v.clone())
        return real_update(self, k, v, *a, **kw)

    def attend(layer, g, query, scaling, softcap=None):
        out = real_attend(layer, g, query, scaling, softcap)
        seen.append((layer.layer_idx, query.clone(), out.clone(), scaling))
        return out

    monkeypatch.setattr(BoundedLayer, "update", update)
    monkeypatch.setattr(attention, "_attend_group", attend)
    stream_logits(kv_engine(tiny_llama(), "full", None, kv_dtype, block_size=n), ids_of(n, 1))
    assert len(seen) == 2
    return seen, block_kv


def test_int4_attends_to_its_newest_tokens_in_16_bits(monkeypatch):
    """KIVI's full-precision residual: of 160 tokens, attention reads the oldest 32 from their int4 codes
    and the newest 128 (``KV_WINDOW_TOKENS``) from their bfloat16 copies (the model computes in float32)."""
    codec, w = KVCodec("int4"), KV_WINDOW_TOKENS["int4"]
    seen, block_kv = _one_block_attention(monkeypatch, "int4", 160)
    for layer, q, out, scaling in seen:
        k, v = block_kv[layer]
        k_hat, v_hat = (codec.decode(*codec.encode(x), torch.empty_like(x)) for x in (k, v))
        for x, x_hat in ((k, k_hat), (v, v_hat)):
            x_hat[..., -w:, :] = x[..., -w:, :].bfloat16().float()
        torch.testing.assert_close(out.double(), causal_attention(q, k_hat, v_hat, scaling), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("positions", ["absolute", "compact"])
def test_the_window_follows_eviction_and_re_packs(positions, monkeypatch):
    """Streaming 300 tokens through h2o at budget 40 in blocks of 16 (holes, compact re-packs, tokens
    leaving the window), each stored token reads its bfloat16 copy while among the 128 newest positions
    and its codes after: values exactly, keys within float rounding of the model's key turned to the
    position it holds."""
    codec, w = KVCodec("int4"), KV_WINDOW_TOKENS["int4"]
    model_kv: dict[int, list] = {}
    real_update = BoundedLayer.update

    def update(self, k, v, *a, **kw):
        model_kv.setdefault(self.layer_idx, []).append((k[0].clone(), v[0].clone()))
        return real_update(self, k, v, *a, **kw)

    monkeypatch.setattr(BoundedLayer, "update", update)
    engine = kv_engine(tiny_llama(), "h2o", 40, "int4", positions=positions)
    _, cache = stream_logits(engine, ids_of(300, 5))
    newest = 299
    for li, layer in enumerate(cache.layers):
        g = layer.groups[0]
        n, pos = g.length, g.positions[:, : g.length]
        keys = torch.cat([k for k, _ in model_kv[li]], 1)  # the model's keys at their first RoPE positions
        values = torch.cat([v for _, v in model_kv[li]], 1)
        v_model = values.gather(1, pos.unsqueeze(-1).expand(-1, -1, values.shape[-1]))
        k_model = keys.gather(1, pos.unsqueeze(-1).expand(-1, -1, keys.shape[-1]))
        fresh = (pos > newest - w).unsqueeze(-1)
        assert fresh.any() and not fresh.all()
        v_codes = codec.decode(*codec.encode(v_model), torch.empty_like(v_model))
        torch.testing.assert_close(
            g.stored_values(), torch.where(fresh, v_model.bfloat16().float(), v_codes), atol=0, rtol=0
        )
        if positions == "absolute":
            assert torch.equal(g.rotary[:, :n], pos)
            k_codes = codec.decode(*codec.encode(k_model), torch.empty_like(k_model))
            torch.testing.assert_close(
                g.stored_keys(), torch.where(fresh, k_model.bfloat16().float(), k_codes), atol=0, rtol=0
            )
        else:
            assert not torch.equal(g.rotary[:, :n], pos)  # re-packed: keys read at compact positions
            turned = g.rotator.rotate(k_model, g.rotary[:, :n] - pos)
            stored = g.stored_keys()
            torch.testing.assert_close(
                stored[fresh.expand_as(stored)], turned[fresh.expand_as(turned)], atol=2e-2, rtol=1e-2
            )


def test_a_saved_int4_cache_brings_its_window_back():
    """A snapshot (what ``.kvc`` and restore hold) of an int4 cache carries the 16-bit window: a fresh
    cache loaded from it continues with the same logits; without the window tensors it reads codes."""
    engine = kv_engine(tiny_llama(), "h2o", 40, "int4")
    doc, more = ids_of(150, 6), ids_of(20, 7)
    _, cache = stream_logits(engine, doc)
    tensors, scalars = cache.snapshot()
    assert any(k.endswith(".window_pos") for k in tensors)
    want, _ = stream_logits(engine, more, cache=cache)
    loaded = engine.new_cache()
    loaded.load(tensors, scalars)
    got, _ = stream_logits(engine, more, cache=loaded)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    bare = engine.new_cache()
    bare.load({k: t for k, t in tensors.items() if ".window_" not in k}, scalars)
    codes_only, _ = stream_logits(engine, more, cache=bare)
    assert not torch.equal(codes_only, want)


# measured max |Δlogit| against dense on these models (seed 1, 150 tokens): int8 ≈ 3e-3, int4 ≈ 4e-2,
# bfloat16 ≈ 1e-3, float16 ≈ 1e-4; the tolerances leave a factor of ~3
TOLERANCE = {"int8": 1e-2, "int4": 1.5e-1, "bfloat16": 5e-3, "float16": 1e-3}


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("kv_dtype", list(TOLERANCE))
@pytest.mark.parametrize("block_size", [1, 16])
def test_nothing_evicted_stays_within_a_measured_tolerance_of_dense(family, kv_dtype, block_size):
    model = MODELS[family]()
    ids = ids_of(150 if block_size > 1 else 40, 1)
    dense = dense_logits(model, ids)
    got, cache = stream_logits(kv_engine(model, "full", None, kv_dtype, block_size=block_size), ids)
    assert cache.kv_dtype == kv_dtype and cache.counters.evicted_tokens == 0
    err = (got - dense).abs().max().item()
    assert 0 < err <= TOLERANCE[kv_dtype], err


# -- policies and recall on coded caches ----------------------------------------------------------
@pytest.mark.parametrize("kv_dtype", INTS)
@pytest.mark.parametrize("policy", [p for p in ALL_POLICIES if p != "full"] + ["razor"])
@pytest.mark.parametrize("positions", ["absolute", "compact"])
def test_every_policy_runs_on_a_quantized_cache_and_scores_what_attention_reads(
    kv_dtype, policy, positions, monkeypatch
):
    model = tiny_llama()
    contexts = []
    real = BoundedLayer.context

    def spy(self, g, probs, evicting=True):
        ctx = real(self, g, probs, evicting)
        # the keys and values a policy scores are the decoded ones, and its per-token constants
        # (KeyDiff's key norm, VATP's ‖v‖₁) were computed from them
        assert ctx.keys.dtype == g.dtype and torch.equal(ctx.keys, g.stored_keys())
        consts = g.policy.constants(ctx.keys, ctx.values)
        for name, value in consts.items():
            torch.testing.assert_close(ctx.state[name], value.float(), atol=1e-5, rtol=1e-5)
        contexts.append(len(consts))
        return ctx

    monkeypatch.setattr(BoundedLayer, "context", spy)
    retrieval = (lambda **_: {0: [1], 1: [0]}) if policy == "razor" else None
    engine = kv_engine(model, policy, 40, kv_dtype, positions=positions, retrieval=retrieval)
    got, cache = stream_logits(engine, ids_of(150, 2))
    assert got.isfinite().all() and cache.counters.evicted_tokens > 0 and contexts
    for g in cache.groups():
        assert g.length <= g.capacity and g.buffers["keys"].dtype == KVCodec(kv_dtype).storage_dtype
    ids, _ = engine.generate(cache, got[-1], 20, set())  # lazy decode evicts once per block of tokens
    assert len(ids) == 20 and all(g.length <= g.capacity + 16 for g in cache.groups())


@pytest.mark.parametrize("kv_dtype", INTS)
@pytest.mark.parametrize("positions", ["absolute", "compact"])
def test_recall_on_a_quantized_cache_brings_back_what_attention_saw(kv_dtype, positions):
    """The archive receives decoded K/V; recalling every archived token gives the logits of the same
    coded cache with nothing evicted (re-encoding a decoded token is lossless), within float rounding."""
    model = tiny_llama()
    doc, question = ids_of(150, 3), ids_of(10, 4)
    full = kv_engine(model, "full", None, kv_dtype, block_size=160, positions=positions)
    ref, _ = stream_logits(full, torch.cat([doc, question]))
    engine = kv_engine(model, "keydiff", 40, kv_dtype, block_size=160, positions=positions, recall_tokens=256)
    cache = engine.new_cache()
    engine.feed(cache, [doc], progress=False)
    snap = cache.snapshot()
    assert recall.archived_tokens(cache) > 0 and recall.archive_dtype(cache) == "float32"
    logits, res = engine.feed_question(cache, question, lambda: cache.restore(snap))
    assert res is not None and res.tokens == 150 - 40
    # compact: the re-pack re-encodes rotated keys; int4: a token evicted from the 16-bit window was archived
    # at 16 bits, and its codes re-taken from those values when recalled can move by a step
    tol = 2e-4 if positions == "absolute" and kv_dtype == "int8" else 5e-2
    torch.testing.assert_close(logits[-1], ref[-1], atol=tol, rtol=tol)


def test_compact_repacks_do_not_drift(monkeypatch):
    """Keys re-packed many times stay within two quantizations of the model's keys: the re-pack
    rotates the quantized original, not the stored (already rounded) key."""
    model = tiny_llama()
    engine = kv_engine(model, "sink", 24, "int8", block_size=4, positions="compact")
    cache = engine.new_cache()
    engine.feed(cache, [ids_of(200, 6)], progress=False)
    g = cache.layers[0].groups[0]
    assert g.origin is not None and "origin_scale" in g.buffers
    sinks = g.stored_keys()[:, :4].clone()  # rotated at every re-pack
    origin = g.origin_keys(4)
    want = g.rotator.rotate(origin, g.rotary[:, :4] - g.positions[:, :4])
    step = g.buffers.items["key_scale"].tokens(0, 4).float().unsqueeze(-1)
    assert (hadamard(sinks - want).abs() <= step / 2 + 1e-6).all()  # in the codes' (rotated) frame


# -- budget -----------------------------------------------------------------------------------------
def test_byte_budget_holds_twice_the_tokens_of_bfloat16_in_int8():
    from kvtool.core.costs import CacheCosts

    dims = (30, 3, 64)  # SmolLM2-135M: layers, KV heads, head dim
    nbytes = 64 * 2**20

    def tokens(kv: str, compute: int = 4) -> int:
        return CacheCosts(*dims, compute, kv).budget_tokens(nbytes)

    bf16, fp32, int8, int4 = tokens("bfloat16"), tokens("float32"), tokens("int8"), tokens("int4")
    per_scale = 64 / 66  # the float16 scale per token and head
    assert bf16 == 2 * fp32 or bf16 == 2 * fp32 + 1
    assert abs(int8 - 2 * bf16 * per_scale) <= 2 and abs(int8 - 4 * fp32 * per_scale) <= 4
    # int4 keeps the newest 128 tokens of every layer and KV head in 16 bits inside the byte budget, then 32 bytes
    # of codes and a float16 scale per token, head, K and V
    layers, heads, d = dims
    assert int4 == (nbytes - layers * heads * 2 * 128 * d * 2) // (layers * heads * 2 * (d // 2 + 2))
    assert 3.5 < int4 / bf16 < 4 * 64 / 68
    assert int8 / bf16 > 1.93 and tokens("auto", 2) == bf16


def test_allocated_bytes_count_codes_scales_and_the_scratch():
    model = tiny_llama()
    plain = kv_engine(model, "sink", 40, "auto").new_cache()
    coded = kv_engine(model, "sink", 40, "int8").new_cache()
    g0, g1 = plain.groups()[0], coded.groups()[0]
    assert g1.bytes_per_token_head() == 16 + 2 and g0.bytes_per_token_head() == 16 * 4
    assert g1.allocated_bytes() == g1.slots * g1.num_heads * 2 * 18
    assert coded.kv_bytes_per_token() == 2 * 2 * 2 * 18  # layers · heads · K+V · bytes
    assert coded.promised_bytes() == 2 * 2 * 2 * 18 * 40
    assert math.isclose(coded.kv_scratch.nbytes(), 0)  # nothing read yet: no scratch


@pytest.mark.parametrize("budget", [64, 160])  # int4's 128-token window: more than a read holds, or less
@pytest.mark.parametrize("kv", ["bfloat16", "int8", "int4"])
def test_the_plan_counts_the_scratch_a_read_uses(kv, budget):
    """The profile's ``decode_scratch_bytes`` is exactly the scratch a read grows: one layer's K and V
    decoded at capacity plus a block, the work buffer of rotated codes, int4's nibbles and window reads,
    and the encoder's float32 work for one block."""
    from kvtool.runtime.memory import decode_scratch_bytes

    model = tiny_llama()
    block = 32
    engine = kv_engine(model, "h2o", budget, kv, block_size=block)
    _, cache = stream_logits(engine, ids_of(budget + 3 * block + 9, 0))
    dims = {
        "num_kv_heads": model.config.num_key_value_heads,
        "head_dim": model.config.hidden_size // model.config.num_attention_heads,
    }
    assert cache.kv_scratch.nbytes() == decode_scratch_bytes(dims, torch.float32, budget, block, kv)


# -- CLI, stats and .kvc ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qenv(tmp_path_factory):
    import random

    from tests.test_store import WORDS, _checkpoint

    root = tmp_path_factory.mktemp("kvquant")
    doc = root / "doc.txt"
    rng = random.Random(3)
    doc.write_text(" ".join(rng.choice(WORDS[20:]) for _ in range(300)) + "\n", encoding="utf-8")
    return {"root": root, "model": str(_checkpoint(root / "tiny")), "doc": doc}


SETTINGS = ["--policy", "h2o", "--block-size", "16", "--device", "cpu", "--max-new-tokens", "6"]


def run_cli(capsys, *args):
    from kvtool.cli.app import main

    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_ask_with_int8_holds_more_tokens_in_the_same_bytes(qenv, capsys):
    """The tiny model (2 layers, 2 KV heads, head dim 8, float32): K+V of a token is 256 bytes in float32,
    128 in bfloat16 storage, 80 in int8 (8 codes + a 2-byte scale, per head, K and V), 48 in int4, whose
    128-token bfloat16 window takes 2 · 2 · (2 · 128 · 8 · 2) = 16,384 bytes off the budget first."""
    import json

    budget = 20480
    stats = {}
    for kv in ("auto", "bfloat16", "int8", "int4"):
        rc, out, err = run_cli(
            capsys,
            "ask",
            qenv["doc"],
            "what is it",
            "--model",
            qenv["model"],
            *SETTINGS,
            "--budget",
            f"{budget}B",
            "--kv-dtype",
            kv,
            "--json",
            "-q",
        )
        assert rc == 0, err
        stats[kv] = json.loads(out)["stats"]
    per_token = {kv: s["kv_bytes_per_token"] for kv, s in stats.items()}
    assert per_token == {"auto": 256, "bfloat16": 128, "int8": 80, "int4": 48}
    assert {kv: s["kv_dtype"] for kv, s in stats.items()} == {
        "auto": "float32",
        "bfloat16": "bfloat16",
        "int8": "int8",
        "int4": "int4",
    }
    window = {"int4": 16384}
    for kv, s in stats.items():  # recall (on by default) holds half of the tokens the bytes buy, inside them
        whole = (budget - window.get(kv, 0)) // per_token[kv]
        assert s["recall_tokens"] == whole // 2 and s["budget"] == whole - whole // 2
        assert s["kv_budget_bytes"] + s["recall_kv_bytes"] <= budget
        assert "bytes of K+V per token in" in s["budget_conversion"]
    assert stats["int8"]["budget"] == 128 and stats["bfloat16"]["budget"] == 80


def test_profile_plans_the_quantized_cache(qenv, capsys):
    import json

    args = ["profile", "--model", qenv["model"], *SETTINGS[:6], "--budget", "64", "--json", "-q"]
    plans = {}
    for kv in ("auto", "int8", "int4"):
        rc, out, err = run_cli(capsys, *args, "--kv-dtype", kv, "--recall", "off")
        assert rc == 0, err
        plans[kv] = json.loads(out)
    auto, int8 = plans["auto"], plans["int8"]
    assert auto["kv_dtype"] == "float32" and int8["kv_dtype"] == "int8"
    assert int8["kv_bytes_per_token"]["total"] == 80 and auto["kv_bytes_per_token"]["total"] == 256
    assert int8["kv_bytes_at_budget"]["promised"] == 64 * 80
    # int4's 128-token window in bfloat16: 2 · 128 · 8 · 2 bytes of K+V per layer and KV head, on top
    assert plans["int4"]["kv_bytes_at_budget"]["promised"] == 64 * 48 + 2 * 2 * (2 * 128 * 8 * 2)
    assert auto["kv_decode_scratch_bytes"] == 0
    # one layer's K, V and the work buffer; the encoder's two float32 K (or V) and scale, one block
    encode = 2 * 16 * (2 * 8 * 4 + 4)
    assert int8["kv_decode_scratch_bytes"] == 3 * (64 + 16) * 2 * 8 * 4 + encode
    # int4: the nibbles split, its window reads over the 80 tokens a read holds (one K or V in bfloat16,
    # two int64 indices and a flag per row), and the encoder's unpacked codes and high nibbles
    assert plans["int4"]["kv_decode_scratch_bytes"] == (
        3 * (64 + 16) * 2 * 8 * 4 + (64 + 16) * 2 * 8 + 2 * 80 * (8 * 2 + 17) + encode + 2 * 16 * (8 + 4)
    )
    # recall (on by default: 256 slots) grows every slot-sized buffer, and int4's window is matched over the
    # recalled tokens too (a relevance placement puts them after the kept ones)
    recalled = {}
    for kv in ("int8", "int4"):
        rc, out, err = run_cli(capsys, *args, "--kv-dtype", kv)
        assert rc == 0, err
        recalled[kv] = json.loads(out)["kv_decode_scratch_bytes"]
    slots = 64 + 16 + 256
    assert recalled["int8"] == 3 * slots * 2 * 8 * 4 + encode
    assert recalled["int4"] == (
        3 * slots * 2 * 8 * 4 + slots * 2 * 8 + 2 * slots * (8 * 2 + 17) + encode + 2 * 16 * (8 + 4)
    )


def test_kvc_round_trip_of_a_quantized_cache(qenv, tmp_path, capsys):
    import json

    out = tmp_path / "q.kvc"
    read = ["--model", qenv["model"], *SETTINGS[:-2], "--budget", "40"]
    base = [*read, *SETTINGS[-2:]]
    rc, _, err = run_cli(capsys, "prefill", qenv["doc"], "-o", out, *read, "--kv-dtype", "int8", "-q")
    assert rc == 0, err
    plain = tmp_path / "p.kvc"
    rc, _, err = run_cli(capsys, "prefill", qenv["doc"], "-o", plain, *read, "-q")
    assert rc == 0, err
    rc, info, _ = run_cli(capsys, "inspect", out, "--json")
    desc = json.loads(info)
    meta = desc["metadata"]
    assert meta["format_version"] == 3 and meta["required_features"] == ["kv_dtype"]
    assert meta["settings"]["kv_dtype"] == "int8"
    rc, pinfo, _ = run_cli(capsys, "inspect", plain, "--json")
    pdesc = json.loads(pinfo)
    assert pdesc["metadata"]["format_version"] == 3 and "required_features" not in pdesc["metadata"]
    assert desc["kv_bytes"] == 2 * 2 * 40 * 2 * (8 + 2) and pdesc["kv_bytes"] == 2 * 2 * 40 * 2 * 8 * 4
    assert out.stat().st_size < plain.stat().st_size

    q = ["what is the castle", "where is the ship"]
    rc, from_doc, err = run_cli(capsys, "ask", qenv["doc"], *q, *base, "--kv-dtype", "int8", "--json", "-q")
    assert rc == 0, err
    rc, from_kvc, err = run_cli(
        capsys, "ask", out, *q, "--model", qenv["model"], "--max-new-tokens", "6", "--json", "-q"
    )
    assert rc == 0, err
    assert json.loads(from_doc)["answers"] == json.loads(from_kvc)["answers"]
    assert json.loads(from_kvc)["stats"]["kv_dtype"] == "int8"
    rc, _, err = run_cli(capsys, "ask", out, "q", "--model", qenv["model"], "--kv-dtype", "int4", "-q")
    assert rc == 2 and "prefilled with --kv-dtype int8" in err and len(err.strip().splitlines()) == 1


def test_an_int4_kvc_answers_as_the_document_does(qenv, tmp_path, capsys):
    """The window travels in the file: asking the ``.kvc`` gives the answers of asking the document."""
    import json

    out = tmp_path / "q4.kvc"
    read = ["--model", qenv["model"], *SETTINGS[:-2], "--budget", "40", "--kv-dtype", "int4"]
    rc, _, err = run_cli(capsys, "prefill", qenv["doc"], "-o", out, *read, "-q")
    assert rc == 0, err
    from safetensors import safe_open

    with safe_open(str(out), framework="pt") as f:
        assert {"l0.g0.window_keys", "l0.g0.window_values", "l0.g0.window_pos"} <= set(f.keys())
    q = ["what is the castle", "where is the ship"]
    rc, from_doc, err = run_cli(capsys, "ask", qenv["doc"], *q, *read, *SETTINGS[-2:], "--json", "-q")
    assert rc == 0, err
    rc, from_kvc, err = run_cli(
        capsys, "ask", out, *q, "--model", qenv["model"], "--max-new-tokens", "6", "--json", "-q"
    )
    assert rc == 0, err
    assert json.loads(from_doc)["answers"] == json.loads(from_kvc)["answers"]


def test_kvc_with_an_unknown_feature_or_a_newer_format_is_refused_in_one_line(qenv, tmp_path, capsys, monkeypatch):
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from kvtool.kvc import format as kvc_format

    src = tmp_path / "q.kvc"
    rc, _, err = run_cli(
        capsys,
        "prefill",
        qenv["doc"],
        "-o",
        src,
        "--model",
        qenv["model"],
        *SETTINGS[:-2],
        "--budget",
        "40",
        "--kv-dtype",
        "int4",
        "-q",
    )
    assert rc == 0, err
    with safe_open(str(src), "pt") as f:
        md = dict(f.metadata())
    meta = json.loads(md["kvtool"])
    meta["required_features"] = ["kv_dtype", "kv_magic"]
    bad = tmp_path / "magic.kvc"
    save_file(load_file(str(src)), str(bad), metadata={**md, "kvtool": json.dumps(meta)})
    for path, needle in ((bad, "needs kv_magic"), (src, "kvc format 3")):
        if path == src:  # a kvtool that reads formats 1-2 only (what a release before plain-text documents does)
            monkeypatch.setattr(kvc_format, "READ_FORMAT_VERSION", 2)
            monkeypatch.setattr(kvc_format, "MIN_FORMAT_VERSION", 1)
        for args in (["ask", path, "q", "--model", qenv["model"], "-q"], ["inspect", path]):
            rc, _, err = run_cli(capsys, *args)
            lines = [ln for ln in err.splitlines() if ln.strip()]
            assert rc == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "phi3", "qwen3"])
def test_every_family_reads_with_an_int8_cache(family):
    """Sliding-window layers, softcapping and per-layer RoPE read coded K/V like the others."""
    from tests.helpers import FAMILY_WINDOW, tiny_family

    model = tiny_family(family)
    ids = ids_of(2 * FAMILY_WINDOW + 30, 5)
    dense = dense_logits(model, ids)
    got, _ = stream_logits(kv_engine(model, "full", None, "int8", block_size=8), ids)
    assert (got - dense).abs().max() <= 5e-2
    got, cache = stream_logits(kv_engine(model, "h2o", 40, "int8", block_size=8, positions="compact"), ids)
    assert got.isfinite().all() and cache.counters.evicted_tokens > 0


def test_kv_dtype_is_a_validated_setting_and_profile_key(tmp_path):
    from kvtool.runtime.settings import PROFILE_KEYS, resolve_settings

    assert "kv_dtype" in PROFILE_KEYS
    prof = tmp_path / "q.yaml"
    prof.write_text("kv_dtype: int4\nbudget: 64MiB\n", encoding="utf-8")
    assert resolve_settings(prof).kv_dtype == "int4"
    assert resolve_settings(prof, {"kv_dtype": "int8"}).kv_dtype == "int8"
    assert resolve_settings(None).kv_dtype == "auto"
    for bad in ("int2", "fp8", 8):
        with pytest.raises(UsageError, match="^--kv-dtype must be one of"):  # the flag the user typed
            resolve_settings(None, {"kv_dtype": bad})
    prof.write_text("kv_dtype: int2\n", encoding="utf-8")
    with pytest.raises(UsageError, match="kv_dtype must be one of"):  # a profile's value: its key
        resolve_settings(prof)


def test_eval_grids_take_kv_dtype(qenv, capsys):
    import json

    base = [
        "eval",
        "ppl",
        "--text",
        qenv["doc"],
        "--model",
        qenv["model"],
        "--context",
        "64",
        "--continuation",
        "6",
        "--samples",
        "1",
        "--policies",
        "full",
        "--block-size",
        "32",
        "--device",
        "cpu",
        "--json",
        "-q",
    ]
    reports = {}
    for kv in ("auto", "int8"):
        rc, out, err = run_cli(capsys, *base, "--kv-dtype", kv)
        assert rc == 0, err
        reports[kv] = json.loads(out)
    assert "kv_dtype" not in reports["auto"]["settings"] and reports["int8"]["settings"]["kv_dtype"] == "int8"
    exact, coded = reports["auto"]["results"][0], reports["int8"]["results"][0]
    assert exact["kl"] == pytest.approx(0.0, abs=1e-5) and 0 < coded["kl"] < 1e-2


def test_agreement_compares_a_quantized_cache_with_the_unquantized_reference(qenv, capsys, tmp_path):
    """``eval agreement --kv-dtype int4`` quantizes the runs' caches, not the dense reference: with nothing
    evicted, a run differs from ``full`` by its quantization alone (KL > 0), and the reference is the one
    an unquantized grid gets."""
    import json

    qfile = tmp_path / "q.txt"
    qfile.write_text("What is it about?\n", encoding="utf-8")
    base = [
        "eval",
        "agreement",
        "--doc",
        qenv["doc"],
        "--questions-file",
        qfile,
        "--model",
        qenv["model"],
        "--policies",
        "sink",
        "--budgets",
        "2k",
        "--max-new-tokens",
        "4",
        "--first-tokens",
        "3",
        "--block-size",
        "32",
        "--device",
        "cpu",
        "--json",
        "-q",
    ]
    reports, kl = {}, {}
    for kv in ("auto", "int4"):
        log = tmp_path / f"{kv}.jsonl"  # its records keep the KL unrounded
        rc, out, err = run_cli(capsys, *base, "--kv-dtype", kv, "--resume", log)
        assert rc == 0, err
        reports[kv] = json.loads(out)
        records = [json.loads(line) for line in log.read_text().splitlines()]
        kl[kv] = next(r["record"]["kl"] for r in records if r["key"] == "sink@2048|0")
    assert reports["auto"]["reference"] == reports["int4"]["reference"]
    # measured: 4.6e-9 (float rounding: budget-bounded vs dense attention) against 4.3e-7; 0 before the
    # reference ignored --kv-dtype (full was then quantized like the run)
    assert kl["int4"] > 20 * max(kl["auto"], 1e-12)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_original_keys_of_blocks_read_after_a_renormalisation_are_at_their_original_position(kv_dtype):
    """``origin`` holds each key at its stream position: a block appended while compact positions differ
    from stream positions (after a renormalisation or the switch of ``auto``) is rotated back before it is
    stored there, or every later re-pack would put its keys at the wrong distance (16-bit caches too)."""
    model = tiny_llama(max_positions=64).to(torch.bfloat16)
    engine = kv_engine(model, "h2o", 24, kv_dtype, block_size=4, positions="compact")
    cache = engine.new_cache()
    engine.feed(cache, [ids_of(203, 0)], progress=False)
    g = cache.layers[0].groups[0]
    n = g.length
    with torch.inference_mode():
        delta = g.rotary[:, :n] - g.positions[:, :n]
        assert (delta != 0).all() and delta.unique().numel() > 1  # renormalised, tokens from both frames
        stored, origin = g.stored_keys().float().clone(), g.origin_keys(n).float()
        want = g.rotator.rotate(origin, delta)
    assert (stored - want).abs().max() < 2e-2  # two roundings (bfloat16 or int8), not a wrong rotation
