"""EPUB chapters with the standard library (zipfile + expat): the spine's XHTML files in reading order.

ebooklib, the usual EPUB library, is AGPL-licensed, which kvtool does not depend on; an EPUB is a ZIP of
XHTML files listed by an OPF package, which the standard library reads in a few milliseconds per book.
DRM (Adobe ADEPT ``rights.xml``, or content listed in ``encryption.xml`` with a cipher other than font
obfuscation) is refused when the book is opened. Chapters are inflated and parsed a chunk at a time
(:mod:`kvtool.documents.zipxml`: caps on sizes and compression ratios) and their text handed out in
parts of at most 64K characters: a chapter is never held whole.
"""

from __future__ import annotations

import posixpath
import pyexpat
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from typing import BinaryIO
from urllib.parse import unquote

from kvtool.documents.base import Part, TextOut, title_of
from kvtool.documents.zipxml import Container, XmlFeed, parse_whole
from kvtool.errors import UsageError

_FONT_OBFUSCATION = ("http://www.idpf.org/2008/embedding", "http://ns.adobe.com/pdf/enc#RC")
_HTML_TYPES = ("application/xhtml+xml", "text/html")
_BLOCKS = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "pre", "section",
           "article", "table", "ul", "ol", "dd", "dt", "hr"}
_SKIP = {"script", "style", "head", "title", "svg", "nav"}
_HEADINGS = ("h1", "h2", "h3")


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


class _Chapter:
    """The text of one XHTML chapter as expat reports it: blocks on their own lines, the first heading."""

    def __init__(self) -> None:
        self.out = TextOut()
        self.skip = 0
        self.heading: str | None = None
        self._in_heading = False
        self._heading: list[str] = []
        self._heading_chars = 0

    def start(self, tag: str, attrs: dict[str, str]) -> None:
        local = _local(tag).lower()
        if local in _SKIP:
            self.skip += 1
        elif local in _BLOCKS:
            self.out.end_line()
        if local in _HEADINGS and self.heading is None:
            self._in_heading = True

    def end(self, tag: str) -> None:
        local = _local(tag).lower()
        if local in _SKIP:
            self.skip = max(0, self.skip - 1)
        elif local in _BLOCKS:
            self.out.end_line()
        if local in _HEADINGS and self._in_heading:
            self._in_heading = False
            self.heading = title_of("".join(self._heading))

    def data(self, text: str) -> None:
        if self.skip:
            return
        self.out.write(text)
        if self._in_heading and self._heading_chars < 1024:
            self._heading.append(text[:1024])
            self._heading_chars += len(self._heading[-1])


class EpubReaderParts:
    """Chapters of an EPUB (spine order); chapters without text (covers, images) are skipped."""

    unit = "chapter"

    def __init__(self, source: str | BinaryIO, name: str) -> None:
        self.name = name
        self.notes: list[str] = []
        self.box = box = Container(source, name, "EPUB")
        try:
            self._package(box)
        except BaseException:
            box.close()
            raise

    def _package(self, box: Container) -> None:
        """DRM checks, then the chapters the OPF package's spine lists (confined, present)."""
        name = self.name
        if "META-INF/rights.xml" in box.names:
            raise UsageError(f"{name} is DRM-protected (Adobe ADEPT); kvtool reads DRM-free EPUBs only")
        if "META-INF/encryption.xml" in box.names:
            for data in self._xml("META-INF/encryption.xml").iter():
                if _local(data.tag) == "EncryptionMethod" and data.get("Algorithm") not in _FONT_OBFUSCATION:
                    raise UsageError(f"{name} is DRM-protected (encrypted content); kvtool reads DRM-free EPUBs only")
        container = self._xml("META-INF/container.xml")
        rootfile = next((e.get("full-path") for e in container.iter() if _local(e.tag) == "rootfile"), None)
        if not rootfile:
            raise box.corrupt("no package in container.xml")
        rootfile = box.confined(rootfile)
        opf = self._xml(rootfile)
        base = posixpath.dirname(rootfile)
        manifest: dict[str, tuple[str, str]] = {}
        spine: list[str] = []
        for e in opf.iter():
            tag = _local(e.tag)
            if tag == "item" and e.get("id") and e.get("href"):
                manifest[e.get("id", "")] = (posixpath.join(base, unquote(e.get("href", ""))), e.get("media-type", ""))
            elif tag == "itemref" and e.get("linear", "yes") != "no":
                spine.append(e.get("idref", ""))
        self.files = [box.confined(manifest[i][0]) for i in spine if i in manifest and manifest[i][1] in _HTML_TYPES]
        if not self.files:
            raise box.corrupt("its spine lists no chapters")
        self.total: int | None = len(self.files)
        self.claimed = sum(box.zip.getinfo(f).file_size for f in self.files)  # progress only: never trusted
        box.prescan(self.files)  # a bomb is refused now, before the first chapter's text reaches a model

    def _xml(self, path: str) -> ET.Element:
        """A metadata member (small, capped) parsed whole."""
        data = self.box.read(self.box.confined(path))
        return parse_whole(data, path, self.box)

    def _pieces(self, path: str, state: _Chapter) -> Iterator[tuple[str, int]]:
        """A chapter's text in pieces (and the bytes of the chapter inflated so far), parsed as it inflates."""
        feed = XmlFeed(state.start, state.end, state.data, entities=True)
        where = f"{self.name}: chapter {path!r:.80}"
        with self.box.open(path) as f:
            while True:
                chunk = f.read()
                try:
                    feed.feed(chunk, where, final=not chunk)
                except pyexpat.ExpatError as e:
                    raise self.box.corrupt(f"chapter {path!r:.80} is not well-formed XHTML: {e}") from None
                for piece in state.out.take(final=not chunk):
                    yield piece, f.read_bytes
                if not chunk:
                    return

    def close(self) -> None:
        """Close the container now (a read abandoned partway, or never started)."""
        self.box.close()

    def parts(self) -> Iterator[Part]:
        chapter = 0
        done = 0
        try:
            for path in self.files:
                state = _Chapter()
                first = True
                for piece, inflated in self._pieces(path, state):
                    if first:
                        chapter += 1
                    text = "\n\n" + piece if first and chapter > 1 else piece
                    fraction = min(1.0, (done + inflated) / self.claimed) if self.claimed else None
                    yield Part(text=text, chapter=chapter, title=state.heading, new_unit=first, fraction=fraction)
                    first = False
                done += self.box.zip.getinfo(path).file_size
        finally:
            self.box.close()
        if chapter == 0:
            raise UsageError(f"{self.name} has no text (only images?); kvtool reads text")
