"""The default ``ask`` read against transformers' dense one pass at one length, in interleaved pairs.

    python bench/parity.py --length 4k --blocks 128,256 --rounds 6 --json OUT.json

One run measures ``--rounds`` rounds; each round runs dense, then the default ``ask`` path (``h2o``, recall, a
question) once per block size, every row in its own process (``bench/prefill.py``'s rows), the order rotated
from round to round. A CPU's rate drifts by several percent from minute to minute, so a ratio taken from two
rows minutes apart says little; the ratio of each round's rows is one unit, and the mean over rounds carries a
bootstrap 95% interval. Between two block sizes the paired difference of the ratios is reported the same way.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.jsonfile import write_json  # noqa: E402
from bench.prefill import child, parse_tokens  # noqa: E402
from kvtool.eval.stats import bootstrap_mean, fmt_interval, paired_difference  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", default="4k")
    ap.add_argument("--budget", default="1k")
    ap.add_argument("--blocks", default="128,256", help="the ask path's block sizes, each a row per round")
    ap.add_argument("--policy", default="h2o")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--decode-tokens", type=int, default=0)
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args()
    n, blocks = parse_tokens(args.length), [int(b) for b in args.blocks.split(",")]
    base = {"model": None, "config": None, "device": "cpu", "dtype": "auto", "budget": parse_tokens(args.budget),
            "decode_tokens": args.decode_tokens, "threads": None, "layers": None, "sync_timing": False,
            "sdpa_probe": False, "length": n}
    specs = [{**base, "kind": "dense", "block_size": blocks[0]}] + [
        {**base, "kind": "ask", "policy": args.policy, "tag": f"{args.policy}@{b}", "block_size": b} for b in blocks]
    rounds: list[dict] = []
    for r in range(args.rounds):
        order = specs[r % len(specs):] + specs[: r % len(specs)]
        rows = {spec.get("tag", "dense"): child(spec) for spec in order}
        bad = [f"{tag}: {row['error']}" for tag, row in rows.items() if "error" in row]
        if bad:
            print("ERROR " + "; ".join(bad), file=sys.stderr)
            return 1
        rate = {tag: n / row["prefill_seconds"] for tag, row in rows.items()}
        ratios = {b: rate[f"{args.policy}@{b}"] / rate["dense"] for b in blocks}
        rounds.append({"rates": rate, "ratios": ratios, "rows": list(rows.values())})
        print(f"round {r + 1}: dense {rate['dense']:.1f} tok/s; " + ", ".join(
            f"block {b}: {rate[f'{args.policy}@{b}']:.1f} ({ratios[b]:.3f}×)" for b in blocks), flush=True)
    summary = {}
    for b in blocks:
        iv = bootstrap_mean([x["ratios"][b] for x in rounds])
        summary[str(b)] = {"mean": iv.value, "low": iv.low, "high": iv.high}
        print(f"ask (block {b}) / dense at {args.length}: mean {fmt_interval(iv, 3)} over {len(rounds)} rounds")
    for b in blocks[1:]:
        d = paired_difference([x["ratios"][b] for x in rounds], [x["ratios"][blocks[0]] for x in rounds])
        summary[f"{b}-{blocks[0]}"] = {"mean": d.value, "low": d.low, "high": d.high}
        print(f"block {b} − block {blocks[0]}: {fmt_interval(d, 3)} (paired)")
    if args.json_path:
        write_json(args.json_path, {"command": " ".join(sys.argv), "length": n, "blocks": blocks,
                                    "rounds": rounds, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
