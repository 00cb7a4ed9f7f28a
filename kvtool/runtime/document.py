"""Documents: validated, read in parts and tokenized as a stream of token blocks.

The whole document is never held as tokens: its format's reader (:mod:`kvtool.runtime.documents`) hands
out parts — pages, chapters, sections, or for plain text 64 KiB pieces cut just before a space (so BPE
tokenization across the cut matches tokenizing the whole text) — which are tokenized as the prefill
reaches them and handed out in blocks. Each token's character span in the extracted text can be
recorded on the way (a :class:`~kvtool.runtime.citations.SourceMap`, for citations). The SHA-256 of the
file's bytes is computed on the way (``.kvc`` metadata).
"""

from __future__ import annotations

import codecs
import hashlib
import io
import os
import stat
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO

from kvtool.errors import UsageError
from kvtool.runtime.documents import Part, Reader, detect_format

if TYPE_CHECKING:
    from kvtool.runtime.citations import SourceMap

if TYPE_CHECKING:  # torch is imported where tokens are made: a bad path fails before torch loads (~10 s)
    from torch import Tensor

CHUNK_BYTES = 64 * 1024
SNIFF_BYTES = 8192


@dataclass
class Document:
    """A validated text source (a file path or ``-`` for stdin)."""

    path: str
    size: int | None  # bytes, when known (files)
    head: bytes  # first bytes, already read (stdin cannot be rewound)
    stream: BinaryIO
    sha256: str = ""
    bytes_read: int = 0
    tokens: int = 0  # tokens handed out so far
    tokenized_bytes: int = 0  # bytes and tokens of the text tokenized so far (for the length estimate)
    tokenized_tokens: int = 0
    fmt: str = "text"  # text | markdown | html | pdf | epub | docx
    reader: Any = field(default=None, repr=False)  # the format's Reader (kvtool.runtime.documents)
    parts_done: int = 0  # pages / chapters / sections started so far
    chars: int = 0  # characters of extracted text handed out so far
    _hash: object = field(default=None, repr=False)

    @property
    def unit(self) -> str:
        return self.reader.unit if self.reader is not None else "section"

    @property
    def parts_total(self) -> int | None:
        return self.reader.total if self.reader is not None else None

    @property
    def notes(self) -> list[str]:
        return list(self.reader.notes) if self.reader is not None else []

    @property
    def name(self) -> str:
        return "<stdin>" if self.path == "-" else self.path


def open_document(path: str, fmt: str | None = None, notify: Callable[[str], None] | None = None) -> Document:
    """Open and sanity-check a document of any supported format; bad input is a one-line ``UsageError``.

    ``fmt`` (``--format``) overrides detection from the content and the extension. Formats other than
    text and Markdown are checked by their reader here (encryption, text layer, DRM, damage), before
    any model is loaded. A FIFO, character device or socket is read like ``-`` (size unknown); opening
    one may wait for a writer, so ``notify`` (a note on stderr) is told "waiting for input on FILE"
    first: a silent hang would look like a bug, and Ctrl-C interrupts the wait like any other.
    """
    if path == "-":
        stream: BinaryIO = sys.stdin.buffer
        size = None
    else:
        if not os.path.exists(path):
            raise UsageError(f"no such file: {path}")
        if os.path.isdir(path):
            raise UsageError(f"{path} is a directory, not a document")
        try:
            regular = stat.S_ISREG(os.stat(path).st_mode)
        except OSError as e:
            raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
        if not regular and notify is not None:
            notify(f"waiting for input on {path} (not a regular file; Ctrl-C to stop)")
        try:
            stream = open(path, "rb")  # noqa: SIM115 - closed by the reader
        except OSError as e:
            raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
        size = os.path.getsize(path) if regular else None
    try:
        head = stream.read(SNIFF_BYTES)
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    name = "<stdin>" if path == "-" else path
    if not head.strip():
        raise UsageError(f"{name} is empty")
    kind = detect_format(head, name, fmt)
    doc = Document(path=path, size=size, head=head, stream=stream, fmt=kind)
    if kind in ("text", "markdown"):
        if b"\x00" in head:
            raise UsageError(f"{name} looks binary (NUL bytes); kvtool reads text, Markdown, HTML, PDF, EPUB and "
                             "DOCX (see --format)")
        try:
            codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
        except UnicodeDecodeError as e:
            raise UsageError(f"{name} is not UTF-8 text (invalid byte at offset {e.start})") from None
        doc.reader = _text_reader(doc)
    else:
        doc.reader = _binary_reader(doc)
    return doc


def _text_reader(doc: Document) -> Reader:
    from kvtool.runtime.documents.markdown import MarkdownReaderParts
    from kvtool.runtime.documents.text import TextReaderParts

    if doc.fmt == "markdown":
        return MarkdownReaderParts(iter_text(doc, cut="\n"))
    return TextReaderParts(iter_text(doc))


def _binary_reader(doc: Document) -> Reader:
    """PDF, EPUB, DOCX and HTML readers over the file (hashed first) or stdin (read into memory)."""
    from kvtool.runtime.documents.docx import DocxReaderParts
    from kvtool.runtime.documents.epub import EpubReaderParts
    from kvtool.runtime.documents.html import HtmlReaderParts
    from kvtool.runtime.documents.pdf import PdfReaderParts

    digest = hashlib.sha256(doc.head)
    if doc.path == "-":
        data = doc.head + doc.stream.read()
        digest.update(data[len(doc.head):])
        source: Any = io.BytesIO(data)
    else:
        while chunk := doc.stream.read(CHUNK_BYTES):
            digest.update(chunk)
        doc.stream.close()
        source = doc.path
    doc.sha256 = digest.hexdigest()
    doc.bytes_read = doc.size or 0
    if doc.fmt == "html":
        stream = source if not isinstance(source, str) else open(source, "rb")  # noqa: SIM115
        try:
            return HtmlReaderParts(stream, b"", doc.name)
        finally:
            stream.close()
    return {"pdf": PdfReaderParts, "epub": EpubReaderParts, "docx": DocxReaderParts}[doc.fmt](source, doc.name)


