"""``kvtool profile``'s text report: the memory plan :func:`kvtool.runtime.profiling.plan` returns, drawn
as rich tables (the runtime computes, the CLI draws)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.table import Table

from kvtool.cli.shown import shown_text
from kvtool.runtime.memory import format_bytes

_F = format_bytes


def _b(n: int | None) -> str:
    return "n/a" if n is None else _F(n)


def component_rows(p: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(component, bytes, how it is computed) for the text table."""
    kv = p["kv_bytes_per_token"]
    at = p["kv_bytes_at_budget"]
    budget = p["budget_tokens"]
    block = p["block_size"]
    keys = f"{budget} + {block}" if budget is not None else f"doc + {block}"
    rows: list[tuple[str, str, str]] = [
        ("runtime baseline", _b(p["runtime_baseline_bytes"]),
         "measured RSS once loaded and warm, less the weights" if p["device"] == "cpu"
         else "0 on CUDA (allocator figures)"),
        ("weights", _b(p["weights_bytes"]), f"{p['num_params']:,} parameters ({p['dtype']}, {p['quantize']})"),
        ("KV per token, per layer per head", _b(kv["per_layer_per_head"]),
         f"K + V x head_dim x element ({p.get('kv_dtype', p['dtype'])}"
         + (", + a float16 scale each)" if p.get("kv_dtype") in ("int8", "int4") else ")")),
        ("KV per token, per layer", _b(kv["per_layer"]), "x KV heads"),
        ("KV per token, total", _b(kv["total"]), "x layers"),
    ]
    if at is not None:
        rows += [
            ("KV at budget (promised)", _b(at["promised"]),
             f"{budget if budget is not None else 'doc'} tokens per KV head"),
            ("KV allocated", _b(at["allocated"]), f"({keys}) tokens: capacity + one block"
             + (", + original keys (16-bit, compact positions)" if p.get("original_keys") else "")),
        ]
        for kind, v in (at.get("by_layer_kind") or {}).items():
            rows.append((f"  of which {kind} layers", _b(v["allocated"]),
                         f"{v['layers']} layers x {v['tokens_per_head']} tokens per KV head (+ one block)"
                         + (" = the window" if kind == "sliding" else "")))
    rows += [
        ("attention scratch (policy)", _b(p["attention_scratch_bytes"]),
         f"{p['attention_rows']} rows x ({keys}) keys, float32 x 2"),
        ("SDPA scratch", _b(p["sdpa_scratch_bytes"]), f"block x ({keys}) keys, one layer"),
        *([("K/V decode scratch", _b(p["kv_decode_scratch_bytes"]),
            f"one layer's ({keys}) K + V decoded to {p['dtype']} for attention")] if p.get("kv_decode_scratch_bytes")
          else []),
        *([("rotation scratch", _b(p["rotation_scratch_bytes"]),
            "keys turned to compact positions: the largest re-pack, and one step's float work")]
          if p.get("rotation_scratch_bytes") else []),
        ("policy score state", _b(p["policy_state_bytes"]), f"{p['policy_state_fields']} float32 field(s) per token"),
        ("positions", _b(p.get("positions_bytes")), "stream and RoPE positions, int64, per slot"),
        ("eviction scratch", _b(p.get("eviction_scratch_bytes")),
         "one eviction's scores and ranks, then its kept tokens' copy, for the layers evicted together"),
        ("activations", _b(p["activation_bytes"]), f"one block of {block} tokens + 1 row of logits"),
        ("cache snapshot", _b(p.get("snapshot_bytes")), "the post-document cache kept to restore per question"
         if not p.get("snapshot_host_bytes") else
         f"on the GPU: one layer's copy on its way ({_b(p['snapshot_host_bytes'])} in pinned host memory, copied "
         "back per question)"),
    ]
    if p.get("recall_tokens"):
        arch = p["archive_bytes_per_evicted_token"]
        rows += [
            ("recall slots", _b(p["recall_slots_bytes"]),
             f"{p['recall_tokens']} tokens per KV head: an answer holds budget + recall + one block "
             f"(K+V {_b(p['recall_kv_bytes'])} on top of the budget's promise"
             + (", inside the byte budget)" if p.get("budget_conversion") else ")")),
            ("recall scratch", _b(p["recall_scratch_bytes"]),
             f"scoring the archive for a question of {p['recall_question_tokens']} tokens: its queries, the "
             "scores held between two passes, one chunk"),
            ("recall growth", _b(p.get("recall_growth_bytes")),
             "making room for recall: the largest buffer held twice while it is reallocated"),
            ("archive appends", _b(p.get("archive_work_bytes")),
             "a block's evicted tokens gathered, summarised and packed, and every layer's rows staged for the file"),
            ("archive per evicted token", f"{_b(arch['file'])} + {_b(arch['index'])}",
             f"on disk, not in memory: K/V ({p['archive_dtype']}) + positions and summaries of "
             f"{p['recall_page']}-token pages, in unlinked temp files (KVTOOL_ARCHIVE_DIR or TMPDIR)"),
        ]
        if p.get("archive_doc_tokens") is not None:
            rows.append((f"archive of {p['archive_doc_tokens']:,} tokens", _b(p["archive_bytes"]),
                         f"on disk; {p['archive_verdict']}"))
    rows.append(("predicted peak", _b(p["predicted_peak_bytes"]),
                 "sum of the above (KV promised is inside allocated)"))
    return rows


