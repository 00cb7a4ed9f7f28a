"""How a string that kvtool did not write reaches rich: its controls shown, its brackets never read as markup.

File names, model names, notes and document text go to the terminal through rich in the live views and the
tables. Two things must never happen to them: a control character (ESC, U+009B, a bidi override) obeyed by the
terminal, and rich markup parsed out of them (a file named ``[/]`` is a ``MarkupError`` in the live view's
refresh thread, ``[red]`` would restyle the line). Every such string is drawn as :func:`shown_text` (or, in a
progress bar's description, through a :func:`plain_column`), never as a plain ``str`` rich would parse.
"""

from __future__ import annotations

from typing import Any

from rich.progress import TextColumn
from rich.text import Text

from kvtool.errors import printable


def shown_text(value: object, style: str = "", one_line: bool = False) -> Text:
    """``value`` as rich ``Text``: controls escaped (``errors.printable``), brackets drawn as they are."""
    return Text(printable(value, one_line=one_line), style=style)


def plain_column(template: str, **kwargs: Any) -> TextColumn:
    """A progress bar's text column that draws its fields as text: a description naming a file is never
    parsed as markup (its controls are escaped where the description is set: ``shown_text`` or ``printable``)."""
    return TextColumn(template, markup=False, **kwargs)
