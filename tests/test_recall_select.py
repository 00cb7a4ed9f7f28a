"""``--recall-select``: the variants of recall's selection (kvtool/core/recall.py, ``Engine.recall_again``).

Oracles: ``grow``'s size against its formula; ``again``'s second pass against transformers' dense logits over the
document, the question and the answer's first tokens when everything archived comes back (recall is then exact:
tests/test_recall.py); the answer's first tokens unchanged by it. ``sum`` and ``layer`` are checked against a
brute-force recall in tests/test_diagnose.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvtool.cli.app import main
from kvtool.config import AGAIN_AFTER, recall_select_spec, recall_selection
from kvtool.core import recall
from kvtool.core.sampling import Chooser
from kvtool.errors import UsageError
from kvtool.runtime.settings import resolve_settings
from tests.helpers import VOCAB, dense_logits, make_engine, tiny_llama


def test_selection_parses_normalises_and_refuses() -> None:
    assert recall_selection("shared") == frozenset()
    assert recall_selection("grow+SUM") == {"sum", "grow"}
    assert recall_select_spec("again+grow+sum") == "sum+grow+again"  # one spelling per set: one resume key
    assert resolve_settings(None, {"recall_select": "layer+sum"}).recall_select == "sum+layer"
    assert recall_select_spec(" AUTO ") == "auto" and recall_selection("auto") == frozenset()
    assert recall_selection("auto", recall.SCAN) == frozenset()
    assert recall_selection("auto", recall.SCAN + 1) == {"again"}
    for bad in ("nope", "sum+sum", "shared+sum", "", "sum+", "auto+again"):
        with pytest.raises(UsageError, match="recall select"):
            recall_selection(bad)


def test_cli_refuses_a_bad_select_in_one_line(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("A short document.", encoding="utf-8")
    assert main(["ask", str(doc), "q", "--recall-select", "widest"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "recall select" in err[0] and "widest" in err[0]


def test_grow_keeps_the_size_up_to_scan_then_follows_the_square_root(monkeypatch: pytest.MonkeyPatch) -> None:
    assert recall.grown(256, 1000) == 256 and recall.grown(256, recall.SCAN) == 256
    assert recall.grown(256, 4 * recall.SCAN) == 512 and recall.grown(256, 2 * recall.SCAN) == round(256 * math.sqrt(2))
    monkeypatch.setattr(recall, "SCAN", 64)  # a tiny archive past the point where the size grows
    doc, question = torch.randint(0, VOCAB, (400,)), torch.randint(0, VOCAB, (8,))
    got = {}
    for select in ("shared", "grow"):
        engine = make_engine(tiny_llama(), "h2o", 40, recall=16, page_size=8, recall_select=select)
        cache = engine.new_cache()
        engine.feed(cache, [doc], progress=False)
        snap = cache.snapshot()
        archived = recall.archives(cache)[0].length
        _, res = engine.feed_question(cache, question, lambda c=cache, s=snap: c.restore(s))
        got[select] = res.tokens
    assert got == {"shared": 16, "grow": recall.grown(16, archived)} and got["grow"] > 16


def _answer(engine, doc: torch.Tensor, question: torch.Tensor, steps: int, again: bool):
    """Greedy ids of an answer, the logits each ``again`` step returned, and how many recalls ran."""
    cache = engine.new_cache()
    engine.feed(cache, [doc], progress=False)
    snap = cache.snapshot()

    def restore() -> None:
        cache.restore(snap)

    logits, first = engine.feed_question(cache, question, restore, steps)
    recalls, turns = [first], []
    hook = engine.recall_again(cache, question.tolist(), restore, None, recalls.append) if again else None

    def step(answer: list[int]) -> torch.Tensor:
        assert hook is not None
        out = hook(answer)
        turns.append((list(answer), out[-1].clone()))
        return out

    ids, _ = engine.generate(cache, logits, steps, set(), Chooser(steps, "cpu"), again=step if again else None)
    return ids, turns, recalls


def test_again_recalls_after_the_first_tokens_and_is_exact_when_everything_comes_back() -> None:
    model = tiny_llama(4)
    doc = torch.randint(0, VOCAB, (150,), generator=torch.Generator().manual_seed(8))
    question = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(9))
    steps = AGAIN_AFTER + 4
    # everything archived comes back, the document read in one block: recall is exact, so is the second pass
    engine = make_engine(model, "h2o", 40, block_size=160, recall=256, page_size=8)
    ids, turns, recalls = _answer(engine, doc, question, steps, again=True)
    assert len(recalls) == 2 and all(r is not None and r.tokens == 150 - 40 for r in recalls)
    (answer, logits), = turns
    assert answer == ids[:AGAIN_AFTER] and len(ids) == steps
    ref = dense_logits(model, torch.cat([doc, question, torch.tensor(answer)]))[-1]
    torch.testing.assert_close(logits, ref, atol=2e-4, rtol=2e-4)
    # a selection: the first tokens are the same answer's without the second recall
    small = make_engine(model, "h2o", 40, recall=16, page_size=8)
    plain, _, once = _answer(small, doc, question, steps, again=False)
    again_ids, turns, twice = _answer(small, doc, question, steps, again=True)
    assert len(once) == 1 and len(twice) == 2 and again_ids[:AGAIN_AFTER] == plain[:AGAIN_AFTER]


def test_again_hands_the_rest_of_the_answer_to_the_fixed_step() -> None:
    """After the second recall the cache stays put, so the answer goes on over the fixed-shape decode step (a graph
    on CUDA) instead of the block path. Oracle: the block path's answer (``decode_step="blocks"``), with a
    repetition penalty and an n-gram guard that read the tokens chosen before the turn from the step's ring."""
    model = tiny_llama(4)
    # seeded so that the penalty's and the guard's reading of the first tokens changes the greedy answer
    doc = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(0))
    question = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(100))
    steps = AGAIN_AFTER + 12
    got = {}
    for mode in ("blocks", "capture"):
        engine = make_engine(model, "h2o", 64, recall=16, page_size=8, decode_step=mode)
        cache = engine.new_cache()
        engine.feed(cache, [doc], progress=False)
        snap = cache.snapshot()
        logits, _ = engine.feed_question(cache, question, lambda c=cache, s=snap: c.restore(s), steps)
        again = engine.recall_again(cache, question.tolist(), lambda c=cache, s=snap: c.restore(s), None,
                                    lambda r: None)
        choose = Chooser(steps, "cpu", repetition_penalty=1.3, no_repeat_ngram=2)
        got[mode], _ = engine.generate(cache, logits, steps, set(), choose, again=again)
        assert (engine.decode_step_of(cache) is not None) == (mode == "capture")
    assert got["capture"] == got["blocks"] and len(got["blocks"]) == steps


