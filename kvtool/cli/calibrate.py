"""``kvtool calibrate``: find RazorAttention's retrieval heads for a model (and cache the result)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from kvtool.cli.options import DeviceOpt, DtypeOpt, JsonOpt, ModelOpt, QuietOpt, capped_option
from kvtool.cli.output import emit_json, sayer
from kvtool.cli.shown import shown_text


def calibrate_cmd(
    model: ModelOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    induction: Annotated[float, capped_option("head_share", "--induction", help="Share of heads kept by induction "
                                              "score.")] = 0.14,
    echo: Annotated[float, capped_option("head_share", "--echo", help="Share of heads kept by echo score.")] = 0.01,
    k: Annotated[int | None, capped_option("calibrate_k", "--k", help="Random tokens per repeat (default: fits the "
                                           "range, ≤ 2048 probe tokens on CPU).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Recompute even if a calibration is saved.")] = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Score every attention head for echo/induction behaviour and select retrieval heads (RazorAttention §3.3)."""
    from rich.progress import Progress

    from kvtool.config import kvtool_home
    from kvtool.policies.razor.calibrate import calibrate, calibration_path
    from kvtool.runtime.model import load_model

    say = sayer(quiet)
    loaded = load_model(model, device or "auto", dtype or "auto", progress=say)
    console = Console(stderr=True)
    with Progress(console=console, disable=quiet or not console.is_terminal, transient=True) as bar:
        task = bar.add_task("calibrating heads", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        data = calibrate(
            loaded.model, identity=loaded.identity, name=loaded.name, home=kvtool_home(), K=k,
            induction_frac=induction, echo_frac=echo, force=force, progress=progress,
            exclude_ids=list(loaded.tokenizer.all_special_ids),
        )
    path = calibration_path(loaded.identity, kvtool_home())
    kv_heads = {str(layer): heads for layer, heads in data["kv_heads"].items()}
    if json_out:
        emit_json({
            "model": loaded.name, "identity": loaded.identity, "path": str(path), "K": data["K"],
            "induction_frac": data["induction_frac"], "echo_frac": data["echo_frac"],
            "query_heads": {str(k2): v for k2, v in data["query_heads"].items()}, "kv_heads": kv_heads,
            "echo": data["echo"], "induction": data["induction"],
        })
        return
    table = Table(title=shown_text(f"retrieval heads of {loaded.name} (induction {induction:.0%}, echo {echo:.0%})"))
    for col in ("layer", "query heads", "KV heads", "best induction", "best echo"):
        table.add_column(col)
    for layer in sorted(data["kv_heads"]):
        table.add_row(str(layer), ", ".join(map(str, data["query_heads"][layer])) or "-",
                      ", ".join(map(str, data["kv_heads"][layer])) or "-",
                      f"{max(data['induction'][layer]):.3f}", f"{max(data['echo'][layer]):.3f}")
    Console().print(table)
    say(f"saved to {path}")
