"""Many documents on a Ray cluster: a pool of actors, each holding one loaded model, fed a document at a time.

The only module of kvtool that imports Ray, an optional dependency (the extra ``kvtool[cluster]``).
The driver (the ``kvtool`` process) keeps the queue and hands the next document to whichever worker
finishes first (``ray.wait`` over the workers' streams of records); each record streams back as its
answer completes and the driver writes it, once, to the same output and under the same resume rule as
a run in one process (:class:`kvtool.runtime.many.Driver`), stamped with the driver's settings fingerprint.
Scheduling, placement, restarts and transport are Ray's: actors sized node by node
(:mod:`kvtool.runtime.cluster_plan`; ``num_gpus=1`` each on GPUs; on CPUs ``num_cpus`` = their torch
threads, so nothing is oversubscribed) and reserved at once in a placement group with a bounded wait,
``max_restarts``, streaming generators.

A worker that dies (killed, its node lost, out of memory) loses no document: the answers it had
streamed are kept, its document goes back to the head of the queue for another worker, at most
:data:`~kvtool.runtime.many.MAX_ATTEMPTS` times, then it is reported failed; Ray restarts the actor.
Ctrl-C or SIGTERM asks each worker to stop at its next block (a flag its read checks: the document's
cleanup runs), and kills the one that has not stopped after :data:`CANCEL_SECONDS`.

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

from kvtool.errors import EXIT_RUNTIME, EXIT_USAGE, KvtoolError, UsageError, first_line
from kvtool.runtime.cluster_plan import Node, PoolSize, model_for_workers, probe, size_pool, split_address
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
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy
except ImportError:
    ray = None

INSTALL = "pip install 'kvtool[cluster]'"
#: how often Ray restarts a worker process that died (each restart reloads the model)
MAX_RESTARTS = 4
#: how long the driver waits in ``ray.wait`` before looking at Ctrl-C again (seconds)
POLL_SECONDS = 0.5
#: after Ctrl-C or SIGTERM, how long running documents get to stop at their next block, cleaning up as a run in
#: one process does (a .kvc being written removes its temp file and archive); a worker still busy then is killed
CANCEL_SECONDS = 5.0
#: how long the workers' cores (and GPUs) may stay taken by other work before the run gives up (seconds)
PLACE_SECONDS = 60.0


def require() -> None:
    """A one-line ``UsageError`` (exit 2) when Ray is not installed."""
    if ray is None:
        raise UsageError(f"--ray needs Ray, which is not installed: {INSTALL}")


def check_where(where: str) -> str:
    """``local``, ``auto`` or a cluster address (``host:port``, ``ray://host:port``); checked before Ray starts."""
    where = where.strip()
    if not where:
        raise UsageError("--ray must be local, auto or a cluster address such as 10.0.0.5:6379")
    if where not in ("local", "auto"):
        split_address(where)
    return where


class Stopped(KeyboardInterrupt):
    """Raised in a worker between two blocks once the driver asked it to stop: the document's cleanup runs
    (every ``finally`` of a Ctrl-C in one process), nothing more is read."""


class KvtoolWorker:
    """A Ray actor's body: one :class:`DocumentWorker` (a loaded model) reading one document at a time.

    The model loads in :meth:`start` (or with the first document after Ray restarted the actor), so an
    error loading it comes back as that call's exception, not as a dead actor. The actor runs two threads
    (``max_concurrency=2``): :meth:`stop` is answered while :meth:`run` reads, and the read checks the flag
    it sets at every event the engine emits (each block of the prefill, the decode's read-backs, each part
    of a .kvc written) -- ``ray.cancel`` cannot interrupt a task that is running Python code."""

    def __init__(self, task: Task, describe: Callable[[BaseException], str]) -> None:
        self.stopping = threading.Event()
        self.worker = DocumentWorker(task, listener=self._between_blocks, describe=describe)

    def start(self) -> dict[str, Any]:
        return {**self.worker.start(), "node": ray.util.get_node_ip_address()}

    def run(self, job: Job) -> Iterator[dict[str, Any]]:
        """The document's records, each streamed to the driver as soon as it is complete; after :meth:`stop`,
        none more (the stream just ends, once the document's temp files and archive are gone)."""
        try:
            yield from self.worker.run(job)
        except Stopped:
            return

    def stop(self) -> None:
        """Stop the document being read at its next block (the run is ending: the actor reads nothing after)."""
        self.stopping.set()

    def _between_blocks(self, event: Any) -> None:
        if self.stopping.is_set():
            raise Stopped()


@contextlib.contextmanager
def connect(where: str) -> Iterator[str]:
    """Start (``local``) or join (``auto``, an address) a Ray cluster for the run; yields a description.

    A cluster this process is already connected to is used as it is and left running. An address is probed
    first (one line and exit 2 within seconds when nothing there answers as a Ray cluster). Ray's own log
    lines stay at errors, and workers' output is not relayed: stdout carries records only.
    """
    require()
    if ray.is_initialized():
        yield "the connected Ray cluster"
        return
    env = {k: v for k, v in os.environ.items() if k.startswith("KVTOOL_")}
    kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.ERROR}
    if where == "local":
        from kvtool.runtime.model import usable_cores

        # a local cluster runs the driver's own kvtool, wherever it was imported from (a source checkout)
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        root = os.path.dirname(package_root)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        kwargs.update(num_cpus=usable_cores(), include_dashboard=False)
        what = "a local Ray cluster"
    else:
        named = where if where != "auto" else os.environ.get("RAY_ADDRESS", "").strip()
        if named and named not in ("auto", "local"):
            probe(named)  # "auto" without RAY_ADDRESS: Ray finds the cluster started on this machine, or says none
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


