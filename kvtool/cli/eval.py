"""``kvtool eval needle | ppl | attn-error | agreement``: evaluate eviction policies over a (policy × budget) grid.

Everything is validated before the model loads; the model is loaded once per command. Progress goes to
stderr and results to stdout as rich tables (:mod:`kvtool.cli.eval_view`), or one JSON object with
``--json`` (see kvtool/eval).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import typer
from rich.console import Console

from kvtool.cli.options import (
    AGREEMENT_SETTINGS,
    EVAL_SETTINGS,
    NEEDLE_SETTINGS,
    JsonOpt,
    QuietOpt,
    capped_option,
    with_settings,
)
from kvtool.cli.output import emit_json, sayer, stderr_console
from kvtool.config import SHARED_RECALL_SELECT
from kvtool.data import sample_path

eval_app = typer.Typer(
    name="eval",
    help="Evaluate eviction policies: needle in a haystack, perplexity, attention-output error, agreement with "
    "the dense answers. Without a corpus, on the packaged sample (`kvtool sample`).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

#: the input of every eval command when none is given: the packaged sample document
DEFAULT_INPUT = str(sample_path())

PoliciesOpt = Annotated[str, typer.Option("--policies", help="Comma list of policies (base[+modifier...]).")]
BudgetsOpt = Annotated[str, typer.Option("--budgets", help="Comma list of KV budgets per head: 256,512 or 1k.")]
EvalSeedOpt = Annotated[int, capped_option("seed", "--seed", help="Seed for the secret numbers and the sample "
                                           "offsets.")]
TextOpt = Annotated[str | None, typer.Option("--text", help="Document(s) in any format kvtool reads, "
                                             "comma-separated (windows are spread over them), or a directory of "
                                             "documents (default: the packaged sample).")]
ContextOpt = Annotated[str, typer.Option("--context", help="Context tokens N before the measured tokens (512, 2k).")]
ContinuationOpt = Annotated[str, typer.Option("--continuation", help="Measured tokens M, fed one at a time.")]
SamplesOpt = Annotated[int, capped_option("samples", "--samples", help="Windows K taken from the text(s) at seeded "
                                          "offsets (spread round-robin over the texts).")]
EvalMaxNewOpt = Annotated[int, capped_option("max_new_tokens", "--max-new-tokens",
                                             help="Longest answer in tokens.")]
ResumeOpt = Annotated[str | None, typer.Option("--resume", help="A JSONL file: finished units are appended as they "
                                               "complete and reused when the same command runs again.")]


def _grid(policies: str, budgets: str, always_full: bool, **kw: Any) -> Callable[[], Any]:
    """Check the settings and policy names now (no torch), and return what builds the (policy × budget)
    grid: building it imports the policies (torch), which waits until every cheap check has passed."""
    from kvtool.policy_syntax import check_spec
    from kvtool.runtime.settings import resolve_settings

    resolve_settings(None, {k: v for k, v in kw.items() if v is not None})
    for item in filter(None, (p.strip() for p in policies.split(","))):
        check_spec(item)

    def build() -> Any:
        from kvtool.eval import make_grid

        return make_grid(policies, budgets, always_full=always_full, **kw)

    return build


def _finish(rep: dict[str, Any], json_out: bool, render: Any) -> None:
    if json_out:
        emit_json(rep)
    else:
        render(rep, Console())


@eval_app.command("needle")
@with_settings(*NEEDLE_SETTINGS)
def needle(
    haystack: Annotated[str | None, typer.Option("--haystack", help="A document in any format kvtool reads, or a "
                                                 "directory of documents (default: the packaged sample).")] = None,
    lengths: Annotated[str, typer.Option("--lengths", help="Document lengths in tokens.")] = "1k,2k",
    depths: Annotated[str, typer.Option("--depths", help="Needle depths in [0, 1].")] = "0,0.5,1",
    policies: PoliciesOpt = "full,sink,h2o,keydiff",
    budgets: BudgetsOpt = "256",
    needle_text: Annotated[str | None, typer.Option("--needle", help="Needle sentence (default: a random "
                                                    "secret number per trial).")] = None,
    question: Annotated[str | None, typer.Option("--question", help="Question for a custom needle.")] = None,
    answer: Annotated[str | None, typer.Option("--answer", help="Expected answer for a custom needle.")] = None,
    trials: Annotated[int, capped_option("trials", "--trials", help="Trials per cell (new secret number each).")] = 10,
    needles: Annotated[int, typer.Option("--needles", help="k > 1: k labelled secret numbers per document, the "
                                         "question asks for one (multi-needle).")] = 1,
    no_full: Annotated[bool, typer.Option("--no-full", help="Leave out the full-cache reference (a dense pass "
                                          "over a long haystack can take hours).")] = False,
    recall: Annotated[str, typer.Option("--recall", help="Comma list of recall budgets per KV head run beside "
                                        "each bounded policy: 0 (eviction only), 256, 4k, auto (ask's "
                                        "default, 256).")] = "auto",
    select: Annotated[str, typer.Option("--recall-select", help="Comma list of the ways recall chooses, each "
                                        "answering every read that recalls (see ask's --recall-select): shared "
                                        "(this grid's default: the baseline each variant is paired with), auto "
                                        "(ask's default), sum, layer, grow, again, or +-joined ones."),
                  ] = SHARED_RECALL_SELECT,
    kind: Annotated[str, typer.Option("--needle-kind", help="What the default needle hides: number (a 5-digit "
                                      "secret number), name (an invented name), paraphrase (an invented town, "
                                      "asked for in other words) or twofact (what the holder of a role did: two "
                                      "facts in two places, and another person's deed).")] = "number",
    resume: ResumeOpt = None,
    diagnose: Annotated[bool, typer.Option("--diagnose", help="Record per trial where recall ranked the needle, "
                                           "which layers hold it and what the answer copied from (a `diagnose` "
                                           "entry in the --resume log and the --json answers; answers unchanged; "
                                           "a trial logged without one is read again).")] = False,
    max_new_tokens: EvalMaxNewOpt = 24,
    seed: EvalSeedOpt = 0,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    flags: dict[str, Any] | None = None,
) -> None:
    """Needle in a haystack: accuracy per (policy, budget, length, depth); `full` is included unless --no-full."""
    build_grid = _grid(policies, budgets, not no_full, seed=seed, max_new_tokens=max_new_tokens, **(flags or {}))
    from kvtool.eval import load_text, parse_depths, parse_token_list, resolve_input

    path = resolve_input(haystack or DEFAULT_INPUT, "", "--haystack")
    # the grid's numbers are checked before torch is imported (a typo fails in milliseconds)
    token_lengths = parse_token_list(lengths, "--lengths", minimum=32)
    depth_list = parse_depths(depths)
    grid = build_grid()
    from kvtool.cli.eval_view import RichReporter, render_needle
    from kvtool.eval.needle import NeedleTask, custom_needle, parse_recalls, parse_selects, run_needle

    task = NeedleTask(
        grid=grid,
        haystack_path=path,
        haystack="",
        lengths=token_lengths,
        depths=depth_list,
        trials=trials,
        needle=custom_needle(needle_text, question, answer),
        max_new_tokens=max_new_tokens,
        recalls=parse_recalls(recall),
        selects=parse_selects(select),
        kind=_needle_kind(kind),
        needles=_needle_count(needles, needle_text, kind),
        resume=resume,
        diagnose=diagnose,
    )
    task.haystack = load_text(path, "--haystack")
    _finish(run_needle(task, RichReporter(quiet, "needle", stderr_console())), json_out, render_needle)


def _needle_kind(kind: str) -> str:
    from kvtool.errors import UsageError
    from kvtool.eval.needle import NEEDLE_KINDS

    if kind.strip().lower() not in NEEDLE_KINDS:
        raise UsageError(f"--needle-kind must be one of {', '.join(NEEDLE_KINDS)} (got {kind!r})")
    return kind.strip().lower()


def _needle_count(needles: int, custom: str | None, kind: str) -> int:
    from kvtool.errors import UsageError
    from kvtool.eval.needle import LABELS
    from kvtool.numbers import Range, capped

    capped("--needles", needles, Range(1, len(LABELS)))  # one labelled secret number per label
    if needles > 1 and custom is not None:
        raise UsageError("--needles > 1 uses labelled pass keys; it cannot be combined with --needle")
    if needles > 1 and kind.strip().lower() != "number":
        raise UsageError(f"--needles > 1 uses labelled pass keys; it cannot be combined with --needle-kind {kind}")
    return needles


def _window_task(text: str | None, context: str, continuation: str, samples: int, grid: Callable[[], Any],
                 resume: str | None) -> Any:
    """The windows' task; the inputs are checked first, then the (torch-importing) grid is built."""
    from kvtool.eval import load_text, parse_tokens, resolve_input, split_list

    paths = [resolve_input(p, "", "--text") for p in split_list(text or DEFAULT_INPUT, "--text")]
    n = parse_tokens(context, "--context")
    m = parse_tokens(continuation, "--continuation")
    texts = [(p.name, load_text(p, "--text")) for p in paths]
    from kvtool.eval.ppl import WindowTask  # torch: only once the input is known to be good

    return WindowTask(grid=grid(), texts=texts, context=n, continuation=m, samples=samples, resume=resume)


