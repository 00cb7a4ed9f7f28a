"""Many documents in one run (fast tier): a reused cache, the inputs, the resumable output, and the CLI's
many-document form on a tiny checkpoint, document by document against one run per file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvtool.cli.app import app
from kvtool.errors import EXIT_PARTIAL, UsageError
from kvtool.runtime.many import Task
from kvtool.runtime.many_inputs import collect, kvc_names
from kvtool.runtime.many_log import ResultLog, record_line
from kvtool.runtime.settings import Settings
from tests.helpers import VOCAB, make_engine, stream_logits, tiny_checkpoint, tiny_llama

ROOT = str(Path(__file__).resolve().parents[1])
runner = CliRunner()
QUESTIONS = ("Who sat on the mat?", "What colour was the door?")


def run(*args: object, input: str | None = None):
    return runner.invoke(app, [str(a) for a in args], input=input)


def records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def answers(text: str) -> list[tuple]:
    """(path, question, answer, tokens) of every record, in order: what two runs must agree on (not timings)."""
    return [
        (x["path"], x.get("question"), x.get("answer"), x.get("stats", {}).get("decode_tokens")) for x in records(text)
    ]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tiny_checkpoint(tmp_path_factory.mktemp("many") / "tiny"))


def base(model_dir: str, *extra: str) -> list[str]:
    """Small, greedy, one thread (the same float sums in every run), recall on (a file archive per document)."""
    return [
        "--model",
        model_dir,
        "--budget",
        "160",
        "--block-size",
        "32",
        "--max-new-tokens",
        "6",
        "--threads",
        "1",
        "--recall",
        "64",
        *extra,
    ]


def write_docs(folder: Path, n: int = 3) -> list[str]:
    """``n`` documents of different lengths (the longer ones evict and archive) in ``folder`` and a subfolder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sub").mkdir(exist_ok=True)
    paths = []
    for i in range(n):
        where = folder / ("sub" if i % 2 else "") / f"doc{i}.txt"
        words = " ".join(
            f"The cat number {i * 7 + j} sat on mat {j}; the door was {('red', 'blue')[j % 2]}."
            for j in range(25 + 30 * i)
        )
        where.write_text(words, encoding="utf-8")
        paths.append(str(where))
    return sorted(paths)


# --------------------------------------------------------------------------------------------- the reused cache
@pytest.mark.parametrize(
    "policy, positions, kv_dtype, recall_tokens",
    [
        ("h2o", "absolute", None, 0),
        ("tova", "compact", None, 64),
        ("snapkv", "absolute", "int8", 64),
        ("keydiff", "compact", "int4", 0),
        ("scissorhands", "absolute", None, 32),
    ],
)
def test_a_reused_cache_gives_the_logits_of_a_new_one(policy, positions, kv_dtype, recall_tokens):
    """The second document read into an emptied cache (its buffers kept) gives exactly the logits of a new cache."""
    kw = {"recall": recall_tokens} if recall_tokens else {}
    if kv_dtype:
        kw["kv_dtype"] = kv_dtype
    engine = make_engine(tiny_llama(), policy, 48, block_size=16, positions=positions, **kw)
    g = torch.Generator().manual_seed(1)
    first, second = torch.randint(0, VOCAB, (300,), generator=g), torch.randint(0, VOCAB, (200,), generator=g)
    expected, _ = stream_logits(engine, second)
    _, cache = stream_logits(engine, first)
    keys = cache.layers[0].groups[0].buffers["keys"]
    engine.reuse_cache(cache)
    got, again = stream_logits(engine, second, cache)
    assert again is cache and cache.layers[0].groups[0].buffers["keys"] is keys  # nothing allocated again
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert cache.counters.evicted_tokens > 0 and cache.seen == second.numel()


