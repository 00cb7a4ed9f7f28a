"""``kvtool eval``'s drawing: the progress bar an eval task reports to, and the tables of its results.

The tasks (:mod:`kvtool.eval`) return data and report through a :class:`kvtool.eval.Reporter`; everything
that reaches the terminal is here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.columns import Columns
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from kvtool.cli.shown import plain_column, shown_text
from kvtool.config import SHARED_RECALL_SELECT
from kvtool.errors import printable
from kvtool.eval import Reporter


class RichReporter(Reporter):
    """An eval task's progress as a rich bar on stderr (nothing when quiet); ``say`` prints above it."""

    def __init__(self, quiet: bool, title: str, console: Any) -> None:
        """``console``: the caller's rich console for stderr (the CLI owns the terminal)."""
        self.quiet = quiet
        self.title = title
        self.console = console
        self.progress = Progress(
            plain_column("{task.description}", style="bold"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
            disable=quiet,
            transient=False,
        )
        self.task: Any = None

    def say(self, msg: str) -> None:
        if not self.quiet:
            self.console.print(msg, highlight=False, markup=False)

    @contextmanager
    def bar(self, total: int) -> Iterator[RichReporter]:
        self.task = self.progress.add_task(printable(self.title, one_line=True), total=total)
        with self.progress:
            yield self

    def doing(self, what: str) -> None:
        if self.task is not None:
            self.progress.update(self.task, description=printable(f"{self.title}: {what}", one_line=True))

    def advance(self, n: int = 1) -> None:
        if self.task is not None:
            self.progress.advance(self.task, n)


def render_ppl(rep: dict[str, Any], console: Any) -> None:
    s = rep["settings"]
    t = Table(title=shown_text(f"perplexity of {s['continuation']} tokens after {s['context']} ({s['model']}, "
                               f"{s['samples']} window(s)); dense ppl {rep['reference']['ppl']:.4f}; KL = "
                               "KL(dense ‖ policy); [95% bootstrap over windows]; * = gap significantly above the "
                               "best row's"))
    for col in ("policy", "budget", "ppl", "gap %", "window gap % [95%]", "KL", "top-1", "seconds"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for r in rep["results"]:
        g = r["window_gap_pct"]
        mark = " *" if r.get("significant") else ""
        t.add_row(r["policy"], "-" if r["budget"] is None else str(r["budget"]), f"{r['ppl']:.4f}",
                  f"{r['ppl_gap_pct']:+.2f}", f"{g['value']:+.2f} [{g['low']:+.2f}, {g['high']:+.2f}]{mark}",
                  f"{r['kl']:.5f}", f"{r['top1']:.3f}", f"{r['seconds']:.1f}")
    console.print(t)
    console.print(f"{rep['seconds']:.1f} s", style="dim")


def render_attn_error(rep: dict[str, Any], console: Any) -> None:
    s = rep["settings"]
    t = Table(title=shown_text(f"attention-output error ‖o_dense − o‖/‖o_dense‖ per layer, mean over heads "
                               f"({s['model']}, {s['continuation']} tokens after {s['context']}, {s['samples']} "
                               "sample(s))"))
    t.add_column("layer", justify="right")
    results = rep["results"]
    for r in results:
        t.add_column(r["policy"] if r["budget"] is None else f"{r['policy']} @ {r['budget']}", justify="right")
    for i in range(s["num_layers"]):
        t.add_row(str(i), *[f"{r['layers'][i]:.4f}" for r in results])
    t.add_section()
    t.add_row("mean", *[f"{r['mean']:.4f}" for r in results], style="bold")
    t.add_row("95% (windows)", *[f"[{r['mean_interval']['low']:.4f}, {r['mean_interval']['high']:.4f}]"
                                 for r in results], style="dim")
    console.print(t)
    console.print(f"{rep['seconds']:.1f} s", style="dim")


def render_agreement(rep: dict[str, Any], console: Any) -> None:
    s = rep["settings"]
    t = Table(title=shown_text(f"agreement with the dense answer ({s['model']}, {s['questions']} question(s); 95% "
                               f"intervals; KL/top-1 over the first {s['first_tokens']} dense answer tokens; * = F1 "
                               "significantly below the best row)"))
    for col in ("policy", "budget", "exact match", "token F1", "ROUGE-L", "KL(dense‖policy)", "top-1"):
        t.add_column(col, justify="left" if col == "policy" else "right")

    def iv(x: dict[str, float] | None, digits: int = 2) -> str:
        if x is None:
            return "-"
        return f"{x['value']:.{digits}f} [{x['low']:.{digits}f}, {x['high']:.{digits}f}]"

    for r in rep["results"]:
        mark = " *" if r["significant"] else ""
        t.add_row(r["policy"], str(r["budget"]), iv(r["exact_match"]), iv(r["f1"]) + mark, iv(r["rouge_l"]),
                  iv(r["kl"], 3), iv(r["top1"]))
    console.print(t)
    console.print(f"{rep['seconds']:.1f} s", style="dim")


def _heat(acc: float) -> str:
    """Red (0) → yellow (0.5) → green (1) background."""
    a = min(1.0, max(0.0, acc))
    lo, mid, hi = (215, 48, 39), (254, 224, 139), (26, 152, 80)
    x, (c0, c1) = (a * 2, (lo, mid)) if a < 0.5 else ((a - 0.5) * 2, (mid, hi))
    r, g, b = (round(u + (v - u) * x) for u, v in zip(c0, c1, strict=True))
    return f"bold black on #{r:02x}{g:02x}{b:02x}"


def _recall_label(row: dict[str, Any]) -> str:
    """A needle row's recall: its budget ("-": none), and its ``--recall-select`` unless the default."""
    rec, sel = row.get("recall", 0), row.get("select", SHARED_RECALL_SELECT)
    return "-" if not rec else str(rec) if sel == SHARED_RECALL_SELECT else f"{rec} ({sel})"


def render_needle(rep: dict[str, Any], console: Any) -> None:
    s = rep["settings"]
    lengths, depths = s["lengths"], s["depths"]
    groups: dict[tuple[str, Any, str], dict[tuple[int, float], float]] = {}
    for c in rep["results"]:
        groups.setdefault((c["policy"], c["budget"], _recall_label(c)), {})[(c["length"], c["depth"])] = c["accuracy"]
    maps = []
    for (policy, budget, rec), acc in groups.items():
        title = policy if budget is None else f"{policy} @ {budget}" + (f" + recall {rec}" if rec != "-" else "")
        t = Table(title=title, title_style="bold")
        t.add_column("length \\ depth", justify="right")
        for d in depths:
            t.add_column(f"{d:g}", justify="center")
        for L in lengths:
            t.add_row(str(L), *[Text(f"{acc[(L, d)]:.2f}", style=_heat(acc[(L, d)])) for d in depths])
        maps.append(t)
    console.print(Columns(maps, padding=(0, 2)))
    summary = Table(title=shown_text(f"needle found-rate ({s['model']}, {s['trials']} trial(s) per cell; 95% Wilson "
                                     "interval; * = significantly below the best row)"))
    for col in ("policy", "budget", "recall", "found", "95% interval", "correct"):
        summary.add_column(col, justify="left" if col == "policy" else "right")
    for row in rep["summary"]:
        budget = "-" if row["budget"] is None else str(row["budget"])
        mark = " *" if row.get("significant") else ""
        lo, hi = row.get("interval", [0.0, 1.0])
        summary.add_row(row["policy"], budget, _recall_label(row),
                        Text(f"{row['accuracy']:.2f}{mark}", style=_heat(row["accuracy"])),
                        f"[{lo:.2f}, {hi:.2f}]", f"{row['correct']}/{row['total']}")
    console.print(summary)
    console.print(f"{rep['seconds']:.1f} s", style="dim")
