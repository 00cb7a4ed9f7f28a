"""Does recall help `summarize`? Summaries with and without recall against the dense summary.

    python bench/summarize_recall.py --docs 8 --length 2k --budget 256 --recall 256

``summarize`` has no question; with ``--recall`` it recalls with the summary instruction's queries.
Each of ``--docs`` essays from ../shared/corpus/paul_graham_essays (the first ``--length`` tokens of
each, alphabetical) is read once per policy run and summarized (``--summary-length short``, greedy):
``full`` (the dense reference), the policy at ``--budget``, and the policy + ``--recall``. Prints one
JSON object: ROUGE-L and token F1 of each bounded summary against the dense one (mean with a
percentile-bootstrap 95% interval over documents) and the paired difference recall − no recall
(bootstrap interval): an interval containing 0 means recall did not measurably change the summary.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from kvtool.documents import text_document
    from kvtool.eval.metrics import rouge_l, token_f1
    from kvtool.eval.stats import bootstrap_mean, paired_difference
    from kvtool.runtime.model import load_model
    from kvtool.runtime.session import Session
    from kvtool.runtime.settings import resolve_settings

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--length", type=int, default=2048, help="document tokens")
    ap.add_argument("--budget", default="256")
    ap.add_argument("--recall", default="256")
    ap.add_argument("--policy", default=None, help="default: kvtool's default policy")
    ap.add_argument("--summary-length", default="short")
    ap.add_argument("--corpus", default=str(ROOT.parent / "shared" / "corpus" / "paul_graham_essays"))
    args = ap.parse_args()

    loaded = load_model(None)
    tok = loaded.tokenizer
    texts = []
    for path in sorted(Path(args.corpus).glob("*.txt")):
        ids = tok(path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
        if len(ids) >= args.length:
            texts.append((path.name, tok.decode(ids[: args.length])))
        if len(texts) == args.docs:
            break
    runs = {"full": {"policy": "full"}, "off": {"budget": args.budget},
            "on": {"budget": args.budget, "recall": args.recall}}
    summaries: dict[str, list[str]] = {k: [] for k in runs}
    for name, over in runs.items():
        if args.policy and name != "full":
            over["policy"] = args.policy
        s = Session(resolve_settings(None, over), loaded=loaded)
        for doc_name, text in texts:
            read = s.read(text_document(text, doc_name))
            summaries[name].append(s.summarize(read, args.summary_length).answer)
            print(name, doc_name, repr(summaries[name][-1][:100]), file=sys.stderr, flush=True)
    out: dict = {"docs": [n for n, _ in texts], "length": args.length, "budget": args.budget, "recall": args.recall,
                 "policy": args.policy or "default"}
    for metric, fn in (("rouge_l", rouge_l), ("token_f1", token_f1)):
        vals = {k: [fn(ref, got) for ref, got in zip(summaries["full"], summaries[k], strict=True)]
                for k in ("off", "on")}
        for k, v in vals.items():
            iv = bootstrap_mean(v)
            out[f"{metric}_{k}"] = [round(iv.value, 3), round(iv.low, 3), round(iv.high, 3)]
        d = paired_difference(vals["on"], vals["off"])
        out[f"{metric}_on_minus_off"] = [round(d.value, 3), round(d.low, 3), round(d.high, 3)]
    out["summaries"] = summaries
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
