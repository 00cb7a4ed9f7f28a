"""Hostile documents: bombs, giant paragraphs, regex traps, text without spaces, late NULs, huge side files.

Every input is generated here at a small size, with the reader's cap scaled down (monkeypatch) so that
the refusal is reached in milliseconds; time bounds are generous (a loaded 2-core machine) and sit far
below what the quadratic or exponential behaviour they guard against would take at these sizes.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
import tracemalloc
import zipfile
from pathlib import Path

import pytest

from kvtool.documents import PART_CHARS, detect_format, iter_parts, iter_text, open_document, read_lines, zipxml
from kvtool.documents import html as html_mod
from kvtool.documents.markdown import MarkdownReaderParts
from kvtool.errors import EXIT_RUNTIME, EXIT_USAGE, KvtoolError, UsageError
from tests.helpers import WordTokenizer

ROOT = Path(__file__).resolve().parents[1]
WORDS = [f"w{i:03d}x" for i in range(997)]


def words(n_chars: int, seed: int = 0) -> str:
    """Text of about ``n_chars`` characters that compresses like prose (ratio ~3), not like a bomb."""
    rng = random.Random(seed)
    n = n_chars // 6
    return " ".join(rng.choices(WORDS, k=n))


def epub(
    path: Path,
    chapters: list[object],
    hrefs: list[str] | None = None,
    rootfile: str = "OEBPS/content.opf",
    padding: int = 0,
) -> Path:
    """An EPUB whose chapters are bytes, or callables writing to the member stream (large ones, streamed);
    ``padding`` bytes of incompressible "image" make the file larger without adding text."""
    hrefs = hrefs or [f"c{i}.xhtml" for i in range(len(chapters))]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(zipfile.ZipInfo("mimetype"), "application/epub+zip")
        z.writestr(
            "META-INF/container.xml",
            '<?xml version="1.0"?><container version="1.0" xmlns="urn:oasis:names:tc:opendocument:xmlns:'
            f'container"><rootfiles><rootfile full-path="{rootfile}"/></rootfiles></container>',
        )
        items = "".join(f'<item id="c{i}" href="{h}" media-type="application/xhtml+xml"/>' for i, h in enumerate(hrefs))
        spine = "".join(f'<itemref idref="c{i}"/>' for i in range(len(hrefs)))
        z.writestr(
            "OEBPS/content.opf",
            '<?xml version="1.0"?><package xmlns="http://www.idpf.org/2007/opf">'
            f"<manifest>{items}</manifest><spine>{spine}</spine></package>",
        )
        if padding:
            z.writestr("OEBPS/cover.jpg", random.Random(1).randbytes(padding))
        for i, body in enumerate(chapters):
            with z.open(f"OEBPS/c{i}.xhtml", "w") as f:
                if callable(body):
                    body(f)
                else:
                    f.write(body)
    return path


def xhtml(body: str) -> bytes:
    return (
        f'<html xmlns="http://www.w3.org/1999/xhtml"><head><title>T</title></head><body><h1>Head</h1>'
        f"{body}</body></html>"
    ).encode()


def streamed_chapter(pattern: bytes, total: int, prefix: bytes = b"", suffix: bytes = b""):
    def write(f) -> None:
        f.write(b'<html xmlns="http://www.w3.org/1999/xhtml"><body><p>' + prefix)
        for _ in range(total // len(pattern)):
            f.write(pattern)
        f.write(suffix + b"</p></body></html>")

    return write


def read_all(path: Path) -> list:
    return list(iter_parts(open_document(str(path))))


def streamed_equal(path: Path, expected: str) -> list[tuple[int, bool, str | None]]:
    """Read ``path`` part by part, checking each against ``expected`` without holding the parts."""
    at, seen = 0, []
    for p in iter_parts(open_document(str(path))):
        assert p.text == expected[at : at + len(p.text)], at
        at += len(p.text)
        seen.append((len(p.text), p.new_unit, p.title))
    assert at == len(expected)
    return seen


def peak_while(fn) -> tuple[object, int]:
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# -- the package stands alone ---------------------------------------------------------------------------------
def test_documents_import_and_read_text_without_torch(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 1000, encoding="utf-8")
    code = (
        "import kvtool.documents, sys; from kvtool.documents import open_document, iter_parts; "
        f"n = sum(len(p.text) for p in iter_parts(open_document({str(tmp_path / 'a.txt')!r}))); "
        "assert n == 12000, n; bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')]; "
        "assert not bad, bad; print('ok')"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


# -- EPUB: decompression bombs are refused as they inflate, chapters streamed -------------------------------------
def test_epub_chapter_bomb_is_refused_at_the_member_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(zipxml, "MAX_RATIO", 10**6)
    monkeypatch.setattr(zipxml, "MAX_MEMBER_BYTES", 4 * 2**20)
    path = epub(tmp_path / "bomb.epub", [streamed_chapter(b"a " * 4096, 16 * 2**20)])
    assert path.stat().st_size < 100_000
    with pytest.raises(UsageError) as e:
        _, peak = peak_while(lambda: read_all(path))
    assert "inflates to more than 4 MiB" in str(e.value) and e.value.exit_code == EXIT_USAGE


def test_epub_compression_ratio_is_capped_per_member_and_per_book(tmp_path):
    bomb = streamed_chapter(b"a " * 4096, 8 * 2**20)
    with pytest.raises(UsageError) as e:
        read_all(epub(tmp_path / "ratio.epub", [bomb], padding=256 * 1024))
    assert "times the compressed bytes read so far" in str(e.value) and "cap is 100x" in str(e.value)
    small = streamed_chapter(b"a " * 4096, zipxml.RATIO_FLOOR_BYTES - 8192)  # each under the floor: only the book
    with pytest.raises(UsageError, match=r"inflates to more than 100 times its size of \d+ KiB"):
        read_all(epub(tmp_path / "book.epub", [small] * 8))


def test_epub_book_total_is_capped(tmp_path, monkeypatch):
    monkeypatch.setattr(zipxml, "MAX_BOOK_BYTES", 2 * 2**20)
    chapters = [xhtml(f"<p>{words(600_000, seed=i)}</p>") for i in range(5)]
    with pytest.raises(UsageError) as e:
        read_all(epub(tmp_path / "many.epub", chapters))
    assert "inflates to more than 2 MiB (the cap for one EPUB)" in str(e.value)


def test_epub_long_chapter_is_streamed_in_bounded_parts(tmp_path):
    text = words(3 * 2**20)
    path = epub(tmp_path / "long.epub", [xhtml(f"<p>{text}</p>")])
    expected = "Head\n" + text
    seen, peak = peak_while(lambda: streamed_equal(path, expected))
    assert max(n for n, _, _ in seen) <= PART_CHARS
    assert [new for _, new, _ in seen].count(True) == 1 and seen[0][2] == "Head"
    assert peak < 2 * 2**20, f"peak {peak / 2**20:.1f} MiB while reading a 3 MiB chapter"


def test_epub_entity_bomb_and_giant_tag_are_refused(tmp_path, monkeypatch):
    lol = (
        '<?xml version="1.0"?><!DOCTYPE html [<!ENTITY a "aaaaaaaaaa">'
        + "".join(f'<!ENTITY {chr(98 + i)} "{("&" + chr(97 + i) + ";") * 10}">' for i in range(8))
        + ']><html xmlns="http://www.w3.org/1999/xhtml"><body><p>&i;</p></body></html>'
    ).encode()
    with pytest.raises(UsageError, match="not well-formed XHTML"):
        read_all(epub(tmp_path / "lol.epub", [lol]))
    monkeypatch.setattr(zipxml, "MAX_TAG_BYTES", 2**20)
    monkeypatch.setattr(zipxml, "MAX_RATIO", 10**6)
    giant = streamed_chapter(b"x" * 4096, 3 * 2**20, prefix=b'<img alt="', suffix=b'"/>')
    with pytest.raises(UsageError, match="an XML tag longer than 1 MiB"):
        read_all(epub(tmp_path / "tag.epub", [giant]))


def test_epub_names_are_confined_to_the_book(tmp_path):
    with pytest.raises(UsageError, match="points outside the EPUB"):
        read_all(epub(tmp_path / "up.epub", [xhtml("<p>x</p>")], hrefs=["../../etc/passwd"]))
    with pytest.raises(UsageError, match="points outside the EPUB"):
        read_all(epub(tmp_path / "abs.epub", [xhtml("<p>x</p>")], rootfile="/etc/content.opf"))


def test_epub_html_entities_are_read_and_old_expat_is_refused(tmp_path, monkeypatch):
    path = epub(tmp_path / "ent.epub", [xhtml("<p>caf&eacute;&nbsp;au&amp;lait</p>")])
    assert "".join(p.text for p in read_all(path)) == "Head\ncafé au&lait"
    monkeypatch.setattr(zipxml.pyexpat, "version_info", (2, 4, 0))
    with pytest.raises(KvtoolError) as e:
        read_all(path)
    assert e.value.exit_code == EXIT_RUNTIME and "older than 2.4.1" in str(e.value)


# -- DOCX: one giant paragraph is handed out in parts ---------------------------------------------------------------
def test_docx_giant_paragraph_is_handed_out_mid_paragraph(tmp_path):
    text = words(3 * 2**20, seed=3)
    w = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"
    path = tmp_path / "giant.docx"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("[Content_Types].xml", "<Types/>")
        z.writestr(
            "word/document.xml",
            f'<w:document xmlns:w="{w}"><w:body><w:p><w:pPr><w:pStyle w:val="Heading1"/>'
            f"</w:pPr><w:r><w:t>Title</w:t></w:r></w:p><w:p><w:r><w:t>{text}</w:t></w:r></w:p>"
            "</w:body></w:document>",
        )
    expected = "Title\n" + text
    seen, peak = peak_while(lambda: streamed_equal(path, expected))
    assert max(n for n, _, _ in seen) <= PART_CHARS and {t for _, _, t in seen} == {"Title"}
    assert peak < 2 * 2**20, f"peak {peak / 2**20:.1f} MiB while reading a 3 MiB paragraph"


# -- every regex over document text is linear ----------------------------------------------------------------------
def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_html_title_scan_is_linear():
    assert html_mod.page_title("<html><TITLE lang=en> A  page </title>") == "A page"
    assert timed(lambda: html_mod.page_title("<title" * 200_000)) < 2.0
    assert timed(lambda: html_mod.page_title("<title>" * 200_000)) < 2.0


def test_markdown_heading_scan_is_linear():
    line = "# a" + " " * 128_000 + "b\n"
    md = "Intro.\n" + line + "text\n" + "## x ##\n" + "#" * 100_000 + " y\n"
    parts: list = []
    assert timed(lambda: parts.extend(MarkdownReaderParts([md]).parts())) < 2.0
    assert "".join(p.text for p in parts) == md
    assert [p.title for p in parts if p.new_unit] == ["a", "x"]  # titles are cut to 200 characters


def test_html_detection_does_not_backtrack():
    head = b"<!---->" * 28 + b"x"
    assert timed(lambda: detect_format(head, "page")) < 1.0
    assert detect_format(b"<?xml version='1.0'?>\n<!-- c --> <!DOCTYPE html><html>", "page") == "html"
    assert detect_format(b"<!-- c --><HTML lang=en>", "page") == "html"
    assert detect_format(b"<!-- c -->hello", "page") == "text"


# -- text without spaces is cut at safe boundaries, linear, bounded -------------------------------------------------
def test_text_without_spaces_is_cut_linearly_with_a_bounded_working_set(tmp_path):
    text = "中文句子没有空格" * 200_000 + "。"  # 1.6M characters, 4.8 MB, no whitespace or punctuation until the end
    path = tmp_path / "zh.txt"
    path.write_text(text, encoding="utf-8")
    doc = open_document(str(path))
    sizes: list[int] = []

    def run() -> None:
        for p in iter_parts(doc):
            sizes.append(len(p.text))

    _, peak = peak_while(run)
    assert sum(sizes) == len(text) and max(sizes) <= PART_CHARS
    assert peak < 1.5 * 2**20, f"peak {peak / 2**20:.1f} MiB"
    punct = "这是一个句子。" * 100_000
    from kvtool.documents import text_document

    pieces = list(iter_text(text_document(punct)))
    assert "".join(pieces) == punct and all(p.endswith("。") for p in pieces)


# -- binary or blank content anywhere in the stream -----------------------------------------------------------------
def test_a_late_nul_is_binary_and_unicode_whitespace_is_empty(tmp_path):
    late = tmp_path / "late.txt"
    late.write_bytes(b"words " * 20_000 + b"\x00rest")
    doc = open_document(str(late))
    with pytest.raises(UsageError, match="looks binary .NUL byte at offset 120000"):
        list(iter_parts(doc))
    blank = tmp_path / "blank.txt"
    blank.write_text("\u00a0\u2003\u3000\n" * 10, encoding="utf-8")
    with pytest.raises(UsageError, match="blank.txt is empty$"):
        open_document(str(blank))
    big = tmp_path / "bigblank.txt"
    big.write_text("\u00a0 \u2003\n" * 20_000, encoding="utf-8")
    with pytest.raises(UsageError, match="bigblank.txt is empty$"):
        list(iter_parts(open_document(str(big))))
    r = subprocess.run(
        [sys.executable, "-m", "kvtool.cli.app", "ask", str(blank), "q?", "--model", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 2 and "is empty" in r.stderr and r.stderr.count("\n") == 1, r.stderr


# -- progress of a single-part document is a byte fraction ----------------------------------------------------------
def test_single_part_progress_estimates_from_the_byte_fraction(tmp_path):
    pytest.importorskip("trafilatura")
    from kvtool.runtime.document import estimate_tokens, iter_token_blocks
    from tests.doc_fixtures import make_html

    paragraphs = [f"Paragraph {i} says {words(600, seed=i)}." for i in range(400)]
    doc = open_document(str(make_html(tmp_path / "long.html", paragraphs)))
    blocks = iter_token_blocks(doc, WordTokenizer(), 256)
    next(blocks)
    early = estimate_tokens(doc)
    total = sum(b.numel() for b in blocks) + 256
    assert doc.fraction == 1.0 and early is not None
    assert 0.8 * total <= early <= 1.25 * total, (early, total)


# -- side files are bounded -----------------------------------------------------------------------------------------
def test_questions_file_is_bounded(tmp_path):
    with pytest.raises(UsageError, match="larger than 1024 KiB"):
        read_lines(Path("/dev/zero"), "--questions-file")
    many = tmp_path / "q.txt"
    many.write_text("why?\n" * 20, encoding="utf-8")
    with pytest.raises(UsageError, match="has 20 questions; at most 10"):
        read_lines(many, "--questions-file", max_lines=10)
    doc = tmp_path / "d.txt"
    doc.write_text("some text", encoding="utf-8")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtool.cli.app",
            "ask",
            str(doc),
            "--questions-file",
            "/dev/zero",
            "--model",
            str(tmp_path / "none"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 2 and "--questions-file /dev/zero is larger than" in r.stderr, r.stderr


def test_pypdf_floor_is_6():
    tomllib = pytest.importorskip("tomllib")
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["documents"]
    assert "pypdf>=6.0" in extra


# -- descriptors: closed on refusal and when a read is released -----------------------------------------------------
@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_readers_close_their_files_on_refusal_and_release(tmp_path, monkeypatch):
    import gc
    import io

    from tests.doc_fixtures import CHAPTERS, make_docx, make_epub, make_pdf

    drm = make_epub(tmp_path / "drm.epub", CHAPTERS, drm=True)
    good = [make_epub(tmp_path / "b.epub", CHAPTERS), make_docx(tmp_path / "d.docx", CHAPTERS)]
    if __import__("importlib").util.find_spec("fpdf"):
        good.append(make_pdf(tmp_path / "p.pdf", ["one page", "two pages"]))
    fds = len(list(Path("/proc/self/fd").iterdir()))
    gc.disable()
    try:
        for _ in range(20):
            with pytest.raises(UsageError, match="DRM"):
                open_document(str(drm))
            for path in good:
                parts = iter_parts(open_document(str(path)))
                next(parts)
                parts.close()
            monkeypatch.setattr(sys, "stdin", type("Stdin", (), {"buffer": io.BytesIO(good[0].read_bytes())}))
            parts = iter_parts(open_document("-"))
            next(parts)
            parts.close()
        assert len(list(Path("/proc/self/fd").iterdir())) == fds
    finally:
        gc.enable()
