"""``kvtool profile``: the predicted memory plan of a run, and (with a document) its measured peak.

Every number comes from the shared formulas in :mod:`kvtool.runtime.memory`, so a profile, a byte budget and
a run's statistics cannot disagree. The prediction is a sum the user can read line by line::

    predicted peak = runtime baseline            measured: memory of the process before weights load
                   + weights                     real bytes of the loaded parameters
                   + KV allocated                (budget + block) tokens x KV bytes per token (x 1.5 when a
                                                 16-bit cache at compact positions keeps original keys)
                   + attention scratch           float32 probabilities the policy asked for (one layer)
                   + SDPA scratch                the block's attention call (one layer, worst case)
                   + policy state                float32 per-token score state next to K/V
                   + positions                   two int64 positions per slot (stream and RoPE)
                   + eviction scratch            an eviction's scores and kept-token copy (a chunk of layers)
                   + activations                 one block's hidden/MLP tensors + one row of logits
                   + snapshot                    the post-document cache a question restores (CPU; on CUDA
                                                 it lives in pinned host memory: one layer's copy on the GPU)
                   (+ coded K/V's decode scratch, compact positions' rotation, recall's slots and scratch)

The unit costs (a token, a slot, a layer, a block) come from :mod:`kvtool.core.costs`, which the engine reads too.

Runtime baseline: on CPU the process RSS once the model is loaded and has run a few tokens, less the
weights' bytes (``warm_baseline``; a plan from a config alone has none): the Python runtime, torch's and
transformers' code and static data, the tokenizer, the model's Python objects, the math libraries'
start-up. On CUDA it is 0, because the figure compared with is the CUDA allocator's
``max_memory_allocated``, which knows nothing of the host process.

The plan is a ceiling: ``kvtool profile --doc`` reads real documents and answers a question about each (``measure``)
and reports the measured peak beside it; tests hold measured <= predicted <= 1.15 x measured for budgets of 1K
and 4K, recall on and off, a ``.kvc`` load and a document read after a recalling one (tests/test_plan_measured.py:
a tiny model's allocations tracked by torch's allocator, the embedded SmolLM2-135M's RSS).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtool.core.archive import SUMMARY_DTYPE
from kvtool.core.costs import dtype_bytes
from kvtool.runtime import memory as _mem
from kvtool.runtime import memory_cache as _cache
from kvtool.runtime.archive_disk import archive_dir, fits
from kvtool.runtime.budget import resolve_budget_and_recall
from kvtool.runtime.settings import Settings, default_block_size


@dataclass
class ModelInfo:
    """What a plan needs to know about a model; ``from_session`` fills it from a loaded model.

    ``weights_bytes=None`` means "not loaded": the bytes then come from ``memory.weights_bytes``.
    ``rows`` is the policy's ``query_rows(block_size)``, ``n_fields`` the number of float32
    per-token state fields it keeps. ``max_positions`` is the model's trained range: with
    ``positions auto`` a 16-bit cache that passes it keeps each key's original copy (see
    ``memory.keeps_original_keys``). ``budget_tokens``/``recall_tokens``/``budget_note`` may be given already
    resolved (a session resolves them); otherwise ``plan`` resolves the settings' budget and recall itself.
    """

    name: str
    dims: dict[str, int]
    num_params: int
    dtype: str = "float32"  # dtype of K/V (the model's compute dtype)
    weights_bytes: int | None = None
    device: str = "cpu"
    quantize: str = "none"
    unquantized_params: int = 0
    policy: str = "h2o"
    rows: int = 0
    n_fields: int = 0
    budget_tokens: int | None = None
    budget_note: str | None = None
    resolved: bool = False  # budget_tokens/recall_tokens/budget_note already resolved (None budget = policy full)
    recall_tokens: int = 0  # resolved: the tokens per KV head recall may add (a byte budget holds them)
    budget_split: list[dict[str, Any]] | None = field(default=None, repr=False)
    max_positions: int | None = None  # the model's max_position_embeddings (when auto positions switch)
    kv_dtype: str = "auto"  # how the cache stores K/V (``--kv-dtype``; auto: ``dtype``)
    rows_summed: bool = False  # the policy reads its probabilities summed over rows (chunked on a long block)
    block_auto: bool = False  # the session chose the block for its device (``--block-size auto``)
    stacked: bool = True  # the policy's layers share one layout and evict a chunk of layers at once
    policy_slot_bytes: int = 0  # its scoring's own work per (head, token) (``Policy.score_slot_bytes``)

    @property
    def elem(self) -> int:
        return dtype_bytes(self.dtype)


def dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def model_info(session: Any) -> ModelInfo:
    """A ``ModelInfo`` from a ``kvtool.runtime.session.Session``: real parameter counts and bytes, the
    policy's attention rows and state fields, the session's resolved budget and razor's split."""
    model = session.model
    num_params, real_bytes = parameter_bytes(model)
    block = session.settings.block_size
    policy = session.policy
    engine = session.engine
    # The cache keeps each head group's own policy's state fields (razor: its fallback's); the
    # largest count over groups is what the formula's one-count-for-every-head bound needs.
    n_fields = len(tuple(policy.state_fields))
    for specs in getattr(engine, "layer_specs", []):
        for spec in specs:
            n_fields = max(n_fields, len(tuple(spec.policy.state_fields)))
    split = getattr(policy, "budget_split", None)
    budget_split = split(engine.env) if callable(split) and session.budget_tokens is not None else None
    return ModelInfo(
        name=session.loaded.name,
        dims=dict(session.dims),
        num_params=num_params,
        dtype=dtype_name(engine.dtype),
        weights_bytes=real_bytes,
        device=str(session.loaded.device),
        quantize=session.loaded.quantize,
        policy=policy.spec,
        rows=min(max(int(policy.query_rows(block)), 0), block),
        n_fields=n_fields,
        budget_tokens=session.budget_tokens,
        budget_note=session.budget_note,
        resolved=True,
        recall_tokens=session.engine_config.recall,
        budget_split=budget_split,
        max_positions=getattr(engine, "max_positions", None),
        kv_dtype=session.settings.kv_dtype,
        rows_summed=bool(policy.rows_summed),
        block_auto=session.block_auto,
        stacked=stacks_layers(policy),
        policy_slot_bytes=policy.score_slot_bytes(session.dims["head_dim"]),
    )


