"""The command line through Typer's test runner, on a tiny checkpoint directory (fast)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvtool.cli.app import app
from tests.helpers import tiny_checkpoint

runner = CliRunner()
DOC = "The cache is small. " * 60 + "The pass key is 12345. " + "hello world. " * 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tiny_checkpoint(tmp_path_factory.mktemp("cli") / "tiny"))


@pytest.fixture
def doc(tmp_path):
    p = tmp_path / "doc.txt"
    p.write_text(DOC, encoding="utf-8")
    return str(p)


def run(*args, input=None):
    return runner.invoke(app, [str(a) for a in args], input=input)


def base(model_dir):
    return ["--model", model_dir, "--budget", "160", "--block-size", "32", "--max-new-tokens", "5", "--quiet"]


def test_plain_answer_on_stdout(model_dir, doc):
    r = run("ask", doc, "What is the pass key?", *base(model_dir))
    assert r.exit_code == 0, r.output
    assert r.stdout.strip()  # an answer (random weights: any text)
    assert "Traceback" not in r.output


def test_json_output_schema(model_dir, doc):
    r = run("ask", doc, "q1", "q2", *base(model_dir), "--json", "--policy", "h2o+vatp")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert [a["question"] for a in out["answers"]] == ["q1", "q2"]
    stats = out["stats"]
    for key in (
        "model",
        "policy",
        "budget",
        "block_size",
        "device",
        "dtype",
        "document_tokens",
        "cached_tokens_max",
        "prefill_seconds",
        "prefill_tokens_per_second",
        "decode_tokens_per_second",
        "kv_cache_bytes",
        "peak_memory_bytes",
    ):
        assert key in stats, key
    assert stats["policy"] == "h2o+vatp"
    assert stats["cached_tokens_max"] <= 160 + stats["recall_tokens"]  # recall (the default) adds its tokens
    assert stats["document_tokens"] > 160


def test_several_questions_reuse_one_read(model_dir, doc):
    one = json.loads(run("ask", doc, "q1", *base(model_dir), "--json").stdout)
    two = json.loads(run("ask", doc, "q1", "q2", "q1", *base(model_dir), "--json").stdout)
    assert two["answers"][0]["answer"] == two["answers"][2]["answer"] == one["answers"][0]["answer"]
    assert two["stats"]["document_tokens"] == one["stats"]["document_tokens"]


def test_jsonl_one_line_per_answer(model_dir, doc, tmp_path):
    qf = tmp_path / "q.txt"
    qf.write_text("first?\n\nsecond?\n", encoding="utf-8")
    r = run("ask", doc, "--questions-file", qf, *base(model_dir), "--jsonl")
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["question"] for x in lines[:2]] == ["first?", "second?"]
    assert "stats" in lines[2]


def test_stdin_document(model_dir):
    r = run("ask", "-", "q", *base(model_dir), "--json", input=DOC)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["stats"]["document_tokens"] > 160


def test_summarize_json(model_dir, doc):
    r = run("summarize", doc, "--length", "short", *base(model_dir), "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["length"] == "short" and "summary" in out and "stats" in out


def test_policies_json():
    r = run("policies", "--json")
    rows = {p["name"]: p for p in json.loads(r.stdout)["policies"]}
    assert rows["keydiff"]["needs_attention"] is False
    assert rows["h2o"]["needs_attention"] is True
    assert rows["caote"]["kind"] == "modifier"


@pytest.mark.parametrize(
    "args, message",
    [
        (["ask", "{missing}", "q"], "no such file"),
        (["ask", "{dir}", "q"], "directory"),
        (["ask", "{empty}", "q"], "empty"),
        (["ask", "{binary}", "q"], "binary"),
        (["ask", "{latin1}", "q"], "UTF-8"),
        (["ask", "{doc}", "q", "--policy", "nope"], "unknown policy"),
        (["ask", "{doc}", "q", "--policy", "keydiff+caote"], "attention-free"),
        (["ask", "{doc}", "q", "--policy", "h2o", "--policy-opt", "bogus=1"], "unknown policy option"),
        (["ask", "{doc}", "q", "--budget", "10"], "too small"),
        (["ask", "{doc}", "q", "--budget", "lots"], "budget"),
        (["ask", "{doc}", "q", "--block-size", "0"], "--block-size"),
        (["ask", "{doc}", "q", "--device", "tpu"], "device"),
        (["ask", "{doc}", "q", "--model", "{missing}"], "does not exist"),
        (["ask", "{doc}"], "question"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, doc, model_dir, args, message):
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    (tmp_path / "bin.dat").write_bytes(b"\x00\x01\x02abc")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    paths = {
        "missing": tmp_path / "nope.txt",
        "dir": tmp_path,
        "empty": tmp_path / "empty.txt",
        "binary": tmp_path / "bin.dat",
        "latin1": tmp_path / "latin1.txt",
        "doc": doc,
    }
    argv = [a.format(**paths) for a in args]
    if "--model" not in argv:
        argv += ["--model", model_dir]
    r = run(*argv)
    assert r.exit_code == 2, r.output
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and message.lower() in err[0].lower(), r.stderr
    assert "Traceback" not in r.output


def test_main_returns_exit_codes_for_parser_errors(capsys):
    from kvtool.cli.app import main

    assert main(["ask", "x", "q", "--no-such-flag"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such option" in err[0].lower()


def test_ctrl_c_during_prefill_exits_130_with_one_line(model_dir, doc, monkeypatch):
    from kvtool.runtime.session import Session

    def interrupted(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(Session, "read", interrupted)
    r = run("ask", doc, "q", *base(model_dir))
    assert r.exit_code == 130
    assert r.stderr.strip().splitlines() == ["kvtool: interrupted"]


def test_ctrl_c_during_decoding_exits_130(model_dir, doc, monkeypatch):
    from kvtool.core.engine import Engine

    def interrupted(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "generate", interrupted)
    r = run("ask", doc, "q", *base(model_dir), "--json")
    assert r.exit_code == 130 and r.stdout == ""