def pool(task: Task, workers: int | None) -> tuple[PoolSize, Task]:
    """How many actors, each with which Ray resources, and the task they run (threads, device, model path).

    GPUs: one per worker (``--device cuda``, or ``auto`` on a cluster with GPUs); the default pool is one
    worker per GPU. CPUs: each worker gets ``CPU_THREADS_PER_WORKER`` cores of one node by default; its torch
    threads are the cores Ray reserves for it, so workers never oversubscribe a node. Sized node by node
    (:func:`~kvtool.runtime.cluster_plan.size_pool`). The task's fingerprint is the driver's: what the pool
    changes (the device ``auto`` resolved, the threads) changes no answer.
    """
    nodes = [Node(int(n["Resources"].get("CPU", 0)), int(n["Resources"].get("GPU", 0)))
             for n in ray.nodes() if n.get("Alive")]
    device = task.settings.device
    if device.startswith("cuda:"):
        raise UsageError("--device cuda:N cannot be used with --ray: each worker gets a GPU of its own "
                         "(use --device cuda)")
    use_gpu = device == "cuda" or (device == "auto" and any(n.gpus for n in nodes))
    size = size_pool(nodes, use_gpu, workers)
    settings = replace(task.settings, device="cuda" if use_gpu else "cpu" if device == "auto" else device,
                       threads=size.threads)
    settings.model = model_for_workers(settings.model)  # workers run in another directory
    return size, replace(task, settings=settings)


def place(size: PoolSize) -> Any:
    """Reserve every worker's cores (and GPU) at once, a placement group of one bundle per worker spread over
    the nodes; a cluster whose nodes stay busy for ``PLACE_SECONDS`` is one line and exit 1, not a wait."""
    group = placement_group([size.bundle] * size.workers, strategy="SPREAD")
    if group.wait(PLACE_SECONDS):
        return group
    remove_placement_group(group)
    free = ray.available_resources()
    raise KvtoolError(f"the Ray cluster could not place {size.describe()} within {PLACE_SECONDS:.0f} s: its nodes "
                      f"are busy (free now: {free.get('CPU', 0):g} CPU(s), {free.get('GPU', 0):g} GPU(s)); try again "
                      "later, or with fewer --workers", EXIT_RUNTIME)


