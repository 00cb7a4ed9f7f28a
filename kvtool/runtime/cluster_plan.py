"""Where a Ray run can go, decided without Ray: the cluster address probed, the pool sized node by node.

Two checks that keep ``--ray`` from waiting where nothing will come:

* :func:`probe` asks a cluster address for an answer before Ray is told to join it: an unknown host, a
  closed port, a host that does not answer or a port that is not a Ray cluster's is one line and exit 2
  within seconds, where ``ray.init`` retries for minutes with its own warnings.
* :func:`size_pool` sizes the workers from the nodes, not from the cluster's total: a worker is placed on
  one node, so a worker asking for more cores than any node has would wait forever. What the nodes cannot
  hold is refused here, in one line, before any model loads.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass

from kvtool.errors import UsageError

#: on CPUs, the default pool gives each worker this many cores (torch threads); smaller nodes: one core each
CPU_THREADS_PER_WORKER = 2
#: how long probing a cluster address may take: name lookup, connect, and the server's first answer (seconds)
PROBE_SECONDS = 3.0
#: the ports Ray listens on when an address names none: the head's GCS, and the Ray Client server (ray://)
DEFAULT_PORT, CLIENT_PORT = 6379, 10001
#: a gRPC server (Ray's GCS and its Ray Client server are) answers this HTTP/2 preface with a SETTINGS frame
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_SETTINGS = 4


def split_address(where: str) -> tuple[str, int]:
    """(host, port) of ``host:port``, ``[v6]:port`` or ``ray://host:port`` (Ray's default port when none)."""
    client = where.startswith("ray://")
    rest = where[len("ray://"):] if client else where
    rest = rest.rstrip("/")
    if rest.startswith("["):  # [::1]:6379
        host, _, tail = rest[1:].partition("]")
        port_text = tail[1:] if tail.startswith(":") else ""
    else:
        host, sep, port_text = rest.rpartition(":")
        if not sep:
            host, port_text = rest, ""
    if not host or (port_text and not port_text.isdigit()) or not 0 < int(port_text or 1) < 65536:
        raise UsageError(f"--ray {where}: a cluster address is HOST:PORT (such as 10.0.0.5:6379), or local, or auto")
    return host, int(port_text) if port_text else CLIENT_PORT if client else DEFAULT_PORT


def probe(where: str, seconds: float = PROBE_SECONDS) -> None:
    """A one-line ``UsageError`` unless ``where`` answers as a Ray cluster does, within ``seconds``.

    The host is looked up, connected to, and sent the HTTP/2 preface, which a gRPC server (a GCS, a Ray
    Client server) answers with its settings; a cluster speaking TLS (``RAY_USE_TLS``) is only connected to.
    """
    host, port = split_address(where)
    addresses = _resolve(host, port, seconds, where)
    try:
        with socket.create_connection(addresses[0][4][:2], timeout=seconds) as s:
            if _truthy(os.environ.get("RAY_USE_TLS")):
                return
            s.settimeout(seconds)
            s.sendall(_H2_PREFACE)
            head = _read(s, 9)
    except TimeoutError:
        raise UsageError(f"--ray {where}: {host}:{port} did not answer within {seconds:.0f} s") from None
    except OSError as e:
        raise UsageError(f"--ray {where}: cannot reach {host}:{port}: {e.strerror or e}") from None
    if len(head) < 9 or head[3] != _SETTINGS:
        raise UsageError(f"--ray {where}: {host}:{port} is not a Ray cluster (no gRPC answer: give the head's "
                         "address, as `ray start --head` printed it)")


def _resolve(host: str, port: int, seconds: float, where: str) -> list:
    """``getaddrinfo``, bounded: a resolver that does not answer is reported like a host that does not."""
    found: list = []
    failed: list[BaseException] = []

    def look_up() -> None:
        try:
            found.extend(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as e:
            failed.append(e)

    t = threading.Thread(target=look_up, name="kvtool-ray-resolve", daemon=True)
    t.start()
    t.join(seconds)
    if failed or (not t.is_alive() and not found):
        raise UsageError(f"--ray {where}: unknown host {host}")
    if t.is_alive():
        raise UsageError(f"--ray {where}: looking up {host} took more than {seconds:.0f} s")
    return found


def _read(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Node:
    """What one node of the cluster holds in all (not what is free now)."""

    cpus: int
    gpus: int


@dataclass(frozen=True)
class PoolSize:
    """How many workers, each with how many cores (its torch threads), and whether each has a GPU."""

    workers: int
    threads: int
    gpu: bool

    @property
    def bundle(self) -> dict[str, float]:
        """One worker's reservation, as Ray names resources."""
        return {"CPU": float(self.threads), **({"GPU": 1.0} if self.gpu else {})}

    def describe(self) -> str:
        return f"{self.workers} worker(s) of {self.threads} core(s){' and a GPU' if self.gpu else ''} each"


def size_pool(nodes: list[Node], gpu: bool, workers: int | None) -> PoolSize:
    """The pool the nodes can hold, each worker on one node: the most cores per worker (at most
    ``CPU_THREADS_PER_WORKER`` with GPUs) with which ``workers`` fit. Default: one worker per GPU, else per
    ``CPU_THREADS_PER_WORKER`` cores of each node (one per core on smaller nodes). Too many: one line, exit 2.
    """
    if gpu:
        hosts = [n for n in nodes if n.gpus > 0]
        want = workers or sum(n.gpus for n in hosts)

        def room(t: int) -> int:
            return sum(min(n.gpus, n.cpus // t) for n in hosts)

        top = CPU_THREADS_PER_WORKER
    else:
        hosts = [n for n in nodes if n.cpus > 0]
        largest = max((n.cpus for n in hosts), default=0)
        per_worker = min(CPU_THREADS_PER_WORKER, largest) or 1
        want = workers or sum(n.cpus // per_worker for n in hosts)

        def room(t: int) -> int:
            return sum(n.cpus // t for n in hosts)

        top = largest
    if not hosts:
        raise UsageError("the Ray cluster has no GPU" if gpu else "the Ray cluster has no CPU to run a worker on")
    for threads in range(top, 0, -1):
        if room(threads) >= want:
            return PoolSize(want, threads, gpu)
    shape = ", ".join(f"{n.cpus} CPU(s)" + (f" {n.gpus} GPU(s)" if gpu else "") for n in hosts[:8])
    more = f" and {len(hosts) - 8} more" if len(hosts) > 8 else ""
    each = "a GPU and a core" if gpu else "a core"
    raise UsageError(f"--workers {want}: the Ray cluster's nodes ({shape}{more}) hold at most {room(1)} workers of "
                     f"{each} each (a worker runs on one node)")


def model_for_workers(model: str | None) -> str | None:
    """``--model`` as the workers must see it: a local path made absolute (they run in another directory);
    the embedded model's alias and a Hugging Face id unchanged (each worker finds the id in its own cache)."""
    from kvtool.runtime.model.convert import EMBEDDED_ALIASES

    if model and model.strip().lower() not in EMBEDDED_ALIASES and os.path.exists(model):
        return os.path.abspath(model)
    return model
