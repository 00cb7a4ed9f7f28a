"""HTML: the page's main text with trafilatura (Apache-2.0), without navigation, banners and footers.

trafilatura was chosen over hand-written rules on selectolax or BeautifulSoup: on the generated fixture
all three find the article and drop the boilerplate, but only trafilatura finds the main text of pages
that do not mark it with ``<article>``/``<main>``. The page is read
whole (at most :data:`MAX_HTML_BYTES`); its text is handed out in parts of at most 64K characters.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import BinaryIO

from kvtool.documents.base import Part, require, split_text, title_of
from kvtool.errors import UsageError

MAX_HTML_BYTES = 64 * 1024 * 1024
_TITLE_OPEN = re.compile(r"<title", re.I)  # literals only: linear
_TITLE_CLOSE = re.compile(r"</title", re.I)
_CHARSET = re.compile(rb"charset=[\"']?([A-Za-z0-9_-]{1,40})")


def decode(data: bytes) -> str:
    """Bytes of a web page as text: UTF-8 (BOM allowed), else the declared charset, else Latin-1."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        m = _CHARSET.search(data[:4096])
        if m:
            try:
                return data.decode(m.group(1).decode("ascii"), errors="replace")
            except LookupError:
                pass
        return data.decode("latin-1")


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