def stacks_layers(policy: Any) -> bool:
    """Whether the cache stacks the policy's layers (``core/stacks.py``'s ``stack_layout``): one layout in every
    layer, scored across layers."""
    return bool(policy.batchable) and not policy.own_layout


def parameter_bytes(model: Any) -> tuple[int, int]:
    """(parameters as the checkpoint counts them, bytes they occupy) of a loaded model.

    A bitsandbytes 4-bit weight is a packed uint8 tensor of half as many elements, with its scales in
    ``quant_state`` (absmax, its nested absmax under double quantization, the code tables); an 8-bit weight
    keeps per-row scales in ``SCB`` (on the module's ``state`` once it has run). All are counted, each
    storage once (layers share their code tables), so the figure is what the allocator holds.
    """
    import torch

    count = 0
    storages: dict[int, int] = {}
    counted: set[int] = set()  # a tied weight (the output head that is the input embedding) is one parameter

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) in counted:
                continue
            counted.add(id(p))
            add(p)
            state = getattr(p, "quant_state", None)
            if state is not None and getattr(state, "shape", None) is not None:
                count += math.prod(state.shape)
                _add_state(state, add)
                continue
            count += p.numel()
            add(getattr(p, "SCB", None))
        add(getattr(getattr(module, "state", None), "SCB", None))
    return count, sum(storages.values())


def _add_state(state: Any, add: Callable[[Any], None]) -> None:
    """A bitsandbytes ``QuantState``'s tensors, its nested state's included."""
    for name in ("absmax", "code", "offset"):
        add(getattr(state, name, None))
    nested = getattr(state, "state2", None)
    if nested is not None:
        _add_state(nested, add)


