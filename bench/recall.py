"""What recall costs: prefill speed with archiving vs without, and recall's share of an ask.

    python bench/recall.py --length 8k --budget 256 --recall 256 --repeats 2

For each repeat, the same ~L-token text (Sherlock Holmes with a pass key at depth 0.5) is read and
asked about with recall off, then on (alternating, so drifting machine load hits both alike). Prints
one JSON object: prefill tokens/s of both, their ratio (issue 13's target: ≥ 0.9), the ask's wall
time, the recall seconds inside it (first question pass + page scoring + reading the archive), and
the archive's size. The archive lives where a run puts it: KVTOOL_ARCHIVE_DIR or the temp directory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_tokens(text: str) -> int:
    text = text.strip().lower()
    return int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", default="8k")
    ap.add_argument("--budget", default="256")
    ap.add_argument("--recall", default="256")
    ap.add_argument("--policy", default="keydiff")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--text", default=str(ROOT.parent / "shared" / "corpus" / "sherlock_holmes.txt"))
    args = ap.parse_args()

    from kvtool.runtime.document import text_document
    from kvtool.runtime.model import load_model
    from kvtool.runtime.session import Session
    from kvtool.runtime.settings import resolve_settings

    loaded = load_model(None)
    tok = loaded.tokenizer
    n = parse_tokens(args.length)
    ids = tok(Path(args.text).read_text(encoding="utf-8")[: n * 8], add_special_tokens=False)["input_ids"][:n]
    half = n // 2
    needle = " The pass key is 71432. Remember it. 71432 is the pass key. "
    doc = tok.decode(ids[:half]) + needle + tok.decode(ids[half:])
    rows: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for _ in range(args.repeats):
        for mode in ("off", "on"):
            s = Session(resolve_settings(None, {"policy": args.policy, "budget": args.budget, "max_new_tokens": 16,
                                                "recall": args.recall if mode == "on" else "off"}), loaded=loaded)
            read = s.read(text_document(doc))
            t0 = time.perf_counter()
            ans = s.ask(read, "What is the pass key?")
            ask_s = time.perf_counter() - t0
            st = s.stats(read)
            rows[mode].append({"prefill_tokens_per_second": st["prefill_tokens_per_second"], "ask_seconds": ask_s,
                               "recall_seconds": st["recall_seconds"], "archive_bytes": st["archive_bytes"],
                               "found": "71432" in ans.answer})
            print(mode, rows[mode][-1], file=sys.stderr, flush=True)

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[mode])

    out = {
        "length": n, "policy": args.policy, "budget": args.budget, "recall": args.recall, "repeats": args.repeats,
        "prefill_tps_off": med("off", "prefill_tokens_per_second"),
        "prefill_tps_on": med("on", "prefill_tokens_per_second"),
        "prefill_speed_ratio": round(med("on", "prefill_tokens_per_second")
                                     / med("off", "prefill_tokens_per_second"), 3),
        "ask_seconds_off": round(med("off", "ask_seconds"), 3),
        "ask_seconds_on": round(med("on", "ask_seconds"), 3),
        "recall_seconds": med("on", "recall_seconds"),
        "archive_bytes": rows["on"][-1]["archive_bytes"],
        "found_off": [r["found"] for r in rows["off"]],
        "found_on": [r["found"] for r in rows["on"]],
        "runs": rows,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
