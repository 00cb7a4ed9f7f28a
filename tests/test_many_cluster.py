"""Many documents, the slow part: a real local Ray cluster (``ray.init(num_cpus=2)``, no mock), a worker killed
mid-document, and runs interrupted by SIGINT and SIGKILL then resumed. Each pair must come out exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.cli.app import app
from tests.helpers import tiny_checkpoint
from tests.test_many import QUESTIONS, base, records, write_docs

pytestmark = pytest.mark.slow

ROOT = str(Path(__file__).resolve().parents[1])
runner = CliRunner()


def pairs(path: Path) -> list[tuple[str, str]]:
    return [(x["path"], x["question"]) for x in records(path.read_text(encoding="utf-8")) if "answer" in x]


def kvtool(*args: object, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "kvtool.cli.app", *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def wait_for_lines(path: Path, n: int, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"{path} never had {n} lines")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tiny_checkpoint(tmp_path_factory.mktemp("cluster") / "tiny"))


@pytest.fixture(scope="module")
def docs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return write_docs(tmp_path_factory.mktemp("cluster-docs") / "folder", 12)


# --------------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_an_interrupted_run_resumes_with_every_pair_exactly_once(model_dir, docs, tmp_path, sig):
    out = tmp_path / "answers.jsonl"
    args = ["ask", *docs, "--question", QUESTIONS[0], "--question", QUESTIONS[1],
            *base(model_dir, "--max-new-tokens", "24"), "-o", out]
    proc = kvtool(*args)
    wait_for_lines(out, 5, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    if sig == signal.SIGINT:
        assert proc.returncode == 130, err
        assert "run the same command again to resume" in err
    else:
        assert proc.returncode == -signal.SIGKILL
    before = pairs(out)
    assert 5 <= len(before) < 2 * len(docs) and len(set(before)) == len(before)
    proc = kvtool(*args)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    after = pairs(out)
    assert after[: len(before)] == before  # what was written stays, in place
    assert sorted(after) == sorted((d, q) for d in docs for q in QUESTIONS)  # every pair, exactly once


# --------------------------------------------------------------------------------------------- Ray
@pytest.fixture(scope="module")
def cluster():
    """A real local Ray cluster of the CI machine's two CPUs; runs in this process and in subprocesses
    (``--ray auto``) use it."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()


def test_a_ray_pool_answers_like_the_serial_run(cluster, model_dir, docs):
    """``--ray local --workers 2`` (here: the cluster this process is connected to) gives, document by
    document, the records of the serial run: the same answers and token counts."""
    flags = ["--question", QUESTIONS[0], "--question", QUESTIONS[1], *base(model_dir, "--cite")]
    serial = runner.invoke(app, ["ask", *docs[:6], *flags])
    pooled = runner.invoke(app, ["ask", *docs[:6], *flags, "--ray", "local", "--workers", "2"])
    assert serial.exit_code == 0 and pooled.exit_code == 0, pooled.output

    def key(x: dict) -> tuple:
        return x["path"], x["question"], x["answer"], x["stats"]["decode_tokens"], x["stats"]["document_tokens"], \
            json.dumps(x.get("citations"))

    assert sorted(map(key, records(pooled.stdout))) == sorted(map(key, records(serial.stdout)))
    assert "2 worker(s), each 1 thread(s)" in pooled.stderr


def test_a_killed_worker_loses_no_document(cluster, model_dir, docs, tmp_path):
    """Kill -9 a Ray worker while it reads a document: another worker answers it; nothing is lost or written
    twice (a subprocess driver joins the cluster with ``--ray auto``)."""
    import psutil

    out = tmp_path / "answers.jsonl"
    proc = kvtool("ask", *docs, "--question", QUESTIONS[0], "--question", QUESTIONS[1],
                  *base(model_dir, "--max-new-tokens", "24"), "--ray", "auto", "--workers", "2", "-o", out)
    victim = None
    deadline = time.monotonic() + 180
    while victim is None and time.monotonic() < deadline and proc.poll() is None:
        wait = out.exists() and out.read_bytes().count(b"\n") >= 2  # a document in, the pool is busy
        for p in psutil.process_iter(["cmdline"]):
            if wait and (p.info["cmdline"] or [""])[0].startswith("ray::KvtoolWorker.run"):
                victim = p
                break
        time.sleep(0.02)
    assert victim is not None, proc.communicate()
    victim.kill()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "worker lost while reading" in err and "retried on another worker" in err
    got = pairs(out)
    assert sorted(got) == sorted((d, q) for d in docs for q in QUESTIONS)  # every pair, exactly once
    assert not [x for x in records(out.read_text(encoding="utf-8")) if "error" in x]
