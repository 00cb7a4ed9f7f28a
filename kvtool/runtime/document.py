"""Documents: validated, read in chunks and tokenized as a stream of token blocks.

The whole document is never held as tokens: text is read 64 KiB at a time, cut just before a
space (so BPE tokenization across the cut matches tokenizing the whole text), tokenized, and handed
out in blocks. The SHA-256 of the bytes is computed on the way (``.kvc`` metadata).
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
from typing import TYPE_CHECKING, BinaryIO

from kvtool.errors import UsageError

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
    _hash: object = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return "<stdin>" if self.path == "-" else self.path


def open_document(path: str, notify: Callable[[str], None] | None = None) -> Document:
    """Open and sanity-check a document; bad input is a one-line ``UsageError``.

    A FIFO, character device or socket is read like ``-`` (size unknown); opening one may wait for a
    writer, so ``notify`` (a note on stderr) is told "waiting for input on FILE" first: a silent hang
    would look like a bug, and Ctrl-C interrupts the wait like any other.
    """
    if path == "-":
        stream: BinaryIO = sys.stdin.buffer
        size = None
    else:
        if not os.path.exists(path):
            raise UsageError(f"no such file: {path}")
        if os.path.isdir(path):
            raise UsageError(f"{path} is a directory, not a text file")
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
    if b"\x00" in head:
        raise UsageError(f"{name} looks binary (NUL bytes); kvtool reads UTF-8 text")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError as e:
        raise UsageError(f"{name} is not UTF-8 text (invalid byte at offset {e.start})") from None
    return Document(path=path, size=size, head=head, stream=stream)


def text_document(text: str, name: str = "<text>") -> Document:
    """A Document over an in-memory string (evaluation haystacks, tests): same reader, same checks."""
    data = text.encode("utf-8")
    stream = io.BytesIO(data)
    return Document(path=name, size=len(data), head=stream.read(SNIFF_BYTES), stream=stream)


def iter_text(doc: Document, chunk_bytes: int = CHUNK_BYTES) -> Iterator[str]:
    """Yield decoded text pieces, each ending just before a space (except the last)."""
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
            cut = pending.rfind(" ", 0, len(pending))
            if cut > 0:
                yield pending[:cut]
                pending = pending[cut:]
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


def iter_token_blocks(doc: Document, tokenizer, block_size: int) -> Iterator[Tensor]:
    """Token blocks of exactly ``block_size`` (the last may be shorter), streamed from the text."""
    import torch

    buf: list[int] = []
    for text in iter_text(doc):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
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


def estimate_tokens(doc: Document) -> int | None:
    """Expected token count from the bytes read so far (files only); refined as reading proceeds."""
    if doc.size is None:
        return None
    if doc.tokenized_tokens and doc.tokenized_bytes:
        return max(doc.tokens, int(doc.size * doc.tokenized_tokens / doc.tokenized_bytes))
    return max(1, doc.size // 4)
