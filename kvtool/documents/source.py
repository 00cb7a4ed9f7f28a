"""Documents: validated, then read as a stream of parts (pages, chapters, sections, text pieces).

The whole document is never held: its format's reader hands out parts of at most
:data:`~kvtool.documents.base.PART_CHARS` characters as the consumer reaches them. Plain text and
Markdown are decoded as a stream and cut before a space (so BPE tokenization across the cut matches
tokenizing the whole text), else at another safe boundary found by a bounded look-back. The SHA-256 of
the file's bytes is computed on the way (``.kvc`` metadata). Tokenization lives in the runtime.
"""

from __future__ import annotations

import codecs
import hashlib
import io
import os
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from kvtool.documents.base import PART_CHARS, Part, Reader, cut_point
from kvtool.documents.detect import detect_format
from kvtool.errors import UsageError, short_path

CHUNK_BYTES = 64 * 1024
SNIFF_BYTES = 8192
#: stdin holding a PDF, EPUB or DOCX is spooled to an unlinked temporary file beyond this many bytes
SPOOL_BYTES = 8 * 1024 * 1024
#: a questions file: at most this many bytes and non-empty lines
MAX_QUESTIONS_BYTES = 1024 * 1024
MAX_QUESTION_LINES = 10_000
#: whitespace read ahead from a stream that starts blank, to tell an empty one from a document (held for the reader)
MAX_BLANK_HEAD = 16 * 1024 * 1024


@dataclass
class Document:
    """A validated text source (a file path or ``-`` for stdin) and how far it has been read."""

    path: str
    size: int | None  # bytes, when known (files)
    head: bytes  # first bytes, already read (stdin cannot be rewound)
    stream: BinaryIO
    sha256: str = ""
    bytes_read: int = 0
    fmt: str = "text"  # text | markdown | html | pdf | epub | docx
    reader: Any = field(default=None, repr=False)  # the format's Reader
    parts_done: int = 0  # pages / chapters / sections started so far
    fraction: float | None = None  # share of the source consumed through the last part handed out
    consumed: int = 0  # bytes of plain text handed out so far (text and Markdown)
    tokens: int = 0  # counted by the consumer that tokenizes the parts (kvtool.runtime.document)
    tokenized_tokens: int = 0
    chars: int = 0  # characters of extracted text handed out so far

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

    parts_iter: Any = field(default=None, repr=False)  # the running ``iter_parts`` generator, closed with the document

    def close(self) -> None:
        """Close what the document holds open, now: a read abandoned partway (an error, Ctrl-C) or never
        started (bad settings after the file was opened) releases its file here, not when it is collected.
        Safe to call twice; stdin itself stays open."""
        for closing in (self.parts_iter, self.reader):
            close = getattr(closing, "close", None)
            if close is not None:
                close()
        self.parts_iter = None
        if self.stream is not sys.stdin.buffer and not self.stream.closed:
            self.stream.close()

    def __enter__(self) -> Document:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _binary_error(name: str, offset: int) -> UsageError:
    return UsageError(f"{name} looks binary (NUL byte at offset {offset}); kvtool reads text, Markdown, HTML, PDF, "
                      "EPUB and DOCX (see --format)")


#: what a file that is not a regular one is, in a message
_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _open(path: str, notify: Callable[[str], None] | None, regular_only: bool = False) -> tuple[BinaryIO, int | None]:
    if path == "-":
        return sys.stdin.buffer, None
    shown = short_path(path)
    if not os.path.exists(path):
        raise UsageError(f"no such file: {shown}")
    if os.path.isdir(path):
        raise UsageError(f"{shown} is a directory, not a document")
    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)
    except OSError as e:
        raise UsageError(f"cannot read {shown}: {e.strerror or e}") from None
    if regular or regular_only:
        return _open_regular(path, shown, regular_only)
    if notify is not None:
        notify(f"waiting for input on {shown} (not a regular file; Ctrl-C to stop)")
    try:
        stream = open(path, "rb")  # noqa: SIM115 - closed by the reader
    except OSError as e:
        raise UsageError(f"cannot read {shown}: {e.strerror or e}") from None
    return stream, None


