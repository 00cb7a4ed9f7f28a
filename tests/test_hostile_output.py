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
    rc, out, err = run(capsys, "ask", env.doc, "What is small?", "--cite", "--model", env.model, *READ,
                       "--max-new-tokens", "4", "-q")
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


@pytest.mark.parametrize("version, writer", [
    ("9" * 4000, None),  # a number of 4,000 digits: an unknown version, shown by its start
    ("x" * 5000, None),
    ([["nested"] * 1000] * 10, None),
    ("99", "v" * 5000),
])
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