#: files whose presence says a checkpoint directory holds weights (``profile`` loads those; a directory of
#: only a config is planned from the config)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def has_weights(directory: Path) -> bool:
    """Whether ``directory`` holds weight files (else ``kvtool profile`` plans from its ``config.json`` alone)."""
    return any(p.name.endswith(WEIGHT_SUFFIXES) for p in directory.iterdir())


def model_info_from_config(directory: Path, settings: Settings, name: str | None = None) -> ModelInfo:
    """A ``ModelInfo`` from a checkpoint directory's ``config.json`` alone: no weights are read, no device is
    needed, so a user can see the plan a model and a card would give before downloading either. The config is
    checked as loading checks it (``checkpoint_config.checked_config``: the same config is refused with or
    without its weights), and its parameters are counted from the model it describes, built on the meta device
    (a mixture of experts counts every expert). The dtype ``auto`` means bfloat16 on CUDA, float32 elsewhere."""
    from kvtool.core.contract import PolicyEnv
    from kvtool.policies import build_policy
    from kvtool.runtime.model.checkpoint_config import checked_config, parameter_counts

    config = checked_config(directory)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    dims = _mem.dims_from_config(config)
    device = settings.device if settings.device != "auto" else "cpu"
    dtype = settings.dtype if settings.dtype != "auto" else "bfloat16" if device.startswith("cuda") else "float32"
    num_params, embeddings = parameter_counts(config)
    budget, recall, note = resolve_budget_and_recall(settings, dims, dtype)
    block = settings.block_size or default_block_size(device.split(":")[0], budget)
    env = PolicyEnv(num_layers=dims["num_layers"], num_kv_heads=dims["num_kv_heads"],
                    num_attention_heads=dims["num_attention_heads"], head_dim=dims["head_dim"], budget=budget,
                    block_size=block, sinks=settings.sinks, recent=settings.recent)
    policy = build_policy(settings.policy, settings.policy_options, env)
    return ModelInfo(name=name or directory.name, dims=dims, num_params=num_params, dtype=dtype,
                     device=device, quantize=settings.quantize,
                     unquantized_params=embeddings if settings.quantize != "none" else 0,
                     policy=policy.spec, rows=min(max(int(policy.query_rows(block)), 0), block),
                     n_fields=len(tuple(policy.state_fields)), budget_tokens=budget, budget_note=note, resolved=True,
                     recall_tokens=recall if budget is not None else 0,
                     max_positions=getattr(text, "max_position_embeddings", None), kv_dtype=settings.kv_dtype,
                     rows_summed=bool(policy.rows_summed), block_auto=settings.block_size is None,
                     stacked=stacks_layers(policy), policy_slot_bytes=policy.score_slot_bytes(dims["head_dim"]))


def plan_from_config(directory: Path, settings: Settings, doc_tokens: int | None, memory: int | None,
                     name: str | None = None) -> dict[str, Any]:
    """``plan`` for a checkpoint directory holding only its ``config.json`` (``model_info_from_config``); ``name``
    (default: the directory's) is what the plan calls the model, e.g. the id of a cached model."""
    out = plan(model_info_from_config(directory, settings, name), settings, doc_tokens=doc_tokens, memory=memory,
               runtime_baseline=0)
    out["from_config"] = True
    return out


def _dense_plan(dims: Any, doc_tokens: int, offset: int, common: dict[str, Any]) -> dict[str, Any]:
    """Dense transformers on the same document: its K/V (in the compute dtype; a sliding layer's window only)
    and predicted peak (``offset``: baseline + weights')."""
    peak = _mem.dense_peak(dims, doc_tokens, runtime_baseline_bytes=0, **common) + offset
    return {"doc_tokens": doc_tokens, "kv_bytes": _mem.dense_kv_bytes(dims, doc_tokens, common["elem"]),
            "predicted_peak_bytes": peak}


