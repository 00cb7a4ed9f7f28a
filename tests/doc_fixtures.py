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
    return ('<?xml version="1.0" encoding="utf-8"?>\n<html xmlns="http://www.w3.org/1999/xhtml"><head>'
            f"<title>{title}</title></head><body><h1>{title}</h1><p>{body}</p></body></html>")


def make_epub(path: Path, chapters: list[tuple[str, str]], drm: bool = False) -> Path:
    """An EPUB 3 with one XHTML file per chapter; ``drm`` adds an encryption.xml over the chapters."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(zipfile.ZipInfo("mimetype"), "application/epub+zip")
        z.writestr("META-INF/container.xml",
                   '<?xml version="1.0"?><container version="1.0" '
                   'xmlns="urn:oasis:names:tc:opendocument:xmlns:container"><rootfiles>'
                   '<rootfile full-path="OEBPS/content.opf" media-type="application/oebps-package+xml"/>'
                   "</rootfiles></container>")
        items = "".join(f'<item id="c{i}" href="c{i}.xhtml" media-type="application/xhtml+xml"/>'
                        for i in range(len(chapters)))
        spine = "".join(f'<itemref idref="c{i}"/>' for i in range(len(chapters)))
        z.writestr("OEBPS/content.opf",
                   '<?xml version="1.0"?><package xmlns="http://www.idpf.org/2007/opf" version="3.0">'
                   '<metadata xmlns:dc="http://purl.org/dc/elements/1.1/"><dc:title>Book</dc:title></metadata>'
                   f"<manifest>{items}</manifest><spine>{spine}</spine></package>")
        for i, (title, body) in enumerate(chapters):
            data = _xhtml(title, body)
            z.writestr(f"OEBPS/c{i}.xhtml", bytes(b ^ 0x5A for b in data.encode()) if drm else data)
        if drm:
            refs = "".join(
                '<EncryptedData xmlns="http://www.w3.org/2001/04/xmlenc#">'
                '<EncryptionMethod Algorithm="http://www.w3.org/2001/04/xmlenc#aes128-cbc"/>'
                f'<CipherData><CipherReference URI="OEBPS/c{i}.xhtml"/></CipherData></EncryptedData>'
                for i in range(len(chapters)))
            z.writestr("META-INF/encryption.xml",
                       f'<?xml version="1.0"?><encryption xmlns="urn:oasis:names:tc:opendocument:xmlns:container">'
                       f"{refs}</encryption>")
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