def check_reachable(jobs: list[Job], task: Task, directory: str | None = None) -> None:
    """Every document (and the model, and the output directory) must be reachable from every node:
    a one-line ``UsageError`` naming the first node and path that are not. Paths missing here too are
    left to their documents' own error records."""
    paths = sorted({j.location for j in jobs if os.path.exists(j.location)})
    model = model_for_workers(task.settings.model)
    if model and os.path.isabs(model):  # a local path; an id is found in each worker's own cache
        paths.append(model)
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
    """Every job on a pool of Ray actors; records reach ``driver`` (written once each) as they complete.
    Nothing left to do (a resumed run that is complete): no cluster is started or joined."""
    require()
    say = say or (lambda s: None)
    if not jobs:
        driver.begin(complete, complete)
        return driver.end()
    with connect(where) as what:
        size, worker_task = pool(task, workers)
        check_reachable(jobs, task, directory)
        nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
        say(f"ray: {what} ({nodes} node(s)); {size.workers} worker(s), each {size.threads} thread(s)"
            + (" and a GPU" if size.gpu else ""))
        group = place(size)
        try:
            driver.begin(len(jobs) + complete, complete, size.workers, what)
            actor_class = ray.remote(KvtoolWorker)
            actors = [actor_class.options(
                max_restarts=MAX_RESTARTS, max_task_retries=0, max_concurrency=2, num_cpus=size.threads,
                num_gpus=1 if size.gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
            ).remote(worker_task, describe) for i in range(size.workers)]
            try:
                _Dispatch(actors, jobs, driver, say).run()
            finally:
                for a in actors:
                    with contextlib.suppress(Exception):
                        ray.kill(a, no_restart=True)
        finally:
            with contextlib.suppress(Exception):
                remove_placement_group(group)
        return driver.end()


class _Dispatch:
    """The driver's loop: start the actors, hand out documents as actors finish, retry a lost worker's.

    Ray's ``ActorPool`` or Ray Data would hand out the documents too, but a task's result there is the
    whole document: this loop takes each answer as it streams back (written and fsynced at once, so a
    lost worker or an interrupted run loses no finished answer), puts a lost worker's document back at the
    head of the queue for another worker with only its unanswered questions, and turns a document's failure
    into its error record while the run goes on.
    """

    def __init__(self, actors: list[Any], jobs: list[Job], driver: Driver,
                 say: Callable[[str], None] = lambda s: None) -> None:
        self.driver = driver
        self.say = say
        self.queue: deque[Job] = deque(jobs)
        self.idle: list[Any] = []
        self.starting: dict[Any, Any] = {a.start.remote(): a for a in actors}  # start() ref -> actor
        self.running: dict[Any, tuple[Any, Job, float]] = {}  # record stream -> (actor, job, started)
        self.last_actor: dict[int, Any] = {}  # id(job) -> the actor it was lost on

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
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (Ray turns kvtool's Terminated into a KeyboardInterrupt)
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
        """A worker has loaded its model: it joins the pool if it runs this kvtool (each worker is checked,
        a restarted one too: it may have come back on another node)."""
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
        from kvtool import __version__

        if info.get("version") != __version__:
            raise UsageError(f"the Ray worker on node {info.get('node', '?')} runs kvtool {info.get('version')}, this "
                             f"is kvtool {__version__}: install the same version on every node", EXIT_USAGE)
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
        """Ctrl-C or SIGTERM: every running worker is asked to stop at its next block (its document's temp
        files and archive go, as in a run in one process); answers that still complete are written. A worker
        that has not stopped after ``CANCEL_SECONDS`` (blocked reading a FIFO, say) is killed, and said so.
        A second Ctrl-C ends the wait at once."""
        for actor, _, _ in self.running.values():
            with contextlib.suppress(Exception):
                actor.stop.remote()
        deadline = time.monotonic() + CANCEL_SECONDS
        while self.running and time.monotonic() < deadline:
            left = deadline - time.monotonic()
            ready, _ = ray.wait(list(self.running), num_returns=1, timeout=min(POLL_SECONDS, max(left, 0.01)))
            for stream in ready:
                job = self.running[stream][1]
                try:
                    self.driver.take(job, ray.get(next(stream)))
                except Exception:  # noqa: BLE001 - ended, stopped, failed or lost: this worker is done either way
                    del self.running[stream]
        for actor, job, _ in self.running.values():
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            self.say(f"ray: the worker reading {job.path} did not stop within {CANCEL_SECONDS:.0f} s; killed it")
