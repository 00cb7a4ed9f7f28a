"""ZIP members (EPUB, DOCX) read as bounded streams and parsed as XML by expat, a chunk at a time.

Nothing a container claims is trusted: every member is inflated through a counter that refuses it
once it passes :data:`MAX_MEMBER_BYTES` or :data:`MAX_RATIO` times the compressed bytes it has consumed so
far, and the whole container once :data:`MAX_BOOK_BYTES` are inflated or :data:`MAX_RATIO` times the file's
size. Before a reader hands out its first part, :meth:`Container.prescan` inflates every member it will
read (counted, discarded: nothing parsed, nothing tokenized), so a bomb anywhere in the book is refused
when the document is opened, before the model reads a token of it. The XML
is fed to expat :data:`CHUNK_BYTES` at a time and handed to callbacks as it is parsed, so a chapter or a
paragraph is never held whole; expat buffers an unfinished tag, which may not exceed
:data:`MAX_TAG_BYTES`. Member names read from the container are confined to it.
"""

from __future__ import annotations

import os
import posixpath
import pyexpat
import re
import zipfile
from collections.abc import Callable
from html.entities import html5
from typing import Any, BinaryIO

from kvtool.errors import KvtoolError, UsageError

CHUNK_BYTES = 64 * 1024
#: one member (chapter, ``document.xml``) inflated: at most this many bytes
MAX_MEMBER_BYTES = 256 * 1024 * 1024
#: one container (all members read) inflated: at most this many bytes
MAX_BOOK_BYTES = 1024 * 1024 * 1024
#: inflated / compressed, per member and per container, once past :data:`RATIO_FLOOR_BYTES`: prose compresses
#: about 3x and XHTML or WordprocessingML about 5-10x; one sentence repeated, about 1,000x
MAX_RATIO = 100
#: below this many inflated bytes the ratio is not checked (a small, repetitive member is no bomb); above it, a
#: member or a book of one repeated sentence is refused (256 KiB of text: ~60K tokens at most from a tiny file)
RATIO_FLOOR_BYTES = 256 * 1024
#: metadata members parsed whole (``container.xml``, the OPF package, ``encryption.xml``)
MAX_META_BYTES = 16 * 1024 * 1024
#: the longest unfinished XML token (a tag with its attributes) expat may buffer
MAX_TAG_BYTES = 16 * 1024 * 1024
#: the most entries a container's directory may list
MAX_ENTRIES = 100_000
#: expat from 2.4.1 on limits entity amplification ("billion laughs"); older ones are refused
MIN_EXPAT = (2, 4, 1)


def check_expat() -> None:
    """Refuse (exit 1) an expat library older than :data:`MIN_EXPAT`: it would expand entity bombs."""
    version = pyexpat.version_info
    if tuple(version) < MIN_EXPAT:
        have = ".".join(map(str, version))
        raise KvtoolError(f"this Python's expat XML library is {have}, older than 2.4.1, which does not limit entity "
                          "expansion; kvtool refuses to read EPUB or DOCX with it (upgrade Python)")


def _size(source: str | BinaryIO) -> int:
    """The container's size in bytes (a path or a seekable stream)."""
    if isinstance(source, str):
        return os.path.getsize(source)
    at = source.tell()
    end = source.seek(0, os.SEEK_END)
    source.seek(at)
    return end


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n / 1024:,.0f} KiB"


