"""The ``kvtool`` command line (Typer): the app, its error handling, and where each command is mounted.

Answers go to stdout; progress, notes and errors go to stderr. Every error a user can cause is one
line on stderr with a documented exit code (0 ok, 1 runtime failure, 2 bad input, 3 some of many documents
failed, 130 interrupted, 143 terminated by SIGTERM/SIGHUP).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

import typer
from rich.console import Console
from typer.exceptions import TyperException

from kvtool import __version__
from kvtool.cli import ask, cache, calibrate, eval, models, profile
from kvtool.cli.error_lines import error_line
from kvtool.cli.options import JsonOpt
from kvtool.cli.output import WRITE_ERRNOS, discard_stdout, emit_json, flush_stdout
from kvtool.errors import (
    EXIT_PIPE,
    EXIT_RUNTIME,
    EXIT_USAGE,
    KvtoolError,
    Terminated,
    first_line,
    interrupt_exit,
    printable,
)
from kvtool.stdio import guard_closed_streams, missing_cwd, no_prompts


class _Group(typer.core.TyperGroup):
    """Turns kvtool's errors into one stderr line and an exit code inside the app itself.

    So the same codes come out of ``main()``, the console script and Typer's test runner.
    """

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except KvtoolError as e:
            print(f"kvtool: error: {error_line(e)}", file=sys.stderr)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt as e:
            msg, code = _interrupt_exit(e)
            print(msg, file=sys.stderr)
            raise typer.Exit(code) from None
        except BrokenPipeError:
            # the reader of stdout went away (`| head -c1`): stop now, quietly, with the status cat has when
            # SIGPIPE ends it (click itself would turn it into exit 1)
            discard_stdout()
            raise typer.Exit(EXIT_PIPE) from None


app = typer.Typer(
    cls=_Group,
    name="kvtool",
    help="Read documents longer than memory allows: block-wise prefill under a strict KV-cache budget.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

# Every command, in one place: a command module defines plain functions, this module mounts them.
app.command("ask")(ask.ask)
app.command("summarize")(ask.summarize)
app.command("prefill")(cache.prefill)
app.command("inspect")(cache.inspect)
app.command("profile")(profile.profile)
app.command("models")(models.models)
app.command("calibrate")(calibrate.calibrate_cmd)
app.add_typer(eval.eval_app, name="eval")


def _print_version(value: bool) -> None:
    if value:
        print(f"kvtool {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print kvtool's version and exit."),
) -> None:
    """Read documents longer than memory allows: block-wise prefill under a strict KV-cache budget."""


@app.command()
def policies(json_out: JsonOpt = False) -> None:
    """List eviction policies and modifiers."""
    from rich.table import Table

    from kvtool.policies import describe_policies

    rows = describe_policies()
    if json_out:
        emit_json({"policies": rows})
        return
    table = Table(title="kvtool policies (compose as base+modifier, e.g. h2o+vatp+caote)")
    for col in ("name", "kind", "attention", "description", "paper"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["name"], r["kind"], "yes" if r["needs_attention"] else "no", r["description"], r["paper"])
    Console().print(table)


@app.command()
def version() -> None:
    """Print kvtool's version."""
    print(__version__)


@app.command()
def sample() -> None:
    """Print the path of the sample document that ships with kvtool (try: kvtool ask "$(kvtool sample)" ...)."""
    from kvtool.data import sample_path

    print(sample_path())


#: the termination signal received, if any: a library may catch kvtool's ``Terminated`` and raise a plain
#: ``KeyboardInterrupt`` in its place (Ray's ``ray.wait`` and ``ray.get`` do), which must still exit 143
_signalled: list[str] = []


def _raise_terminated(signum: int, frame: Any) -> None:
    name = signal.Signals(signum).name
    _signalled.append(name)
    raise Terminated(name)


def _interrupt_exit(e: BaseException) -> tuple[str, int]:
    """The line and exit code of an interrupt: a termination signal's (143) whatever became of its exception."""
    if _signalled and not isinstance(e, Terminated):
        e = Terminated(_signalled[0])
    return interrupt_exit(e)


@contextlib.contextmanager
def _termination_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP behave like Ctrl-C (temp files removed, one line) but exit 143; restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = [s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s is not None]
    old = {s: signal.signal(s, _raise_terminated) for s in sigs}
    _signalled.clear()
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the app and turn every failure into one line and an exit code.

    A closed stdout or stderr is pointed at ``/dev/null`` first (so no file kvtool opens takes its
    descriptor, and no error line falls back to stdout); a closed stdout is then refused, since the answers
    would be lost after all the work. No library may prompt on stdin while the command runs.
    """
    stdout_closed, _ = guard_closed_streams()
    if stdout_closed:
        print("kvtool: error: stdout is closed: kvtool writes its output there (redirect it to /dev/null to "
              "discard it)", file=sys.stderr)
        return EXIT_USAGE
    gone = missing_cwd()
    if gone is not None:
        print(f"kvtool: error: {gone}", file=sys.stderr)
        return EXIT_USAGE
    with _termination_signals(), no_prompts():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if sys.stdin is None and "-" in args:  # started with stdin closed (`<&-`): nothing to read "-" from
        print("kvtool: error: stdin is closed (the document or questions were to come from '-')", file=sys.stderr)
        return EXIT_USAGE
    try:
        rc = app(args=args, standalone_mode=False, prog_name="kvtool")
        flush_stdout()
        return rc if isinstance(rc, int) else 0
    except KvtoolError as e:  # raised outside a command (e.g. while registering)
        print(f"kvtool: error: {error_line(e)}", file=sys.stderr)
        return e.exit_code
    except typer.Exit as e:
        return int(e.exit_code or 0)
    except typer.Abort as e:  # click turns a KeyboardInterrupt (or Terminated) outside a command into Abort
        msg, code = _interrupt_exit(e.__cause__ or e)
        print(msg, file=sys.stderr)
        return code
    except TyperException as e:  # usage errors from the command-line parser
        fmt = getattr(e, "format_message", None)
        msg = fmt() if fmt else str(e)
        if msg:  # "no arguments: show help" has already printed the help and has no message
            print(f"kvtool: error: {printable(msg, one_line=True)}", file=sys.stderr)
        return int(getattr(e, "exit_code", EXIT_USAGE) or EXIT_USAGE)
    except KeyboardInterrupt as e:
        msg, code = _interrupt_exit(e)
        print(msg, file=sys.stderr)
        return code
    except BrokenPipeError:
        # the reader of stdout went away (`| head -c1`): stop quietly, with the status cat has when SIGPIPE ends it
        discard_stdout()
        return EXIT_PIPE
    except OSError as e:
        if e.errno not in WRITE_ERRNOS:
            return _internal_error(e)
        discard_stdout()  # what is still buffered would fail again at exit, with a second message
        print(f"kvtool: error: cannot write the output: {e.strerror or first_line(e)}", file=sys.stderr)
        return EXIT_RUNTIME
    except Exception as e:  # noqa: BLE001 - last line of defence: one line, never a traceback
        return _internal_error(e)


def _internal_error(e: Exception) -> int:
    if os.environ.get("KVTOOL_DEBUG"):
        raise e
    msg = first_line(e) if str(e).strip() else ""
    print(f"kvtool: internal error: {type(e).__name__}: {printable(msg, one_line=True)} "
          "(set KVTOOL_DEBUG=1 for details)", file=sys.stderr)
    return EXIT_RUNTIME


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
