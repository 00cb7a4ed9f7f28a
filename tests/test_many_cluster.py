"""Many documents, the slow part: a real local Ray cluster (``ray.init(num_cpus=2)``, no mock), a worker killed
mid-document, and runs interrupted by SIGINT and SIGKILL then resumed. Each pair must come out exactly once."""

from __future__ import annotations

import contextlib
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
    return subprocess.Popen(
        [sys.executable, "-m", "kvtool.cli.app", *map(str, args)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


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
    args = [
        "ask",
        *docs,
        "--question",
        QUESTIONS[0],
        "--question",
        QUESTIONS[1],
        *base(model_dir, "--max-new-tokens", "24"),
        "-o",
        out,
    ]
    proc = kvtool(*args)
    # the run yields the CPU to this test's poll: on a loaded machine it could otherwise answer every pair
    # between the poll's wake-ups and end before the signal arrives
    os.setpriority(os.PRIO_PROCESS, proc.pid, 15)
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
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}},
    )
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
        return (
            x["path"],
            x["question"],
            x["answer"],
            x["stats"]["decode_tokens"],
            x["stats"]["document_tokens"],
            json.dumps(x.get("citations")),
        )

    assert sorted(map(key, records(pooled.stdout))) == sorted(map(key, records(serial.stdout)))
    assert "2 worker(s), each 1 thread(s)" in pooled.stderr


def test_a_killed_worker_loses_no_document(cluster, model_dir, docs, tmp_path):
    """Kill -9 a Ray worker while it reads a document: another worker answers it; nothing is lost or written
    twice (a subprocess driver joins the cluster with ``--ray auto``)."""
    import psutil

    out = tmp_path / "answers.jsonl"
    proc = kvtool(
        "ask",
        *docs,
        "--question",
        QUESTIONS[0],
        "--question",
        QUESTIONS[1],
        *base(model_dir, "--max-new-tokens", "24"),
        "--ray",
        "auto",
        "--workers",
        "2",
        "-o",
        out,
    )
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


def small(docs: list[str]) -> list[str]:
    """The two shortest documents (a few thousand tokens)."""
    return [docs[0], docs[2]]


def test_a_resumed_ray_run_writes_nothing_again_and_starts_no_cluster(cluster, model_dir, docs, tmp_path):
    """Ray with ``-o`` run twice: the records the workers stamped carry the driver's fingerprint (the pool's
    device and threads change no answer), so the second run finds every pair done, writes nothing and
    finishes in seconds, without starting a cluster."""
    out = tmp_path / "answers.jsonl"
    args = [
        "ask",
        *small(docs),
        "--question",
        QUESTIONS[0],
        *base(model_dir),
        "--ray",
        "local",
        "--workers",
        "1",
        "-o",
        str(out),
    ]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    written = out.read_bytes()
    assert len(pairs(out)) == 2
    t0 = time.monotonic()
    proc = kvtool(*args)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert time.monotonic() - t0 < 20, err
    assert out.read_bytes() == written  # nothing answered again
    assert "2 of 2 documents already done" in err and "made with other settings" not in err


def test_a_busy_cluster_is_one_line_and_exit_1_not_a_wait(cluster, model_dir, docs):
    """Every core of the cluster is taken by other work: the pool cannot be placed, and after the placement
    wait (1 s here) the run says so in one line and exits 1, instead of waiting for ever."""

    @cluster.remote(num_cpus=2)
    class Hog:
        def ping(self) -> int:
            return 1

    hog = Hog.remote()
    cluster.get(hog.ping.remote())
    try:
        code = (
            "import sys, kvtool.runtime.cluster as c; c.PLACE_SECONDS = 1.0; from kvtool.cli.app import main; "
            "sys.exit(main(sys.argv[1:]))"
        )
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
        r = subprocess.run(
            [
                sys.executable,
                "-c",
                code,
                "ask",
                docs[0],
                "--question",
                QUESTIONS[0],
                *base(model_dir),
                "--ray",
                "auto",
                "--workers",
                "1",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        cluster.kill(hog)
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("kvtool:")]
    assert errors == [
        "kvtool: error: the Ray cluster could not place 1 worker(s) of 2 core(s) each within 1 s: its "
        "nodes are busy (free now: 0 CPU(s), 0 GPU(s)); try again later, or with fewer --workers"
    ]


def ray_workers(method: str = "") -> list:
    """This machine's processes running a kvtool Ray actor (``method``: running that method now)."""
    import psutil

    prefix = f"ray::KvtoolWorker{'.' + method if method else ''}"
    return [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [""])[0].startswith(prefix)]


