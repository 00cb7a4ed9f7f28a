"""Citation evidence and cost behind docs/results.md ("Citations"): is the needle the top citation, and
what does --cite cost?

    python bench/citations.py --policies full,sink,keydiff,h2o --budget 512 --trials 6
    python bench/citations.py --micro      # decode step time with and without the mass, interleaved

For every policy and trial a ~1K-token essay haystack gets a pass-key needle late in the text (depths
0.94–1.0, where SmolLM2-135M finds it), is read once, and the question is asked twice: without and with
citations (greedy, so the answers must be identical). Reported per policy: answers right, needle = top
citation among those, and decode seconds per token without/with --cite (+ the ranking after decoding).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from kvtool.documents import text_document
from kvtool.eval import load_text
from kvtool.eval.needle import Haystack, insert_needle, passkey_needle
from kvtool.runtime.model import load_model
from kvtool.runtime.session import Session
from kvtool.runtime.settings import resolve_settings

ROOT = Path(__file__).resolve().parents[1]
DEPTHS = (0.94, 0.96, 0.98, 1.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policies", default="full,sink,keydiff,h2o")
    ap.add_argument("--budget", default="512")
    ap.add_argument("--length", type=int, default=1000)
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--haystack", default=str(ROOT.parent / "shared" / "corpus" / "paul_graham_essays"))
    ap.add_argument("--micro", action="store_true", help="only time decode steps with/without citing")
    args = ap.parse_args()
    torch.manual_seed(0)
    loaded = load_model(None)
    hay = Haystack(load_text(Path(args.haystack), "--haystack"), loaded.tokenizer, args.length)
    base, starts = hay.cut(args.length - 30)
    if args.micro:
        micro(loaded, base, args.policies.split(",")[0], args.budget)
        return
    rows = []
    for policy in args.policies.split(","):
        settings = resolve_settings(None, {"policy": policy, "budget": args.budget, "max_new_tokens": 16})
        session = Session(settings, loaded=loaded)
        row = {"policy": policy, "budget": None if policy == "full" else args.budget, "trials": args.trials,
               "answered": 0, "top_is_needle": 0, "same_answer": 0, "decode_s": 0.0, "decode_cite_s": 0.0,
               "rank_s": 0.0, "tokens": 0}
        for trial in range(args.trials):
            needle = passkey_needle(0, trial)
            doc, at = insert_needle(base, needle.text, DEPTHS[trial % len(DEPTHS)], starts)
            read = session.read(text_document(doc, "haystack"))
            plain = session.ask(read, needle.question)
            cited = session.ask(read, needle.question, cite_spans=True)
            row["same_answer"] += plain.answer == cited.answer
            row["decode_s"] += plain.seconds
            row["decode_cite_s"] += cited.seconds
            row["rank_s"] += cited.cite_seconds
            row["tokens"] += plain.tokens
            if needle.answer in cited.answer:
                row["answered"] += 1
                top = cited.citations[0] if cited.citations else None
                row["top_is_needle"] += bool(top and top.start_char < at + len(needle.text) and top.end_char > at)
        t = max(1, row["tokens"])
        row["ms_per_token"] = round(1000 * row["decode_s"] / t, 2)
        row["ms_per_token_cite"] = round(1000 * row["decode_cite_s"] / t, 2)
        row["overhead_pct"] = round(100 * (row["decode_cite_s"] - row["decode_s"]) / row["decode_s"], 1)
        row["rank_overhead_pct"] = round(100 * row["rank_s"] / row["decode_s"], 1)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)  # progress; the report is the last line, on stdout
    print(json.dumps({"length": args.length, "depths": DEPTHS, "rows": rows, "when": time.strftime("%F")}))


def micro(loaded, text: str, policy: str, budget: str, steps: int = 32, rounds: int = 9) -> None:
    """Median per-token decode time over ``rounds`` interleaved runs of ``steps`` steps, off vs on.

    Same cache (restored before each run), same tokens: the only difference is ``start_mass``.
    """
    import statistics

    session = Session(resolve_settings(None, {"policy": policy, "budget": budget}), loaded=loaded)
    read = session.read(text_document(text, "haystack"))
    cache, engine = read.cache, session.engine
    tokens = torch.randint(100, 1000, (steps,))
    times: dict[bool, list[float]] = {False: [], True: []}
    with torch.inference_mode():
        for _ in range(rounds):
            for cite in (False, True):
                cache.restore(read.snapshot)
                if cite:
                    cache.start_mass(first_layer=len(cache.layers) // 2)
                t0 = time.perf_counter()
                for t in tokens:
                    engine.step(cache, t.view(1))
                times[cite].append((time.perf_counter() - t0) / steps)
                cache.stop_mass()
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(json.dumps({"policy": policy, "budget": budget, "cached": max(cache.lengths()), "steps": steps,
                      "rounds": rounds, "ms_per_token": round(1000 * off, 2), "ms_per_token_cite": round(1000 * on, 2),
                      "overhead_pct": round(100 * (on - off) / off, 1)}))


if __name__ == "__main__":
    main()
