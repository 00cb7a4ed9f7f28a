"""Citations: the attention mass the cache accumulates, the spans ranked from it, and the CLI around it.

Oracles: the mass accumulated by the bounded cache equals the dense (eager) attention of the same decode
rows summed over heads; spans are checked against a source map with known pages; the real-model test
checks that the needle's page is cited first.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvtool.cli.app import app
from kvtool.runtime.citations import SourceMap, cite
from tests.helpers import make_engine, tiny_checkpoint, tiny_llama

runner = CliRunner()


# -- the accumulated mass ----------------------------------------------------------------------------------------
def test_mass_equals_dense_attention_of_the_decode_rows() -> None:
    """Policy full: per position and layer, Σ over query heads of the decode rows' probabilities (eager attention)."""
    model = tiny_llama(seed=3)
    engine = make_engine(model, "full", None, block_size=16)
    ids = torch.randint(0, 100, (40,))
    decode = torch.randint(0, 100, (5,))
    cache = engine.new_cache()
    for _ in engine.steps(cache, ids):
        pass
    cache.start_mass(first_layer=0)
    for t in decode:
        engine.step(cache, t.view(1))
    per_layer = [(g.positions[:, : g.length].clone(), g.mass[:, : g.length].clone()) for g in cache.groups()]
    positions, mass = cache.stop_mass()
    assert all(g.mass is None for g in cache.groups())  # off again: no buffers, no work
    dense = tiny_llama(seed=3)
    dense.set_attn_implementation("eager")
    with torch.no_grad():
        att = dense(torch.cat([ids, decode])[None], output_attentions=True).attentions
    n = ids.numel() + decode.numel()
    for li, (pos, m) in enumerate(per_layer):
        want = att[li][0, :, ids.numel() :, :].sum((0, 1))  # decode rows, summed over query heads and rows
        got = torch.zeros(n).index_add_(0, pos.reshape(-1), m.reshape(-1))
        assert torch.allclose(got, want, atol=1e-4), li
    assert torch.equal(positions, torch.cat([p.reshape(-1) for p, _ in per_layer]))
    assert torch.allclose(mass, torch.cat([m.reshape(-1) for _, m in per_layer]))


def test_mass_moves_with_eviction_and_covers_only_requested_layers() -> None:
    model = tiny_llama(seed=1)
    engine = make_engine(model, "h2o", 32, block_size=8)
    cache = engine.new_cache()
    for _ in engine.steps(cache, torch.randint(0, 100, (64,))):
        pass
    cache.start_mass(first_layer=1)
    assert cache.layers[0].groups[0].mass is None and cache.layers[1].groups[0].mass is not None
    steps = 12
    for t in torch.randint(0, 100, (steps,)):
        engine.step(cache, t.view(1))  # evicts a token per step: mass is gathered with K/V
    g = cache.layers[1].groups[0]
    total = float(g.mass[:, : g.length].sum())
    heads = model.config.num_attention_heads
    assert 0 < total <= steps * heads + 1e-3  # each step's rows sum to 1 per query head; evicted mass is gone
    # the newest token was attended only by itself (its own step): at most one row per query head
    newest = int(g.positions[:, : g.length].argmax(1)[0])
    assert float(g.mass[0, newest]) <= model.config.num_attention_heads // model.config.num_key_value_heads + 1e-4


