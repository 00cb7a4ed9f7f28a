"""Sizes read from options, profiles and files: checked against what the document and model can need before
anything is allocated; every file read whole is read with a cap; numbers too large for torch are one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvtool.cli.app import main
from kvtool.errors import UsageError
from tests import test_hostile_kvc as hk
from tests.helpers import tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
DOC = " ".join(["the river ran past the old castle and the king slept"] * 40) + "\n"
READ = ["--budget", "128", "--block-size", "16", "--device", "cpu", "-q"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-limits")
    model = tiny_checkpoint(root / "tiny")
    doc = root / "doc.txt"
    doc.write_text(DOC, encoding="utf-8")
    kvcs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVTOOL_HOME", str(root / "home"))
        mp.setenv("KVTOOL_ARCHIVE_DIR", str(root))
        for policy in ("h2o", "scissorhands"):
            kvcs[policy] = root / f"{policy}.kvc"
            assert (
                main(
                    [
                        "prefill",
                        str(doc),
                        "-o",
                        str(kvcs[policy]),
                        "--model",
                        str(model),
                        "--policy",
                        policy,
                        "--recall",
                        "64",
                        *READ,
                    ]
                )
                == 0
            )
    return SimpleNamespace(root=root, model=str(model), doc=doc, kvc=kvcs)


@pytest.fixture(autouse=True)
def _dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTOOL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KVTOOL_ARCHIVE_DIR", str(tmp_path))


def one_line(capsys, args, code: int = 2) -> str:
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == code and len(lines) == 1 and "Traceback" not in err and "internal error" not in err, err
    return lines[0]


def with_pair(env, tmp_path: Path, policy: str, edit) -> Path:
    """A copy of ``policy``'s cache (its archive beside it) with its metadata edited, checksum recomputed."""
    _, meta, _ = hk.read_frame(env.kvc[policy])
    arch = meta["archive"]["file"]
    (tmp_path / arch).write_bytes((env.root / arch).read_bytes())
    return hk.rewrite(env.kvc[policy], tmp_path / "c.kvc", edit)


# -- numbers past what torch takes: one line, exit 2, before the model loads ------------------------------------
@pytest.mark.parametrize(
    "flags, words",
    [
        (["--budget", "99999999999999999999"], "budget must be at most"),
        (["--budget", "99999999999999999999TiB"], "budget must be at most"),
        (["--sinks", "99999999999999999999"], "--sinks must be at most"),
        (["--max-new-tokens", "99999999999999999999"], "--max-new-tokens must be at most"),
        (["--recall", "99999999999999999999"], "recall must be at most"),
        (["--threads", "99999999999"], "--threads must be at most"),
        (["--recall-page", "1073741824"], "--recall-page must be at most"),
        (["--policy", "snapkv", "--policy-opt", "window=99999999999999999999"], "out of range"),
    ],
)
def test_numbers_too_large_are_one_line_before_the_model_loads(env, capsys, flags, words):
    started = time.monotonic()
    line = one_line(capsys, ["ask", env.doc, "q", "--model", "/nonexistent-model-dir", *flags])
    assert words in line, line
    assert time.monotonic() - started < 5


# -- policy options sizing per-token state -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "opts, words",
    [
        (["window=1000000000", "buckets=1000000000"], "buckets=1000000000 must be between 1 and window (at most 1024"),
        (["window=4096", "buckets=2048"], "at most 1024"),
    ],
)
def test_scissorhands_buckets_are_capped(env, capsys, opts, words):
    args = ["ask", env.doc, "q", "--model", env.model, "--policy", "scissorhands", *READ]
    for o in opts:
        args += ["--policy-opt", o]
    assert words in one_line(capsys, args)


def test_snapkv_kernel_is_capped(env, capsys):
    line = one_line(
        capsys,
        ["ask", env.doc, "q", "--model", env.model, "--policy", "snapkv", "--policy-opt", "kernel=999999999", *READ],
    )
    assert "at most 1023" in line


def test_scissorhands_options_inside_a_kvc_are_capped_too(env, tmp_path, capsys):
    def huge(meta):
        for where in (meta["settings"]["policy_options"], meta["policy"]["options"]):
            where.update({"window": 1_000_000_000, "buckets": 1_000_000_000})

    kvc = with_pair(env, tmp_path, "scissorhands", huge)
    line = one_line(capsys, ["ask", kvc, "q", "--model", env.model, "--max-new-tokens", "2", "-q"])
    assert "buckets=1000000000" in line