def _open_regular(path: str, shown: str, many: bool) -> tuple[BinaryIO, int]:
    """``path`` opened without waiting (``O_NONBLOCK``: a FIFO opens at once, with or without a writer) and
    kept only if the open file is a regular one (``fstat``, not the name's earlier ``stat``: it may have
    been replaced since). Symbolic links are followed, as they were when the file was listed."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise UsageError(f"cannot read {shown}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            why = ("; a run over many documents reads regular files only (one that waits for a writer would stall "
                   "every document after it)") if many else " (it was replaced while it was opened)"
            raise UsageError(f"{shown} is {_kind(st.st_mode)}, not a regular file{why}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), st.st_size
    except BaseException:
        os.close(fd)
        raise


def open_document(path: str, fmt: str | None = None, notify: Callable[[str], None] | None = None,
                  regular_only: bool = False) -> Document:
    """Open and sanity-check a document of any supported format; bad input is a one-line ``UsageError``.

    ``fmt`` (``--format``) overrides detection from the content and the extension. Formats other than
    text and Markdown are checked by their reader here (encryption, text layer, DRM, damage), before
    any model is loaded. A FIFO, character device or socket is read like ``-`` (size unknown); opening
    one may wait for a writer, so ``notify`` (a note on stderr) is told "waiting for input on FILE"
    first: a silent hang would look like a bug, and Ctrl-C interrupts the wait like any other.
    ``regular_only`` (each document of a many-document run) refuses anything but a regular file instead,
    at once and without waiting, whatever the file was when it was listed.
    """
    stream, size = _open(path, notify, regular_only)
    try:
        return _check(path, fmt, stream, size)
    except BaseException:  # a refused document closes its file now, not when it is collected
        if stream is not sys.stdin.buffer:
            stream.close()
        raise


def _check(path: str, fmt: str | None, stream: BinaryIO, size: int | None) -> Document:
    """``open_document`` once the file is open: sniff, detect, and hand the document to its reader."""
    try:
        head = stream.read(SNIFF_BYTES)
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    name = "<stdin>" if path == "-" else path
    if not head.strip() and len(head) < SNIFF_BYTES:
        raise UsageError(f"{name} is empty")
    kind = detect_format(head, name, fmt)
    doc = Document(path=path, size=size, head=head, stream=stream, fmt=kind)
    if kind in ("text", "markdown"):
        if b"\x00" in head:
            raise _binary_error(name, head.index(0))
        decoder = codecs.getincrementaldecoder("utf-8")()
        try:
            first = decoder.decode(head, final=False)
        except UnicodeDecodeError as e:
            raise UsageError(f"{name} is not UTF-8 text (invalid byte at offset {e.start})") from None
        if _blank(first):
            if len(head) < SNIFF_BYTES or _blank_to_the_end(doc, decoder):
                raise UsageError(f"{name} is empty")
        doc.reader = _text_reader(doc)
    else:
        doc.reader = _binary_reader(doc)
    return doc


def _blank_to_the_end(doc: Document, decoder: codecs.IncrementalDecoder) -> bool:
    """Whether a text document whose first bytes are blank holds nothing but whitespace: found up front, so
    that an empty file is refused before a model loads, not after its whitespace was read through it.

    A regular file is scanned with ``pread`` (nothing held; the read position does not move) until its
    first non-blank character. A stream (stdin, a FIFO) cannot be rewound: its leading whitespace is kept
    in ``doc.head`` for the reader, at most :data:`MAX_BLANK_HEAD` bytes of it. A NUL or an invalid byte
    ends the scan (not blank: the reader reports it where it is).
    """
    fd = _regular_fd(doc.stream)
    offset = len(doc.head)
    while True:
        try:
            chunk = os.pread(fd, CHUNK_BYTES, offset) if fd is not None else doc.stream.read(CHUNK_BYTES)
        except OSError as e:
            raise UsageError(f"cannot read {doc.name}: {e.strerror or e}") from None
        if fd is None:
            doc.head += chunk
        offset += len(chunk)
        if b"\x00" in chunk:
            return False
        try:
            text = decoder.decode(chunk, final=not chunk)
        except UnicodeDecodeError:
            return False
        if not _blank(text):
            return False
        if not chunk:
            return True
        if fd is None and len(doc.head) > MAX_BLANK_HEAD:
            raise UsageError(f"{doc.name} starts with more than {MAX_BLANK_HEAD >> 20} MiB of whitespace; "
                             "refused (is it empty?)")


def _regular_fd(stream: BinaryIO) -> int | None:
    """The descriptor of ``stream`` when it is a regular file (``pread`` works), else None."""
    try:
        fd = stream.fileno()
        return fd if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except (OSError, ValueError, AttributeError):
        return None


def _blank(text: str) -> bool:
    """Whether decoded text holds nothing but (Unicode) whitespace and byte-order marks."""
    return not text.replace("\ufeff", "").strip()


def _text_reader(doc: Document) -> Reader:
    from kvtool.documents.markdown import MarkdownReaderParts
    from kvtool.documents.text import TextReaderParts

    def progress() -> float | None:
        return min(1.0, doc.consumed / doc.size) if doc.size else None

    if doc.fmt == "markdown":
        return MarkdownReaderParts(iter_text(doc, cut="\n"), progress)
    return TextReaderParts(iter_text(doc), progress)


def _binary_reader(doc: Document) -> Reader:
    """PDF, EPUB, DOCX and HTML readers over the file (hashed first) or stdin (spooled, hashed on the way)."""
    from kvtool.documents.docx import DocxReaderParts
    from kvtool.documents.epub import EpubReaderParts
    from kvtool.documents.html import HtmlReaderParts
    from kvtool.documents.pdf import PdfReaderParts

    digest = hashlib.sha256(doc.head)
    if doc.path == "-":
        source: Any = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)  # noqa: SIM115 - closed by the reader
        source.write(doc.head)
        while chunk := doc.stream.read(CHUNK_BYTES):
            digest.update(chunk)
            source.write(chunk)
        doc.size = source.tell()
        source.seek(0)
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
    """Decoded text in pieces of at most ``PART_CHARS`` characters, each cut by :func:`cut_point`.

    Every byte is checked as it is read: a NUL anywhere is "looks binary" (exit 2) at that point, and a
    stream of nothing but whitespace is "empty" (exit 2) once its end is reached. Linear in the input,
    with at most one piece and one chunk held.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    digest = hashlib.sha256()
    pending = ""
    offset = 0
    blank = True
    data = doc.head
    try:
        while True:
            final = not data
            if b"\x00" in data:
                raise _binary_error(doc.name, offset + data.index(0))
            digest.update(data)
            try:
                pending += decoder.decode(data, final=final)
            except UnicodeDecodeError as e:
                where = "truncated character at the end" if final else f"invalid byte near offset {offset + e.start}"
                raise UsageError(f"{doc.name} is not UTF-8 text ({where})") from None
            offset += len(data)
            doc.bytes_read = offset
            while len(pending) > PART_CHARS or (final and pending):
                at = len(pending) if len(pending) <= PART_CHARS else cut_point(pending, PART_CHARS, cut)
                piece, pending = pending[:at], pending[at:]
                blank = blank and _blank(piece)
                doc.consumed += len(piece.encode("utf-8"))
                yield piece
            if final:
                break
            data = doc.stream.read(chunk_bytes)
        if blank:
            raise UsageError(f"{doc.name} is empty")
    finally:
        if doc.stream is not sys.stdin.buffer:
            doc.stream.close()
    doc.sha256 = digest.hexdigest()