# --------------------------------------------------------------------------------------------- inputs
def test_inputs_walk_directories_skip_other_formats_and_read_lists(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("a/x.txt", "a/b/y.md", "a/b/z.PDF", "a/skip.png", "a/.hidden.txt", "a/.git/c.txt", "a/s.kvc"):
        Path(name).parent.mkdir(parents=True, exist_ok=True)
        Path(name).write_text("t", encoding="utf-8")
    os.mkfifo("a/pipe.txt")  # a walk never opens a FIFO (it would wait for a writer)
    got = collect(["a", "a/x.txt", "named.bin"])
    assert got.paths == ["a/s.kvc", "a/x.txt", "a/b/y.md", "a/b/z.PDF", "named.bin"]
    assert got.skipped == 2 and got.duplicates == 1 and "2 file(s) of other formats skipped" in got.describe_skipped()
    assert "a/s.kvc" not in collect(["a"], kvc=False).paths  # prefill does not read caches
    Path("list0").write_bytes(b"a/x.txt\0a/b/y.md\0\0")
    assert collect([], "list0").paths == ["a/x.txt", "a/b/y.md"]
    Path("list").write_text("a/x.txt\r\n\n a/b/y.md\n", encoding="utf-8")
    assert collect([], "list").paths == ["a/x.txt", " a/b/y.md"]  # a path is taken as it is written
    monkeypatch.setattr(sys, "stdin", type("In", (), {"buffer": __import__("io").BytesIO(b"a/x.txt\n")})())
    assert collect(["a/b/y.md"], "-").paths == ["a/b/y.md", "a/x.txt"]
    with pytest.raises(UsageError, match="stdin"):
        collect(["-", "a"])


def test_walk_order_is_depth_first_in_name_order(tmp_path):
    for name in ("b.txt", "a/z.txt", "a/b/c.txt", "c.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("t", encoding="utf-8")
    rel = [os.path.relpath(p, tmp_path) for p in collect([str(tmp_path)]).paths]
    assert rel == ["b.txt", "c.md", os.path.join("a", "z.txt"), os.path.join("a", "b", "c.txt")]


def test_kvc_names_cannot_collide():
    names = kvc_names(["x/a.txt", "y/a.txt", "x/a.md", "b.pdf"], "out")
    assert names["x/a.md"] == os.path.join("out", "a.md.kvc") and names["b.pdf"] == os.path.join("out", "b.pdf.kvc")
    assert len(set(names.values())) == 4
    assert names["x/a.txt"].startswith(os.path.join("out", "a.txt-")) and names["x/a.txt"].endswith(".kvc")
    assert kvc_names(["x/a.txt", "y/a.txt"], "out") == {k: names[k] for k in ("x/a.txt", "y/a.txt")}  # stable


# --------------------------------------------------------------------------------------------- the output file
def test_fingerprint_is_what_changes_an_answer():
    task = Task("ask", Settings(), ["q"])
    same = Task("ask", Settings(threads=3), ["other question"])
    assert task.fingerprint == same.fingerprint  # threads and the questions themselves are not settings
    assert task.fingerprint != Task("ask", Settings(budget="2k"), ["q"]).fingerprint
    assert task.fingerprint != Task("ask", Settings(), ["q"], cite=True).fingerprint
    assert Task("summarize", Settings()).fingerprint != Task("summarize", Settings(), length="short").fingerprint


def test_result_log_resumes_cuts_a_torn_line_and_is_locked(tmp_path):
    path = tmp_path / "out.jsonl"
    answer = {"path": "a.txt", "question": "q", "answer": "x", "stats": {}, "settings": "fp"}
    other = {**answer, "question": "q2", "settings": "old"}
    error = {"path": "b.txt", "error": "bad", "exit_code": 2, "settings": "fp"}
    path.write_text(
        "\n".join(record_line(r) for r in (answer, other, error)) + '\n{"path": "c.txt", "quest', encoding="utf-8"
    )
    log = ResultLog(str(path))
    resumed = log.open("fp")
    try:
        assert resumed.done == {(os.path.realpath("a.txt"), "q")}  # keyed by the resolved path
        assert resumed.other_settings == 1 and resumed.errors == 1
        assert resumed.torn_bytes == len('{"path": "c.txt", "quest')
        assert path.read_bytes().endswith(b"}\n")  # cut at the last complete line
        with pytest.raises(UsageError, match="another kvtool run"):
            ResultLog(str(path)).open("fp")
        log.write({"path": "é\udcff.txt", "question": "q", "answer": "y", "settings": "fp"})  # a non-UTF-8 name
    finally:
        log.close()
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 4 and json.loads(lines[-1])["path"] == "é\udcff.txt"
    again = ResultLog(str(path))
    assert (os.path.realpath("é\udcff.txt"), "q") in again.open("fp").done
    again.close()
    path.write_text('{"path": "a"}\nnot json\n{"path": "b"}\n', encoding="utf-8")
    with pytest.raises(UsageError, match="line 2 is not a kvtool record"):
        ResultLog(str(path)).open("fp")
    with pytest.raises(UsageError, match="is a directory"):
        ResultLog(str(tmp_path)).open("fp")


# --------------------------------------------------------------------------------------------- the CLI
@pytest.fixture(scope="module")
def docs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return write_docs(tmp_path_factory.mktemp("docs") / "folder")


@pytest.mark.parametrize("cite", [False, True])
def test_many_documents_answer_like_one_run_per_file(model_dir, docs, cite):
    """One run over a folder gives, document by document, the answers and token counts of ``kvtool ask FILE``
    run once per file (greedy decoding, the same thread count: identical)."""
    flags = base(model_dir, *(["--cite"] if cite else []))
    folder = str(Path(docs[0]).parent)
    r = run("ask", folder, "--question", QUESTIONS[0], "--question", QUESTIONS[1], *flags)
    assert r.exit_code == 0, r.output
    got = {(x["path"], x["question"]): x for x in records(r.stdout)}
    assert sorted(p for p, _ in got) == sorted(d for d in docs for _ in QUESTIONS)
    for d in docs:
        one = run("ask", d, *QUESTIONS, *flags, "--jsonl", "--quiet")
        assert one.exit_code == 0, one.output
        lines = records(one.stdout)
        stats = lines[-1]["stats"]
        for line in lines[:-1]:
            rec = got[(d, line["question"])]
            assert rec["answer"] == line["answer"]
            assert rec["stats"]["decode_tokens"] == line["tokens"]
            assert rec["stats"]["document_tokens"] == stats["document_tokens"] > 0
            assert rec.get("citations") == line.get("citations")
    assert "answered 3 of 3 documents" in r.stderr


def test_one_hostile_file_in_a_folder_is_one_error_line(model_dir, docs, tmp_path):
    folder = tmp_path / "mixed"
    good = write_docs(folder, 2)
    (folder / "sub" / "evil.txt").write_bytes(b"looks like text\x00then binary")
    (folder / "picture.png").write_bytes(b"\x89PNG\r\n")
    r = run("ask", folder, "--question", QUESTIONS[0], *base(model_dir))
    assert r.exit_code == EXIT_PARTIAL, r.output
    out = records(r.stdout)
    errors = [x for x in out if "error" in x]
    assert len(errors) == 1 and errors[0]["path"] == str(folder / "sub" / "evil.txt")
    assert "looks binary" in errors[0]["error"] and errors[0]["exit_code"] == 2
    assert sorted(x["path"] for x in out if "answer" in x) == sorted(good)
    assert "1 file(s) of other formats skipped" in r.stderr
    assert "1 of 3 documents failed" in r.stderr.strip().splitlines()[-1]
    # nothing answerable: what one bad document exits with
    r = run("ask", folder / "sub" / "evil.txt", folder / "nope.txt", "--question", "q", *base(model_dir))
    assert r.exit_code == 2 and "no such file" in r.stdout, r.output


def test_output_file_resumes_and_a_torn_line_is_redone(model_dir, docs, tmp_path):
    out = tmp_path / "answers.jsonl"
    args = ["ask", *docs, "--question", QUESTIONS[0], "--question", QUESTIONS[1], *base(model_dir), "-o", out]
    r = run(*args)
    assert r.exit_code == 0 and r.stdout == "", r.output  # -o: stdout stays empty
    full = out.read_text(encoding="utf-8")
    assert len(records(full)) == 2 * len(docs)
    r = run(*args)
    assert r.exit_code == 0 and out.read_text(encoding="utf-8") == full  # nothing answered twice
    assert "3 of 3 documents already done" in r.stderr
    torn = full[: full.rindex("\n", 0, len(full) - 1) + 1] + full.splitlines()[-1][:25]  # the last line cut short
    out.write_text(torn, encoding="utf-8")
    r = run(*args)
    assert r.exit_code == 0, r.output
    assert "torn last line" in r.stderr
    now = out.read_text(encoding="utf-8")
    assert now.startswith(torn[: torn.rindex("\n") + 1])  # what was complete is kept as it was
    assert answers(now) == answers(full)  # and the file holds what one uninterrupted run writes

    r = run(*args[:-2], "--max-new-tokens", "3", "-o", out)  # other settings: those pairs again, kept apart
    pairs = [(x["path"], x["question"], x["settings"]) for x in records(out.read_text(encoding="utf-8"))]
    assert r.exit_code == 0 and len(pairs) == 4 * len(docs) == len(set(pairs))


def test_prefill_many_then_ask_the_caches(model_dir, docs, tmp_path):
    """``prefill DOC... -o DIR/`` writes one .kvc per document (same basenames do not collide); asking the
    folder of caches answers as asking the documents."""
    twin = tmp_path / "twin" / Path(docs[0]).name
    twin.parent.mkdir()
    twin.write_text(Path(docs[1]).read_text(encoding="utf-8"), encoding="utf-8")
    caches = tmp_path / "caches"
    flags = base(model_dir)
    prefill_flags = [f for i, f in enumerate(flags) if "--max-new-tokens" not in flags[max(0, i - 1) : i + 1]]
    r = run("prefill", *docs, twin, "-o", f"{caches}{os.sep}", *prefill_flags)
    assert r.exit_code == 0, r.output
    written = records(r.stdout)
    assert len(written) == 4 and len({x["output"] for x in written}) == 4
    assert all(Path(x["output"]).is_file() and x["bytes"] > 0 for x in written)
    again = run("prefill", *docs, twin, "-o", f"{caches}{os.sep}", *prefill_flags)
    assert again.exit_code == 0 and again.stdout == "" and "4 of 4 documents already done" in again.stderr
    asked = records(run("ask", caches, "--question", QUESTIONS[0], *flags).stdout)
    from_docs = records(run("ask", *docs, twin, "--question", QUESTIONS[0], *flags).stdout)
    source = {x["output"]: x["path"] for x in written}
    assert sorted((source[x["path"]], x["answer"]) for x in asked) == sorted(
        (x["path"], x["answer"]) for x in from_docs
    )


def test_summarize_many(model_dir, docs):
    r = run("summarize", *docs, "--length", "short", *base(model_dir))
    assert r.exit_code == 0, r.output
    out = records(r.stdout)
    assert [x["path"] for x in out] == docs and all(x["length"] == "short" and "summary" in x for x in out)
    assert all(x["stats"]["recall_tokens"] == 64 for x in out)  # --recall 64 given: as for one document


def test_files_from_stdin_nul_separated(model_dir, docs):
    r = run("ask", "--files-from", "-", "--question", "q", *base(model_dir), input="\0".join(docs) + "\0")
    assert r.exit_code == 0, r.output
    assert [x["path"] for x in records(r.stdout)] == docs


def test_one_document_keeps_its_single_document_output(model_dir, docs):
    r = run("ask", docs[0], "--question", "q", *base(model_dir), "--json")
    assert r.exit_code == 0 and [a["question"] for a in json.loads(r.stdout)["answers"]] == ["q"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["ask", "{doc}", "q", "-o", "{tmp}/o.jsonl"], "--output take(s) the many-document form"),
        (["ask", "{doc}", "q", "--files-from", "{doc}"], "--files-from take(s) the many-document form"),
        (["ask", "{doc}", "{doc}", "--question", "q", "--workers", "2"], "--workers sets the size of a Ray pool"),
        (["ask", "{doc}", "{doc}", "--question", "q", "-o", "{tmp}"], "is a directory"),
        (["ask", "{doc}", "Who signs?", "--questions-file", "{doc}"], "is not a file: with --question"),
        (["ask", "{empty}", "--question", "q"], "no documents to read"),
        (["ask", "{doc}", "{doc}", "--question", ""], "question 1 is empty"),
        (["prefill", "{doc}", "{doc}"], "-o DIR/"),
        (["prefill", "{doc}", "{tmp}/x.txt", "-o", "{tmp}/out.kvc"], "many documents need a directory"),
        (["summarize", "{doc}", "{tmp}/x.txt", "-o", "{doc}"], "is one of the documents"),
        (["summarize", "{doc}", "{doc}", "-o", "{tmp}/notes.txt"], "line 1 is not a kvtool record"),
    ],
)
def test_bad_options_of_the_many_form_are_one_line_and_exit_2(model_dir, docs, tmp_path, args, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.odt").write_text("x", encoding="utf-8")
    (tmp_path / "notes.txt").write_text("my notes, no newline at the end", encoding="utf-8")
    argv = [a.format(doc=docs[0], tmp=tmp_path, empty=tmp_path / "empty") for a in args]
    r = run(*argv, "--model", model_dir)
    assert r.exit_code == 2, r.output
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and message in err[0], r.stderr
    assert (tmp_path / "notes.txt").read_text(encoding="utf-8") == "my notes, no newline at the end"  # untouched


def test_ray_without_the_extra_is_one_line_and_exit_2(docs):
    script = (
        "import sys; sys.modules['ray'] = None\n"  # what an environment without Ray gives
        "from kvtool.cli.app import main\n"
        f"sys.exit(main(['ask', *{docs!r}, '--question', 'q', '--ray', 'local']))"
    )
    r = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.strip() == ("kvtool: error: --ray needs Ray, which is not installed: pip install 'kvtool[cluster]'")


def test_a_run_closes_every_file_it_opens(model_dir, tmp_path):
    """Thirty documents, some failing at different stages: the process holds no more descriptors after."""
    folder = tmp_path / "many"
    write_docs(folder, 3)
    for i in range(12):
        (folder / f"bad{i}.txt").write_bytes(b"word " * (i * 360) + b"\x00")  # binary found early or late
        (folder / f"empty{i}.md").write_text(" \n", encoding="utf-8")
    args = ["ask", folder, "--question", "q", *base(model_dir)]
    run(*args)  # warm-up: the model's own files and caches are opened once per process

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = fds()
    r = run(*args)
    assert r.exit_code == EXIT_PARTIAL and len(records(r.stdout)) == 3 + 24, r.output
    assert fds() <= before


def test_ray_is_imported_by_the_cluster_module_only():
    """Ray is optional (kvtool[cluster]): one module imports it, and the CLI does not load it unless --ray is given."""
    import re

    package = Path(ROOT) / "kvtool"
    importers = sorted(
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if re.search(r"^\s*(import ray\b|from ray\b)", p.read_text(encoding="utf-8"), re.M)
    )
    assert importers == [os.path.join("runtime", "cluster.py")]
    probe = "import sys, kvtool.cli.app; print('ray' in sys.modules, 'torch' in sys.modules)"
    r = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert r.stdout.split() == ["False", "False"], r.stderr
