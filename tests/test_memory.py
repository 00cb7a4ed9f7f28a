"""Memory formulas against hand-computed numbers, and the shipped profiles' numbers against them."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvtool.core.costs import dtype_bytes
from kvtool.runtime.memory import (
    activation_bytes,
    attention_scratch_bytes,
    dense_max_tokens,
    dense_peak,
    dims_from_config,
    embedding_params,
    format_bytes,
    largest_budget,
    llama_param_count,
    predict_peak,
    sdpa_scratch_bytes,
    weights_bytes,
)
from kvtool.runtime.memory_cache import kv_bytes_at_budget, kv_bytes_per_token, policy_state_bytes
from tests.test_profile import tiny_dir  # noqa: F401 (the tiny checkpoint fixture)

# A tiny GQA model: 2 layers, 4 query heads sharing 2 KV heads of 8 dims.
TINY = {
    "num_layers": 2,
    "num_kv_heads": 2,
    "num_attention_heads": 4,
    "head_dim": 8,
    "hidden_size": 32,
    "intermediate_size": 64,
    "vocab_size": 100,
}

PROFILES = Path(__file__).resolve().parent.parent / "kvtool" / "profiles"
LLAMA_31_8B = {
    "num_layers": 32,
    "num_kv_heads": 8,
    "num_attention_heads": 32,
    "head_dim": 128,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "vocab_size": 128256,
}
LLAMA_32_3B = {
    "num_layers": 28,
    "num_kv_heads": 8,
    "num_attention_heads": 24,
    "head_dim": 128,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "vocab_size": 128256,
}
SMOLLM2_135M = {
    "num_layers": 30,
    "num_kv_heads": 3,
    "num_attention_heads": 9,
    "head_dim": 64,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "vocab_size": 49152,
}


def test_dtype_bytes() -> None:
    assert dtype_bytes(torch.float32) == 4 and dtype_bytes(torch.bfloat16) == 2 and dtype_bytes(2) == 2
    assert dtype_bytes("bfloat16") == 2
    with pytest.raises(TypeError):
        dtype_bytes("int4")


def test_dims_from_config() -> None:
    cfg = SimpleNamespace(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=100,
    )
    assert dims_from_config(cfg) == TINY  # head_dim = hidden // heads
    cfg.head_dim = 16
    assert dims_from_config(cfg)["head_dim"] == 16


def test_dims_from_transformers_config() -> None:
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        hidden_size=576,
        intermediate_size=1536,
        vocab_size=49152,
    )
    assert dims_from_config(cfg) == SMOLLM2_135M


def test_kv_formulas_by_hand() -> None:
    # per layer per head: 2 * 8 * 2 bytes = 32; per layer: 64; total: 128
    assert kv_bytes_per_token(TINY, torch.float16) == {"per_layer_per_head": 32, "per_layer": 64, "total": 128}
    assert kv_bytes_at_budget(TINY, 2, budget_tokens=10, block_size=4) == {"promised": 1280, "allocated": 1792}


def test_scratch_state_activations_by_hand() -> None:
    # no attention rows: nothing; 3 rows x (10 + 4) keys x 4 heads x 4 bytes x 2 (scores + softmax)
    assert attention_scratch_bytes(TINY, block=4, budget=10, rows=0) == 0
    assert attention_scratch_bytes(TINY, block=4, budget=10, rows=3) == 3 * 14 * 4 * 4 * 2 == 1344
    # repeated K/V: 2 * 14 keys * 4 heads * 8 dims * 2 bytes = 1792; scores: 4 * 14 * 4 * 4 = 896
    assert sdpa_scratch_bytes(TINY, block=4, budget=10, elem=2) == 1792 + 896
    no_gqa = {**TINY, "num_kv_heads": 4}
    assert sdpa_scratch_bytes(no_gqa, block=4, budget=10, elem=2) == 896
    # 2 fields * 4 bytes * 14 tokens * 2 KV heads * 2 layers
    assert policy_state_bytes(TINY, budget=10, block=4, n_fields=2) == 448
    assert policy_state_bytes(TINY, budget=10, block=4, n_fields=0) == 0
    # 4 * 32 * 2 * 6 + 4 * 64 * 2 * 3 + 1 * 100 * 4
    assert activation_bytes(TINY, block=4, elem=2) == 1536 + 1536 + 400
    assert activation_bytes(TINY, block=4, elem=2, logits_rows=4) == 1536 + 1536 + 1600


def test_weights_bytes() -> None:
    assert weights_bytes(1000, torch.bfloat16) == 2000
    assert weights_bytes(1000, 4, "8bit") == 1000
    assert weights_bytes(1000, 2, "4bit") == 515  # 0.5 + 1/64 + 4/(64·256) byte per param, rounded down
    assert weights_bytes(1000, 2, "4bit", unquantized_params=200) == 412 + 400
    with pytest.raises(ValueError):
        weights_bytes(1000, 2, "3bit")


def test_param_counts_match_published_sizes() -> None:
    assert llama_param_count(LLAMA_31_8B, tie_word_embeddings=False) == 8_030_261_248
    assert llama_param_count(LLAMA_32_3B, tie_word_embeddings=True) == 3_212_749_824
    assert llama_param_count(SMOLLM2_135M, tie_word_embeddings=True) == 134_515_008
    assert embedding_params(LLAMA_31_8B, tie_word_embeddings=False) == 2 * 128256 * 4096


def tiny_peak(budget: int, **kw: Any) -> dict[str, int]:
    args = {"num_params": 10_000, "elem": 2, "block_size": 4, "rows": 3, "n_fields": 2, "runtime_baseline_bytes": 5}
    args.update(kw)
    return predict_peak(TINY, budget_tokens=budget, **args)


def test_predict_peak_sums_components() -> None:
    p = tiny_peak(10)
    assert p["weights_bytes"] == 20_000
    assert p["kv_allocated_bytes"] == 1792 and p["kv_promised_bytes"] == 1280
    assert p["attention_scratch_bytes"] == 1344 and p["policy_state_bytes"] == 448
    # snapshot: 10 tokens x (K+V 2 x 8 x 2 B + two int64 positions + two float32 fields) x 2 heads x 2 layers
    assert p["snapshot_bytes"] == 10 * (32 + 16 + 8) * 2 * 2 == 2240
    # two int64 positions per slot: 14 slots x 2 KV heads x 2 layers
    assert p["positions_bytes"] == 16 * 14 * 2 * 2 == 896
    # an eviction: per layer 2 KV heads x the larger of scoring 14 slots (48 B each) and copying 10 kept keys
    # (16 B) with their two int64 indices; both layers at once (one chunk), and a few small tensors
    assert p["eviction_scratch_bytes"] == 2 * 2 * max(14 * 48, 10 * (16 + 16)) + 4096 == 6784
    assert p["predicted_peak_bytes"] == 20_000 + 1792 + 1344 + 2688 + 448 + 896 + 6784 + 3472 + 2240 + 5


def test_largest_budget_consistent_and_monotonic() -> None:
    kw = {"num_params": 10_000, "elem": 2, "block_size": 4, "rows": 3, "n_fields": 2, "runtime_baseline_bytes": 5}
    last = 0
    for memory in (20_000, 30_000, 50_000, 100_000, 1_000_000, 10_000_000):
        b = largest_budget(memory, TINY, **kw)
        assert b >= last
        last = b
        if b:
            assert tiny_peak(b)["predicted_peak_bytes"] <= memory < tiny_peak(b + 1)["predicted_peak_bytes"]
        else:
            assert tiny_peak(1)["predicted_peak_bytes"] > memory
    assert largest_budget(20_000, TINY, **kw) == 0  # the weights alone do not fit
    assert last > 1000


def test_dense_max_tokens_consistent_and_monotonic() -> None:
    kw = {"num_params": 10_000, "elem": 2}
    # per token: KV 128 + activations 32*2*6 + 64*2*3 = 896; fixed: 20_000 weights + 400 logits
    assert dense_peak(TINY, 10, **kw) == 20_000 + 10 * 896 + 400
    last = 0
    for memory in (20_000, 21_296, 21_297, 50_000, 1_000_000):
        n = dense_max_tokens(memory, TINY, **kw)
        assert n >= last
        last = n
        if n:
            assert dense_peak(TINY, n, **kw) <= memory < dense_peak(TINY, n + 1, **kw)
    assert dense_max_tokens(21_296, TINY, **kw) == 1 and dense_max_tokens(21_295, TINY, **kw) == 0
    # a budgeted run reads documents of any length; dense reads only what fits
    assert largest_budget(1_000_000, TINY, num_params=10_000, elem=2, block_size=4) > 0


def test_format_bytes() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(int(1.23 * 2**30)) == "1.23 GiB"
    assert format_bytes(-2048) == "-2.00 KiB"


@pytest.mark.parametrize(
    ("profile", "dims", "tied", "elem", "quantize", "budget"),
    [
        ("default", SMOLLM2_135M, True, torch.float32, "none", 1024),
        ("gpu-8b-4bit", LLAMA_31_8B, False, torch.bfloat16, "4bit", 4096),
        ("gpu-3b-bf16", LLAMA_32_3B, True, torch.bfloat16, "none", 8192),
    ],
)
def test_profile_expected_memory_matches_formulas(
    profile: str, dims: dict[str, int], tied: bool, elem: torch.dtype, quantize: str, budget: int
) -> None:
    """The numbers written in the shipped profiles are what memory.py computes (no drift), for their policy."""
    from kvtool.policies import REGISTRY
    from kvtool.runtime.budget import parse_budget
    from kvtool.runtime.settings import default_block_size, load_profile

    data = load_profile(PROFILES / f"{profile}.yaml")
    policy = REGISTRY.bases[data["policy"]]()  # a plain base (no modifiers) in every shipped profile
    assert data["quantize"] == quantize
    assert data["dtype"] in ("auto", str(elem).removeprefix("torch."))
    expected = data["expected_memory"]
    assert expected["assumed_dtype"] == str(elem).removeprefix("torch.")
    num_params = llama_param_count(dims, tied)
    unquantized = embedding_params(dims, tied)
    assert parse_budget(data["budget"]).tokens == budget
    block = data["block_size"] or default_block_size(data["device"], budget)  # auto: the device's block
    peak = predict_peak(
        dims,
        num_params=num_params,
        elem=elem,
        budget_tokens=budget,
        block_size=block,
        quantize=quantize,
        unquantized_params=unquantized,
        rows=policy.query_rows(block),
        n_fields=len(policy.state_fields),
        rows_summed=policy.rows_summed,
        device_type=data["device"],
    )
    assert expected["num_params"] == num_params
    assert expected["unquantized_params"] == unquantized
    for key, value in peak.items():
        assert expected[key] == value, key
    assert expected["predicted_peak"] == format_bytes(peak["predicted_peak_bytes"])


@pytest.mark.parametrize(
    ("positions", "dtype", "doc_tokens", "kept"),
    [
        ("compact", torch.bfloat16, 48, True),
        ("compact", torch.float16, 48, True),
        ("compact", torch.float32, 48, False),
        ("absolute", torch.bfloat16, 48, False),
        ("auto", torch.bfloat16, 48, False),  # within the model's 64 positions: never switches
        ("auto", torch.bfloat16, 100, True),  # passes them: switches to compact
    ],
)
def test_kv_allocation_plan_counts_original_keys_as_the_cache_allocates_them(
    positions: str, dtype: torch.dtype, doc_tokens: int, kept: bool
) -> None:
    """The plan's allocated K/V equals the cache's real buffers (keys, values, and the original keys'
    copy a 16-bit cache keeps at compact positions), for a tiny model streamed past its budget."""
    from kvtool.runtime.memory import keeps_original_keys
    from tests.helpers import VOCAB, make_engine, stream_logits, tiny_llama

    budget, block = 16, 8
    model = tiny_llama(max_positions=64).to(dtype)
    engine = make_engine(model, "h2o", budget, block_size=block, positions=positions)
    ids = torch.randint(0, VOCAB, (doc_tokens,), generator=torch.Generator().manual_seed(0))
    _, cache = stream_logits(engine, ids)
    elem = torch.empty((), dtype=dtype).element_size()
    original = keeps_original_keys(elem, positions, 64, doc_tokens)
    assert original == kept
    assert all((g.origin is not None) == kept for g in cache.groups())
    dims = dims_from_config(model.config)
    planned = kv_bytes_at_budget(dims, elem, budget, block, original_keys=original)
    assert cache.allocated_bytes() == planned["allocated"]
    plain = kv_bytes_at_budget(dims, elem, budget, block)["allocated"]
    assert planned["allocated"] == (plain * 3 // 2 if kept else plain)


def test_plan_counts_original_keys_in_allocation_peak_and_budget_search() -> None:
    """``kvtool profile``'s plan: compact bf16 allocates K/V x 1.5 (and the largest budget shrinks
    to match); auto positions only when the document passes the model's range; float32 never."""
    from kvtool.runtime.profiling import ModelInfo, plan
    from kvtool.runtime.settings import resolve_settings

    def run(dtype: str, positions: str, doc: int, max_positions: int | None = 64) -> dict[str, Any]:
        info = ModelInfo(name="hand", dims=dict(TINY), num_params=1000, dtype=dtype, max_positions=max_positions)
        settings = resolve_settings(
            None, {"block_size": 16, "budget": "64", "policy": "h2o", "positions": positions, "recall": "off"}
        )
        return plan(info, settings, doc_tokens=doc, memory=10_000_000)

    base = run("bfloat16", "absolute", 1000)
    per_token = kv_bytes_per_token(TINY, 2)["total"]
    assert base["kv_bytes_at_budget"]["allocated"] == 80 * per_token and not base["original_keys"]
    for positions, doc, max_positions in [("compact", 10, 64), ("auto", 1000, 64)]:
        p = run("bfloat16", positions, doc, max_positions)
        assert p["original_keys"]
        assert p["kv_bytes_at_budget"]["promised"] == base["kv_bytes_at_budget"]["promised"]
        assert p["kv_bytes_at_budget"]["allocated"] == 80 * per_token * 3 // 2
        assert p["memory"]["largest_budget_tokens"] < base["memory"]["largest_budget_tokens"]
    assert not run("bfloat16", "auto", 1000, None)["original_keys"]  # no range: auto never switches
    assert not run("bfloat16", "auto", 50)["original_keys"]
    assert not run("float32", "compact", 10)["original_keys"]


