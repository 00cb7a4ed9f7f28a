"""Document fixtures generated on the spot (never downloaded): PDFs (fpdf2), EPUB and DOCX (zipfile), HTML."""

from __future__ import annotations

import zipfile
from pathlib import Path

PAGES = [
    "The lighthouse keeper counted the ships every evening. He wrote their names in a green ledger.",
    "On the second page the storm arrived from the west. The harbour master closed the gates at noon.",
    "The third page tells how the keeper's daughter repaired the lamp with a copper wire and patience.",
]
CHAPTERS = [
    ("The Orchard", "Mira planted seven apple trees behind the mill. The soil there was dark and wet."),
    ("The Winter", "Snow covered the orchard for three months. Mira read old letters by the stove."),
    ("The Harvest", "In autumn the trees gave more apples than the village could eat. They made cider."),
]
ARTICLE = [
    "Researchers measured the migration of arctic terns across the Atlantic for eleven years.",
    "The birds flew an average of seventy thousand kilometres each year, the longest migration known.",
    "Tagged birds returned to the same colony with remarkable precision, often to the same rock.",
]


def make_pdf(path: Path, pages: list[str | None], password: str | None = None) -> Path:
    """A PDF with one page per item: text, or ``None`` for a page with only a drawing (no text layer)."""
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("Helvetica", size=11)
    for text in pages:
        pdf.add_page()
        if text is None:
            pdf.set_fill_color(120, 120, 120)
            pdf.rect(20, 20, 150, 200, style="F")  # a "scanned image": shapes, no text
        else:
            pdf.multi_cell(0, 6, text)
    if password is not None:
        pdf.set_encryption(owner_password=password, user_password=password)
    pdf.output(str(path))
    return path


def _xhtml(title: str, body: str) -> str:
    return (
        '<?xml version="1.0" encoding="utf-8"?>\n<html xmlns="http://www.w3.org/1999/xhtml"><head>'
        f"<title>{title}</title></head><body><h1>{title}</h1><p>{body}</p></body></html>"
    )