def plan(
    session_or_model_info: Any,
    settings: Settings,
    doc_tokens: int | None = None,
    memory: int | None = None,
    runtime_baseline: int | None = None,
    question_tokens: int | None = None,
) -> dict[str, Any]:
    """The predicted memory plan (the ``--json`` object of ``kvtool profile`` without ``measured``).

    ``session_or_model_info``: a ``Session`` (real dims, parameter bytes, policy) or a ``ModelInfo``.
    ``doc_tokens``: a document length for the dense comparison (and, for policy ``full``, which
    keeps every token, the cache size of the prediction). ``memory``: bytes
    available; adds the largest budget that fits and the longest document dense transformers could
    hold. ``runtime_baseline``: bytes of the process before weights (None: 0, e.g. on CUDA). ``question_tokens``:
    the question recall scores with, when known (else ``memory.PLANNED_QUESTION_TOKENS``).
    """
    limit, kv = memory, settings.kv_dtype
    info = session_or_model_info if isinstance(session_or_model_info, ModelInfo) else model_info(session_or_model_info)
    dims, elem = info.dims, info.elem
    baseline = int(runtime_baseline or 0)
    budget, recall, note = (info.budget_tokens, info.recall_tokens, info.budget_note) if info.resolved else \
        resolve_budget_and_recall(settings, dims, info.dtype)
    recall = recall if budget is not None else 0  # only a bounded cache archives
    auto, settings = settings.block_size is None or info.block_auto, _with_block(settings, info, budget)
    block = settings.block_size

    formula_weights = _mem.weights_bytes(info.num_params, elem, info.quantize, info.unquantized_params)
    weights = info.weights_bytes if info.weights_bytes is not None else formula_weights
    # memory.py computes weights from a parameter count; a loaded model's real bytes (mixed dtypes,
    # packed quantized weights) may differ. The difference is carried as a constant offset so the
    # searches below (largest budget, dense max tokens) see exactly the same weights as the plan.
    weights_offset = weights - formula_weights
    common = {"num_params": info.num_params, "elem": elem, "quantize": info.quantize,
              "unquantized_params": info.unquantized_params}
    device_type = info.device.split(":")[0]
    original_keys = _mem.keeps_original_keys(elem, settings.positions, info.max_positions, doc_tokens, kv)
    compact = _mem.compact_positions(settings.positions, info.max_positions, doc_tokens)
    # recall's slots and temporaries are priced in the peak and in the largest-budget search alike
    sized = {"original_keys": original_keys, "kv_dtype": kv, "compact": compact, "recall_tokens": recall,
             "recall_page": settings.recall_page, "archived_tokens": doc_tokens, "rows_summed": info.rows_summed,
             "device_type": device_type, "stacked": info.stacked, "policy_slot_bytes": info.policy_slot_bytes,
             "question_tokens": question_tokens or _mem.PLANNED_QUESTION_TOKENS,
             "archive_dtype": settings.archive_dtype}

    out: dict[str, Any] = {
        "model": info.name,
        "dtype": info.dtype,
        "device": info.device,
        "quantize": info.quantize,
        "kv_dtype": info.dtype if kv == "auto" else kv,
        "policy": info.policy,
        "block_size": block,
        "block_auto": auto,
        "budget_tokens": budget,
        "budget_conversion": note,
        "num_params": info.num_params,
        "kv_bytes_per_token": _cache.kv_bytes_per_token(dims, elem, kv),
    }
    peak = _peak(info, dims, block, baseline, budget, doc_tokens, weights, weights_offset, {**common, **sized})
    out["kv_bytes_at_budget"] = _kv_at_budget(peak, dims, elem, budget if budget is not None else doc_tokens, block,
                                              original_keys, kv)
    out["original_keys"] = original_keys
    out.update(_components(peak, info, weights, baseline))
    _add_recall(out, settings, info, peak, budget, recall, doc_tokens, sized["question_tokens"])
    if doc_tokens is not None:
        out["dense"] = _dense_plan(dims, doc_tokens, baseline + weights_offset, common)
    if limit is not None:
        out["memory"] = _fit_in(limit, out["predicted_peak_bytes"], info, block, baseline + weights_offset,
                                {**common, **sized})
    if info.budget_split is not None:
        out["budget_split"] = info.budget_split
    return out


