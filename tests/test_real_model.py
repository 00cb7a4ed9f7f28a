"""Smoke tests with the embedded SmolLM2-135M-Instruct (marked ``real_model``; CI runs them too)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvtool.documents import text_document
from kvtool.runtime.model import load_model
from kvtool.runtime.session import Session
from kvtool.runtime.settings import resolve_settings

pytestmark = pytest.mark.real_model

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus"
PASSKEY = "71432"
NEEDLE = f" The pass key is {PASSKEY}. Remember it. {PASSKEY} is the pass key."


@pytest.fixture(scope="module")
def loaded():
    return load_model(None)


def essay_text(tokenizer, tokens: int) -> str:
    text = (CORPUS / "paul_graham_essays" / "aord.txt").read_text(encoding="utf-8")
    text += (CORPUS / "paul_graham_essays" / "before.txt").read_text(encoding="utf-8")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
    return tokenizer.decode(ids)


def session(loaded, **overrides) -> Session:
    return Session(resolve_settings(None, {"max_new_tokens": 24, **overrides}), loaded=loaded)


@pytest.mark.parametrize("policy, budget", [("full", None), ("sink", "512")])
def test_passkey_in_recent_window_is_answered(loaded, policy, budget):
    text = essay_text(loaded.tokenizer, 950) + NEEDLE
    s = session(loaded, policy=policy, **({"budget": budget} if budget else {}))
    read = s.read(text_document(text))
    assert 900 < read.document_tokens < 1100
    ans = s.ask(read, "What is the pass key?")
    print(policy, repr(ans.answer))
    assert PASSKEY in ans.answer
    if budget:
        assert read.cache.counters.max_cached <= 512 + s.recall_tokens  # an answer holds budget + recall
        assert read.cache.counters.evicted_tokens > 0


POLICIES = [
    "sink",
    "h2o",
    "tova",
    "snapkv",
    "scissorhands",
    "keydiff",
    "h2o+vatp",
    "scissorhands+vatp",
    "tova+caote",
    "snapkv+fastcaote",
    "h2o+vatp+caote",
    "razor",
]


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_answers_a_2k_document_within_budget(loaded, policy):
    text = essay_text(loaded.tokenizer, 2000)
    s = session(loaded, policy=policy, budget="512")
    read = s.read(text_document(text))
    ans = s.ask(read, "What is the essay about?")
    print(policy, repr(ans.answer))
    assert ans.answer.strip()
    for g in read.cache.groups():  # the answer's tokens await their (lazy) eviction: at most one block more
        assert g.length <= g.capacity + s.settings.block_size
    per_token_head = 2 * 64 * 4  # K and V, head_dim 64, float32
    promised = read.cache.promised_bytes()
    assert promised <= 512 * 30 * 3 * per_token_head  # the budget: 512 tokens × layers × KV heads
    assert promised >= (512 * 3 - 2) * 30 * per_token_head  # razor leaves < n_retrieval tokens of floor remainder
    stats = s.stats(read)
    assert stats["evicted_tokens"] > 0
    if policy != "razor":  # razor's retrieval heads hold more than B while other heads hold less
        assert stats["cached_tokens_max"] <= 512 + stats["recall_tokens"]  # an answer holds budget + recall


def test_razor_calibration_selects_the_configured_share(loaded):
    s = session(loaded, policy="razor", budget="512")
    cal = s.calibration
    assert cal is not None
    heads = sum(len(v) for v in cal["query_heads"].values())
    total = 30 * 9
    assert heads <= math.floor(0.14 * total + 0.5) + math.floor(0.01 * total + 0.5)
    assert heads >= math.floor(0.14 * total + 0.5)
    split = s.stats()["budget_split"]
    assert all(row["total_tokens"] + row["unused_tokens"] == 512 * 3 for row in split)


def test_summarize_real_model(loaded):
    s = session(loaded, policy="keydiff", budget="512", max_new_tokens=40)
    read = s.read(text_document(essay_text(loaded.tokenizer, 1500)))
    ans = s.summarize(read, "short")
    print(repr(ans.answer))
    assert len(ans.answer.split()) >= 5


def test_cli_ask_json_real_model(tmp_path, capsys):
    from kvtool.cli.app import main

    doc = tmp_path / "doc.txt"
    doc.write_text(essay_text(load_model(None).tokenizer, 950) + NEEDLE, encoding="utf-8")
    rc = main(
        [
            "ask",
            str(doc),
            "What is the pass key?",
            "--budget",
            "512",
            "--policy",
            "sink",
            "--json",
            "--quiet",
            "--max-new-tokens",
            "24",
        ]
    )
    out = capsys.readouterr()
    assert rc == 0, out.err
    result = json.loads(out.out)
    assert PASSKEY in result["answers"][0]["answer"]
    assert result["stats"]["cached_tokens_max"] <= 512 + result["stats"]["recall_tokens"]


def test_recall_finds_a_needle_eviction_dropped(loaded):
    """keydiff at budget 256 on a ~1.2K-token text loses a pass key at depth 0.5; recall 256 brings it back."""
    tok = loaded.tokenizer
    text = essay_text(tok, 1150)
    half = len(tok.decode(tok(text, add_special_tokens=False)["input_ids"][:575]))
    doc = text[:half] + NEEDLE + " " + text[half:]
    answers = {}
    for rec in ("off", "256"):
        s = session(loaded, policy="keydiff", budget="256", recall=rec, max_new_tokens=16)
        read = s.read(text_document(doc))
        answers[rec] = s.ask(read, "What is the pass key?").answer
        if rec != "off":
            stats = s.stats(read)
            assert stats["recalled_pages"] > 0 and stats["archive_bytes"] > 0
            # budget + recall, plus at most one block of answer tokens awaiting their (lazy) eviction
            assert max(read.cache.lengths()) <= 256 + 256 + 128
    print(answers)
    assert PASSKEY not in answers["off"]
    assert PASSKEY in answers["256"]


def test_needle_outside_the_recent_window_is_kept_by_the_policy(loaded):
    """A secret number near the start of a 1K-token haystack (far outside any recent window) survives
    KeyDiff at budget 256 and is answered: the policy's choice kept it, not recency. The same case as
    ``kvtool eval needle`` at seed 0, length 1k, depth 0.1, trial 0 (docs/results.md)."""
    import bisect

    from kvtool.eval import load_text
    from kvtool.eval.needle import Haystack, build_document, passkey_needle

    tok = loaded.tokenizer
    needle = passkey_needle(0, 0)
    hay = Haystack(load_text(CORPUS / "paul_graham_essays", "--haystack"), tok, 1024)
    ntok = len(tok(" " + needle.text + " ", add_special_tokens=False)["input_ids"])
    text, at, starts = build_document(hay, [needle], 1024, 0.1, 0, 0, ntok)
    s = session(loaded, policy="keydiff", budget="256", max_new_tokens=16)
    read = s.read(text_document(text))
    needle_token = bisect.bisect_left(starts, at - 1)
    assert read.document_tokens - needle_token > 3 * 256  # three budgets back from the question
    assert read.cache.counters.evicted_tokens > 0
    ans = s.ask(read, needle.question)
    assert needle.answer in ans.answer, ans.answer
