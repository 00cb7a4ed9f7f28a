"""Readers for the documents people have: PDF, EPUB, HTML, Markdown, DOCX and plain text.

Every reader turns a file into a stream of :class:`Part` — a page (PDF), a chapter (EPUB) or a section
(HTML, DOCX, Markdown headings) — extracted one at a time, so the prefill tokenizes a part while the next
one is still in the file and memory stays flat however long the document is. Concatenated, the parts'
texts are the *extracted text* of the document; character offsets (citations) are offsets into it.

The format is detected from the content (magic bytes) with the file name as a hint, or forced with
``--format``. Bad input (encrypted, no text layer, DRM, damaged) is a one-line ``UsageError`` (exit 2),
raised while the document is opened — before the model loads — whenever it can be known that early.
The extraction libraries are the optional extra ``kvtool[documents]`` (pypdf, trafilatura).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from kvtool.errors import UsageError

#: every format ``--format`` accepts (``auto``: detect)
FORMATS = ("auto", "text", "markdown", "html", "pdf", "epub", "docx")
_EXTENSIONS = {
    ".pdf": "pdf", ".epub": "epub", ".docx": "docx", ".html": "html", ".htm": "html", ".xhtml": "html",
    ".md": "markdown", ".markdown": "markdown", ".txt": "text", ".text": "text",
}  # fmt: skip
_HTML_START = re.compile(rb"^\s*(<\?xml[^>]*>\s*)?(<!--.*?-->\s*)*<(!doctype\s+html|html[\s>])", re.I | re.S)
_MD_HEADING = re.compile(rb"^\s*#{1,6}\s+\S")


@dataclass
class Part:
    """One piece of extracted text and where it sits in the document.

    ``text`` already carries its separator from the previous part (readers add a blank line between
    pages or chapters), so the parts' texts concatenated are the extracted text.
    """

    text: str
    page: int | None = None  # 1-based page number (PDF)
    chapter: int | None = None  # 1-based chapter number (EPUB)
    title: str | None = None  # chapter or section heading
    new_unit: bool = True  # whether this part starts a new page/chapter/section (counted in progress)


class Reader(Protocol):
    """What every format's reader offers."""

    unit: str  # "page", "chapter" or "section": what progress counts
    total: int | None  # how many units, when known before reading
    notes: list[str]  # things worth telling the user once the document is read (e.g. empty pages)

    def parts(self) -> Iterator[Part]: ...


def require(module: str, fmt: str) -> None:
    """A one-line error when the ``documents`` extra is missing (kvtool itself reads text without it)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise UsageError(f"reading {fmt.upper()} needs the documents extra: pip install 'kvtool[documents]'")


def detect_format(head: bytes, name: str, forced: str | None = None) -> str:
    """The document's format from its first bytes, the extension as a hint, or ``forced`` (``--format``)."""
    if forced is not None:
        f = forced.strip().lower()
        if f not in FORMATS:
            raise UsageError(f"--format must be one of {', '.join(FORMATS)} (got {forced!r})")
        if f != "auto":
            return f
    ext = _EXTENSIONS.get(os.path.splitext(name)[1].lower())
    if b"%PDF-" in head[:1024]:
        return "pdf"
    if head.startswith(b"PK\x03\x04"):
        if b"mimetypeapplication/epub+zip" in head[:100] or b"META-INF/container.xml" in head:
            return "epub"
        if b"word/" in head or b"[Content_Types].xml" in head and ext == "docx":
            return "docx"
        if ext in ("epub", "docx"):
            return ext
        raise UsageError(f"{name} is a ZIP archive, not an EPUB or DOCX document; kvtool cannot read it")
    if head.startswith(b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"):
        raise UsageError(f"{name} is an encrypted Office file or an old .doc: decrypt it first and save it as .docx")
    if ext in ("pdf", "epub", "docx"):
        kind = "an EPUB (ZIP)" if ext == "epub" else "a DOCX (ZIP)" if ext == "docx" else "a PDF"
        raise UsageError(f"{name} is not {kind}: the file is damaged or misnamed (use --format to override)")
    if ext == "html" or _HTML_START.match(head[:4096]):
        return "html"
    if ext == "markdown" or (ext is None and _MD_HEADING.match(head[:256])):
        return "markdown"
    return "text"
