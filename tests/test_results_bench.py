"""bench/results.py's evidence machinery: the grid, pooling over documents, the claims' verdicts, KeyDiff's
correlation (against brute force) and razor's whole-heads budget. No real model."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import cite_table  # noqa: E402
import claims  # noqa: E402
import default_rule  # noqa: E402
import defaults  # noqa: E402
import evidence  # noqa: E402
import kv_tables  # noqa: E402
import recall_variants  # noqa: E402
import results  # noqa: E402

from kvtool.eval.distinctiveness import (  # noqa: E402
    distinctiveness,
    layer_correlation,
    measure_window,
    pearson,
    received_attention,
    spearman,
)
from kvtool.policy_syntax import check_spec  # noqa: E402


# --------------------------------------------------------------------------------------------- the grid
def test_grid_lists_every_base_and_every_modifier_on_the_bases_it_applies_to():
    expected = {
        "sink",
        "h2o",
        "tova",
        "snapkv",
        "scissorhands",
        "keydiff",
        "razor",
        "h2o+vatp",
        "scissorhands+vatp",
        *(f"{b}+{m}" for b in ("h2o", "tova", "snapkv") for m in ("caote", "fastcaote", "caote(greedy=true)")),
    }
    got = evidence.grid_policies()
    assert set(got) == expected and len(got) == len(expected)
    for spec in got:
        check_spec(spec)  # every spec parses (names, modifiers, inline options)


def test_grid_tasks_scale_the_haystack_with_the_budget_and_read_every_document():
    tasks = evidence.grid_tasks(["h2o"], [256, 1024], trials=2, samples=3)
    assert set(tasks) == {
        "needle",
        "needle-1024",
        "ppl",
        "ppl-1024",
        "agreement-aord",
        "agreement-pride",
        "agreement-langdes",
    }
    assert tasks["needle"][tasks["needle"].index("--lengths") + 1] == "1k"
    assert tasks["needle-1024"][tasks["needle-1024"].index("--lengths") + 1] == "4k"
    assert tasks["ppl-1024"][tasks["ppl-1024"].index("--context") + 1] == "4k"
    assert tasks["agreement-pride"][tasks["agreement-pride"].index("--budgets") + 1] == "256,1024"


def test_agreement_documents_have_at_least_36_questions_over_three_kinds():
    total = 0
    for _, doc, questions, _ in evidence.DOCS:
        qs = [q for q in (ROOT / questions).read_text().splitlines() if q.strip()]
        assert len(qs) >= 12, questions
        total += len(qs)
        if not doc.startswith("../"):
            assert (ROOT / doc).is_file()
    assert total >= 36
    assert len({kind for *_, kind in evidence.DOCS}) == 3


# --------------------------------------------------------------------------------------------- pooling
def _doc(f1s: dict[tuple[str, int], list[float]], name: str) -> dict:
    rows = [
        {
            "policy": p,
            "budget": b,
            "answers": [{"f1": x, "exact": x == 1.0, "rouge_l": x, "kl": 1 - x, "top1": x} for x in xs],
        }
        for (p, b), xs in f1s.items()
    ]
    return {
        "command": f"kvtool eval agreement --doc {name}",
        "seconds": 1.0,
        "result": {"task": "agreement", "settings": {"doc": name}, "results": rows},
    }


def test_pool_agreement_concatenates_questions_and_flags_against_the_best_at_the_budget():
    a = _doc({("h2o", 256): [1.0, 0.9, 0.8], ("sink", 256): [0.1, 0.2, 0.1]}, "a.txt")
    b = _doc({("h2o", 256): [0.9, 1.0], ("sink", 256): [0.0, 0.1], ("tova", 256): [0.5, 0.5]}, "b.txt")
    pooled = evidence.pool_agreement([a, b])
    rows = {r["policy"]: r for r in pooled["result"]["results"]}
    assert set(rows) == {"h2o", "sink"}  # tova is not in every document: left out
    assert rows["h2o"]["questions"] == 5
    assert rows["h2o"]["f1"]["value"] == pytest.approx((1.0 + 0.9 + 0.8 + 0.9 + 1.0) / 5)
    assert rows["h2o"]["exact_match"]["value"] == pytest.approx(2 / 5)
    assert rows["h2o"]["best"] and not rows["h2o"]["significant"]
    assert rows["sink"]["significant"]
    assert pooled["result"]["settings"]["docs"] == ["a.txt", "b.txt"]


def test_merge_replaces_the_rows_of_a_rerun_policy_and_keeps_the_others():
    old = _doc({("h2o", 256): [0.5], ("sink", 256): [0.1]}, "a.txt")
    new = _doc({("h2o", 256): [0.9]}, "a.txt")
    new["command"] += " --policies h2o --budgets 256"
    out = evidence.merge(old, new)
    merged = out["result"]["results"]
    assert [(r["policy"], r["answers"][0]["f1"]) for r in merged] == [("sink", 0.1), ("h2o", 0.9)]
    assert out["command"] == "kvtool eval agreement --doc a.txt --policies sink,h2o --budgets 256"  # the whole table


def test_merge_replaces_a_table_measured_under_other_settings():
    old = _doc({("full", None): [1.0], ("h2o", 256): [0.5]}, "a.txt")
    new = _doc({("h2o", 256): [0.9]}, "a.txt")
    new["result"]["settings"]["recall_placement"] = "relevance"  # e.g. a default changed since the old rows
    out = evidence.merge(old, new)
    assert out is new and [r["policy"] for r in out["result"]["results"]] == ["h2o"]  # no stale `full` row


# --------------------------------------------------------------------------------------------- verdicts
@pytest.mark.parametrize(
    ("low", "high", "kind", "margin", "want"),
    [
        (0.01, 0.2, "better", 0.0, claims.HOLDS),
        (-0.2, -0.01, "better", 0.0, claims.FAILS),
        (-0.1, 0.1, "better", 0.0, claims.NOISE),
        (-0.04, 0.1, "competitive", 0.05, claims.HOLDS),
        (-0.2, -0.06, "competitive", 0.05, claims.FAILS),
        (-0.1, 0.0, "competitive", 0.05, claims.NOISE),
        (-0.04, 0.04, "close", 0.05, claims.HOLDS),
        (0.06, 0.2, "close", 0.05, claims.FAILS),
        (-0.2, -0.06, "close", 0.05, claims.FAILS),
        (0.0, 0.1, "close", 0.05, claims.NOISE),
    ],
)
def test_cell_verdict_on_synthetic_intervals(low, high, kind, margin, want):
    assert claims.cell_verdict(low, high, kind, margin) == want


def test_claim_verdict_every_and_most():
    H, F, N = claims.HOLDS, claims.FAILS, claims.NOISE
    assert claims.claim_verdict([H, H, H], "every") == H
    assert claims.claim_verdict([H, H, N], "every") == N
    assert claims.claim_verdict([H, H, F], "every") == F
    assert claims.claim_verdict([H, H, N], "most") == H
    assert claims.claim_verdict([H, N, N, N], "most") == N
    assert claims.claim_verdict([H, H, F, F], "most") == F  # no majority can hold
    assert claims.claim_verdict([], "every") == N
    # with cells still to run, a verdict they could change says so; one they cannot change is final
    assert claims.claim_verdict([H], "most", expected=6) == "holds so far (1 of 6 cells)"
    assert claims.claim_verdict([H, H, H, H], "most", expected=6) == H
    assert claims.claim_verdict([F, F, F], "most", expected=6) == F
    assert claims.claim_verdict([H, H], "every", expected=6) == "holds so far (2 of 6 cells)"
    assert claims.claim_verdict([H, F], "every", expected=6) == F


def test_paired_cells_compare_the_same_units_with_higher_better():
    trials = [{"trial": t, "correct": c} for t, c in enumerate([True, True, False, True])]
    base = [{"trial": t, "correct": False} for t in range(4)]
    data = {
        "needle": {
            "result": {
                "results": [
                    {"policy": "h2o+vatp", "budget": 256, "recall": 0, "answers": trials},
                    {"policy": "h2o", "budget": 256, "recall": 0, "answers": base},
                ]
            }
        },
        "ppl": {
            "result": {
                "results": [
                    {"policy": "h2o+vatp", "budget": 256, "samples": [{"ppl": 11.0, "dense_ppl": 10.0}] * 3},
                    {"policy": "h2o", "budget": 256, "samples": [{"ppl": 12.0, "dense_ppl": 10.0}] * 3},
                ]
            }
        },
    }
    cells = {c["table"]: c for c in claims.paired_cells(data, "h2o+vatp", "h2o", [256, 1024])}
    assert set(cells) == {"needle", "ppl"}  # no agreement table, no 1024 runs
    assert cells["needle"]["value"] == pytest.approx(0.75)
    assert cells["ppl"]["value"] == pytest.approx(10.0)  # a gap of 10% instead of 20%: +10 points
    row = claims.judge(claims.CLAIMS[0], list(cells.values()))
    assert row["verdict"] in (claims.HOLDS, claims.NOISE)
    assert "needle @ 256 +75 pp" in claims.table_claims([row])


# --------------------------------------------------------------------------------------------- correlation
def test_distinctiveness_and_received_attention_against_brute_force():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 7, 5, generator=g, dtype=torch.float64)
    got = distinctiveness(keys)
    for h in range(2):
        units = [keys[h, j] / keys[h, j].norm() for j in range(7)]
        anchor = sum(units) / 7
        for j in range(7):
            cos = float(units[j] @ anchor) / float(anchor.norm())
            assert got[h, j].item() == pytest.approx(1 - cos, abs=1e-12)
    logits = torch.randn(4, 7, 7, generator=g, dtype=torch.float64)
    logits = logits.masked_fill(torch.ones(7, 7).triu(1).bool(), -math.inf)
    probs = logits.softmax(-1)
    recv = received_attention(probs, kv_heads=2)
    for kv in range(2):
        for j in range(7):
            vals = [float(probs[q, i, j]) for q in (2 * kv, 2 * kv + 1) for i in range(j, 7)]
            assert recv[kv, j].item() == pytest.approx(sum(vals) / len(vals), abs=1e-12)


def test_spearman_and_pearson_against_brute_force_with_ties():
    x = torch.tensor([3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0])
    y = torch.tensor([2.0, 7.0, 1.0, 8.0, 2.0, 8.0, 1.0, 8.0])
    assert pearson(x, y) == pytest.approx(statistics.correlation(x.tolist(), y.tolist()), abs=1e-12)

    def avg_ranks(v: list[float]) -> list[float]:
        return [sum(1 for w in v if w < a) + (sum(1 for w in v if w == a) - 1) / 2 for a in v]

    want = statistics.correlation(avg_ranks(x.tolist()), avg_ranks(y.tolist()))
    assert spearman(x, y) == pytest.approx(want, abs=1e-12)
    assert spearman(x, x * 2 + 1) == pytest.approx(1.0)


def test_layer_correlation_leaves_out_keys_seen_by_few_queries():
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(1, 40, 4, generator=g)
    probs = torch.randn(2, 40, 40, generator=g).masked_fill(torch.ones(40, 40).triu(1).bool(), -math.inf).softmax(-1)
    out = layer_correlation(keys, probs, min_queries=10)
    dist = distinctiveness(keys)[0, :31]
    recv = received_attention(probs, 1)[0, :31]
    assert out["spearman"] == pytest.approx(spearman(dist, recv))
    assert out["pearson"] == pytest.approx(pearson(dist, recv))
    with pytest.raises(ValueError):
        layer_correlation(keys, probs, min_queries=39)


def test_measure_window_on_a_tiny_model_restores_its_attention():
    from tests.helpers import tiny_llama

    model = tiny_llama()
    before = model.config._attn_implementation
    rows = measure_window(model, torch.arange(48) % 50, min_queries=8)
    assert len(rows) == model.config.num_hidden_layers
    assert all(-1.0 <= r["spearman"] <= 1.0 and -1.0 <= r["pearson"] <= 1.0 for r in rows)
    assert model.config._attn_implementation == before


# --------------------------------------------------------------------------------------------- razor
def test_whole_budget_is_the_smallest_that_keeps_every_retrieval_head_whole():
    from razor_bytes import whole_budget

    from kvtool.core.contract import PolicyEnv
    from kvtool.policies.razor.policy import Razor

    split = [{"layer": 0, "retrieval_heads": [1]}, {"layer": 1, "retrieval_heads": []}]
    b = whole_budget(split, tokens=1000, num_kv_heads=3, sinks=4)

    def capacity(budget: int) -> int:
        razor = Razor()
        razor.env = PolicyEnv(
            num_layers=2,
            num_kv_heads=3,
            num_attention_heads=3,
            head_dim=2,
            budget=budget,
            sinks=4,
            retrieval_heads=lambda **_: {0: [1], 1: []},
        )
        return razor.budget_split(razor.env)[0]["retrieval_capacity"]

    assert capacity(b) >= 1000 > capacity(b - 1)
    assert whole_budget([{"layer": 0, "retrieval_heads": [0, 1, 2]}], 500, 3, 4) == 500  # all heads retrieval


def test_the_evidence_sections_render_from_synthetic_results():
    from distinctiveness import summarize

    windows = [[{"spearman": 0.1 * w + 0.2 * layer, "pearson": 0.5} for layer in range(3)] for w in range(4)]
    razor_rows = [
        {
            "policy": p,
            "budget": b,
            "stored": s,
            "reduction_vs_dense": 1 - s / 1000,
            "equal_bytes_budget": None if b is None else b,
        }
        for p, b, s in (("full", None, 1000), ("razor", 256, 130), ("h2o", 256, 130), ("sink", 256, 130))
    ]
    data = {
        "distinctiveness": {"command": "python bench/distinctiveness.py", "seconds": 1.0, "result": summarize(windows)},
        "razor-bytes": {
            "command": "python bench/razor_bytes.py",
            "seconds": 2.0,
            "result": {
                "docs": [
                    {
                        "doc": "a.txt",
                        "tokens": 2000,
                        "retrieval_kv_heads": 24,
                        "kv_heads": 90,
                        "whole_budget": 2000,
                        "paper_layout_reduction": 0.59,
                        "rows": razor_rows,
                    }
                ]
            },
        },
    }
    text = "\n".join(evidence.evidence_sections(data, "h2o"))
    assert "## Do distinctive keys receive high attention?" in text and "## The memory RazorAttention holds" in text
    assert "≥ 70% KV reduction with retrieval heads kept whole" in text
    assert "| RazorAttention | ≥ 70% KV reduction with retrieval heads kept whole |" in text
    assert text.count("**does not hold**") >= 1  # the paper's layout saves 59% < 70%
    rows = claims.claims_rows(data, [256])
    corr = next(r for r in rows if r["claim"].startswith("distinctive keys"))
    assert [c["layer"] for c in corr["cells"]] == [0, 1, 2]
    assert corr["verdict"] == claims.HOLDS  # layers 1 and 2 have every window above 0


# --------------------------------------------------------------------------------------------- the default settings
def _needle(rows: list[tuple[str, int, int, int]]) -> dict:
    return {"result": {"summary": [{"policy": p, "recall": r, "correct": k, "total": n} for p, r, k, n in rows]}}


def test_default_table_compares_with_full_and_holds_the_floor_where_full_fails():
    data = {
        "default-number-1k": _needle([("h2o", 0, 23, 60), ("h2o", 256, 60, 60)]),
        "default-number-1k-full": _needle([("full", 0, 30, 30)]),
        "default-number-8k": _needle([("h2o", 0, 0, 9), ("h2o", 256, 9, 9)]),
        "default-number-8k-document": _needle([("full", 0, 5, 9)]),  # the same trials' `full` rows
        "needle-32k-full": _needle([("full", 0, 0, 30)]),
        "default-number-32k": _needle([("h2o", 0, 0, 9), ("h2o", 256, 9, 9)]),
        "default-name-32k": _needle([("h2o", 0, 0, 9), ("h2o", 256, 5, 9)]),
        "default-number-128k": _needle([("h2o", 0, 0, 12), ("h2o", 256, 12, 12)]),
    }
    number_1k, name_1k, number_8k, name_8k, number_32k, name_32k, number_128k, _ = defaults.table_needles(
        data
    ).splitlines()[2:]
    assert "| 30/30 [89, 100] | 23/60 [27, 51] | **60/60** [94, 100] | 100% of `full`'s rate (+0 pp" in number_1k
    assert "| not run | not run | not run | – |" in name_1k  # its log is missing: nothing is made up
    assert "180% of `full`'s rate (+44 pp [+5, +73])" in number_8k and "noise" not in number_8k
    assert "`full` fails; the default finds 100% (at least the 80% it should)" in number_32k
    assert "**5/9** [27, 81] | `full` fails; the default finds 56% (below the 80% it should reach)" in name_32k
    assert "| 0/12 [0, 24] | **12/12** [76, 100] | `full` fails; the default finds 100%" in number_128k


def _needle_trials(found: dict[tuple[float, int], bool]) -> dict:
    depths = sorted({d for d, _ in found})
    return {
        "result": {
            "results": [
                {
                    "policy": "h2o",
                    "budget": 256,
                    "recall": 256,
                    "depth": d,
                    "answers": [{"trial": t, "correct": ok} for (dd, t), ok in sorted(found.items()) if dd == d],
                }
                for d in depths
            ]
        }
    }


def test_placement_table_pairs_the_same_trials():
    doc = {(0.1, 0): True, (0.1, 1): False, (0.5, 0): True, (0.5, 1): False, (0.9, 0): True}
    rel = {(0.1, 0): True, (0.1, 1): True, (0.5, 0): False, (0.5, 1): True, (0.9, 0): True, (0.9, 1): True}
    data = {"default-name-32k-document": _needle_trials(doc), "default-name-32k": _needle_trials(rel)}
    _, _, row = defaults.table_placement(data).splitlines()  # the other rows have no data: left out
    # five common trials: both 2, only relevance 2, only document 1 ((0.9, 1) is unpaired); mid-p by hand:
    # 2 · (P(X ≤ 1) − P(X = 1) / 2) for X ~ Bin(3, ½) = 2 · (4/8 − 3/16) = 0.625
    assert row.startswith("| an invented name, 32K | 3/5 [") and "| **4/5** [" in row
    assert "+20 pp [" in row and "(inside the noise)" in row and "| 2 / 1 (McNemar mid-p 0.625) |" in row


def test_default_tasks_run_with_kvtools_own_answering_settings():
    for name, argv in defaults.TASKS.items():
        pinned = evidence.pinned_answering(argv)
        if name.startswith("gen-"):  # the penalty it is compared with is spelled out
            assert argv[argv.index("--repetition-penalty") + 1] == "1.1", name
        else:  # results.py would pin kvtool 0.2's penalty and recall off: these tables must not be pinned
            assert "--repetition-penalty" not in argv and pinned != argv, name


def test_a_loop_is_a_phrase_repeated_back_to_back():
    assert defaults._loops("the secret is the end the end the end")
    assert not defaults._loops("not whether they are default alive but whether they are default dead")


# --------------------------------------------------------------------------------------------- quantized K/V
def _ppl_run(budgets: dict) -> dict:
    return {
        "result": {
            "results": [
                {"policy": "h2o", "budget": b, "samples": [{"ppl": p, "dense_ppl": 10.0} for p in ppls]}
                for b, ppls in budgets.items()
            ]
        }
    }


def test_kv_perplexity_rows_pair_windows_against_the_float32_cache():
    data = {
        "kv-ppl-auto": _ppl_run({256: [10.0, 20.0], 113: [12.0, 24.0]}),
        "kv-ppl-int8": _ppl_run({256: [10.1, 19.8], 441: [10.0, 20.0]}),
    }
    tokens, gap, vs = kv_tables.ppl_rows(data)
    assert "| – | +0.00% [" in tokens and "(noise)" in tokens  # +1% and −1%: the paired mean is 0
    assert "| +80.00% [+20.00, +140.00] | +50.00% [+0.00, +100.00] | not run |" in gap  # each window against dense
    assert "-16.67% [-16.67, -16.67]" in vs  # 10/12 and 20/24, paired


def test_kv_speed_rows_take_each_dtype_from_the_newest_report(tmp_path):
    def report(name, dtypes):
        (tmp_path / name).write_text(json.dumps({"dtypes": dtypes}))

    fig = {
        "prefill_tps": 100.0,
        "peak_rss_bytes": 1.1e9,
        "speed_ratio": 1.0,
        "speed_ratio_repeats": [1.0],
        "peak_ratio": 1.0,
    }
    report(
        "kv-dtype-8k.json",
        {
            "auto": {**fig, "prefill_tps": 84.0},
            "int8": {**fig, "speed_ratio": 1.18, "speed_ratio_repeats": [1.14, 1.22]},
            "int4": {**fig, "speed_ratio": 0.79},
        },
    )
    report("kv-dtype-8k-int4.json", {"auto": fig, "int4": {**fig, "speed_ratio": 0.88, "peak_ratio": 0.9}})
    speed, peak = kv_tables.speed_rows(tmp_path)
    assert "| 100 / 84 tok/s (one per run) | 1.18× (1.14, 1.22) | 0.88× (1.00) |" in speed  # int4: the newer run
    assert peak.endswith("| 1.10 GB | 1.00× | 0.90× |")


def test_citation_table_puts_intervals_on_its_counts():
    row = {
        "policy": "h2o",
        "budget": "512",
        "trials": 6,
        "answered": 5,
        "top_is_needle": 5,
        "same_answer": 6,
        "ms_per_token": 100.0,
        "ms_per_token_cite": 105.0,
        "overhead_pct": 5.0,
        "rank_overhead_pct": 0.3,
    }
    line = cite_table.table({"rows": [row, {**row, "policy": "sink", "answered": 0, "top_is_needle": 0}]})
    assert "| `h2o` @ 512 | 5/6 [44, 97] | 5/5 [57, 100] | 100.0 → 105.0 (+5.0%) | 0.3% of decode |" in line
    assert "| `sink` @ 512 | 0/6 [0, 39] | – |" in line  # no right answer: nothing to cite


def _rule_data(needle: dict[str, int], f1: dict[str, list[float]], trials: int = 30) -> dict:
    """Tables as the rule reads them: needle trials (the first k of each policy found) and F1 per question."""
    cells = [
        {
            "policy": p,
            "budget": 256,
            "recall": 0,
            "correct": k,
            "trials": trials,
            "answers": [{"correct": i < k} for i in range(trials)],
        }
        for p, k in needle.items()
    ]
    rows = [
        {
            "policy": p,
            "budget": 256,
            "f1": {"value": sum(v) / len(v)},
            "significant": False,
            "answers": [{"f1": x} for x in v],
        }
        for p, v in f1.items()
    ]
    return {"needle": {"result": {"results": cells}}, "agreement": {"result": {"results": rows}}}


def test_the_default_rule_compares_only_policies_run_in_both_tables():
    data = _rule_data({"h2o": 5, "sink": 10, "razor": 16}, {"h2o": [0.63] * 12, "sink": [0.62] * 12})
    rule = default_rule.choose_default(data, "h2o")
    # razor (not in the agreement table yet) would put h2o significantly below it; it neither wins nor sets the bar
    assert "razor" not in rule[1] and "`h2o` @ 256 17%," in rule[1]
    assert "the default stays **`h2o`**" in rule[-1]


def test_the_default_moves_only_on_a_win_that_survives_the_number_of_comparisons():
    """Five trials more of 30 found, all by the challenger (mid-p 0.031), is significant alone but not once
    Holm adjusts for the other challengers' cells; seven more (mid-p 0.008, 0.047 adjusted over six cells)
    moves it, though the two rates alone (16/30 against 9/30, unpaired) are inside each other's interval."""
    f1 = {p: [0.6, 0.7] * 6 for p in ("h2o", "a", "b", "c", "d")}
    close = _rule_data({"h2o": 5, "a": 10, "b": 5, "c": 6, "d": 4}, f1)
    rule = default_rule.choose_default(close, "h2o")
    assert "the default stays **`h2o`**" in rule[-1] and "`a` needle @ 256 +17 pp (p = 0.031;" in rule[-1]
    far = _rule_data({"h2o": 9, "a": 16, "b": 9, "c": 10, "d": 8}, f1)
    rule = default_rule.choose_default(far, "h2o")
    assert "`h2o`" in rule[2] and rule[-1].endswith("the data supports **`a`**.")
    assert "`a` needle @ 256 +23 pp (p = 0.008; 0.047 after Holm over 6 cells)" in rule[-1]
    # a default significantly below the needle's best is no candidate: the others' best F1 is named, and the
    # line says the tool's default has not moved with it
    gone = _rule_data({"h2o": 5, "a": 25, "b": 24}, {"h2o": [0.7] * 12, "a": [0.6] * 12, "b": [0.65] * 12})
    rule = default_rule.choose_default(gone, "h2o")
    assert "significantly below the best in the needle table" in rule[-1] and "**`b`**" in rule[-1]
    assert "kvtool still defaults to `h2o`" in rule[-1]