def _window_command(name: str, summary: str, context_default: str, continuation_default: str,
                    policies_default: str, parts: Callable[[], tuple[Any, Any]]) -> Callable[..., None]:
    """An ``eval`` command over text windows (ppl, attn-error): the same options with its own defaults;
    ``parts`` imports (torch, only once the input is checked) its runner and its table."""

    def command(
        text: TextOpt = None,
        context: ContextOpt = context_default,
        continuation: ContinuationOpt = continuation_default,
        samples: SamplesOpt = 16,
        policies: PoliciesOpt = policies_default,
        budgets: BudgetsOpt = "256",
        seed: EvalSeedOpt = 0,
        resume: ResumeOpt = None,
        json_out: JsonOpt = False,
        quiet: QuietOpt = False,
        flags: dict[str, Any] | None = None,
    ) -> None:
        task = _window_task(text, context, continuation, samples,
                            _grid(policies, budgets, False, seed=seed, **(flags or {})), resume)
        from kvtool.cli.eval_view import RichReporter

        run, render = parts()
        _finish(run(task, RichReporter(quiet, name, stderr_console())), json_out, render)

    command.__doc__ = summary
    command.__name__ = name.replace("-", "_")
    return eval_app.command(name)(with_settings(*EVAL_SETTINGS)(command))


