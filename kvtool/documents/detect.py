"""Format detection: from the content (magic bytes), the file name as a hint, or ``--format``.

Every reader (one module per format in this package) turns a file into a stream of
:class:`~kvtool.documents.base.Part`; bad input (encrypted, no text layer, DRM, damaged) is a one-line
``UsageError`` (exit 2), raised while the document is opened whenever it can be known that early.
The checks here look at the first bytes only and are linear in them (no backtracking regex).
"""

from __future__ import annotations

import os

from kvtool.errors import UsageError

#: every format ``--format`` accepts (``auto``: detect)
FORMATS = ("auto", "text", "markdown", "html", "pdf", "epub", "docx")
_EXTENSIONS = {
    ".pdf": "pdf", ".epub": "epub", ".docx": "docx", ".html": "html", ".htm": "html", ".xhtml": "html",
    ".md": "markdown", ".markdown": "markdown", ".txt": "text", ".text": "text",
}  # fmt: skip
_SPACE = b" \t\r\n\f\v"


def _skip_space(head: bytes, i: int) -> int:
    while i < len(head) and head[i] in _SPACE:
        i += 1
    return i


def looks_like_html(head: bytes) -> bool:
    """Whether ``head`` starts (after an XML declaration, comments and whitespace) with a doctype or ``<html``."""
    low = head.lower()
    i = _skip_space(low, 0)
    if low.startswith(b"<?xml", i):
        end = low.find(b">", i)
        if end < 0:
            return False
        i = _skip_space(low, end + 1)
    while low.startswith(b"<!--", i):
        end = low.find(b"-->", i + 4)
        if end < 0:
            return False
        i = _skip_space(low, end + 3)
    if low.startswith(b"<!doctype", i):
        j = _skip_space(low, i + 9)
        return j > i + 9 and low.startswith(b"html", j)
    return low.startswith(b"<html", i) and len(low) > i + 5 and low[i + 5] in _SPACE + b">"


def _looks_like_markdown(head: bytes) -> bool:
    """Whether the first line is a ``#`` heading (``# Title``)."""
    i = _skip_space(head, 0)
    j = i
    while j < len(head) and head[j : j + 1] == b"#":
        j += 1
    return 1 <= j - i <= 6 and j < len(head) and head[j] in _SPACE and _skip_space(head, j) < len(head)


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
    if ext == "html" or looks_like_html(head[:4096]):
        return "html"
    if ext == "markdown" or (ext is None and _looks_like_markdown(head[:256])):
        return "markdown"
    return "text"