def wait_until(predicate, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_sigterm_stops_a_working_ray_worker_at_its_next_block(cluster, model_dir, tmp_path):
    """SIGTERM while a worker prefills a long document: the worker stops at its next block (not killed after
    a grace period), its cleanup runs -- no .kvc, temp file or archive is left in the output directory -- and
    the run exits 143 at once, its worker gone."""
    doc = tmp_path / "long.txt"
    doc.write_text(" ".join(f"The cat number {j} sat on mat {j}." for j in range(40_000)), encoding="utf-8")
    caches = tmp_path / "caches"
    proc = kvtool(
        "prefill",
        doc,
        "--model",
        model_dir,
        "--budget",
        "160",
        "--block-size",
        "32",
        "--recall",
        "64",
        "--ray",
        "auto",
        "--workers",
        "1",
        "-o",
        f"{caches}/",
    )
    wait_until(lambda: ray_workers("run") or proc.poll() is not None)
    time.sleep(1.0)  # into the prefill
    assert proc.poll() is None, proc.communicate()
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert time.monotonic() - t0 < 4, err  # stopped at a block, not after the 5 s grace
    assert "did not stop" not in err and err.strip().endswith("kvtool: terminated (SIGTERM)"), err
    assert not list(caches.iterdir())  # no .kvc, no temp file, no archive
    wait_until(lambda: not ray_workers(), timeout=30)


def test_a_stopped_worker_removes_the_cache_and_archive_it_was_writing(model_dir, tmp_path):
    """The actor's body itself (no cluster needed): ``stop()`` arrives while the .kvc is being written, after its
    archive was placed beside it; the read stops at the next chunk written, and both the temp file and the
    archive are gone -- what a ``ray.kill`` would have left behind."""
    pytest.importorskip("ray")
    from kvtool.runtime import cluster as ray_cluster
    from kvtool.runtime.events import PhaseProgress
    from kvtool.runtime.many import Job, Task, describe_error
    from kvtool.runtime.settings import resolve_settings

    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(f"The cat number {j} sat on mat {j}." for j in range(600)), encoding="utf-8")
    out = tmp_path / "caches"
    out.mkdir()
    settings = resolve_settings(
        None, {"model": model_dir, "budget": "160", "block_size": 32, "threads": 1, "recall": "64"}
    )
    worker = ray_cluster.KvtoolWorker(Task("prefill", settings), describe_error)
    present: list[list[str]] = []

    def stop_mid_write(event: object) -> None:
        if isinstance(event, PhaseProgress) and event.name == "writing doc.kvc" and 0 < event.done and not present:
            present.append(sorted(os.listdir(out)))
            worker.stop()  # as the driver's stop.remote() would, from the actor's other thread
        worker._between_blocks(event)

    worker.worker.listener = stop_mid_write  # the session is made with it on the first job
    job = Job(path=str(doc), location=str(doc), keys=["prefill"], output=str(out / "doc.kvc"))
    assert list(worker.run(job)) == []  # stopped: no record, no error record
    assert len(present) == 1 and any(".tmp" in name for name in present[0]) and len(present[0]) == 2, present
    assert os.listdir(out) == []  # the temp file and the archive are gone


