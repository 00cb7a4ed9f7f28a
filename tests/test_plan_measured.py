"""The memory plan is a ceiling, measured: ``kvtool profile --doc`` reads real documents and answers a question about
each, and the measured peak is at most the plan's prediction and within 15 % of it.

Rows: budget 1K and 4K with recall off and on, a ``.kvc`` load, a document read after a recalling one in the same
cache, and the largest budget ``--memory`` says fits. The fast tier measures a tiny model's tensor allocations
(torch's CPU allocator, every allocation and free, ops' own work included); the slow tier the embedded SmolLM2-135M's
RSS in a fresh process, as a user runs ``kvtool profile``.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtool.cli.app import main
from tests.helpers import tensor_peak, tiny_checkpoint

WORDS = (
    "the cache keeps what the question needs while the reader moves on through chapters of letters numbers "
    "and names that a small model can read in blocks"
).split()
CORPUS = Path("/work/shared/corpus/sherlock_holmes.txt")
#: the measured peak may fall below the plan by at most this factor: a ceiling, not a guess far above
CLOSE = 1.15


def _text(words: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] + ("." if i % 13 == 12 else "") for i in range(words)) + "\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plan-measured")
    docs = {}
    for name, words, seed in (("a", 1400, 1), ("b", 1300, 2)):  # ~5K tokens each: past a 4K budget
        docs[name] = root / f"{name}.txt"
        docs[name].write_text(_text(words, seed), encoding="utf-8")
    return {"model": tiny_checkpoint(root / "model", layers=4), **docs, "root": root}


def _profile(*args: str) -> tuple[dict, dict[str, int]]:
    """``kvtool profile`` in this process, its tensor allocations tracked from before the model loads."""
    out = io.StringIO()
    with tensor_peak() as tracked, contextlib.redirect_stdout(out):
        code = main(["profile", "--device", "cpu", "--json", "--quiet", "--max-new-tokens", "24", *args])
    assert code == 0
    return json.loads(out.getvalue()), tracked


def _check(p: dict, measured: int, label: str) -> None:
    predicted, base = p["predicted_peak_bytes"], p["runtime_baseline_bytes"]
    print(
        f"\n{label}: measured {measured / 2**20:.2f} MiB, predicted {predicted / 2**20:.2f} MiB "
        f"(measured/predicted {measured / predicted:.3f}; above the runtime baseline of {base / 2**20:.1f} MiB: "
        f"{(measured - base) / 2**20:.2f} against {(predicted - base) / 2**20:.2f} MiB)"
    )
    assert measured <= predicted, label
    assert predicted <= CLOSE * measured, label


ROWS = [("1k", "off"), ("1k", "256"), ("4k", "off"), ("4k", "256")]


@pytest.mark.parametrize(("budget", "recall"), ROWS)
def test_tiny_model_reads_and_answers_within_its_plan(tiny, budget, recall):
    """The peak of every tensor the run allocates (the weights included) on top of the runtime baseline: at most
    the plan, within 15 %; and the plan's working set (all but the baseline) is a ceiling of the tracked one."""
    p, tracked = _profile(
        "--model", str(tiny["model"]), "--budget", budget, "--recall", recall, "--doc", str(tiny["a"])
    )
    m = p["measured"]
    assert m["document_tokens"] > 4096 + 256 and m["documents"][0]["answer_tokens"] > 0
    if recall != "off":
        assert m["documents"][0]["recalled_tokens"] > 0  # recall ran: its slots and scoring are in the peak
    assert m["kv_allocated_bytes"] == p["kv_bytes_at_budget"]["allocated"]
    _check(p, p["runtime_baseline_bytes"] + tracked["peak"], f"tiny, budget {budget}, recall {recall}")


