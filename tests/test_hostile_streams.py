"""Signals, pipes and standard streams: an interruption stays an interruption, a reader that goes away ends the
run quietly, a closed stream never moves an error line onto stdout, and a FIFO wait is announced."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvtool.errors import EXIT_PIPE, Terminated
from tests.helpers import tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
KVTOOL = [sys.executable, "-c", "from kvtool.cli.app import entry; entry()"]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "KVTOOL_DEBUG": ""}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-streams")
    model = tiny_checkpoint(root / "tiny")
    doc = root / "doc.txt"
    doc.write_text("the river ran past the old castle and the king slept. " * 60, encoding="utf-8")
    return root, str(model), doc


# -- an interruption while the archive is read or written stays an interruption (143 / 130) ------------------------
@pytest.mark.parametrize("signal_error", [Terminated("SIGTERM"), KeyboardInterrupt()])
def test_an_interrupted_archive_read_raises_the_interruption_not_buffererror(tmp_path, signal_error):
    from kvtool.core.archive_stores import FileStore

    store = FileStore(8, tmp_path)
    store.append(torch.arange(32, dtype=torch.uint8).view(4, 8))

    class Interrupted:  # the signal arrives while the rows are copied out of the map
        def numpy(self):
            raise signal_error

    with pytest.raises(type(signal_error)):
        store.read(Interrupted())
    assert store.read(torch.tensor([1, 3])).tolist() == [list(range(8, 16)), list(range(24, 32))]  # still usable
    store.close()


def test_sigterm_while_the_archive_is_written_exits_143_without_a_file(env, tmp_path):
    root, model, doc = env
    code = (
        "import os, signal, sys\n"
        "from kvtool.core import archive_stores\n"
        "real = archive_stores.FileStore.read\n"
        "def read(self, index):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)  # arrives while the rows are being copied for the archive\n"
        "    return real(self, index)\n"
        "archive_stores.FileStore.read = read\n"
        "from kvtool.cli.app import main\n"
        f"sys.exit(main(['prefill', {str(doc)!r}, '-o', {str(tmp_path / 'c.kvc')!r}, '--model', {model!r},\n"
        "               '--budget', '64', '--block-size', '16', '--recall', '32', '-q']))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 143, r.stderr
    assert r.stderr.strip() == "kvtool: terminated (SIGTERM)", r.stderr
    assert not list(tmp_path.iterdir())


# -- a reader that closes the pipe early: quiet, like cat ------------------------------------------------------------
def _closed_early(args: list[str], read: int) -> tuple[int, str]:
    p = subprocess.Popen([*KVTOOL, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, cwd=REPO)
    assert p.stdout is not None and p.stderr is not None
    if read:
        p.stdout.read(read)
    p.stdout.close()  # `| head -c1`
    err = p.stderr.read().decode()
    return p.wait(timeout=300), err


@pytest.mark.parametrize("read", [1, 0])
def test_a_reader_that_closes_the_pipe_ends_the_run_quietly(env, read):
    _, model, doc = env
    rc, err = _closed_early(
        [
            "ask",
            str(doc),
            "What ran?",
            "--model",
            model,
            "--budget",
            "512",
            "--max-new-tokens",
            "200",
            "--temperature",
            "1",
            "--no-repeat-ngram",
            "0",
            "-q",
        ],
        read,
    )
    assert rc == EXIT_PIPE and err == "", err


def test_jsonl_to_a_closed_pipe_ends_quietly(env, tmp_path):
    _, model, doc = env
    questions = tmp_path / "q.txt"
    questions.write_text("What ran?\nWho slept?\nWhere?\n" * 3, encoding="utf-8")
    rc, err = _closed_early(
        [
            "ask",
            str(doc),
            "--questions-file",
            str(questions),
            "--jsonl",
            "--model",
            model,
            "--budget",
            "512",
            "--max-new-tokens",
            "40",
            "--temperature",
            "1",
            "-q",
        ],
        1,
    )
    assert rc == EXIT_PIPE and err == "", err


# -- closed standard streams ----------------------------------------------------------------------------------------
def _sh(redirect: str, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["sh", "-c", f'"$@" {redirect}', "sh", *KVTOOL, *args],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=REPO,
        timeout=300,
    )


def test_with_stderr_closed_the_error_line_never_lands_on_stdout(tmp_path):
    r = _sh("2>&-", ["ask", str(tmp_path / "missing.txt"), "q"])
    assert r.returncode == 2 and r.stdout == "", r.stdout
    r = _sh("2>&-", ["ask", str(REPO / "README.md"), "q", "--budget", "99999999999999999999"])
    assert r.returncode == 2 and r.stdout == "", r.stdout


def test_with_stdout_closed_the_run_is_refused_before_any_work(env):
    _, model, doc = env
    started = time.monotonic()
    r = _sh(">&-", ["ask", str(doc), "q", "--model", model])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "stdout is closed" in r.stderr, r.stderr
    assert "internal error" not in r.stderr and time.monotonic() - started < 60


# -- a FIFO as the questions file: the wait is announced, then the questions are read ------------------------------
def test_a_fifo_questions_file_says_it_waits_then_reads(env, tmp_path):
    _, model, doc = env
    fifo = tmp_path / "questions"
    os.mkfifo(fifo)
    p = subprocess.Popen(
        [
            *KVTOOL,
            "ask",
            str(doc),
            "--questions-file",
            str(fifo),
            "--model",
            model,
            "--budget",
            "128",
            "--max-new-tokens",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
    )
    assert p.stderr is not None
    line = b""
    deadline = time.monotonic() + 120
    while b"\n" not in line and time.monotonic() < deadline:  # the note comes before the open blocks
        if select.select([p.stderr], [], [], 1)[0]:
            line += os.read(p.stderr.fileno(), 4096)
    assert b"waiting for input on --questions-file" in line, line
    with open(fifo, "w") as w:
        w.write("What ran?\n")
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
