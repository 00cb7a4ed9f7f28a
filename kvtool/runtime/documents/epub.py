"""EPUB chapters with the standard library (zipfile + XML): the spine's XHTML files in reading order.

ebooklib, the usual EPUB library, is AGPL-licensed, which kvtool does not depend on; an EPUB is a ZIP of
XHTML files listed by an OPF package, which the standard library reads in a few milliseconds per book.
DRM (Adobe ADEPT ``rights.xml``, or content listed in ``encryption.xml`` with a cipher other than font
obfuscation) is refused when the book is opened.
"""

from __future__ import annotations

import posixpath
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Iterator
from typing import BinaryIO
from urllib.parse import unquote

from kvtool.errors import UsageError
from kvtool.runtime.documents import Part
from kvtool.runtime.documents.html import decode, xhtml_text

_FONT_OBFUSCATION = ("http://www.idpf.org/2008/embedding", "http://ns.adobe.com/pdf/enc#RC")
_HTML_TYPES = ("application/xhtml+xml", "text/html")


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _xml(z: zipfile.ZipFile, path: str, name: str) -> ET.Element:
    try:
        return ET.fromstring(z.read(path))
    except KeyError:
        raise UsageError(f"{name} is not a valid EPUB (corrupt: {path} is missing)") from None
    except (ET.ParseError, zipfile.BadZipFile, OSError) as e:
        raise UsageError(f"{name} is not a valid EPUB (corrupt: {path}: {e})") from None


class EpubReaderParts:
    """Chapters of an EPUB (spine order); chapters without text (covers, images) are skipped."""

    unit = "chapter"

    def __init__(self, source: str | BinaryIO, name: str) -> None:
        self.name = name
        self.notes: list[str] = []
        try:
            self.zip = zipfile.ZipFile(source)
            names = set(self.zip.namelist())
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            raise UsageError(f"{name} is not a valid EPUB (corrupt ZIP: {e})") from None
        if "META-INF/rights.xml" in names:
            raise UsageError(f"{name} is DRM-protected (Adobe ADEPT); kvtool reads DRM-free EPUBs only")
        if "META-INF/encryption.xml" in names:
            for data in _xml(self.zip, "META-INF/encryption.xml", name).iter():
                if _local(data.tag) == "EncryptionMethod" and data.get("Algorithm") not in _FONT_OBFUSCATION:
                    raise UsageError(f"{name} is DRM-protected (encrypted content); kvtool reads DRM-free EPUBs only")
        container = _xml(self.zip, "META-INF/container.xml", name)
        rootfile = next((e.get("full-path") for e in container.iter() if _local(e.tag) == "rootfile"), None)
        if not rootfile:
            raise UsageError(f"{name} is not a valid EPUB (corrupt: no package in container.xml)")
        opf = _xml(self.zip, rootfile, name)
        base = posixpath.dirname(rootfile)
        manifest: dict[str, tuple[str, str]] = {}
        spine: list[str] = []
        for e in opf.iter():
            tag = _local(e.tag)
            if tag == "item" and e.get("id") and e.get("href"):
                manifest[e.get("id", "")] = (posixpath.normpath(posixpath.join(base, unquote(e.get("href", "")))),
                                             e.get("media-type", ""))
            elif tag == "itemref" and e.get("linear", "yes") != "no":
                spine.append(e.get("idref", ""))
        self.files = [manifest[i][0] for i in spine if i in manifest and manifest[i][1] in _HTML_TYPES]
        if not self.files:
            raise UsageError(f"{name} is not a valid EPUB (corrupt: its spine lists no chapters)")
        self.total: int | None = len(self.files)

    def parts(self) -> Iterator[Part]:
        chapter = 0
        for path in self.files:
            try:
                markup = decode(self.zip.read(path))
            except KeyError:
                raise UsageError(f"{self.name} is not a valid EPUB (corrupt: chapter {path} is missing)") from None
            except (zipfile.BadZipFile, OSError, ValueError) as e:
                raise UsageError(f"{self.name} is not a valid EPUB (corrupt: {path}: {e})") from None
            text, heading = xhtml_text(markup)
            if not text:
                continue
            chapter += 1
            yield Part(text=text if chapter == 1 else "\n\n" + text, chapter=chapter, title=heading)
        if chapter == 0:
            raise UsageError(f"{self.name} has no text (only images?); kvtool reads text")
