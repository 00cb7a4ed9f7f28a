"""The model families kvtool claims to support, on tiny random models from transformers' own configs.

Oracles (as in test_engine.py):

1. Dense equality: with a budget covering the document the logits equal transformers' own forward
   (SDPA, or eager for Gemma 2's softcapping) — in both position modes. Sliding-window layers drop
   what left their window during this, so equality also proves that window eviction is exact.
2. Masking reference after eviction: a dense float64 forward in which every query sees exactly what
   the cache held, intersected with the model's own sliding window and with its own softcap.
3. Compact positions re-rotate each layer's keys with that layer's own RoPE (Gemma 3: two bases).
4. Sliding layers never hold more than the window (or the budget, if smaller); global layers never
   more than the budget. Families kvtool cannot run are refused with one line naming the feature.
"""

from __future__ import annotations

import pytest
import torch

from kvtool.core.cache import HeadGroup
from kvtool.core.layout import layer_kinds, layer_windows, window_capacity
from kvtool.errors import UsageError
from tests.helpers import (
    FAMILIES,
    FAMILY_WINDOW,
    VOCAB,
    dense_logits,
    make_engine,
    masking_reference_logits,
    record_visibility,
    stream_logits,
    tiny_family,
)

SLIDING = {"mistral", "phi3", "gemma2", "gemma3", "gemma3-multimodal"}


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("positions", ["absolute", "compact"])
@pytest.mark.parametrize("policy", ["full", "tova"])
def test_budget_covering_the_document_reproduces_transformers_logits(family, positions, policy):
    model = tiny_family(family)
    ids = _ids(100, 1)  # longer than every sliding window (24–32)
    dense = dense_logits(model, ids)  # transformers' own attention: the engine is not built yet
    engine = make_engine(model, policy, None if policy == "full" else 128, block_size=16, positions=positions)
    got, cache = stream_logits(engine, ids)
    torch.testing.assert_close(got, dense, atol=1e-5, rtol=1e-5)
    windows = layer_windows(model.config)
    assert (family in SLIDING) == any(w is not None for w in windows)
    for w, layer in zip(windows, cache.layers, strict=True):
        for g in layer.groups:  # sliding layers dropped what left the window; global layers kept everything
            assert g.length == (ids.numel() if w is None else w - 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_forward_after_an_engine_still_equals_transformers(family):
    """The registered attention falls back to SDPA — or, for softcapped models, explicit capping — without
    the engine's cache, so the same model object keeps giving transformers' own logits."""
    model = tiny_family(family)
    ids = _ids(60, 3)
    before = dense_logits(model, ids)
    make_engine(model, "sink", 64)
    torch.testing.assert_close(dense_logits(model, ids), before, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [1, 5])
def test_decoding_and_small_blocks_reproduce_transformers_logits(family, block_size):
    model = tiny_family(family)
    ids = _ids(60, 2)
    dense = dense_logits(model, ids)
    got, _ = stream_logits(make_engine(model, "sink", 128, block_size=block_size), ids)
    torch.testing.assert_close(got, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["h2o", "keydiff"])
def test_outputs_after_eviction_equal_masking_reference(monkeypatch, family, policy):
    model = tiny_family(family)
    ids = _ids(120, 4)
    visibility = record_visibility(monkeypatch)
    got, cache = stream_logits(make_engine(model, policy, 40, block_size=8), ids)
    assert cache.counters.evicted_tokens > 0
    ref = masking_reference_logits(model, ids, visibility)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", sorted(SLIDING))
def test_budget_below_the_window_narrows_sliding_layers_and_matches_the_reference(monkeypatch, family):
    """budget < W - 1: a sliding layer keeps the ``budget`` newest tokens (the budget is never exceeded)."""
    model = tiny_family(family, window=48)
    ids = _ids(120, 5)
    visibility = record_visibility(monkeypatch)
    budget = 20
    engine = make_engine(model, "h2o", budget, block_size=8)

    def check(cache):
        for g in cache.groups():
            assert g.length <= budget

    got, cache = stream_logits(engine, ids, check=check)
    for g in cache.groups():
        if g.window is not None:
            assert g.capacity == budget == window_capacity(48, budget)
    ref = masking_reference_logits(model, ids, visibility)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", sorted(SLIDING))
def test_sliding_layers_hold_the_window_and_global_layers_the_budget(family):
    model = tiny_family(family)
    windows = layer_windows(model.config)
    block, budget = 8, 40
    engine = make_engine(model, "tova", budget, block_size=block)
    stored = []

    def check(cache):
        for w, layer in zip(windows, cache.layers, strict=True):
            for g in layer.groups:
                assert g.length <= (budget if w is None else w - 1)
                assert g.slots == g.capacity + block  # preallocated: capacity + one block, never more
        stored.append(cache.counters.max_stored)

    _, cache = stream_logits(engine, _ids(150, 6), check=check)
    logits = engine.step(cache, torch.tensor([3]), 1)
    engine.generate(cache, logits, 10, eos_ids=set())
    # decoding evicts lazily (one eviction per block of generated tokens): until the spare block region is
    # full a group holds up to capacity + block; the window mask keeps attention exact meanwhile
    for layer in cache.layers:
        for g in layer.groups:
            assert g.length <= g.capacity + block
    assert max(stored) <= budget + block


def test_gemma3_compact_rerotation_uses_each_layers_own_rope(monkeypatch):
    """Gemma 3's local layers use RoPE base 10 000, global ones 1 000 000 with linear scaling: every key
    re-rotated in compact mode equals its first key rotated once (float64) with its own layer's frequencies."""
    model = tiny_family("gemma3", max_positions=64)  # 64: rotary positions are also shifted back down
    first: dict[tuple[int, int, int], tuple[torch.Tensor, int]] = {}
    original_append = HeadGroup.append

    def spy(self, key_states, value_states, positions, rotary=None):
        for head in self.heads:
            for j, p in enumerate(positions.tolist()):
                first[(self._layer, head, p)] = (key_states[0, head, j].clone(), int(rotary[j]))
        return original_append(self, key_states, value_states, positions, rotary)

    monkeypatch.setattr(HeadGroup, "append", spy)
    engine = make_engine(model, "h2o", 32, block_size=8, positions="compact")
    cache = engine.new_cache()
    for li, layer in enumerate(cache.layers):
        for g in layer.groups:
            g._layer = li
    stream_logits(engine, _ids(200, 7), cache=cache)
    assert cache.counters.evicted_tokens > 0
    local, glob = cache.layers[0].groups[0].rotator, cache.layers[1].groups[0].rotator
    assert not torch.allclose(local.inv_freq, glob.inv_freq)
    rope = model.model.rotary_emb
    torch.testing.assert_close(local.inv_freq, rope.sliding_attention_inv_freq.float())
    torch.testing.assert_close(glob.inv_freq, rope.full_attention_inv_freq.float())
    moved = 0
    for li, layer in enumerate(cache.layers):
        for g in layer.groups:
            inv = g.rotator.inv_freq.double()
            for h, head in enumerate(g.heads):
                for r in range(g.length):
                    k0, p0 = first[(li, head, int(g.positions[h, r]))]
                    delta = float(g.rotary[h, r] - p0)
                    moved += delta != 0
                    ang = delta * inv
                    ang = torch.cat((ang, ang))
                    k = k0.double()
                    half = k.shape[-1] // 2
                    expected = k * ang.cos() + torch.cat((-k[half:], k[:half])) * ang.sin()
                    torch.testing.assert_close(g.keys[0, h, g.off + r].double(), expected, atol=1e-5, rtol=1e-5)
    assert moved > 0  # keys really were re-rotated


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_qk_norm_families_really_normalise_queries_and_keys(family):
    """The QK-norm families' dense-equality tests above are only evidence if the norm is in the model."""
    model = tiny_family(family)
    attn = model.model.layers[0].self_attn
    assert hasattr(attn, "q_norm") and hasattr(attn, "k_norm")


def test_softcapping_matters_in_the_gemma2_test_model():
    """Gemma 2's dense-equality tests prove softcapping only if capping changes the logits."""
    model = tiny_family("gemma2")
    ids = _ids(40, 8)
    capped = dense_logits(model, ids)
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert (dense_logits(model, ids) - capped).abs().max() > 1e-2


def test_layer_kinds_for_memory_plans():
    gemma3 = tiny_family("gemma3").config
    assert layer_kinds(gemma3, 40) == {
        "global_layers": 1,
        "sliding_layers": 2,
        "sliding_window": FAMILY_WINDOW,
        "sliding_capacity": FAMILY_WINDOW - 1,
    }
    assert layer_kinds(gemma3, 10)["sliding_capacity"] == 10
    assert layer_kinds(tiny_family("llama3").config, 40)["sliding_layers"] == 0


def test_attention_sink_logits_are_refused_with_one_line():
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=16,
        max_position_embeddings=256,
    )
    model = GptOssForCausalLM(cfg).eval()
    with pytest.raises(UsageError, match="attention-sink logits") as err:
        make_engine(model, "sink", 64)
    assert "\n" not in str(err.value)


