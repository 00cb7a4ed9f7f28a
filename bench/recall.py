"""What recall costs: prefill speed with archiving vs without, and recall's share of an ask.

    python bench/recall.py --length 8k --budget 256 --recall 256 --repeats 2

For each repeat, the same ~L-token text (Sherlock Holmes with a secret number at depth 0.5) is read and
asked about with recall off and on (in the order off-on, on-off, off-on, …, so that a drift of the
machine's speed — on this shared VM the first run after a pause is often the fastest — hits both alike), each in
its own child process so its peak memory is its own. Prints one JSON object: prefill tokens/s of
both and their ratio (the target: ≥ 0.9), the peak memory with recall against the peak
without plus the recall slots (≤ 1.05; RSS sampled every 5 ms by the bench itself, since kvtool's
own 50 ms sampler can miss recall's short-lived buffers — its figure is printed beside), recall's
share of the run's wall time (read + ask; ≤ 0.10),
the ask's own time, the recall seconds (first question pass + scoring the archive + reading what
comes back) and the archive's size. The archive lives where a run puts it: KVTOOL_ARCHIVE_DIR or the
temp directory; ``--archive-dtype int8`` stores it as ``kvtool ask --archive-dtype int8`` would.

Prefill speed on a shared 2-core machine drifts by up to ~15% between consecutive runs of the same
read (measured: 478 then 404 tok/s at 16K, recall off both times), so one pair says little: the
ratio of each pair is printed beside the ratio of the medians — use ``--repeats 3`` or more, and
``--pool A.json B.json …`` for the mean pair ratio over saved runs with a bootstrap 95% interval.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_tokens(text: str) -> int:
    text = text.strip().lower()
    return int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)


def child(args: argparse.Namespace, mode: str) -> dict:
    """One read + one question in this process (so its peak memory is its own)."""
    from kvtool.documents import text_document
    from kvtool.runtime.model import load_model
    from kvtool.runtime.session import Session
    from kvtool.runtime.settings import resolve_settings

    loaded = load_model(None)
    tok = loaded.tokenizer
    n = parse_tokens(args.length)
    ids = tok(Path(args.text).read_text(encoding="utf-8")[: n * 8], add_special_tokens=False)["input_ids"][:n]
    half = n // 2
    needle = " The secret number is 71432. Remember it: the secret number is 71432. "  # eval needle's wording
    doc = tok.decode(ids[:half]) + needle + tok.decode(ids[half:])
    over = {"budget": args.budget, "max_new_tokens": 16, "recall": args.recall if mode == "on" else "off",
            "repetition_penalty": 1.0, "archive_dtype": args.archive_dtype, "kv_dtype": args.kv_dtype}
    if args.policy:
        over["policy"] = args.policy
    s = Session(resolve_settings(None, over), loaded=loaded)
    proc, peak, done = psutil.Process(), [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], proc.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    read = s.read(text_document(doc))
    t1 = time.perf_counter()
    ans = s.ask(read, "What is the secret number?")
    t2 = time.perf_counter()
    done.set()
    sampler.join()
    st = s.stats(read)
    return {"prefill_tokens_per_second": st["prefill_tokens_per_second"], "read_seconds": t1 - t0,
            "ask_seconds": t2 - t1, "wall_seconds": t2 - t0, "recall_seconds": st["recall_seconds"],
            "archive_bytes": st["archive_bytes"], "kv_cache_bytes": st["kv_cache_bytes"],
            "peak_memory_bytes": st["peak_memory_bytes"], "peak_rss_5ms_bytes": max(peak[0], st["peak_memory_bytes"]),
            "policy": st["policy"], "found": "71432" in ans.answer, "kv_dtype": st["kv_dtype"],
            "budget_tokens": st["budget"], "kv_bytes_per_token": st["kv_bytes_per_token"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", default="8k")
    ap.add_argument("--budget", default="256")
    ap.add_argument("--recall", default="256")
    ap.add_argument("--policy", default=None, help="default: kvtool's default policy")
    ap.add_argument("--archive-dtype", default="auto", help="how archived K/V are stored (auto: the model's)")
    ap.add_argument("--kv-dtype", default="auto", help="how the cache stores K/V (auto: the model's)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--text", default=str(ROOT.parent / "shared" / "corpus" / "sherlock_holmes.txt"))
    ap.add_argument("--pool", nargs="+", metavar="JSON",
                    help="no runs: mean prefill ratio over the pairs of saved results, bootstrap 95%% interval")
    ap.add_argument("--child", choices=("off", "on"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.pool:
        from kvtool.eval.stats import bootstrap_mean

        pairs = [r for f in args.pool for r in json.loads(Path(f).read_text())["prefill_speed_ratio_pairs"]]
        print(json.dumps({"files": args.pool, "pairs": pairs,
                          "prefill_speed_ratio_mean": bootstrap_mean(pairs).as_dict(3)}, indent=1))
        return
    if args.child:
        print(json.dumps(child(args, args.child)))
        return
    rows: dict[str, list[dict]] = {"off": [], "on": []}
    for i in range(args.repeats):
        for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):  # ABBA: a linear drift cancels
            argv = [sys.executable, __file__, "--child", mode, "--length", args.length, "--budget", args.budget,
                    "--recall", args.recall, "--archive-dtype", args.archive_dtype, "--kv-dtype", args.kv_dtype,
                    "--text", args.text]
            if args.policy:
                argv += ["--policy", args.policy]
            proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=True)
            rows[mode].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(mode, rows[mode][-1], file=sys.stderr, flush=True)

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[mode])

    slots = med("on", "kv_cache_bytes") - med("off", "kv_cache_bytes")  # the recall slots, allocated with the cache
    out = {
        "length": parse_tokens(args.length), "policy": rows["on"][0]["policy"], "budget": args.budget,
        "recall": args.recall, "archive_dtype": args.archive_dtype, "repeats": args.repeats,
        "prefill_tps_off": med("off", "prefill_tokens_per_second"),
        "prefill_tps_on": med("on", "prefill_tokens_per_second"),
        # the targets: ≥ 0.9, ≤ 1.05, ≤ 0.10
        "prefill_speed_ratio": round(med("on", "prefill_tokens_per_second")
                                     / med("off", "prefill_tokens_per_second"), 3),
        # each pair's own ratio: their spread is this machine's run-to-run noise
        "prefill_speed_ratio_pairs": [round(on["prefill_tokens_per_second"] / off["prefill_tokens_per_second"], 3)
                                      for off, on in zip(rows["off"], rows["on"], strict=True)],
        "peak_off": med("off", "peak_rss_5ms_bytes"), "peak_on": med("on", "peak_rss_5ms_bytes"),
        "recall_slot_bytes": slots,
        "peak_ratio": round(med("on", "peak_rss_5ms_bytes") / (med("off", "peak_rss_5ms_bytes") + slots), 3),
        "peak_ratio_kvtool_meter": round(med("on", "peak_memory_bytes")
                                         / (med("off", "peak_memory_bytes") + slots), 3),
        "recall_share_of_wall": round(med("on", "recall_seconds") / med("on", "wall_seconds"), 4),
        "wall_seconds_off": round(med("off", "wall_seconds"), 2),
        "wall_seconds_on": round(med("on", "wall_seconds"), 2),
        "ask_seconds_off": round(med("off", "ask_seconds"), 3), "ask_seconds_on": round(med("on", "ask_seconds"), 3),
        "recall_seconds": med("on", "recall_seconds"),
        "archive_bytes": rows["on"][-1]["archive_bytes"],
        "found_off": [r["found"] for r in rows["off"]],
        "found_on": [r["found"] for r in rows["on"]],
        "runs": rows,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
