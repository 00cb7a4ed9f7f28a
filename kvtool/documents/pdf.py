"""PDF pages with pypdf (BSD): text layer of each page, extracted as the prefill reaches it.

pypdf was chosen over pdfminer.six by measurement on generated fixtures: both extract the known text
exactly, pypdf reads a 1,000-page PDF in 1.7 s against 22 s (README "Documents").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, BinaryIO

from kvtool.documents.base import Part, require, split_text
from kvtool.errors import UsageError

#: pages between two clearings of pypdf's object cache (see ``PdfReaderParts._forget``)
FORGET_EVERY = 64


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
    return text


#: a page takes at least a few dozen bytes of a file; a page tree listing more than this many per KiB shares
#: its nodes (a tree whose kids repeat can list 2^depth pages in a few KiB)
PAGES_PER_KIB = 64
#: page-tree nodes above a page; real trees are a few levels deep
MAX_TREE_DEPTH = 256
#: page attributes a page inherits from the page-tree nodes above it (PDF 32000-1, 7.7.3.4)
INHERITED = ("/Resources", "/MediaBox", "/CropBox", "/Rotate")


def _page_count(reader: Any) -> int | None:
    """The page count the root of the page tree claims (progress only; the walk counts the real pages)."""
    try:
        count = reader.root_object["/Pages"].get_object().get("/Count")
        count = int(count.get_object() if hasattr(count, "get_object") else count)
    except Exception:  # noqa: BLE001 - no count: progress shows pages without a total
        return None
    return count if 0 <= count <= 1 << 31 else None


def _page_walk(reader: Any) -> Iterator[Any]:
    """The PDF's pages in order, built one at a time from its page tree, with their inherited attributes.

    pypdf's ``reader.pages`` builds a page object for every page first (about 2.5 KiB each: 250 MB for
    100,000 pages) and keeps them; this walk holds only the path from the root to the current page (a
    stack of ``/Kids`` arrays and positions), so a reader's working set does not grow with the page count.
    A node already on the path is a cycle, a path deeper than :data:`MAX_TREE_DEPTH` is refused, and a
    ``/Kids`` entry that is not a dictionary is skipped, as pypdf does.
    """
    from pypdf import PageObject
    from pypdf.errors import PdfReadError
    from pypdf.generic import ArrayObject, DictionaryObject, IndirectObject, NameObject

    def kids_of(node: Any) -> list[Any]:
        kids = node.get("/Kids")
        kids = kids.get_object() if isinstance(kids, IndirectObject) else kids
        return list(kids) if isinstance(kids, ArrayObject) else []

    def inherit(parent: dict[str, Any], node: Any) -> dict[str, Any]:
        return {**parent, **{a: node[a] for a in INHERITED if a in node}}

    top_ref = reader.root_object["/Pages"]
    top = top_ref.get_object()
    if not isinstance(top, DictionaryObject):
        raise PdfReadError("invalid /Pages")
    stack: list[tuple[list[Any], int, dict[str, Any], int]] = [(kids_of(top), 0, inherit({}, top), id(top))]
    path = {getattr(top_ref, "idnum", -1)}
    while stack:
        kids, at, attrs, key = stack[-1]
        if at >= len(kids):
            stack.pop()
            path.discard(key)
            continue
        stack[-1] = (kids, at + 1, attrs, key)
        ref = kids[at]
        node = ref.get_object() if isinstance(ref, IndirectObject) else ref
        if not isinstance(node, DictionaryObject):
            continue
        kind = node.get("/Type")
        if kind == "/Pages" or (kind != "/Page" and "/Kids" in node):
            key = getattr(ref, "idnum", None) if isinstance(ref, IndirectObject) else id(node)
            if key in path:
                raise PdfReadError("the page tree loops")
            if len(stack) >= MAX_TREE_DEPTH:
                raise PdfReadError(f"the page tree is more than {MAX_TREE_DEPTH} levels deep")
            path.add(key)
            stack.append((kids_of(node), 0, inherit(attrs, node), key))
            continue
        page = PageObject(reader, ref if isinstance(ref, IndirectObject) else None)
        if not isinstance(ref, IndirectObject):
            page.update(node)
        for name, value in attrs.items():
            if name not in page:
                page[NameObject(name)] = value
        yield page


def _needs(name: str, e: Exception) -> UsageError:
    """The one line for a PDF that needs an optional package pypdf did not find (AES: ``cryptography``)."""
    text = str(e)
    if "cryptography" in text or "AES" in text:
        return UsageError(f"{name} is encrypted with AES: reading it needs the cryptography package (pip install "
                          "cryptography), or decrypt it first (e.g. qpdf --decrypt --password=... in out)")
    return UsageError(f"{name} needs a package kvtool's PDF reader lacks: {_short(e)}")


def _handler(file: BinaryIO) -> str:
    """The ``/Filter`` an encrypted PDF names (shown bounded, escaped), read from the file's last KiB."""
    import re

    try:
        file.seek(0, 2)
        size = file.tell()
        file.seek(max(0, size - 64 * 1024))
        tail = file.read(64 * 1024)
    except (OSError, ValueError):
        return "unknown handler"
    names = re.findall(rb"/Filter\s*/([A-Za-z0-9.#_-]{1,40})", tail)
    handlers = [n.decode("ascii") for n in names if not n.endswith(b"Decode")]
    return "/" + handlers[-1] if handlers else "unknown handler"