def render_plan(p: Mapping[str, Any], console: Any) -> None:
    """Print the plan (and measurement, dense and memory comparisons, razor split) with rich."""
    budget = p["budget_tokens"]
    auto = " (auto: " + ("GPU-sized" if p["device"].startswith("cuda") else "the CPU's") + ")" \
        if p.get("block_auto") else ""
    head = f"{p['model']}  {p['dtype']} on {p['device']}  policy {p['policy']}  block {p['block_size']}{auto}  "
    head += f"budget {budget} tokens per KV head" if budget is not None else "no budget (full cache)"
    console.print(shown_text(head))  # the model's name is a directory's: drawn as text, controls escaped
    if p.get("budget_conversion"):
        console.print(shown_text(p["budget_conversion"]))
    table = Table(title="predicted memory plan")
    for col, justify in (("component", "left"), ("bytes", "right"), ("how", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for row in component_rows(p):
        table.add_row(*(shown_text(cell) for cell in row))
    console.print(table)
    m = p.get("measured")
    if m:
        console.print(
            f"measured peak {_F(m['peak_bytes'])} ({m['metric']}) vs predicted {_b(m['predicted_peak_bytes'])}: "
            f"ratio {m['ratio']:.3f}  ({m['document_tokens']} document tokens in {m['seconds']:.2f} s; "
            f"KV allocated {_F(m['kv_allocated_bytes'])})"
        )
        for d in m.get("documents", []):
            if d.get("note"):
                console.print(f"{d['name']}: {d['note']}")
    d = p.get("dense")
    if d:
        console.print(
            f"dense (no eviction), {d['doc_tokens']} tokens: KV {_F(d['kv_bytes'])}, "
            f"predicted peak {_F(d['predicted_peak_bytes'])}"
        )
    mem = p.get("memory")
    if mem:
        fits = "" if mem["fits"] is None else (" (this plan fits)" if mem["fits"] else " (this plan does NOT fit)")
        if mem.get("cuda_runtime_bytes"):
            fits += f" after {_F(mem['cuda_runtime_bytes'])} for the CUDA runtime (context, cuBLAS workspace)"
        console.print(
            f"in {_F(mem['limit_bytes'])}{fits}: largest budget {mem['largest_budget_tokens']} tokens per KV head; "
            f"dense transformers holds at most {mem['dense_max_tokens']} tokens"
        )
    split = p.get("budget_split")
    if split:
        render_split(split, console)


def render_split(split: list[Mapping[str, Any]], console: Any) -> None:
    """Razor's per-layer budget split as a table (whatever keys the policy reports)."""
    keys: list[str] = []
    for row in split:
        for k in row:
            if k not in keys:
                keys.append(k)
    table = Table(title="razor budget split (tokens per layer: retrieval heads keep most of the budget)")
    for k in keys:
        table.add_column(_SPLIT_HEADERS.get(k, str(k)), no_wrap=True)
    for row in split:
        table.add_row(*(_cell(row.get(k)) for k in keys))
    console.print(table)


_SPLIT_HEADERS = {
    "retrieval_heads": "retrieval heads",
    "retrieval_capacity": "each keeps",
    "other_heads": "other heads",
    "other_capacity": "each keeps",
    "total_tokens": "used",
    "budget_tokens": "budget",
    "unused_tokens": "unused",
}


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    return str(v)