def test_sigterm_kills_a_hung_ray_worker_after_the_grace_period(cluster, model_dir, tmp_path):
    """A worker that does not answer (hung in a system call or a library; here stopped with SIGSTOP mid-read,
    since a FIFO document is now refused at open) cannot look at its stop flag: after the grace period the driver
    kills it, says so in one line, and exits 143; no worker is left running."""
    doc = tmp_path / "long.txt"
    doc.write_text(" ".join(f"The cat number {j} sat on mat {j}." for j in range(40_000)), encoding="utf-8")
    proc = kvtool("ask", doc, "--question", QUESTIONS[0], *base(model_dir), "--ray", "auto", "--workers", "1")
    wait_until(lambda: ray_workers("run") or proc.poll() is not None)
    time.sleep(1.0)  # into the prefill
    assert proc.poll() is None, proc.communicate()
    hung = ray_workers("run")
    for p in hung:
        p.send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    finally:
        for p in hung:
            with contextlib.suppress(Exception):
                p.send_signal(signal.SIGCONT)
    assert proc.returncode == 143, err
    assert 4 < time.monotonic() - t0 < 30, err
    assert f"ray: the worker reading {doc} did not stop within 5 s; killed it" in err
    assert err.strip().endswith("kvtool: terminated (SIGTERM)"), err
    wait_until(lambda: not ray_workers(), timeout=30)


# --------------------------------------------------------------------------------------------- several nodes
@pytest.fixture(scope="module")
def two_nodes():
    """A real Ray cluster of two nodes of one CPU each (``ray.cluster_utils.Cluster``: a head and a worker node
    started on this machine); kvtool joins it as a subprocess with ``--ray ADDRESS``."""
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as mp:  # what the nodes' workers inherit
        mp.setenv("PYTHONPATH", ROOT)
        mp.setenv("OMP_NUM_THREADS", "1")
        nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        nodes.add_node(num_cpus=1)
    nodes.wait_for_nodes()
    yield nodes
    nodes.shutdown()


def test_a_worker_is_sized_for_one_node_not_the_whole_cluster(two_nodes, model_dir, docs, tmp_path):
    """``--workers 1`` on two 1-CPU nodes: the worker asks for one core (what a node has), not two (what the
    cluster has, which no node could give: it waited for ever); more workers than the nodes' cores are
    refused in one line before any model loads."""
    out = tmp_path / "answers.jsonl"
    proc = kvtool(
        "ask",
        *small(docs),
        "--question",
        QUESTIONS[0],
        *base(model_dir),
        "--ray",
        two_nodes.address,
        "--workers",
        "1",
        "-o",
        out,
    )
    try:
        _, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, err
    assert "2 node(s)); 1 worker(s), each 1 thread(s)" in err
    assert sorted(pairs(out)) == [(d, QUESTIONS[0]) for d in small(docs)]
    proc = kvtool(
        "ask", docs[0], "--question", QUESTIONS[0], *base(model_dir), "--ray", two_nodes.address, "--workers", "3"
    )
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert err.strip().splitlines() == [
        "kvtool: error: --workers 3: the Ray cluster's nodes (1 CPU(s), 1 CPU(s)) "
        "hold at most 2 workers of a core each (a worker runs on one node)"
    ]


def test_every_worker_is_checked_for_the_same_kvtool(two_nodes, model_dir, docs, tmp_path):
    """A third node runs another kvtool version (its processes start later than the others'): the run stops
    with one line naming it, even though the first worker to start ran the right version. The node's other
    version is a ``sitecustomize`` on its PYTHONPATH (a Ray worker puts the driver's own path first, and this
    machine has the driver's kvtool at that path)."""
    import kvtool as package

    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text(
        "import time\nimport kvtool\nkvtool.__version__ = '0.0.0+other'\ntime.sleep(3)\n", encoding="utf-8"
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join((str(other), ROOT)))
        node = two_nodes.add_node(num_cpus=1)
    two_nodes.wait_for_nodes()
    try:
        proc = kvtool(
            "ask", *docs, "--question", QUESTIONS[0], *base(model_dir), "--ray", two_nodes.address, "--workers", "3"
        )  # more documents than the others read in the seconds that one starts later
        _, err = proc.communicate(timeout=240)
    finally:
        two_nodes.remove_node(node)
    assert proc.returncode == 2, err
    assert (
        f"runs kvtool 0.0.0+other, this is kvtool {package.__version__}: install the same version on every node"
        in err.strip().splitlines()[-1]
    ), err
