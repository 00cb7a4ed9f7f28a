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
        _edit_json(dst / "config.json", model_type="evil",
                   auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"})
    _edit_json(dst / "tokenizer_config.json", auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]})
    return dst


def _run(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "KVTOOL_DEBUG": ""}
    return subprocess.run([sys.executable, "-c", "from kvtool.cli.app import entry; entry()", *args], input=stdin,
                          capture_output=True, env=env, cwd=REPO, timeout=300)


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
@pytest.mark.parametrize("changes, words", [
    ({"num_hidden_layers": -5}, "num_hidden_layers must be a positive integer"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
    ({"hidden_size": "64"}, "hidden_size must be a positive integer"),
    ({"text_config": {"num_key_value_heads": 2**40}}, "text_config.num_key_value_heads"),
    ({"model_type": "no-such-family"}, "could not read the model config"),
])
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
    "writes gigabytes": ("{% for a in range(99999) %}{% for b in range(99999) %}" + "x" * 1000 + "{% endfor %}"
                         "{% endfor %}{{ messages[0]['content'] }}", "writes more than"),
    "loops writing nothing": ("{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"
                              "{{ messages[0]['content'] }}", "runs longer than"),
    "doubles a string": ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                         "{% endfor %}{{ messages[0]['content'] }}", "MiB of memory"),
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
