"""Real-shape random models and the GPU measurements of ``bench/prefill.py`` (``--config``, ``scripts/gpu-check.sh``).

* ``CONFIGS``: shapes of real models (from their published config.json files, written here: nothing is
  downloaded). ``config_model`` builds one on the meta device and materialises it on the target device in
  bfloat16 (no float32 copy, no host copy on CUDA), then initialises it there (``init_weights``: random
  weights, RoPE buffers recomputed). ``layers`` overrides the depth, so the 8B shape can be smoke-tested on
  a CPU with one or two layers.
* ``SdpaProbe`` counts the SDPA calls that only the math backend could serve: every call first runs with
  the math backend disabled (``torch.nn.attention.sdpa_kernel``); a call no efficient kernel accepts
  raises before computing, is counted, and runs again with math allowed. CUDA only (on CPU: n/a).
* ``gpu_targets``: the ratios a GPU run is judged by (printed, not asserted).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any

# "class" is the transformers config class; every other key is passed to it.
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
CONFIGS: dict[str, dict] = {
    "llama-3.1-8b": {"class": "LlamaConfig", "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "vocab_size": 128256, "max_position_embeddings": 131072, "rope_scaling": _LLAMA3_ROPE},
    "llama-3.2-1b": {"class": "LlamaConfig", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                     "max_position_embeddings": 131072, "tie_word_embeddings": True,
                     "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0}},
    "qwen3-8b": {"class": "Qwen3Config", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                 "max_position_embeddings": 40960, "rope_theta": 1000000.0},
    "qwen3-0.6b": {"class": "Qwen3Config", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                   "max_position_embeddings": 40960, "rope_theta": 1000000.0, "tie_word_embeddings": True},
    "qwen2.5-0.5b": {"class": "Qwen2Config", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                     "max_position_embeddings": 32768, "rope_theta": 1000000.0, "tie_word_embeddings": True},
    "mistral-7b-v0.1": {"class": "MistralConfig", "hidden_size": 4096, "intermediate_size": 14336,
                        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                        "vocab_size": 32000, "max_position_embeddings": 32768, "sliding_window": 4096},
    "phi-3-mini": {"class": "Phi3Config", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064,
                   "max_position_embeddings": 4096, "sliding_window": 2047, "pad_token_id": 32000},
    "gemma-2-9b": {"class": "Gemma2Config", "hidden_size": 3584, "intermediate_size": 14336, "num_hidden_layers": 42,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 256000,
                   "max_position_embeddings": 8192, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
                   "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 256},
    "gemma-3-12b": {"class": "Gemma3TextConfig", "hidden_size": 3840, "intermediate_size": 15360,
                    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
                    "vocab_size": 262208, "max_position_embeddings": 131072, "sliding_window": 1024,
                    "query_pre_attn_scalar": 256,
                    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0,
                                                           "factor": 8.0}}},
    "gemma-3-1b": {"class": "Gemma3TextConfig", "hidden_size": 1152, "intermediate_size": 6912,
                   "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                   "vocab_size": 262144, "max_position_embeddings": 32768, "sliding_window": 512,
                   "query_pre_attn_scalar": 256,
                   "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                       "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}},
}


def config_model(name: str, device_spec: str, dtype_spec: str, layers: int | None = None):
    """A randomly initialised model of ``CONFIGS[name]``'s shape: built on meta, materialised on the device.

    ``dtype_spec`` ``auto`` means bfloat16 here (the dtype these models are served in); ``layers`` keeps only
    the first ``layers`` layers (Gemma's ``layer_types`` are cut to match).
    """
    import torch
    import transformers

    from kvtool.runtime.model import resolve_device, resolve_dtype

    spec = dict(CONFIGS[name])
    cls = getattr(transformers, spec.pop("class"))
    device = resolve_device(device_spec)
    dtype = torch.bfloat16 if dtype_spec == "auto" else resolve_dtype(dtype_spec, device)
    if layers is not None:
        spec["num_hidden_layers"] = layers
    config = cls(**spec)
    if layers is not None and getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()  # random weights on the device; RoPE inv_freq recomputed (to_empty left it garbage)
    model.eval().requires_grad_(False)
    return model, device


def timed(fn, cuda: bool) -> float:
    """Seconds of one call of ``fn`` (CUDA events on a GPU, so launches queue as they would in a read)."""
    import torch

    if not cuda:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000


def random_ids(vocab: int, n: int, seed: int = 0):
    import torch

    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def planned_peak(model, spec: dict, runtime_baseline: int = 0) -> int | None:
    """The peak ``kvtool profile`` predicts for a row (``kvtool.runtime.profiling.plan``): a kvtool row's
    budgeted run (an ``ask`` row with recall's slots), or dense transformers on the row's document.
    ``runtime_baseline``: the process's bytes besides the model's (``profiling.warm_baseline`` on a CPU, whose
    rows report RSS; 0 on CUDA, whose allocator's peak knows no CUDA context). None for the chunked rows, which
    the plan has no line for."""
    from kvtool.core.engine import EngineConfig, model_env
    from kvtool.policies import build_policy
    from kvtool.runtime.memory import dims_from_config
    from kvtool.runtime.profiling import ModelInfo, dtype_name, plan
    from kvtool.runtime.settings import Settings

    if spec["kind"] == "chunked":
        return None
    params = list(model.parameters())
    policy_name = spec.get("policy") or "h2o"
    block = spec["block_size"]
    budget = spec["budget"]
    policy = build_policy(policy_name, {}, model_env(model, EngineConfig(budget=budget, block_size=block)))
    dtype = next(iter(params)).dtype
    info = ModelInfo(name=spec.get("config") or "model", dims=dims_from_config(model.config),
                     num_params=sum(p.numel() for p in params),
                     dtype=dtype_name(dtype), weights_bytes=sum(p.numel() * p.element_size() for p in params),
                     device=str(params[0].device), policy=policy.spec,
                     rows=min(max(int(policy.query_rows(block)), 0), block),
                     n_fields=len(tuple(policy.state_fields)),
                     max_positions=getattr(model.config.get_text_config(), "max_position_embeddings", None))
    settings = Settings(policy=policy_name, budget=str(budget), block_size=block,
                        recall="auto" if spec["kind"] == "ask" else "0", archive_dtype="int8")
    out = plan(info, settings, doc_tokens=spec["length"], runtime_baseline=runtime_baseline)
    if spec["kind"] == "dense":
        return int(out["dense"]["predicted_peak_bytes"])
    return int(out["predicted_peak_bytes"])


#: dense bf16 tensor-core peaks (TFLOP/s, no sparsity) by a substring of ``torch.cuda.get_device_name``, most specific
#: first: the denominator of the MFU column (``--peak-tflops`` overrides; an unknown card falls back to the measured
#: bf16 matmul roofline, and the column says so)
PEAK_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("GH200", 989.0),
               ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0), ("A10", 125.0))


def nominal_peak(device_name: str) -> float | None:
    """The card's dense bf16 peak in FLOP/s, None when the name is not in ``PEAK_TFLOPS``."""
    for key, tflops in PEAK_TFLOPS:
        if key in device_name:
            return tflops * 1e12
    return None


def attended_pairs(kind: str, n: int, block: int, budget: int) -> int:
    """(query, key) pairs a row's prefill attends to, summed over its ``n`` queries: a causal triangle for dense and
    chunked transformers; for a bounded cache, each block's queries over at most ``budget`` kept tokens (a full
    cache: evicted down to the budget after every block) plus the block's own causal triangle."""
    if kind in ("dense", "chunked"):
        return n * (n + 1) // 2
    pairs = 0
    for s in range(0, n, block):
        m = min(block, n - s)
        pairs += m * min(s, budget) + m * (m + 1) // 2
    return pairs


def window_pairs(n: int, window: int) -> int:
    """(query, key) pairs a sliding-window layer attends to over ``n`` queries: each sees at most ``window`` keys
    (itself and the ``window - 1`` before it), however the prefill is cut into blocks."""
    if n <= window:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def model_flops(model, kind: str, n: int, block: int, budget: int) -> int:
    """The prefill's model FLOPs (MFU's numerator): 2 per weight of the decoder layers' matrices per token (the
    embedding lookup and the one logits row left out) + 4 · head dim per attended (query, key) pair and query head
    (QKᵀ and PV): a global layer's pairs are the row's own (``attended_pairs``), a sliding-window layer's those of
    its window for every row (``window_pairs``: dense transformers' mask skips the same pairs). Work a row does
    beyond the model's (H2O's statistic, eviction, the masked scores a kernel computes anyway) is not counted: it
    is what makes a row's MFU lower."""
    from kvtool.runtime.memory import dims_from_config

    dims = dims_from_config(model.config)
    linear = sum(p.numel() for name, p in model.named_parameters() if ".layers." in name and p.dim() == 2)
    sliding = dims.get("sliding_layers", 0)
    pairs = (dims["num_layers"] - sliding) * attended_pairs(kind, n, block, budget)
    if sliding:
        pairs += sliding * window_pairs(n, dims["sliding_window"])
    return 2 * linear * n + 4 * dims["head_dim"] * dims["num_attention_heads"] * pairs


def model_bytes(model) -> dict[str, int]:
    """Weight bytes and K/V bytes per cached token (all layers, keys and values) of a loaded model."""
    c = model.config.get_text_config()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    elt = next(model.parameters()).element_size()
    return {"weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "kv_bytes_per_token": 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * elt}


class SdpaProbe:
    """Counts SDPA calls that needed the math backend (see the module docstring); a no-op off CUDA."""

    def __init__(self, device, enabled: bool = True) -> None:
        # every probed call enters a backend switch and a warnings context: host time the timed rows would pay
        self.active = enabled and device.type == "cuda"
        self.calls = 0
        self.math = 0
        self.reason: str | None = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> SdpaProbe:
        if self.active:
            import torch.nn.functional as F

            self._stack.enter_context(_patched(F, "scaled_dot_product_attention", self._wrap(
                F.scaled_dot_product_attention)))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def _wrap(self, original):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        efficient = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]

        def probed(*args, **kwargs):
            self.calls += 1
            try:
                with warnings.catch_warnings(), sdpa_kernel(efficient):
                    warnings.simplefilter("ignore")
                    return original(*args, **kwargs)
            except RuntimeError:
                self.math += 1
                if self.reason is None:
                    self.reason = _why_not_efficient(original, args, kwargs, efficient)
                with sdpa_kernel([SDPBackend.MATH]):
                    return original(*args, **kwargs)

        return probed

    def result(self) -> dict[str, Any]:
        if not self.active:
            return {"sdpa_calls": None, "math_calls": None, "math_share": None}
        share = self.math / self.calls if self.calls else 0.0
        return {"sdpa_calls": self.calls, "math_calls": self.math, "math_share": share, "math_reason": self.reason}


@contextlib.contextmanager
def _patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _why_not_efficient(original, args, kwargs, efficient) -> str:
    """torch's own warnings for one call that no efficient kernel took (its reasons, one line)."""
    from torch.nn.attention import sdpa_kernel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with contextlib.suppress(RuntimeError), sdpa_kernel(efficient):
            original(*args, **kwargs)
    text = " | ".join(str(w.message).splitlines()[0] for w in caught) or "no efficient kernel"
    return text[:400]


def gpu_targets(rows: list[dict], budget: int, report, find) -> None:
    """The GPU run's targets (ratios; ``report(name, value, target, higher_is_better)`` prints each)."""
    pols = sorted({(r["kind"], r.get("tag") or r["policy"]) for r in rows if r["kind"] in ("kvtool", "ask")})
    n4, n128 = 4096, 131072
    for kind, p in pols:
        label = f"{kind}:{p}"
        for n in sorted({r["length"] for r in rows}):
            r = find(rows, kind, n, p)
            if r and r.get("predicted_peak_bytes") and str(r.get("device", "")).startswith("cuda"):
                report(f"peak allocated / the plan's prediction at {n // 1024}K, {label}",
                       r["peak_bytes"] / r["predicted_peak_bytes"], 1.10, higher_is_better=False)
        r, c = find(rows, kind, n4, p), find(rows, "chunked", n4)
        if r and c and r.get("block_size") == c.get("block_size"):
            report(f"4K prefill vs transformers' chunked prefill (same block), {label}",
                   c["prefill_seconds"] / r["prefill_seconds"], 0.9)
        r, d = find(rows, kind, n128, p), find(rows, "dense", n128)
        if r and d:
            report(f"128K prefill vs dense SDPA, {label}", d["prefill_seconds"] / r["prefill_seconds"], 2.0)
        elif r:
            print(f"  n/a  128K prefill vs dense SDPA, {label}: no dense 128K row (did not fit, or not run)")
        c4 = find(rows, "chunked", n4)
        if r and c4 and "weight_bytes" in r:
            act = max(0, c4["peak_bytes"] - c4["weight_bytes"] - c4["kv_bytes_per_token"] * n4)
            bound = r["weight_bytes"] + r["kv_bytes_per_token"] * (budget + r["block_size"]) + act
            report(f"peak allocated 128K / (weights + budget KV + one block's activations), {label}",
                   r["peak_bytes"] / bound, 1.10, higher_is_better=False)
        floor = find(rows, "dense", budget)
        if r and floor and all(x.get("decode_tokens") and x.get("decode_seconds") for x in (r, floor)):
            report(f"decode after 128K at budget {budget} / transformers' decode after {budget} tokens, {label}",
                   (r["decode_tokens"] / r["decode_seconds"]) / (floor["decode_tokens"] / floor["decode_seconds"]),
                   0.95)
    compute_limit_targets(rows, report, find)
    shares = [(row_name(r), r.get("math_share")) for r in rows if "error" not in r]
    if shares:
        print("  math-backend share of SDPA calls: " + ", ".join(
            f"{name} {'n/a' if s is None else f'{s:.1%}'}" for name, s in shares))


def row_name(r: dict) -> str:
    kind = r["kind"] if r["kind"] in ("dense", "chunked") else f"{r['kind']}:{r.get('tag') or r['policy']}"
    return f"{r['length'] // 1024}K {kind}" if r["length"] % 1024 == 0 else f"{r['length']} {kind}"


def compute_limit_targets(rows: list[dict], report, find) -> None:
    """The default ``ask`` path against dense SDPA, ``sink`` and its own 4K rate, its statistic's share, its
    question: the GPU targets of a prefill at the compute limit (each printed where its rows exist)."""
    lengths = sorted({r["length"] for r in rows})
    for n in lengths:
        ask, dense, sink = find(rows, "ask", n, "h2o"), find(rows, "dense", n), find(rows, "kvtool", n, "sink")
        label = f"{n // 1024}K"
        if ask and dense and n == 32768:
            report(f"{label} prefill, default ask / dense SDPA", dense["prefill_seconds"] / ask["prefill_seconds"], 1.0)
        if ask and sink:
            report(f"{label} prefill, default ask (h2o + recall) / sink",
                   sink["prefill_seconds"] / ask["prefill_seconds"], 0.9)
        if sink and sink.get("mfu") is not None and n == 32768:
            report(f"{label} prefill MFU, sink", sink["mfu"], 0.5)
        if ask and "split_seconds" in ask:
            sp = ask["split_seconds"]
            forward = ask["prefill_seconds"] - sp["probs"] - sp["score"] - sp["evict"]
            report(f"{label} H2O's statistic / the block's forward, default ask", sp["probs"] / max(forward, 1e-12),
                   0.10, higher_is_better=False)
        if ask and "question_seconds" in ask and n in (32768, 131072):
            report(f"{label} question, end of the read to its first token, default ask", ask["question_seconds"],
                   0.5 if n == 32768 else 1.5, higher_is_better=False, unit=" s")
    for kind, tag in sorted({(r["kind"], r.get("tag") or r["policy"]) for r in rows if r["kind"] in ("kvtool", "ask")}):
        base = find(rows, kind, 4096, tag)
        for n in (x for x in lengths if x > 4096):
            r = find(rows, kind, n, tag)
            if base and r:
                ratio = (n / r["prefill_seconds"]) / (4096 / base["prefill_seconds"])
                report(f"tok/s {n // 1024}K / 4K = {ratio:.3f}, distance from flat, {kind}:{tag}", abs(ratio - 1), 0.10,
                       higher_is_better=False)