def text_document(text: str, name: str = "<text>") -> Document:
    """A Document over an in-memory string (evaluation haystacks, tests): same reader, same checks."""
    data = text.encode("utf-8")
    stream = io.BytesIO(data)
    doc = Document(path=name, size=len(data), head=stream.read(SNIFF_BYTES), stream=stream)
    doc.reader = _text_reader(doc)
    return doc


def iter_text(doc: Document, chunk_bytes: int = CHUNK_BYTES, cut: str = " ") -> Iterator[str]:
    """Yield decoded text pieces, each ending just before a ``cut`` character (except the last)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    digest = hashlib.sha256()
    pending = ""
    offset = 0
    data = doc.head
    try:
        while data:
            digest.update(data)
            try:
                pending += decoder.decode(data, final=False)
            except UnicodeDecodeError as e:
                at = offset + e.start
                raise UsageError(f"{doc.name} is not UTF-8 text (invalid byte near offset {at})") from None
            offset += len(data)
            doc.bytes_read = offset
            at = pending.rfind(cut, 0, len(pending))
            if at <= 0 and cut != " ":
                at = pending.rfind(" ", 0, len(pending))
            if at > 0:
                yield pending[:at]
                pending = pending[at:]
            data = doc.stream.read(chunk_bytes)
        try:
            pending += decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise UsageError(f"{doc.name} is not UTF-8 text (truncated character at the end)") from None
        if pending:
            yield pending
    finally:
        if doc.stream is not sys.stdin.buffer:
            doc.stream.close()
    doc.sha256 = digest.hexdigest()


def iter_parts(doc: Document) -> Iterator[Part]:
    """The document's parts in order, counted as they are read (progress shows pages or chapters)."""
    reader = doc.reader if doc.reader is not None else _text_reader(doc)
    doc.reader = reader
    for part in reader.parts():
        if part.new_unit:
            doc.parts_done += 1
        yield part


def iter_token_blocks(doc: Document, tokenizer, block_size: int, source: SourceMap | None = None) -> Iterator[Tensor]:
    """Token blocks of exactly ``block_size`` (the last may be shorter), streamed from the parts.

    With ``source``, each token's character span in the extracted text and its part (page, chapter,
    section) are recorded as the token is handed out.
    """
    import torch

    buf: list[int] = []
    for part in iter_parts(doc):
        for text in _pieces(part.text):
            if source is not None:
                ids, spans = _tokenize_spans(tokenizer, text, doc.chars)
                source.add_section(doc.chars, part.page, part.chapter, part.title)
                source.add(ids, spans)
            else:
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            doc.chars += len(text)
            doc.tokenized_bytes += len(text.encode("utf-8"))
            doc.tokenized_tokens += len(ids)
            buf.extend(ids)
            while len(buf) >= block_size:
                block, buf = buf[:block_size], buf[block_size:]
                doc.tokens += len(block)
                yield torch.tensor(block, dtype=torch.long)
    if buf:
        doc.tokens += len(buf)
        yield torch.tensor(buf, dtype=torch.long)


def _pieces(text: str, size: int = CHUNK_BYTES) -> Iterator[str]:
    """A long part (a whole chapter) in pieces of about ``size`` characters, cut before a space."""
    while len(text) > size:
        at = text.rfind(" ", 0, size)
        if at <= 0:
            at = size
        yield text[:at]
        text = text[at:]
    if text:
        yield text


def _tokenize_spans(tokenizer, text: str, base: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and each token's (start, end) character span, offset by ``base``.

    Fast tokenizers give exact offsets; otherwise spans come from the lengths of decoded prefixes.
    """
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [(base + int(a), base + int(b)) for a, b in enc["offset_mapping"]]
    except (NotImplementedError, ValueError, TypeError, KeyError):
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        spans, at = [], 0
        for i in ids:  # approximate: each token's own decoded length
            end = min(len(text), at + len(tokenizer.decode([i])))
            spans.append((base + at, base + end))
            at = end
        return ids, spans


def extract_text(path: str, max_chars: int, fmt: str | None = None) -> str:
    """The extracted text of a document of any format, at most ``max_chars`` characters (evaluation inputs)."""
    doc = open_document(path, fmt)
    out: list[str] = []
    have = 0
    for part in iter_parts(doc):
        out.append(part.text[: max_chars - have])
        have += len(out[-1])
        if have >= max_chars:
            break
    return "".join(out)


def estimate_tokens(doc: Document) -> int | None:
    """Expected token count from the bytes read so far (files only); refined as reading proceeds."""
    total = doc.parts_total
    if doc.fmt not in ("text", "markdown"):
        if total and doc.parts_done:  # pages or chapters: tokens per part so far × parts
            return max(doc.tokens, int(doc.tokenized_tokens * total / doc.parts_done))
        return None
    if doc.size is None:
        return None
    if doc.tokenized_tokens and doc.tokenized_bytes:
        return max(doc.tokens, int(doc.size * doc.tokenized_tokens / doc.tokenized_bytes))
    return max(1, doc.size // 4)
