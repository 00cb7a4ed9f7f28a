"""Memory formulas: the plan's lines, one set shared by ``kvtool profile``, byte budgets and run statistics.

What a token, a slot, a layer and a block cost comes from ``kvtool/core/costs.py`` (the engine reads it too);
``memory_cache.py`` prices the cache with it (K/V at a budget, positions, the snapshot, an eviction, recall's
slots), this module the scratch of a block's forward, of recall's scoring, of coded K/V, and sums the peak
(``predict_peak``). So the numbers a profile promises, the budget a
"--budget 2GiB" turns into, and the prediction printed next to a run's measured peak cannot disagree.

All functions work on a ``dims`` dict (see ``dims_from_config``) with the keys ``num_layers``,
``num_kv_heads``, ``num_attention_heads``, ``head_dim``, ``hidden_size``, ``intermediate_size`` and
``vocab_size``. Element sizes (``elem``) may be a ``torch.dtype`` or its size in bytes. Everything is
an estimate of *steady-state* peaks for batch size 1; constants are documented where they appear.

Hybrid models (Gemma 2/3, Mistral and Phi-3 configs with a sliding window) add ``sliding_layers`` and
``sliding_window`` to ``dims``: a sliding layer holds ``min(W - 1, budget)`` tokens per KV head
(``core/families.py``), only the other layers hold the budget. Softcapped models (Gemma 2) add
``softcap``: their attention always computes every row's probabilities explicitly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from kvtool.config import (
    KV_WINDOW_TOKENS,
    QUANT_BYTES_PER_PARAM,
    ROTATE_CHUNK,
    SCAN_BYTES,
    SCAN_CHUNK,
    SCORE_BYTES,
    batch_split,
    probs_chunk_rows,
)
from kvtool.core.costs import coded_kv, dtype_bytes
from kvtool.core.layout import layer_kinds
from kvtool.runtime.memory_cache import (
    cache_parts,
    kv_bytes_per_token,
    layer_split,
    recall_parts,
    snapshot_bytes,
    snapshot_copy_bytes,
)

DIM_KEYS: tuple[str, ...] = (
    "num_layers",
    "num_kv_heads",
    "num_attention_heads",
    "head_dim",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
)

#: Hidden-sized tensors alive at once for each token of a block: residual stream, normed input,
#: query projection, attention output, o_proj output and the next residual (K/V projections are
#: smaller under GQA and go straight into the cache). A deliberately round upper estimate.
HIDDEN_TENSORS = 6
#: Intermediate-sized MLP tensors alive at once per token: gate, up and act(gate) * up.
INTERMEDIATE_TENSORS = 3
#: Logits are taken as float32 (sampling and log-softmax upcast them), whatever the model dtype.
LOGITS_BYTES = 4
#: Attention probabilities a policy asks for are float32: scores plus their softmax.
PROBS_COPIES = 2
#: GPU memory a CUDA process holds outside torch's allocator (the context, its kernels, cuBLAS's workspace):
#: the allocator's peak, which the plan predicts, does not see it; what fits on a card leaves it free.
#: Measured 685 MiB on an H200 (CUDA 13.0, torch 2.11, after one bf16 product), with headroom for other builds.
CUDA_RUNTIME_BYTES = 768 * 2**20
#: The question a plan assumes recall scores with (its own tokens, not the chat template's): its queries are
#: held while the archive is scored (``recall_scratch_bytes``; a longer question adds its per-token share).
PLANNED_QUESTION_TOKENS = 256
Dims = Mapping[str, int]


def dims_from_config(config: Any) -> dict[str, int]:
    """Build ``dims`` from a transformers config (multimodal configs: their text config).

    ``head_dim`` is ``config.head_dim`` when the config sets it (Gemma, Qwen3 decouple it from the
    hidden size), else hidden_size // num_attention_heads. Missing KV heads mean plain multi-head
    attention; a missing intermediate size (GPT-2's ``n_inner=None``) means 4 x hidden.
    """
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        config = get_text()
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    dims = {
        "num_layers": int(config.num_hidden_layers),
        "num_kv_heads": int(kv_heads),
        "num_attention_heads": heads,
        "head_dim": int(head_dim),
        "hidden_size": hidden,
        "intermediate_size": int(intermediate),
        "vocab_size": int(config.vocab_size),
    }
    kinds = layer_kinds(config, None)
    if kinds["sliding_layers"]:
        dims["sliding_layers"] = kinds["sliding_layers"]
        dims["sliding_window"] = kinds["sliding_window"]
    if getattr(config, "attn_logit_softcapping", None):
        dims["softcap"] = 1
    return dims


def llama_param_count(dims: Dims, tie_word_embeddings: bool) -> int:
    """Parameters of a Llama-style decoder (no biases, RMSNorm, gated MLP) from its ``dims``.

    Used to write profiles' expected memory from architecture numbers alone; for a loaded model
    count ``model.parameters()`` instead.
    """
    hidden, d = dims["hidden_size"], dims["head_dim"]
    attn = hidden * dims["num_attention_heads"] * d * 2 + hidden * dims["num_kv_heads"] * d * 2
    mlp = 3 * hidden * dims["intermediate_size"]
    per_layer = attn + mlp + 2 * hidden
    embeddings = dims["vocab_size"] * hidden * (1 if tie_word_embeddings else 2)
    return dims["num_layers"] * per_layer + hidden + embeddings


def embedding_params(dims: Dims, tie_word_embeddings: bool) -> int:
    """Parameters of the input embedding and LM head, which quantization leaves unquantized."""
    return dims["vocab_size"] * dims["hidden_size"] * (1 if tie_word_embeddings else 2)


# ---------------------------------------------------------------------------------------------
# scratch (the cache's own lines are in memory_cache.py)
# ---------------------------------------------------------------------------------------------


def compact_positions(positions: str, max_positions: int | None = None, doc_tokens: int | None = None) -> bool:
    """Whether a run's keys move to compact positions (``CompactPositions``) and are rotated there:
    ``positions="compact"`` from the first token, ``"auto"`` once the stream passes ``max_positions``
    (never when the model states no range). With ``"auto"`` an unknown document length counts as
    passing: a plan must not under-count."""
    if positions == "compact":
        return True
    if positions == "auto" and max_positions is not None:
        return doc_tokens is None or doc_tokens > max_positions
    return False


def keeps_original_keys(elem: Any, positions: str, max_positions: int | None = None,
                        doc_tokens: int | None = None, kv_dtype: str = "auto") -> bool:
    """Whether a run keeps each key's original copy beside its rotated one (``HeadGroup.keep_origin``).

    The cache does so for a 16-bit K/V dtype (bf16, fp16) once keys sit at compact positions, so that
    re-packing rotates from the model's own key and rounds once: ``positions="compact"`` from the first
    token, ``"auto"`` once the stream passes ``max_positions`` (never when the model states no range).
    With ``"auto"`` an unknown document length counts as passing: a plan must not under-count.
    int8 / int4 K/V (``kv_dtype``) keep a quantized copy; a float ``kv_dtype`` decides by its own size.
    """
    stored = dtype_bytes(elem) if kv_dtype == "auto" else 1 if kv_dtype in ("int8", "int4") else dtype_bytes(kv_dtype)
    return stored < 4 and compact_positions(positions, max_positions, doc_tokens)


def attention_scratch_bytes(dims: Dims, block: int, budget: int, rows: int, rows_summed: bool = False) -> int:
    """float32 attention probabilities a policy asked for, one layer at a time.

    ``rows`` query rows x (budget + block) keys x attention heads, scores plus softmax output.
    ``rows = 0`` (policies that never look at attention) costs nothing. A policy that reads every row only
    summed (``rows_summed``: H2O) gets them in chunks of ``probs_chunk_rows`` rows (``core/attention.py``).
    SDPA's own temporaries are counted separately by ``sdpa_scratch_bytes`` (``predict_peak`` adds both).
    """
    if dims.get("softcap"):  # SDPA cannot softcap: every row's probabilities are computed
        rows = block
    if rows <= 0:
        return 0
    rows = min(rows, block)
    keys, heads = budget + block, dims["num_attention_heads"]
    if rows_summed and rows == block:
        rows = min(rows, probs_chunk_rows(heads, keys))
    return PROBS_COPIES * rows * keys * heads * 4


def head_split_bytes(dims: Dims, elem: Any, keys: int, block: int, threads: int | None = None) -> int:
    """The copies of one layer's K (float32) and V a CPU's explicit attention multiplies against when its KV heads
    do not divide among the threads (``kvtool/config.py``'s ``batch_split``, for a block's rows): 0 when they do."""
    if threads is None:
        import torch  # the threads this process's matmuls use (imported here: an error path loads no torch)

        threads = torch.get_num_threads()
    heads = dims["num_kv_heads"]
    parts = batch_split(heads, threads, dims["num_attention_heads"] // heads * block)
    if parts == 1:
        return 0
    return heads * parts * keys * dims["head_dim"] * (4 + dtype_bytes(elem))


def sdpa_scratch_bytes(dims: Dims, block: int, budget: int, elem: Any) -> int:
    """Temporaries of the block's attention call itself, one layer at a time.

    With a mask (a block attending to a compacted cache always has one) transformers repeats K and
    V to every query head before SDPA, so K/V are expanded to ``num_attention_heads`` copies when
    heads are grouped. The kernel may fall back to the math path, which materialises a float32
    block x keys x heads score matrix; we count that worst case.
    """
    keys = budget + block
    heads = dims["num_attention_heads"]
    expanded = 0
    if heads != dims["num_kv_heads"]:
        expanded = 2 * keys * heads * dims["head_dim"] * dtype_bytes(elem)
    scores = block * keys * heads * 4
    return expanded + scores


def decode_scratch_bytes(dims: Dims, elem: Any, budget: int, block: int, kv_dtype: str = "auto",
                         recall: int = 0) -> int:
    """The buffers coded K/V (``--kv-dtype``) are read and written through (``core/quant.py``'s ``Scratch``,
    shared by every layer); 0 when K/V are stored in the compute dtype. ``recall``: slots a group holds
    during an answer on top of capacity + block (read like the others; int4's window is matched over them
    too, since a relevance placement puts them after the kept tokens).

    Reading: one layer's K and V decoded to the compute dtype, capacity plus one block; integer codes add
    one more K (or V) where they are scaled before their rotation back, and int4 the nibbles split (one
    byte per element) and what reading its 16-bit window takes (one K or V of the window, its rows, held
    positions and matches). Writing integer codes: two float32 K (or V) and a float32 scale per token,
    one block long (int4: also its codes unpacked and the shifted high nibbles)."""
    if not coded_kv(elem, kv_dtype):
        return 0
    h, d, e = dims["num_kv_heads"], dims["head_dim"], dtype_bytes(elem)
    slots = budget + block + recall
    if kv_dtype not in ("int8", "int4"):
        return 2 * slots * h * d * e
    read = 3 * slots * h * d * e
    write = h * block * (2 * d * 4 + 4)
    if kv_dtype == "int4":
        window = min(KV_WINDOW_TOKENS["int4"] + recall, slots)  # the slots the window's tokens are matched over
        read += slots * h * d + h * window * (d * min(e, 2) + 8 + 8 + 1)
        write += h * block * (d + d // 2)
    return read + write


def rotation_scratch_bytes(dims: Dims, elem: Any, tokens: int) -> int:
    """The buffers compact positions rotate keys through (``core/positions.py``'s ``RotationWork``, shared
    by every layer): the rotated keys of the largest rotation, ``tokens`` per KV head in the compute dtype
    (at most a group's slots), and one step's work, ``ROTATE_CHUNK`` tokens at most: float64 angles and
    four float32 half-dimension terms (8 + 16 bytes per pair of channels), plus a float32 copy of the key
    and of its result for a 16-bit key. 0 tokens (no compact positions) cost nothing."""
    if tokens <= 0:
        return 0
    h, d, e = dims["num_kv_heads"], dims["head_dim"], dtype_bytes(elem)
    step = min(ROTATE_CHUNK, tokens)
    return h * tokens * d * e + h * step * d * (12 + (8 if e != 4 else 0))


def recall_scratch_bytes(dims: Dims, elem: Any, budget: int, page: int, question: int = PLANNED_QUESTION_TOKENS,
                         archived: int | None = None) -> int:
    """Recall's temporaries while a question scores the archive (``core/recall.py``), for ``question`` tokens.

    The query log: the question's rows of every global layer, all attention heads, in the compute dtype. One
    group's rows gathered and in float32. The archive scores held between the softmax's two passes: at most
    ``SCAN_BYTES``, or every archived token's (``archived`` per head, when known) if fewer (with compact
    positions every archived token is scored, so ``SCAN`` does not bound what is held). The scores being
    computed, a chunk of at most ``SCORE_BYTES`` (or one page), and their softmax's temporary. The question
    cannot exceed the budget (it is pinned in it).
    """
    h, heads, d, e = dims["num_kv_heads"], dims["num_attention_heads"], dims["head_dim"], dtype_bytes(elem)
    q = max(1, min(question, budget))
    layers = dims["num_layers"] - int(dims.get("sliding_layers", 0))
    log = layers * heads * q * d * e
    queries = heads * q * d * (e + 4)
    per_token = 4 * h * (heads // h) * q  # one token's scores: every row of every KV head
    hold = max(page, SCAN_BYTES // per_token)
    held = per_token * (hold if archived is None else min(hold, archived))
    archive_chunk = per_token * page * max(1, min(SCAN_CHUNK, SCORE_BYTES // (per_token * page)))
    kept_chunk = per_token * max(1, min(budget, SCORE_BYTES // per_token))
    return log + queries + held + 2 * max(archive_chunk, kept_chunk)


def activation_bytes(dims: Dims, block: int, elem: Any, logits_rows: int = 1) -> int:
    """Hidden states and MLP intermediates for one block of ``block`` tokens, plus the logits.

    block x hidden x elem x ``HIDDEN_TENSORS`` + block x intermediate x elem x
    ``INTERMEDIATE_TENSORS`` + logits_rows x vocab x ``LOGITS_BYTES``. Layers run one after the
    other, so only one layer's worth is alive at a time. Only the last row's logits are computed
    while reading (``logits_rows = 1``).
    """
    e = dtype_bytes(elem)
    hidden = block * dims["hidden_size"] * e * HIDDEN_TENSORS
    mlp = block * dims["intermediate_size"] * e * INTERMEDIATE_TENSORS
    return hidden + mlp + logits_rows * dims["vocab_size"] * LOGITS_BYTES


def weights_bytes(num_params: int, elem: Any, quantize: str = "none", unquantized_params: int = 0) -> int:
    """Bytes of the model's weights.

    ``quantize="none"``: every parameter at ``elem``. "8bit" / "4bit": linear weights at
    ``QUANT_BYTES_PER_PARAM`` bytes each; ``unquantized_params`` (embeddings, LM head, which
    bitsandbytes leaves alone — see ``embedding_params``) stay at ``elem``.
    """
    e = dtype_bytes(elem)
    if quantize == "none":
        return num_params * e
    if quantize not in QUANT_BYTES_PER_PARAM:
        raise ValueError(f"quantize must be one of none, {', '.join(QUANT_BYTES_PER_PARAM)}: got {quantize!r}")
    quantized = max(0, num_params - unquantized_params)
    return int(quantized * QUANT_BYTES_PER_PARAM[quantize]) + (num_params - quantized) * e


# ---------------------------------------------------------------------------------------------
# peaks
# ---------------------------------------------------------------------------------------------


def predict_peak(
    dims: Dims,
    *,
    num_params: int,
    elem: Any,
    budget_tokens: int,
    block_size: int,
    quantize: str = "none",
    rows: int = 0,
    n_fields: int = 0,
    runtime_baseline_bytes: int = 0,
    unquantized_params: int = 0,
    snapshot_tokens: int | None = None,
    original_keys: bool = False,
    kv_dtype: str = "auto",
    compact: bool = False,
    rows_summed: bool = False,
    device_type: str = "cpu",
    recall_tokens: int = 0,
    recall_page: int = 32,
    archived_tokens: int | None = None,
    stacked: bool = True,
    policy_slot_bytes: int = 0,
    question_tokens: int = PLANNED_QUESTION_TOKENS,
    archive_dtype: str = "auto",
) -> dict[str, int]:
    """Predicted peak memory of a budgeted run, with every component.

    ``snapshot_bytes`` is the copy of the post-document cache the session keeps to restore before each
    question (``snapshot_tokens`` per head: the budget, or fewer when the document is shorter).

    ``rows`` is the policy's ``query_rows(block_size)``, ``n_fields`` its ``len(state_fields)``;
    ``runtime_baseline_bytes`` is the process's memory before weights are loaded, measured by the
    caller (RSS on CPU; 0 on CUDA, where the CUDA context is not counted by the allocator).
    ``original_keys``: the cache keeps each key's original copy too (``keeps_original_keys``).
    ``kv_dtype``: how K/V are stored (``--kv-dtype``); a coded cache adds its decode scratch.
    ``compact``: keys move to compact positions (``compact_positions``), which adds the rotation's buffers.
    ``rows_summed``: the policy reads its probabilities summed over the rows (chunked: ``attention_scratch_bytes``).
    ``device_type``: on ``cuda`` the snapshot lives in pinned host memory (``snapshot_host_bytes``), not on the GPU;
    copying it there holds one layer's keys on the GPU (``snapshot_copy_bytes``).
    ``stacked``: the policy's layers share one layout (a batchable policy of its own layout) and evict a chunk of
    layers at once (``eviction_scratch_bytes``); ``policy_slot_bytes``: its ``Policy.score_slot_bytes``.
    ``recall_tokens``: slots recall adds per KV head during an answer (``recall_slots_bytes``), which every
    buffer sized by a group's slots grows by, and its scoring's temporaries (``recall_scratch_bytes``, pages
    of ``recall_page``; ``archived_tokens`` per head when the document's length is known; ``question_tokens``: the
    question's, with its chat template, when it is known, else ``PLANNED_QUESTION_TOKENS``); ``archive_dtype``: how
    the archive stores K/V (``--archive-dtype``), which its appends' work depends on (``archive_work_bytes``).
    """
    held = budget_tokens + recall_tokens  # the keys a query sees during an answer
    snapshot_tokens = budget_tokens if snapshot_tokens is None else min(snapshot_tokens, budget_tokens)
    snapshot = snapshot_bytes(dims, elem, snapshot_tokens, n_fields, kv_dtype, original_keys)
    cache = {"kv_dtype": kv_dtype, "n_fields": n_fields, "stacked": stacked, "policy_slot_bytes": policy_slot_bytes}
    parts = {
        "weights_bytes": weights_bytes(num_params, elem, quantize, unquantized_params),
        **cache_parts(dims, elem, budget_tokens, block_size, original_keys=original_keys, recall=recall_tokens,
                      **cache),
        "attention_scratch_bytes": attention_scratch_bytes(dims, block_size, held, rows, rows_summed),
        "sdpa_scratch_bytes": sdpa_scratch_bytes(dims, block_size, held, elem),
        "activation_bytes": activation_bytes(dims, block_size, elem),
        "snapshot_bytes": snapshot_copy_bytes(dims, elem, snapshot_tokens, kv_dtype) if device_type == "cuda"
        else snapshot,
        "runtime_baseline_bytes": runtime_baseline_bytes,
    }
    if device_type == "cpu" and (rows or dims.get("softcap")):  # explicit probabilities on a CPU
        parts["head_split_bytes"] = head_split_bytes(dims, elem, held + block_size, block_size)
    if coded_kv(elem, kv_dtype):  # a part only where it exists: the profiles' expected figures stay as they are
        parts["kv_decode_scratch_bytes"] = decode_scratch_bytes(dims, elem, budget_tokens, block_size, kv_dtype,
                                                                recall_tokens)
    if compact:  # a group holding its recalled tokens is re-packed whole
        parts["rotation_scratch_bytes"] = rotation_scratch_bytes(dims, elem, held + block_size)
    if recall_tokens:
        parts.update(recall_parts(dims, elem, budget_tokens, block_size, recall_tokens, original_keys=original_keys,
                                  page=recall_page, archive_dtype=archive_dtype, **cache))
        parts["recall_scratch_bytes"] = recall_scratch_bytes(dims, elem, budget_tokens, recall_page,
                                                             question_tokens, archived_tokens)
    # The promise is contained in the allocation, so it is not added twice.
    parts["predicted_peak_bytes"] = sum(v for k, v in parts.items() if k != "kv_promised_bytes")
    if device_type == "cuda":  # host memory: reported beside the peak, not in it
        parts["snapshot_host_bytes"] = snapshot
    return parts


def dense_peak(
    dims: Dims,
    n_tokens: int,
    *,
    num_params: int,
    elem: Any,
    quantize: str = "none",
    runtime_baseline_bytes: int = 0,
    unquantized_params: int = 0,
) -> int:
    """Peak of plain transformers reading ``n_tokens`` in one prefill pass with a growing cache.

    Weights + KV for every token (a sliding-window layer's window: ``dense_kv_bytes``) + activations for all
    ``n_tokens`` at once (same constants as ``activation_bytes``) + one row of logits + the attention mask a
    model with sliding layers is given (``dense_mask_bytes``) + the scores of a model that attends eagerly
    (``dense_scores_bytes``). SDPA's fused kernels hold no scores, so they are not counted for other models: the
    estimate is generous to dense where a backend falls back to its math path.
    """
    return (
        weights_bytes(num_params, elem, quantize, unquantized_params)
        + dense_kv_bytes(dims, n_tokens, elem)
        + activation_bytes(dims, n_tokens, elem, logits_rows=1)
        + dense_mask_bytes(dims, n_tokens, elem)
        + dense_scores_bytes(dims, n_tokens, elem)
        + runtime_baseline_bytes
    )


def dense_mask_bytes(dims: Dims, n_tokens: int, elem: Any) -> int:
    """The attention masks of one dense prefill over ``n_tokens``. On SDPA, a model with sliding-window layers:
    once the document reaches the window, transformers cannot hand SDPA ``is_causal`` for those layers and builds
    a boolean ``n × n`` mask, which SDPA turns into an additive mask in the compute dtype for each call, so
    ``1 + elem`` bytes per query-key pair are alive together (3 in bfloat16, 5 in float32); a model without
    sliding layers gets ``is_causal`` and no mask. On eager attention (softcapped Gemma 2) every layer kind's mask
    is additive in the compute dtype, whatever the length: ``elem`` bytes a pair for each."""
    e = dtype_bytes(elem)
    sliding = int(dims.get("sliding_layers", 0))
    if dims.get("softcap"):
        return n_tokens * n_tokens * e * (2 if sliding else 1)
    if not sliding or n_tokens < int(dims.get("sliding_window", 0)):
        return 0
    return n_tokens * n_tokens * (1 + e)


def dense_scores_bytes(dims: Dims, n_tokens: int, elem: Any) -> int:
    """The attention scores of one dense prefill over ``n_tokens`` on a softcapped model (Gemma 2), which
    transformers runs on its eager attention: each layer holds every query head's ``n × n`` scores while its
    softmax upcasts them, the scores in the compute dtype, their float32 copy and the float32 probabilities
    (``elem + 8`` bytes a pair below float32, 8 in float32; tests/test_plan_measured.py holds it against the
    allocator). Other models run SDPA: none."""
    if not dims.get("softcap"):
        return 0
    e = dtype_bytes(elem)
    return int(dims["num_attention_heads"]) * n_tokens * n_tokens * (8 if e >= 4 else e + 8)


def dense_kv_bytes(dims: Dims, n_tokens: int, elem: Any) -> int:
    """K/V plain transformers holds after reading ``n_tokens``: every token in a global layer, at most the
    ``W - 1`` newest in a sliding-window layer (transformers' own cache keeps no more of them)."""
    per_layer = kv_bytes_per_token(dims, elem)["per_layer"]
    split = layer_split(dims, None)
    return per_layer * (split["global_layers"] * n_tokens + split["sliding_layers"] * min(n_tokens,
                                                                                        split["sliding_tokens"]))


def _largest(fits: Callable[[int], bool]) -> int:
    """Largest n >= 1 with ``fits(n)`` for a monotone predicate, or 0 if even 1 does not fit."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 48:  # nothing per token costs memory: no meaningful answer
            raise ValueError("memory use does not grow with tokens; check dims")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def largest_budget(memory_bytes: int, dims: Dims, **peak: Any) -> int:
    """Largest budget (tokens per KV head) whose ``predict_peak`` fits in ``memory_bytes``; 0 if none.

    ``peak``: ``predict_peak``'s keywords other than ``budget_tokens`` (``num_params``, ``elem`` and
    ``block_size`` required), so the search prices a budget exactly as the plan does.
    """
    return _largest(lambda budget: predict_peak(dims, budget_tokens=budget, **peak)["predicted_peak_bytes"]
                    <= memory_bytes)


def dense_max_tokens(memory_bytes: int, dims: Dims, **peak: Any) -> int:
    """Longest document (tokens) whose ``dense_peak`` fits in ``memory_bytes``; 0 if none.

    ``peak``: ``dense_peak``'s keywords (``num_params`` and ``elem`` required).
    """
    return _largest(lambda n: dense_peak(dims, n, **peak) <= memory_bytes)


def format_bytes(n: int | float | None) -> str:
    """Human-readable binary size with about three significant digits: "512 B", "1.50 KiB", "11.8 MiB".

    The one byte formatter of kvtool (plans, stats, dashboard, inspect); "n/a" for None or non-finite.
    """
    if n is None or not math.isfinite(n):
        return "n/a"
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    if value < 1024:
        return f"{sign}{int(value)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            digits = f"{value:,.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"
            return f"{sign}{digits} {unit}"
    raise AssertionError("unreachable")
