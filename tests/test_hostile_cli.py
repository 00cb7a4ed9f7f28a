"""Hostile input reaching the terminal or the process's limits: escapes in citations, few descriptors, sampling
numbers at the edge of their range, an environment that points kvtool's home at a file."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from typer.testing import CliRunner

from kvtool.cli.app import app, main
from kvtool.core.sampling import Chooser
from tests.helpers import tiny_checkpoint

runner = CliRunner()
BASE = ["--budget", "96", "--block-size", "16", "--max-new-tokens", "4", "--quiet"]
ESCAPES = "\x1b]0;pwned\x07\x1b[2J"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tiny_checkpoint(tmp_path_factory.mktemp("hostile-cli") / "tiny"))


def test_citations_never_send_the_documents_terminal_escapes(model_dir, tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text(f"# Title {ESCAPES}\n" + f"the cache is small {ESCAPES}. " * 30 + "\n", encoding="utf-8")
    r = runner.invoke(app, ["ask", str(doc), "What is small?", "--cite", "--model", model_dir, *BASE])
    assert r.exit_code == 0, r.output
    cited = [line for line in r.stdout.splitlines() if line.startswith("  ")]
    assert cited, r.stdout
    for line in cited:
        assert "\x1b" not in line and "\x07" not in line and "\\x1b" in line  # shown, not obeyed
    r = runner.invoke(app, ["ask", str(doc), "What is small?", "--cite", "--json", "--model", model_dir, *BASE])
    cites = json.loads(r.stdout)["answers"][0]["citations"]
    assert any("\x1b" in c["text"] for c in cites)  # JSON keeps the document's own characters, as a string


def test_descriptors_for_the_archive_are_reserved_or_refused_with_the_figures():
    code = textwrap.dedent("""
        import resource
        from kvtool.core.archive_stores import reserve_descriptors
        from kvtool.errors import UsageError
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 256))
        reserve_descriptors(90)                       # above the soft limit, below the hard one: raised
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert soft >= 90 and hard == 256, (soft, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        try:
            reserve_descriptors(90)
        except UsageError as e:
            assert e.field == "recall" and "90 archive files" in str(e) and "limit 64" in str(e), str(e)
            print("refused")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "refused", r.stderr


def test_recall_under_a_tiny_open_file_limit_is_one_clear_line(model_dir, tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text("the cache is small. " * 200, encoding="utf-8")
    code = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_NOFILE, (24, 24))
        from kvtool.cli.app import main
        sys.exit(main(["ask", {str(doc)!r}, "What is small?", "--recall", "64", "--model", {model_dir!r},
                       "--budget", "96", "--block-size", "16", "--max-new-tokens", "2", "--quiet"]))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "archive files open" in lines[0] and "limit 24" in lines[0], lines[0]
    assert "Traceback" not in r.stderr


# -- sampling: any top-p and temperature in range gives a distribution, the nucleus holds the best token -----------
def _nucleus(logits: torch.Tensor, temperature: float, top_p: float) -> set[int]:
    """Brute force: the most likely tokens, best first, while the mass before each is below ``top_p``."""
    probs = torch.softmax(logits.double() / temperature, dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, before = set(), 0.0
    for i in order:
        if kept and before >= top_p:
            break
        kept.add(i)
        before += probs[i]
    return kept


@pytest.mark.parametrize("temperature", [1e-300, 0.05, 1.0, 100.0])
@pytest.mark.parametrize("top_p", [1e-300, 1e-8, 0.3, 0.75, 0.999, 1.0])
def test_nucleus_sampling_draws_only_from_the_nucleus_for_any_top_p(temperature, top_p):
    logits = torch.tensor([2.0, 0.5, 1.7, -1.0, 0.9, 3.1])  # no two tokens near a nucleus boundary
    allowed = _nucleus(logits, temperature, top_p)
    chooser = Chooser(200, "cpu", temperature=temperature, top_p=top_p, seed=1)
    drawn = {int(chooser(logits, t)) for t in range(200)}
    assert drawn <= allowed, (drawn, allowed)
    if top_p < 1e-6 or temperature < 1e-3:
        assert drawn == {5}  # the best token alone: greedy
    if temperature == 100.0 and top_p == 1.0:
        assert drawn == set(range(6))  # a flat distribution still samples everything


def test_a_tiny_top_p_or_temperature_answers_as_greedy_does(model_dir, tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text("the cache is small and the river is long. " * 30, encoding="utf-8")
    answers = []
    for sampling in (["--temperature", "0"], ["--top-p", "1e-300", "--temperature", "1"], ["--temperature", "1e-300"]):
        r = runner.invoke(
            app,
            [
                "ask",
                str(doc),
                "What is small?",
                "--model",
                model_dir,
                *BASE,
                "--max-new-tokens",
                "6",
                "--json",
                *sampling,
            ],
        )
        assert r.exit_code == 0 and "internal error" not in r.output, r.output
        answers.append(json.loads(r.stdout)["answers"][0]["answer"])
    assert answers[0] and answers[1] == answers[0] and answers[2] == answers[0], answers


# -- the environment: KVTOOL_HOME (or XDG_CACHE_HOME) that is a file is a usage error ----------------------------------
@pytest.mark.parametrize("variable, under", [("KVTOOL_HOME", False), ("KVTOOL_HOME", True), ("XDG_CACHE_HOME", False)])
def test_a_home_that_is_a_file_is_one_line_and_exit_2(model_dir, tmp_path, capsys, monkeypatch, variable, under):
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    monkeypatch.delenv("KVTOOL_HOME", raising=False)
    monkeypatch.setenv(variable, str(a_file / "sub" if under else a_file))
    doc = tmp_path / "d.txt"
    doc.write_text("the cache is small. " * 20, encoding="utf-8")
    for argv in (
        ["calibrate", "--model", model_dir, "--device", "cpu", "-q"],  # writes its calibration there
        ["ask", str(doc), "q", "--max-new-tokens", "2", "-q"],
    ):  # the embedded model is converted there
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and variable in err and "not a directory" in err, err
