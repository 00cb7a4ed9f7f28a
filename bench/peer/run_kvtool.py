"""Run kvtool on the peer cases in a fresh process: answers, wall time and peak RSS (kvtool's environment).

    python bench/peer/run_kvtool.py --cases CASES.json --policy snapkv --budget 256 --out OUT.json

The twin of ``run_kvpress.py``: same cases, same prompt (kvtool's chat template + instruction), greedy
decoding without repetition penalty (kvpress has none), one process per (tool, policy) so the peak
memory is the run's own.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True)
    ap.add_argument("--policy", required=True)
    ap.add_argument("--budget", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--block-size", type=int, default=128)
    args = ap.parse_args()

    from kvtool.documents import text_document
    from kvtool.runtime.session import Session
    from kvtool.runtime.settings import resolve_settings

    cases = json.load(open(args.cases, encoding="utf-8"))
    out = {"impl": "kvtool", "policy": args.policy, "budget": args.budget, "groups": []}
    t_all = time.perf_counter()
    session = None
    for group in cases["groups"]:
        overrides = {"policy": args.policy, "block_size": args.block_size, "max_new_tokens": group["max_new_tokens"],
                     "repetition_penalty": 1.0, "positions": "absolute"}
        if args.policy != "full":
            overrides["budget"] = str(args.budget)
        if session is None:
            session = Session(resolve_settings(None, overrides))
        # one session (one model load) for every group, but each group's own answer length, as kvpress gets
        session.settings.max_new_tokens = group["max_new_tokens"]
        t0 = time.perf_counter()
        read = session.read(text_document(group["document"], group["id"]))
        answers = [session.ask(read, q).answer for q in group["questions"]]
        out["groups"].append({"id": group["id"], "answers": answers, "context_tokens": read.document_tokens,
                              "seconds": time.perf_counter() - t0})
    out["seconds"] = time.perf_counter() - t_all
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