def _components(peak: Mapping[str, Any], info: ModelInfo, weights: int, baseline: int) -> dict[str, Any]:
    """The plan's lines below the K/V: scratch, state, activations, snapshot, weights and the predicted peak."""
    return {
        "attention_rows": info.rows,
        "attention_scratch_bytes": peak["attention_scratch_bytes"],
        "sdpa_scratch_bytes": peak["sdpa_scratch_bytes"],
        "kv_decode_scratch_bytes": peak.get("kv_decode_scratch_bytes", 0),
        "rotation_scratch_bytes": peak.get("rotation_scratch_bytes", 0),
        "policy_state_fields": info.n_fields,
        "policy_state_bytes": peak["policy_state_bytes"],
        "positions_bytes": peak["positions_bytes"],
        "eviction_scratch_bytes": peak["eviction_scratch_bytes"],
        "activation_bytes": peak["activation_bytes"],
        "snapshot_bytes": peak["snapshot_bytes"],
        "snapshot_host_bytes": peak.get("snapshot_host_bytes", 0),
        "weights_bytes": weights,
        "runtime_baseline_bytes": baseline,
        "predicted_peak_bytes": peak["predicted_peak_bytes"],
    }


def _with_block(settings: Settings, info: ModelInfo, budget: int | None) -> Settings:
    """``settings`` with ``--block-size auto`` resolved for the plan's device (a session resolved it already)."""
    if settings.block_size is not None:
        return settings
    return dataclasses.replace(settings, block_size=default_block_size(info.device.split(":")[0], budget))


def _kv_at_budget(peak: Mapping[str, Any], dims: Mapping[str, int], elem: int, cache_tokens: int | None,
                  block: int, original_keys: bool, kv_dtype: str = "auto") -> dict[str, Any] | None:
    """K/V bytes promised and allocated at the budget; a hybrid model's split into global and sliding layers."""
    if peak["kv_allocated_bytes"] is None:
        return None
    out: dict[str, Any] = {"promised": peak["kv_promised_bytes"], "allocated": peak["kv_allocated_bytes"]}
    if cache_tokens is not None and dims.get("sliding_layers"):
        split = _cache.layer_split(dims, cache_tokens)
        out["by_layer_kind"] = {
            kind: {**v, "layers": split[f"{kind}_layers"], "tokens_per_head": split[f"{kind}_tokens"]}
            for kind, v in _cache.kv_bytes_at_budget(dims, elem, cache_tokens, block,
                                                   original_keys, kv_dtype)["by_layer_kind"].items()
        }
    return out


def _fit_in(limit: int, predicted: int | None, info: ModelInfo, block: int, shifted_baseline: int,
            sized: dict[str, Any]) -> dict[str, Any]:
    """What fits in ``limit`` bytes: this plan, the largest budget (priced as the plan prices one: K/V as
    ``--kv-dtype`` stores them, recall's slots and temporaries included), the longest dense document (K/V in the
    compute dtype). ``sized``: ``predict_peak``'s keywords besides the budget, the block and the policy's. On
    CUDA the allocator gets ``limit`` less the CUDA runtime's own memory (``memory.CUDA_RUNTIME_BYTES``)."""
    runtime = _mem.CUDA_RUNTIME_BYTES if sized.get("device_type") == "cuda" else 0
    usable = limit - runtime
    dense = {k: sized[k] for k in ("num_params", "elem", "quantize", "unquantized_params")}
    return {
        "limit_bytes": limit,
        "cuda_runtime_bytes": runtime,
        "fits": predicted <= usable if predicted is not None else None,
        "largest_budget_tokens": _mem.largest_budget(
            usable, info.dims, block_size=block, rows=info.rows, n_fields=info.n_fields,
            runtime_baseline_bytes=shifted_baseline, **sized,
        ),
        "dense_max_tokens": _mem.dense_max_tokens(usable, info.dims, runtime_baseline_bytes=shifted_baseline,
                                                  **dense),
    }


