"""Regenerate docs/results.md: every evaluation table behind kvtool's claims, with 95% intervals.

    python bench/results.py                 # the whole grid (resumable: rerun after a stop, finished cells are kept)
    python bench/results.py --only needle,agreement
    python bench/results.py --quick         # fewer trials/questions/windows: a smoke run of the pipeline
    python bench/results.py --only agreement --policies h2o,h2o+vatp --budgets 256   # a piece of the grid
    python bench/results.py --scratch /tmp/try --only needle --policies razor --trials 1  # nothing tracked written

The grid tables hold every policy at budgets 256 and 1024 (bench/evidence.py; rows run with ``--policies``
are merged into them); the claims table is bench/claims.py's; the default settings' section is
bench/defaults.py's, the quantized K/V section bench/kv_tables.py's and the Gemma 3 270M section
bench/gemma_tables.py's (their commands run with kvtool's own answering defaults, not pinned; the Gemma tasks
need ``pip install '.[eval-models]'`` and are skipped without it).

Each table is one ``kvtool eval ... --json --resume bench/results-runs/NAME.jsonl`` command (printed under the
table with its run time), so anyone can rerun one table; the kvpress side-by-side is
``python bench/peer/compare.py``. Raw results go to docs/results-data.json; docs/results.md is written
whole from them (do not edit it by hand: edit this script). The total run time is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import cite_table
import defaults
import evidence
import gemma_tables
import kv_tables
from default_rule import DEFAULT_RULE, beside_the_rule, choose_default
from result_tables import (
    BLOCKS,
    DEFAULT,
    GPU_BLOCKS,
    GPU_KINDS,
    PAGES,
    peer_differences,
    table_agreement,
    table_archive,
    table_blocks,
    table_gpu_block,
    table_needle,
    table_peer,
    table_ppl,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DOC = ROOT / "docs" / "results.md"
DATA = ROOT / "docs" / "results-data.json"
RESUME = ROOT / "bench" / "results-runs"  # tracked: a later session resumes what an earlier one finished
START, END = "<!-- RESULTS START -->", "<!-- RESULTS END -->"
CORPUS = "../shared/corpus"
POLICIES = "sink,h2o,tova,snapkv,keydiff,snapkv+caote"
ORDER = ("needle", "needle-recall", "agreement", "ppl", "needle-1024", "ppl-1024", "distinctiveness", "razor-bytes",
         "peer", "needle-multi", "needle-name-1k", "needle-multi-1k", "needle-name-8k", "needle-multi-8k", "block-64",
         "block-256", "block-1024", *(f"block-needle-{k}-{b}" for k in GPU_KINDS for b in GPU_BLOCKS),
         "recall-page-16", "recall-page-64", "archive-float16", "archive-int8", "needle-recall-2k",
         "needle-recall-long", "needle-recall-32k", "needle-32k-full", "needle-recall-64k", *defaults.TASKS,
         *kv_tables.TASKS, "citations", *gemma_tables.TASKS)
#: how long a table's trials took when they ran, for the tables a rerun resumes in seconds
RAN = {"needle-recall": "the recall trials ran beside other runs at low priority",
       "needle-recall-2k": "the recall trials ran in 424 s beside other runs",
       "needle-recall-long": "this session's `full`, `tova`, `snapkv` and `keydiff` trials ran in 7,730 s beside "
                             "other runs",
       "needle-recall-32k": "the recall trials ran in 5,743 s beside other runs",
       "needle-32k-full": "over three sessions; each dense trial took 10 to 12 minutes alone on 2 threads (the "
                          "first, 1,290 s, beside another run)",
       "needle-recall-64k": "the trials ran in 1,782 s beside other runs",
       **{f"block-needle-{k}": f"the trials ran in {s} s, two logs at a time on one thread each"
          for k, s in (("number-128", "1,624"), ("number-1024", "1,641"), ("name-128", "1,546"),
                       ("name-1024", "1,533"), ("number-256", "1,357"), ("name-256", "1,372"))}}
# needle-recall shares needle's log: its full and eviction-only trials are needle's, resumed
LOGS = {"needle-recall": "needle", "agreement-aord": "agreement", "needle-multi-1k": "needle-multi"}


def tasks(opts: argparse.Namespace) -> dict[str, list[str]]:
    """Every task's ``kvtool eval`` argv; the grid tables (needle, agreement, ppl) come from bench/evidence.py."""
    trials = str(opts.trials or (3 if opts.quick else 10))
    multi_trials = str(opts.trials or (3 if opts.quick else 5))
    pols = POLICIES.split(",")
    recall_rows = ["--policies", f"full,sink,{DEFAULT}", "--budgets", "256", "--recall", "0,256"]
    out = evidence.grid_tasks(opts.policies or evidence.grid_policies(), opts.budgets or evidence.BUDGETS,
                              int(trials), opts.samples or (4 if opts.quick else 16))
    return {
        **out,
        **defaults.TASKS,  # the default settings' section: kvtool's own answering defaults
        **kv_tables.TASKS,  # --kv-dtype at equal tokens and equal bytes, with the default settings
        **gemma_tables.TASKS,  # Gemma 3 270M (kvtool[eval-models]): dense references to 32K
        # recall for sink (the best eviction-only policy of the first six run at 256) and the default
        "needle-recall": ["eval", "needle", "--haystack", f"{CORPUS}/paul_graham_essays", "--lengths", "1k",
                          "--depths", "0.1,0.5,0.9", "--trials", trials, *recall_rows, "--max-new-tokens", "16"],
        # longer haystacks: with and without recall, compact positions (--positions auto) past the
        # model's 8,192 positions; penalty 1 as for 2K (1.1 drops a repeated digit of the number). 8K: full and
        # every base policy of the first tables (not the snapkv+caote combination: time); 32K: the default only,
        # without full (a dense 32K pass takes 10+ minutes per trial here: needle-32k-full runs ten per depth).
        **{f"needle-recall-{name}": ["eval", "needle", "--haystack", f"{CORPUS}/paul_graham_essays", "--lengths",
                                     length, "--depths", "0.1,0.5,0.9", "--trials", trials, "--policies", *policies,
                                     "--budgets", "256", "--max-new-tokens", "16", "--recall", "0,256",
                                     "--repetition-penalty", "1"]
           for name, length, policies in (("long", "8k", ["full," + ",".join(pols[:-1])]),
                                          ("32k", "32k", [DEFAULT, "--no-full"]))},
        # past 32,768 archived tokens per head (compact: every token scored, in two passes): a sample
        "needle-recall-64k": ["eval", "needle", "--haystack", f"{CORPUS}/paul_graham_essays", "--lengths", "64k",
                              "--depths", "0.1,0.5,0.9", "--trials", "1", "--policies", DEFAULT, "--no-full",
                              "--budgets", "256", "--max-new-tokens", "16", "--recall", "0,256",
                              "--repetition-penalty", "1"],
        # the dense reference at 32K: ten trials per depth (a dense 32K pass takes 10+ minutes per trial here)
        "needle-32k-full": ["eval", "needle", "--haystack", f"{CORPUS}/paul_graham_essays", "--lengths", "32k",
                            "--depths", "0.1,0.5,0.9", "--trials", "10", "--policies", "full", "--budgets", "256",
                            "--max-new-tokens", "16", "--repetition-penalty", "1"],
        # 2K haystack without the repetition penalty: at 1.1 it drops a repeated digit of the number (see render)
        "needle-recall-2k": ["eval", "needle", "--haystack", f"{CORPUS}/paul_graham_essays", "--lengths", "2k",
                             "--depths", "0.1,0.5,0.9", "--trials", trials, "--policies", f"full,{DEFAULT}",
                             "--budgets", "256", "--max-new-tokens", "16", "--recall", "0,256",
                             "--repetition-penalty", "1"],
        # the archive's page size and storage dtype: the default + recall 256 on needle's 1K trials
        **{f"recall-page-{p}": ["eval", "needle", "--haystack", f"{CORPUS}/paul_graham_essays", "--lengths", "1k",
                                "--depths", "0.1,0.5,0.9", "--trials", trials, "--policies", DEFAULT, "--budgets",
                                "256", "--max-new-tokens", "16", "--recall", "256", "--recall-page", str(p)]
           for p in PAGES},
        **{f"archive-{dt}": ["eval", "needle", "--haystack", f"{CORPUS}/paul_graham_essays", "--lengths", "1k",
                             "--depths", "0.1,0.5,0.9", "--trials", trials, "--policies", DEFAULT, "--budgets", "256",
                             "--max-new-tokens", "16", "--recall", "256", "--archive-dtype", dt]
           for dt in ("float16", "int8")},
        "needle-multi": ["eval", "needle", "--haystack", f"{CORPUS}/paul_graham_essays", "--lengths", "1k",
                         "--depths", "0.1,0.5,0.9", "--trials", multi_trials, "--needles", "3",
                         "--policies", "full," + POLICIES, "--budgets", "256", "--max-new-tokens", "24"],
        **needle_kinds(trials, multi_trials, recall_rows),
        **{f"block-{b}": ["eval", "agreement", "--doc", f"{CORPUS}/paul_graham_essays/aord.txt", "--questions-file",
                          "bench/data/aord_questions.txt", "--policies", DEFAULT, "--budgets",
                          "256" if opts.quick else "256,1024", "--max-new-tokens", "24", "--first-tokens", "8",
                          "--block-size", str(b)] for b in BLOCKS},
        # the block a GPU picks at budget 4K (1,024) and a CPU's (256) against the tables' (128), where a 16K
        # haystack makes the budget evict three quarters of it: kvtool's own answering defaults (recall on), one thread
        **{f"block-needle-{k}-{b}": ["eval", "needle", "--haystack", f"{CORPUS}/paul_graham_essays",
                                     *(["--needle-kind", k] if k != "number" else []), "--lengths", "16k",
                                     "--depths", "0.1,0.5,0.9", "--trials", str(opts.trials or 4), "--policies",
                                     DEFAULT, "--no-full", "--budgets", "4k", "--recall", "auto",
                                     "--max-new-tokens", "16", "--threads", "1", "--block-size", str(b)]
           for k in GPU_KINDS for b in GPU_BLOCKS},
    }


