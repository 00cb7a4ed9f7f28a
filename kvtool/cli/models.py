"""``kvtool models``: what kvtool can run from the local caches (the Hugging Face cache and the embedded model).

The listing itself is :func:`kvtool.runtime.model.catalog.list_models` (config files only, no weights);
this module prints it as a table, or as one JSON object with ``--json``.
"""

from __future__ import annotations

import sys
from typing import Any

from kvtool.cli.options import JsonOpt
from kvtool.cli.output import emit_json
from kvtool.errors import printable


def models(json_out: JsonOpt = False) -> None:
    """List the models kvtool can run from the local caches: Hugging Face cache ids, and the embedded model."""
    from kvtool.runtime.model.catalog import list_models

    listing = list_models()
    if json_out:
        emit_json(listing)
        return
    _table(listing)


def _table(listing: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from kvtool.runtime.memory import format_bytes

    found = "" if listing["cache_found"] else " (not found)"
    table = Table(title=f"models kvtool can run (--model ID); Hugging Face cache: {listing['cache_dir']}{found}",
                  title_justify="left")
    for column in ("--model", "family", "parameters", "dtype", "size", "kvtool"):
        table.add_column(column, overflow="fold")
    for row in listing["models"]:
        name = row["id"] + (f" ({row['revision']})" if row["revision"] and row["revision"] != "main" else "")
        params = _count(row["parameters"])
        cells = [name, row["family"] or "?", params, row["dtype"] or "?",
                 format_bytes(row["size_bytes"]) if row["size_bytes"] else "-", _verdict(row)]
        table.add_row(*(Text(printable(cell, one_line=True)) for cell in cells))
    Console(highlight=False, width=None if sys.stdout.isatty() else 160).print(table)


def _verdict(row: dict[str, Any]) -> str:
    """The last column: runs (and how well proven), or why not."""
    if row["problem"]:
        return f"cannot run: {row['problem']}"
    if row["supported"] == "yes":
        return "runs" + (f" ({row['why']})" if row["why"] else "")
    return f"{'may run' if row['supported'] == 'unproven' else 'no'}: {row['why']}"


def _count(parameters: int | None) -> str:
    """135M, 8.03B: the way model sizes are named."""
    if not parameters:
        return "?"
    return f"{parameters / 1e6:.0f}M" if parameters < 1e9 else f"{parameters / 1e9:.2f}B"
