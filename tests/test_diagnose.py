"""``kvtool eval needle --diagnose`` (kvtool/eval/diagnose.py, ``RecallTrace`` in kvtool/core/recall.py).

Oracles: the trace's relevance and ranking against a brute-force float64 recomputation of recall's vote
from the recorded queries and every kept and archived key; ranks, cut-offs and held counts against loops
over those; the longest common span against every pair of substrings; the answers with and without the
diagnosis are the same.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from kvtool.cli.app import main
from kvtool.core import recall
from kvtool.core.recall import SPAN, TIE, RecallTrace, passage_ranking
from kvtool.eval.diagnose import diagnose, longest_common, passage_rank, runs
from kvtool.runtime.citations import SourceMap
from tests.helpers import VOCAB, make_engine, tiny_byte_checkpoint, tiny_llama


def brute_rank(ranking: list[float], needle: list[int], first: int) -> int:
    """1 + passages above the needle, by a loop over positions (the needle's span left out)."""
    score = max(ranking[p] for p in needle)
    lo, hi = min(needle) - SPAN[0], max(needle) + SPAN[1]
    passages, inside = 0, False
    for p in range(len(ranking)):
        above = p >= first and not lo <= p <= hi and ranking[p] > score
        passages += above and not inside
        inside = above
    return 1 + passages


def brute_common(a: list[int], b: list[int]) -> int:
    return max([0] + [n for i in range(len(a)) for n in range(1, len(a) - i + 1)
                      if any(a[i : i + n] == b[j : j + n] for j in range(len(b) - n + 1))])


def test_passage_rank_and_longest_common_match_loops() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(40, 120)
        ranking = [rng.choice([0.0, 0.1, 0.5, 0.9, rng.random()]) for _ in range(n)]
        start = rng.randint(0, n - 5)
        needle = list(range(start, start + rng.randint(1, 5)))
        first = rng.randint(0, 10)
        assert passage_rank(torch.tensor(ranking), torch.tensor(needle), first) == brute_rank(ranking, needle, first)
        a = [rng.randint(0, 4) for _ in range(rng.randint(0, 9))]
        b = [rng.randint(0, 4) for _ in range(rng.randint(0, 12))]
        n_common, end = longest_common(a, b)
        assert n_common == brute_common(a, b)
        assert n_common == 0 or any(a[end - n_common : end] == b[j : j + n_common] for j in range(len(b)))
    assert runs(torch.tensor([3, 4, 5, 9, 11, 12])) == [(3, 6), (9, 10), (11, 13)]


def _brute_relevance(state: dict, log: list, seen: int, focus_rows: int,
                     pool: str = "max") -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Recall's vote in float64 from scratch: per layer, group and KV head, each question row's softmax over
    the kept and archived keys, maximised (``pool="sum"``: summed) over the rows that share the head, summed per
    position."""
    total = torch.zeros(seen + 1, dtype=torch.float64)
    per_layer: dict[int, torch.Tensor] = {}
    for (li, _), (kept, archived, positions, q_index, per_kv) in state.items():
        q = torch.cat([x[0] for layer, x, _ in log if layer == li], dim=1)[:, -focus_rows:].double()  # [H, r, d]
        scaling = next(s for layer, _, s in log if layer == li)
        own = per_layer.setdefault(li, torch.zeros(seen + 1, dtype=torch.float64))
        for h in range(kept.shape[0]):
            best = torch.zeros(archived.shape[1], dtype=torch.float64)
            for qh in q_index[h * per_kv : (h + 1) * per_kv]:
                for r in range(q.shape[1]):
                    s = torch.cat([kept[h].double() @ q[qh, r], archived[h].double() @ q[qh, r]]) * scaling
                    p = torch.softmax(s, 0)[kept.shape[1] :]
                    best = best + p if pool == "sum" else torch.maximum(best, p)
            for j in range(archived.shape[1]):
                total[positions[h, j]] += best[j]
                own[positions[h, j]] += best[j]
    return total, per_layer


@pytest.mark.parametrize("select", ["shared", "sum", "layer"])
def test_trace_matches_a_brute_force_recall_and_changes_nothing(monkeypatch: pytest.MonkeyPatch, select: str) -> None:
    """Also the ``--recall-select`` variants that change the vote (``sum``) or whose ranking a head recalls by
    (``layer``: its layer's own)."""
    model = tiny_llama(3)
    doc = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(5))
    question = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(6))
    focus = slice(2, 7)
    watch = torch.arange(120, 140)
    state: dict = {}
    captured: list = []
    real = recall.recall

    def spy(cache, log, tokens, *args, **kwargs):
        captured.extend(list(log))
        for li, layer in enumerate(cache.layers):
            for gi, g in enumerate(layer.groups):
                a = g.archive
                if a is not None and a.length:
                    k, _, pos = a.read(torch.arange(a.length).expand(a.h, -1), values=False)
                    q_index = torch.arange(model.config.num_attention_heads) if g.all_heads else g.q_index
                    state[(li, gi)] = (g.stored_keys().float().clone(), k.float(), pos, q_index,
                                       len(q_index) // g.num_heads)
        return real(cache, log, tokens, *args, **kwargs)

    monkeypatch.setattr(recall, "recall", spy)
    answers = []
    for traced in (False, True):
        engine = make_engine(model, "h2o", 64, recall=32, page_size=8, recall_select=select)
        cache = engine.new_cache()
        engine.feed(cache, [doc], progress=False)
        snap = cache.snapshot()
        trace = RecallTrace(watch) if traced else None
        engine.recall_trace = trace
        logits, result = engine.feed_question(cache, question, lambda c=cache, s=snap: c.restore(s), 4, focus)
        answers.append(logits)
        held = {(li, gi): g.positions[:, : g.length].clone() for li, layer in enumerate(cache.layers)
                for gi, g in enumerate(layer.groups)}
    assert torch.equal(answers[0], answers[1])  # the trace changes nothing

    assert trace is not None and trace.ranking is not None
    seen = trace.ranking.numel() - 1
    total, per_layer = _brute_relevance(state, captured[len(captured) // 2 :], seen, focus.stop - focus.start,
                                        "sum" if select == "sum" else "max")
    before, after = SPAN

    def brute_ranking(rel: torch.Tensor) -> torch.Tensor:
        return torch.tensor([max(rel[max(0, p - after) : p + before + 1]) + TIE * rel[p] for p in range(seen + 1)])

    assert torch.allclose(trace.ranking.double(), brute_ranking(total), atol=1e-5)
    for li, rel in per_layer.items():
        assert torch.allclose(trace.layer_relevance[li].double(), rel, atol=1e-5)
    assert torch.allclose(sum(trace.layer_relevance.values()).double(), total, atol=1e-5)

    assert len(trace.groups) == len(state)
    for gt, ((li, gi), (_, _, positions, _, _)) in zip(trace.groups, sorted(state.items()), strict=True):
        assert gt.layer == li
        for h in range(positions.shape[0]):
            in_archive = set(positions[h].tolist())
            holds = set(held[(li, gi)][h].tolist())
            assert gt.archived[h].tolist() == [p in in_archive for p in watch.tolist()]
            assert gt.held[h].tolist() == [p in holds for p in watch.tolist()]
            # the cut-off is the 32nd best ranking among the head's archived positions (``layer``: its layer's)
            by = brute_ranking(per_layer[li]) if select == "layer" else trace.ranking
            ranked = sorted((float(by[p]) for p in in_archive), reverse=True)
            assert float(gt.cutoff[h]) == pytest.approx(ranked[31], abs=1e-5)
            assert all(float(by[p]) >= ranked[31] - 1e-5 for p in gt.recalled[h].tolist())
            assert set(gt.recalled[h].tolist()) <= in_archive and gt.recalled.shape[1] == 32

    # the record: ranks by loops, held shares by counting
    source = SourceMap(first_position=0)
    source.add(doc.tolist(), [(i, i + 1) for i in range(doc.numel())])
    needles = [watch[:12], watch[12:]]
    answer_ids = doc[125:131].tolist() + [1, 2]  # copies six tokens of the first needle
    rec = diagnose(trace, needles, source, answer_ids, lambda ids: " ".join(map(str, ids)) and "x")
    ranking = trace.ranking.tolist()
    for entry, pos in zip(rec["needles"], needles, strict=True):
        assert entry["rank"] == brute_rank(ranking, pos.tolist(), 0)
        assert entry["positions"] == [int(pos[0]), int(pos[-1]) + 1]
        pairs = [(gt.layer, h, p) for gt in trace.groups for h in range(gt.held.shape[0]) for p in pos.tolist()
                 if p in set(held_positions(held, gt, h))]
        assert entry["held"] == pytest.approx(len(pairs) / (sum(g.held.shape[0] for g in trace.groups) * pos.numel()),
                                              abs=1e-4)
        layer_ranks = [brute_rank(passage_ranking(trace.layer_relevance[li]).tolist(), pos.tolist(), 0)
                       for li in sorted(trace.layer_relevance)]
        assert entry["layer_ranks"] == layer_ranks
    assert rec["needle_copy"][0] == 6
    copies = [c for c in rec["copied"] if c["needle"] == 0]
    assert all(c["tokens"] <= 6 for c in rec["copied"])
    recalled = set(torch.cat([gt.recalled.reshape(-1) for gt in trace.groups]).tolist())
    if set(range(125, 131)) <= recalled:
        assert copies and copies[0]["tokens"] == 6


def held_positions(held: dict, gt, h: int) -> list[int]:
    return next(v[h].tolist() for (li, _), v in held.items() if li == gt.layer)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_byte_checkpoint(tmp_path_factory.mktemp("diag") / "tiny-byte-llama")


def _needle_json(tiny_dir: Path, hay: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    code = main(["eval", "needle", "--haystack", str(hay), "--model", str(tiny_dir), "--lengths", "700",
                 "--depths", "0.3,0.7", "--policies", "full,sink", "--budgets", "160", "--max-new-tokens", "4",
                 "--trials", "2", "--recall", "0,64", "--json", "--quiet", *extra])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def test_cli_diagnose_keeps_answers_and_logs_a_record(tiny_dir: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    hay = tmp_path / "hay.txt"
    hay.write_text("The river ran north past the old mill. Nobody remembered who built it! " * 30, encoding="utf-8")
    log = tmp_path / "log.jsonl"
    plain = _needle_json(tiny_dir, hay, capsys, "--resume", str(log))
    diag = _needle_json(tiny_dir, hay, capsys, "--resume", str(log), "--diagnose")
    def answers(rep: dict) -> list:
        return [[{k: a[k] for k in ("trial", "expected", "answer", "correct")} for a in c["answers"]]
                for c in rep["results"]]

    assert answers(diag) == answers(plain)  # the same answers, read again with the diagnosis
    for cell in diag["results"]:
        for a in cell["answers"]:
            d = a["diagnose"]
            (needle,) = d["needles"]
            assert needle["tokens"] > 20 and 0 <= needle["held"] <= 1
            if cell["recall"]:
                assert needle["rank"] >= 1 and len(needle["layer_ranks"]) == 2 and "copied" in d
            else:
                assert "rank" not in needle and "copied" not in d
            if cell["policy"] == "full":
                assert needle["held"] == 1.0 and needle["layers_in"] == [0, 1]
    rows = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    assert sum("diagnose" in r["record"] for r in rows) == len(rows) // 2  # every trial logged again, diagnosed
    again = _needle_json(tiny_dir, hay, capsys, "--resume", str(log), "--diagnose")
    assert again["results"] == diag["results"]
    assert len(log.read_text(encoding="utf-8").splitlines()) == len(rows)  # all resumed: nothing read again
