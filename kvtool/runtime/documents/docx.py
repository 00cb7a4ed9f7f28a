"""DOCX with the standard library: ``word/document.xml`` parsed incrementally, sections at headings.

python-docx extracts the same paragraphs but takes 8 ms for the fixture against 0.8 ms for an
incremental ElementTree parse (which also never holds the document's object tree); a heading
paragraph (style ``Heading N`` or ``Title``) starts a new section, named by its text in citations.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Iterator
from typing import BinaryIO

from kvtool.errors import UsageError
from kvtool.runtime.documents import Part

W = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"
SECTION_CHARS = 16 * 1024  # a long section without headings is handed out in pieces of about this size


class DocxReaderParts:
    """Paragraphs of a Word document, grouped into sections by headings."""

    unit = "section"
    total = None

    def __init__(self, source: str | BinaryIO, name: str) -> None:
        self.name = name
        self.notes: list[str] = []
        try:
            self.zip = zipfile.ZipFile(source)
            self.zip.getinfo("word/document.xml")
        except KeyError:
            raise UsageError(f"{name} is not a valid DOCX (corrupt: word/document.xml is missing)") from None
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            raise UsageError(f"{name} is not a valid DOCX (corrupt ZIP: {e})") from None

    def _paragraphs(self) -> Iterator[tuple[str, bool]]:
        """(text, is_heading) per paragraph, parsed incrementally."""
        try:
            with self.zip.open("word/document.xml") as f:
                for _, el in ET.iterparse(f, events=("end",)):
                    if el.tag != W + "p":
                        continue
                    style = el.find(f"{W}pPr/{W}pStyle")
                    sval = (style.get(W + "val") or "") if style is not None else ""
                    heading = sval.lower().startswith(("heading", "title"))
                    pieces = []
                    for node in el.iter():
                        if node.tag == W + "t" and node.text:
                            pieces.append(node.text)
                        elif node.tag == W + "tab":
                            pieces.append("\t")
                        elif node.tag in (W + "br", W + "cr"):
                            pieces.append("\n")
                    el.clear()
                    yield "".join(pieces), heading
        except (ET.ParseError, zipfile.BadZipFile, OSError, EOFError) as e:
            raise UsageError(f"{self.name} is not a valid DOCX (corrupt: {e})") from None

    def parts(self) -> Iterator[Part]:
        title: str | None = None
        buf: list[str] = []
        size = 0
        emitted = False
        new_unit = True

        def flush() -> Part:
            nonlocal emitted, buf, size, new_unit
            text = "\n".join(buf)
            part = Part(text=("\n\n" + text) if emitted else text, title=title, new_unit=new_unit)
            emitted, buf, size, new_unit = True, [], 0, False
            return part

        for text, heading in self._paragraphs():
            if heading and text.strip():
                if buf:
                    yield flush()
                title, new_unit = " ".join(text.split()), True
            if text.strip():
                buf.append(text)
                size += len(text)
                if size >= SECTION_CHARS:
                    yield flush()
        if buf:
            yield flush()
        if not emitted:
            raise UsageError(f"{self.name} has no text")
