"""``kvtool profile``: plan numbers by hand, byte budgets, the CLI's JSON and text, measured vs predicted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from kvtool.cli.app import main
from kvtool.runtime.budget import resolve_budget_and_recall
from kvtool.runtime.memory import llama_param_count, predict_peak
from kvtool.runtime.profiling import ModelInfo, plan
from kvtool.runtime.settings import Settings, resolve_settings

# Hand-computable dims: 2 layers, 4 query heads sharing 2 KV heads of 16 dims.
DIMS = {
    "num_layers": 2,
    "num_kv_heads": 2,
    "num_attention_heads": 4,
    "head_dim": 16,
    "hidden_size": 64,
    "intermediate_size": 96,
    "vocab_size": 100,
}
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = ["[UNK]", "<|im_start|>", "<|im_end|>", "user", "assistant", "hello", "world", "the", "cache", "is", "small"]


def _info(**kw) -> ModelInfo:
    base = {"name": "hand", "dims": DIMS, "num_params": 1000, "dtype": "float32", "rows": 16, "n_fields": 1}
    return ModelInfo(**{**base, **kw})


def _settings(**kw) -> Settings:
    return resolve_settings(None, {"block_size": 16, "budget": "64", "policy": "h2o", "recall": "off", **kw})


# ---------------------------------------------------------------------------------------------
# pure plan numbers


def test_plan_matches_hand_computation() -> None:
    p = plan(_info(), _settings(), doc_tokens=1000, memory=None, runtime_baseline=1000)
    # K+V per token: 2 x 16 dims x 4 bytes = 128 per (layer, KV head); x 2 KV heads; x 2 layers
    assert p["kv_bytes_per_token"] == {"per_layer_per_head": 128, "per_layer": 256, "total": 512}
    assert p["budget_tokens"] == 64 and p["budget_conversion"] is None
    # promised: 64 tokens; allocated: 64 + one block of 16
    assert p["kv_bytes_at_budget"] == {"promised": 64 * 512, "allocated": 80 * 512}
    # float32 probs and softmax: 2 copies x 16 rows x 80 keys x 4 heads x 4 bytes
    assert p["attention_scratch_bytes"] == 2 * 16 * 80 * 4 * 4 == 40960
    # SDPA: K and V repeated to 4 heads (2 x 80 x 4 x 16 x 4) + float32 scores 16 x 80 x 4 x 4
    assert p["sdpa_scratch_bytes"] == 40960 + 20480
    # one float32 field x 80 slots x 2 KV heads x 2 layers
    assert p["policy_state_bytes"] == 4 * 80 * 2 * 2 == 1280
    # 16 tokens x (64 hidden x 4 B x 6 tensors + 96 intermediate x 4 B x 3 tensors) + 100 logits x 4 B
    assert p["activation_bytes"] == 16 * 64 * 4 * 6 + 16 * 96 * 4 * 3 + 100 * 4 == 43408
    assert p["weights_bytes"] == 4000 and p["runtime_baseline_bytes"] == 1000
    # the snapshot kept between questions: 64 tokens x (K+V 128 B + 2 int64 positions + 1 float32 field)
    # x 2 KV heads x 2 layers
    assert p["snapshot_bytes"] == 64 * (128 + 16 + 4) * 2 * 2 == 37888
    # two int64 positions per slot (80 x 2 KV heads x 2 layers); an eviction of both layers at once: per layer
    # 2 KV heads x the larger of scoring 80 slots (48 B each) and copying 64 kept keys (64 B) with two indices
    assert p["positions_bytes"] == 16 * 80 * 2 * 2 == 5120
    assert p["eviction_scratch_bytes"] == 2 * 2 * max(80 * 48, 64 * (64 + 16)) + 4096 == 24576
    parts = 1000 + 4000 + 40960 + 40960 + 61440 + 1280 + 5120 + 24576 + 43408 + 37888
    assert p["predicted_peak_bytes"] == parts == 260632
    # recall's default (auto: 256 slots per KV head): its slots (K+V, two positions, the state field, x 2 KV heads
    # x 2 layers)
    auto = plan(_info(), _settings(recall="auto"), doc_tokens=1000, memory=None, runtime_baseline=1000)
    assert auto["recall_slots_bytes"] == 256 * (128 + 16 + 4) * 2 * 2 == 151552
    assert auto["recall_kv_bytes"] == 256 * 512  # what recall adds to the budget's promise
    # a query sees 64 + 256 + 16 keys while answering: the policy's probabilities and SDPA's scratch grow with them
    attention, sdpa = 2 * 16 * 336 * 4 * 4, 2 * 336 * 4 * 16 * 4 + 16 * 336 * 4 * 4
    assert (auto["attention_scratch_bytes"], auto["sdpa_scratch_bytes"]) == (attention, sdpa) == (172032, 258048)
    # scoring the archive, for a question of min(256, budget) = 64 tokens: its queries logged in both layers
    # (4 heads x 16 dims, float32), one layer's gathered and in float32, the scores held between the softmax's
    # passes (2 KV heads x 2 x 64 rows, float32, for each of the 1000 tokens a 1000-token document can archive),
    # and a chunk of 16 pages of 32 tokens with its softmax's temporary
    assert auto["recall_question_tokens"] == 64
    per_token = 4 * 2 * 2 * 64
    scratch = 2 * 4 * 64 * 16 * 4 + 4 * 64 * 16 * 8 + per_token * 1000 + 2 * per_token * 16 * 32
    assert auto["recall_scratch_bytes"] == scratch == 2138112
    # making room for recall holds the stack's old keys for a moment (80 slots x 2 heads x 2 layers x 64 B); a
    # recalling layer evicts alone, over 64 + 256 + 16 slots; the archive's appends (int8): per layer and head a
    # block of 16 evicted tokens gathered (positions, K and V in float32, keys again in float32, the packed row of
    # 2 x 16 codes, 2 float32 scales and an int32 position, K and V twice in float32 with their scales) and the
    # summaries of two pages (five buffers of 2 x 16 values), for both layers at once, and every layer's packed rows
    growth = 2 * 2 * 80 * 64
    evict = 2 * max(336 * 48, 320 * (64 + 16)) + 4096
    row = 2 * 16 + 8 + 4
    archive = 2 * (2 * (16 * (8 + 2 * 16 * 4 + 4 * 16 + row + 2 * (2 * 16 * 4 + 4)) + 2 * 2 * 16 * 13) + 2 * 16 * row)
    assert (
        (auto["recall_growth_bytes"], auto["eviction_scratch_bytes"], auto["archive_work_bytes"])
        == (growth, evict, archive)
        == (20480, 55296, 38656)
    )
    assert auto["predicted_peak_bytes"] == (
        260632 - 40960 - 61440 - 24576 + attention + sdpa + evict + 151552 + scratch + growth + archive
    )
    # dense: every token's K+V, and activations for all 1000 tokens at once
    assert p["dense"] == {
        "doc_tokens": 1000,
        "kv_bytes": 512000,
        "predicted_peak_bytes": 1000 + 4000 + 512000 + 1000 * (64 * 4 * 6 + 96 * 4 * 3) + 400,
    }
    assert "memory" not in p and "measured" not in p and "budget_split" not in p


def test_plan_counts_the_rotation_of_compact_positions() -> None:
    base = plan(_info(), _settings(), doc_tokens=1000)
    p = plan(_info(), _settings(positions="compact"), doc_tokens=1000)
    assert base["rotation_scratch_bytes"] == 0
    # rotated keys: 2 KV heads x 80 slots x 16 dims x 4 B; one step of those 80 tokens: float64 angles and
    # four float32 half-dimension terms, 12 B per dimension
    assert p["rotation_scratch_bytes"] == 2 * 80 * 16 * 4 + 2 * 80 * 16 * 12 == 40960
    assert p["predicted_peak_bytes"] == base["predicted_peak_bytes"] + 40960
    # a 16-bit key adds its float32 copy and result (8 B per dimension)
    half = plan(_info(dtype="bfloat16"), _settings(positions="compact"), doc_tokens=1000)
    assert half["rotation_scratch_bytes"] == 2 * 80 * 16 * 2 + 2 * 80 * 16 * 20
    # recall: a group holding its recalled tokens is re-packed whole (64 + 16 + 256 slots, in one step)
    r = plan(_info(), _settings(positions="compact", recall="auto"), doc_tokens=1000)
    assert r["rotation_scratch_bytes"] == 2 * 336 * 16 * 4 + 2 * 336 * 16 * 12
    a = plan(_info(), _settings(recall="auto"), doc_tokens=1000)
    assert r["predicted_peak_bytes"] == a["predicted_peak_bytes"] + r["rotation_scratch_bytes"]
    # auto positions rotate only past the model's range
    inside, past = (plan(_info(max_positions=m), _settings(positions="auto"), doc_tokens=1000) for m in (2000, 500))
    assert inside["rotation_scratch_bytes"] == 0 and past["rotation_scratch_bytes"] == 40960


def test_plan_agrees_with_predict_peak_and_real_weight_bytes() -> None:
    base = plan(_info(), _settings())
    ref = predict_peak(DIMS, num_params=1000, elem=4, budget_tokens=64, block_size=16, rows=16, n_fields=1)
    assert base["predicted_peak_bytes"] == ref["predicted_peak_bytes"]
    assert base["runtime_baseline_bytes"] == 0  # None: nothing measured (CUDA)
    # a loaded model's real bytes replace the formula's, everywhere
    real = plan(_info(weights_bytes=5000), _settings())
    assert real["weights_bytes"] == 5000
    assert real["predicted_peak_bytes"] == base["predicted_peak_bytes"] + 1000


def test_memory_limit_largest_budget_and_dense_max() -> None:
    limit = 400_000
    p = plan(_info(weights_bytes=9000), _settings(), memory=limit, runtime_baseline=2000)
    mem = p["memory"]
    assert mem["limit_bytes"] == limit and mem["fits"] is True
    best = mem["largest_budget_tokens"]
    at = plan(_info(weights_bytes=9000), _settings(budget=str(best)), runtime_baseline=2000)
    over = plan(_info(weights_bytes=9000), _settings(budget=str(best + 1)), runtime_baseline=2000)
    assert at["predicted_peak_bytes"] <= limit < over["predicted_peak_bytes"]
    n = mem["dense_max_tokens"]
    d_at = plan(_info(weights_bytes=9000), _settings(), doc_tokens=n, runtime_baseline=2000)["dense"]
    d_over = plan(_info(weights_bytes=9000), _settings(), doc_tokens=n + 1, runtime_baseline=2000)["dense"]
    assert d_at["predicted_peak_bytes"] <= limit < d_over["predicted_peak_bytes"]
    assert 0 < n and 0 < best  # measured against real reads at the largest budget: tests/test_plan_measured.py
    assert plan(_info(), _settings(), memory=1000)["memory"]["fits"] is False


def test_budget_bytes_are_converted_with_model_dims_and_dtype() -> None:
    p = plan(_info(), _settings(budget="40KiB"))
    assert p["budget_tokens"] == 40960 // 512 == 80
    assert p["budget_conversion"] == "budget 40KiB = 80 tokens per KV head (512 bytes of K+V per token in float32)"
    half = plan(_info(dtype="bfloat16"), _settings(budget="40KiB"))
    assert half["budget_tokens"] == 160 and "256 bytes of K+V per token in bfloat16" in half["budget_conversion"]
    tokens, _, note = resolve_budget_and_recall(_settings(budget="2k"), DIMS, torch.float32)
    assert (tokens, note) == (2048, None)


def test_full_policy_needs_a_length() -> None:
    s = _settings(policy="full")
    p = plan(_info(rows=0, n_fields=0), s)
    assert p["budget_tokens"] is None and p["kv_bytes_at_budget"] is None and p["predicted_peak_bytes"] is None
    q = plan(_info(rows=0, n_fields=0), s, doc_tokens=300)
    assert q["kv_bytes_at_budget"]["promised"] == 300 * 512 and q["predicted_peak_bytes"] > 0


# ---------------------------------------------------------------------------------------------
# the CLI on a tiny checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = tmp_path_factory.mktemp("profile") / "tiny-llama"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32,
        max_position_embeddings=4096,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(str(directory))
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="<|im_end|>")
    tok.chat_template = CHATML
    tok.save_pretrained(str(directory))
    return directory


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["profile", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _tiny_doc(tmp_path: Path, words: int) -> Path:
    doc = tmp_path / "doc.txt"
    vocab = WORDS[5:]
    doc.write_text(" ".join(vocab[i % len(vocab)] for i in range(words)) + "\n", encoding="utf-8")
    return doc


def test_cli_json_schema(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(
        capsys,
        "--model",
        str(tiny_dir),
        "--budget",
        "32KiB",
        "--block-size",
        "16",
        "--device",
        "cpu",
        "--memory",
        "64GiB",
        "--doc-tokens",
        "5000",
        "--policy",
        "keydiff",
        "--json",
        "--recall",
        "off",
        "--quiet",
    )
    assert code == 0, err
    assert err == ""
    p = json.loads(out)
    for key in (
        "model",
        "dtype",
        "budget_tokens",
        "budget_conversion",
        "kv_bytes_per_token",
        "kv_bytes_at_budget",
        "attention_scratch_bytes",
        "policy_state_bytes",
        "activation_bytes",
        "weights_bytes",
        "runtime_baseline_bytes",
        "predicted_peak_bytes",
        "dense",
        "memory",
    ):
        assert key in p, key
    assert p["model"] == "tiny-llama" and p["dtype"] == "float32" and p["policy"] == "keydiff"
    # 2 (K,V) x 16 dims x 4 B x 2 KV heads x 2 layers = 512 B per token: 32 KiB = 64 tokens per KV head
    assert p["kv_bytes_per_token"] == {"per_layer_per_head": 128, "per_layer": 256, "total": 512}
    assert p["budget_tokens"] == 64
    assert p["budget_conversion"] == "budget 32KiB = 64 tokens per KV head (512 bytes of K+V per token in float32)"
    assert p["kv_bytes_at_budget"] == {"promised": 64 * 512, "allocated": 80 * 512}
    dims = {
        "num_layers": 2,
        "num_kv_heads": 2,
        "num_attention_heads": 4,
        "head_dim": 16,
        "hidden_size": 64,
        "intermediate_size": 96,
        "vocab_size": 32,
    }
    assert p["num_params"] == llama_param_count(dims, tie_word_embeddings=False)
    assert p["weights_bytes"] == 4 * p["num_params"]
    assert p["runtime_baseline_bytes"] > 0  # CPU: measured RSS before the weights
    assert p["attention_scratch_bytes"] == 0  # keydiff reads no attention
    assert p["policy_state_bytes"] == 80 * 2 * 2 * 4  # its 1/‖k‖ per token: 80 slots x 2 KV heads x 2 layers, float32
    assert p["dense"]["doc_tokens"] == 5000 and p["dense"]["kv_bytes"] == 5000 * 512
    # The limit sits far above the measured baseline: a test process that has loaded the real model
    # (the full suite in CI) has an RSS above 1 GiB before this plan's weights.
    assert p["memory"]["limit_bytes"] == 64 * 1024**3 and p["memory"]["largest_budget_tokens"] > 64
    assert p["memory"]["dense_max_tokens"] > 0 and p["memory"]["fits"] is True
    assert "measured" not in p and "budget_split" not in p


def test_cli_text_prints_conversion_and_table(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(
        capsys,
        "--model",
        str(tiny_dir),
        "--budget",
        "32KiB",
        "--block-size",
        "16",
        "--device",
        "cpu",
        "--policy",
        "h2o",
        "--memory",
        "1GiB",
        "--quiet",
    )
    assert code == 0, err
    # recall (on by default) is held inside a byte budget: half of its 64 tokens recalled, half kept
    assert (
        "budget 32KiB = 32 tokens per KV head kept (16.0 KiB) + 32 recalled while answering (16.0 KiB; 512 "
        "bytes of K+V per token in float32)"
    ) in " ".join(out.split())
    for label in (
        "runtime baseline",
        "weights",
        "KV per token, per layer per head",
        "KV allocated",
        "attention scratch (policy)",
        "policy score state",
        "activations",
        "recall slots",
        "recall scratch",
        "predicted peak",
        "largest budget",
    ):
        assert label in out, label
    code, out, err = _run(
        capsys,
        "--model",
        str(tiny_dir),
        "--budget",
        "32KiB",
        "--block-size",
        "16",
        "--device",
        "cpu",
        "--policy",
        "h2o",
        "--recall",
        "off",
        "--quiet",
    )
    assert code == 0, err
    assert "budget 32KiB = 64 tokens per KV head (512 bytes of K+V per token in float32)" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--memory", "lots"], "size must be"),
        (["--doc-tokens", "0"], "--doc-tokens must be >= 1"),
        (["--budget", "3B"], "holds no token"),
        (["--budget", "many"], "budget must be"),
        (["--block-size", "0"], "--block-size must be >= 1: got 0"),
        (["--sinks", "-1"], "--sinks must be >= 0: got -1"),
        (["--doc", "/nonexistent/doc.txt"], "no such file"),
    ],
)
def test_cli_bad_values_are_one_line_usage_errors(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, out, err = _run(capsys, "--model", str(tiny_dir), "--device", "cpu", "--quiet", *args)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and message in err, err


def test_cli_razor_reports_budget_split(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVTOOL_HOME", str(tmp_path / "home"))  # the calibration is saved there
    code, out, err = _run(
        capsys,
        "--model",
        str(tiny_dir),
        "--budget",
        "64",
        "--block-size",
        "16",
        "--device",
        "cpu",
        "--policy",
        "razor",
        "--json",
        "--quiet",
    )
    assert code == 0, err
    p = json.loads(out)
    split = p["budget_split"]
    assert [row["layer"] for row in split] == [0, 1]
    for row in split:
        assert row["budget_tokens"] == 64 * 2 and row["total_tokens"] + row["unused_tokens"] == 128
    code, out, err = _run(
        capsys,
        "--model",
        str(tiny_dir),
        "--budget",
        "64",
        "--block-size",
        "16",
        "--device",
        "cpu",
        "--policy",
        "razor",
        "--quiet",
    )
    assert code == 0, err
    assert "razor budget split" in out


def test_measured_vs_predicted_tiny_model(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _tiny_doc(tmp_path, 600)
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
        "--policy",
        "h2o",
        "--doc",
        str(doc),
        "--json",
        "--quiet",
    )
    assert code == 0, err
    p = json.loads(out)
    m = p["measured"]
    print(
        f"\ntiny model: measured {m['peak_bytes']} B / predicted {p['predicted_peak_bytes']} B = "
        f"ratio {m['ratio']:.3f} (runtime baseline {p['runtime_baseline_bytes']} B dominates; "
        f"weights {p['weights_bytes']} B)"
    )
    assert m["document_tokens"] == 600 and m["seconds"] > 0
    assert m["metric"] == "rss_peak"
    assert m["kv_allocated_bytes"] == p["kv_bytes_at_budget"]["allocated"]  # formula == the real buffers
    assert m["ratio"] == pytest.approx(m["peak_bytes"] / p["predicted_peak_bytes"], rel=1e-3)
    assert 0.75 <= m["ratio"] <= 1.25
    assert p["dense"]["doc_tokens"] == 600  # with --doc and no --doc-tokens: the document read


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_counts_a_tied_embedding_once(tied: bool) -> None:
    """A tied output head is the input embedding: one parameter, counted once (as ``model.parameters()``
    does), as its bytes already were."""
    from kvtool.runtime.profiling import parameter_bytes
    from tests.helpers import tiny_llama

    model = tiny_llama(tie_word_embeddings=tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    count, stored = parameter_bytes(model)
    assert count == sum(p.numel() for p in model.parameters())
    assert stored == 4 * count


# ---------------------------------------------------------------------------------------------
# a config alone: counted as the model it describes, the same plan as with the weights

SMALL = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 32,
    "max_position_embeddings": 4096,
}
FAMILY_CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(
        **SMALL, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SMALL, head_dim=16, intermediate_size=96, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2
    ),
    "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=32, n_positions=1024),
}


@pytest.mark.parametrize("family", list(FAMILY_CONFIGS))
def test_a_config_alone_counts_every_parameter_of_the_model_it_describes(family, tmp_path, capsys):
    """A mixture of experts planned from its config was a dense Llama (its experts uncounted); the count is now the
    model's own, whatever the family: the oracle is the model built from the same config."""
    config = FAMILY_CONFIGS[family]()
    expected = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    config.save_pretrained(str(tmp_path / family))
    code, out, err = _run(capsys, "--model", str(tmp_path / family), "--device", "cpu", "--json", "--quiet")
    assert code == 0, err
    assert json.loads(out)["num_params"] == expected