def test_results_page_renders_from_its_split_modules():
    """bench/results.py draws the page from result_tables.py, default_rule.py and evidence.py: with no data yet
    every part still renders (the tables say they were not run)."""
    page = results.render({"version": 2}, 0.0)
    assert "Generated by `python bench/results.py`" in page
    assert results.table_needle.__module__ == "result_tables" and results.choose_default.__module__ == "default_rule"


def test_gemma_logs_report_the_gap_and_the_needles_a_partial_log_holds(tmp_path, capsys):
    """bench/gemma_logs.py: each window's gap is ``exp(nll − dense nll) − 1`` as ``kvtool eval ppl`` computes it
    (checked by hand), one window gets no interval, and the needle table pairs the default with ``full`` on the
    trials both answered."""
    import gemma_logs

    def line(key: str, record) -> str:
        return json.dumps({"task": "x", "fingerprint": "f", "key": key, "record": record}) + "\n"

    ppl = [line("dense|a.txt@0", 3.0), line("dense|a.txt@9", 2.0)]
    ppl += [line(f"h2o@256|a.txt@{w}", {"window": w, "nll": nll, "dense_nll": d, "kl": 0.1, "top1": 0.9,
                                         "seconds": 1.0, "budget": 256})
            for w, nll, d in ((0, 3.1, 3.0), (9, 2.05, 2.0))]
    ppl.append(line("h2o@1024|a.txt@0", {"window": 0, "nll": 2.9, "dense_nll": 3.0, "kl": 0.1, "top1": 0.9,
                                          "seconds": 1.0, "budget": 1024}))
    (tmp_path / "gemma-ppl-16k.jsonl").write_text("".join(ppl))
    needle = [line(f"{cell}|32256|{depth}|0", {"expected": "1", "answer": "1" if ok else "2", "correct": ok})
              for cell, depth, ok in (("full", 0.1, False), ("full", 0.9, True), ("h2o@1024", 0.1, False),
                                      ("h2o@1024+recall256", 0.1, True), ("h2o@1024+recall256", 0.9, True))]
    (tmp_path / "gemma-number-32k.jsonl").write_text("".join(needle))
    assert gemma_logs.main(["gemma_logs.py", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    mean = statistics.mean([100 * (math.exp(0.1) - 1), 100 * (math.exp(0.05) - 1)])
    assert "- dense reference: 2 window(s)" in out
    assert f"- h2o@256: mean window gap {mean:+.2f}% [" in out and "over 2 windows" in out
    assert f"- h2o@1024: window gap {100 * (math.exp(-0.1) - 1):+.2f}% (one window: no interval)" in out
    row = next(r for r in out.splitlines() if r.startswith("| a 5-digit number | 32K"))
    assert "| 1/2 [" in row and "**2/2 [" in row and "| 0/1 [" in row  # full, default, eviction only


def test_gemma_seed_needles_keep_budgets_apart_and_mark_a_loss_to_full_on_the_same_trials(tmp_path, capsys):
    """The seed policies' 4K needle rows from partial logs: a log of two budgets keeps them apart (counted here by
    hand), and ✱ marks only a rate below ``full``'s beyond the noise of the paired trials."""
    import gemma_logs

    def line(key: str, ok: bool, budget: int | None) -> str:
        return json.dumps({"task": "x", "fingerprint": "f", "key": key,
                           "record": {"expected": "1", "answer": "1" if ok else "2", "correct": ok,
                                      "budget": budget}}) + "\n"

    trials = [(d, t) for d in (0.1, 0.5, 0.9) for t in range(3)]
    base = [line(f"full|4096|{d}|{t}", True, None) for d, t in trials]
    base += [line(f"h2o@1024+recall256|4096|{d}|{t}", t != 0, 1024) for d, t in trials]
    (tmp_path / "gemma-number-4k.jsonl").write_text("".join(base))
    seeds = [line(f"sink@256|4096|{d}|{t}", False, 256) for d, t in trials]  # 0/9 where full found 9/9
    seeds += [line(f"sink@1024|4096|{d}|{t}", t != 2, 1024) for d, t in trials]  # 6/9: inside the noise
    (tmp_path / "gemma-number-4k-seeds.jsonl").write_text("".join(seeds))
    assert gemma_logs.main(["gemma_logs.py", str(tmp_path)]) == 0
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]]
            for r in capsys.readouterr().out.splitlines() if r.startswith("| ") and "number @" not in r}
    assert rows["`full` (dense)"][:2] == ["9/9 [70, 100]", "9/9 [70, 100]"]
    assert rows["**default** (`h2o` @ 1K, recall `auto`)"][:2] == ["–", "6/9 [35, 88]"]
    assert rows["`sink`"][0].startswith("0/9 [0, 30]") and rows["`sink`"][0].endswith("✱")
    assert rows["`sink`"][1] == "6/9 [35, 88]" and rows["`sink`"][2:] == ["–", "–"]  # no name log: no name rates


