"""``kvtool prefill`` (read a document once, save the compressed cache) and ``kvtool inspect`` (show one).

``ask`` and ``summarize`` accept the ``.kvc`` file in place of the document (kvtool/cli/ask.py); the file
format is in kvtool/kvc/ and docs/kvc-format.md.
"""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer

from kvtool.cli import many
from kvtool.cli.many import FilesFromOpt, RayOpt, WorkersOpt
from kvtool.cli.options import READ_SETTINGS, FormatOpt, JsonOpt, ProfileOpt, QuietOpt, with_settings
from kvtool.cli.output import dashboard, emit_json, sayer
from kvtool.errors import UsageError, printable
from kvtool.runtime.memory import format_bytes


@with_settings(*READ_SETTINGS)
def prefill(
    file: Annotated[list[str] | None, typer.Argument(help="Documents to read (text, Markdown, HTML, PDF, EPUB, "
                                                     "DOCX, directories read recursively), or '-' for stdin.")]
    = None,
    output: Annotated[str | None, typer.Option("--output", "-o", help="The .kvc file to write (required); for "
                                               "many documents a directory (DIR/), one .kvc each.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite the output file if it exists.")] = False,
    files_from: FilesFromOpt = None,
    ray: RayOpt = None,
    workers: WorkersOpt = None,
    doc_format: FormatOpt = None,
    profile: ProfileOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    flags: dict[str, Any] | None = None,
) -> None:
    """Read a document (or many) once under a KV budget and save the compressed cache (.kvc) for later questions."""
    documents = list(file or [])
    to_dir = bool(output) and output.endswith(os.sep)  # `-o DIR/`: one .kvc per document, even for one
    if many.is_many(documents, files_from, None, ray) or to_dir:
        many.run_many("prefill", documents, flags or {}, profile=profile, quiet=quiet, files_from=files_from,
                      output=output, ray=ray, workers=workers, doc_format=doc_format, force=force)
        return
    many.refuse_many_options("prefill", workers=workers)
    if not documents:
        raise UsageError("give a document: kvtool prefill FILE -o OUT.kvc (or DOC... -o DIR/ for many)")
    _prefill_one(documents[0], output, force, doc_format, profile, json_out, quiet, flags or {})


def _prefill_one(file: str, output: str | None, force: bool, doc_format: str | None, profile: str | None,
                 json_out: bool, quiet: bool, flags: dict[str, Any]) -> None:
    """One document, one .kvc file: ``kvtool prefill FILE -o OUT.kvc``."""
    from kvtool.documents import open_document
    from kvtool.kvc.format import is_kvc
    from kvtool.kvc.write import check_output

    # Bad input fails before the model loads.
    if not output:
        raise UsageError("prefill needs an output file: -o/--output OUT.kvc")
    if file != "-" and doc_format in (None, "auto") and is_kvc(file):
        raise UsageError(f"{file} is already a .kvc cache; prefill reads a text document (ask it directly)")
    check_output(output, force, source=file)
    with open_document(file, doc_format, notify=sayer(quiet)) as doc:  # closed however the read ends
        _prefill(doc, output, force, profile, json_out, quiet, flags)


def _prefill(doc: Any, output: str, force: bool, profile: str | None, json_out: bool, quiet: bool,
             flags: dict[str, Any] | None) -> None:
    from kvtool.runtime import store
    from kvtool.runtime.settings import resolve_settings

    settings = resolve_settings(profile, flags or {})
    from kvtool.runtime.session import Session  # torch loads only once the input is known to be good

    say = sayer(quiet)
    with dashboard(quiet) as dash:
        session = Session(settings, listener=dash, say=say)
        meter = session.engine.meter
        with meter.track():
            read = session.read(doc)
        with read:  # the recall archive's files are closed once saved
            nbytes = store.save_cache(output, session, read, force=force)
            stats = session.stats(read, meter.peak_bytes())
    tokens = max(read.cache.lengths())
    say(f"wrote {output} ({format_bytes(nbytes)}, {tokens} tokens/head, {session.dims['num_layers']} layers)")
    if json_out:
        emit_json({"output": output, "bytes": nbytes, "stats": stats})


def inspect(
    file: Annotated[str, typer.Argument(help="A .kvc cache written by `kvtool prefill`.")],
    json_out: JsonOpt = False,
) -> None:
    """Show a saved cache: metadata, per-layer cache lengths, size on disk (the model is not loaded)."""
    from kvtool.kvc.format import describe, is_kvc, read_header

    if not os.path.exists(file):
        raise UsageError(f"no such file: {file}")
    if os.path.isdir(file):
        raise UsageError(f"{file} is a directory, not a .kvc file")
    if not is_kvc(file):
        raise UsageError(f"{file} is not a kvtool cache (.kvc); make one with `kvtool prefill`")
    info = describe(read_header(file))
    if json_out:
        emit_json(info)
        return
    _print_inspect(info)


