"""Run the evaluation grid behind docs/results.md and write its tables.

    python bench/results.py            # ~30 min on 2 CPU cores; writes docs/results-data.json + tables

Each task is one ``kvtool eval ... --json`` command (printed in the document with its run time),
so anyone can rerun a single table. The prose findings in docs/results.md are written by hand from
these tables; this script regenerates the section between the RESULTS markers.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "results.md"
DATA = ROOT / "docs" / "results-data.json"
BUDGETS = "128,256,512,1024"
ALL = ("sink,h2o,tova,snapkv,scissorhands,keydiff,razor,h2o+vatp,scissorhands+vatp,h2o+caote,h2o+fastcaote,"
       "tova+caote,tova+fastcaote,snapkv+caote,snapkv+fastcaote,h2o+vatp+caote,tova+caote(greedy=true)")
CORE = "sink,h2o,tova,snapkv,scissorhands,keydiff,razor,h2o+vatp,h2o+caote,tova+caote,snapkv+fastcaote"
ATTN = "sink,h2o,tova,snapkv,keydiff,h2o+vatp,h2o+caote,tova+caote,tova+fastcaote,snapkv+caote"
TASKS = {
    "ppl": ["eval", "ppl", "--text", "../shared/corpus/sherlock_holmes.txt", "--context", "2k", "--continuation", "128",
            "--samples", "1", "--policies", ALL, "--budgets", BUDGETS],
    "needle": ["eval", "needle", "--haystack", "../shared/corpus/paul_graham_essays", "--lengths", "2k", "--depths",
               "0.1,0.5,0.9", "--trials", "1", "--policies", CORE, "--budgets", BUDGETS],
    "attn-error": ["eval", "attn-error", "--text", "../shared/corpus/pride_and_prejudice.txt", "--context", "1k",
                   "--continuation", "16", "--samples", "1", "--policies", ATTN, "--budgets", "128,256"],
}


def run(name: str) -> dict:
    argv = [str(ROOT / ".venv" / "bin" / "kvtool"), *TASKS[name], "--json", "--quiet"]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{name} failed: {proc.stderr.strip()}")
    return {"command": "kvtool " + shlex.join(TASKS[name]) + " --json", "seconds": seconds,
            "result": json.loads(proc.stdout)}


def table_ppl(task: dict) -> str:
    res = task["result"]
    budgets = sorted({r["budget"] for r in res["results"] if r["budget"] is not None})
    ref = res.get("reference", {}).get("ppl")
    lines = [f"Dense perplexity: **{ref:.3f}**. Cells: perplexity gap to dense in % (KL(dense‖policy), top-1 "
             "agreement).", "", "| policy | " + " | ".join(f"budget {b}" for b in budgets) + " |",
             "|---|" + "---|" * len(budgets)]
    for pol in dict.fromkeys(r["policy"] for r in res["results"] if r["budget"] is not None):
        cells = []
        for b in budgets:
            r = next((x for x in res["results"] if x["policy"] == pol and x["budget"] == b), None)
            cells.append("–" if r is None else f"{r['ppl_gap_pct']:+.1f}% ({r['kl']:.3f}, {r['top1']:.2f})")
        lines.append(f"| `{pol}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table_needle(task: dict) -> str:
    res = task["result"]
    budgets = sorted({r["budget"] for r in res["results"] if r["budget"] is not None})
    full = [r for r in res["results"] if r["budget"] is None]
    head = f"`full` (dense reference): {sum(r['correct'] for r in full)}/{sum(r['trials'] for r in full)} correct."
    lines = [head + " Cells: needles found (of depths 0.1, 0.5, 0.9).", "",
             "| policy | " + " | ".join(f"budget {b}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for pol in dict.fromkeys(r["policy"] for r in res["results"] if r["budget"] is not None):
        cells = []
        for b in budgets:
            rows = [x for x in res["results"] if x["policy"] == pol and x["budget"] == b]
            cells.append(f"{sum(r['correct'] for r in rows)}/{sum(r['trials'] for r in rows)}")
        lines.append(f"| `{pol}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table_attn(task: dict) -> str:
    res = task["result"]
    budgets = sorted({r["budget"] for r in res["results"] if r["budget"] is not None})
    lines = ["Cells: mean over layers of the normalised attention-output error (max over layers).", "",
             "| policy | " + " | ".join(f"budget {b}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for pol in dict.fromkeys(r["policy"] for r in res["results"]):
        cells = []
        for b in budgets:
            r = next((x for x in res["results"] if x["policy"] == pol and x["budget"] == b), None)
            cells.append("–" if r is None else f"{r['mean']:.3f} ({r['max']:.3f})")
        lines.append(f"| `{pol}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


RENDER = {"ppl": table_ppl, "needle": table_needle, "attn-error": table_attn}
TITLES = {"ppl": "Perplexity gap (CAOTE §4.3)", "needle": "Needle in a haystack",
          "attn-error": "Attention-output error (CAOTE App. E.4)"}


def main() -> None:
    names = sys.argv[1:] or list(TASKS)
    data = json.loads(DATA.read_text()) if DATA.exists() else {}
    for name in names:
        print(f"running {name} ...", flush=True)
        data[name] = run(name)
        DATA.write_text(json.dumps(data, indent=1))
        print(f"  {data[name]['seconds']:.0f} s", flush=True)
    parts = []
    for name in TASKS:
        if name in data:
            t = data[name]
            parts.append(f"### {TITLES[name]}\n\n```bash\n{t['command']}\n```\n\nRun time: {t['seconds'] / 60:.1f} min "
                         f"(2 CPU cores).\n\n{RENDER[name](t)}\n")
    body = "\n".join(parts)
    text = DOC.read_text() if DOC.exists() else "# Results\n\n<!-- RESULTS START -->\n<!-- RESULTS END -->\n"
    start, end = text.index("<!-- RESULTS START -->"), text.index("<!-- RESULTS END -->")
    DOC.write_text(text[: start + len("<!-- RESULTS START -->")] + "\n" + body + text[end:])
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
