"""HTML: the page's main text with trafilatura (Apache-2.0), without navigation, banners and footers.

trafilatura was chosen over hand-written rules on selectolax or BeautifulSoup: on the generated fixture
all three find the article and drop the boilerplate, but only trafilatura finds the main text of pages
that do not mark it with ``<article>``/``<main>``. The page is read
whole (at most :data:`MAX_HTML_BYTES`); its text is handed out in parts of at most 64K characters.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterator
from typing import BinaryIO

from kvtool.documents.base import Part, require, split_text, title_of
from kvtool.errors import UsageError

MAX_HTML_BYTES = 64 * 1024 * 1024
_TITLE_OPEN = re.compile(r"<title", re.I)  # literals only: linear
_TITLE_CLOSE = re.compile(r"</title", re.I)
_CHARSET = re.compile(rb"charset=[\"']?([A-Za-z0-9_-]{1,40})")


#: codecs Python knows that are not a page's character encoding (or decode nothing): never used for a page
_NOT_CHARSETS = frozenset({"idna", "punycode", "undefined", "unicode_escape", "raw_unicode_escape", "utf_7"})


def decode(data: bytes) -> str:
    """Bytes of a web page as text: UTF-8 (BOM allowed), else the declared charset, else Latin-1.

    A declared charset Python does not know, or one that is not a text encoding (``idna``, ``undefined``,
    ``rot13``), is ignored like a missing one: the page is read as Latin-1, never an error."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        m = _CHARSET.search(data[:4096])
        charset = _charset(m.group(1).decode("ascii")) if m else None
        if charset is not None:
            try:
                return data.decode(charset, errors="replace")
            except (LookupError, UnicodeError, ValueError):
                pass
        return data.decode("latin-1")


def _charset(name: str) -> str | None:
    """The codec ``name`` names, if it is a text encoding a page may be written in."""
    try:
        info = codecs.lookup(name)
    except LookupError:
        return None
    if not getattr(info, "_is_text_encoding", True) or info.name.replace("-", "_") in _NOT_CHARSETS:
        return None
    return info.name


def page_title(markup: str) -> str | None:
    """The text of the first ``<title ...>...</title>``: one forward scan, linear however the tags nest or fail."""
    m = _TITLE_OPEN.search(markup)
    if m is None:
        return None
    gt = markup.find(">", m.end())
    if gt < 0:
        return None
    close = _TITLE_CLOSE.search(markup, gt + 1)
    if close is None:
        return None
    return title_of(markup[gt + 1 : min(close.start(), gt + 1 + 4 * 1024)])


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
        self.title = page_title(markup)

    def parts(self) -> Iterator[Part]:
        done = 0
        for i, piece in enumerate(split_text(self.text)):
            done += len(piece)
            yield Part(text=piece, title=self.title, new_unit=i == 0, fraction=done / len(self.text))