def _archive_rows(arch: Any) -> list[tuple[str, str]]:
    """The archive's lines of ``inspect``; the metadata is the file's word, so nothing in it is trusted."""
    if not arch:
        return [("archive", "none (questions are answered without recall)")]
    if not isinstance(arch, dict):
        return [("archive", "unusable metadata (questions are answered without recall)")]

    def count(key: str) -> int:
        v = arch.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62 else 0

    recall = count("recall")
    return [
        ("archive", f"{printable(str(arch.get('file')), one_line=True)} ({format_bytes(count('bytes'))})"),
        ("archive pages", f"{count('pages'):,} pages of {count('page_size')} tokens, "
                          f"{printable(str(arch.get('dtype')), one_line=True)}"),
        ("archived", f"{count('tokens'):,} token-heads evicted"
                     + (f"; asking recalls {recall} tokens per KV head" if recall else "")),
    ]


def _print_inspect(info: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from kvtool.cli.shown import shown_text

    meta = info["metadata"]
    model = meta.get("model") or {}
    settings = meta.get("settings") or {}
    pol = meta.get("policy") or {}
    doc = meta.get("document") or {}
    cache = meta.get("cache") or {}
    promised = info["kv_promised_bytes"]
    kv = info["kv_bytes"]
    ratio = f" ({100 * kv / promised:.0f}% of the budget's {format_bytes(promised)})" if promised else ""
    opts = " ".join(f"{k}={v}" for k, v in sorted((pol.get("options") or {}).items()))
    budget = settings.get("budget_tokens")
    budget_text = settings.get("budget")
    quant = meta.get("quantize")
    mode = settings.get("positions")
    if cache.get("compact"):
        mode = f"{mode} (compact since token {cache.get('compact_since')})"
    rows = [
        ("file", info["path"]),
        ("size on disk", f"{format_bytes(info['size_bytes'])} ({info['size_bytes']:,} bytes)"),
        ("K/V bytes", f"{format_bytes(kv)}{ratio}"),
        ("header", format_bytes(info["header_bytes"])),
        ("kvtool", f"{meta.get('kvtool_version')} (kvc format {meta.get('format_version')})"),
        ("created", str(meta.get("created"))),
        ("model", f"{model.get('name')} ({model.get('source')})"),
        ("model identity", str(model.get("identity"))),
        ("dtype", str(meta.get("dtype")) + (f", quantize {quant}" if quant not in (None, "none") else "")),
        ("policy", str(pol.get("spec", "?")) + (f"  {opts}" if opts else "")),
        ("budget", "none (full)" if budget is None else f"{budget} tokens per KV head (--budget {budget_text})"),
        ("block size", str(settings.get("block_size"))),
        ("sinks / recent", f"{settings.get('sinks')} / {settings.get('recent')}"),
        ("positions", str(mode)),
        ("position counter", f"{cache.get('seen', 0):,} tokens seen"),
        ("document", f"{doc.get('name')} ({doc.get('tokens', 0):,} tokens)"),
        ("document sha256", str(doc.get("sha256"))),
        ("chat prefix", f"{(meta.get('prompt') or {}).get('prefix_tokens')} tokens"),
        *_archive_rows(info.get("archive")),
    ]
    console = Console(highlight=False)
    table = Table(title="kvtool cache", show_header=False)
    table.add_column("key", style="bold")
    table.add_column("value", overflow="fold")
    for key, value in rows:  # shown_text: a name like "notes[/v2].txt" is shown as is, never parsed as markup
        table.add_row(key, shown_text(value))
    console.print(table)

    layers = Table(title="cache per layer (tokens per KV head)")
    for col in ("layer", "group", "KV heads", "length", "capacity"):
        layers.add_column(col, justify="right" if col != "KV heads" else "left")
    for layer in info["layers"]:
        for gi, g in enumerate(layer["groups"]):
            heads = g.get("heads")
            cap = g.get("capacity")
            cap_text = "unbounded" if cap is None else str(cap) + (" + comp" if g.get("compensation") else "")
            layers.add_row(str(layer["layer"]), str(gi), ",".join(map(str, heads)) if heads else "?",
                           str(g["length"]), shown_text(cap_text))
    console.print(layers)
