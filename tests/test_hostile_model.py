"""Hostile model directories: code they name never runs, no library prompts, configs and chat templates are
checked and capped; each failure is one line with the documented exit code."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtool.cli.app import main
from kvtool.errors import UsageError
from tests.helpers import tiny_checkpoint, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
FAST = ["--budget", "128", "--block-size", "16", "--max-new-tokens", "2", "--device", "cpu", "-q"]
EVIL = """
import pathlib
pathlib.Path({marker!r}).write_text("the model directory's code ran")
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
class EvilConfig(LlamaConfig):
    model_type = "evil"
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
class EvilModel(LlamaForCausalLM):
    config_class = EvilConfig
"""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("hostile-model") / "tiny")


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _custom_code_dir(src: Path, dst: Path, marker: Path, config: bool = True) -> Path:
    """A checkpoint whose tokenizer (and, with ``config``, config) names a Python file of its own."""
    shutil.copytree(src, dst)
    (dst / "evil.py").write_text(EVIL.format(marker=str(marker)))
    if config:
        _edit_json(
            dst / "config.json",
            model_type="evil",
            auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"},
        )
    _edit_json(dst / "tokenizer_config.json", auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]})
    return dst


def _run(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "KVTOOL_DEBUG": ""}
    return subprocess.run(
        [sys.executable, "-c", "from kvtool.cli.app import entry; entry()", *args],
        input=stdin,
        capture_output=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )


def _answering_yes() -> bytes:
    """A document on stdin whose lines after the first 8 KiB (what kvtool sniffs) say ``y``."""
    head = ("the cache is small. " * 500)[: 8192 - 1] + "\n"
    return (head + "y\n" * 20 + "the cache is small. " * 100).encode()


@pytest.mark.parametrize("command", [["ask", "-", "What is small?"], ["prefill", "-", "-o", "out.kvc"]])
def test_code_from_the_model_directory_never_runs_even_when_the_document_answers_yes(tiny_dir, tmp_path, command):
    marker = tmp_path / "ran"
    evil = _custom_code_dir(tiny_dir, tmp_path / "evil", marker)
    command = [str(tmp_path / c) if c.endswith(".kvc") else c for c in command]
    flags = FAST if command[0] == "ask" else [f for f in FAST if f not in ("--max-new-tokens", "2")]
    r = _run(*command, "--model", str(evil), *flags, stdin=_answering_yes())
    err = r.stderr.decode()
    assert not marker.exists(), "custom code from the model directory ran"
    assert r.returncode == 2, err
    assert err.count("\n") == 1 and "never runs code from a model directory" in err and "auto_map" in err, err
    assert b"custom code" not in r.stdout and b"[y/N]" not in r.stdout + r.stderr  # nobody was asked
    assert not list(tmp_path.glob("*.kvc*"))


def test_a_tokenizer_naming_its_own_code_loads_the_library_class_instead(tiny_dir, tmp_path):
    marker = tmp_path / "ran"
    evil = _custom_code_dir(tiny_dir, tmp_path / "evil-tok", marker, config=False)
    r = _run("ask", "-", "What is small?", "--model", str(evil), *FAST, stdin=_answering_yes())
    assert not marker.exists(), "custom code from the tokenizer's auto_map ran"
    assert r.returncode == 0, r.stderr.decode()


def test_a_library_that_prompts_on_stdin_is_refused(tiny_dir, tmp_path, capsys, monkeypatch):
    import transformers

    def prompting(*args, **kwargs):
        return input("Do you wish to run the custom code? [y/N] ")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", prompting)
    doc = tmp_path / "d.txt"
    doc.write_text("the cache is small. " * 40)
    rc = main(["ask", str(doc), "q", "--model", str(tiny_dir), *FAST])
    out, err = capsys.readouterr()
    assert rc == 1 and not out, err
    assert err.count("\n") == 1 and "asked a question on stdin" in err and "never answers prompts" in err, err


# -- configs: a bad one is a bad model (exit 2), whichever check meets it first ------------------------------------
@pytest.mark.parametrize(
    "changes, words",
    [
        ({"num_hidden_layers": -5}, "num_hidden_layers must be >= 1"),
        ({"num_attention_heads": 0}, "num_attention_heads must be >= 1"),
        ({"hidden_size": "64"}, "hidden_size must be an integer from 1 to 262,144"),
        ({"text_config": {"num_key_value_heads": 2**40}}, "text_config.num_key_value_heads must be at most 4,096"),
        ({"model_type": "no-such-family"}, "model type 'no-such-family' is not one transformers"),
    ],
)
def test_a_bad_config_is_one_line_and_exit_2(tiny_dir, tmp_path, capsys, changes, words):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_dir, bad)
    _edit_json(bad / "config.json", **changes)
    doc = tmp_path / "d.txt"
    doc.write_text("the cache is small. " * 40)
    rc = main(["ask", str(doc), "q", "--model", str(bad), *FAST])
    out, err = capsys.readouterr()
    assert rc == 2 and not out, err
    assert err.count("\n") == 1 and words in err and "tokenizer" not in err and "internal error" not in err, err


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json"])
def test_a_huge_or_sparse_checkpoint_file_is_refused_unread(tiny_dir, tmp_path, capsys, name):
    bad = tmp_path / "sparse"
    shutil.copytree(tiny_dir, bad)
    with open(bad / name, "r+b") as f:
        f.truncate(1 << 30)  # a 1 GiB sparse file: nothing on disk, gigabytes if read
    started = time.monotonic()
    rc = main(["ask", str(REPO / "README.md"), "q", "--model", str(bad), *FAST])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "refused unread" in err and name in err, err
    assert time.monotonic() - started < 30


def test_a_fifo_in_the_checkpoint_is_refused_not_waited_on(tiny_dir, tmp_path, capsys):
    bad = tmp_path / "fifo"
    shutil.copytree(tiny_dir, bad)
    (bad / "generation_config.json").unlink(missing_ok=True)
    os.mkfifo(bad / "generation_config.json")
    rc = main(["ask", str(REPO / "README.md"), "q", "--model", str(bad), *FAST])
    err = capsys.readouterr().err
    assert rc == 2 and "not a regular file" in err, err


# -- chat templates: the checkpoint's code, rendered under caps ---------------------------------------------------
TEMPLATES = {
    "drops the message": ("{% for m in messages %}hello{% endfor %}", "drops the user's message"),
    "repeats the message": ("{{ messages[0]['content'] }}{{ messages[0]['content'] }}", "repeats the user's message"),
    "raises": ("{{ raise_exception('this template refuses') }}", "this template refuses"),
    "trips the sandbox": ("{{ messages.__class__.__mro__ }}", "SecurityError"),
    "syntax error": ("{% for %}", "TemplateSyntaxError"),
    "writes gigabytes": (
        "{% for a in range(99999) %}{% for b in range(99999) %}" + "x" * 1000 + "{% endfor %}"
        "{% endfor %}{{ messages[0]['content'] }}",
        "writes more than",
    ),
    "loops writing nothing": (
        "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}",
        "runs longer than",
    ),
    "doubles a string": (
        "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ messages[0]['content'] }}",
        "MiB of memory",
    ),
}


@pytest.mark.parametrize("case", list(TEMPLATES))
def test_a_hostile_chat_template_is_one_usage_error(case, monkeypatch):
    from kvtool.runtime import prompt

    if case != "doubles a string":  # the memory cap's case keeps the default time: on a loaded machine 1 s
        monkeypatch.setattr(prompt, "TEMPLATE_SECONDS", 1.0)  # can pass before 256 MiB have been doubled into
    template, words = TEMPLATES[case]
    tok = tiny_tokenizer()
    tok.chat_template = template
    started = time.monotonic()
    with pytest.raises(UsageError, match="the model's chat template") as info:
        prompt.question_suffix(tok, "Who is the narrator?")
    assert words in str(info.value) and "\n" not in str(info.value)
    assert time.monotonic() - started < 20
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}"  # the caps go away
    assert prompt.question_suffix(tok, "Who?").text.endswith("Who?")


def test_a_hostile_chat_template_in_the_checkpoint_exits_2_before_reading(tiny_dir, tmp_path, capsys):
    bad = tmp_path / "template"
    shutil.copytree(tiny_dir, bad)
    _edit_json(bad / "tokenizer_config.json", chat_template="{{ raise_exception('no chat here') }}")
    (bad / "chat_template.jinja").unlink(missing_ok=True)
    rc = main(["ask", str(REPO / "README.md"), "q", "--model", str(bad), *FAST])
    out, err = capsys.readouterr()
    assert rc == 2 and not out and err.count("\n") == 1 and "no chat here" in err, err


# -- one validation for a config, with or without its weights -------------------------------------------------------
def _config_text(tiny_dir: Path, case: str) -> str | None:
    """``config.json``'s text for a hostile ``case`` (None: the case makes the file itself)."""
    config = json.loads((tiny_dir / "config.json").read_text())
    edits = {
        "negative hidden_size": {"hidden_size": -64},
        "zero hidden_size": {"hidden_size": 0},
        "vocab 2^62": {"vocab_size": 2**62},
        "a billion layers": {"num_hidden_layers": 10**9},
        "no KV heads": {"num_key_value_heads": 0},
        "3 KV heads for 4": {"num_key_value_heads": 3},
        "heads that do not divide the hidden size": {"head_dim": None, "hidden_size": 66},
        "unknown model_type": {"model_type": "no-such-family"},
    }
    if case in edits:
        config.update(edits[case])
    elif case == "no model_type":
        del config["model_type"]
    elif case == "NaN":
        return json.dumps({**config, "rms_norm_eps": "@"}).replace('"@"', "NaN")
    elif case == "deeply nested":
        return json.dumps(config)[:-1] + ', "x": ' + "[" * 500 + "]" * 500 + "}"
    else:
        return None
    return json.dumps(config)