def test_gemma_razor_note_only_where_razor_and_its_fallback_read_the_same():
    """The note that Razor is its KeyDiff fallback on Gemma 3 270M appears only for the budgets whose windows
    match bit for bit."""
    import gemma_tables

    def row(policy: str, budget: int, ppls: list[float]) -> dict:
        return {"policy": policy, "budget": budget, "samples": [{"window": i, "ppl": p} for i, p in enumerate(ppls)]}

    rows = [row("keydiff", 256, [20.1, 30.2]), row("razor", 256, [20.1, 30.2]),
            row("keydiff", 1024, [19.0, 29.0]), row("razor", 1024, [19.0, 29.5])]
    note = gemma_tables.razor_note({"gemma-ppl-4k": {"result": {"results": rows}}}, "gemma-ppl-4k")
    assert note is not None and note.startswith("`razor` equals `keydiff` bit for bit at 256:")
    assert gemma_tables.razor_note({"gemma-ppl-4k": {"result": {"results": rows[2:]}}}, "gemma-ppl-4k") is None


def test_gemma_section_titles_each_perplexity_table_by_the_policies_it_holds():
    """A perplexity table of the default policy alone is titled so, one of the seed policies so; the Razor note
    sits under each table where Razor matched its fallback (the committed 4K rows: they do), and a table of the
    seed policies without Razor says why."""
    import gemma_tables

    data = json.loads((ROOT / "docs" / "results-data.json").read_text())
    four = data["gemma-ppl-4k"]

    def only(keep) -> dict:
        return {**four, "result": {**four["result"], "results": [r for r in four["result"]["results"]
                                                                 if keep(r["policy"])]}}

    data = {"gemma-ppl-4k": four, "gemma-ppl-16k": only(lambda p: p in ("full", "h2o")),
            "gemma-ppl-32k": only(lambda p: p != "razor")}
    lines = gemma_tables.section(data)
    titles = [line for line in lines if line.startswith("### Perplexity")]
    assert titles == ["### Perplexity, 4K-token contexts: the seed policies at budgets 256 and 1K",
                      "### Perplexity, 16K-token contexts: the default policy",
                      "### Perplexity, 32K-token contexts: the seed policies at budgets 256 and 1K"]
    notes = [i for i, line in enumerate(lines) if line.startswith("`razor` equals `keydiff`")]
    assert len(notes) == 1 and lines.index(titles[0]) < notes[0] < lines.index(titles[1])
    # no razor row at 32K: the note says why, naming the length that showed it; 16K has no keydiff row either
    skipped = [i for i, line in enumerate(lines) if line.startswith("`razor` is not run")]
    assert len(skipped) == 1 and skipped[0] > lines.index(titles[2]) and "(at 4K, above)" in lines[skipped[0]]


