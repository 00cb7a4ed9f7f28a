"""Readers for the documents people have: PDF, EPUB, HTML, Markdown, DOCX and plain text.

Every reader turns a file into a stream of :class:`Part` — a page (PDF), a chapter (EPUB) or a section
(HTML, DOCX, Markdown headings), each at most 64K characters — extracted one at a time, so the consumer
works on a part while the next one is still in the file and memory stays flat however long the document
is. Concatenated, the parts' texts are the *extracted text* of the document; character offsets
(citations) are offsets into it. Caps, formats and exit codes: docs/documents.md.

The lowest layer of kvtool: it imports nothing of kvtool but :mod:`kvtool.errors`, and never torch.
The extraction libraries are the optional extra ``kvtool[documents]`` (pypdf, trafilatura).
"""

from kvtool.documents.base import PART_CHARS, Part, Reader, require
from kvtool.documents.detect import FORMATS, detect_format
from kvtool.documents.source import (
    SNIFF_BYTES,
    Document,
    extract_text,
    iter_parts,
    iter_text,
    open_document,
    read_lines,
    text_document,
)

__all__ = [
    "FORMATS", "PART_CHARS", "SNIFF_BYTES", "Document", "Part", "Reader", "detect_format", "extract_text",
    "iter_parts", "iter_text", "open_document", "read_lines", "require", "text_document",
]