def _peak(info: ModelInfo, dims: Mapping[str, int], block: int, baseline: int, budget: int | None,
          doc_tokens: int | None, weights: int, weights_offset: int, common: dict[str, Any]) -> dict[str, Any]:
    """The peak's components; without a budget or a document length (policy full) only weights and activations."""
    # Policy full keeps every token: its cache is the document (when its length is known).
    cache_tokens = budget if budget is not None else doc_tokens
    if cache_tokens is None:
        peak: dict[str, Any] = {k: None for k in ("kv_promised_bytes", "kv_allocated_bytes", "attention_scratch_bytes",
                                                  "sdpa_scratch_bytes", "policy_state_bytes", "positions_bytes",
                                                  "eviction_scratch_bytes", "snapshot_bytes", "predicted_peak_bytes")}
        peak["weights_bytes"] = weights
        peak["activation_bytes"] = _mem.activation_bytes(dims, block, info.elem)
        return peak
    peak = _mem.predict_peak(
        dims, budget_tokens=cache_tokens, block_size=block, rows=info.rows, n_fields=info.n_fields,
        runtime_baseline_bytes=baseline, snapshot_tokens=doc_tokens, **common,
    )
    peak["predicted_peak_bytes"] += weights_offset
    peak["weights_bytes"] = weights
    return peak


def _add_recall(out: dict[str, Any], settings: Settings, info: ModelInfo, peak: Mapping[str, Any], budget: int | None,
                recall: int, doc_tokens: int | None, question_tokens: int) -> None:
    """Recall's part of the plan, in place: its slots and temporaries (already in the peak), the K/V it adds to
    the budget's promise, and a document's archive on disk."""
    if not recall or budget is None:
        return
    out.update(_recall_plan(settings, info, info.dims, recall))
    out.update({"recall_slots_bytes": peak["recall_slots_bytes"], "recall_kv_bytes": _cache.recall_kv_bytes(
        info.dims, info.elem, recall, settings.kv_dtype), "recall_scratch_bytes": peak["recall_scratch_bytes"],
        "archive_work_bytes": peak["archive_work_bytes"], "recall_growth_bytes": peak["recall_growth_bytes"],
        "recall_question_tokens": min(question_tokens, budget)})
    if doc_tokens is not None:  # the archive of such a document, and whether ``auto`` would keep it
        out.update(_archive_on_disk(out["archive_bytes_per_evicted_token"], doc_tokens, budget, settings.recall))


def _archive_on_disk(per_token: Mapping[str, int], doc_tokens: int, budget: int, recall: str) -> dict[str, Any]:
    """The archive of a ``doc_tokens`` document (its evicted tokens, on disk), and whether ``--recall auto``
    would archive it in the archive directory as things stand (kvtool/runtime/archive_disk.py)."""
    auto = recall == "auto"
    nbytes = max(0, doc_tokens - budget) * (per_token["file"] + per_token["index"])
    ok, why = fits(nbytes, archive_dir())
    return {"archive_doc_tokens": doc_tokens, "archive_bytes": nbytes,
            "archive_fits": ok, "archive_verdict": (("recall on by default: " if auto else "") + why) if ok
            else ("recall off by default: " if auto else "warning: ") + why}