def needle_kinds(trials: str, multi_trials: str, recall_rows: list[str]) -> dict[str, list[str]]:
    """A name (a word, not a number) and three labelled numbers (one asked), each with and without recall, at
    1K and 8K tokens (the number's rows are needle-recall and needle-recall-long)."""
    out = {}
    for kind, extra, n, tokens in (("name", ["--needle-kind", "name"], trials, "16"),
                                   ("multi", ["--needles", "3"], multi_trials, "24")):
        for length, penalty in (("1k", []), ("8k", ["--repetition-penalty", "1"])):
            out[f"needle-{kind}-{length}"] = ["eval", "needle", *extra, "--haystack", f"{CORPUS}/paul_graham_essays",
                                              "--lengths", length, "--depths", "0.1,0.5,0.9", "--trials", n,
                                              *recall_rows, "--max-new-tokens", tokens, *penalty]
    return out


def run_eval(name: str, argv: list[str]) -> dict:
    # measured with kvtool's own answering defaults (the block pairing: what `ask` does at each block)
    own = (name in defaults.TASKS or name in kv_tables.TASKS or name in gemma_tables.TASKS
           or name.startswith("block-needle-"))
    argv = argv if own else evidence.pinned_answering(argv)
    log = LOGS.get(name, name)
    resume = RESUME / f"{log}.jsonl"
    full = [sys.executable, "-m", "kvtool.cli.app", *argv, "--resume", os.path.relpath(resume, ROOT), "--json"]
    t0 = time.perf_counter()
    print(f"[{name}] kvtool {shlex.join(argv)}", flush=True)
    proc = subprocess.run(full, cwd=ROOT, stdout=subprocess.PIPE, text=True)  # progress bar stays on stderr
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (exit {proc.returncode}); rerun to resume")
    print(f"[{name}] {seconds:.0f} s", flush=True)
    return {"command": f"kvtool {shlex.join(argv)} --resume {os.path.relpath(resume, ROOT)} --json",
            "seconds": round(seconds, 1), "result": json.loads(proc.stdout)}


