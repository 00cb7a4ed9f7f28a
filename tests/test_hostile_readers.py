"""Hostile documents, round 4: encodings nobody can decode, encrypted PDFs kvtool cannot open, readers whose
library does not import, work that grew with what the file says (blank files, page counts, bombs), and files
left to the garbage collector. Each is one line and exit 2, or a bounded read."""

from __future__ import annotations

import gc
import html
import os
import subprocess
import sys
import time
import tracemalloc
import warnings
import zipfile
from pathlib import Path

import pytest

from kvtool.cli.app import main
from kvtool.documents import iter_parts, open_document
from kvtool.errors import UsageError
from tests import test_hostile_documents as hd
from tests.doc_fixtures import (
    ARTICLE,
    CHAPTERS,
    make_bomb_docx,
    make_bomb_epub,
    make_docx,
    make_epub,
    make_html,
    novel_sections,
)

REPO = Path(__file__).resolve().parents[1]
NO_MODEL = ["--model", "/nonexistent-model-dir"]


def read_all(path: Path) -> str:
    with open_document(str(path)) as doc:
        return "".join(p.text for p in iter_parts(doc))


def one_line(capsys, args, code: int = 2) -> str:
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == code and len(lines) == 1 and "internal error" not in err and not out, err
    return lines[0]


def rezip(src: Path, dst: Path, member: str, edit) -> Path:
    """A copy of a ZIP document with one member's bytes passed through ``edit``."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            zout.writestr(info, edit(data) if info.filename == member else data)
    return dst


def declare(encoding: str):
    """An edit that makes a member's XML declare ``encoding`` (adding a declaration where there is none)."""

    def edit(data: bytes) -> bytes:
        body = data.split(b"?>", 1)[1] if data.startswith(b"<?xml") else data
        return f'<?xml version="1.0" encoding="{encoding}"?>'.encode() + body

    return edit


# -- encodings a document declares that Python does not know or cannot decode with --------------------------------
@pytest.mark.parametrize("charset", ["idna", "undefined", "rot13", "x-klingon", "utf-7"])
def test_html_declaring_an_unusable_charset_is_read_as_latin_1(tmp_path, charset):
    pytest.importorskip("trafilatura")
    page = make_html(tmp_path / "p.html", ARTICLE)
    data = page.read_bytes().replace(b"<head>", f'<head><meta charset="{charset}">'.encode())
    page.write_bytes(data.replace(b"seventy", b"seventy\xe9"))  # not UTF-8: the declared charset is consulted
    assert "seventy\u00e9" in read_all(page)


EPUB_MEMBERS = ["META-INF/container.xml", "OEBPS/content.opf", "OEBPS/c1.xhtml"]


@pytest.mark.parametrize("encoding", ["windows-874", "x-mac-roman", "x-klingon", "idna", "utf-7", "rot13"])
@pytest.mark.parametrize("member", EPUB_MEMBERS)
def test_epub_member_declaring_an_unusable_encoding_is_one_line(tmp_path, capsys, member, encoding):
    book = rezip(make_epub(tmp_path / "b.epub", CHAPTERS), tmp_path / "enc.epub", member, declare(encoding))
    with pytest.raises(UsageError) as e:  # metadata when the book opens, a chapter when the read reaches it
        read_all(book)
    line = str(e.value)
    assert f"declared in encoding '{encoding}'" in line and "save it as UTF-8" in line and "\n" not in line, line
    if member != "OEBPS/c1.xhtml":  # before any model loads
        assert f"encoding '{encoding}'" in one_line(capsys, ["ask", book, "q", *NO_MODEL])


@pytest.mark.parametrize("encoding", ["windows-874", "x-mac-roman", "idna"])
def test_docx_part_declaring_an_unusable_encoding_is_one_line(tmp_path, capsys, encoding):
    pytest.importorskip("docx")
    src = make_docx(tmp_path / "d.docx", CHAPTERS)
    doc = rezip(src, tmp_path / "enc.docx", "word/document.xml", declare(encoding))
    with pytest.raises(UsageError) as e:
        read_all(doc)
    assert "word/document.xml" in str(e.value) and f"encoding '{encoding}'" in str(e.value), str(e.value)


# -- PDFs kvtool cannot decrypt: say so, and how to read them ------------------------------------------------------
def _plain_pdf(tmp_path: Path) -> bytes:
    pytest.importorskip("fpdf")
    from tests.doc_fixtures import make_pdf

    return make_pdf(tmp_path / "plain.pdf", ["The castle by the river."]).read_bytes()


