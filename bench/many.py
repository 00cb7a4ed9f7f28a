"""Many documents: one run against a shell loop of single-document runs, and a Ray pool against one process.

    python bench/many.py                  # 20 documents of ~2K tokens, one question each, 2 rounds
    python bench/many.py --rss 50         # RSS after each of 50 documents in one process (--compare: and not reused)
    python bench/many.py --quick          # 6 documents, 1 round

Configurations, interleaved round by round (the machine is shared: a ratio is taken within a round):

* ``loop``: ``for f in docs/*; do kvtool ask "$f" Q --json --threads T; done`` — a process per document;
* ``one``: ``kvtool ask docs/ --question Q --threads T`` — one process, one model, the cache reused;
* ``ray``: ``kvtool ask docs/ --question Q --ray local --workers 2`` — two actors of one thread each (the
  two cores split between them), the local cluster started and stopped by the run.

``T`` is ``--threads`` (default 2). Every configuration answers with the embedded SmolLM2-135M-Instruct and
kvtool's defaults but ``--max-new-tokens 48``. The documents are consecutive 8,000-character slices of the essays in
``../shared/corpus`` (about 2K tokens each). Prints one JSON object: wall seconds per configuration and
round, the ratios, where a loop's document spends its time (from its ``--json`` stats: interpreter and
imports, model load, reading, answering), and whether the answers agree document by document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "corpus"
QUESTION = "What is the main point the author makes here?"
SLICE_CHARS = 8000
COMMON = ["--max-new-tokens", "48"]
#: the RSS runs' torch threads (memory does not depend on them; one thread is the fastest on a shared machine)
RSS_THREADS = 1


def make_docs(folder: Path, n: int) -> list[Path]:
    """``n`` documents of ``SLICE_CHARS`` characters (~2K tokens), cut at a space, from the corpus."""
    sources = sorted((CORPUS / "paul_graham_essays").glob("*.txt")) + sorted(CORPUS.glob("*.txt"))
    if not sources:
        raise SystemExit(f"no corpus at {CORPUS}: the bench reads ../shared/corpus")
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in sources)
    folder.mkdir(parents=True, exist_ok=True)
    out, at = [], 0
    for i in range(n):
        end = text.rfind(" ", at, at + SLICE_CHARS)
        end = at + SLICE_CHARS if end <= at else end
        path = folder / f"doc{i:03d}.txt"
        path.write_text(text[at:end].strip(), encoding="utf-8")
        out.append(path)
        at = end + 1
    return out


def kvtool(*args: object) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "kvtool.cli.app", *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=str(ROOT), check=False)


def run_loop(docs: list[Path], threads: int) -> tuple[float, dict[str, str], list[dict]]:
    """The shell loop: one process per document; its answers and each run's stats."""
    t0 = time.perf_counter()
    answers, split = {}, []
    for d in docs:
        t1 = time.perf_counter()
        r = kvtool("ask", d, QUESTION, "--json", "--quiet", "--threads", str(threads), *COMMON)
        wall = time.perf_counter() - t1
        if r.returncode:
            raise SystemExit(f"kvtool ask {d} failed: {r.stderr.strip()}")
        out = json.loads(r.stdout)
        answers[str(d)] = out["answers"][0]["answer"]
        s = out["stats"]
        decode = s["decode_tokens"] / s["decode_tokens_per_second"] if s["decode_tokens_per_second"] else 0.0
        split.append({"wall": wall, "load": s["model_load_seconds"], "read": s["prefill_seconds"], "answer": decode,
                      "tokens": s["document_tokens"] + s["prefix_tokens"]})
    return time.perf_counter() - t0, answers, split


def run_many(folder: Path, *extra: str) -> tuple[float, dict[str, str], str]:
    """One many-document run over ``folder``: wall seconds, answers by path, its closing line."""
    t0 = time.perf_counter()
    r = kvtool("ask", folder, "--question", QUESTION, *COMMON, *extra)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"kvtool ask {folder} ... {' '.join(extra)} failed: {r.stderr.strip()[-2000:]}")
    answers = {x["path"]: x["answer"] for x in map(json.loads, r.stdout.splitlines())}
    closing = [ln for ln in r.stderr.splitlines() if ln.startswith("answered ")]
    return wall, answers, closing[-1] if closing else ""