def run_peer(quick: bool) -> dict | None:
    argv = [sys.executable, "bench/peer/compare.py", "--trials", "2" if quick else "3"]
    t0 = time.perf_counter()
    print("[peer] python bench/peer/compare.py", flush=True)
    proc = subprocess.run(argv, cwd=ROOT)
    if proc.returncode != 0:
        print("[peer] failed: the side-by-side table is left out (see its output above)", flush=True)
        return None
    data = json.loads((RESUME / "peer.json").read_text())
    data["wall_seconds"] = round(time.perf_counter() - t0, 1)
    return data


def sections(data: dict) -> list[tuple]:
    """The tables written from one eval command each: (data key, heading, text above the table, table)."""
    return [
        ("needle", "Needle in a haystack (one needle), budget 256 on 1K tokens",
         "The needle is a 5-digit *secret number* (`The secret number is N. Remember it: the secret number is N.`), "
         "a new number per trial, asked as `What is the secret number?`. The earlier *pass key* wording made the "
         "135M model define the phrase instead of reading the text (dense found 0 of 12 at 1K tokens, depths "
         "0.1–0.5); with the secret-number wording the dense model finds it where the table shows.", table_needle),
        ("needle-recall", "Needle with recall",
         "The same trials, for `sink` (the best eviction-only policy at budget 256 among the six run first; `razor` "
         "is better in the full grid above) and the default "
         f"(`{DEFAULT}`), "
         "each also answering with `--recall 256`: evicted tokens archived in 32-token pages; every KV head "
         "scores its archive exactly against the queries of the question's own tokens (not the instruction "
         "and chat template around it), the resulting attention is summed per "
         "document position over all heads and layers, and every head brings back the most relevant positions "
         "(with the 8 tokens before and 24 after each) for the answer. The eviction-only and recall rows of a "
         "policy answer from the same read. Earlier selections on these trials: Quest's bound alone, "
         "`sink` 11/30 and `h2o` 28/30; per-head pages re-ranked by exact max q·k, `sink` 24/30, `h2o` 29/30; "
         "the shared ranking with every suffix row voting, `sink` 30/30, `h2o` 29/30.",
         table_needle),
        ("needle-recall-2k", "Needle with recall on a 2K haystack, no repetition penalty",
         f"`full`, the default (`{DEFAULT}`) and the default + recall 256 at budget 256 on a 2K-token haystack, "
         "answered with `--repetition-penalty 1` (off). With the default penalty (1.1 on the answer's own tokens) "
         "and the earlier per-head selection "
         f"`{DEFAULT}` + recall found 7 of these 30 numbers, and "
         "18 of its 23 misses stopped at or skipped a digit the answer had already written (`60494` → `6049`, "
         "`27611` → `2761`). With per-head pages (re-ranked) and no penalty it found 23/30: "
         "11–16 of the 90 KV heads held all five digits and the answers came out cut (`419` for `41190`, "
         "`52` for `52445`); the shared ranking puts them in all 90.", table_needle),
        ("needle-recall-long", "Needle with recall on an 8K haystack",
         "`full` and every policy at budget 256, each with and without recall 256, on an 8K-token haystack, "
         "no repetition penalty. SmolLM2-135M was trained on 8,192 positions: with the chat template and the "
         "question the haystack passes that, so `full` reads past its range and the bounded rows use compact "
         "positions (`--positions auto`); recall scores each archived key where it would land among the kept "
         "ones. With the default penalty (1.1) `full` found 15/30 (0/10 at depth 0.1, 6/10 at 0.5, 9/10 at "
         "0.9). With the earlier per-head selection `h2o` + recall found 0/30 at 8K; with the shared ranking "
         "and every suffix row voting, 30/30. Where a policy + recall misses a whole depth, see "
         "[recall-history.md](recall-history.md).", table_needle),
        ("needle-recall-32k", "Needle with recall on a 32K haystack",
         "The same on a 32K-token haystack (four times the model's trained positions). Recall scores all of "
         "the ~32,500 archived tokens per KV head exactly. Before the ranking used the question's own rows "
         "only (every suffix row voting, at most 8,192 tokens scored per head) it found 2 of 6 (0/2 at depth "
         "0.1, 2/2 at 0.5, 0/2 at 0.9): the instruction's and template's rows attended to essay titles and "
         "dates, and the bound's pre-selection dropped the needle's page in most heads.", table_needle),
        ("needle-32k-full", "The dense reference on the 32K haystack (ten trials per depth)",
         "`full` on the ten trials of each depth above (the same needles), no repetition penalty: the "
         "whole cache at absolute positions, four times the range SmolLM2-135M was trained on. Every answer "
         "is underscores, line breaks and stray words (`_\\nThe\\n_.-\\n_…` at depth 0.1, `the one._\\nthe."
         "TheThe…` at 0.5, nearly the same string for every needle of a depth): the model does not read 32K tokens "
         "at all. A dense 32K pass is quadratic in length: 10 to 12 minutes per trial alone on this 2-core "
         "machine (21 minutes beside another run), so the 30 trials ran over three sessions, resumed from the "
         "log.", table_needle),
        ("needle-recall-64k", "Needle with recall on a 64K haystack (a sample)",
         f"`{DEFAULT}` with and without recall 256 at budget 256 on a 64K-token haystack, one trial per depth. "
         "About 65,000 tokens per KV head are archived: past the 32,768 whose scores recall holds, so every "
         "archived token is scored in two passes (the normaliser, then the probabilities).", table_needle),
        ("needle-multi", "Needle in a haystack (three needles, one asked)",
         "Three labelled secret numbers (`the red door opens with N`) at seeded depths; the question asks for "
         "the one at the cell's depth.", table_needle),
        ("needle-1024", "Needle in a haystack (one needle), budget 1024 on 4K tokens",
         "The same needle at budget 1024 in a 4K-token haystack (a quarter kept, as 256 of 1K), no repetition "
         "penalty (past 1K tokens the default 1.1 drops a repeated digit of the number).", table_needle),
        ("agreement", "Agreement with the dense answer",
         evidence.agreement_intro(data.get("agreement")), table_agreement),
        ("ppl", "Perplexity under eviction",
         "Budget 256, windows of 1K context + 32 continuation tokens spread over *The Adventures of Sherlock Holmes*, "
         "*Pride and Prejudice* and the essays; the continuation is fed one token at a time so eviction runs "
         "as in generation. The dense reference is one plain transformers forward.", table_ppl),
        ("ppl-1024", "Perplexity under eviction, budget 1024 on 4K-token contexts",
         "The same at budget 1024 with 4K tokens of context (a quarter kept).", table_ppl),
    ]