class Container:
    """A ZIP file opened for reading with caps on everything inflated from it."""

    def __init__(self, source: str | BinaryIO, name: str, kind: str) -> None:
        check_expat()
        self.name, self.kind, self.size = name, kind, max(1, _size(source))
        self.inflated = 0
        self._stream = None if isinstance(source, str) else source  # a stream handed over is ours to close
        try:
            self.zip = zipfile.ZipFile(source)
            infos = self.zip.infolist()
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
            if self._stream is not None:
                self._stream.close()
            raise UsageError(f"{name} is not a valid {kind} (corrupt ZIP: {e})") from None
        if len(infos) > MAX_ENTRIES:
            self.close()
            raise UsageError(f"{name} lists {len(infos):,} files; a {kind} of at most {MAX_ENTRIES:,} is read")
        self.names = {i.filename for i in infos}

    def close(self) -> None:
        """Close the ZIP and the stream it was given (a spooled stdin), if any."""
        self.zip.close()
        if self._stream is not None:
            self._stream.close()

    def corrupt(self, what: str) -> UsageError:
        return UsageError(f"{self.name} is not a valid {self.kind} (corrupt: {what})")

    def confined(self, path: str) -> str:
        """``path`` (read from the container) as a member name: relative, inside the container, present."""
        norm = posixpath.normpath(path)
        if "\0" in path or path.startswith("/") or norm == ".." or norm.startswith("../") or "\\" in path:
            raise self.corrupt(f"{path!r:.80} points outside the {self.kind}")
        if norm not in self.names:
            raise self.corrupt(f"{norm!r:.80} is missing")
        return norm

    def open(self, member: str, cap: int | None = None) -> _Member:
        """A stream over one member, refused as it is read once a cap (default :data:`MAX_MEMBER_BYTES`) is passed."""
        try:
            info = self.zip.getinfo(member)
            return _Member(self, member, self.zip.open(info), max(1, info.compress_size), cap or MAX_MEMBER_BYTES)
        except KeyError:
            raise self.corrupt(f"{member!r:.80} is missing") from None
        except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError, RuntimeError) as e:
            raise self.corrupt(f"{member!r:.80}: {e}") from None

    def prescan(self, members: list[str]) -> None:
        """Inflate ``members`` (in the order a reader will read them, repeats included) through every cap, and
        discard the bytes: a decompression bomb anywhere in them is refused now, before the first part is
        handed out and the model reads a token of it. Linear, bounded by the caps (at most
        :data:`MAX_BOOK_BYTES` inflated); the read that follows counts its bytes again, from where the
        metadata left the container's count, so a member changed since is still held to the caps."""
        before = self.inflated
        for member in members:
            with self.open(member) as f:
                while f.read():
                    pass
        self.inflated = before

    def read(self, member: str) -> bytes:
        """A small member whole (metadata), within :data:`MAX_META_BYTES` and the container's caps."""
        out = bytearray()
        with self.open(member, MAX_META_BYTES) as f:
            while chunk := f.read(CHUNK_BYTES):
                out += chunk
        return bytes(out)


class _Member:
    """A member's inflated bytes, counted against its caps and the container's."""

    def __init__(self, box: Container, member: str, raw: Any, compressed: int, cap: int) -> None:
        self.box, self.member, self.raw, self.compressed, self.cap = box, member, raw, compressed, cap
        self.read_bytes = 0

    def consumed(self) -> int:
        """Compressed bytes the decompressor has taken so far (at least 1).

        Compared with the bytes inflated so far, so that a bomb is refused within its first MiBs: against the
        member's whole compressed size, a 1.7 MB chapter of one repeated sentence passes 170 MB before the
        ratio cap trips. zipfile keeps the count in ``_compress_left`` (the file bytes not read yet) and the
        decompressor's ``unconsumed_tail`` (read, not yet inflated); without them, the whole size is used.
        """
        left = getattr(self.raw, "_compress_left", None)
        if not isinstance(left, int):
            return self.compressed
        tail = getattr(getattr(self.raw, "_decompressor", None), "unconsumed_tail", b"")
        return max(1, self.compressed - left - len(tail if isinstance(tail, bytes) else b""))

    def __enter__(self) -> _Member:
        return self

    def __exit__(self, *exc: object) -> None:
        self.raw.close()

    def read(self, n: int = CHUNK_BYTES) -> bytes:
        box = self.box
        try:
            data = self.raw.read(min(n, CHUNK_BYTES))
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
            raise box.corrupt(f"{self.member!r:.80}: {e}") from None
        self.read_bytes += len(data)
        box.inflated += len(data)
        what = f"{box.name}: {self.member!r:.80} inflates to"
        if self.read_bytes > self.cap:
            raise UsageError(f"{what} more than {_mib(self.cap)} (the cap for one {box.kind} member); refused")
        if self.read_bytes > RATIO_FLOOR_BYTES and self.read_bytes > MAX_RATIO * self.consumed():
            consumed = self.consumed()
            raise UsageError(f"{what} more than {self.read_bytes // consumed:,} times the compressed bytes read so "
                             f"far ({_mib(self.read_bytes)} from {_mib(consumed)}; the cap is {MAX_RATIO}x): a "
                             "decompression bomb? refused")
        if box.inflated > MAX_BOOK_BYTES:
            raise UsageError(f"{box.name} inflates to more than {_mib(MAX_BOOK_BYTES)} (the cap for one "
                             f"{box.kind}); refused")
        if box.inflated > RATIO_FLOOR_BYTES and box.inflated > MAX_RATIO * box.size:
            raise UsageError(f"{box.name} inflates to more than {MAX_RATIO} times its size of {_mib(box.size)} "
                             "(a decompression bomb?); refused")
        return data