def _ppl_parts() -> tuple[Any, Any]:
    from kvtool.cli.eval_view import render_ppl
    from kvtool.eval.ppl import run_ppl

    return run_ppl, render_ppl


def _attn_error_parts() -> tuple[Any, Any]:
    from kvtool.cli.eval_view import render_attn_error
    from kvtool.eval.attn_error import run_attn_error

    return run_attn_error, render_attn_error


ppl = _window_command("ppl", "Perplexity of M continuation tokens after N context tokens vs the dense model "
                      "(CAOTE §4.3).", "1k", "64", "full,sink,h2o,tova,keydiff", _ppl_parts)
attn_error = _window_command("attn-error", "Per-layer normalised error between dense and evicted attention "
                             "outputs (CAOTE App. E.4).", "512", "32", "sink,h2o,tova,keydiff", _attn_error_parts)


@eval_app.command("agreement")
@with_settings(*AGREEMENT_SETTINGS)
def agreement(
    doc: Annotated[str, typer.Option("--doc", help="The document to read (any format kvtool reads).")],
    questions_file: Annotated[str, typer.Option("--questions-file", help="One question per line.")],
    policies: PoliciesOpt = "sink,h2o,tova,snapkv,keydiff",
    budgets: BudgetsOpt = "256,512,1024",
    seed: EvalSeedOpt = 0,
    first_tokens: Annotated[int, capped_option("first_tokens", "--first-tokens", help="Dense answer tokens "
                                               "teacher-forced for KL and top-1.")] = 8,
    max_new_tokens: EvalMaxNewOpt = 48,
    resume: ResumeOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    flags: dict[str, Any] | None = None,
) -> None:
    """Fidelity to dense: each policy's answers vs full's (exact match, token F1, ROUGE-L, KL, top-1)."""
    from pathlib import Path

    build_grid = _grid(policies, budgets, True, seed=seed, max_new_tokens=max_new_tokens, **(flags or {}))
    from kvtool.cli.eval_view import RichReporter, render_agreement
    from kvtool.eval import resolve_input
    from kvtool.eval.agreement import AgreementTask, read_questions_file, run_agreement

    path = resolve_input(doc, "", "--doc")
    if not path.is_file():
        from kvtool.errors import UsageError

        raise UsageError(f"--doc {path} is not a file")
    questions = read_questions_file(Path(questions_file), sayer(quiet))
    task = AgreementTask(grid=build_grid(), doc_path=path, questions=questions,
                         first_tokens=first_tokens,
                         max_new_tokens=max_new_tokens, resume=resume)
    _finish(run_agreement(task, RichReporter(quiet, "agreement", stderr_console())), json_out, render_agreement)