def render(data: dict, total_seconds: float) -> str:
    parts = ["Generated by `python bench/results.py` (do not edit this block by hand). Model: the embedded "
             "SmolLM2-135M-Instruct (fp32, CPU). Every cell carries a 95% interval: Wilson for rates, "
             "percentile bootstrap over questions/windows for means. ✱ marks a row significantly worse than "
             "the best row *at the same budget* (Newcombe interval for rates, paired bootstrap for means); a "
             "difference without ✱ is inside the noise. In needle tables ↓ marks a row significantly below "
             "`full` (the dense reference). A difference between two rows answered on the same trials (a "
             "claim's cell, a dtype against float32) uses Newcombe's paired score interval; choosing the "
             "default among many policies uses p-values adjusted for the number of comparisons (Holm). The "
             "tables answer with the settings they were first measured with, spelled out in each command "
             "(repetition penalty 1.1 unless a table says otherwise, no n-gram guard, the archive in the model's "
             "dtype, recalled passages merged in document order); what kvtool does with nothing but a budget is "
             "its own section, \"Answering with the default settings\".", "",
             evidence.WHAT_A_SMALL_MODEL_SHOWS, ""]
    for key, title, intro, table in sections(data):
        if key not in data:
            continue
        task = data[key]
        parts += [f"## {title}", "", intro, "", table(task), "",
                  f"`{task['command']}` — {task['seconds']:.0f} s"
                  + (f" (resumed from its log {RAN[key]})" if key == "needle-32k-full" else
                     f" (resumed from its log; {RAN[key]})" if key in RAN else ""),
                  ""]
    if "agreement" in data and any(f"block-{b}" in data for b in BLOCKS):
        parts += ["## Block size for the default policy", "",
                  f"`{DEFAULT}` on the agreement questions at prefill blocks of 64, 128 (the tables' block), 256 (a "
                  "CPU's `auto` from budget 1K) and 1,024 tokens; each block size's token F1 against block 128's "
                  "on the same questions (paired bootstrap).", "", table_blocks(data), ""]
    if any(f"block-needle-{k}-{b}" in data for k in GPU_KINDS for b in GPU_BLOCKS):
        parts += ["### The GPU's block and a CPU's, against the tables' 128", "",
                  "At budget 4K `--block-size auto` feeds 1,024 tokens a block on CUDA and 256 on a CPU; `kvtool "
                  "eval` reads at 128. What that costs in answers, measured on this CPU where the block is a "
                  "choice: needles in 16K tokens (the budget evicts three quarters of the document), kvtool's "
                  "default settings (recall on), 4 trials per depth (0.1, 0.5, 0.9), the same trials at every "
                  "block.", "",
                  table_gpu_block(data, RAN), "",
                  "Every block misses the same way: the name's misses answer with a phrase of a recalled passage "
                  "(`The secret name is \"The Secret Weapon\"`), as in the default settings' 8K row (below), "
                  "where `full` finds the name 3 times in 9; the block does not move it.", ""]
    if any(k in data for k in ("archive-float16", "archive-int8", *(f"recall-page-{p}" for p in PAGES))):
        cmds = [f"`{data[k]['command']}` — {data[k]['seconds']:.0f} s"
                for k in (*(f"recall-page-{p}" for p in PAGES), "archive-float16", "archive-int8") if k in data]
        parts += ["## Recall: archive page size and storage dtype", "",
                  f"`{DEFAULT}` at budget 256 + recall 256 on the needle trials above (1K tokens, depths 0.1/0.5/0.9), "
                  "with archive pages of 16, 32 and 64 tokens and with the archive stored in float16 and in int8 "
                  "(a float32 scale per token and head). The 32-token, "
                  "float32 row is the \"Needle with recall\" table's. Re-run on 2026-11-23 with the current ranking "
                  "(the question's own rows vote); with the previous one (every suffix row voting) each row also "
                  "found 29/30.", "", table_archive(data), "",
                  *[f"- {c}" for c in cmds], ""]
    parts += evidence.evidence_sections(data, DEFAULT)
    rule = choose_default(data) + beside_the_rule(data)
    parts += ["## Choosing the default policy", "", DEFAULT_RULE.format(default=DEFAULT), "",
              *[f"- {x}" for x in rule], ""]
    if data.get("peer"):
        peer = data["peer"]
        parts += ["## Side by side with NVIDIA kvpress", "",
                  f"The same cases (needle trials at {peer['length']} tokens, and the agreement questions), the same "
                  f"prompt, {peer['budget']} document tokens kept per head by both tools (kvpress: compression ratio "
                  "1 − budget/context). kvpress prefills the whole document and then compresses it (it sees "
                  "everything before it evicts, but holds it all in memory); kvtool evicts inside a bounded "
                  "block-wise prefill. Both decode greedily without a repetition penalty. F1 is against each "
                  "tool's own uncompressed answer. Rows where kvpress is better are reported as they are.", "",
                  table_peer(peer), "", *[f"- {x}" for x in peer_differences(peer)], "",
                  f"`{peer['command']}` — {peer.get('wall_seconds', peer['seconds']):.0f} s",
                  ""]
    parts += defaults.section(data)
    parts += kv_tables.section(data, RESUME)
    parts += cite_table.section(data.get("citations"))
    parts += gemma_tables.section(data)
    parts += [f"Total run time of this regeneration: {total_seconds:.0f} s (resumed cells are not re-run).", ""]
    return "\n".join(parts)