def test_chunked_and_bidirectional_attention_are_refused():
    from kvtool.core.families import check_supported

    model = tiny_family("llama3")
    model.config.attention_chunk_size = 16
    with pytest.raises(UsageError, match="chunked"):
        check_supported(model)
    model.config.attention_chunk_size = None
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(UsageError, match="linear_attention"):
        check_supported(model)
    gemma3 = tiny_family("gemma3")
    gemma3.config.use_bidirectional_attention = True
    with pytest.raises(UsageError, match="bidirectional"):
        check_supported(gemma3)


# -- the command line: memory plans and stats split by layer kind; refusals are one line, exit 2 -------------------


def test_profile_and_stats_split_kv_bytes_by_layer_kind(tmp_path, capsys):
    import json

    from kvtool.cli.app import main
    from kvtool.core.costs import CacheCosts
    from tests.helpers import tiny_family_checkpoint

    model_dir = tiny_family_checkpoint(tmp_path / "gemma3", "gemma3")
    doc = tmp_path / "doc.txt"
    doc.write_text("the cache is small and the pass key is 12345 hello world " * 30, encoding="utf-8")
    # 3 layers (2 sliding, window 24) x 2 KV heads x 16 dims x K+V x 4 bytes = 256 bytes per token and layer
    code = main(
        [
            "profile",
            "--model",
            str(model_dir),
            "--budget",
            "24KiB",
            "--block-size",
            "16",
            "--device",
            "cpu",
            "--policy",
            "h2o",
            "--recall",
            "off",
            "--doc",
            str(doc),
            "--json",
            "--quiet",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    p = json.loads(out)
    # recall off: the whole byte budget is kept tokens (with recall on it holds the recalled ones too)
    tokens = 24 * 1024 // 256 - 2 * (FAMILY_WINDOW - 1)  # 2 sliding layers need only W - 1 tokens; 1 global layer
    assert p["budget_tokens"] == tokens == CacheCosts(3, 2, 16, 4, "auto", 2, FAMILY_WINDOW).budget_tokens(24 * 1024)
    kinds = p["kv_bytes_at_budget"]["by_layer_kind"]
    assert kinds["global"]["promised"] == tokens * 256 and kinds["sliding"]["promised"] == 2 * 23 * 256
    assert kinds["global"]["promised"] + kinds["sliding"]["promised"] <= 24 * 1024  # the byte budget holds
    assert p["measured"]["kv_allocated_bytes"] == p["kv_bytes_at_budget"]["allocated"]  # formula == real buffers
    assert f"slide over a {FAMILY_WINDOW}-token window" in p["budget_conversion"]
    code = main(
        [
            "profile",
            "--model",
            str(model_dir),
            "--budget",
            "120",
            "--block-size",
            "16",
            "--device",
            "cpu",
            "--recall",
            "24",
            "--json",
            "--quiet",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    # the global layer's slots only, as the ask below: K+V (256 bytes a token), two int64 positions and h2o's one
    # float32 of state per KV head (2 heads), none in the sliding layers
    assert json.loads(out)["recall_slots_bytes"] == 24 * (256 + 2 * (16 + 4))

    code = main(
        [
            "ask",
            str(doc),
            "what is the pass key?",
            "--model",
            str(model_dir),
            "--budget",
            "120",
            "--block-size",
            "16",
            "--max-new-tokens",
            "3",
            "--json",
            "--quiet",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    stats = json.loads(out)["stats"]
    split = stats["kv_cache_bytes_by_layer_kind"]
    recalled = stats["recalled_tokens_max"]  # recall (the default) grows the global layer's slots only
    assert split["global"] == (120 + 16 + recalled) * 256 and split["sliding"] == 2 * (23 + 16) * 256
    assert split["global"] + split["sliding"] == stats["kv_cache_bytes"]


def test_cli_refuses_attention_sink_models_in_one_line(tmp_path, capsys):
    from transformers import GptOssConfig, GptOssForCausalLM

    from kvtool.cli.app import main
    from tests.helpers import tiny_tokenizer

    tok = tiny_tokenizer()
    cfg = GptOssConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=16,
        max_position_embeddings=256,
    )
    GptOssForCausalLM(cfg).save_pretrained(str(tmp_path / "oss"))
    tok.save_pretrained(str(tmp_path / "oss"))
    doc = tmp_path / "doc.txt"
    doc.write_text("hello world", encoding="utf-8")
    capsys.readouterr()  # drop save_pretrained's progress bar
    code = main(["ask", str(doc), "q", "--model", str(tmp_path / "oss"), "--budget", "64", "--quiet"])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.strip().startswith("kvtool: error:") and "attention-sink logits" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    ("rope", "positions"),
    [
        ({"rope_type": "linear", "factor": 4.0}, "compact"),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, "compact"),
        ({"rope_type": "dynamic", "factor": 2.0}, "absolute"),  # length-dependent: absolute positions only
    ],
)
def test_rope_scaling_variants_reproduce_transformers_logits(rope, positions):
    from tests.helpers import tiny_llama

    model = tiny_llama(rope_scaling={"rope_theta": 10000.0, **rope})
    ids = _ids(80, 9)
    dense = dense_logits(model, ids)
    got, _ = stream_logits(make_engine(model, "tova", 128, block_size=16, positions=positions), ids)
    torch.testing.assert_close(got, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_document_read_without_logits_leaves_the_same_cache(family):
    """A document's blocks fed with no logits row (what a read does: a question follows) skip only the
    vocabulary projection: the question's logits equal those after blocks that computed theirs."""
    model = tiny_family(family)
    ids, question = _ids(96, 3), _ids(8, 4)
    engine = make_engine(model, "h2o", 32, block_size=16)
    runs = []
    for rows in (1, 0):
        cache = engine.new_cache()
        last = engine.feed(cache, [ids], progress=False, logits_rows=rows)
        assert last is not None and last.shape[0] == rows
        runs.append(engine.step(cache, question, 1))
    torch.testing.assert_close(runs[1], runs[0], atol=0, rtol=0)