CONFIG_CASES = {  # case -> words its one line says, with or without the weights
    "negative hidden_size": "hidden_size must be >= 1: got -64",
    "zero hidden_size": "hidden_size must be >= 1: got 0",
    "vocab 2^62": "vocab_size must be at most 16,777,216",
    "a billion layers": "num_hidden_layers must be at most 1,024",
    "no KV heads": "num_key_value_heads must be >= 1: got 0",
    "3 KV heads for 4": "num_key_value_heads (3) must divide num_attention_heads (4)",
    "heads that do not divide the hidden size": "hidden size (66) is not a multiple of the number of attention heads",
    "no model_type": "names no model_type",
    "unknown model_type": "model type 'no-such-family' is not one transformers",
    "NaN": "NaN is not a JSON number",
    "deeply nested": "nested more than 32 levels deep",
    "a FIFO": "config.json is not a regular file",
    "/dev/zero": "config.json is not a regular file",
    "100 MB": "refused unread",
}

_DRIVER = """
import contextlib, io, json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.RLIM_INFINITY))
from kvtool.cli.app import main
import torch, transformers  # imported before the clock starts: each case is timed on its own
out = {}
for key, argv in json.loads(sys.argv[1]).items():
    err = io.StringIO()
    started = time.monotonic()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(argv)
    out[key] = [rc, err.getvalue(), time.monotonic() - started]
print(json.dumps(out))
"""