def write_doc(block: str) -> None:
    """Replace the generated block of docs/results.md (between the RESULTS markers); keep the rest."""
    text = DOC.read_text(encoding="utf-8") if DOC.exists() else f"# Results\n\n{START}\n{END}\n"
    if START not in text or END not in text:
        text = text.rstrip() + f"\n\n{START}\n{END}\n"
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    DOC.write_text(f"{head}{START}\n{block.rstrip()}\n{END}{tail}", encoding="utf-8")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma list of: " + ", ".join(ORDER))
    ap.add_argument("--quick", action="store_true", help="fewer trials/windows and budget 256 for the block rows")
    ap.add_argument("--policies", default="", help="grid tables: run these policies only (merged into the tables)")
    ap.add_argument("--budgets", default="", help="grid tables: these budgets only (default 256,1024)")
    ap.add_argument("--trials", type=int, default=0, help="needle trials per cell (default 10; multi-needle 5)")
    ap.add_argument("--samples", type=int, default=0, help="perplexity windows and correlation windows (default 16)")
    ap.add_argument("--render-only", action="store_true", help="rewrite docs/results.md from docs/results-data.json")
    ap.add_argument("--scratch", default="", help="a directory for the logs, the data and the page instead of "
                    "bench/results-runs, docs/results-data.json and docs/results.md (a trial run)")
    args = ap.parse_args()
    args.policies = [p for p in args.policies.split(",") if p]
    try:
        args.budgets = [int(b) for b in args.budgets.split(",") if b]
    except ValueError:
        ap.error(f"--budgets must be a comma list of token counts (got {args.budgets!r})")
    unknown = {x for x in args.only.split(",") if x} - set(ORDER)
    if unknown or args.trials < 0 or args.samples < 0:
        ap.error(f"unknown --only table(s): {', '.join(sorted(unknown))}" if unknown else "counts must be >= 0")
    return args


