"""PDF pages with pypdf (BSD): text layer of each page, extracted as the prefill reaches it.

pypdf was chosen over pdfminer.six by measurement on generated fixtures: both extract the known text
exactly, pypdf reads a 1,000-page PDF in 1.7 s against 22 s (README "Documents").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, BinaryIO

from kvtool.documents.base import Part, require, split_text
from kvtool.errors import UsageError


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
    return text


def _has_font(page: Any) -> bool:
    """Whether a page can carry a text layer: fonts in its resources or its form XObjects' (cheap, no parsing)."""
    try:
        res = page.get("/Resources")
        res = res.get_object() if res is not None else None
        if not res:
            return False
        if res.get("/Font"):
            return True
        xobjects = res.get("/XObject")
        for ref in (xobjects.get_object().values() if xobjects else []):
            inner = ref.get_object().get("/Resources")
            if inner is not None and inner.get_object().get("/Font"):
                return True
    except Exception:  # an odd resource dictionary: let extraction decide
        return True
    return False


class PdfReaderParts:
    """Pages of a PDF; checked for encryption and a text layer when opened."""

    unit = "page"

    def __init__(self, source: str | BinaryIO, name: str) -> None:
        require("pypdf", "pdf")
        import logging

        # pypdf logs its repairs of damaged files ("EOF marker not found") on stderr; kvtool reports one line
        logging.getLogger("pypdf").setLevel(logging.ERROR)
        self.name = name
        self.notes: list[str] = []
        self.empty_pages: list[int] = []
        # a path is opened here and read by pypdf as it seeks (given a path, pypdf would read the file whole)
        self.file: BinaryIO = open(source, "rb") if isinstance(source, str) else source  # noqa: SIM115
        try:
            self._open(name)
        except BaseException:
            self.file.close()
            raise

    def _open(self, name: str) -> None:
        import pypdf
        from pypdf.errors import DependencyError, PdfReadError

        try:
            self.reader = pypdf.PdfReader(self.file)
            encrypted = self.reader.is_encrypted
        except (PdfReadError, ValueError, KeyError, TypeError, AttributeError, OSError) as e:
            raise UsageError(f"{name} is not a readable PDF (corrupt: {_short(e)})") from None
        if encrypted:
            try:  # owner-password-only PDFs (printing/copying restrictions) open with the empty password
                ok = bool(self.reader.decrypt(""))
            except (DependencyError, PdfReadError, NotImplementedError, ValueError):
                ok = False
            if not ok:
                raise UsageError(f"{name} is encrypted: decrypt it first (e.g. qpdf --decrypt --password=... in out)")
        try:
            self.total = len(self.reader.pages)
            fonts = [_has_font(p) for p in self.reader.pages]
        except Exception as e:  # pypdf raises many types on damaged page trees
            raise UsageError(f"{name} is not a readable PDF (corrupt page tree: {_short(e)})") from None
        if self.total == 0:
            raise UsageError(f"{name} has no pages")
        if not any(fonts):
            raise UsageError(f"{name} has no text layer: run OCR first (none of its {self.total} pages has text)")

    def parts(self) -> Iterator[Part]:
        try:
            yield from self._pages()
        finally:
            self.file.close()

    def _pages(self) -> Iterator[Part]:
        first = True
        for i in range(self.total):
            try:
                text = self.reader.pages[i].extract_text() or ""
            except Exception as e:
                raise UsageError(f"{self.name}: page {i + 1} cannot be read (corrupt: {_short(e)})") from None
            text = text.strip()
            if not text:
                self.empty_pages.append(i + 1)
                continue
            done = 0
            for k, piece in enumerate(split_text(text)):
                done += len(piece)
                fraction = (i + done / len(text)) / self.total
                yield Part(text=piece if first or k else "\n\n" + piece, page=i + 1, new_unit=k == 0, fraction=fraction)
            first = False
        if first:
            raise UsageError(f"{self.name} has no text layer: run OCR first (none of its {self.total} pages has text)")
        if self.empty_pages:
            read = self.total - len(self.empty_pages)
            self.notes.append(f"{self.name}: {len(self.empty_pages)} of {self.total} pages had no text layer "
                              f"({'pages' if len(self.empty_pages) > 1 else 'page'} {_ranges(self.empty_pages)}); "
                              f"read the other {read}")


def _ranges(pages: list[int]) -> str:
    """``[1, 2, 3, 7]`` → ``"1-3, 7"``."""
    out: list[str] = []
    start = prev = pages[0]
    for p in [*pages[1:], None]:
        if p is not None and p == prev + 1:
            prev = p
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if p is not None:
            start = prev = p
    return ", ".join(out)
