"""What ``--kv-dtype`` costs in prefill speed and buys in memory: the same read with each cache dtype.

    python bench/kv_dtype.py --length 8k --budget 1k --dtypes auto,int8,int4 --repeats 3     # speed, equal tokens
    python bench/kv_dtype.py --length 32k --budget 1k --repeats 2                            # peak, equal tokens
    python bench/kv_dtype.py --length 32k --budget 12MiB --repeats 2                         # peak, equal bytes

Each run is one read and one question (``bench/recall.py``'s child, recall off) in its own child
process, so its peak memory is its own (RSS sampled every 5 ms). The dtypes run in a rotated order
each repeat (auto-int8-int4, int8-int4-auto, …) so a drift of this shared machine's speed hits all
alike. A token budget (``1k``) compares the dtypes at equal tokens: what quantization alone costs in
speed, and whether the smaller buffers lower the peak. A byte budget (``12MiB``) compares them at
equal bytes: int8 then holds ~4× the tokens of a float32 cache (~2× of bf16).

Prints one JSON object: per dtype the median prefill tokens/s, peak RSS, tokens per head and bytes per
token; each quantized dtype's speed ratio to ``auto`` (median and per repeat, the noise) and peak
ratio. Targets: speed ≥ 0.85× of the unquantized cache at 8K; peak at 32K ≤ the unquantized peak.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECALL = Path(__file__).with_name("recall.py")


def run_one(args: argparse.Namespace, dtype: str) -> dict:
    """One read + ask with cache dtype ``dtype`` in a fresh process (bench/recall.py's child, recall off)."""
    argv = [sys.executable, str(RECALL), "--child", "off", "--length", args.length, "--budget", args.budget,
            "--kv-dtype", dtype, "--text", args.text]
    if args.policy:
        argv += ["--policy", args.policy]
    proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", default="8k")
    ap.add_argument("--budget", default="1k", help="tokens per head (equal tokens) or bytes, e.g. 12MiB (equal bytes)")
    ap.add_argument("--dtypes", default="auto,int8,int4", help="the first is the reference")
    ap.add_argument("--policy", default=None, help="default: kvtool's default policy")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--text", default=str(ROOT.parent / "shared" / "corpus" / "sherlock_holmes.txt"))
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    rows: dict[str, list[dict]] = {d: [] for d in dtypes}
    for i in range(args.repeats):
        for d in dtypes[i % len(dtypes):] + dtypes[: i % len(dtypes)]:
            rows[d].append(run_one(args, d))
            print(d, rows[d][-1], file=sys.stderr, flush=True)

    def med(d: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[d])

    ref = dtypes[0]
    out: dict = {"length": args.length, "budget": args.budget, "policy": rows[ref][0]["policy"],
                 "repeats": args.repeats, "dtypes": {}}
    for d in dtypes:
        out["dtypes"][d] = {
            "kv_dtype": rows[d][0]["kv_dtype"], "budget_tokens": rows[d][0]["budget_tokens"],
            "kv_bytes_per_token": rows[d][0]["kv_bytes_per_token"],
            "prefill_tps": med(d, "prefill_tokens_per_second"), "peak_rss_bytes": med(d, "peak_rss_5ms_bytes"),
            "kv_cache_bytes": med(d, "kv_cache_bytes"), "found": [r["found"] for r in rows[d]],
            "speed_ratio": round(med(d, "prefill_tokens_per_second") / med(ref, "prefill_tokens_per_second"), 3),
            # per repeat: each run against the reference's run of the same repeat (their spread is the noise)
            "speed_ratio_repeats": [round(r["prefill_tokens_per_second"] / a["prefill_tokens_per_second"], 3)
                                    for r, a in zip(rows[d], rows[ref], strict=True)],
            "peak_ratio": round(med(d, "peak_rss_5ms_bytes") / med(ref, "peak_rss_5ms_bytes"), 3),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