def _recall_plan(settings: Settings, info: ModelInfo, dims: Mapping[str, int], recall_tokens: int) -> dict[str, Any]:
    """Recall (kvtool/core/recall.py): its size, and its archive in files: K/V rows, and an index (positions
    and page summaries, a few bytes per token). Only global layers archive (a sliding window's evicted tokens
    are gone by the model's definition)."""
    elem = info.elem
    global_layers = dims["num_layers"] - dims.get("sliding_layers", 0)
    heads = dims["num_kv_heads"] * global_layers
    int8 = settings.archive_dtype == "int8"  # one byte per element + a float32 scale per token, head, K/V
    archive_elem = elem if settings.archive_dtype == "auto" else 1 if int8 else dtype_bytes(
        settings.archive_dtype)
    per_head_token = 2 * dims["head_dim"] * archive_elem + (2 * 4 if int8 else 0)
    return {
        "recall_tokens": recall_tokens,
        "archive_dtype": info.dtype if settings.archive_dtype == "auto" else settings.archive_dtype,
        "recall_page": settings.recall_page,
        "archive_bytes_per_evicted_token": {
            "file": heads * per_head_token,
            "index": heads * (4 + 2 * SUMMARY_DTYPE.itemsize * dims["head_dim"] // settings.recall_page),
        },
    }


def process_rss() -> int:
    """Resident memory of this process now (psutil), after a garbage collection."""
    import gc

    import psutil

    gc.collect()
    return int(psutil.Process().memory_info().rss)


def warm_baseline(model: Any, device: Any, before_load: int) -> int:
    """A CPU plan's runtime baseline: the process's RSS once ``model`` is loaded and has run a few tokens, less its
    weights' bytes, and never less than ``before_load`` (the RSS before the model loaded). The tokenizer, the model's
    Python objects, the code transformers imports while loading and the math libraries' start-up are then in it: a
    baseline taken before the model loaded left them out, and a run's measured peak passed its plan."""
    import torch

    with torch.inference_mode():  # a plain forward (no kvtool cache): transformers' own attention
        model(input_ids=torch.zeros(1, 4, dtype=torch.long, device=device))
    return max(before_load, process_rss() - parameter_bytes(model)[1])


#: what ``kvtool profile --doc`` asks about each document (``--question``): an answer is decoded and measured too
DEFAULT_QUESTION = "What is this document about?"


def measure(session: Any, inputs: list[tuple[str, Any]], question: str) -> dict[str, Any]:
    """Read each input in turn (``("document", Document)``, or ``("kvc", path)`` for a saved cache) and answer
    ``question`` about it, under the session's meter (RSS on a CPU, the CUDA allocator's peak on a GPU): the
    measured side of the plan. Several inputs share one cache, emptied between them, as a run over many documents
    reads them (``Session.reuse_cache``). Returns ``kvtool profile``'s ``measured`` object but its ratio."""
    from kvtool.runtime import store

    meter = session.engine.meter
    session.reuse_cache = len(inputs) > 1
    docs: list[dict[str, Any]] = []
    first: dict[str, Any] = {}
    with meter.track():
        for kind, source in inputs:
            read = store.load_cache(source, session) if kind == "kvc" else session.read(source)
            try:
                if not first:  # the plan's K/V is the read's (recall adds its slots only while answering)
                    first = {"kv_allocated_bytes": read.cache.allocated_bytes(),
                             "kv_promised_bytes": read.cache.promised_bytes()}
                session.reset_counters()
                docs.append({"name": read.name, "loaded_from": read.loaded_from, "document_tokens":
                             read.document_tokens, "prefix_tokens": read.prefix_tokens,
                             "seconds": round(read.seconds, 3), **_answer(session, read, question)})
            finally:
                read.close()
    on_cuda = session.loaded.device.type == "cuda"
    return {"peak_bytes": int(meter.peak_bytes()), "metric": "cuda_max_allocated" if on_cuda else "rss_peak",
            "document_tokens": docs[0]["document_tokens"], "prefix_tokens": docs[0]["prefix_tokens"],
            "seconds": docs[0]["seconds"], **first, "question": question, "documents": docs}


def _answer(session: Any, read: Any, question: str) -> dict[str, Any]:
    """Answer ``question`` about ``read`` for ``measure``: what it decoded and recalled, the K/V then held; a question
    the budget cannot hold beside its windows is not asked, and ``note`` says why (the read is measured alone)."""
    from kvtool.errors import UsageError, first_line

    try:
        answer = session.ask(read, question)
    except UsageError as e:
        if e.field != "budget":
            raise
        return {"answer_tokens": None, "recalled_tokens": 0, "question_tokens": None,
                "kv_allocated_bytes": read.cache.allocated_bytes(), "note": f"not answered: {first_line(e)}"}
    return {"answer_tokens": answer.tokens, "recalled_tokens": session.recalled_tokens_max,
            "question_tokens": answer.prompt_tokens, "kv_allocated_bytes": read.cache.allocated_bytes()}