def iter_parts(doc: Document) -> Iterator[Part]:
    """The document's parts in order, counted as they are read (progress shows pages or chapters).

    ``doc.close()`` ends the iteration where it stands and closes the reader's files."""
    gen = _parts(doc)
    doc.parts_iter = gen
    return gen


def _parts(doc: Document) -> Iterator[Part]:
    reader = doc.reader if doc.reader is not None else _text_reader(doc)
    doc.reader = reader
    parts = reader.parts()
    try:
        for part in parts:
            if part.new_unit:
                doc.parts_done += 1
            if part.fraction is not None:
                doc.fraction = part.fraction
            yield part
    finally:
        parts.close()


def extract_text(path: str, max_chars: int, fmt: str | None = None) -> str:
    """The extracted text of a document of any format, at most ``max_chars`` characters (evaluation inputs)."""
    out: list[str] = []
    have = 0
    with open_document(path, fmt) as doc:  # closed when enough text is in, mid-document
        for part in iter_parts(doc):
            out.append(part.text[: max_chars - have])
            have += len(out[-1])
            if have >= max_chars:
                break
    return "".join(out)


def read_lines(path: Path, what: str, max_bytes: int = MAX_QUESTIONS_BYTES,
               max_lines: int = MAX_QUESTION_LINES, notify: Callable[[str], None] | None = None) -> list[str]:
    """The non-empty lines of a small UTF-8 file (a questions file), stripped; bounded whatever the file is.

    At most ``max_bytes`` are read (``/dev/zero`` or a huge file is refused, not read to the end) and at
    most ``max_lines`` lines are kept; beyond either, a one-line ``UsageError`` names ``what`` and the cap.
    A FIFO (or another non-regular file) may wait for a writer when opened: ``notify`` is told so first,
    as for a document, so a wait never looks like a hang.
    """
    try:
        if notify is not None and os.path.exists(path) and not os.path.isfile(path):
            notify(f"waiting for input on {what} {path} (not a regular file; Ctrl-C to stop)")
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise UsageError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise UsageError(f"{what} {path} is larger than {max_bytes // 1024} KiB; give at most {max_lines:,} "
                         "questions, one per line")
    if b"\x00" in data:
        raise UsageError(f"{what} {path} looks binary (NUL byte at offset {data.index(0)}); give one question per line")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"cannot read {what} {path}: not UTF-8 (invalid byte at offset {e.start})") from None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if len(lines) > max_lines:
        raise UsageError(f"{what} {path} has {len(lines):,} questions; at most {max_lines:,}")
    return lines
