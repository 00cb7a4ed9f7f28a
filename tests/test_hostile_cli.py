"""Hostile input reaching the terminal or the process's limits: escapes in citations, few descriptors."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from typer.testing import CliRunner

from kvtool.cli.app import app
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

