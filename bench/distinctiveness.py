"""KeyDiff's observation on the embedded model: per layer, do distinctive keys receive high attention?

    python bench/distinctiveness.py --samples 12 --window 512 --resume bench/results-runs/distinctiveness.jsonl

Windows of ``--window`` tokens at seeded offsets, spread round-robin over the texts (as ``kvtool eval
ppl`` spreads its windows); one dense forward per window (no eviction); per layer the Spearman and
Pearson correlations between a key's distinctiveness (1 − cosine to its head's mean normalised key) and
the mean attention it receives (``kvtool.eval.distinctiveness``), with a 95% bootstrap interval over
windows. Prints one JSON object; resumable (one line per finished window).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CORPUS = "../shared/corpus"
TEXTS = f"{CORPUS}/sherlock_holmes.txt,{CORPUS}/pride_and_prejudice.txt,{CORPUS}/paul_graham_essays"


def summarize(per_window: list[list[dict[str, float]]], seed: int = 0) -> dict:
    """Per layer: mean Spearman and Pearson over windows with bootstrap intervals; how many layers are above 0."""
    from kvtool.eval.stats import bootstrap_mean

    layers = []
    for i in range(len(per_window[0])):
        row = {"layer": i}
        for name in ("spearman", "pearson"):
            row[name] = bootstrap_mean([w[i][name] for w in per_window], seed=seed).as_dict()
        layers.append(row)
    above = sum(r["spearman"]["low"] > 0 for r in layers)
    below = sum(r["spearman"]["high"] < 0 for r in layers)
    overall = bootstrap_mean([sum(x["spearman"] for x in w) / len(w) for w in per_window], seed=seed).as_dict()
    return {"layers": layers, "layers_above_zero": above, "layers_below_zero": below,
            "mean_spearman": overall, "windows": len(per_window)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", default=TEXTS, help="comma list of documents or directories")
    ap.add_argument("--samples", type=int, default=12, help="windows (spread over the texts)")
    ap.add_argument("--window", type=int, default=512, help="tokens per window")
    ap.add_argument("--min-queries", type=int, default=32, help="keys seen by fewer queries are left out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", default=None, help="JSONL of finished windows")
    args = ap.parse_args()
    from kvtool.errors import KvtoolError, UsageError

    try:
        print(json.dumps(run(args)))
    except (UsageError, KvtoolError) as e:
        raise SystemExit(f"error: {e}") from None


def run(args: argparse.Namespace) -> dict:
    import torch

    from kvtool.eval import CellLog, load_text, resolve_input, split_list
    from kvtool.eval.distinctiveness import measure_window
    from kvtool.eval.ppl import pick_offsets
    from kvtool.runtime.model.loading import load_model
    from kvtool.runtime.tokens import bos_prefix

    t0 = time.perf_counter()
    if args.samples < 1 or args.window < args.min_queries + 3:
        raise SystemExit("error: --samples must be >= 1 and --window >= --min-queries + 3")
    texts = [(p.name, load_text(p, "--text")) for p in (resolve_input(x, "", "--text")
                                                        for x in split_list(args.text, "--text"))]
    loaded = load_model(None, "cpu", "float32", None)
    settings = {"model": loaded.identity, "window": args.window, "min_queries": args.min_queries,
                "seed": args.seed, "texts": [n for n, _ in texts]}
    log = CellLog(args.resume, "distinctiveness", settings)
    prefix = bos_prefix(loaded.tokenizer)
    width = args.window - len(prefix)
    per_window, keys = [], []
    for i, (name, text) in enumerate(texts):
        k = (args.samples - i + len(texts) - 1) // len(texts)
        if k <= 0:
            continue
        ids = loaded.tokenizer(text[: 16 * 1024 * 1024], add_special_tokens=False)["input_ids"]
        for off in pick_offsets(len(ids), width, k, args.seed + i):
            key = f"{name}@{off}"
            window = torch.tensor(prefix + list(ids[off: off + width]), dtype=torch.long)
            print(f"[distinctiveness] {key}", file=sys.stderr, flush=True)
            per_window.append(log.cached(key, lambda w=window: measure_window(loaded.model, w, args.min_queries)))
            keys.append(key)
    return {"task": "distinctiveness", "settings": settings, "windows": keys, **summarize(per_window, args.seed),
            "seconds": round(time.perf_counter() - t0, 1)}


if __name__ == "__main__":
    main()
