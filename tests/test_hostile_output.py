"""Output hygiene: characters that reorder a terminal's text are shown, never obeyed; --json is always strict
JSON; an error line stays short whatever a file holds."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvtool.cli import error_lines
from kvtool.cli.app import main
from kvtool.errors import UsageError, printable
from tests import test_hostile_kvc as hk
from tests.helpers import tiny_checkpoint

RLO = "\u202e"  # right-to-left override: "report\u202etxt.exe" shows as "reportexe.txt"
READ = ["--budget", "128", "--block-size", "16", "--device", "cpu"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-output")
    model = tiny_checkpoint(root / "tiny")
    doc = root / f"notes{RLO}txt.md"
    doc.write_text(f"# Chapter {RLO}one\n\n" + "the cache is small and the river is long. " * 40, encoding="utf-8")
    kvc = root / "c.kvc"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVTOOL_HOME", str(root / "home"))
        assert main(["prefill", str(doc), "-o", str(kvc), "--model", str(model), "--recall", "off", *READ, "-q"]) == 0
    return SimpleNamespace(root=root, model=str(model), doc=doc, kvc=kvc)


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTOOL_HOME", str(tmp_path / "home"))


def run(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


# -- bidi and separator characters ------------------------------------------------------------------------------------
@pytest.mark.parametrize("char", [RLO, "\u2066", "\u200f", "\u2028", "\u061c"])
def test_printable_shows_bidi_and_separator_characters(char):
    shown = printable(f"a{char}b", one_line=True)
    assert char not in shown and f"\\u{ord(char):04x}" in shown


def test_citations_show_a_headings_bidi_override_escaped(env, capsys):
    rc, out, err = run(
        capsys, "ask", env.doc, "What is small?", "--cite", "--model", env.model, *READ, "--max-new-tokens", "4", "-q"
    )
    assert rc == 0, err
    cited = [line for line in out.splitlines() if line.startswith("  ")]
    assert cited and all(RLO not in line for line in cited) and any("\\u202e" in line for line in cited), out


def test_inspect_and_the_loaded_note_show_kvc_metadata_escaped(env, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # a table cell wide enough not to fold the escape itself
    rc, out, err = run(capsys, "inspect", env.kvc)
    assert rc == 0 and RLO not in out and "\\u202e" in out, out
    rc, out, err = run(capsys, "ask", env.kvc, "What is small?", "--model", env.model, "--max-new-tokens", "2")
    loaded = [line for line in err.splitlines() if "loaded" in line]
    assert rc == 0 and loaded and RLO not in err and "\\u202e" in loaded[0], err


def test_notes_naming_files_show_them_escaped(env, tmp_path, capsys):
    out_kvc = tmp_path / f"out{RLO}cvk.kvc"
    rc, out, err = run(capsys, "prefill", env.doc, "-o", out_kvc, "--model", env.model, "--recall", "off", *READ)
    wrote = [line for line in err.splitlines() if line.startswith("wrote")]
    assert rc == 0 and wrote and RLO not in err and "\\u202e" in wrote[0], err


# -- --json is strict JSON ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e400])
def test_a_kvc_with_a_non_finite_number_is_corrupt_not_invalid_json(env, tmp_path, capsys, value):
    kvc = hk.rewrite(env.kvc, tmp_path / "inf.kvc", lambda meta: meta.update(prefill_seconds=value))
    for args in (["inspect", kvc, "--json"], ["ask", kvc, "q", "--model", env.model, "--json", "-q"]):
        rc, out, err = run(capsys, *args)
        assert rc == 2 and not out and "corrupted" in err and err.count("\n") == 1, err


def test_emit_json_never_writes_nan_or_infinity(capsys):
    from kvtool.cli.output import emit_json

    emit_json({"a": float("inf"), "b": [1.5, float("nan")], "c": (float("-inf"),)})
    assert json.loads(capsys.readouterr().out) == {"a": None, "b": [1.5, None], "c": [None]}


# -- an error line stays one short line -------------------------------------------------------------------------------
def _with_version(src, dst, version, writer=None):
    """A copy of a .kvc whose safetensors metadata says ``format_version`` (and its kvtool metadata ``writer``)."""
    header, meta, data = hk.read_frame(src)
    if writer is not None:
        meta["kvtool_version"] = writer
        meta["meta_sha256"] = hk.meta_sha(meta)
    header["__metadata__"]["kvtool"] = json.dumps(meta, sort_keys=True)
    header["__metadata__"]["format_version"] = version
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    dst.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return dst


@pytest.mark.parametrize(
    "version, writer",
    [
        ("9" * 4000, None),  # a number of 4,000 digits: an unknown version, shown by its start
        ("x" * 5000, None),
        ([["nested"] * 1000] * 10, None),
        ("99", "v" * 5000),
    ],
)
def test_a_long_value_in_a_kvc_gives_a_short_error_line(env, tmp_path, capsys, version, writer):
    kvc = _with_version(env.kvc, tmp_path / "v.kvc", version, writer)
    rc, out, err = run(capsys, "inspect", kvc)
    assert rc == 2 and err.count("\n") == 1 and len(err) < 400, (len(err), err[:300])


def test_any_long_message_is_capped_at_the_cli(capsys, monkeypatch):
    from kvtool.cli import app as app_mod

    def fail(*a, **k):
        raise UsageError("x" * 10_000 + " end")

    monkeypatch.setattr(app_mod.cache, "_print_inspect", fail)
    monkeypatch.setattr("kvtool.kvc.format.read_header", lambda path: SimpleNamespace())
    monkeypatch.setattr("kvtool.kvc.format.describe", lambda header: {})
    monkeypatch.setattr("kvtool.kvc.format.is_kvc", lambda path: True)
    rc, out, err = run(capsys, "inspect", __file__)
    assert rc == 2 and err.count("\n") == 1 and len(err) <= len("kvtool: error: ") + error_lines.MAX_ERROR_CHARS + 1
    assert err.rstrip().endswith("…")


# -- every string printed: JSON escapes controls too, rich never reads a name as markup -------------------------------
#: what a terminal obeys or reorders: ESC (C0), U+009B (an 8-bit CSI, C1), DEL, the bidi overrides and isolates, the
#: marks and the separators; in a file name they must reach stdout escaped, and come back from the JSON unchanged
HOSTILE_NAME_CHARS = "\x1b\x9b\x85\x7f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c\u2028"
OBEYED = set(HOSTILE_NAME_CHARS) | {chr(c) for c in range(0x80, 0xA0)}


def test_json_records_of_many_documents_escape_every_control_and_round_trip(env, tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    names = [f"a{HOSTILE_NAME_CHARS}.txt", "b\x9b31mred.txt", f"report{RLO}txt.md"]
    for name in names:
        (docs / name).write_text("the cache is small and the river is long. " * 30, encoding="utf-8")
    log = tmp_path / "log.jsonl"
    for out_file in (None, log):
        args = ["ask", docs, "--question", "What is small?", "--model", env.model, *READ, "--max-new-tokens", "2", "-q"]
        rc, out, err = run(capsys, *args, *(["-o", out_file] if out_file else []))
        text = out if out_file is None else log.read_text(encoding="utf-8")
        assert rc == 0, err
        assert not OBEYED & set(text), [c for c in text if c in OBEYED]
        paths = sorted(json.loads(line)["path"] for line in text.splitlines())
        assert paths == sorted(str(docs / n) for n in names)  # the escapes read back to the names themselves


def test_emit_json_escapes_controls_and_reads_back_the_same(capsys):
    from kvtool.cli.output import emit_json

    value = {"path": f"x{HOSTILE_NAME_CHARS}y\udcff", "answer": "\x1b]0;pwned\x07 é 中"}
    emit_json(value)
    out = capsys.readouterr().out
    assert out.isascii() or not OBEYED & set(out)
    assert "\\u009b" in out and "\\u202e" in out and json.loads(out) == value
    out.encode("utf-8")  # a path's undecodable byte (a lone surrogate) is an escape too, never unencodable text


def test_an_answer_streamed_as_text_shows_its_controls(capsys):
    from kvtool.cli.output import write_text

    write_text("line one\n\x1b[2Jcleared\x9b31m\u202etxt.exe\tend")
    out = capsys.readouterr().out
    assert not OBEYED & set(out) and "\\x1b[2J" in out and "\\u202e" in out and "\n" in out and "\t" in out


MARKUP_NAMES = ["a[/]b.txt", "[bold]x[/bold].txt", "[link=file:///etc]y[/link].md", "[/red]\x1b[2J\u202e.txt"]


@pytest.mark.parametrize("name", MARKUP_NAMES)
def test_a_file_name_with_markup_draws_in_the_live_view_of_many_documents(name):
    import io

    from rich.console import Console

    from kvtool.cli.many_view import ManyView
    from kvtool.runtime.many import DocumentFinished, DocumentStarted, RunStarted

    console = Console(file=io.StringIO(), record=True, width=200, force_terminal=True)
    with ManyView("live", console) as view:
        view(RunStarted(total=2, complete=0))
        view(DocumentStarted(name))
        view._progress.refresh()  # what the refresh thread does: it raised MarkupError for "[/]"
        drawn = console.export_text()  # the bar names the document in flight as it is ("[bold]" not eaten)
        view(DocumentFinished(name, seconds=0.5, records=1, tokens=64))
    assert printable(name, one_line=True) in drawn and "\x1b[2J" not in drawn and RLO not in drawn


@pytest.mark.parametrize("name", MARKUP_NAMES)
def test_a_model_or_step_name_with_markup_draws_in_the_dashboard_and_the_plan(name):
    import io

    from rich.console import Console

    from kvtool.cli.dashboard import Dashboard
    from kvtool.cli.plan_view import render_plan
    from kvtool.runtime.events import PhaseProgress

    console = Console(file=io.StringIO(), record=True, width=200, force_terminal=True)
    dash = Dashboard("live", console)
    dash(PhaseProgress(f"loading {name}", 0, 1))
    console.print(dash.render())
    assert printable(f"loading {name}", one_line=True) in console.export_text()
    from kvtool.runtime import profiling
    from kvtool.runtime.settings import Settings

    info = profiling.ModelInfo(
        name=name,
        dims={
            "num_layers": 2,
            "num_kv_heads": 2,
            "num_attention_heads": 4,
            "head_dim": 16,
            "hidden_size": 64,
            "intermediate_size": 128,
            "vocab_size": 100,
        },
        num_params=1000,
        dtype="float32",
        device="cpu",
        quantize="none",
        policy="h2o",
        rows=16,
        n_fields=1,
        budget_tokens=64,
        resolved=True,
    )
    render_plan(profiling.plan(info, Settings(budget="64"), runtime_baseline=0), console)
    shown = console.export_text()
    assert printable(name) in shown and "\x1b[2J" not in shown and RLO not in shown


def test_a_run_over_a_file_named_with_markup_on_a_terminal_draws_its_live_view(env, tmp_path):
    """The whole path on a real terminal (a pseudo-terminal on stderr): the live view's refresh thread used to die
    of a MarkupError traceback for a file named "[/]" while the run went on to exit 0."""
    import os
    import pty
    import subprocess
    import sys

    docs = tmp_path / "docs"
    (docs / "a[").mkdir(parents=True)  # a path holding "[/]": the directory "a[" and its file "]b.txt"
    for name in ("a[/]b.txt", "c[bold].txt"):
        (docs / name).write_text("the cache is small and the river is long. " * 30, encoding="utf-8")
    master, slave = pty.openpty()
    run_env = {**os.environ, "OMP_NUM_THREADS": "1", "KVTOOL_HOME": str(tmp_path / "home"), "COLUMNS": "200"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from kvtool.cli.app import entry; entry()",
            "ask",
            str(docs),
            "--question",
            "What is small?",
            "--model",
            env.model,
            *READ,
            "--max-new-tokens",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=slave,
        env=run_env,
    )
    os.close(slave)
    drawn = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the terminal closed: the run is over
            break
        if not chunk:
            break
        drawn += chunk
    out, _ = proc.communicate(timeout=300)
    os.close(master)
    text = drawn.decode("utf-8", "replace")
    assert proc.returncode == 0 and "Traceback" not in text and "MarkupError" not in text, text[-2000:]
    assert "a[/]b.txt" in text and len(out.splitlines()) == 2, text[-2000:]