#: the encoding an XML declaration names (first KiB only; a bounded name: linear)
_DECLARED = re.compile(rb"<\?xml[^>]{0,200}?encoding\s*=\s*[\"']([A-Za-z0-9._:-]{1,40})")


def declared_encoding(head: bytes) -> str | None:
    """The ``encoding="..."`` of an XML declaration at the start of ``head``, if any."""
    m = _DECLARED.match(head[:1024].lstrip())
    return m.group(1).decode("ascii") if m else None


def encoding_error(where: str, head: bytes, e: Exception) -> UsageError:
    """One line for XML whose declared encoding Python does not know, or expat cannot decode with."""
    name = declared_encoding(head)
    what = f"encoding {name!r}" if name else f"an encoding kvtool cannot read ({str(e)[:60]})"
    return UsageError(f"{where} is declared in {what}, which kvtool cannot decode (expat reads UTF-8, UTF-16 and "
                      "single-byte encodings Python knows); save it as UTF-8")


def parse_whole(data: bytes, member: str, box: Container) -> Any:
    """A small XML member (EPUB metadata) parsed whole with ElementTree; every failure is one line."""
    import xml.etree.ElementTree as ET

    try:
        return ET.fromstring(data)
    except ET.ParseError as e:
        raise box.corrupt(f"{member}: {e}") from None
    except (LookupError, UnicodeError, ValueError) as e:
        raise encoding_error(f"{box.name}: {member!r:.80}", data, e) from None


class XmlFeed:
    """An expat parser with callbacks, fed a member's stream a chunk at a time.

    Element names are ``uri}local`` (namespaces resolved). ``entities`` (XHTML): a document may use
    HTML's named entities (``&nbsp;``) without declaring them; they are resolved from the HTML5 table.
    """

    def __init__(self, start: Callable[[str, dict[str, str]], None], end: Callable[[str], None],
                 data: Callable[[str], None], entities: bool = False) -> None:
        p = pyexpat.ParserCreate(namespace_separator="}")
        p.buffer_text = True
        self.last = self.fed = 0
        self.data = data

        def mark() -> None:
            self.last = max(self.last, p.CurrentByteIndex)

        def on_start(tag: str, attrs: dict[str, str]) -> None:
            mark()
            start(tag, attrs)

        def on_end(tag: str) -> None:
            mark()
            end(tag)

        def on_data(text: str) -> None:
            mark()
            data(text)

        p.StartElementHandler, p.EndElementHandler, p.CharacterDataHandler = on_start, on_end, on_data
        if entities:
            p.UseForeignDTD(True)
            p.SkippedEntityHandler = self._entity
        self.parser = p

    def _entity(self, name: str, is_parameter: bool) -> None:
        if not is_parameter:
            self.data(html5.get(name + ";", html5.get(name, "")))

    def feed(self, chunk: bytes, where: str, final: bool = False) -> None:
        """Parse one chunk (callbacks run now); an unfinished token past :data:`MAX_TAG_BYTES` is refused.

        An encoding the XML declares that Python does not know or expat cannot use is one ``UsageError``."""
        head = chunk if not self.fed else b""
        try:
            self.parser.Parse(chunk, final)
        except (LookupError, UnicodeError, ValueError) as e:
            raise encoding_error(where, head, e) from None
        self.fed += len(chunk)
        if self.fed - self.last > MAX_TAG_BYTES:
            raise UsageError(f"{where}: an XML tag longer than {_mib(MAX_TAG_BYTES)} (from byte {self.last:,}); "
                             "refused")