def test_a_config_is_refused_alike_whether_its_weights_are_there_or_not(tiny_dir, tmp_path):
    """``profile`` from a config alone used to check nothing the load path checks: each hostile config is now one
    line and exit 2 from ``profile`` with and without weights and from ``ask``, the same words every time, fast and
    under a 4 GiB address-space limit (a billion layers was a billion-entry list)."""
    runs = {}
    doc = tmp_path / "d.txt"
    doc.write_text("the cache is small. " * 40)
    for i, case in enumerate(CONFIG_CASES):
        weights, alone = tmp_path / f"w{i}", tmp_path / f"c{i}"
        shutil.copytree(tiny_dir, weights)
        alone.mkdir()
        for d in (weights, alone):
            config = d / "config.json"
            config.unlink(missing_ok=True)
            text = _config_text(tiny_dir, case)
            if text is not None:
                config.write_text(text)
            elif case == "a FIFO":
                os.mkfifo(config)
            elif case == "/dev/zero":
                config.symlink_to("/dev/zero")
            else:
                with open(config, "wb") as f:
                    f.truncate(100 << 20)
        runs[f"{case}|profile alone"] = ["profile", "--model", str(alone), "--device", "cpu"]
        runs[f"{case}|profile weights"] = ["profile", "--model", str(weights), "--device", "cpu", "-q"]
        runs[f"{case}|ask weights"] = ["ask", str(doc), "q", "--model", str(weights), *FAST]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "KVTOOL_HOME": str(tmp_path / "home")}
    r = subprocess.run(
        [sys.executable, "-c", _DRIVER, json.dumps(runs)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout.splitlines()[-1])
    bad = {}
    for key, (rc, err, seconds) in results.items():
        words = CONFIG_CASES[key.split("|")[0]]
        if not (rc == 2 and err.count("\n") == 1 and words in err and "internal error" not in err and seconds < 30):
            bad[key] = (rc, err.strip()[:200], round(seconds, 1))
    assert not bad, bad