def save(data: dict) -> None:
    """docs/results-data.json, written whole (temp file, then rename): a stop never leaves it half-written."""
    tmp = DATA.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(DATA)


def run_task(name: str, table: dict, data: dict, args: argparse.Namespace) -> None:
    """Run one table's command(s) and put its result in ``data`` (merged with rows of earlier runs)."""
    if name == "peer":
        peer = run_peer(args.quick)
        if peer is not None:
            data["peer"] = peer
    elif name == "agreement":
        for doc in evidence.DOCS:
            key = f"agreement-{doc[0]}"
            data[key] = evidence.merge(data.get(key), run_eval(key, table[key]))
        data["agreement"] = evidence.pool_agreement([data[f"agreement-{d[0]}"] for d in evidence.DOCS])
    elif name == "distinctiveness":
        samples = str(args.samples or (3 if args.quick else 12))
        data[name] = run_script(name, ["bench/distinctiveness.py", "--samples", samples, "--window", "512",
                                       "--resume", os.path.relpath(RESUME / "distinctiveness.jsonl", ROOT)])
    elif name == "razor-bytes":
        docs = ",".join(d[1] for d in evidence.DOCS)
        budgets = ",".join(map(str, args.budgets or evidence.BUDGETS))
        argv = ["bench/razor_bytes.py", "--docs", docs, "--budgets", budgets]
        old = data.get(name)
        if old is None or old["command"] != f"python {shlex.join(argv)}":  # exact bytes: nothing to resume
            data[name] = run_script(name, argv)
    elif name == "citations":  # timings of a few trials: run once per command, again only when asked by name
        old = data.get(name)
        if old is None or old["command"] != cite_table.commands() or name in args.only.split(","):
            main = run_script(name, cite_table.MAIN)
            micro = [run_script(name, argv) for argv in cite_table.MICRO]
            seconds = main["seconds"] + sum(m["seconds"] for m in micro)
            data[name] = {"command": cite_table.commands(), "seconds": seconds,
                          "result": {**main["result"], "micro": [m["result"] for m in micro]}}
    elif name in gemma_tables.TASKS and not gemma_tables.installed():
        print(f"[{name}] Gemma 3 270M is not installed (pip install '.[eval-models]'): skipped", flush=True)
    elif name in table:
        data[name] = evidence.merge(data.get(name), run_eval(name, table[name]))
    else:
        print(f"[{name}] not in this run's budgets: skipped", flush=True)