def test_a_mixture_of_experts_is_planned_alike_with_and_without_its_weights(tiny_dir, tmp_path, capsys):
    weights, alone = tmp_path / "moe", tmp_path / "moe-config"
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(FAMILY_CONFIGS["mixtral"]()).save_pretrained(str(weights))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny_dir / name).exists():
            (weights / name).write_bytes((tiny_dir / name).read_bytes())
    alone.mkdir()
    (alone / "config.json").write_bytes((weights / "config.json").read_bytes())
    plans = []
    for directory in (weights, alone):
        code, out, err = _run(
            capsys,
            "--model",
            str(directory),
            "--device",
            "cpu",
            "--json",
            "--quiet",
            "--budget",
            "64",
            "--block-size",
            "16",
        )
        assert code == 0, err
        plans.append(json.loads(out))
    keys = ("num_params", "weights_bytes", "kv_bytes_per_token", "kv_bytes_at_budget", "budget_tokens")
    assert {k: plans[0][k] for k in keys} == {k: plans[1][k] for k in keys}


@pytest.mark.parametrize(
    "family, words",
    [
        ("rwkv", "names no num_attention_heads"),  # an RNN: no attention K/V to plan
        ("jamba", "layer type 'linear_attention' is not supported"),  # a hybrid: Mamba layers hold no K/V
        ("mllama", "cross-attention layers"),  # text-only, its cross-attention layers hold no cache
        ("t5", "not a causal language model"),
        ("deepseek_v3", "keys and values of different widths"),
    ],
)
def test_a_family_kvtool_cannot_plan_is_refused_from_its_config_alone(family, words, tmp_path, capsys):
    transformers.CONFIG_MAPPING[family]().save_pretrained(str(tmp_path / family))
    code, out, err = _run(capsys, "--model", str(tmp_path / family), "--device", "cpu", "--json")
    assert code == 2 and not out and err.count("\n") == 1 and words in err and "internal error" not in err, err
