"""The documentation agrees with the code: docs/cli.md against the app and the JSON keys the code emits."""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvtool.cli.app import app
from tests.helpers import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
CLI_PAGE = ROOT / "docs" / "cli.md"
README = ROOT / "README.md"
#: where the documented keys are produced: every documented key must be spelled in one of these
STATS_SOURCES = ("kvtool/runtime/session.py",)
PROFILE_SOURCES = ("kvtool/runtime/profiling.py", "kvtool/runtime/memory.py", "kvtool/cli/profile.py")


def _generator() -> dict[str, Any]:
    return runpy.run_path(str(ROOT / "scripts" / "gen-cli-docs"))


def _section(page: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", page, re.S | re.M)
    assert m, f"docs/cli.md has no section {title!r}"
    return m.group(1)


def _documented_keys(page: str, title: str) -> set[str]:
    """Every backticked key in the first column of the section's table."""
    keys: set[str] = set()
    for line in _section(page, title).splitlines():
        if line.startswith("| `"):
            keys |= set(re.findall(r"`([a-z_][a-z0-9_.]*)`", line.split(" | ")[0]))
    return keys


def _emitted_keys(obj: dict[str, Any], prefix: str = "", nested: bool = True) -> set[str]:
    out: set[str] = set()
    for key, value in obj.items():
        out.add(prefix + key)
        if nested and isinstance(value, dict) and key != "by_layer_kind":
            out |= _emitted_keys(value, prefix + key + ".", nested)
    return out


def _spelled_in(key: str, sources: tuple[str, ...]) -> bool:
    leaf = key.rsplit(".", 1)[-1]
    return any(f'"{leaf}"' in (ROOT / s).read_text(encoding="utf-8") for s in sources)


def test_cli_page_is_generated_from_the_app() -> None:
    gen = _generator()
    page = CLI_PAGE.read_text(encoding="utf-8")
    assert page.startswith(gen["render"]()), "docs/cli.md disagrees with the app: run python scripts/gen-cli-docs"


def test_every_option_of_every_command_is_documented() -> None:
    gen = _generator()
    generated = CLI_PAGE.read_text(encoding="utf-8").split(gen["MARK"])[0]
    for path, cmd in gen["commands"]():
        section = _section(generated, f"kvtool {' '.join(path)}")
        for p in cmd.params:
            if p.param_type_name == "option":
                assert f"`{p.opts[0]}`" in section, f"kvtool {' '.join(path)} {p.opts[0]} is not in docs/cli.md"
                assert " ".join((p.help or "").split()).replace("|", "\\|") in section


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``ask --json`` (with recall), ``ask`` of a .kvc, and ``profile --json`` with every part, on a tiny model."""
    tmp = tmp_path_factory.mktemp("docs")
    model = str(tiny_checkpoint(tmp / "tiny"))
    doc = tmp / "doc.txt"
    doc.write_text("The cache is small. " * 60, encoding="utf-8")
    base = ["--model", model, "--budget", "160", "--block-size", "32", "--quiet"]
    runner = CliRunner()

    def run(*args: str) -> dict[str, Any]:
        r = runner.invoke(app, [*args, *base])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)

    asked = run("ask", str(doc), "q", "--json", "--recall", "64", "--max-new-tokens", "3")
    kvc = tmp / "doc.kvc"
    run("prefill", str(doc), "-o", str(kvc), "--json", "--recall", "off")
    loaded = run("ask", str(kvc), "q", "--json", "--max-new-tokens", "3")
    profiled = run("profile", "--json", "--recall", "64", "--doc", str(doc), "--memory", "8GiB", "--doc-tokens", "999")
    return {"ask": asked["stats"], "kvc": loaded["stats"], "profile": profiled}


def test_stats_keys_documented_and_emitted(runs: dict[str, Any]) -> None:
    documented = _documented_keys(CLI_PAGE.read_text(encoding="utf-8"), "Stats keys")
    emitted = _emitted_keys(runs["ask"], nested=False) | _emitted_keys(runs["kvc"], nested=False)
    assert emitted - documented == set(), "stats keys the code emits but docs/cli.md does not document"
    missing = {k for k in documented - emitted if not _spelled_in(k, STATS_SOURCES)}
    assert missing == set(), "stats keys docs/cli.md documents but the code does not emit"
    assert {"loaded_from", "cache_load_seconds"} <= set(runs["kvc"])


def test_profile_keys_documented_and_emitted(runs: dict[str, Any]) -> None:
    documented = _documented_keys(CLI_PAGE.read_text(encoding="utf-8"), "Profile keys")
    emitted = _emitted_keys(runs["profile"])
    assert emitted - documented == set(), "profile keys the code emits but docs/cli.md does not document"
    missing = {k for k in documented - emitted if not _spelled_in(k, PROFILE_SOURCES)}
    assert missing == set(), "profile keys docs/cli.md documents but the code does not emit"


def test_models_keys_documented_and_emitted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.helpers import hf_cache_layout

    hf_cache_layout(tmp_path / "hub", "acme/tiny", tiny_checkpoint(tmp_path / "tiny"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    result = CliRunner().invoke(app, ["models", "--json"])
    assert result.exit_code == 0, result.output
    listing = json.loads(result.stdout)
    assert len(listing["models"]) == 2
    emitted = set(listing) | {f"models.{key}" for row in listing["models"] for key in row}
    assert _documented_keys(CLI_PAGE.read_text(encoding="utf-8"), "Models keys") == emitted


def test_many_document_record_keys_documented_and_emitted(tmp_path: Path) -> None:
    """Every key of the records of ``ask``/``summarize``/``prefill`` over many documents (answers, citations,
    notes, error records) is in docs/cli.md's "Many documents" table, and every key there is emitted."""
    model = str(tiny_checkpoint(tmp_path / "tiny"))
    for name in ("a.txt", "b.txt"):
        (tmp_path / "docs" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "docs" / name).write_text("The cache is small. " * 40, encoding="utf-8")
    (tmp_path / "docs" / "bad.txt").write_bytes(b"text\x00binary")
    base = ["--model", model, "--budget", "160", "--block-size", "32", "--quiet"]
    answer = ["--max-new-tokens", "3"]
    folder = str(tmp_path / "docs")
    runner = CliRunner()
    emitted: set[str] = set()
    for args in (
        ["ask", folder, "--question", "q", "--cite", *answer],
        ["summarize", folder, *answer],
        ["prefill", folder, "-o", str(tmp_path / "caches") + "/"],
    ):
        r = runner.invoke(app, [*args, *base])
        assert r.exit_code == 3, r.output
        for line in r.stdout.splitlines():
            emitted |= set(json.loads(line))
    emitted.add("notes")  # only from readers with notes (a PDF with pages without text): spelled in the runner
    documented = _documented_keys(CLI_PAGE.read_text(encoding="utf-8"), "Many documents")
    assert emitted == documented
    assert '"notes"' in (ROOT / "kvtool" / "runtime" / "many.py").read_text(encoding="utf-8")


def test_archive_path_is_a_path_or_null(runs: dict[str, Any]) -> None:
    path = runs["ask"]["archive_path"]
    assert isinstance(path, str) and Path(path).is_dir(), path
    assert runs["kvc"]["archive_path"] is None  # prefilled without an archive: nothing to recall


def test_readme_is_short_and_keeps_the_test_command() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.encode("utf-8")) <= 15 * 1024, f"README.md is {len(text.encode()):,} bytes (at most 15 KB)"
    assert "bash scripts/test.sh" in text and 'python -m pytest -m "not slow"' in text
    assert "--model" in text and "kvtool sample" in text


@pytest.mark.parametrize(
    "page", ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
)
def test_links_to_docs_resolve(page: str) -> None:
    text = (ROOT / page).read_text(encoding="utf-8")
    for target in re.findall(r"\]\(((?:docs/)?[\w.-]+\.md)(?:#[\w-]*)?\)", text):
        base = ROOT if page == "README.md" else ROOT / "docs"
        if target.startswith("docs/") and page != "README.md":
            base = ROOT
        assert (base / target).is_file(), f"{page} links to missing {target}"


def test_no_issue_numbers_in_the_face_pages() -> None:
    for page in (
        "README.md",
        "docs/cli.md",
        "docs/policies.md",
        "docs/recall.md",
        "docs/models.md",
        "docs/evaluation.md",
    ):
        text = (ROOT / page).read_text(encoding="utf-8")
        assert not re.search(r"\bissue \d+|#\d{1,4}\b(?!\.)", text, re.I), page