def run_script(name: str, argv: list[str]) -> dict:
    """A bench script that prints one JSON object (its progress on stderr)."""
    t0 = time.perf_counter()
    print(f"[{name}] python {shlex.join(argv)}", flush=True)
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (exit {proc.returncode}); rerun to resume")
    seconds = time.perf_counter() - t0
    print(f"[{name}] {seconds:.0f} s", flush=True)
    return {"command": f"python {shlex.join(argv)}", "seconds": round(seconds, 1), "result": json.loads(proc.stdout)}


def main() -> None:
    global DOC, DATA, RESUME
    args = parse_args()
    if args.scratch:
        scratch = Path(args.scratch).resolve()
        DOC, DATA, RESUME = scratch / "results.md", scratch / "results-data.json", scratch / "results-runs"
    t0 = time.perf_counter()
    RESUME.mkdir(parents=True, exist_ok=True)
    data = json.loads(DATA.read_text()) if DATA.exists() else {}
    if not isinstance(data, dict) or "version" not in data:
        data = {"version": 2}
    if not args.render_only:
        only = {x for x in args.only.split(",") if x}
        table = tasks(args)
        for name in ORDER:  # most decisive first: a stopped run has the tables that matter most
            if not only or name in only:
                run_task(name, table, data, args)
                save(data)
        data["total_seconds"] = round(time.perf_counter() - t0, 1)
        save(data)
    total = data.get("total_seconds", 0.0)  # --render-only keeps the last run's figure
    write_doc(render(data, total))
    print(f"wrote {DOC}; this run took {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
