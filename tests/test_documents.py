"""Documents in every format: extraction equals the known text, pages map back, bad input is one line.

Fixtures are generated here (tests/doc_fixtures.py: fpdf2 for PDFs, zipfile for EPUB, python-docx for
DOCX), never downloaded. No model is loaded: a tiny word-level tokenizer stands in where tokens matter.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pypdf")
pytest.importorskip("fpdf")

from kvtool.documents import detect_format, extract_text, iter_parts, open_document  # noqa: E402
from kvtool.errors import UsageError  # noqa: E402
from kvtool.runtime.citations import SourceMap  # noqa: E402
from kvtool.runtime.document import iter_token_blocks  # noqa: E402
from tests.doc_fixtures import (  # noqa: E402
    ARTICLE,
    CHAPTERS,
    PAGES,
    make_docx,
    make_epub,
    make_html,
    make_pdf,
)
from tests.helpers import WordTokenizer  # noqa: E402


def norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def read_all(path: Path, fmt: str | None = None) -> tuple[object, list]:
    doc = open_document(str(path), fmt)
    return doc, list(iter_parts(doc))


# -- extraction ---------------------------------------------------------------------------------------------
def test_pdf_pages_extract_the_known_text(tmp_path):
    doc, parts = read_all(make_pdf(tmp_path / "p.pdf", PAGES))
    assert doc.fmt == "pdf" and doc.parts_total == 3 and doc.unit == "page"
    assert [p.page for p in parts] == [1, 2, 3]
    assert [norm(p.text) for p in parts] == PAGES
    assert doc.sha256 and doc.notes == []


def test_epub_chapters_in_spine_order_with_titles(tmp_path):
    doc, parts = read_all(make_epub(tmp_path / "b.epub", CHAPTERS))
    assert doc.fmt == "epub" and doc.unit == "chapter"
    assert [(p.chapter, p.title) for p in parts] == [(i + 1, t) for i, (t, _) in enumerate(CHAPTERS)]
    assert [norm(p.text) for p in parts] == [f"{t} {b}" for t, b in CHAPTERS]


def test_html_main_text_without_boilerplate(tmp_path):
    _, parts = read_all(make_html(tmp_path / "a.html", ARTICLE))
    text = norm("".join(p.text for p in parts))
    for paragraph in ARTICLE:
        assert paragraph in text
    for boilerplate in ("Section 3", "cookies", "Copyright", "Owls at night", "var x"):
        assert boilerplate not in text


def test_docx_sections_at_headings(tmp_path):
    doc, parts = read_all(make_docx(tmp_path / "d.docx", CHAPTERS))
    assert doc.fmt == "docx"
    assert [p.title for p in parts] == [t for t, _ in CHAPTERS]
    assert [norm(p.text) for p in parts] == [f"{t} {b}" for t, b in CHAPTERS]


def test_markdown_headings_start_sections_and_text_is_kept_as_is(tmp_path):
    md = "Intro line.\n\n# First\nAlpha text.\n\n## Second part\nBeta text.\n"
    path = tmp_path / "n.md"
    path.write_text(md, encoding="utf-8")
    doc, parts = read_all(path)
    assert doc.fmt == "markdown"
    assert "".join(p.text for p in parts) == md  # Markdown is read as it is
    titled = {p.title for p in parts if "text" in p.text}
    assert titled == {"First", "Second part"}


def test_plain_text_is_unchanged(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("just words here " * 5000, encoding="utf-8")
    _, parts = read_all(path)
    assert "".join(p.text for p in parts) == "just words here " * 5000


def test_format_is_detected_from_content_not_the_name(tmp_path):
    pdf = make_pdf(tmp_path / "x.pdf", PAGES[:1]).read_bytes()
    (tmp_path / "paper.bin").write_bytes(pdf)
    assert open_document(str(tmp_path / "paper.bin")).fmt == "pdf"
    epub = make_epub(tmp_path / "b.epub", CHAPTERS).read_bytes()
    assert detect_format(epub[:8192], "book.zip") == "epub"
    assert detect_format(b"<!DOCTYPE html><html>", "page") == "html"
    assert detect_format(b"# Title\n\ntext", "notes") == "markdown"
    assert detect_format(b"<p>hi</p>", "x.txt", "html") == "html"  # --format overrides
    assert detect_format(b"# not markdown", "x.md", "text") == "text"


def test_stdin_pdf_is_read(tmp_path, monkeypatch):
    data = make_pdf(tmp_path / "p.pdf", PAGES).read_bytes()

    class Stdin:
        buffer = io.BytesIO(data)

    monkeypatch.setattr(sys, "stdin", Stdin)
    doc, parts = read_all(Path("-"))
    assert doc.fmt == "pdf" and [norm(p.text) for p in parts] == PAGES


def test_eval_inputs_accept_documents(tmp_path):
    from kvtool.eval import load_text

    make_pdf(tmp_path / "a.pdf", PAGES)
    (tmp_path / "b.txt").write_text("Plain tail.", encoding="utf-8")
    text = load_text(tmp_path, "--haystack")
    assert norm(text) == norm(" ".join(PAGES) + " Plain tail.")
    assert norm(extract_text(str(tmp_path / "a.pdf"), 40)) == norm(PAGES[0][:40])


# -- the token → (page, character) map ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "maker, items, key",
    [
        (make_pdf, PAGES, "page"),
        (make_epub, CHAPTERS, "chapter"),
    ],
)
def test_every_token_maps_back_to_its_page_and_characters(tmp_path, maker, items, key):
    path = maker(tmp_path / f"doc.{'pdf' if key == 'page' else 'epub'}", items)
    doc = open_document(str(path))
    source = SourceMap(first_position=5)
    blocks = list(iter_token_blocks(doc, WordTokenizer(), 7, source))
    text = extract_text(str(path), 10**6)
    assert sum(b.numel() for b in blocks) == doc.tokens == source.count == len(source)
    source._flush()
    assert source.positions.tolist() == list(range(5, 5 + doc.tokens))
    # each token's span is exactly its text; spans tile the extracted text
    assert source.spans[0, 0] == 0 and int(source.spans[-1, 1]) == len(text)
    assert (source.spans[1:, 0] == source.spans[:-1, 1]).all()
    # known sentences map to their page / chapter
    for i, item in enumerate(items):
        sentence = item if key == "page" else item[1]
        at = text.index(sentence.split(".")[0])
        sec = source.section_at(at)
        assert getattr(sec, key) == i + 1


def test_source_map_prunes_evicted_tokens_and_round_trips(tmp_path):
    import torch

    doc = open_document(str(make_pdf(tmp_path / "p.pdf", PAGES)))
    source = SourceMap(first_position=3)
    list(iter_token_blocks(doc, WordTokenizer(), 8, source))
    n = source.count
    held = torch.tensor([0, 1, 3, 4, 10, 11, 12])
    source.prune(held, seen=3 + n - 5)  # the last 5 tokens are not fed yet: kept
    kept = source.positions.tolist()
    assert kept == [3, 4, 10, 11, 12] + list(range(3 + n - 5, 3 + n))
    again = SourceMap.from_meta(source.meta())
    assert again.positions.tolist() == kept and torch.equal(again.spans, source.spans)
    assert torch.equal(again.ids, source.ids) and again.sections == source.sections


# -- bad input: one line, exit 2 -------------------------------------------------------------------------------
def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtool.cli.app", *args], capture_output=True, text=True, timeout=120)


BAD = [
    ("enc.pdf", lambda p: make_pdf(p, PAGES, password="secret"), "is encrypted: decrypt it first"),
    ("scan.pdf", lambda p: make_pdf(p, [None, None, None]), "has no text layer: run OCR first (none of its 3 pages"),
    ("broken.pdf", lambda p: p.write_bytes(b"%PDF-1.7\n" + b"\x8f garbage " * 50), "is not a readable PDF"),
    ("drm.epub", lambda p: make_epub(p, CHAPTERS, drm=True), "is DRM-protected"),
    ("nav.html", lambda p: make_html(p, [], article=False), "has no main text"),
    ("cut.epub", lambda p: p.write_bytes(make_epub(p, CHAPTERS).read_bytes()[:300]), "is not a valid EPUB"),
    ("cut.docx", lambda p: p.write_bytes(b"PK\x03\x04" + b"\x00" * 40), "is not a valid DOCX"),
    ("fake.pdf", lambda p: p.write_text("hello, not a pdf", encoding="utf-8"), "is not a PDF"),
]


@pytest.mark.parametrize("name, make, message", BAD, ids=[b[0] for b in BAD])
def test_bad_documents_are_one_line_errors(tmp_path, name, make, message):
    path = tmp_path / name
    make(path)
    with pytest.raises(UsageError) as e:
        doc = open_document(str(path))
        list(iter_parts(doc))
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name, make, message", [BAD[0], BAD[1], BAD[3], BAD[4]], ids=["enc", "scan", "drm", "html"])
def test_bad_documents_exit_2_before_the_model_loads(tmp_path, name, make, message):
    path = tmp_path / name
    make(path)
    r = cli("ask", str(path), "What?", "--model", str(tmp_path / "no-such-model"))
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("kvtool: error:") and message in r.stderr


def test_pdf_with_some_empty_pages_reads_the_others_and_says_which(tmp_path):
    doc, parts = read_all(make_pdf(tmp_path / "mixed.pdf", [PAGES[0], None, None, PAGES[1], None]))
    assert [p.page for p in parts] == [1, 4]
    assert [norm(p.text) for p in parts] == PAGES[:2]
    assert doc.notes == [f"{tmp_path / 'mixed.pdf'}: 3 of 5 pages had no text layer (pages 2-3, 5); read the other 2"]
