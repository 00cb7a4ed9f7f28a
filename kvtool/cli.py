"""The ``kvtool`` command line (Typer).

Answers go to stdout; progress, notes and errors go to stderr. Every error a user can cause is one
line on stderr with a documented exit code (0 ok, 1 runtime failure, 2 bad input, 130 interrupted).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from typer.exceptions import TyperException

from kvtool import __version__
from kvtool.errors import EXIT_INTERRUPTED, EXIT_RUNTIME, EXIT_USAGE, KvtoolError, UsageError


class _Group(typer.core.TyperGroup):
    """Turns kvtool's errors into one stderr line and an exit code inside the app itself.

    So the same codes come out of ``main()``, the console script and Typer's test runner.
    """

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except KvtoolError as e:
            print(f"kvtool: error: {e}", file=sys.stderr)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            print("kvtool: interrupted", file=sys.stderr)
            raise typer.Exit(EXIT_INTERRUPTED) from None


app = typer.Typer(
    cls=_Group,
    name="kvtool",
    help="Read documents longer than memory allows: block-wise prefill under a strict KV-cache budget.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

# -- shared options -------------------------------------------------------------------------------------
ModelOpt = Annotated[str | None, typer.Option("--model", "-m", help="Local HF checkpoint dir or .gguf file "
                                              "(default: embedded SmolLM2-135M-Instruct).")]
PolicyOpt = Annotated[str | None, typer.Option("--policy", "-p", help="Eviction policy: base[+modifier...], "
                                               "e.g. keydiff, h2o+vatp, snapkv+caote (see `kvtool policies`).")]
PolicyOptOpt = Annotated[list[str] | None, typer.Option("--policy-opt", help="Policy option key=value (repeatable).")]
BudgetOpt = Annotated[str | None, typer.Option("--budget", "-b", help="KV budget per head and layer: tokens "
                                               "(4096, 4k) or bytes of K+V (512MiB, 2GB).")]
BlockOpt = Annotated[int | None, typer.Option("--block-size", help="Prefill block size in tokens (default 128).")]
DeviceOpt = Annotated[str | None, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")]
DtypeOpt = Annotated[str | None, typer.Option("--dtype", help="auto, float32, bfloat16 or float16.")]
QuantOpt = Annotated[str | None, typer.Option("--quantize", help="none, 8bit or 4bit (bitsandbytes, CUDA only).")]
PositionsOpt = Annotated[str | None, typer.Option("--positions", help="absolute, compact or auto (default).")]
SinksOpt = Annotated[int | None, typer.Option("--sinks", help="First tokens never evicted (default 4).")]
RecentOpt = Annotated[int | None, typer.Option("--recent", help="Most recent tokens never evicted (default 8).")]
MaxNewOpt = Annotated[int | None, typer.Option("--max-new-tokens", help="Longest answer in tokens (default 256).")]
TempOpt = Annotated[float | None, typer.Option("--temperature", help="0 = greedy (default).")]
TopPOpt = Annotated[float | None, typer.Option("--top-p", help="Nucleus sampling threshold.")]
RepPenOpt = Annotated[float | None, typer.Option("--repetition-penalty", help="Penalty on the answer's own "
                                                 "repeated tokens (1 = off; default 1.1).")]
SeedOpt = Annotated[int | None, typer.Option("--seed", help="Sampling seed.")]
ProfileOpt = Annotated[str | None, typer.Option("--profile", help="A profile name in profiles/ or a YAML path.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of text.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Nothing on stderr but errors.")]


def overrides(**kw: Any) -> dict[str, Any]:
    """CLI flags as settings overrides (None = not given)."""
    opts = kw.pop("policy_opt", None)
    if opts:
        kw["policy_options"] = parse_policy_opts(opts)
    return kw


def settings_flags(params: dict[str, Any]) -> dict[str, Any]:
    """A command's setting flags (pass ``locals()``) as overrides: every other parameter is ignored."""
    from kvtool.settings import SETTINGS_FIELDS

    return overrides(**{k: v for k, v in params.items() if k in SETTINGS_FIELDS or k == "policy_opt"})