@pytest.mark.parametrize("scan", [10_000, 64])
def test_auto_recalls_again_past_the_scan_and_once_below_it(tmp_path, monkeypatch: pytest.MonkeyPatch, scan) -> None:
    """``--recall-select auto`` through a session: the answer recalls once while every head's archive fits the
    scan (the same answer as ``shared``), and twice, as ``again`` does, past it (the same answer as ``again``)."""
    import kvtool.config
    from kvtool.core.events import Note
    from kvtool.documents import open_document
    from kvtool.runtime.session import Session
    from kvtool.runtime.settings import resolve_settings
    from tests.helpers import tiny_checkpoint

    monkeypatch.setattr(kvtool.config, "SCAN", scan)
    model = str(tiny_checkpoint(tmp_path / "tiny"))
    doc = tmp_path / "d.txt"
    doc.write_text("the cache is small and the pass key is 4412. " * 60, encoding="utf-8")
    got = {}
    for select in ("shared", "again", "auto"):
        notes: list[str] = []
        settings = {"model": model, "budget": "256", "block_size": 16, "recall": "16", "max_new_tokens": 8,
                    "recall_select": select}
        s = Session(resolve_settings(None, settings),
                    listener=lambda e, n=notes: n.append(e.message) if isinstance(e, Note) else None)
        read = s.read(open_document(str(doc)))
        archived = recall.archived_per_head(read.cache)
        ans = s.ask(read, "What is the pass key?")
        got[select] = (ans.ids, sum(n.startswith("recall: ") for n in notes))
    assert 64 < archived < 10_000
    assert got["shared"][1] == 1 and got["again"][1] == 2
    assert got["auto"] == (got["again"] if archived > scan else got["shared"])