def _encrypted(raw: bytes, path: Path, encrypt: bytes) -> Path:
    """``raw`` with an /Encrypt dictionary (a new object) named by its trailer."""
    n = raw.count(b" obj") + 1
    at = raw.find(b"<<", raw.rfind(b"trailer")) + 2
    data = raw[:at] + f" /Encrypt {n} 0 R".encode() + raw[at:]
    data = data.replace(b"startxref", f"{n} 0 obj\n".encode() + encrypt + b"\nendobj\nstartxref")
    path.write_bytes(data)
    return path


ZEROS = b"<" + b"00" * 48 + b">"
AES256 = (
    b"<< /Filter /Standard /V 5 /R 6 /Length 256 /O "
    + ZEROS
    + b" /U "
    + ZEROS
    + b" /OE <"
    + b"00" * 32
    + b"> /UE <"
    + b"00" * 32
    + b"> /P -4 /Perms <"
    + b"00" * 16
    + b"> /CF << /StdCF << /CFM /AESV3 "
    b"/AuthEvent /DocOpen /Length 32 >> >> /StmF /StdCF /StrF /StdCF >>"
)


def test_aes_pdf_without_the_cryptography_package_says_what_to_install(tmp_path, capsys, monkeypatch):
    import pypdf._encryption as enc
    from pypdf._crypt_providers import _fallback

    for name in ("aes_cbc_encrypt", "aes_cbc_decrypt", "aes_ecb_encrypt", "aes_ecb_decrypt"):
        monkeypatch.setattr(enc, name, getattr(_fallback, name))  # as pypdf is without cryptography
    pdf = _encrypted(_plain_pdf(tmp_path), tmp_path / "aes.pdf", AES256)
    line = one_line(capsys, ["ask", pdf, "q", *NO_MODEL])
    assert "encrypted with AES" in line and "pip install cryptography" in line and "qpdf --decrypt" in line, line


@pytest.mark.parametrize(
    "handler", [b"/Adobe.PubSec /SubFilter /adbe.pkcs7.s5 /Recipients [<00>]", b"/Klingon.Security"]
)
def test_pdf_with_a_non_standard_security_handler_is_one_line(tmp_path, capsys, handler):
    pdf = _encrypted(_plain_pdf(tmp_path), tmp_path / "h.pdf", b"<< /Filter " + handler + b" /V 2 /R 3 /Length 128 >>")
    line = one_line(capsys, ["ask", pdf, "q", *NO_MODEL])
    name = handler.split()[0].decode()
    assert f"the {name} security handler" in line and "decrypt it first" in line, line


def test_a_package_a_page_needs_is_named_not_an_internal_error(tmp_path, capsys, monkeypatch):
    import pypdf
    from pypdf.errors import DependencyError

    pdf = tmp_path / "p.pdf"
    pdf.write_bytes(_plain_pdf(tmp_path))

    def needs(self, *a, **k):
        raise DependencyError("cryptography>=3.1 is required for AES algorithm")

    monkeypatch.setattr(pypdf.PageObject, "extract_text", needs)
    with pytest.raises(UsageError, match="pip install cryptography"):
        read_all(pdf)