# -- recall sized by what the archive holds, not by a page size or a 'seen' the file claims ----------------------
def test_a_page_far_longer_than_the_archive_scores_only_what_was_archived():
    from kvtool.core.archive import GroupArchive
    from kvtool.core.archive_stores import MemoryStore

    a = GroupArchive(2, 8, torch.float32, 1 << 20, MemoryStore)
    n = 100
    a.append(torch.randn(2, n, 8), torch.randn(2, n, 8), torch.arange(n).expand(2, n))
    q = torch.randn(2, 3, 8)
    chunks = list(a.scores(q, a.candidate_pages(q, None)))
    assert sum(s.shape[2] for _, s in chunks) == n  # a 2^20-token page: 100 scores, not 2^20
    a.close()


def _ask_limited(env, kvc: Path, limit_gib: float) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, ({int(limit_gib * 2**30)}, resource.RLIM_INFINITY))
        from kvtool.cli.app import main
        sys.exit(main(["ask", {str(kvc)!r}, "what is the castle", "--model", {env.model!r}, "--max-new-tokens", "2",
                       "--json"]))
    """)
    run_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=run_env, timeout=300)


@pytest.mark.parametrize("seen", [2**30, 2**40])
def test_a_kvc_claiming_more_tokens_seen_than_it_holds_answers_without_recall(env, tmp_path, seen):
    def claim(meta):
        meta["cache"]["seen"] = seen
        meta["document"]["tokens"] = seen - meta["prompt"]["prefix_tokens"]
        meta["document"].pop("source_map", None)

    kvc = with_pair(env, tmp_path, "h2o", claim)
    r = _ask_limited(env, kvc, 3)  # recall's per-position table of 2^30 floats alone is 4 GiB
    assert r.returncode == 0, r.stderr
    assert "answering without recall" in r.stderr and "internal error" not in r.stderr, r.stderr
    assert json.loads(r.stdout)["stats"]["recalled_pages"] == 0


def test_archived_positions_past_the_tokens_seen_are_not_used(env, tmp_path, capsys):
    from kvtool.kvc import archive as kvc_archive

    kvc = with_pair(env, tmp_path, "h2o", lambda meta: None)
    original = kvc_archive._read_tensor

    def crafted(fd, header, name, digest):  # what a crafted archive would hold (its checksum aside)
        t = original(fd, header, name, digest)
        return t + 2**30 if name.endswith(".positions") else t

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kvc_archive, "_read_tensor", crafted)
        rc, out, err = hk.cli(capsys, "ask", kvc, "what is the castle", "--model", env.model, "--max-new-tokens", "2")
    assert rc == 0 and "positions lie outside the tokens the cache has read" in err, err


# -- .kvc headers: counted before they are built -------------------------------------------------------------------
def _with_tensors(src: Path, dst: Path, extra: dict) -> Path:
    header, _, data = hk.read_frame(src)
    header.update(extra)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    dst.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return dst


def test_a_header_of_a_million_empty_tensors_is_refused_before_it_is_built(env, tmp_path, capsys):
    empty = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
    kvc = _with_tensors(env.kvc["h2o"], tmp_path / "many.kvc", {f"x{i}": empty for i in range(300_000)})
    started = time.monotonic()
    line = one_line(capsys, ["inspect", kvc])
    assert "corrupted" in line and "JSON objects" in line, line
    assert time.monotonic() - started < 20


def test_tensors_that_belong_to_no_layer_group_are_refused(env, tmp_path, capsys):
    empty = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
    kvc = _with_tensors(env.kvc["h2o"], tmp_path / "stray.kvc", {f"l{900 + i}.g0.keys": empty for i in range(10)})
    for args in (["inspect", kvc], ["ask", kvc, "q", "--model", env.model, "-q"]):
        assert "belongs to no layer group" in one_line(capsys, args)


# -- profiles: read with a cap, YAML with an alias and a depth cap, values shown bounded ---------------------------
def _laughs(levels: int, key: str) -> str:
    """A "billion laughs": each level refers to the one before nine times; ``key`` holds the last level."""
    text = "a0: &a0 [lol,lol,lol,lol,lol,lol,lol,lol,lol]\n"
    text += "".join(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]\n" for i in range(1, levels + 1))
    return text + f"{key}: *a{levels}\n"


@pytest.mark.parametrize(
    "name, text, words",
    [
        ("laughs", _laughs(12, "budget"), "more than 100 YAML aliases"),  # 109 aliases, 9^12 strings if walked
        (
            "laughs under the cap",
            "description: [&a0 [lol,lol], "
            + ", ".join(f"&a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9))
            + "]\n",
            "description must be text",
        ),  # 72 aliases, a value of 2·9^8 strings repr'd into the message: shown bounded
        ("deep", "budget: " + "[" * 100_000 + "]" * 100_000 + "\n", "nested more than"),
        ("keys", "".join(f"k{i}: {i}\n" for i in range(60_000)), "larger than 256 KiB"),
    ],
)
def test_hostile_profiles_are_one_line_fast(env, tmp_path, capsys, name, text, words):
    profile = tmp_path / "p.yaml"
    profile.write_text(text)
    started = time.monotonic()
    line = one_line(capsys, ["ask", env.doc, "q", "--profile", profile, "--model", env.model])
    assert words in line and len(line) < 600, line
    assert time.monotonic() - started < 10


def test_a_profile_value_is_shown_bounded(env, tmp_path, capsys):
    profile = tmp_path / "long.yaml"
    profile.write_text("budget: " + "x" * 100_000 + "\n")
    line = one_line(capsys, ["ask", env.doc, "q", "--profile", profile, "--model", env.model])
    assert "budget must be" in line and len(line) < 400, line


# -- every number a command or a profile takes: capped where it is parsed, the range in the message ----------------
CAPPED_OPTIONS = [  # (command line, the cap the line must name); none may reach the model or a document
    (["ask", "{doc}", "q", "--max-new-tokens", "1000000000"], "--max-new-tokens must be at most 1,048,576"),
    (["summarize", "{doc}", "--max-new-tokens", "1000000000"], "--max-new-tokens must be at most 1,048,576"),
    (["ask", "{doc}", "q", "--temperature", "1e9"], "--temperature must be at most 100"),
    (["ask", "{doc}", "q", "--temperature", "nan"], "--temperature must be a number from 0 to 100"),
    (["ask", "{doc}", "q", "--top-p", "0"], "--top-p must be > 0"),
    (["ask", "{doc}", "q", "--top-p", "inf"], "--top-p must be a number in (0, 1]"),
    (["ask", "{doc}", "q", "--repetition-penalty", "1e300"], "--repetition-penalty must be at most 100"),
    (["ask", "{doc}", "q", "--no-repeat-ngram", "1000000000"], "--no-repeat-ngram must be at most 256"),
    (["ask", "{doc}", "q", "--seed", "99999999999999999999999"], "--seed must be at most 18,446,744,073,709,551,615"),
    (["ask", "{doc}", "q", "--block-size", str(2**41)], "--block-size must be at most 1,099,511,627,776"),
    (["ask", "{doc}", "q", "--recent", str(2**41)], "--recent must be at most 1,099,511,627,776"),
    (["prefill", "{doc}", "-o", "{out}", "--recall-page", str(2**21)], "--recall-page must be at most 1,048,576"),
    (["ask", "{doc}", "--question", "q", "--ray", "local", "--workers", "1000000"], "--workers must be at most 1,024"),
    (["profile", "--doc-tokens", str(2**41)], "--doc-tokens must be at most 1,099,511,627,776"),
    (["profile", "--memory", "2000000TiB"], "size must be at most 1,152,921,504,606,846,976 bytes"),
    (["calibrate", "--k", "100000000"], "--k must be at most 16,384"),
    (["calibrate", "--induction", "1.5"], "--induction must be at most 1"),
    (["calibrate", "--echo", "-0.5"], "--echo must be >= 0"),
    (["eval", "needle", "--trials", "1000000000"], "--trials must be at most 10,000"),
    (["eval", "needle", "--lengths", "1000000000"], "--lengths must be at most 4,194,304"),
    (["eval", "needle", "--max-new-tokens", "1000000000"], "--max-new-tokens must be at most 1,048,576"),
    (["eval", "needle", "--seed", str(2**70)], "--seed must be at most"),
    (["eval", "ppl", "--samples", "1000000000"], "--samples must be at most 10,000"),
    (["eval", "ppl", "--context", "8m", "--samples", "1"], "--context must be at most 4,194,304"),
    (["eval", "attn-error", "--continuation", "99999999"], "--continuation must be at most 4,194,304"),
    (
        ["eval", "agreement", "--doc", "{doc}", "--questions-file", "{doc}", "--first-tokens", "1000000000"],
        "--first-tokens must be at most 1,048,576",
    ),
]


@pytest.mark.parametrize("args, words", CAPPED_OPTIONS, ids=[" ".join(a[:2] + a[-2:]) for a, _ in CAPPED_OPTIONS])
def test_every_numeric_option_is_capped_where_it_is_parsed(env, tmp_path, capsys, args, words):
    started = time.monotonic()
    argv = [a.format(doc=env.doc, out=tmp_path / "o.kvc") for a in args]
    line = one_line(capsys, [*argv, "--model", "/nonexistent-model-dir"] if argv[0] != "eval" else argv)
    assert words in line, line
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    "text, words",
    [
        ("generation:\n  max_new_tokens: 1000000000\n", "generation.max_new_tokens must be at most 1,048,576"),
        ("generation:\n  max_new_tokens: 1.0e9\n", "generation.max_new_tokens must be an integer from 1 to 1,048,576"),
        ("generation:\n  temperature: .nan\n", "generation.temperature must be a number from 0 to 100"),
        ("generation:\n  top_p: 0\n", "generation.top_p must be > 0"),
        ("generation:\n  no_repeat_ngram: 100000\n", "generation.no_repeat_ngram must be at most 256"),
        ("block_size: 99999999999999\n", "block_size must be at most 1,099,511,627,776"),
        ("recall_page: 99999999\n", "recall_page must be at most 1,048,576"),
        ("threads: 100000\n", "threads must be at most 4,096"),
        ("budget: 99999999999999\n", "budget must be at most 1,099,511,627,776 tokens"),
    ],
)
def test_every_number_in_a_profile_is_capped_where_it_is_parsed(env, tmp_path, capsys, text, words):
    profile = tmp_path / "p.yaml"
    profile.write_text(text)
    line = one_line(capsys, ["ask", env.doc, "q", "--profile", profile, "--model", "/nonexistent-model-dir"])
    assert words in line and str(profile) in line, line


def test_every_setting_that_is_a_number_has_a_range():
    """The sweep is complete: each numeric setting is checked through ``numbers.capped`` with its ``LIMITS`` entry."""
    from kvtool.numbers import LIMITS
    from kvtool.runtime.settings import Settings

    numeric = [f for f, v in vars(Settings()).items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    assert numeric and set(numeric) | {"threads", "block_size"} <= set(LIMITS), set(numeric) - set(LIMITS)
    for name in numeric:
        with pytest.raises(UsageError, match=f"^{name} must be"):
            Settings(**{name: 10**30}).validate()


def test_the_answer_buffer_grows_with_the_answer_not_with_the_limit():
    from kvtool.core.sampling import Chooser
    from kvtool.numbers import MAX_NEW_TOKENS

    chooser = Chooser(MAX_NEW_TOKENS, "cpu")  # the longest answer allowed: 8 MiB if sized by the option
    assert chooser.ids.numel() <= 1024
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3000, 50, generator=gen)
    for t in range(3000):  # longer than the first room: grown (doubling), every token kept
        chooser(logits[t], t)
    assert chooser.read(0, 3000) == logits.argmax(-1).tolist()
    assert 3000 <= chooser.ids.numel() <= 4096


def test_a_billion_new_tokens_is_refused_within_bounded_memory(env):
    """Under a 3 GiB address-space limit: the option was an 8 GB allocation before the first token."""
    code = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, ({3 * 2**30}, resource.RLIM_INFINITY))
        from kvtool.cli.app import main
        sys.exit(main(["ask", {str(env.doc)!r}, "q", "--model", {env.model!r}, "--max-new-tokens", "1000000000",
                       "--device", "cpu", "-q"]))
    """)
    run_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "KVTOOL_HOME": str(env.root / "h")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=run_env, timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "at most 1,048,576" in r.stderr, r.stderr


def test_every_range_is_in_the_docs():
    """docs/cli.md's "Limits" lists each range of ``numbers.LIMITS`` and each config key of ``CONFIG_LIMITS``."""
    import re

    from kvtool.numbers import CONFIG_LIMITS, LIMITS

    page = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    section = re.search(r"^## Limits\n(.*?)(?=^## )", page, re.S | re.M).group(1)
    missing = [k for k, r in LIMITS.items() if r.span() not in section]
    rows = {line for line in section.splitlines() if line.startswith("| `")}
    missing += [k for k, r in CONFIG_LIMITS.items() if not any(f"`{k}`" in row and r.span() in row for row in rows)]
    assert not missing, missing
