"""``--ray``, before any cluster: an address that is no Ray cluster is refused within seconds (real sockets, no
Ray started), the pool is sized node by node, and a termination signal exits 143 whatever a library made of it."""

from __future__ import annotations

import socket
import time

import pytest
from typer.testing import CliRunner

from kvtool.cli import app as app_module
from kvtool.cli.app import app
from kvtool.errors import EXIT_TERMINATED, UsageError
from kvtool.runtime.cluster_plan import Node, PoolSize, probe, size_pool, split_address

runner = CliRunner()


@pytest.fixture
def doc(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text("The cat sat on the mat.", encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("where", ["localhost:1", "999.1.1.1:1", "no-such-host.invalid:6379"])
def test_an_address_with_no_cluster_is_one_line_and_exit_2_within_seconds(doc, where):
    pytest.importorskip("ray")
    t0 = time.monotonic()
    r = runner.invoke(app, ["ask", doc, "--question", "Who?", "--ray", where])
    assert r.exit_code == 2, r.output
    assert time.monotonic() - t0 < 10
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvtool: error: --ray {where}: "), r.stderr


def test_a_port_that_is_not_a_ray_cluster_is_refused_within_the_probe_time():
    """A listening socket that never answers (connect succeeds, no gRPC settings come back), and one that
    answers as a web server would: both refused, neither waited on for more than the probe's seconds."""
    silent = socket.create_server(("127.0.0.1", 0))
    talker = socket.create_server(("127.0.0.1", 0))
    try:
        t0 = time.monotonic()
        with pytest.raises(UsageError, match="did not answer within 1 s"):
            probe(f"127.0.0.1:{silent.getsockname()[1]}", seconds=1.0)
        assert time.monotonic() - t0 < 3
        import threading

        def answer() -> None:
            conn, _ = talker.accept()
            with conn:
                conn.recv(64)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        threading.Thread(target=answer, daemon=True).start()
        with pytest.raises(UsageError, match="is not a Ray cluster"):
            probe(f"127.0.0.1:{talker.getsockname()[1]}", seconds=2.0)
    finally:
        silent.close()
        talker.close()


def test_addresses_are_parsed_before_ray_starts():
    assert split_address("10.0.0.5:6379") == ("10.0.0.5", 6379)
    assert split_address("ray://head") == ("head", 10001)
    assert split_address("[::1]:7000") == ("::1", 7000)
    for bad in ("head:99999", "head:x", ":6379"):
        with pytest.raises(UsageError, match="a cluster address is HOST:PORT"):
            split_address(bad)


def test_the_pool_is_sized_per_node():
    """A worker lives on one node: two 1-CPU nodes hold two 1-core workers, never one 2-core worker."""
    two_small = [Node(1, 0), Node(1, 0)]
    assert size_pool(two_small, gpu=False, workers=1) == PoolSize(1, 1, False)
    assert size_pool(two_small, gpu=False, workers=None) == PoolSize(2, 1, False)
    with pytest.raises(UsageError, match="--workers 3: .* at most 2 workers"):
        size_pool(two_small, gpu=False, workers=3)
    assert size_pool([Node(2, 0)], gpu=False, workers=1) == PoolSize(1, 2, False)  # the whole node
    assert size_pool([Node(3, 0)], gpu=False, workers=None) == PoolSize(1, 3, False)
    assert size_pool([Node(1, 0), Node(4, 0)], gpu=False, workers=None) == PoolSize(2, 2, False)
    assert size_pool([Node(1, 0), Node(4, 0)], gpu=False, workers=3) == PoolSize(3, 1, False)
    # GPUs: one each, with at most 2 of its node's cores; a node's cores are shared among its GPUs
    assert size_pool([Node(16, 2), Node(8, 0)], gpu=True, workers=None) == PoolSize(2, 2, True)
    assert size_pool([Node(1, 2)], gpu=True, workers=1) == PoolSize(1, 1, True)
    with pytest.raises(UsageError, match="at most 1 workers of a GPU and a core"):
        size_pool([Node(1, 2)], gpu=True, workers=2)
    with pytest.raises(UsageError, match="no GPU"):
        size_pool([Node(8, 0)], gpu=True, workers=None)


def test_a_termination_signal_exits_143_even_when_a_library_turned_it_into_ctrl_c(monkeypatch):
    """Ray's ``ray.wait`` catches kvtool's ``Terminated`` and raises a bare ``KeyboardInterrupt``: the signal
    received decides the exit code, not the exception that comes back."""
    monkeypatch.setattr(app_module, "_signalled", [])
    assert app_module._interrupt_exit(KeyboardInterrupt()) == ("kvtool: interrupted", 130)
    app_module._signalled.append("SIGTERM")
    assert app_module._interrupt_exit(KeyboardInterrupt()) == ("kvtool: terminated (SIGTERM)", EXIT_TERMINATED)


def test_workers_get_a_local_model_path_made_absolute_and_an_id_or_alias_as_given(tmp_path, monkeypatch):
    from kvtool.runtime.cluster_plan import model_for_workers

    (tmp_path / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "embedded").mkdir()
    monkeypatch.chdir(tmp_path)
    assert model_for_workers("models/tiny") == str(tmp_path / "models" / "tiny")
    assert model_for_workers("meta-llama/Llama-3.1-8B-Instruct") == "meta-llama/Llama-3.1-8B-Instruct"
    assert model_for_workers("embedded") == "embedded"
    assert model_for_workers(None) is None