def test_profile_measured_allocation_matches_plan_bf16_compact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_dir: Path  # noqa: F811 (the fixture, by name)
) -> None:
    """``kvtool profile --doc`` with a bf16 cache at compact positions: the real buffers (the original keys'
    copy included) are exactly the plan's allocated K/V, which counts the copy."""
    from tests.test_profile import _run, _tiny_doc

    doc = _tiny_doc(tmp_path, 300)
    code, out, err = _run(
        capsys,
        "--model",
        str(tiny_dir),
        "--budget",
        "32",
        "--block-size",
        "16",
        "--device",
        "cpu",
        "--dtype",
        "bfloat16",
        "--positions",
        "compact",
        "--policy",
        "h2o",
        "--doc",
        str(doc),
        "--json",
        "--quiet",
    )
    assert code == 0, err
    p = json.loads(out)
    assert p["original_keys"]
    per_token = p["kv_bytes_per_token"]["total"]
    assert p["kv_bytes_at_budget"]["allocated"] == (32 + 16) * per_token * 3 // 2
    assert p["measured"]["kv_allocated_bytes"] == p["kv_bytes_at_budget"]["allocated"]


CONFIGS = Path(__file__).resolve().parent / "data" / "configs"
#: the profiles of the models people run on one workstation GPU: (published config, the cards each is for)
MODEL_PROFILES = {
    "llama-3.1-8b-24gb": ("llama-3.1-8b-instruct", ["23GiB"]),
    "llama-3.1-8b-80gb": ("llama-3.1-8b-instruct", ["79GiB"]),
    "mistral-7b-v0.3-24gb": ("mistral-7b-instruct-v0.3", ["23GiB"]),
    "mistral-7b-v0.3-80gb": ("mistral-7b-instruct-v0.3", ["79GiB"]),
    "qwen2.5-7b": ("qwen2.5-7b-instruct", ["23GiB", "79GiB"]),
    "gemma-2-9b": ("gemma-2-9b-it", ["23GiB", "79GiB"]),
}
#: tokens of the trained range a profile's budget leaves free (recall, the question, the answer, two blocks)
RANGE_SLACK = 4096


