"""The KV memory RazorAttention really holds, against the dense cache and against `h2o`/`sink` at equal bytes.

    python bench/razor_bytes.py --docs a.txt,b.txt --budgets 256,1024

Per document: one read by `full` (the dense cache: every token's K and V) and one by each of `razor`,
`h2o` and `sink` per budget, in one process (the model loads once). From each read's stats
(`Session.stats`, what `kvtool ask --stats --json` prints): the K/V bytes the cache allocated
(`kv_cache_bytes`), stored (`kv_cache_stored_bytes`) and promised (`kv_budget_bytes`), and razor's
per-layer split (`budget_split`). Bytes become an equal-bytes budget by dividing by the dense read's
bytes per token per KV head (layers × 2 × head_dim × element size). Also computed: the budget at
which every retrieval head keeps the whole prompt (the paper's setting: retrieval heads whole) and the
reduction it gives (one layer whose KV heads are all retrieval heads keeps everything under a per-layer
budget), and the reduction of the paper's own layout (retrieval heads whole, every other head sinks + a
buffer of N/5 + a compensation token; no per-layer budget). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def whole_budget(split: list[dict], tokens: int, num_kv_heads: int, sinks: int) -> int:
    """Smallest per-head budget at which razor's retrieval heads hold ``tokens`` tokens in every layer.

    The retrieval capacity grows with the budget (razor's split, ``kvtool.policies.razor``), so a
    bisection over ``[sinks + 2, tokens · num_kv_heads]`` finds it.
    """
    from kvtool.core.contract import PolicyEnv
    from kvtool.errors import UsageError
    from kvtool.policies.razor.policy import Razor

    heads = {s["layer"]: s["retrieval_heads"] for s in split}

    def capacity(budget: int) -> int:
        env = PolicyEnv(num_layers=len(split), num_kv_heads=num_kv_heads, num_attention_heads=num_kv_heads,
                        head_dim=2, budget=budget, sinks=sinks, retrieval_heads=lambda **_: heads)
        razor = Razor()
        razor.env = env
        rows = razor.budget_split(env)
        return min((r["retrieval_capacity"] for r in rows if r["retrieval_heads"]), default=budget)

    lo, hi = sinks + 2, tokens * num_kv_heads
    if capacity(hi) < tokens:
        return hi
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            ok = capacity(mid) >= tokens
        except UsageError:  # a budget too small to split a layer
            ok = False
        lo, hi = (lo, mid) if ok else (mid + 1, hi)
    return lo


def measure(doc: str, budgets: list[int], loaded) -> dict:
    """One document: the dense read's bytes, each policy's bytes per budget, razor's whole-heads budget."""
    from kvtool.documents import open_document
    from kvtool.eval import make_grid, make_session

    grid = make_grid("razor,h2o,sink", ",".join(map(str, budgets)), always_full=True)
    rows = []
    for run in grid.runs():
        session = make_session(grid, run, loaded)
        with session.read(open_document(doc)) as read:
            s = session.stats(read)
        rows.append({"policy": run.policy, "budget": s["budget"], "allocated": s["kv_cache_bytes"],
                     "stored": s["kv_cache_stored_bytes"], "promised": s["kv_budget_bytes"],
                     "tokens": s["document_tokens"] + s["prefix_tokens"], "split": s.get("budget_split")})
    dense = rows[0]
    hkv = loaded.model.config.num_key_value_heads
    per_head_token = dense["stored"] / (dense["tokens"] * hkv)  # bytes of one token in one KV head, all layers
    for r in rows:
        r["reduction_vs_dense"] = 1.0 - r["stored"] / dense["stored"]
        r["equal_bytes_budget"] = r["promised"] / (hkv * per_head_token) if r["promised"] else None
    split = next(r["split"] for r in rows if r["policy"] == "razor")
    whole = whole_budget(split, dense["tokens"], hkv, grid.settings.sinks)
    retrieval = sum(len(s["retrieval_heads"]) for s in split)
    total_heads = hkv * len(split)
    # the paper's layout (Table 2): retrieval heads whole, the others sinks + a buffer of N/5 (+ compensation)
    other = (grid.settings.sinks + dense["tokens"] // 5 + 1) / dense["tokens"]
    paper = 1.0 - (retrieval + (total_heads - retrieval) * other) / total_heads
    return {"doc": Path(doc).name, "tokens": dense["tokens"], "dense_bytes": dense["stored"],
            "bytes_per_token_per_head": per_head_token, "retrieval_kv_heads": retrieval,
            "kv_heads": total_heads, "paper_layout_reduction": paper, "whole_budget": whole,
            "whole_reduction": 1.0 - whole / dense["tokens"],
            "rows": [{k: v for k, v in r.items() if k != "split"} for r in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", required=True, help="comma list of documents")
    ap.add_argument("--budgets", default="256,1024")
    args = ap.parse_args()
    from kvtool.errors import KvtoolError, UsageError
    from kvtool.runtime.model.loading import load_model

    t0 = time.perf_counter()
    try:
        budgets = [int(b) for b in args.budgets.split(",") if b]
        loaded = load_model(None, "cpu", "float32", None)
        docs = [measure(d, budgets, loaded) for d in args.docs.split(",") if d]
    except (UsageError, KvtoolError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    print(json.dumps({"task": "razor-bytes", "budgets": budgets, "docs": docs,
                      "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