# -- spans --------------------------------------------------------------------------------------------------------
class CharTokenizer:
    """One token per character: ids are code points, so decoding is exact."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def make_source(text: str, pages: list[int], first: int = 10) -> SourceMap:
    source = SourceMap(first_position=first)
    at = 0
    for page, chunk in zip(pages, text.splitlines(keepends=True), strict=True):
        source.add_section(at, page, None, None)
        source.add([ord(c) for c in chunk], [(at + i, at + i + 1) for i in range(len(chunk))])
        at += len(chunk)
    return source


def test_the_heaviest_sentence_is_cited_with_its_page() -> None:
    text = "Cats sleep all day. Dogs bark.\nThe key is 42. Birds sing.\nFish swim quietly.\n"
    source = make_source(text, [1, 2, 3])
    key = text.index("42")
    positions = torch.arange(10, 10 + len(text)).repeat(3)  # three heads hold every token
    mass = torch.full((3 * len(text),), 0.01)
    mass[key : key + 2] = 5.0  # one head attends to "42"
    fish = text.index("Fish")
    mass[len(text) + fish : len(text) + fish + 4] = 1.5  # another to "Fish"
    cites = cite(source, positions, mass, CharTokenizer())
    assert [c.page for c in cites] == [2, 3]
    top = cites[0]
    assert top.text == "The key is 42." and text[top.start_char : top.end_char].strip() == "The key is 42."
    assert top.label == "p. 2" and top.line().startswith("p. 2: \u00abThe key is 42.\u00bb")
    assert 0 < cites[1].weight < top.weight < 1
    assert set(top.json()) == {"page", "start_char", "end_char", "text", "weight"}


def test_spans_stop_at_evicted_tokens() -> None:
    text = "alpha beta gamma delta epsilon.\n"
    source = make_source(text, [7])
    held = [i for i in range(len(text)) if not 11 <= i < 17]  # "gamma " was evicted everywhere
    positions = torch.tensor(held) + 10
    source.prune(positions, seen=10 + len(text))
    mass = torch.where(positions == 10 + text.index("delta"), 3.0, 0.1)
    (c, *_) = cite(source, positions, mass, CharTokenizer())
    assert c.text == "delta epsilon." and c.page == 7


# -- the command line (tiny checkpoint) ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tiny_checkpoint(tmp_path_factory.mktemp("cite") / "tiny"))


BASE = ["--budget", "96", "--block-size", "16", "--max-new-tokens", "4", "--quiet"]


def test_cli_cite_json_and_text(model_dir, tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text(
        "# One\n" + "the cache is small. " * 20 + "\n\n# Two\nthe pass key is 12345. hello world.\n", encoding="utf-8"
    )
    r = runner.invoke(app, ["ask", str(doc), "What is the pass key?", "--cite", "--json", "--model", model_dir, *BASE])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    cites = out["answers"][0]["citations"]
    assert 1 <= len(cites) <= 3
    text = doc.read_text(encoding="utf-8")
    for c in cites:
        assert c["section"] in ("One", "Two") and c["page"] is None
        assert text[c["start_char"] : c["end_char"]].strip() == c["text"]
    assert [c["weight"] for c in cites] == sorted((c["weight"] for c in cites), reverse=True)
    r = runner.invoke(app, ["ask", str(doc), "What is the pass key?", "--model", model_dir, "--json", *BASE])
    assert "citations" not in json.loads(r.stdout)["answers"][0]  # without --cite: nothing computed or shown
    r = runner.invoke(app, ["ask", str(doc), "What is the pass key?", "--cite", "--model", model_dir, *BASE])
    assert r.exit_code == 0 and re.search(r"^  \u00a7 \u201c(One|Two)\u201d: \u00ab.+\u00bb \(\d+%\)$", r.stdout, re.M)


def test_cite_from_a_kvc_and_an_old_kvc_without_source_map(model_dir, tmp_path):
    from kvtool.kvc import format as kvc_format
    from kvtool.kvc import load as kvc_load
    from kvtool.kvc import write as kvc_write

    doc = tmp_path / "d.txt"
    doc.write_text("the cache is small. " * 30 + "the pass key is 12345.", encoding="utf-8")
    kvc = tmp_path / "d.kvc"
    r = runner.invoke(
        app,
        ["prefill", str(doc), "-o", str(kvc), "--model", model_dir, "--budget", "96", "--block-size", "16", "--quiet"],
    )
    assert r.exit_code == 0, r.output
    args = ["ask", str(kvc), "What is the pass key?", "--cite", "--json", "--model", model_dir, *BASE]
    direct = runner.invoke(app, ["ask", str(doc), *args[2:]])
    loaded = runner.invoke(app, args)
    assert loaded.exit_code == 0, loaded.output
    assert json.loads(loaded.stdout)["answers"] == json.loads(direct.stdout)["answers"]  # same citations
    # a cache written before citations existed: no source_map in its metadata
    header = kvc_format.read_header(kvc)
    tensors = kvc_load.load_tensors(header)
    meta = dict(header.meta)
    meta["document"] = {k: v for k, v in meta["document"].items() if k not in ("source_map", "format")}
    old = tmp_path / "old.kvc"
    kvc_write.write_kvc(old, tensors, meta)
    r = runner.invoke(app, ["ask", str(old), "What is the pass key?", "--model", model_dir, *BASE])
    assert r.exit_code == 0, r.output  # still loads
    r = runner.invoke(app, ["ask", str(old), "What is the pass key?", "--cite", "--model", model_dir, *BASE])
    assert r.exit_code == 2 and "has no source map" in r.output
    info = runner.invoke(app, ["inspect", str(kvc), "--json"])
    smap = json.loads(info.stdout)["metadata"]["document"]["source_map"]
    assert "ids" not in smap and smap["entries"] > 0


# -- the real model: the needle's page is cited first ---------------------------------------------------------------
CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus"
POLICY = "sink"


@pytest.mark.real_model
def test_real_model_cites_the_needle_page(tmp_path):
    pytest.importorskip("fpdf")
    from kvtool.documents import open_document
    from kvtool.runtime.model import load_model
    from kvtool.runtime.session import Session
    from kvtool.runtime.settings import resolve_settings
    from tests.doc_fixtures import make_pdf

    loaded = load_model(None)
    tok = loaded.tokenizer
    essay = (CORPUS / "paul_graham_essays" / "aord.txt").read_text(encoding="utf-8")
    words = tok.decode(tok(essay, add_special_tokens=False)["input_ids"][:930]).split()
    pages = [" ".join(words[i : i + 120]) for i in range(0, len(words), 120)]  # ~6 pages of ~160 tokens
    hits = answered = 0
    for key in ("71432", "58219", "30917"):
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        doc = make_pdf(tmp_path / f"{key}.pdf", [*pages[:-1], pages[-1] + " " + needle])
        s = Session(resolve_settings(None, {"max_new_tokens": 12, "policy": POLICY, "budget": "512"}), loaded=loaded)
        read = s.read(open_document(str(doc)))
        ans = s.ask(read, "What is the pass key?", cite_spans=True)
        print(key, repr(ans.answer), [c.line(80) for c in ans.citations])
        if key in ans.answer:
            answered += 1
            top = ans.citations[0]
            hits += top.page == len(pages) and key in top.text
    assert answered >= 2 and hits == answered


def test_progress_counts_pages_and_the_source_map_stays_bounded(model_dir, tmp_path):
    """Prefill events carry pages read; the source map holds only tokens some head still holds (recall off:
    with an archive it keeps every token, which recall may bring back)."""
    pytest.importorskip("fpdf")
    from kvtool.cli.dashboard import format_parts
    from kvtool.core.events import PrefillProgress
    from kvtool.documents import open_document
    from kvtool.runtime.citations import held_positions
    from kvtool.runtime.session import Session
    from kvtool.runtime.settings import resolve_settings
    from tests.doc_fixtures import make_pdf

    pages = [f"the cache is small and the pass key is {i} hello world. " * 6 for i in range(8)]
    events: list[PrefillProgress] = []
    s = Session(
        resolve_settings(None, {"model": model_dir, "budget": "48", "block_size": 16, "recall": "off"}),
        listener=lambda e: events.append(e) if isinstance(e, PrefillProgress) else None,
    )
    read = s.read(open_document(str(make_pdf(tmp_path / "p.pdf", pages))))
    done = [e.parts_done for e in events]
    assert done == sorted(done) and done[-1] == 8 and {e.parts_total for e in events} == {8}
    assert events[-1].parts_unit == "page" and format_parts(events[-1]) == ", page 8 / 8"
    source = read.source
    assert source.count == read.document_tokens > 5 * 48
    held = held_positions(read.cache)
    assert torch.equal(source.positions, held[held >= source.first_position])  # exactly the held document tokens


def test_cite_with_recall_again_keeps_the_mass_of_the_first_tokens(tmp_path, monkeypatch):
    """``--recall-select again`` rebuilds the cache after the answer's first tokens; with ``--cite`` the mass those
    tokens paid is kept and the rest of the answer's adds to it. Oracle: every single-token step adds one unit of
    attention per query head in each cited layer, so the cited mass is exactly (fed steps) × layers × heads,
    the first ``AGAIN_AFTER`` - 1 steps included (the turn's token is fed with the second recall, not as a
    step). Citing does not change the answer, and nothing is noted."""
    import kvtool.runtime.session as session_module
    from kvtool.config import AGAIN_AFTER
    from kvtool.core.events import Note
    from kvtool.documents import open_document
    from kvtool.runtime.session import Session
    from kvtool.runtime.settings import resolve_settings

    model = str(tiny_checkpoint(tmp_path / "tiny"))
    doc = tmp_path / "d.md"
    doc.write_text("# One\n" + "the cache is small. " * 120 + "\n\n# Two\nthe pass key is 12345.\n", encoding="utf-8")
    cited: list[tuple[torch.Tensor, torch.Tensor]] = []
    monkeypatch.setattr(session_module, "cite", lambda src, pos, w, tok: cited.append((pos, w)) or cite(
        src, pos, w, tok))
    got = {}
    for select, cite_spans in (("again", True), ("again", False), ("shared", True)):
        notes: list[str] = []
        s = Session(resolve_settings(None, {"model": model, "budget": "256", "block_size": 16, "recall": "32",
                                            "max_new_tokens": 8, "recall_select": select}),
                    listener=lambda e, n=notes: n.append(e.message) if isinstance(e, Note) else None)
        read = s.read(open_document(str(doc)))
        ans = s.ask(read, "What is the pass key?", cite_spans=cite_spans)
        got[select, cite_spans] = ans.ids
        assert not any("--recall-select" in n for n in notes)
        if cite_spans:
            config = s.model.config
            layers = config.num_hidden_layers - config.num_hidden_layers // 2
            turned = select == "again" and len(ans.ids) > AGAIN_AFTER
            steps = len(ans.ids) - 1 - int(turned)
            _, weights = cited[-1]
            assert turned or select == "shared"
            assert float(weights.sum()) == pytest.approx(steps * layers * config.num_attention_heads, rel=1e-4)
            assert ans.citations is not None
    assert got["again", True] == got["again", False]