def per_document(split: list[dict]) -> dict:
    """Where a loop's document spends its wall time, on average (its --json stats say the model load, reading
    and answering; the rest is starting Python, importing torch and transformers, and exiting)."""

    def mean(key: str) -> float:
        return round(statistics.mean(x[key] for x in split), 2)

    out = {"wall": mean("wall"), "model_load": mean("load"), "read": mean("read"), "answer": mean("answer"),
           "tokens": round(statistics.mean(x["tokens"] for x in split))}
    out["interpreter_imports_and_rest"] = round(out["wall"] - out["model_load"] - out["read"] - out["answer"], 2)
    return out


def timing(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvtool-many-") as tmp:
        folder = Path(tmp) / "docs"
        docs = make_docs(folder, args.docs)
        rounds = []
        for _ in range(args.rounds):
            threads = str(args.threads)
            one, one_answers, one_line = run_many(folder, "--threads", threads)
            row: dict = {"one_s": round(one, 1), "one_line": one_line}
            if args.loop:
                loop, loop_answers, split = run_loop(docs, args.threads)
                row.update(loop_s=round(loop, 1), loop_over_one=round(loop / one, 2),
                           same_answers_loop_one=sum(loop_answers[k] == one_answers.get(k) for k in loop_answers),
                           loop_per_document_s=per_document(split))
            if args.ray:
                ray, ray_answers, ray_line = run_many(folder, "--ray", "local", "--workers", "2")
                row.update(ray_s=round(ray, 1), one_over_ray=round(one / ray, 2), ray_line=ray_line,
                           same_answers_one_ray=sum(one_answers[k] == ray_answers.get(k) for k in one_answers))
            rounds.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return {"documents": args.docs, "question": QUESTION, "settings": COMMON, "threads": args.threads,
            "ray_workers": "2 x 1 thread" if args.ray else None, "rounds": rounds}


def rss(args: argparse.Namespace) -> dict:
    """RSS after every document, each variant in a fresh process: the cache reused (what the runner does)
    and, with ``--compare``, a new cache (and snapshot) per document."""
    out: dict = {"documents": args.rss, "threads": RSS_THREADS}
    for variant in ("reused", "new")[: 2 if args.compare else 1]:
        r = subprocess.run([sys.executable, __file__, "--rss", str(args.rss), "--variant", variant],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
        if r.returncode:
            raise SystemExit(r.stderr[-2000:])
        out[variant] = json.loads(r.stdout)
        print(json.dumps({variant: out[variant]}), file=sys.stderr, flush=True)
    return out


def rss_variant(n: int, reuse: bool) -> dict:
    """One process: the many-document worker over ``n`` documents, RSS sampled after each."""
    sys.path.insert(0, str(ROOT))
    import psutil

    from kvtool.runtime.many import DocumentWorker, Task, plan
    from kvtool.runtime.settings import resolve_settings

    proc = psutil.Process()
    with tempfile.TemporaryDirectory(prefix="kvtool-rss-") as tmp:
        docs = [str(p) for p in make_docs(Path(tmp) / "docs", n)]
        task = Task("ask", resolve_settings(None, {"max_new_tokens": 48, "threads": RSS_THREADS}), [QUESTION])
        worker = DocumentWorker(task)
        worker.start()
        worker.session.reuse_cache = reuse
        before = proc.memory_info().rss
        samples, failed = [], 0
        t0 = time.perf_counter()
        for job in plan(task, docs)[0]:
            failed += sum("error" in record for record in worker.run(job))
            samples.append(proc.memory_info().rss)
    mib = [round(x / 2**20, 1) for x in samples]
    marks = sorted({0, 4, 9, 19, 29, 39, n - 1} & set(range(n)))
    return {"rss_mib_model_loaded": round(before / 2**20, 1), "rss_mib_after": {str(i + 1): mib[i] for i in marks},
            "growth_mib_doc5_to_last": round(mib[-1] - mib[min(4, n - 1)], 1), "max_mib": max(mib),
            "failed": failed, "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the loop's runs and the one run "
                    "(the Ray workers get one core each)")
    ap.add_argument("--no-loop", dest="loop", action="store_false", help="leave out the shell loop")
    ap.add_argument("--no-ray", dest="ray", action="store_false", help="leave out the Ray configuration")
    ap.add_argument("--rss", type=int, default=0, help="measure RSS over this many documents instead")
    ap.add_argument("--compare", action="store_true", help="with --rss: also a new cache per document")
    ap.add_argument("--variant", choices=("reused", "new"), help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="6 documents, 1 round")
    args = ap.parse_args()
    if args.quick:
        args.docs, args.rounds = 6, 1
    if args.variant:
        print(json.dumps(rss_variant(args.rss, args.variant == "reused")))
        return
    print(json.dumps(rss(args) if args.rss else timing(args), indent=1))


if __name__ == "__main__":
    main()
