"""kvtool side by side with NVIDIA kvpress on the same cases, the same prompt and the same per-head budget.

    python bench/peer/compare.py                  # builds bench/peer/.venv (kvpress) once, then runs
    python bench/peer/compare.py --budget 256 --policies sink,snapkv,tova,keydiff,h2o

kvpress pins an older transformers, so it gets its own virtualenv (``bench/peer/.venv``: torch, kvpress
and what they need, from the package registry) and never enters kvtool's environment. Both tools load the
same embedded SmolLM2-135M-Instruct checkpoint from kvtool's model cache. Policies map to presses:
sink → StreamingLLMPress, snapkv → SnapKVPress, tova → TOVAPress, keydiff → KeyDiffPress, h2o →
ObservedAttentionPress; kvpress's compression ratio is 1 − budget/context tokens so that both keep
``budget`` tokens of the document per head. Every (tool, policy) runs in a fresh process (its peak RSS
is its own); finished runs are kept in bench/results-runs/peer/ and skipped next time (resumable).

Cases: the needle trials (``secret number`` wording at one length, several depths) and the agreement
questions on one essay. Reported per row: needle found-rate (Wilson 95%), token F1 of each answer against
the same tool's own uncompressed answer (bootstrap 95%), peak RSS and wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "bench" / "results-runs" / "peer"
VENV = ROOT / "bench" / "peer" / ".venv"
KVPRESS = "kvpress==0.5.5"


def build_cases(length: int, depths: list[float], trials: int, budget: int) -> dict:
    from kvtool.eval import load_text
    from kvtool.eval.needle import Haystack, build_document, passkey_needle
    from kvtool.runtime import prompt
    from kvtool.runtime.model import load_model

    loaded = load_model(None)
    tok = loaded.tokenizer
    hay = Haystack(load_text(ROOT.parent / "shared" / "corpus" / "paul_graham_essays", "--haystack"), tok, length)
    groups = []
    for d in depths:
        for t in range(trials):
            n = passkey_needle(0, t)
            ntok = len(tok(" " + n.text + " ", add_special_tokens=False)["input_ids"])
            text, _, _ = build_document(hay, [n], length, d, 0, t, ntok)
            groups.append({"id": f"needle L={length} d={d:g} t={t}", "kind": "needle", "document": text,
                           "questions": [n.question], "answers": [n.answer], "max_new_tokens": 16})
    doc = (ROOT.parent / "shared" / "corpus" / "paul_graham_essays" / "aord.txt").read_text(encoding="utf-8")
    qs = [q.strip() for q in (ROOT / "bench" / "data" / "aord_questions.txt").read_text().splitlines() if q.strip()]
    groups.append({"id": "agreement aord", "kind": "agreement", "document": doc, "questions": qs, "answers": None,
                   "max_new_tokens": 32})
    for g in groups:
        g["prompts"] = [prompt.ASK_INSTRUCTION.format(question=q) for q in g["questions"]]
    return {"model": loaded.source, "budget": budget, "groups": groups}


def ensure_venv() -> Path:
    py = VENV / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import kvpress"], capture_output=True).returncode == 0:
        return py
    print(f"creating {VENV} with {KVPRESS} (its own transformers) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(py), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "torch==2.13.0"], check=False)  # the CPU wheel where one is on local disk
    subprocess.run([*pip, KVPRESS], check=True)
    return py


def run(impl: str, policy: str, cases_path: Path, model: str, budget: int) -> dict:
    out = OUT / f"{cases_path.stem}-{impl}-{policy}.json"
    if out.exists():
        return json.loads(out.read_text())
    tmp = out.with_suffix(".tmp")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if impl == "kvpress":
        argv = [str(ensure_venv()), str(ROOT / "bench" / "peer" / "run_kvpress.py"), "--press", policy]
        argv += ["--model", model]
    else:
        argv = [sys.executable, str(ROOT / "bench" / "peer" / "run_kvtool.py"), "--policy", policy]
    argv += ["--cases", str(cases_path), "--budget", str(budget), "--out", str(tmp)]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{impl} {policy} failed:\n{proc.stderr[-3000:]}")
    tmp.replace(out)
    print(f"  {impl:8s} {policy:8s} {time.perf_counter() - t0:7.1f} s", flush=True)
    return json.loads(out.read_text())


def summarize(cases: dict, results: list[dict]) -> list[dict]:
    from kvtool.eval.metrics import contains_answer, token_f1
    from kvtool.eval.stats import bootstrap_mean, wilson

    by = {(r["impl"], r["policy"]): r for r in results}
    rows = []
    for r in results:
        ref = by.get((r["impl"], "full"))
        found = total = 0
        f1s: list[float] = []
        for case, got in zip(cases["groups"], r["groups"], strict=True):
            if case["kind"] == "needle":
                total += 1
                found += int(contains_answer(got["answers"][0], case["answers"][0]))
            elif ref is not None:
                ref_group = next(g for g in ref["groups"] if g["id"] == case["id"])
                f1s += [token_f1(a, b) for a, b in zip(ref_group["answers"], got["answers"], strict=True)]
        rows.append({"impl": r["impl"], "policy": r["policy"], "budget": None if r["policy"] == "full" else r["budget"],
                     "needle": wilson(found, total).as_dict(), "needle_found": found, "needle_total": total,
                     "f1_vs_own_full": bootstrap_mean(f1s).as_dict() if f1s else None,
                     "peak_rss_bytes": r["peak_rss_bytes"], "seconds": round(r["seconds"], 1),
                     "answers": [g["answers"] for g in r["groups"]]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--policies", default="full,sink,snapkv,tova,keydiff,h2o")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    cases_path = OUT / f"cases-{args.length}-{args.depths.replace(',', '_')}-{args.trials}-{args.budget}.json"
    if cases_path.exists():
        cases = json.loads(cases_path.read_text())
    else:
        cases = build_cases(args.length, [float(d) for d in args.depths.split(",")], args.trials, args.budget)
        cases_path.write_text(json.dumps(cases))
    t0 = time.perf_counter()
    results = []
    for policy in [p for p in args.policies.split(",") if p]:
        for impl in ("kvtool", "kvpress"):
            results.append(run(impl, policy, cases_path, cases["model"], args.budget))
    rows = summarize(cases, results)
    (OUT.parent / "peer.json").write_text(json.dumps({"budget": args.budget, "length": args.length,
                                                      "cases": len(cases["groups"]), "rows": rows,
                                                      "command": "python bench/peer/compare.py " + " ".join(
                                                          sys.argv[1:]),
                                                      "seconds": round(time.perf_counter() - t0, 1)}, indent=1))
    for row in rows:
        print(f"{row['impl']:8s} {row['policy']:8s} needle {row['needle_found']}/{row['needle_total']} "
              f"F1 {row['f1_vs_own_full']} peak {row['peak_rss_bytes'] / 2**20:.0f} MiB {row['seconds']} s")


if __name__ == "__main__":
    main()