def parse_policy_opts(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise UsageError(f"--policy-opt must be key=value (got {item!r})")
        key, value = item.split("=", 1)
        out[key.strip()] = value.strip()
    return out


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


def sayer(quiet: bool) -> Callable[[str], None]:
    def say(msg: str) -> None:
        if not quiet:
            print(msg, file=sys.stderr, flush=True)

    return say


@contextmanager
def dashboard(quiet: bool) -> Iterator[Any]:
    from kvtool.dashboard import choose_mode, make_listener

    console = stderr_console()
    with make_listener(choose_mode(quiet, console.is_terminal), console) as dash:
        yield dash


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def write_text(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def read_questions(questions: list[str] | None, questions_file: Path | None) -> list[str]:
    qs = list(questions or [])
    if questions_file is not None:
        try:
            lines = questions_file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read --questions-file {questions_file}: {e}") from None
        qs += [ln.strip() for ln in lines if ln.strip()]
    if not qs:
        raise UsageError("give at least one question (arguments or --questions-file)")
    return qs


# -- commands ------------------------------------------------------------------------------------------------
@app.command()
def ask(
    file: Annotated[str, typer.Argument(help="Text file, '-' for stdin, or a .kvc cache from `kvtool prefill`.")],
    questions: Annotated[list[str] | None, typer.Argument(help="One or more questions.")] = None,
    questions_file: Annotated[Path | None, typer.Option("--questions-file", help="One question per line.")] = None,
    policy: PolicyOpt = None,
    policy_opt: PolicyOptOpt = None,
    budget: BudgetOpt = None,
    block_size: BlockOpt = None,
    model: ModelOpt = None,
    max_new_tokens: MaxNewOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    quantize: QuantOpt = None,
    positions: PositionsOpt = None,
    sinks: SinksOpt = None,
    recent: RecentOpt = None,
    temperature: TempOpt = None,
    top_p: TopPOpt = None,
    repetition_penalty: RepPenOpt = None,
    seed: SeedOpt = None,
    profile: ProfileOpt = None,
    json_out: JsonOpt = False,
    jsonl: Annotated[bool, typer.Option("--jsonl", help="One JSON line per answer as it completes.")] = False,
    quiet: QuietOpt = False,
) -> None:
    """Answer questions about a document read under a KV budget."""
    from kvtool.runner import run_ask

    flags = settings_flags(locals())
    run_ask(file, read_questions(questions, questions_file), flags, profile=profile, json_out=json_out, jsonl=jsonl,
            quiet=quiet)


@app.command()
def summarize(
    file: Annotated[str, typer.Argument(help="Text file, '-' for stdin, or a .kvc cache.")],
    length: Annotated[str, typer.Option("--length", help="short, medium or long.")] = "medium",
    policy: PolicyOpt = None,
    policy_opt: PolicyOptOpt = None,
    budget: BudgetOpt = None,
    block_size: BlockOpt = None,
    model: ModelOpt = None,
    max_new_tokens: MaxNewOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    quantize: QuantOpt = None,
    positions: PositionsOpt = None,
    sinks: SinksOpt = None,
    recent: RecentOpt = None,
    temperature: TempOpt = None,
    top_p: TopPOpt = None,
    repetition_penalty: RepPenOpt = None,
    seed: SeedOpt = None,
    profile: ProfileOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Summarize a document read under a KV budget."""
    from kvtool.runner import run_summarize

    run_summarize(file, length, settings_flags(locals()), profile=profile, json_out=json_out, quiet=quiet)


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


def _register_extra_commands() -> None:
    """Commands that live in their own modules (one concept per module)."""
    import importlib

    for name in ("cli_cache", "cli_calibrate", "cli_eval", "cli_profile"):
        try:
            mod = importlib.import_module(f"kvtool.{name}")
        except ModuleNotFoundError:  # TEMP during development
            continue
        mod.register(app)


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the app and turn every failure into one line and an exit code."""
    _register_extra_commands()
    try:
        rc = app(args=argv, standalone_mode=False, prog_name="kvtool")
        return rc if isinstance(rc, int) else 0
    except KvtoolError as e:  # raised outside a command (e.g. while registering)
        print(f"kvtool: error: {e}", file=sys.stderr)
        return e.exit_code
    except typer.Exit as e:
        return int(e.exit_code or 0)
    except typer.Abort:
        print("kvtool: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except TyperException as e:  # usage errors from the command-line parser
        fmt = getattr(e, "format_message", None)
        msg = fmt() if fmt else str(e)
        if msg:  # "no arguments: show help" has already printed the help and has no message
            print(f"kvtool: error: {msg}", file=sys.stderr)
        return int(getattr(e, "exit_code", EXIT_USAGE) or EXIT_USAGE)
    except KeyboardInterrupt:
        print("kvtool: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader of stdout went away (e.g. `| head`): not an error worth a message
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        except OSError:
            pass
        return EXIT_RUNTIME
    except Exception as e:  # noqa: BLE001 - last line of defence: one line, never a traceback
        if os.environ.get("KVTOOL_DEBUG"):
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"kvtool: internal error: {type(e).__name__}: {msg} (set KVTOOL_DEBUG=1 for details)", file=sys.stderr)
        return EXIT_RUNTIME


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