@pytest.mark.parametrize("profile", sorted(MODEL_PROFILES))
def test_model_profiles_are_the_plan_of_their_published_config(profile: str) -> None:
    """Every number a model's profile embeds is what ``kvtool profile`` plans from the model's config.json alone,
    and its budget is the rule's: the largest multiple of 4k each card it is for holds, leaving 4k of the
    trained range free."""
    from kvtool.runtime.budget import parse_size
    from kvtool.runtime.profiling import plan_from_config
    from kvtool.runtime.settings import load_profile, resolve_settings

    config_name, cards = MODEL_PROFILES[profile]
    directory = CONFIGS / config_name
    path = PROFILES / f"{profile}.yaml"
    data = load_profile(path)
    settings = resolve_settings(str(path), {})
    trained = json.loads((directory / "config.json").read_text())["max_position_embeddings"]
    for card in cards:
        largest = plan_from_config(directory, settings, None, parse_size(card))["memory"]["largest_budget_tokens"]
        assert settings.parsed_budget.tokens == min(largest, trained - RANGE_SLACK) // 4096 * 4096, card
    expected = data["expected_memory"]
    plan = plan_from_config(directory, settings, None, parse_size(expected["planned_memory"]))
    assert plan["memory"]["fits"] and plan["memory"]["largest_budget_tokens"] == expected["largest_budget_tokens"]
    assert expected["assumed_dtype"] == plan["dtype"] == data["dtype"]
    computed = {
        **plan,
        "kv_promised_bytes": plan["kv_bytes_at_budget"]["promised"],
        "kv_allocated_bytes": plan["kv_bytes_at_budget"]["allocated"],
    }
    for key, value in expected.items():
        if key not in ("assumed_dtype", "planned_memory", "largest_budget_tokens", "predicted_peak"):
            assert computed[key] == value, key
    assert expected["predicted_peak"] == format_bytes(plan["predicted_peak_bytes"])
    table = (Path(__file__).resolve().parent.parent / "docs" / "models.md").read_text(encoding="utf-8")
    assert f" | {data['budget']} | {expected['predicted_peak']} |" in next(
        line for line in table.splitlines() if line.startswith(f"| `{profile}` |")
    ), "docs/models.md's table"


def test_the_published_configs_count_their_published_parameters() -> None:
    """The configs the profiles are planned from are the published ones: their sizes (model cards, up to the
    norms and biases the Llama-style count leaves out) come out of the memory plan's count."""
    import transformers

    published = {
        "llama-3.1-8b-instruct": 8_030_261_248,
        "qwen2.5-7b-instruct": 7_615_616_512,
        "mistral-7b-instruct-v0.3": 7_248_023_552,
        "gemma-2-9b-it": 9_241_705_984,
    }
    for name, params in published.items():
        config = transformers.AutoConfig.from_pretrained(str(CONFIGS / name))
        text = config.get_text_config()
        counted = llama_param_count(dims_from_config(config), bool(getattr(text, "tie_word_embeddings", False)))
        assert abs(counted - params) / params < 1e-4, name