def make_epub(path: Path, chapters: list[tuple[str, str]], drm: bool = False) -> Path:
    """An EPUB 3 with one XHTML file per chapter; ``drm`` adds an encryption.xml over the chapters."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(zipfile.ZipInfo("mimetype"), "application/epub+zip")
        z.writestr(
            "META-INF/container.xml",
            '<?xml version="1.0"?><container version="1.0" '
            'xmlns="urn:oasis:names:tc:opendocument:xmlns:container"><rootfiles>'
            '<rootfile full-path="OEBPS/content.opf" media-type="application/oebps-package+xml"/>'
            "</rootfiles></container>",
        )
        items = "".join(
            f'<item id="c{i}" href="c{i}.xhtml" media-type="application/xhtml+xml"/>' for i in range(len(chapters))
        )
        spine = "".join(f'<itemref idref="c{i}"/>' for i in range(len(chapters)))
        z.writestr(
            "OEBPS/content.opf",
            '<?xml version="1.0"?><package xmlns="http://www.idpf.org/2007/opf" version="3.0">'
            '<metadata xmlns:dc="http://purl.org/dc/elements/1.1/"><dc:title>Book</dc:title></metadata>'
            f"<manifest>{items}</manifest><spine>{spine}</spine></package>",
        )
        for i, (title, body) in enumerate(chapters):
            data = _xhtml(title, body)
            z.writestr(f"OEBPS/c{i}.xhtml", bytes(b ^ 0x5A for b in data.encode()) if drm else data)
        if drm:
            refs = "".join(
                '<EncryptedData xmlns="http://www.w3.org/2001/04/xmlenc#">'
                '<EncryptionMethod Algorithm="http://www.w3.org/2001/04/xmlenc#aes128-cbc"/>'
                f'<CipherData><CipherReference URI="OEBPS/c{i}.xhtml"/></CipherData></EncryptedData>'
                for i in range(len(chapters))
            )
            z.writestr(
                "META-INF/encryption.xml",
                f'<?xml version="1.0"?><encryption xmlns="urn:oasis:names:tc:opendocument:xmlns:container">'
                f"{refs}</encryption>",
            )
    return path


def make_html(path: Path, paragraphs: list[str], article: bool = True) -> Path:
    """A web page: navigation, a cookie banner, sidebar and footer around an article (or no article)."""
    nav = "".join(f'<li><a href="/s{i}">Section {i}</a></li>' for i in range(12))
    body = "".join(f"<p>{p}</p>" for p in paragraphs) if article else ""
    main = f"<article><h1>Arctic terns</h1>{body}</article>" if article else ""
    html = (
        "<!DOCTYPE html><html><head><title>Birds daily</title><script>var x = 1;</script>"
        "<style>p {color: red}</style></head><body>"
        f'<header><nav><ul>{nav}</ul></nav></header><div class="cookie">We use cookies. Accept all</div>'
        f'<main>{main}</main><aside><h3>Related</h3><ul><li><a href="/a">Owls at night</a></li>'
        '<li><a href="/b">Crows are clever</a></li></ul></aside>'
        "<footer>Copyright 2024 Birds daily. All rights reserved. Contact | Privacy | Terms</footer></body></html>"
    )
    path.write_text(html, encoding="utf-8")
    return path


def make_docx(path: Path, sections: list[tuple[str, str]]) -> Path:
    """A DOCX with a Heading 1 and a paragraph per section (python-docx)."""
    import docx

    d = docx.Document()
    for title, body in sections:
        d.add_heading(title, level=1)
        d.add_paragraph(body)
    d.save(str(path))
    return path


#: what a decompression bomb repeats: one sentence, so that the text it hands out is the model's work
BOMB_SENTENCE = b"The same sentence, again and again, fills this chapter to the brim. "
_DOCX_TYPES = (
    '<?xml version="1.0" encoding="UTF-8"?><Types xmlns="http://schemas.openxmlformats.org/package/2006/'
    'content-types"><Default Extension="xml" ContentType="application/xml"/><Override PartName="/word/'
    'document.xml" ContentType="application/vnd.openxmlformats-officedocument.wordprocessingml.document.'
    'main+xml"/></Types>'
)
_W = 'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"'


def _streamed(
    z: zipfile.ZipFile, name: str, head: bytes, pattern: bytes, inflated: int, tail: bytes, prefix: bytes = b""
) -> None:
    """Member ``name``: ``head``, ``prefix``, then ``pattern`` repeated to ``inflated`` bytes, then ``tail``, written
    through zlib a MiB at a time (the bomb is never held: a few KiB of output per MiB of input)."""
    block = pattern * max(1, (1 << 20) // len(pattern))
    full, rest = divmod(inflated, len(block))
    with z.open(name, "w", force_zip64=True) as f:
        f.write(head + prefix)
        for _ in range(full):
            f.write(block)
        f.write(block[: rest - rest % len(pattern)] + tail)


def make_bomb_epub(path: Path, inflated: int, prefix: bytes = b"") -> Path:
    """An EPUB whose second chapter is ``prefix`` then :data:`BOMB_SENTENCE` repeated to ``inflated`` bytes: a
    file of a few KiB per MiB of text (deflate's ratio on repetition is about 1,000)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(zipfile.ZipInfo("mimetype"), "application/epub+zip")
        z.writestr(
            "META-INF/container.xml",
            '<?xml version="1.0"?><container version="1.0" '
            'xmlns="urn:oasis:names:tc:opendocument:xmlns:container"><rootfiles>'
            '<rootfile full-path="OEBPS/content.opf" media-type="application/oebps-package+xml"/>'
            "</rootfiles></container>",
        )
        z.writestr(
            "OEBPS/content.opf",
            '<?xml version="1.0"?><package xmlns="http://www.idpf.org/2007/opf" version="3.0"><manifest>'
            '<item id="c0" href="c0.xhtml" media-type="application/xhtml+xml"/>'
            '<item id="c1" href="c1.xhtml" media-type="application/xhtml+xml"/>'
            '</manifest><spine><itemref idref="c0"/><itemref idref="c1"/></spine></package>',
        )
        z.writestr("OEBPS/c0.xhtml", _xhtml("Start", "The book begins quietly."))
        _streamed(
            z,
            "OEBPS/c1.xhtml",
            b'<html xmlns="http://www.w3.org/1999/xhtml"><body><p>',
            BOMB_SENTENCE,
            inflated,
            b"</p></body></html>",
            prefix,
        )
    return path


def make_bomb_docx(path: Path, inflated: int, prefix: bytes = b"") -> Path:
    """A DOCX whose ``word/document.xml`` is ``prefix`` then one paragraph of :data:`BOMB_SENTENCE` repeated to
    ``inflated`` bytes (a minimal package: the content types and the document part)."""
    para = b"<w:p><w:r><w:t>" + BOMB_SENTENCE.strip() + b"</w:t></w:r></w:p>"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("[Content_Types].xml", _DOCX_TYPES)
        _streamed(
            z,
            "word/document.xml",
            f'<?xml version="1.0"?><w:document {_W}><w:body>'.encode(),
            para,
            inflated,
            b"</w:body></w:document>",
            prefix,
        )
    return path


def novel_sections(path: Path) -> list[tuple[str, str]]:
    """A whole novel from the corpus as (chapter title, text) pairs, split at its ``Chapter N`` lines: the large,
    legitimate book every bomb check must still read (escape the text for XHTML: ``make_epub`` puts it as is)."""
    text = path.read_text(encoding="utf-8")
    sections: list[tuple[str, list[str]]] = [("Front matter", [])]
    for line in text.splitlines():
        if line.startswith("Chapter ") and line[8:].strip().isdigit():
            sections.append((line.strip(), []))
        else:
            sections[-1][1].append(line)
    return [(title, " ".join(" ".join(lines).split())) for title, lines in sections]