def _has_font(page: Any) -> bool:
    """Whether a page can carry a text layer: fonts in its resources or its form XObjects' (cheap, no parsing)."""
    try:
        res = page.get("/Resources")
        res = res.get_object() if res is not None else None
        if not res:
            return False
        if res.get("/Font"):
            return True
        xobjects = res.get("/XObject")
        for ref in (xobjects.get_object().values() if xobjects else []):
            inner = ref.get_object().get("/Resources")
            if inner is not None and inner.get_object().get("/Font"):
                return True
    except Exception:  # an odd resource dictionary: let extraction decide
        return True
    return False


class PdfReaderParts:
    """Pages of a PDF; checked for encryption and a text layer when opened."""

    unit = "page"

    def __init__(self, source: str | BinaryIO, name: str) -> None:
        require("pypdf", "pdf")
        import logging

        # pypdf logs its repairs of damaged files ("EOF marker not found") on stderr; kvtool reports one line
        logging.getLogger("pypdf").setLevel(logging.ERROR)
        self.name = name
        self.notes: list[str] = []
        self.empty_pages: list[int] = []
        # a path is opened here and read by pypdf as it seeks (given a path, pypdf would read the file whole)
        self.file: BinaryIO = open(source, "rb") if isinstance(source, str) else source  # noqa: SIM115
        try:
            self._open(name)
        except BaseException:
            self.file.close()
            raise

    def _open(self, name: str) -> None:
        import pypdf
        from pypdf.errors import DependencyError

        # pypdf tries the empty password while it opens an encrypted file: a handler it does not implement, or AES
        # without the cryptography package, fails right here, before any page is read
        try:
            self.reader = pypdf.PdfReader(self.file)
            encrypted = self.reader.is_encrypted
        except DependencyError as e:
            raise _needs(name, e) from None
        except NotImplementedError:
            raise UsageError(f"{name} is encrypted with the {_handler(self.file)} security handler, which kvtool "
                             "cannot open (only password encryption): decrypt it first with the software that "
                             "encrypted it") from None
        except Exception as e:  # noqa: BLE001 - pypdf raises many types on damaged files
            raise UsageError(f"{name} is not a readable PDF (corrupt: {_short(e)})") from None
        if encrypted:
            try:  # owner-password-only PDFs (printing/copying restrictions) open with the empty password
                ok = bool(self.reader.decrypt(""))
            except DependencyError as e:
                raise _needs(name, e) from None
            except Exception:  # noqa: BLE001 - a damaged encryption dictionary is as unreadable as a password
                ok = False
            if not ok:
                raise UsageError(f"{name} is encrypted: decrypt it first (e.g. qpdf --decrypt --password=... in out)")
        try:
            self.total = _page_count(self.reader)
            # the first page with a font settles it (a text PDF: page 1); only a scan is looked at whole
            fonts = any(_has_font(p) for p in self._walk())
        except DependencyError as e:
            raise _needs(name, e) from None
        except Exception as e:  # pypdf raises many types on damaged page trees
            raise UsageError(f"{name} is not a readable PDF (corrupt page tree: {_short(e)})") from None
        finally:
            self._forget()
        if self.total == 0:
            raise UsageError(f"{name} has no pages")
        if not fonts:
            raise UsageError(f"{name} has no text layer: run OCR first (none of its {self.total} pages has text)")

    def _walk(self) -> Iterator[Any]:
        """The pages in order, each built as the walk reaches it (see :func:`_page_walk`), pages past what the
        file's size can hold refused."""
        cap = PAGES_PER_KIB * max(1, self._size() // 1024) + 1024
        for i, page in enumerate(_page_walk(self.reader)):
            if i >= cap:
                raise UsageError(f"{self.name} lists more than {cap:,} pages, more than its size can hold (pages "
                                 "shared in a loop of its page tree?); refused")
            yield page

    def _size(self) -> int:
        try:
            at = self.file.tell()
            end = self.file.seek(0, 2)
            self.file.seek(at)
            return end
        except (OSError, ValueError):
            return 1 << 30

    def _forget(self) -> None:
        """Drop the objects pypdf has parsed and cached (fonts, content streams): re-read if needed again.

        pypdf keeps every object it resolves for the life of the reader, so reading a 100,000-page PDF
        would hold all their content streams by the end; clearing the cache every few pages keeps the
        working set at a few pages' objects."""
        cache = getattr(getattr(self, "reader", None), "resolved_objects", None)
        if isinstance(cache, dict):
            cache.clear()

    def close(self) -> None:
        """Close the file now (a read abandoned partway, or never started)."""
        self.file.close()

    def parts(self) -> Iterator[Part]:
        try:
            yield from self._pages()
        finally:
            self.file.close()

    def _pages(self) -> Iterator[Part]:
        from pypdf.errors import DependencyError

        first = True
        pages = self._walk()
        i = -1
        while True:
            i += 1
            try:
                page = next(pages, None)
                if page is None:
                    break
                text = page.extract_text() or ""
            except UsageError:
                raise
            except DependencyError as e:
                raise _needs(self.name, e) from None
            except Exception as e:
                raise UsageError(f"{self.name}: page {i + 1} cannot be read (corrupt: {_short(e)})") from None
            if i % FORGET_EVERY == FORGET_EVERY - 1:
                self._forget()
            text = text.strip()
            if not text:
                self.empty_pages.append(i + 1)
                continue
            done = 0
            for k, piece in enumerate(split_text(text)):
                done += len(piece)
                fraction = min(1.0, (i + done / len(text)) / self.total) if self.total else None
                yield Part(text=piece if first or k else "\n\n" + piece, page=i + 1, new_unit=k == 0, fraction=fraction)
            first = False
        self.total = i  # the pages walked (the file's own count only estimated progress)
        if first:
            raise UsageError(f"{self.name} has no text layer: run OCR first (none of its {self.total} pages has text)")
        if self.empty_pages:
            read = self.total - len(self.empty_pages)
            self.notes.append(f"{self.name}: {len(self.empty_pages)} of {self.total} pages had no text layer "
                              f"({'pages' if len(self.empty_pages) > 1 else 'page'} {_ranges(self.empty_pages)}); "
                              f"read the other {read}")


def _ranges(pages: list[int]) -> str:
    """``[1, 2, 3, 7]`` → ``"1-3, 7"``."""
    out: list[str] = []
    start = prev = pages[0]
    for p in [*pages[1:], None]:
        if p is not None and p == prev + 1:
            prev = p
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if p is not None:
            start = prev = p
    return ", ".join(out)
