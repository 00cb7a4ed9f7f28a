"""HTML: the page's main text with trafilatura (Apache-2.0), without navigation, banners and footers.

trafilatura was chosen over hand-written rules on selectolax or BeautifulSoup: on the generated fixture
all three find the article and drop the boilerplate, but only trafilatura finds the main text of pages
that do not mark it with ``<article>``/``<main>``, and a page costs it about 1.6 ms. XHTML chapters of an
EPUB are clean documents and go through :func:`xhtml_text` (standard library) instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from html.parser import HTMLParser
from typing import BinaryIO

from kvtool.errors import UsageError
from kvtool.runtime.documents import Part, require

MAX_HTML_BYTES = 64 * 1024 * 1024
_TITLE = re.compile(r"<title[^>]*>(.*?)</title>", re.I | re.S)
_BLOCKS = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "pre", "section",
           "article", "table", "ul", "ol", "dd", "dt", "hr"}
_SKIP = {"script", "style", "head", "title", "svg", "nav"}


def decode(data: bytes) -> str:
    """Bytes of a web page as text: UTF-8 (BOM allowed), else the declared charset, else Latin-1."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        m = re.search(rb"charset=[\"']?([A-Za-z0-9_-]+)", data[:4096])
        if m:
            try:
                return data.decode(m.group(1).decode("ascii"), errors="replace")
            except LookupError:
                pass
        return data.decode("latin-1")


class _Text(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.skip = 0
        self.heading: str | None = None
        self._in_heading = False
        self._heading_buf: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _SKIP:
            self.skip += 1
        elif tag in _BLOCKS:
            self.out.append("\n")
        if tag in ("h1", "h2", "h3") and self.heading is None:
            self._in_heading = True

    def handle_endtag(self, tag: str) -> None:
        if tag in _SKIP:
            self.skip = max(0, self.skip - 1)
        elif tag in _BLOCKS:
            self.out.append("\n")
        if tag in ("h1", "h2", "h3") and self._in_heading:
            self._in_heading = False
            self.heading = " ".join("".join(self._heading_buf).split()) or None

    def handle_data(self, data: str) -> None:
        if self.skip:
            return
        self.out.append(data)
        if self._in_heading:
            self._heading_buf.append(data)


def xhtml_text(markup: str) -> tuple[str, str | None]:
    """Text of a clean (X)HTML document and its first heading: paragraphs on their own lines."""
    p = _Text()
    p.feed(markup)
    p.close()
    lines = (" ".join(line.split()) for line in "".join(p.out).split("\n"))
    return "\n".join(line for line in lines if line), p.heading


class HtmlReaderParts:
    """One saved web page: its main text as one section titled by the page's ``<title>``."""

    unit = "section"
    total = 1

    def __init__(self, stream: BinaryIO, head: bytes, name: str) -> None:
        require("trafilatura", "html")
        self.name = name
        self.notes: list[str] = []
        data = head + stream.read(MAX_HTML_BYTES - len(head) + 1)
        if len(data) > MAX_HTML_BYTES:
            raise UsageError(f"{name} is larger than {MAX_HTML_BYTES // 2**20} MiB, too large for one web page")
        markup = decode(data)
        import trafilatura

        try:
            text = trafilatura.extract(markup, include_comments=False, include_tables=True, favor_precision=True)
        except Exception as e:  # lxml/trafilatura errors on broken markup
            raise UsageError(f"{name} is not readable HTML ({type(e).__name__})") from None
        if not text or not text.strip():
            raise UsageError(f"{name} has no main text (only navigation, scripts or boilerplate?); "
                             "save the article itself or pass --format text")
        self.text = text.strip()
        m = _TITLE.search(markup)
        self.title = " ".join(m.group(1).split()) if m else None

    def parts(self) -> Iterator[Part]:
        yield Part(text=self.text, title=self.title)
