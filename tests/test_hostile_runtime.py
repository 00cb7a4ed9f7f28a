"""The runtime against hostile or broken surroundings: a shared directory someone else prepared, an
oversized thread request, a config that lies about its weights, transformers' deprecation noise, and the
command line's ends (a huge seed, a full disk on stdout, a closed stdin)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kvtool.errors import EXIT_USAGE, UsageError
from tests.helpers import make_engine, tiny_checkpoint, tiny_llama

REPO = Path(__file__).resolve().parent.parent


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


# -- core sharing -----------------------------------------------------------------------------------


def test_a_fifo_named_after_a_live_pid_does_not_hang(tmp_path: Path) -> None:
    from kvtool.runtime.cores import CoreShare

    procs = tmp_path / "procs"
    procs.mkdir(mode=0o700)
    peer = _sleeper()
    try:
        os.mkfifo(procs / str(peer.pid))
        share = CoreShare(procs, interval=0.0)
        counted: list[int] = []
        worker = threading.Thread(target=lambda: counted.append(share.count_peers()), daemon=True)
        worker.start()
        worker.join(timeout=20)
        assert not worker.is_alive(), "count_peers blocked on a FIFO"
        assert counted == [0]
        share.close()
    finally:
        peer.kill()
        peer.wait()


def test_procs_as_a_link_to_another_directory_deletes_nothing_there(tmp_path: Path) -> None:
    from kvtool.runtime.cores import CoreShare

    victim = tmp_path / "victim"
    victim.mkdir()
    for name in ("999999990", "999999991", "12"):  # all digits, no such processes
        (victim / name).write_text("precious")
    home = tmp_path / "kvtool-1"
    home.mkdir(mode=0o700)
    (home / "procs").symlink_to(victim)
    share = CoreShare(home / "procs", interval=0.0)
    share.rebalance()
    share.close()
    assert sorted(p.name for p in victim.iterdir()) == ["12", "999999990", "999999991"]
    assert all((victim / n).read_text() == "precious" for n in ("12", "999999990", "999999991"))


def test_files_named_after_live_foreign_processes_are_not_peers(tmp_path: Path) -> None:
    import psutil

    from kvtool.runtime.cores import CoreShare

    procs = tmp_path / "procs"
    procs.mkdir(mode=0o700)
    live = [p for p in psutil.pids() if p != os.getpid()][:40]
    for pid in live:
        (procs / str(pid)).write_text(",".join(str(c) for c in sorted(os.sched_getaffinity(0))))
    before = torch.get_num_threads()
    share = CoreShare(procs, interval=0.0)
    try:
        share.rebalance()
        assert share.peers == 0
        assert share.threads == len(share.cores)
        assert sorted(p.name for p in procs.iterdir()) == [str(os.getpid())]  # unlocked entries are stale
    finally:
        share.close()
        torch.set_num_threads(before)


def test_registration_is_private_and_closes_every_descriptor(tmp_path: Path, monkeypatch) -> None:
    import tempfile

    from kvtool.runtime import cores

    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    directory = cores.default_directory()
    assert directory.parent.parent == tmp_path
    opened = _fds()
    share = cores.CoreShare(interval=0.0)
    assert share.path is not None and share.path.parent == directory
    assert (directory.stat().st_mode & 0o777) == 0o700 and (directory.parent.stat().st_mode & 0o777) == 0o700
    share.rebalance()
    share.close()
    share.close()
    assert _fds() == opened
    assert list(directory.iterdir()) == []


def test_runtime_dir_is_preferred(tmp_path: Path, monkeypatch) -> None:
    from kvtool.runtime.cores import default_directory

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_directory() == tmp_path / "kvtool" / "procs"


# -- threads ---------------------------------------------------------------------------------------


def test_threads_capped_at_usable_cores_with_a_note() -> None:
    from kvtool.runtime.model import set_threads, usable_cores

    before = torch.get_num_threads()
    notes: list[str] = []
    try:
        assert set_threads(1000, notes.append) == usable_cores() == torch.get_num_threads()
        assert len(notes) == 1 and "1000" in notes[0] and str(usable_cores()) in notes[0] and "\n" not in notes[0]
        notes.clear()
        assert set_threads(1, notes.append) == 1 and notes == []
    finally:
        torch.set_num_threads(before)


# -- a config that lies about its size -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("hostile") / "tiny")


def _with_config(src: Path, dst: Path, **changes) -> Path:
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_config_claiming_far_more_layers_than_the_weights_is_refused_fast(tiny_dir: Path, tmp_path: Path) -> None:
    from kvtool.runtime.model import load_model

    bad = _with_config(tiny_dir, tmp_path / "liar", num_hidden_layers=1000)  # in range: the weights say no
    started = time.perf_counter()
    with pytest.raises(UsageError) as info:
        load_model(str(bad), device="cpu")
    assert time.perf_counter() - started < 10
    msg = str(info.value)
    assert info.value.exit_code == EXIT_USAGE and "\n" not in msg
    assert "parameters" in msg and "disagree" in msg


def test_model_larger_than_free_memory_is_refused(tiny_dir: Path, monkeypatch) -> None:
    from kvtool.runtime.model import fit, load_model

    monkeypatch.setattr(fit, "available_bytes", lambda device: 1024)
    with pytest.raises(UsageError, match="available") as info:
        load_model(str(tiny_dir), device="cpu")
    assert "\n" not in str(info.value)


def test_honest_checkpoint_passes_the_fit_check(tiny_dir: Path) -> None:
    import transformers

    from kvtool.runtime.model import fit

    config = transformers.AutoConfig.from_pretrained(str(tiny_dir))
    assert fit.implied_params(config) <= 2 * fit.safetensors_bytes(tiny_dir)
    fit.check_fits(tiny_dir, config, torch.device("cpu"), torch.float32, "none")


# -- transformers' deprecation warning -------------------------------------------------------------


def test_engine_passes_the_cache_under_the_forward_keyword() -> None:
    import warnings

    model = tiny_llama()
    engine = make_engine(model, "h2o", budget=32, block_size=8)
    ids = torch.randint(0, model.config.vocab_size, (40,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.feed(engine.new_cache(), [ids], progress=False)
    texts = [str(w.message) for w in caught]
    assert not [t for t in texts if "past_key_values" in t], texts


def _kvtool(*args: str, stdin=None, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "kvtool.cli.app", *args],
        stdin=stdin,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )


def test_quiet_ask_prints_nothing_on_stderr(tiny_dir: Path, tmp_path: Path) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("The secret number is 42. " * 20)
    out = _kvtool(
        "ask",
        str(doc),
        "what is it?",
        "--model",
        str(tiny_dir),
        "--quiet",
        "--max-new-tokens",
        "3",
        "--budget",
        "256",
        "--threads",
        "1",
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""


# -- the command line's ends -------------------------------------------------------------------------


def test_huge_seed_is_a_usage_error() -> None:
    from kvtool.runtime.settings import Settings

    with pytest.raises(UsageError, match="seed") as info:
        Settings(seed=99999999999999999999999).validate()
    assert "\n" not in str(info.value)
    assert Settings(seed=2**64 - 1).validate().seed == 2**64 - 1


def test_huge_seed_on_the_command_line(tmp_path: Path) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("hello")
    out = _kvtool("ask", str(doc), "q", "--seed", "99999999999999999999999", "--quiet")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "seed" in out.stderr and "internal error" not in out.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_full_stdout_is_one_line_and_exit_1() -> None:
    with open("/dev/full", "w") as full:
        out = _kvtool("policies", "--json", stdout=full)
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1 and "No space left" in out.stderr and "internal error" not in out.stderr


@pytest.mark.parametrize("args", [("ask", "-", "q"), ("prefill", "-", "-o", "out.kvc")])
def test_closed_stdin_is_a_usage_error(args: tuple[str, ...], tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "kvtool.cli.app", *args]
    # ``<&-``: the child starts with descriptor 0 closed
    out = subprocess.run(
        ["sh", "-c", '"$@" <&-', "sh", *cmd], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "stdin is closed" in out.stderr


# -- one vocabulary: devices and profiles ------------------------------------------------------------


def test_mps_is_refused_up_front() -> None:
    from kvtool.runtime.settings import Settings

    with pytest.raises(UsageError, match="device must be auto, cpu, cuda or cuda:N") as info:
        Settings(device="mps").validate()
    assert info.value.exit_code == EXIT_USAGE


def test_mps_on_the_command_line_exits_2(tmp_path: Path) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("hello")
    out = _kvtool("ask", str(doc), "q", "--device", "mps", "--quiet")
    assert out.returncode == 2 and out.stdout == "" and out.stderr.count("\n") == 1 and "mps" in out.stderr


def test_a_packaged_profile_is_found_by_name_outside_the_repo(tmp_path: Path, monkeypatch) -> None:
    from kvtool.config import packaged_profiles_dir
    from kvtool.runtime.settings import find_profile, load_profile

    monkeypatch.setenv("KVTOOL_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    found = find_profile("default")
    assert found.parent.resolve() == packaged_profiles_dir().resolve() == (REPO / "kvtool" / "profiles").resolve()
    assert load_profile("gpu-8b-4bit")["quantize"] == "4bit"
    assert (REPO / "profiles").resolve() == packaged_profiles_dir().resolve()  # the old path still works
    assert '"profiles/*.yaml"' in (REPO / "pyproject.toml").read_text()  # shipped in the wheel


# -- only the CLI draws ---------------------------------------------------------------------------------


def test_calibration_progress_is_an_event_the_dashboard_draws() -> None:
    import io

    from rich.console import Console

    from kvtool.cli.dashboard import Dashboard
    from kvtool.runtime.events import CalibrationProgress

    plain = Console(file=io.StringIO(), record=True, force_terminal=False)
    dash = Dashboard("plain", plain)
    for done in range(5):
        dash(CalibrationProgress(done, 4))
    lines = plain.export_text().splitlines()
    assert lines == ["razor: calibrating retrieval heads: started", "razor: calibrating retrieval heads: done"]
    live = Dashboard("live", Console(file=io.StringIO(), record=True, width=120, force_terminal=True))
    live(CalibrationProgress(2, 4))
    rendered = Console(file=io.StringIO(), record=True, width=120)
    rendered.print(live.render())
    assert "2 / 4" in rendered.export_text()
    quiet = Console(file=io.StringIO(), record=True)
    Dashboard("quiet", quiet)(CalibrationProgress(1, 4))
    assert quiet.export_text() == ""


def test_eval_reporter_base_draws_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtool.eval import Reporter

    reporter = Reporter()
    reporter.say("a note")
    with reporter.bar(3) as bar:
        bar.doing("unit")
        bar.advance()
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""