def test_far_recall_section_pairs_again_with_shared_and_bolds_what_auto_selects():
    """bench/recall_variants.py from synthetic needle output: the verdict pairs ``again`` with ``shared`` on the
    same reads (counts and McNemar's discordant pairs computed here by hand), the number row sits beside the name
    rows, and the harder needles' table bolds ``shared`` up to 32K and ``again`` at 128K (``auto``'s choice)."""

    def task(found: dict[str, list[bool]], policy: str = "h2o", recall: int = 256) -> dict:
        secs = {"again": 2.0, "shared": 1.0}
        cells = [{"policy": policy, "recall": recall, "select": sel, "depth": 0.5,
                  "answers": [{"trial": t, "correct": c, "answer": "x", "recall_seconds": secs[sel]}
                              for t, c in enumerate(hits)]} for sel, hits in found.items()]
        summary = [{"policy": policy, "budget": "256", "recall": recall, "select": sel, "correct": sum(hits),
                    "total": len(hits)} for sel, hits in found.items()]
        return {"result": {"results": cells, "summary": summary}}

    data = {
        "variants-name-32k": task({"shared": [True, True, False, True], "again": [True, True, True, True]}),
        "variants-name-128k": task({"shared": [False, False, True, False], "again": [True, True, True, False]}),
        "variants-number-128k": task({"shared": [True] * 4, "again": [True] * 4}),
        "paraphrase-1k": {"result": {"results": [], "summary": [
            {"policy": "full", "budget": None, "recall": 0, "select": "shared", "correct": 8, "total": 10},
            {"policy": "h2o", "budget": "256", "recall": 256, "select": "shared", "correct": 7, "total": 10}]}},
        "paraphrase-128k": task({"shared": [True, False], "again": [True, True]}),
    }
    text = recall_variants.verdict(data)
    assert "the name, `again` 3/4" in text and "`shared` 1/4" in text and "2 / 0" in text  # 2 found only by again
    assert "the number, `again` 4/4" in text and "0 / 0" in text and "2.00× `shared`'s" in text
    table = recall_variants.table_variants(data).splitlines()
    assert "number, 128K" in table[0] and "**4/4**" in next(r for r in table if r.startswith("| `shared`"))
    kinds = recall_variants.table_kinds(data).splitlines()
    head = [c.strip() for c in kinds[0].split("|")[1:-1]]
    para = [c.strip() for c in kinds[2].split("|")[1:-1]]
    cell = dict(zip(head, para, strict=True))
    assert cell["`again`, 128K (default)"].startswith("**2/2**") and cell["`shared`, 128K"].startswith("1/2 ")
    assert cell["`shared`, 1K (default)"].startswith("**7/10**") and cell["`full`, 8K"] == "not run"
    assert "2/2 at 128K (1.25× `full`'s rate at 1K)" in recall_variants.kinds_line(data)

