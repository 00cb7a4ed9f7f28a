"""Many documents on a Ray cluster: a pool of actors, each holding one loaded model, fed a document at a time.

The only module of kvtool that imports Ray, an optional dependency (the extra ``kvtool[cluster]``).
The driver (the ``kvtool`` process) keeps the queue and hands the next document to whichever worker
finishes first (``ray.wait`` over the workers' streams of records); each record streams back as its
answer completes and the driver writes it, once, to the same output and under the same resume rule as
a run in one process (:class:`kvtool.runtime.many.Driver`). Scheduling, placement, restarts and
transport are Ray's: actors (``num_gpus=1`` each on GPUs; on CPUs the cores split between them,
``num_cpus`` = their torch threads, so nothing is oversubscribed), ``max_restarts``, streaming generators.

A worker that dies (killed, its node lost, out of memory) loses no document: the answers it had
streamed are kept, its document goes back to the head of the queue for another worker, at most
:data:`~kvtool.runtime.many.MAX_ATTEMPTS` times, then it is reported failed; Ray restarts the actor.

Workers open the documents themselves: every path must name the same file on every node (a shared
filesystem). That is checked before any model loads, on every node of the cluster.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from kvtool.errors import EXIT_USAGE, KvtoolError, UsageError, first_line
from kvtool.runtime.many import (
    MAX_ATTEMPTS,
    DocumentWorker,
    Driver,
    Job,
    Outcome,
    Task,
    WorkerLost,
    describe_error,
    is_setting_error,
)

try:  # the optional extra: without it, --ray is one line and exit 2 (``require``)
    import ray
    from ray.exceptions import (
        NodeDiedError,
        ObjectLostError,
        OutOfMemoryError,
        RayActorError,
        RayTaskError,
        WorkerCrashedError,
    )

    #: what a worker's death looks like to the driver: the actor died or is unreachable, its node is gone, Ray's
    #: memory monitor killed it, or a record it had sent was lost with its node
    LOST = (RayActorError, NodeDiedError, ObjectLostError, OutOfMemoryError, WorkerCrashedError)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError:
    ray = None

INSTALL = "pip install 'kvtool[cluster]'"
#: on CPUs, the default pool gives each worker this many cores (torch threads); fewer cores: one worker
CPU_THREADS_PER_WORKER = 2
#: how often Ray restarts a worker process that died (each restart reloads the model)
MAX_RESTARTS = 4
#: how long the driver waits in ``ray.wait`` before looking at Ctrl-C again (seconds)
POLL_SECONDS = 0.5
#: after Ctrl-C, how long running documents get to stop cleanly (a .kvc being written removes its temp file)
CANCEL_SECONDS = 5.0


def require() -> None:
    """A one-line ``UsageError`` (exit 2) when Ray is not installed."""
    if ray is None:
        raise UsageError(f"--ray needs Ray, which is not installed: {INSTALL}")


def check_where(where: str) -> str:
    """``local``, ``auto`` or a cluster address (``host:port``, ``ray://host:port``); checked before Ray starts."""
    where = where.strip()
    if not where:
        raise UsageError("--ray must be local, auto or a cluster address such as 10.0.0.5:6379")
    return where


class KvtoolWorker:
    """A Ray actor's body: one :class:`DocumentWorker` (a loaded model) reading one document at a time.

    The model loads in :meth:`start` (or with the first document after Ray restarted the actor), so an
    error loading it comes back as that call's exception, not as a dead actor."""

    def __init__(self, task: Task, describe: Callable[[BaseException], str]) -> None:
        self.worker = DocumentWorker(task, describe=describe)

    def start(self) -> dict[str, Any]:
        return self.worker.start()

    def run(self, job: Job) -> Iterator[dict[str, Any]]:
        """The document's records, each streamed to the driver as soon as it is complete."""
        yield from self.worker.run(job)


@contextlib.contextmanager
def connect(where: str) -> Iterator[str]:
    """Start (``local``) or join (``auto``, an address) a Ray cluster for the run; yields a description.

    A cluster this process is already connected to is used as it is and left running. Ray's own log
    lines stay at warnings, and workers' output is not relayed: stdout carries records only.
    """
    require()
    if ray.is_initialized():
        yield "the connected Ray cluster"
        return
    env = {k: v for k, v in os.environ.items() if k.startswith("KVTOOL_")}
    kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
    if where == "local":
        from kvtool.runtime.model import usable_cores

        # a local cluster runs the driver's own kvtool, wherever it was imported from (a source checkout)
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        root = os.path.dirname(package_root)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        kwargs.update(num_cpus=usable_cores(), include_dashboard=False)
        what = "a local Ray cluster"
    else:
        kwargs["address"] = where
        what = f"the Ray cluster at {where}"
    in_main = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if in_main else None
    try:
        ray.init(runtime_env={"env_vars": env}, **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise UsageError(f"cannot {'start' if where == 'local' else 'join'} {what}: {first_line(e)}") from None
    finally:
        if sigterm is not None:  # ray.init installs its own; kvtool's stops the run like Ctrl-C (exit 143)
            signal.signal(signal.SIGTERM, sigterm)
    try:
        yield what
    finally:
        ray.shutdown()


def pool(task: Task, workers: int | None) -> tuple[int, dict[str, Any], Task]:
    """How many actors, each with which Ray resources, and the task they run (threads, device, model path).

    GPUs: one per worker (``--device cuda``, or ``auto`` on a cluster with GPUs); the default pool is one
    worker per GPU. CPUs: each worker gets ``CPU_THREADS_PER_WORKER`` cores by default, at least one; its
    torch threads are the cores Ray reserves for it, so workers never oversubscribe a node.
    """
    res = ray.cluster_resources()
    gpus, cpus = int(res.get("GPU", 0)), int(res.get("CPU", 0))
    device = task.settings.device
    if device.startswith("cuda:"):
        raise UsageError("--device cuda:N cannot be used with --ray: each worker gets a GPU of its own "
                         "(use --device cuda)")
    use_gpu = device == "cuda" or (device == "auto" and gpus > 0)
    if use_gpu and gpus == 0:
        raise UsageError("--device cuda: the Ray cluster has no GPU")
    if cpus < 1:
        raise UsageError("the Ray cluster has no CPU to run a worker on")
    if use_gpu:
        n = workers or gpus
        threads = max(1, min(cpus // n, CPU_THREADS_PER_WORKER))
        resources: dict[str, Any] = {"num_gpus": 1, "num_cpus": 1}
        settings = replace(task.settings, device="cuda", threads=threads)
    else:
        n = workers or max(1, cpus // CPU_THREADS_PER_WORKER)
        if n > cpus:
            raise UsageError(f"--workers {n}: the Ray cluster has {cpus} CPU(s), at most {cpus} workers (one core "
                             "each; more would oversubscribe them)")
        threads = cpus // n
        resources = {"num_cpus": threads}
        settings = replace(task.settings, device="cpu" if device == "auto" else device, threads=threads)
    if settings.model:
        settings.model = os.path.abspath(settings.model)  # workers run in another directory
    return n, resources, replace(task, settings=settings)


def check_reachable(jobs: list[Job], task: Task, directory: str | None = None) -> None:
    """Every document (and the model, and the output directory) must be reachable from every node:
    a one-line ``UsageError`` naming the first node and path that are not. Paths missing here too are
    left to their documents' own error records."""
    paths = sorted({j.location for j in jobs if os.path.exists(j.location)})
    if task.settings.model:
        paths.append(os.path.abspath(task.settings.model))
    dirs = [os.path.abspath(directory)] if directory else []

    @ray.remote(num_cpus=0)
    def missing(paths: list[str], dirs: list[str]) -> list[str]:
        gone = [p for p in paths if not os.path.exists(p)]
        return gone + [d for d in dirs if not (os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK))]

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    refs = {missing.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
            .remote(paths, dirs): n for n in nodes}
    for ref, node in refs.items():
        gone = ray.get(ref)
        if gone:
            where = node.get("NodeManagerAddress", node["NodeID"][:8])
            more = f" (and {len(gone) - 1} more)" if len(gone) > 1 else ""
            raise UsageError(f"{gone[0]} is not reachable from Ray node {where}{more}: documents, the model and "
                             "the output directory must be on a filesystem every node mounts, under the same path")


def run_cluster(task: Task, jobs: list[Job], driver: Driver, where: str, workers: int | None = None,
                complete: int = 0, describe: Callable[[BaseException], str] = describe_error,
                directory: str | None = None, say: Callable[[str], None] | None = None) -> Outcome:
    """Every job on a pool of Ray actors; records reach ``driver`` (written once each) as they complete."""
    require()
    say = say or (lambda s: None)
    with connect(where) as what:
        n, resources, worker_task = pool(task, workers)
        check_reachable(jobs, task, directory)
        nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
        threads = worker_task.settings.threads
        say(f"ray: {what} ({nodes} node(s)); {n} worker(s), each {threads} thread(s)"
            + (" and a GPU" if "num_gpus" in resources else ""))
        driver.begin(len(jobs) + complete, complete, n, what)
        if not jobs:
            return driver.end()
        actor_class = ray.remote(KvtoolWorker).options(max_restarts=MAX_RESTARTS, max_task_retries=0, **resources)
        actors = [actor_class.remote(worker_task, describe) for _ in range(n)]
        try:
            _Dispatch(actors, jobs, driver).run()
        finally:
            for a in actors:
                with contextlib.suppress(Exception):
                    ray.kill(a, no_restart=True)
        return driver.end()


class _Dispatch:
    """The driver's loop: start the actors, hand out documents as actors finish, retry a lost worker's."""

    def __init__(self, actors: list[Any], jobs: list[Job], driver: Driver) -> None:
        self.driver = driver
        self.queue: deque[Job] = deque(jobs)
        self.idle: list[Any] = []
        self.starting: dict[Any, Any] = {a.start.remote(): a for a in actors}  # start() ref -> actor
        self.running: dict[Any, tuple[Any, Job, float]] = {}  # record stream -> (actor, job, started)
        self.last_actor: dict[int, Any] = {}  # id(job) -> the actor it was lost on
        self.version_checked = False

    def run(self) -> None:
        try:
            while self.queue or self.running:
                self._hand_out()
                if not self.running and not self.starting:
                    for job in list(self.queue):  # every worker is gone for good
                        self.driver.fail(job, "no Ray worker left to read it (every worker died)")
                        self.driver.finished(job, 0.0)
                    self.queue.clear()
                    break
                ready, _ = ray.wait([*self.starting, *self.running], num_returns=1, timeout=POLL_SECONDS)
                for ref in ready:
                    if ref in self.starting:
                        self._started(ref)
                    else:
                        self._next_record(ref)
        except KeyboardInterrupt:
            self._cancel()
            raise

    def _hand_out(self) -> None:
        while self.idle and self.queue:
            job = self.queue.popleft()
            lost_on = self.last_actor.get(id(job))
            others = [a for a in self.idle if a is not lost_on]
            actor = others[0] if others else self.idle[0]  # a retried document goes to another worker if one is free
            self.idle.remove(actor)
            self.driver.started(job)
            self.running[actor.run.remote(job)] = (actor, job, time.monotonic())

    def _started(self, ref: Any) -> None:
        actor = self.starting.pop(ref)
        try:
            info = ray.get(ref)
        except RayTaskError as e:  # the model cannot load: nothing can start (a bad --model: exit 2)
            cause = e.cause if isinstance(e.cause, BaseException) else e
            if isinstance(cause, KvtoolError):
                raise KvtoolError(f"a Ray worker cannot start: {first_line(cause)}", cause.exit_code) from None
            raise KvtoolError(f"a Ray worker cannot start: {first_line(cause)}") from None
        except LOST:  # died while starting, or restarted too often: out of the pool
            return
        if not self.version_checked:
            from kvtool import __version__

            if info.get("version") != __version__:
                raise UsageError(f"the Ray workers run kvtool {info.get('version')}, this is kvtool {__version__}: "
                                 "install the same version on every node", EXIT_USAGE)
            self.version_checked = True
        self.idle.append(actor)

    def _next_record(self, stream: Any) -> None:
        actor, job, t0 = self.running[stream]
        try:
            record = ray.get(next(stream))
        except StopIteration:
            del self.running[stream]
            self.driver.finished(job, time.monotonic() - t0)
            self.idle.append(actor)
            return
        except LOST as e:
            self._lost(stream, e)
            return
        except RayTaskError as e:  # a setting every document would fail on, or the worker's own code failed
            cause = e.cause if isinstance(e.cause, BaseException) else e
            if is_setting_error(cause):
                raise cause from None
            del self.running[stream]
            self.driver.fail(job, describe_error(cause))
            self.driver.finished(job, time.monotonic() - t0)
            self.idle.append(actor)
            return
        self.driver.take(job, record)

    def _lost(self, stream: Any, e: BaseException) -> None:
        """The worker reading ``job`` died: its document goes back to the queue (or fails after
        ``MAX_ATTEMPTS``), and the actor, which Ray restarts, rejoins the pool once it answers again."""
        actor, job, t0 = self.running.pop(stream)
        reason = first_line(e, 120)
        retried = bool(job.keys) and job.attempts < MAX_ATTEMPTS
        self.driver.emit(WorkerLost(job.path, job.attempts, reason, retried))
        if retried:
            self.last_actor[id(job)] = actor
            self.queue.appendleft(job)
        elif job.keys:
            self.driver.fail(job, f"the Ray worker reading it died {job.attempts} times (last: {reason})")
            self.driver.finished(job, time.monotonic() - t0)
        else:  # every record had arrived: nothing is lost
            self.driver.finished(job, time.monotonic() - t0)
        self.starting[actor.start.remote()] = actor

    def _cancel(self) -> None:
        """Ctrl-C: stop the running documents (their tasks get KeyboardInterrupt), wait a little for them."""
        for stream in self.running:
            with contextlib.suppress(Exception):
                ray.cancel(stream)
        deadline = time.monotonic() + CANCEL_SECONDS
        for stream in list(self.running):
            with contextlib.suppress(StopIteration, Exception):  # cancelled, died, timed out: all the same now
                while time.monotonic() < deadline:
                    ray.get(next(stream), timeout=max(0.1, deadline - time.monotonic()))
