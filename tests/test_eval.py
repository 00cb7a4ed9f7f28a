"""kvtool eval: metrics by hand, needle insertion, ppl/attn-error invariants and the --json schemas.

Everything runs on a tiny random Llama with a byte-level tokenizer (one token per ASCII character), so the
whole file takes seconds on CPU.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers

from kvtool.cli.app import main
from kvtool.errors import UsageError
from kvtool.eval import make_grid, parse_policies, parse_token_list, text_document
from kvtool.eval.metrics import (
    contains_answer,
    kl_divergence,
    mean_nll,
    normalised_error,
    perplexity,
    top1_agreement,
)
from kvtool.eval.needle import Haystack, custom_needle, insert_needle, passkey_needle, sentence_boundaries
from kvtool.eval.ppl import dense_logits, pick_offsets, stream_logits
from tests.helpers import VOCAB, byte_tokenizer, make_engine, tiny_byte_checkpoint, tiny_llama

# --------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_byte_checkpoint(tmp_path_factory.mktemp("eval") / "tiny-byte-llama")


SENTENCES = [
    "The river ran north past the old mill.",
    "Nobody remembered who built it!",
    "Was it the baker or the smith?",
    "Rain fell for three days and the roads turned to mud.",
]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "story.txt"
    path.write_text(" ".join(SENTENCES * 20), encoding="utf-8")  # ~3.3k bytes = tokens
    return path


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    code = main([*argv, "--json", "--quiet"])
    out = capsys.readouterr()
    assert code == 0, out.err
    lines = out.out.strip().splitlines()
    assert len(lines) == 1, out.out
    rep = json.loads(lines[0])
    assert set(rep) >= {"task", "settings", "results", "seconds"}
    assert isinstance(rep["seconds"], float)
    return rep


# --------------------------------------------------------------------------------------------- metrics


def test_perplexity_by_hand() -> None:
    uniform = torch.zeros(3, 4)
    assert perplexity(uniform, torch.tensor([0, 1, 3])) == pytest.approx(4.0)
    # p(target) = 3/4 and 1/4: mean NLL = (ln 4/3 + ln 4) / 2
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]])
    nll = (math.log(4 / 3) + math.log(4)) / 2
    assert mean_nll(logits, torch.tensor([1, 0])) == pytest.approx(nll)
    assert perplexity(logits, torch.tensor([1, 0])) == pytest.approx(math.exp(nll))


def test_kl_by_hand() -> None:
    p = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    assert kl_divergence(p, p) == pytest.approx(0.0, abs=1e-7)
    q = torch.log(torch.tensor([[0.25, 0.75], [0.9, 0.1]]))
    row0 = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert kl_divergence(p, q) == pytest.approx(row0 / 2, rel=1e-5)  # mean over the 2 positions
    assert kl_divergence(p + 7.0, p) == pytest.approx(0.0, abs=1e-7)  # logits, not probabilities


def test_top1_agreement_by_hand() -> None:
    p = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 1.0], [0.0, 3.0]])
    q = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 3.0]])
    assert top1_agreement(p, q) == 0.5
    assert top1_agreement(p, p) == 1.0


def test_normalised_error_by_hand() -> None:
    a = torch.tensor([[3.0, 4.0], [1.0, 0.0]])  # 2 heads, d = 2
    b = torch.tensor([[0.0, 4.0], [1.0, 0.0]])
    assert normalised_error(a, b) == pytest.approx((3 / 5 + 0) / 2)
    assert normalised_error(a, a) == 0.0
    tokens = torch.stack([a, a])  # leading token dim averages too
    assert normalised_error(tokens, torch.stack([b, a])) == pytest.approx(0.15)


def test_contains_answer() -> None:
    assert contains_answer("The pass key is 48213.", "48213")
    assert contains_answer("It is  New\n York", "new york")  # whitespace and case normalised
    assert not contains_answer("It is New York", "new york", case_sensitive=True)
    assert not contains_answer("4821 3", "48213")
    assert not contains_answer("anything", "  ")


# --------------------------------------------------------------------------------------------- needle


def test_passkey_needle_is_seeded_per_trial() -> None:
    a, b = passkey_needle(0, 0), passkey_needle(0, 1)
    assert a == passkey_needle(0, 0) and a != b
    assert a.question == "What is the secret number?"
    assert a.answer.isdigit() and len(a.answer) == 5 and a.text.count(a.answer) == 2


def test_insert_needle_depth_0_and_1_exact() -> None:
    hay = " ".join(SENTENCES)
    doc, at = insert_needle(hay, "NEEDLE.", 0.0)
    assert at == 0 and doc == "NEEDLE. " + hay
    doc, at = insert_needle(hay, "NEEDLE.", 1.0)
    assert doc == hay + " NEEDLE." and doc[at:] == "NEEDLE."


def test_insert_needle_middle_on_sentence_boundary() -> None:
    hay = " ".join(SENTENCES * 3)
    doc, at = insert_needle(hay, "NEEDLE.", 0.5)
    assert doc[at : at + 7] == "NEEDLE."
    assert doc[: at - 1].endswith((".", "!", "?"))  # right after a sentence end
    assert doc.replace(" NEEDLE.", "", 1) == hay
    boundaries = sentence_boundaries(hay)
    nearest = min(abs(b - len(hay) / 2) for b in boundaries)
    assert abs((at - 1) - len(hay) / 2) == nearest


def test_insert_needle_without_sentences_falls_back_to_whitespace() -> None:
    doc, at = insert_needle("aaa bbb ccc ddd", "N", 0.5)
    assert doc == "aaa bbb N ccc ddd" or doc == "aaa bbb ccc N ddd" or doc == "aaa N bbb ccc ddd"
    assert doc[at] == "N"


def test_haystack_cut_and_repeat() -> None:
    tok = byte_tokenizer()
    hay = Haystack("Short text. Very short.", tok, 100)
    assert hay.repeated
    text, starts = hay.cut(60)
    assert len(tok(text, add_special_tokens=False)["input_ids"]) == 60 and len(starts) == 60
    hay = Haystack(" ".join(SENTENCES * 10), tok, 100)
    assert not hay.repeated and hay.cut(10)[0] == SENTENCES[0][:10]


def test_text_document_reads_like_a_file() -> None:
    from kvtool.documents import iter_text

    text = "x" * 10000 + " é " + "y" * 100
    assert "".join(iter_text(text_document(text, "<t>"))) == text


def test_custom_needle_needs_all_three() -> None:
    assert custom_needle(None, None, None) is None
    with pytest.raises(UsageError):
        custom_needle("The code is 7.", None, "7")
    assert custom_needle("The  code is 7.", "Code?", "7").text == "The code is 7."


# --------------------------------------------------------------------------------------------- options


def test_grid_full_once_and_validation() -> None:
    grid = make_grid("sink,h2o+vatp", "256,1k", always_full=True)
    assert [r.label for r in grid.runs()] == ["full", "sink@256", "sink@1024", "h2o+vatp@256", "h2o+vatp@1024"]
    assert parse_token_list("1k,2k", "--lengths") == [1024, 2048]
    for bad in ("nope", "sink+vatp", "h2o+nope"):
        with pytest.raises(UsageError):
            parse_policies(bad)
    with pytest.raises(UsageError, match="too small"):
        make_grid("sink", "10")


def test_pick_offsets_deterministic_and_in_range() -> None:
    a = pick_offsets(1000, 100, 4, seed=3)
    assert a == pick_offsets(1000, 100, 4, seed=3) and a != pick_offsets(1000, 100, 4, seed=4)
    assert all(250 * i <= o <= 250 * i + 150 for i, o in enumerate(a))  # one per segment, no overlap
    assert all(0 <= o <= 50 for o in pick_offsets(150, 100, 5, seed=0))
    with pytest.raises(UsageError):
        pick_offsets(50, 100, 1, seed=0)


# --------------------------------------------------------------------------------------------- ppl / attn-error


def test_full_matches_dense_and_eviction_does_not() -> None:
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (80,), generator=torch.Generator().manual_seed(0))
    n, m = 64, 16
    dense = dense_logits(model, ids, m)
    targets = ids[n:]
    full = stream_logits(make_engine(model, "full", None, block_size=16), ids, n)
    assert perplexity(full, targets) == pytest.approx(perplexity(dense, targets), rel=1e-5)
    assert kl_divergence(dense, full) == pytest.approx(0.0, abs=1e-6)
    assert top1_agreement(dense, full) == 1.0
    sink = stream_logits(make_engine(model, "sink", 16, block_size=16), ids, n)
    assert kl_divergence(dense, sink) > 1e-6


def test_cli_ppl_json(tiny_dir: Path, text_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["eval", "ppl", "--text", str(text_file), "--model", str(tiny_dir), "--context", "64", "--continuation",
            "6", "--samples", "2", "--policies", "full,sink", "--budgets", "24", "--block-size", "32"]
    rep = run_json(argv, capsys)
    assert rep["task"] == "ppl"
    s = rep["settings"]
    assert s["context"] == 64 and s["continuation"] == 6 and s["samples"] == 2 and len(s["windows"]) == 2
    assert s["model"] == "tiny-byte-llama" and s["budgets"] == [24] and s["policies"] == ["full", "sink"]
    assert rep["reference"]["ppl"] > 1
    full, sink = rep["results"]
    keys = {
        "policy",
        "budget",
        "ppl",
        "dense_ppl",
        "ppl_gap",
        "ppl_gap_pct",
        "kl",
        "top1",
        "tokens",
        "seconds",
        "samples",
        "window_gap_pct",
        "kl_interval",
        "top1_interval",
        "best",
        "significant",
    }
    assert set(full) == keys and set(sink) == keys
    assert (full["policy"], full["budget"], sink["policy"], sink["budget"]) == ("full", None, "sink", 24)
    assert abs(full["ppl_gap"]) < 1e-3 * full["dense_ppl"] and abs(full["ppl_gap_pct"]) < 0.1
    assert full["kl"] == pytest.approx(0.0, abs=1e-5) and full["top1"] == 1.0 and full["tokens"] == 12
    assert sink["kl"] > 0
    assert set(full["samples"][0]) == {"window", "ppl", "dense_ppl", "kl", "top1"}
    # rows are compared within their budget: full (no budget) and sink @ 24 are each alone in theirs
    assert not full["best"] and not sink["best"] and not full["significant"] and not sink["significant"]
    lo, hi = sink["window_gap_pct"]["low"], sink["window_gap_pct"]["high"]
    assert lo <= sink["window_gap_pct"]["value"] <= hi
    # deterministic under --seed
    again = run_json(argv, capsys)
    assert again["results"][1]["ppl"] == sink["ppl"] and again["settings"]["windows"] == s["windows"]


def test_cli_attn_error_json(tiny_dir: Path, text_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rep = run_json(
        [
            "eval",
            "attn-error",
            "--text",
            str(text_file),
            "--model",
            str(tiny_dir),
            "--context",
            "64",
            "--continuation",
            "6",
            "--samples",
            "1",
            "--policies",
            "full,sink",
            "--budgets",
            "16",
        ],
        capsys,
    )
    assert rep["task"] == "attn-error"
    assert rep["settings"]["num_layers"] == 2 and rep["settings"]["num_heads"] == 4
    full, sink = rep["results"]
    assert set(full) == {"policy", "budget", "layers", "mean", "max", "mean_interval"}
    assert full["layers"] == [0.0, 0.0] and full["mean"] == 0.0
    assert all(e > 0 for e in sink["layers"]) and sink["budget"] == 16


def test_cli_needle_json(tiny_dir: Path, text_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rep = run_json(
        [
            "eval",
            "needle",
            "--haystack",
            str(text_file.parent),
            "--model",
            str(tiny_dir),
            "--lengths",
            "200,300",
            "--depths",
            "0,1",
            "--policies",
            "sink",
            "--budgets",
            "160",
            "--max-new-tokens",
            "3",
            "--trials",
            "2",
        ],
        capsys,
    )
    assert rep["task"] == "needle"
    s = rep["settings"]
    assert s["lengths"] == [200, 300] and s["depths"] == [0.0, 1.0] and s["trials"] == 2
    assert s["needle"] == "passkey" and s["policies"] == ["full", "sink"]  # full always included
    cells = rep["results"]
    assert len(cells) == 2 * 2 * 2
    keys = {"policy", "budget", "recall", "select", "length", "depth", "needle_token", "document_tokens", "trials",
            "correct", "accuracy", "answers", "interval"}
    assert all(set(c) == keys for c in cells)
    assert {(c["policy"], c["budget"]) for c in cells} == {("full", None), ("sink", 160)}
    for c in cells:
        assert len(c["answers"]) == 2
        assert set(c["answers"][0]) == {"trial", "expected", "answer", "correct", "recall_seconds"}
        assert c["accuracy"] == c["correct"] / 2
        assert c["interval"][0] <= c["accuracy"] <= c["interval"][1]
        assert abs(c["document_tokens"] - c["length"]) <= 2  # byte tokenizer: ≈ exact length
        needle = passkey_needle(0, 0).text
        if c["depth"] == 0:
            assert c["needle_token"] == 0
        else:  # at the very end: every token but the needle (and its separating space) is haystack
            assert c["needle_token"] == c["document_tokens"] - len(needle) - 1
    keys = {c["answers"][0]["expected"] for c in cells}
    assert keys == {passkey_needle(0, 0).answer}
    assert {(r["policy"], r["budget"]) for r in rep["summary"]} == {("full", None), ("sink", 160)}
    for r in rep["summary"]:  # 95% Wilson interval around the observed rate
        lo, hi = r["interval"]
        assert 0 <= lo <= r["accuracy"] <= hi <= 1


def test_cli_needle_recall_runs_each_bounded_policy_with_and_without(
    tiny_dir: Path, text_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["eval", "needle", "--haystack", str(text_file.parent), "--model", str(tiny_dir), "--lengths", "300",
            "--depths", "0.5", "--policies", "sink", "--budgets", "160", "--max-new-tokens", "3", "--recall"]
    rep = run_json([*argv, "0,64"], capsys)
    assert rep["settings"]["recalls"] == [0, 64]
    assert {(c["policy"], c["recall"]) for c in rep["results"]} == {("full", 0), ("sink", 0), ("sink", 64)}
    # the eviction-only answers come from the read that also archived: the same as a run without recall
    alone = run_json([*argv, "0"], capsys)
    shared = next(c for c in rep["results"] if c["policy"] == "sink" and c["recall"] == 0)
    plain = next(c for c in alone["results"] if c["policy"] == "sink")
    assert shared["answers"] == plain["answers"]


def test_wilson_interval_matches_the_formula() -> None:
    from kvtool.eval.stats import wilson

    iv = wilson(10, 10)
    assert iv.high == 1.0 and abs(iv.low - 0.7225) < 1e-3  # 10/10: the textbook lower bound 0.722


def test_cli_needle_table(tiny_dir: Path, text_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "eval",
            "needle",
            "--haystack",
            str(text_file),
            "--model",
            str(tiny_dir),
            "--lengths",
            "200",
            "--depths",
            "0.5",
            "--policies",
            "full",
            "--max-new-tokens",
            "2",
            "--needle",
            "The code word is zebra.",
            "--question",
            "What is the code word?",
            "--answer",
            "zebra",
            "--quiet",
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "needle found-rate" in out.out and "length \\ depth" in out.out and out.err == ""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["needle", "--depths", "0,1.5"], "--depths"),
        (["needle", "--policies", "nope"], "unknown policy"),
        (["needle", "--budgets", "8"], "too small"),
        (["needle", "--lengths", "2MiB"], "--lengths"),
        (["needle", "--haystack", "/nonexistent/hay"], "no such file"),
        (["needle", "--needle", "x"], "--answer"),
        (["ppl", "--text", "/nonexistent.txt"], "no such file"),
        (["ppl", "--context", "0"], "--context"),
        (["attn-error", "--samples", "0"], "--samples"),
    ],
)
def test_usage_errors_before_model_load(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the model path does not exist: the option error must come first (validated before loading)
    code = main(["eval", *argv, "--model", str(tmp_path / "no-model"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1


def test_cli_needle_resume_continues_without_recomputing(
    tiny_dir: Path, text_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvtool.eval.needle as needle_mod

    log = tmp_path / "needle.jsonl"
    argv = [
        "eval",
        "needle",
        "--haystack",
        str(text_file),
        "--model",
        str(tiny_dir),
        "--lengths",
        "200",
        "--depths",
        "0.5",
        "--policies",
        "sink",
        "--budgets",
        "160",
        "--max-new-tokens",
        "2",
        "--trials",
        "3",
        "--resume",
        str(log),
    ]
    calls: list[int] = []
    real_trial = needle_mod.needle_trial

    def killed_after_two(*args, **kwargs):
        if len(calls) == 4:  # full's 3 trials and sink's first one are done: "kill" the run here
            raise KeyboardInterrupt
        calls.append(1)
        return real_trial(*args, **kwargs)

    monkeypatch.setattr(needle_mod, "needle_trial", killed_after_two)
    assert main([*argv, "--quiet"]) == 130
    capsys.readouterr()
    assert len(log.read_text().splitlines()) == 4
    calls.clear()
    monkeypatch.setattr(needle_mod, "needle_trial", lambda *a, **k: calls.append(1) or real_trial(*a, **k))
    rep = run_json(argv, capsys)
    assert len(calls) == 2  # only sink's two missing trials ran
    assert [c["trials"] for c in rep["results"]] == [3, 3]
    calls.clear()
    again = run_json(argv, capsys)  # everything logged: no trial runs at all
    assert calls == [] and again["results"] == rep["results"]


def test_multi_needle_document_holds_every_needle_and_asks_the_first(text_file: Path) -> None:
    from kvtool.eval.needle import Haystack, build_document, labelled_needles

    needles = labelled_needles(0, 0, 3)
    assert len({n.answer for n in needles}) == 3 and len({n.question for n in needles}) == 3
    hay = Haystack(text_file.read_text(encoding="utf-8"), byte_tokenizer(), 400)
    text, at, _ = build_document(hay, needles, 400, 0.5, 0, 0, 60)
    assert text[at:].startswith(needles[0].text)
    for n in needles:
        assert text.count(n.text) == 1


def test_harder_needle_kinds_are_seeded_and_scored_by_their_rules(text_file: Path) -> None:
    from kvtool.eval.needle import (
        PARAPHRASE_QUESTION,
        Haystack,
        paraphrase_needle,
        place_needles,
        twofact_needles,
    )

    para = paraphrase_needle(0, 3)
    assert para == paraphrase_needle(0, 3) and para.answer in para.text and para.question == PARAPHRASE_QUESTION
    words = {w.strip("?.'s").lower() for w in para.question.split()}
    shared = words & {w.strip("?.'s").lower() for w in para.text.replace(para.answer, "").split()}
    assert shared - {"the", "of", "in", "is", "a"} == {"village"}  # one anchor word; the rest in other words
    role, deed, other = twofact_needles(0, 5)
    assert role.answer in deed.text and role.wrong in other.text and role.answer != role.wrong
    name = role.text.rsplit(" ", 1)[-1].rstrip(".")
    assert deed.text.startswith(name) and not other.text.startswith(name) and name not in role.question
    assert role.found(f"The keeper hid a {role.answer}.") and not role.found("I do not know.")
    assert not role.found(f"a {role.answer} or a {role.wrong}")  # naming the other's thing is wrong
    hay = Haystack(text_file.read_text(encoding="utf-8"), byte_tokenizer(), 600)
    text, spans, _ = place_needles(hay, [role, deed, other], 600, 0.5, 0, 5, 120)
    assert [text[a:b] for a, b in spans] == [role.text, deed.text, other.text]


def test_cli_agreement_json(
    tiny_dir: Path, text_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    qfile = tmp_path / "q.txt"
    qfile.write_text("What is the story about?\n\nWho speaks first?\n", encoding="utf-8")
    doc = tmp_path / "doc.txt"
    doc.write_text(text_file.read_text(encoding="utf-8")[:1200], encoding="utf-8")
    rep = run_json(
        [
            "eval",
            "agreement",
            "--doc",
            str(doc),
            "--questions-file",
            str(qfile),
            "--model",
            str(tiny_dir),
            "--policies",
            "full,sink",
            "--budgets",
            "160,2k",
            "--max-new-tokens",
            "4",
            "--first-tokens",
            "3",
            "--block-size",
            "32",
        ],
        capsys,
    )
    assert rep["task"] == "agreement" and rep["settings"]["questions"] == 2
    small, big = rep["results"]
    assert (small["policy"], small["budget"], big["budget"]) == ("sink", 160, 2048)
    # budget 2k holds the whole document: the answers and the distributions equal full's
    assert big["exact_match"]["value"] == 1.0 and big["f1"]["value"] == 1.0
    assert big["kl"]["value"] == pytest.approx(0.0, abs=1e-5) and big["top1"]["value"] == 1.0
    assert small["kl"]["value"] > 0
    assert [a["dense"] for a in small["answers"]] == [r["answer"] for r in rep["reference"]]


def test_cli_agreement_empty_questions_file_is_named(
    tiny_dir: Path, text_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n", encoding="utf-8")
    code = main(
        [
            "eval",
            "agreement",
            "--doc",
            str(text_file),
            "--questions-file",
            str(empty),
            "--model",
            str(tiny_dir),
            "--quiet",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and str(empty) in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("positions", "lengths", "recalls", "expected"),
    [
        ("auto", [1024, 4096], [0, 256], False),  # inside the model's range: placement never acts
        ("auto", [1024, 8192], [0, 256], True),  # 8K of haystack and the chat prefix pass it: the answers depend on it
        ("auto", [32768], [0, 256], True),
        ("auto", [32768], [0], False),  # nothing recalled
        ("compact", [1024], [0, 256], True),  # compact from the first token
        ("absolute", [32768], [0, 256], False),
    ],
)
def test_recall_placement_enters_a_needle_fingerprint_only_where_it_can_act(
    positions: str, lengths: list[int], recalls: list[int], expected: bool
) -> None:
    from kvtool.eval.needle import NeedleTask

    def fingerprint_settings(placement: str) -> dict:
        grid = make_grid("h2o", "256", recall_placement=placement, positions=positions)
        task = NeedleTask(
            grid=grid,
            haystack_path=Path("hay"),
            haystack="",
            lengths=lengths,
            depths=[0.5],
            trials=1,
            needle=None,
            max_new_tokens=4,
            recalls=recalls,
        )
        return task.settings(max_positions=8192)

    relevance, document = fingerprint_settings("relevance"), fingerprint_settings("document")
    assert "recall_placement" not in document  # the placement every log before the setting was written with
    assert (relevance.get("recall_placement") == "relevance") is expected
    assert (relevance == document) is not expected  # logs resume across placements only where it cannot act


def test_recall_placement_enters_an_agreement_fingerprint_only_for_a_document_past_the_range(tmp_path: Path) -> None:
    from kvtool.eval.agreement import PROMPT_MARGIN, AgreementTask, document_tokens

    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(["one two three four five six seven eight."] * 40), encoding="utf-8")
    tok = byte_tokenizer()
    n = len(tok(doc.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"])
    assert document_tokens(doc, tok, n + PROMPT_MARGIN) == n + PROMPT_MARGIN
    assert document_tokens(doc, tok, n + PROMPT_MARGIN - 1) is None  # past the range: counted as unknown
    assert document_tokens(doc, tok, None) is None
    task = AgreementTask(grid=make_grid("h2o", "256", recall_placement="relevance"), doc_path=doc, questions=["q"])
    assert "recall_placement" not in task.settings(8192, n + PROMPT_MARGIN)  # inside the range it cannot act
    assert task.settings(8192, None)["recall_placement"] == "relevance"  # unknown length counts as past it


def test_recall_select_enters_a_fingerprint_only_where_it_can_act(tmp_path: Path) -> None:
    """``--recall-select`` (default ``auto``) acts only past one scan of archived tokens per head, and a needle
    grid keys it per trial: the logs written when ``shared`` was the default resume under ``auto`` where it
    cannot act, and a select that can act is in the fingerprint."""
    from kvtool.config import DEFAULT_RECALL_SELECT, SCAN
    from kvtool.eval.agreement import AgreementTask
    from kvtool.eval.needle import NeedleTask
    from kvtool.runtime.settings import resolve_settings

    assert DEFAULT_RECALL_SELECT == "auto" and resolve_settings(None, {}).recall_select == "auto"
    doc = tmp_path / "doc.txt"
    doc.write_text("one two.", encoding="utf-8")
    task = AgreementTask(grid=make_grid("h2o", "256"), doc_path=doc, questions=["q"])
    assert "recall_select" not in task.settings(8192, 2000)  # a short document: auto is shared there
    assert task.settings(None, None)["recall_select"] == "auto"  # unknown length: it can act
    assert task.settings(None, SCAN + 1)["recall_select"] == "auto"
    shared = AgreementTask(grid=make_grid("h2o", "256", recall_select="shared"), doc_path=doc, questions=["q"])
    assert "recall_select" not in shared.settings(None, None)  # what every log before the setting meant
    off = AgreementTask(grid=make_grid("h2o", "256", recall="off"), doc_path=doc, questions=["q"])
    assert "recall_select" not in off.settings(None, None)  # no recall: nothing to select
    needle = NeedleTask(grid=make_grid("h2o", "256"), haystack_path=tmp_path, haystack="essays", lengths=[131072],
                        depths=[0.5], trials=1, needle=None, max_new_tokens=8, recalls=[256])
    assert "recall_select" not in needle.settings(None) and needle.selects == ["shared"]  # keyed per trial


def test_model_range_reads_the_text_models_range() -> None:
    from types import SimpleNamespace

    from kvtool.eval import model_range

    plain = SimpleNamespace(model=SimpleNamespace(config=transformers.LlamaConfig(max_position_embeddings=8192)))
    assert model_range(plain) == 8192
    multimodal = SimpleNamespace(
        model=SimpleNamespace(config=transformers.Gemma3Config(text_config={"max_position_embeddings": 4096}))
    )
    assert model_range(multimodal) == 4096


@pytest.mark.parametrize("family", ["llama3", "gemma3"])
def test_chunked_dense_reference_equals_one_forward(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past 2 · DENSE_CHUNK tokens the dense reference is transformers' chunked prefill into its DynamicCache:
    the same logits as one forward, sliding-window layers (Gemma 3, window 16 < chunk) included."""
    from kvtool.eval import ppl
    from tests.helpers import tiny_family

    model = tiny_family(family, window=16)
    ids = torch.randint(0, VOCAB, (120,), generator=torch.Generator().manual_seed(3))
    whole = dense_logits(model, ids, 20)
    for chunk in (24, 50):  # the kept rows inside one chunk, and spread over two
        monkeypatch.setattr(ppl, "DENSE_CHUNK", chunk)
        torch.testing.assert_close(dense_logits(model, ids, 20), whole, atol=1e-5, rtol=1e-5)
