"""The command line's options: one declaration for every reading command, and bad input found before torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from kvtool.cli import options
from kvtool.cli.app import app
from tests.helpers import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]

#: every command that reads a document, and the settings it must take from cli/options.py
READING = {
    ("ask",): options.ANSWER_SETTINGS,
    ("summarize",): options.ANSWER_SETTINGS,
    ("prefill",): options.READ_SETTINGS,
    ("profile",): options.READ_SETTINGS,
    ("eval", "needle"): options.NEEDLE_SETTINGS,
    ("eval", "ppl"): options.EVAL_SETTINGS,
    ("eval", "attn-error"): options.EVAL_SETTINGS,
    ("eval", "agreement"): options.EVAL_SETTINGS,
}
#: options every reading command takes besides the settings
COMMON = ("--json", "--quiet")


def _command(path: tuple[str, ...]) -> Any:
    """The click command at ``path`` (typer may vendor its own click, so no isinstance checks)."""
    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    return cmd


def _options(cmd: Any) -> dict[str, Any]:
    return {opt: p for p in cmd.params if p.param_type_name == "option" for opt in p.opts}


def _declared(name: str) -> typer.models.OptionInfo:
    return options.SETTING_OPTIONS[name].__metadata__[0]


def test_the_reading_settings_are_every_setting_of_a_read() -> None:
    answering = {"max_new_tokens", "temperature", "top_p", "repetition_penalty", "no_repeat_ngram", "seed"}
    assert set(options.READ_SETTINGS) | answering == set(options.SETTING_OPTIONS)
    assert {"sinks", "recent", "positions", "threads"} <= set(options.EVAL_SETTINGS)


@pytest.mark.parametrize("path", list(READING), ids=" ".join)
def test_every_reading_command_has_every_reading_option(path: tuple[str, ...]) -> None:
    opts = _options(_command(path))
    for name in READING[path]:
        info = _declared(name)
        decls = [info.default, *info.param_decls] if isinstance(info.default, str) else list(info.param_decls)
        flag = next(d for d in decls if d.startswith("--"))
        assert flag in opts, f"kvtool {' '.join(path)} lacks {flag}"
        # the same declaration, not a copy: the same help text
        assert opts[flag].help == info.help, f"kvtool {' '.join(path)} {flag} is declared by hand"
    for flag in COMMON:
        assert flag in opts, f"kvtool {' '.join(path)} lacks {flag}"


def test_profile_takes_what_a_run_it_reproduces_takes() -> None:
    opts = _options(_command(("profile",)))
    for flag in (
        "--sinks",
        "--recent",
        "--positions",
        "--threads",
        "--recall",
        "--recall-page",
        "--recall-placement",
        "--archive-dtype",
    ):
        assert flag in opts
    assert "--threads" in _options(_command(("eval", "needle")))


def test_help_texts_say_what_the_code_does() -> None:
    threads = _declared("threads").help
    assert "divided" in threads and "1 when running several" not in threads
    for path, flag in (
        (("eval", "ppl"), "--text"),
        (("eval", "needle"), "--haystack"),
        (("eval", "agreement"), "--doc"),
    ):
        help_text = _options(_command(path))[flag].help or ""
        assert ".txt" not in help_text and "any format" in help_text, (path, flag)
    for path, flag in ((("eval", "needle"), "--needle"), (("eval", "needle"), "--seed")):
        assert "pass key" not in (_options(_command(path))[flag].help or "")
    r = CliRunner().invoke(app, ["eval", "--help"])
    assert "agreement" in r.stdout.split("Commands")[0]  # named in the group's own description too


def test_version() -> None:
    import kvtool

    r = CliRunner().invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout.strip() == f"kvtool {kvtool.__version__}"
    assert kvtool.__version__ == "0.2.0"


def test_the_sample_ships_with_the_package_and_is_evals_default() -> None:
    from kvtool.cli import eval as eval_cli
    from kvtool.data import sample_path

    path = sample_path()
    assert path.is_file() and 10_000 < path.stat().st_size < 40_000  # read in seconds
    assert "Irene Adler" in path.read_text(encoding="utf-8")
    assert Path(eval_cli.DEFAULT_INPUT) == path
    r = CliRunner().invoke(app, ["sample"])
    assert r.exit_code == 0 and Path(r.stdout.strip()) == path
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert '"data/*.txt"' in pyproject  # installed as package data


def test_policy_names_known_without_torch_are_the_registry() -> None:
    from kvtool import policy_syntax
    from kvtool.policies import REGISTRY

    assert set(policy_syntax.BASES) == set(REGISTRY.bases), "a new base policy: add its name to policy_syntax.BASES"
    assert set(policy_syntax.MODIFIERS) == set(REGISTRY.modifiers), "a new modifier: add it to MODIFIERS"


def test_summary_line() -> None:
    from kvtool.cli.ask import summary_line

    stats = {
        "document_tokens": 5000,
        "prefix_tokens": 30,
        "prefill_tokens_per_second": 412.3,
        "peak_memory_bytes": 1024**3,
        "recall_tokens": 0,
    }
    line = summary_line(stats, 14.26)
    assert line.startswith("answered in 14.3 s · 5,030 tokens read at 412 tok/s · peak 1.00 GiB · recall off")
    stats.update(recall_tokens=256, recalled_pages=40, recall_seconds=0.5, loaded_from="x.kvc", cache_load_seconds=0.25)
    line = summary_line(stats, 2.0, "summarized")
    assert "summarized in 2.0 s" in line and "loaded in 0.2 s" in line and "recall 256 tokens/head" in line


# --------------------------------------------------------------------------- end of run: one line or --stats


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tiny_checkpoint(tmp_path_factory.mktemp("opts") / "tiny"))


def test_end_of_run_is_one_line_unless_stats(model_dir: str, tmp_path: Path) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("The cache is small. " * 40, encoding="utf-8")
    base = [
        "ask",
        str(doc),
        "q",
        "--model",
        model_dir,
        "--budget",
        "160",
        "--block-size",
        "32",
        "--max-new-tokens",
        "3",
    ]
    short = CliRunner().invoke(app, base)
    assert short.exit_code == 0, short.output
    assert "answered in" in short.stderr and "tokens read at" in short.stderr
    assert "run summary" not in short.stderr and "time_split_seconds" not in short.stderr
    full = CliRunner().invoke(app, [*base, "--stats"])
    assert full.exit_code == 0, full.output
    assert "time_split_seconds" in full.stderr and "answered in" not in full.stderr
    quiet = CliRunner().invoke(app, [*base, "--quiet", "--json"])
    assert quiet.stderr == "" and "time_split_seconds" in json.loads(quiet.stdout)["stats"]


# --------------------------------------------------------------------------- validated before torch, in < 1 s


@pytest.fixture(scope="module")
def big_doc(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 100 MB text document: checks that read it would take minutes, so a fast error read none of it."""
    p = tmp_path_factory.mktemp("big") / "big.txt"
    line = ("All work and no play makes Jack a dull boy. " * 20 + "\n").encode()
    with open(p, "wb") as f:
        for _ in range(100 * 2**20 // len(line) + 1):
            f.write(line)
    return p


def _run_without_model(argv: list[str], cwd: Path) -> tuple[int, str, bool, float]:
    """Run the CLI in a fresh interpreter: exit code, stderr, whether torch got imported, seconds in main()."""
    code = (
        "import json, sys, time; from kvtool.cli.app import main; t = time.perf_counter(); "
        f"rc = main({argv!r}); print(json.dumps([rc, 'torch' in sys.modules, time.perf_counter() - t]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    rc, torch_loaded, seconds = json.loads(r.stdout.strip().splitlines()[-1])
    return rc, r.stderr, torch_loaded, seconds


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ask", "{doc}", " "], "question 1 is empty"),
        (["ask", "{doc}", "Who?", ""], "question 2 is empty"),
        (["summarize", "{doc}", "--length", "typo"], "--length"),
        (["ask", "{doc}", "q", "--policy", "h2oo"], "unknown policy 'h2oo'"),
        (["ask", "{doc}", "q", "--policy", "snapkv++caote"], "empty component"),
        (["ask", "{doc}", "q", "--policy", "+caote"], "empty component"),
        (["ask", "{doc}", "q", "--policy", "h2o+tova"], "two bases"),
        (["ask", "{doc}", "q", "--policy", "h2o+vatp+vatp"], "twice"),
        (["prefill", "{doc}", "-o", "{out}", "--policy", "keydif"], "unknown policy"),
        (["ask", "{doc}", "q", "--profile", "{bad_profile}"], "bogus"),
        (["profile", "--profile", "{bad_profile}"], "bogus"),
        (["profile", "--policy", "h2o+"], "empty component"),
        (["profile", "--memory", "lots"], "size"),
        (["profile", "--doc", "{doc}", "--sinks", "-1"], "sinks"),
        (["eval", "needle", "--threads", "0", "--haystack", "{doc}"], "threads"),
        (["eval", "ppl", "--policies", "h2o,tovaa", "--text", "{doc}"], "unknown policy"),
        (["eval", "needle", "--lengths", "typo"], "--lengths"),
        (["eval", "needle", "--depths", "1.5"], "depth"),
        (["eval", "ppl", "--context", "typo"], "--context"),
        (["eval", "attn-error", "--samples", "0"], "--samples"),
    ],
)
def test_bad_input_fails_before_torch_and_reading(big_doc: Path, tmp_path: Path, args: list[str], message: str) -> None:
    bad_profile = tmp_path / "bad.yaml"
    bad_profile.write_text("bogus_key: 1\n", encoding="utf-8")
    paths = {"doc": big_doc, "out": tmp_path / "out.kvc", "bad_profile": bad_profile}
    argv = [a.format(**paths) for a in args]
    rc, err, torch_loaded, seconds = _run_without_model(argv, tmp_path)
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message.lower() in lines[0].lower(), err
    assert not torch_loaded, f"torch was imported before {message!r} was reported"
    assert seconds < 3.0, f"{seconds:.2f} s before {message!r} was reported on a 100 MB document"  # reading: minutes