def test_tiny_model_kvc_load_and_a_document_after_a_recalling_one(tiny):
    kvc = tiny["root"] / "a.kvc"
    settings = ["--model", str(tiny["model"]), "--budget", "1k", "--recall", "256", "--device", "cpu"]
    assert main(["prefill", str(tiny["a"]), "-o", str(kvc), *settings, "-q"]) == 0
    p, tracked = _profile(*settings, "--doc", str(kvc))
    assert p["measured"]["documents"][0]["loaded_from"] == str(kvc)
    _check(p, p["runtime_baseline_bytes"] + tracked["peak"], "tiny, .kvc load, recall 256")
    p, tracked = _profile(*settings, "--doc", str(tiny["a"]), "--doc", str(tiny["b"]))
    first, second = p["measured"]["documents"]
    assert first["recalled_tokens"] > 0 and second["document_tokens"] > 4096
    _check(p, p["runtime_baseline_bytes"] + tracked["peak"], "tiny, a document after a recalling one")


def test_tiny_model_largest_budget_that_fits_runs_within_the_memory(tiny):
    """``--memory M``'s largest budget (searched by ``kvtool profile`` in a fresh process, on its own runtime
    baseline), read and answered: that baseline plus the tensors the run allocates is within M."""
    model = ["--model", str(tiny["model"]), "--recall", "256", "--doc", str(tiny["a"])]
    first = _fresh_profile(*model, "--budget", "1k")
    limit = first["predicted_peak_bytes"] + (8 << 20)
    fit = _fresh_profile(*model, "--budget", "1k", "--memory", f"{limit}B")
    budget, baseline = fit["memory"]["largest_budget_tokens"], fit["runtime_baseline_bytes"]
    assert budget > 1024
    p, tracked = _profile(*model, "--budget", str(budget))
    measured = baseline + tracked["peak"]
    predicted = p["predicted_peak_bytes"] - p["runtime_baseline_bytes"] + baseline
    print(
        f"\nlargest budget in {limit / 2**20:.1f} MiB: {budget} tokens, measured {measured / 2**20:.2f} MiB, "
        f"predicted {predicted / 2**20:.2f} MiB"
    )
    assert measured <= predicted <= limit


def _fresh_profile(*args: str) -> dict:
    code = "import sys; from kvtool.cli.app import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "profile",
            "--device",
            "cpu",
            "--json",
            "--quiet",
            "--max-new-tokens",
            "24",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def sherlock(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if not CORPUS.is_file():
        pytest.skip(f"corpus not found: {CORPUS}")
    text = CORPUS.read_text(encoding="utf-8")
    root = tmp_path_factory.mktemp("sherlock")
    docs = {"2k": (20000, 28500), "5k": (40000, 61000), "5k-b": (70000, 91000)}
    out = {}
    for name, (a, b) in docs.items():
        out[name] = root / f"{name}.txt"
        out[name].write_text(text[a:b], encoding="utf-8")
    out["root"] = root
    return out


@pytest.mark.real_model
@pytest.mark.parametrize(
    ("budget", "recall", "doc"), [("1k", "off", "2k"), ("1k", "auto", "2k"), ("4k", "off", "5k"), ("4k", "auto", "5k")]
)
def test_smollm2_reads_and_answers_within_its_plan(sherlock, budget, recall, doc):
    """The embedded SmolLM2-135M in a fresh process: RSS peak (the meter of every command) against the plan."""
    p = _fresh_profile("--budget", budget, "--recall", recall, "--doc", str(sherlock[doc]))
    m = p["measured"]
    assert m["metric"] == "rss_peak" and m["kv_allocated_bytes"] == p["kv_bytes_at_budget"]["allocated"]
    _check(p, m["peak_bytes"], f"SmolLM2-135M, budget {budget}, recall {recall}, {m['document_tokens']} tokens")


@pytest.mark.real_model
def test_smollm2_kvc_load_and_a_document_after_a_recalling_one(sherlock):
    kvc = sherlock["root"] / "5k.kvc"
    code = "import sys; from kvtool.cli.app import main; sys.exit(main(sys.argv[1:]))"
    subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "prefill",
            str(sherlock["5k"]),
            "-o",
            str(kvc),
            "--budget",
            "4k",
            "--device",
            "cpu",
            "-q",
        ],
        check=True,
        timeout=1800,
    )
    p = _fresh_profile("--budget", "4k", "--doc", str(kvc))
    _check(p, p["measured"]["peak_bytes"], "SmolLM2-135M, .kvc load, budget 4k")
    p = _fresh_profile("--budget", "4k", "--doc", str(sherlock["5k"]), "--doc", str(sherlock["5k-b"]))
    assert p["measured"]["documents"][0]["recalled_tokens"] > 0
    _check(p, p["measured"]["peak_bytes"], "SmolLM2-135M, budget 4k, a document after a recalling one")