# -- a reader whose library is installed but does not import --------------------------------------------------------
def _run(code: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env_extra or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_html_without_lxml_html_clean_says_what_to_install(tmp_path):
    pytest.importorskip("trafilatura")
    page = make_html(tmp_path / "p.html", ARTICLE)
    r = _run(
        "import sys; sys.modules['lxml_html_clean'] = None\n"  # as if not installed: lxml's stub then refuses
        "from kvtool.cli.app import main\n"
        f"sys.exit(main(['ask', {str(page)!r}, 'q', '--model', '/nonexistent-model-dir']))"
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "installed but does not import" in r.stderr and "pip install lxml_html_clean" in r.stderr, r.stderr


def test_a_broken_pdf_library_is_named_not_an_internal_error(tmp_path):
    fake = tmp_path / "site" / "pypdf"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise AttributeError(\"module 'zlib' has no attribute 'inflate'\")\n")
    pdf = tmp_path / "p.pdf"
    pdf.write_bytes(b"%PDF-1.4\n" + b"0" * 100)
    r = _run(
        "import sys\nfrom kvtool.cli.app import main\n"
        f"sys.exit(main(['ask', {str(pdf)!r}, 'q', '--model', '/nonexistent-model-dir']))",
        {"PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{REPO}"},
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "pypdf, which is installed but does not import (AttributeError" in r.stderr, r.stderr


# -- work that grew with the file -------------------------------------------------------------------------------------
def test_a_whitespace_only_file_is_refused_up_front(tmp_path, capsys):
    blank = tmp_path / "blank.txt"
    blank.write_text(" \n\t\u3000" * 300_000, encoding="utf-8")  # 2 MB of whitespace
    started = time.monotonic()
    with pytest.raises(UsageError, match="blank.txt is empty$"):
        open_document(str(blank))  # before any reader (or model) touches it
    assert "is empty" in one_line(capsys, ["ask", blank, "q", *NO_MODEL])
    assert time.monotonic() - started < 10


def test_whitespace_on_stdin_is_refused_and_late_text_is_kept(tmp_path):
    blank = subprocess.run(
        [sys.executable, "-c", "from kvtool.cli.app import entry; entry()", "ask", "-", "q", *NO_MODEL],
        input=b" \n" * 200_000,
        capture_output=True,
        cwd=REPO,
        timeout=120,
    )
    assert blank.returncode == 2 and blank.stderr.decode().strip() == "kvtool: error: <stdin> is empty", blank.stderr
    late = tmp_path / "late.md"
    text = " \n" * 20_000 + "# Heading\n\nthe word\n"
    late.write_text(text, encoding="utf-8")
    assert read_all(late) == text  # a regular file is scanned with pread: nothing moved, nothing lost


def _pages_pdf(path: Path, n: int) -> Path:
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("Helvetica", size=12)
    for i in range(n):
        pdf.add_page()
        pdf.cell(0, 10, f"w{i}")
    pdf.output(str(path))
    return path


def test_a_pdf_of_many_pages_is_read_without_holding_its_pages(tmp_path):
    pytest.importorskip("fpdf")

    def peak(n: int) -> int:
        path = _pages_pdf(tmp_path / f"p{n}.pdf", n)
        tracemalloc.start()
        try:
            with open_document(str(path)) as doc:
                words = sum(len(p.text.split()) for p in iter_parts(doc))
            assert words == n and doc.reader.total == n
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    peak(50)  # pypdf's imports and first-use caches, outside the comparison
    small, large = peak(200), peak(2000)
    # what remains per page is pypdf's cross-reference index (~0.9 KiB for a page's three objects); holding
    # every page object and the objects read (pypdf's own page list and cache) costs ~3.7 KiB a page
    assert (large - small) / 1800 < 1536, (small, large)


def test_a_markdown_line_of_200000_nested_quotes_reaches_its_first_block_fast(tmp_path):
    from kvtool.runtime.citations import SourceMap
    from kvtool.runtime.document import iter_token_blocks
    from tests.helpers import tiny_tokenizer

    md = tmp_path / "q.md"
    md.write_text("# Quotes\n\n" + "> " * 200_000 + "deep\n", encoding="utf-8")
    started = time.monotonic()
    with open_document(str(md)) as doc:
        blocks = iter_token_blocks(doc, tiny_tokenizer(), 128, SourceMap(0))
        assert next(blocks).numel() == 128
    assert time.monotonic() - started < 10


# -- decompression bombs: refused when the document is opened, before the model reads a token of them -------------
BOMBS = {"epub": make_bomb_epub, "docx": make_bomb_docx}


@pytest.mark.parametrize("kind", sorted(BOMBS))
@pytest.mark.parametrize(
    "inflated, prose",
    [
        (64 * 2**20, 0),  # one sentence from the first byte
        (900 * 1024, 0),  # under a MiB: a few KiB of file that hands out ~200K tokens
        (200 * 2**20, 2 * 2**20),  # 2 MiB of prose first: "so far" stays under the cap for the first ~70 MiB
    ],
)
def test_a_bomb_is_refused_when_opened_before_any_part(tmp_path, kind, inflated, prose):
    bomb = BOMBS[kind](tmp_path / f"bomb.{kind}", inflated, hd.words(prose).encode())
    assert bomb.stat().st_size < 2 * 2**20
    started = time.monotonic()
    with pytest.raises(UsageError, match="decompression bomb"):
        open_document(str(bomb))  # no part handed out: the model has nothing to read
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("kind", sorted(BOMBS))
def test_kvtool_ask_on_a_bomb_ends_in_seconds_in_bounded_memory(tmp_path, kind):
    """The embedded model and the default settings, as a user runs it: one line, exit 2, within 20 s, < 1.8 GB."""
    bomb = BOMBS[kind](tmp_path / f"bomb.{kind}", 400 * 2**20)
    assert bomb.stat().st_size < 2 * 2**20
    # a wrapper whose only child is kvtool: its children's peak RSS is kvtool's
    code = (
        "import resource, subprocess, sys, time\n"
        "t = time.monotonic()\n"
        "try:\n"
        f"    r = subprocess.run([sys.executable, '-c', 'from kvtool.cli.app import entry; entry()', 'ask', "
        f"{str(bomb)!r}, 'How did revenue change?'], capture_output=True, text=True, timeout=20)\n"
        "    code, err = r.returncode, r.stderr\n"
        "except subprocess.TimeoutExpired:\n"
        "    code, err = 'timeout', ''\n"
        "print(code, round(time.monotonic() - t, 1), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
        "sys.stdout.write(err)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    first, _, err = r.stdout.partition("\n")
    rc, seconds, peak_kib = first.split()
    assert rc == "2" and float(seconds) < 20, (first, err)
    assert int(peak_kib) < 1.8e9 / 1024, first
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "decompression bomb" in lines[0] and "internal error" not in err, err


@pytest.mark.parametrize("kind", sorted(BOMBS))
def test_a_whole_novel_still_reads(tmp_path, kind):
    novel = Path("/work/shared/corpus/pride_and_prejudice.txt")
    if not novel.is_file():
        pytest.skip(f"corpus not found: {novel}")
    sections = novel_sections(novel)
    if kind == "epub":
        book = make_epub(tmp_path / "novel.epub", [(t, html.escape(b, quote=False)) for t, b in sections])
    else:
        pytest.importorskip("docx")
        book = make_docx(tmp_path / "novel.docx", sections)
    words = read_all(book).split()
    assert words == [w for title, body in sections for w in f"{title} {body}".split()]
    assert len(words) > 120_000


# -- files closed when their owner is done, not when the garbage collector finds them ------------------------------
def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_a_document_opened_but_never_read_is_closed(tmp_path, capsys):
    doc = tmp_path / "d.txt"
    doc.write_text("the castle by the river. " * 1000, encoding="utf-8")
    bad_profile = tmp_path / "p.yaml"
    bad_profile.write_text("budgett: 1\n")
    gc.disable()
    try:
        before = _open_fds()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for args in (
                ["ask", doc, "q", "--profile", bad_profile],
                ["prefill", doc, "-o", tmp_path / "o.kvc", "--profile", bad_profile],
            ):
                assert main([str(a) for a in args]) == 2
            assert _open_fds() == before
            gc.enable()
            gc.collect()
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]
    finally:
        gc.enable()
    capsys.readouterr()


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
@pytest.mark.parametrize("fmt", ["txt", "md", "epub"])
def test_a_read_abandoned_partway_closes_its_file(tmp_path, fmt):
    if fmt == "epub":
        path = hd.epub(tmp_path / "b.epub", [hd.xhtml(f"<p>{hd.words(300_000, seed=i)}</p>") for i in range(3)])
    else:
        path = tmp_path / f"d.{fmt}"
        path.write_text(("# Part\n\n" if fmt == "md" else "") + hd.words(600_000), encoding="utf-8")
    gc.disable()
    try:
        before = _open_fds()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with open_document(str(path)) as doc:
                parts = iter_parts(doc)
                next(parts)  # the read stops here: an error or Ctrl-C in the consumer
            assert _open_fds() == before
            del parts, doc
            gc.enable()
            gc.collect()
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]
    finally:
        gc.enable()


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
@pytest.mark.parametrize(
    "content", [b" \n" * 10_000, b"text then a \x00 NUL", b"caf\xe9 is not UTF-8 " * 10, b"PK\x03\x04 a zip of nothing"]
)
def test_a_document_refused_when_opened_closes_its_file(tmp_path, content):
    path = tmp_path / "d.txt"
    path.write_bytes(content)
    gc.disable()
    try:
        before = _open_fds()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(5):
                with pytest.raises(UsageError):
                    open_document(str(path))
            assert _open_fds() == before
            gc.enable()
            gc.collect()
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]
    finally:
        gc.enable()
