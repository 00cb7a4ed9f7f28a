"""RazorAttention: retrieval-head calibration (echo / induction probe) and the razor budget split."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvtool.policies.razor.calibrate as cal
from kvtool.errors import KvtoolError, UsageError
from kvtool.policies import PolicyEnv, build_policy
from kvtool.policies.razor.policy import Razor
from kvtool.policies.sink import Sink

V, D, HD = 32, 64, 64  # vocab, hidden, head dim of the forced model
ECHO_HEAD, INDUCTION_HEAD = 1, 2  # query heads of layer 1 (KV heads 0 and 1)


def _forced_model() -> LlamaForCausalLM:
    """A 2-layer Llama whose layer-1 query head 1 is an echo head and query head 2 an induction head.

    Token embeddings are one-hot (dims 0..V-1). Layer 0, query head 0 is a previous-token head:
    its q/k come from biases on the fast RoPE pairs, shaped so ``q_i·k_j ∝ Σ cos(ω(i−j−1))`` peaks
    at ``j = i − 1``; its values copy the token and ``o_proj`` writes it to dims V..2V-1, so after
    layer 0 the residual holds (current token, previous token). In layer 1 queries read the current
    token and keys read the current token (KV head 0 → echo) or the previous token (KV head 1 →
    induction), both placed on RoPE pairs that barely rotate (rope_theta 1e8) so position does not
    disturb the match.
    """
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=D,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HD,
        vocab_size=V,
        max_position_embeddings=512,
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e8},
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg).eval()
    half = HD // 2
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.zero_()
        emb[:, :V] = torch.eye(V)
        a0, a1 = model.model.layers[0].self_attn, model.model.layers[1].self_attn
        model.model.layers[0].mlp.down_proj.weight.zero_()
        for p in (a0.q_proj, a0.k_proj, a0.v_proj, a0.o_proj):
            p.weight.zero_()
            p.bias.zero_()
        r = math.sqrt(175.0)
        for k in range(6):  # fast pairs: ω = 1e8^(-2k/64)
            w = 1e8 ** (-2 * k / HD)
            a0.k_proj.bias[k] = r
            a0.q_proj.bias[k] = r * math.cos(w)
            a0.q_proj.bias[k + half] = -r * math.sin(w)
        a0.v_proj.weight[:V, :V] = torch.eye(V) / 8  # RMSNorm turns e_t into 8·e_t
        a0.o_proj.weight[V : 2 * V, :V] = torch.eye(V)
        for p in (a1.q_proj, a1.k_proj):
            p.weight.zero_()
            p.bias.zero_()
        slow = [d for d in range(HD) if d % half >= 10][:V]  # pairs rotating ≤ 0.003 rad per token
        s = 3.0
        for t in range(V):
            a1.q_proj.weight[ECHO_HEAD * HD + slow[t], t] = s
            a1.q_proj.weight[INDUCTION_HEAD * HD + slow[t], t] = s
            a1.k_proj.weight[0 * HD + slow[t], t] = s
            a1.k_proj.weight[1 * HD + slow[t], V + t] = s
    return model


def _random_model(scale: float = 3.0, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(1)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=512,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)  # less uniform attention, so the comparison means something
    return model


# --------------------------------------------------------------------------------------------------
# head_scores on a real forward pass
# --------------------------------------------------------------------------------------------------
def test_forced_echo_and_induction_heads_are_found():
    model = _forced_model()
    calls = []
    s = cal.head_scores(model, K=8, progress=lambda d, t: calls.append((d, t)))
    assert s["K"] == 8 and s["bos"] and s["tokens"] == 1 + 4 * 8
    assert calls[0] == (0, 2) and calls[-1] == (2, 2)
    echo, ind = torch.tensor(s["echo"]), torch.tensor(s["induction"])
    assert echo.shape == ind.shape == (2, 4)
    # distinct tokens: in repeat r the echo head splits its attention over r copies (itself included),
    # the induction head over the r−1 tokens that followed the earlier copies.
    assert echo[1, ECHO_HEAD].item() == pytest.approx((1 / 2 + 1 / 3 + 1 / 4) / 3, abs=1e-3)
    assert ind[1, INDUCTION_HEAD].item() == pytest.approx((1 + 1 / 2 + 1 / 3) / 3, abs=1e-3)
    assert int(echo.flatten().argmax()) == 1 * 4 + ECHO_HEAD
    assert int(ind.flatten().argmax()) == 1 * 4 + INDUCTION_HEAD
    assert ind[1, ECHO_HEAD] < 0.01 and echo[1, INDUCTION_HEAD] < 0.01
    # the attention implementation is restored
    assert model.config._attn_implementation == "sdpa"

    sel = cal.select_retrieval_heads(s, induction_frac=1 / 8, echo_frac=1 / 8)
    assert sel["query_heads"] == {0: [], 1: [ECHO_HEAD, INDUCTION_HEAD]}
    assert sel["kv_heads"] == {0: [], 1: [ECHO_HEAD // 2, INDUCTION_HEAD // 2]}
    sel = cal.select_retrieval_heads(s, induction_frac=0.0, echo_frac=0.01)  # 1 % of 8 → at least 1
    assert sel["query_heads"][1] == [ECHO_HEAD] and sel["kv_heads"] == {0: [], 1: [0]}


def test_on_the_fly_scores_match_eager_attention(monkeypatch):
    model = _random_model()
    monkeypatch.setattr(cal, "_CHUNK_ELEMENTS", 4 * 45 * 3)  # ~3 query rows per chunk: exercise chunking
    s = cal.head_scores(model, K=11, repeats=4, seed=5)
    ids, offset = cal.probe_tokens(model, 11, 4, 5)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(ids, output_attentions=True)
    model.set_attn_implementation("sdpa")
    for layer, attn in enumerate(out.attentions):
        echo, ind = cal.scores_from_attention(attn[0], 11, 4, offset)
        torch.testing.assert_close(echo, torch.tensor(s["echo"][layer]), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(ind, torch.tensor(s["induction"][layer]), atol=1e-5, rtol=1e-4)
    assert max(max(r) for r in s["echo"]) > 0.01  # not trivially zero


def test_sliding_window_mask_is_respected():
    """Mistral with a window shorter than the probe: sdpa hands the scorer a boolean mask."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=512,
        sliding_window=10,
    )
    model = MistralForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    s = cal.head_scores(model, K=6)
    ids, offset = cal.probe_tokens(model, 6)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(ids, output_attentions=True)
    for layer, attn in enumerate(out.attentions):
        echo, ind = cal.scores_from_attention(attn[0], 6, 4, offset)
        torch.testing.assert_close(echo, torch.tensor(s["echo"][layer]), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(ind, torch.tensor(s["induction"][layer]), atol=1e-5, rtol=1e-4)


def test_eager_model_keeps_eager_and_same_scores():
    model = _random_model()
    ref = cal.head_scores(model, K=6)
    model.set_attn_implementation("eager")
    got = cal.head_scores(model, K=6)
    assert model.config._attn_implementation == "eager"
    torch.testing.assert_close(torch.tensor(got["echo"]), torch.tensor(ref["echo"]), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(got["induction"]), torch.tensor(ref["induction"]), atol=1e-5, rtol=1e-4)


def test_scores_from_attention_synthetic():
    K, R, H = 3, 3, 2
    T = K * R
    attn = torch.zeros(H, T, T)
    for i in range(T):
        attn[:, i, 0] = 1.0  # default: everything on the first token
    for i in range(K, T):
        attn[0, i] = 0
        attn[0, i, i - K] = 1.0  # head 0: echo
        attn[1, i] = 0
        attn[1, i, i - K + 1] = 0.5  # head 1: half induction, half self
        attn[1, i, i] += 0.5
    echo, ind = cal.scores_from_attention(attn, K, R)
    assert echo.tolist() == [1.0, 0.0] and ind.tolist() == [0.0, 0.5]


def test_probe_tokens_and_default_k():
    model = _random_model()
    ids, offset = cal.probe_tokens(model, 20, 4, seed=3)
    assert offset == 1 and ids[0, 0].item() == model.config.bos_token_id
    body = ids[0, 1:].view(4, 20)
    assert (body == body[0]).all() and len(set(body[0].tolist())) == 20
    assert not {model.config.bos_token_id, model.config.eos_token_id} & set(body[0].tolist())
    again, _ = cal.probe_tokens(model, 20, 4, seed=3)
    assert torch.equal(ids, again)
    assert cal.default_k(model) == min(2500, 512 // 4 - 1, cal.CPU_MAX_TOKENS // 4)
    assert cal.default_k(model, max_tokens=100) == 25
    with pytest.raises(UsageError):
        cal.head_scores(model, K=200)  # 801 tokens > 512 positions


# --------------------------------------------------------------------------------------------------
# selection
# --------------------------------------------------------------------------------------------------
def test_select_retrieval_heads_fractions_union_gqa():
    # 2 layers × 8 query heads = 16 heads; 4 KV heads (2 query heads each)
    ind = [[0.0] * 8 for _ in range(2)]
    echo = [[0.0] * 8 for _ in range(2)]
    ind[0][3], ind[1][0], ind[1][7] = 0.9, 0.8, 0.7
    echo[1][0], echo[0][5] = 0.95, 0.9
    scores = {"echo": echo, "induction": ind}
    sel = cal.select_retrieval_heads(scores, induction_frac=0.14, echo_frac=0.01, num_kv_heads=4, num_attention_heads=8)
    # round(0.14 × 16) = 2 induction heads, 1 % of 16 rounds to 0 → at least 1 echo head
    assert sel["induction_selected"] == [[0, 3], [1, 0]]
    assert sel["echo_selected"] == [[1, 0]]
    assert sel["query_heads"] == {0: [3], 1: [0]}
    assert sel["kv_heads"] == {0: [1], 1: [0]}
    sel = cal.select_retrieval_heads(
        scores, induction_frac=3 / 16, echo_frac=2 / 16, num_kv_heads=4, num_attention_heads=8
    )
    assert sel["query_heads"] == {0: [3, 5], 1: [0, 7]}
    assert sel["kv_heads"] == {0: [1, 2], 1: [0, 3]}
    # MQA: any selected head makes the single KV head retrieval
    sel = cal.select_retrieval_heads(scores, 0.1, 0.0, num_kv_heads=1, num_attention_heads=8)
    assert sel["kv_heads"] == {0: [0], 1: [0]}
    assert cal.head_count(0.0, 100) == 0 and cal.head_count(0.005, 100) == 1 and cal.head_count(0.125, 100) == 13
    with pytest.raises(UsageError):
        cal.select_retrieval_heads(scores, induction_frac=1.5)


# --------------------------------------------------------------------------------------------------
# persistence
# --------------------------------------------------------------------------------------------------
def test_save_load_roundtrip_and_corrupt(tmp_path):
    path = cal.calibration_path("abcdef0123456789ffff", tmp_path)
    assert path == tmp_path / "calibration" / "abcdef0123456789.json"
    assert cal.load_calibration(path) is None
    scores = {"echo": [[0.1, 0.2]], "induction": [[0.3, 0.4]], "num_attention_heads": 2, "num_kv_heads": 1}
    data = {
        "format": cal.FORMAT,
        "version": 1,
        "model": "m",
        "identity": "abcdef0123456789ffff",
        "K": 4,
        "repeats": 4,
        "seed": 0,
        **scores,
        **cal.select_retrieval_heads(scores, 0.5, 0.0),
    }
    cal.save_calibration(path, data)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left behind
    back = cal.load_calibration(path)
    assert back["kv_heads"] == {0: [0]} and back["query_heads"] == {0: [1]}
    assert back["echo"] == [[0.1, 0.2]] and back["K"] == 4
    for bad in ("{not json", json.dumps({"format": "other"}), json.dumps({**data, "kv_heads": [1]}), "[]"):
        path.write_text(bad)
        with pytest.raises(KvtoolError) as exc:
            cal.load_calibration(path)
        assert "corrupt" in str(exc.value) and "\n" not in str(exc.value)


def test_calibrate_reuses_saved_result(tmp_path, monkeypatch):
    model = _random_model()
    calls = []
    real = cal.head_scores

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cal, "head_scores", counting)
    ident = "0123456789abcdef" * 4
    first = cal.calibrate(model, ident, "tiny", tmp_path, K=6, induction_frac=0.25, echo_frac=0.125)
    assert len(calls) == 1 and first["K"] == 6 and first["model"] == "tiny"
    saved = json.loads(cal.calibration_path(ident, tmp_path).read_text())
    assert saved["identity"] == ident and len(saved["echo"]) == 2 and len(saved["induction"][0]) == 4
    again = cal.calibrate(model, ident, "tiny", tmp_path, K=6, induction_frac=0.25, echo_frac=0.125)
    assert len(calls) == 1 and again["kv_heads"] == first["kv_heads"]
    # other fractions: re-selected from the saved scores, no forward pass
    more = cal.calibrate(model, ident, "tiny", tmp_path, K=6, induction_frac=1.0, echo_frac=0.0)
    assert len(calls) == 1 and more["kv_heads"] == {0: [0, 1], 1: [0, 1]}
    assert cal.load_calibration(cal.calibration_path(ident, tmp_path))["induction_frac"] == 1.0
    # a different K, or force, recomputes
    cal.calibrate(model, ident, "tiny", tmp_path, K=5)
    assert len(calls) == 2
    cal.calibrate(model, ident, "tiny", tmp_path, K=5, force=True)
    assert len(calls) == 3


# --------------------------------------------------------------------------------------------------
# razor layout
# --------------------------------------------------------------------------------------------------
def _env(heads: dict[int, list[int]], budget: int | None = 256, hkv: int = 4, **kw) -> PolicyEnv:
    return PolicyEnv(
        num_layers=len(heads),
        num_kv_heads=hkv,
        num_attention_heads=2 * hkv,
        head_dim=16,
        budget=budget,
        block_size=kw.pop("block_size", 16),
        sinks=4,
        recent=8,
        retrieval_heads=lambda: heads,
        **kw,
    )


def _razor(env: PolicyEnv, **opts) -> Razor:
    pol = build_policy("razor", {"fallback": "sink", **opts}, env)
    assert isinstance(pol, Razor)
    return pol


def _promise(groups) -> int:
    return sum(len(g.heads) * (g.capacity + (1 if g.compensation else 0)) for g in groups)


def test_razor_split_capacities():
    env = _env({0: [1], 1: [0, 3], 2: [], 3: [0, 1, 2, 3]})
    pol = _razor(env)
    B, hkv = 256, 4
    window = min(max(64, B // 4), B // 2)  # the default window
    c_n = 4 + window + 1
    # layer 0: one retrieval head takes what the three others leave
    g = pol.layer_groups(0, env)
    assert [x.heads for x in g] == [[1], [0, 2, 3]]
    assert g[0].capacity == B * hkv - 3 * c_n and not g[0].compensation
    assert g[1].capacity == c_n - 1 and g[1].compensation and isinstance(g[1].policy, Sink)
    assert g[0].policy is pol.fallback_policy() and g[0].policy.name == "sink"
    assert g[0].capacity > g[1].capacity + 1
    assert _promise(g) == B * hkv
    # layer 1: two retrieval heads, floor split
    g = pol.layer_groups(1, env)
    assert [x.heads for x in g] == [[0, 3], [1, 2]]
    assert g[0].capacity == (B * hkv - 2 * c_n) // 2
    assert B * hkv - 1 <= _promise(g) <= B * hkv
    # layer 2: no retrieval head → every head sinks + (B − sinks − 1) + compensation
    g = pol.layer_groups(2, env)
    assert len(g) == 1 and g[0].heads == [0, 1, 2, 3] and g[0].capacity == B - 1 and g[0].compensation
    assert _promise(g) == B * hkv
    # layer 3: all retrieval → B each, no compensation group
    g = pol.layer_groups(3, env)
    assert len(g) == 1 and g[0].heads == [0, 1, 2, 3] and g[0].capacity == B and not g[0].compensation

    split = pol.budget_split()
    assert [s["layer"] for s in split] == [0, 1, 2, 3]
    for s in split:
        assert s["budget_tokens"] == B * hkv
        assert s["total_tokens"] + s["unused_tokens"] == B * hkv
        assert 0 <= s["unused_tokens"] < max(1, len(s["retrieval_heads"]))
    assert split[0]["other_capacity"] == c_n and split[0]["retrieval_capacity"] == B * hkv - 3 * c_n
    odd = _razor(_env({0: [0, 1, 2]}, budget=100), window=10)  # 400 − 15 = 385 over 3 heads: 1 unused
    assert odd.budget_split()[0]["unused_tokens"] == 1 and odd.budget_split()[0]["retrieval_capacity"] == 128


def test_razor_window_option_and_too_small_budget():
    env = _env({0: [2]}, budget=64)
    pol = _razor(env, window=20)
    g = pol.layer_groups(0, env)
    assert g[1].capacity == 4 + 20 and g[0].capacity == 64 * 4 - 3 * 25
    # default window = min(max(64, budget // 4), budget // 2) = 32 here
    assert _razor(env).layer_groups(0, env)[1].capacity == 4 + 32
    small = _env({0: [2]}, budget=24)
    with pytest.raises(UsageError, match="budget >= 25"):
        _razor(small, window=20).layer_groups(0, small)
    ok = _env({0: [2]}, budget=25)
    g = _razor(ok, window=20).layer_groups(0, ok)
    assert g[0].capacity == 25 and g[1].capacity == 24  # c_r == c_n: the minimum
    tiny = _env({0: []}, budget=5)
    with pytest.raises(UsageError):
        _razor(tiny).layer_groups(0, tiny)
    with pytest.raises(UsageError):
        _razor(_env({0: []}, budget=None)).layer_groups(0, _env({0: []}, budget=None))
    with pytest.raises(UsageError):
        _razor(env, window=0)
    with pytest.raises(UsageError):
        _razor(env, induction=2.0)


def test_razor_needs_calibration_and_is_attention_free():
    env = PolicyEnv(num_layers=1, num_kv_heads=2, num_attention_heads=4, head_dim=8, budget=64)
    pol = build_policy("razor", {"fallback": "sink"}, env)
    with pytest.raises(KvtoolError, match="calibration"):
        pol.layer_groups(0, env)
    with pytest.raises(KvtoolError, match="calibration"):
        Razor().retrieval_heads()
    assert not pol.needs_attention and not Razor().needs_attention
    with pytest.raises(AssertionError):
        pol.score(None)  # type: ignore[arg-type]
    seen = {}

    def heads(induction_frac=None, echo_frac=None):
        seen.update(induction=induction_frac, echo=echo_frac)
        return {"0": ["1"]}  # JSON-style keys are accepted

    env2 = PolicyEnv(
        num_layers=1, num_kv_heads=2, num_attention_heads=4, head_dim=8, budget=64, block_size=8, retrieval_heads=heads
    )
    pol2 = build_policy("razor", {"fallback": "sink", "induction": "0.3"}, env2)
    assert pol2.retrieval_heads() == {0: [1]} and seen == {"induction": 0.3, "echo": 0.01}
    bad = PolicyEnv(
        num_layers=1, num_kv_heads=2, num_attention_heads=4, head_dim=8, budget=64, retrieval_heads=lambda: {0: [5]}
    )
    with pytest.raises(KvtoolError, match="recalibrate"):
        build_policy("razor", {"fallback": "sink"}, bad).layer_groups(0, bad)


def test_razor_default_fallback_is_keydiff():
    env = _env({0: [0]})
    pol = build_policy("razor", {}, env)
    assert pol.layer_groups(0, env)[0].policy.name == "keydiff"


def test_razor_end_to_end_with_engine(tmp_path):
    """Calibration runs lazily inside Engine set-up (engine attention active) and is restored after."""
    from kvtool.core import attention
    from tests.helpers import make_engine, stream_logits

    model = _random_model(scale=1.0)
    ident = "feedfacefeedface" * 4
    calls = []

    def heads():
        calls.append(1)
        return cal.calibrate(model, ident, "tiny", tmp_path, K=8, induction_frac=0.25, echo_frac=0.125)["kv_heads"]

    B, block = 40, 8
    engine = make_engine(model, "razor", budget=B, block_size=block, retrieval=heads, options={"window": 12})
    assert calls == [1] and model.config._attn_implementation == attention.NAME
    assert cal.calibration_path(ident, tmp_path).is_file()
    ids = torch.randint(3, 64, (120,), generator=torch.Generator().manual_seed(0))
    logits, cache = stream_logits(engine, ids)
    assert torch.isfinite(logits).all()
    hkv, hd = 2, 16
    elem = cache.groups()[0].keys.element_size()
    assert cache.promised_bytes() <= 2 * B * hkv * hd * elem * 2  # 2 layers × B × Hkv tokens of K and V
    assert cache.stored_bytes() <= cache.promised_bytes()
    assert any(g.compensation for g in cache.groups()) or all(
        len(h) == hkv for h in engine.policy.retrieval_heads().values()
    )