@pytest.mark.real_model
def test_bench_prefill_cpu_row_is_measured_against_the_plan_with_its_runtime_baseline():
    """``bench/prefill.py`` on a CPU compares a row's RSS peak with the plan ``kvtool profile`` would print: the
    runtime baseline (the warm process less its weights) included, so that the comparison is the CLI's, not a plan
    short by Python, torch and the tokenizer."""
    spec = {"model": None, "config": None, "device": "cpu", "dtype": "auto", "budget": 256, "block_size": 128,
            "decode_tokens": 0, "threads": 1, "layers": None, "kind": "ask", "policy": "h2o", "length": 1024}
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "bench" / "prefill.py"), "--run-one", json.dumps(spec)],
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["runtime_baseline_bytes"] > 100 * 2**20  # Python, torch, transformers and the tokenizer at least
    _check(row, row["peak_bytes"], "bench/prefill.py, SmolLM2-135M ask row, 1,024 tokens")
    # without its baseline the plan would sit below the measured peak: the baseline is what it was missing
    assert row["predicted_peak_bytes"] - row["runtime_baseline_bytes"] < row["peak_bytes"]


#: tiny configs with a real model's proportions (the MLP 3.5× the hidden size, as Llama 3's), one KV head; 6 layers
#: are Gemma 3's 5 sliding layers to a global one
DENSE_SHAPES = {"hidden_size": 128, "intermediate_size": 448, "num_hidden_layers": 6, "num_attention_heads": 4,
                "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 512, "max_position_embeddings": 16384}


@pytest.mark.parametrize("family", ["LlamaConfig", "MistralConfig", "Gemma3TextConfig", "Gemma2Config"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dense_one_forward_plan_holds_the_mask_a_sliding_model_is_given(family, dtype):
    """The dense plan against torch's CPU allocator over one transformers prefill of 8,192 tokens (4,096 for Gemma
    2): a model with sliding layers (Mistral's window, Gemma 3's and Gemma 2's sliding layers: 256 tokens) is
    given a boolean mask that SDPA copies into the compute dtype, and softcapped Gemma 2 attends eagerly, holding
    every head's scores (5–39× the plan before it counted them, at these shapes); Llama gets ``is_causal`` and
    no mask. Weights are outside both sides."""
    import torch
    import transformers

    from kvtool.runtime.memory import dense_peak, dims_from_config, weights_bytes

    n = 4096 if family == "Gemma2Config" else 8192
    config = getattr(transformers, family)(**DENSE_SHAPES, **({} if family == "LlamaConfig" else
                                                              {"sliding_window": 256}))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).eval()
    # transformers' own choice, as a plain call gets it: SDPA, but eager for softcapped Gemma 2
    assert model.config._attn_implementation == ("eager" if family == "Gemma2Config" else "sdpa")
    elem = 2 if dtype == "bfloat16" else 4
    params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), tensor_peak() as measured:
        model(ids, use_cache=True, logits_to_keep=1)  # the model's own DynamicCache, as a plain call makes
    dims = dims_from_config(config)
    assert bool(dims.get("sliding_layers")) == (family != "LlamaConfig")
    predicted = dense_peak(dims, n, num_params=params, elem=elem) - weights_bytes(params, elem)
    print(f"\n{family} {dtype}: measured {measured['peak'] / 2**20:.1f} MiB, predicted {predicted / 2**20:.1f} MiB")
    assert measured["peak"] <= predicted <= CLOSE * measured["peak"]
