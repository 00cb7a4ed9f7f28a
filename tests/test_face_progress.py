"""The live view and the streamed answer on one terminal, and progress rows for slow phases.

A fake terminal is a rich console forced into terminal mode over a buffer that the "stdout" writes go to as well,
so the buffer holds exactly what a person would see scroll by, in order.
"""

from __future__ import annotations

import io
import re
import time
from unittest.mock import patch

import pytest
from rich.console import Console

from kvtool.cli import dashboard as dashboard_module
from kvtool.cli.dashboard import Dashboard
from kvtool.core.events import DecodeProgress, MemorySample, PrefillProgress
from kvtool.runtime.events import DecodeStarting
from tests.helpers import tiny_checkpoint

ANSWER = "Irene Adler is the woman."


def _prefill(done: int) -> PrefillProgress:
    return PrefillProgress(
        tokens_done=done,
        tokens_total=1000,
        seconds=0.1 * done / 100,
        cache_min=10,
        cache_mean=10.0,
        cache_max=10,
        evicted_total=0,
        memory=MemorySample(1, 1),
    )


def _terminal() -> tuple[Console, io.StringIO]:
    screen = io.StringIO()
    return Console(file=screen, force_terminal=True, width=130), screen


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tiny_checkpoint(tmp_path_factory.mktemp("face") / "tiny"))


# -- 1. the answer is never redrawn over ---------------------------------------------------------------------------


def test_live_view_stops_before_the_answer_streams_and_the_answer_stays_whole() -> None:
    console, screen = _terminal()
    dash = Dashboard("live", console, refresh_per_second=50, live_during_decode=False)
    with dash:
        for done in range(100, 1001, 100):
            dash(_prefill(done))
        time.sleep(0.1)  # let the refresh thread draw a few frames
        live = dash.live
        dash(DecodeStarting("q"))
        assert dash.live is None and not live.is_started  # stopped before anything of the answer is written
        before = screen.getvalue()
        for i, ch in enumerate(ANSWER):
            screen.write(ch)  # the answer, as tokens arrive on stdout
            dash(DecodeProgress(tokens=i + 1, seconds=0.01 * (i + 1)))
            time.sleep(0.005)
        screen.write("\n")
    after = screen.getvalue()[len(before) :]
    assert after.startswith(ANSWER + "\n")  # intact, in order, no cursor movement or erase inside it
    assert "prefill" not in after and after.count("done ·") == 0  # no frame redrawn after the answer
    assert "decode: 25 tokens" in after  # the rate comes as a plain line after the answer


class _EveryToken:
    """A detokenizer that writes every token at once (a random model's first token may be half a character,
    which the real one holds back, hiding when the first write happens)."""

    def __init__(self, tokenizer: object) -> None:
        self.pieces: list[str] = []

    def push(self, token: int) -> str:
        self.pieces.append(f"<{token}>")
        return self.pieces[-1]

    def text(self) -> str:
        return "".join(self.pieces)


def test_session_announces_decoding_before_the_first_token_is_written(model_dir, tmp_path, monkeypatch) -> None:
    """End to end on a tiny model: when the first piece of the answer is written, the live view is gone."""
    from kvtool.documents import open_document
    from kvtool.runtime import session as session_module
    from kvtool.runtime.session import Session
    from kvtool.runtime.settings import resolve_settings

    monkeypatch.setattr(session_module, "Detokenizer", _EveryToken)

    console, screen = _terminal()
    dash = Dashboard("live", console, refresh_per_second=50, live_during_decode=False)
    live_at_write: list[bool] = []
    pieces: list[str] = []
    first: list[int] = []

    def write(piece: str) -> None:
        live_at_write.append(dash.live is not None)
        first[:] = first or [len(screen.getvalue())]
        pieces.append(piece)
        screen.write(piece)

    with dash:
        s = Session(
            resolve_settings(None, {"model": model_dir, "budget": "160", "block_size": 32, "max_new_tokens": 6}),
            listener=dash,
        )
        doc = tmp_path / "doc.txt"
        doc.write_text("the cache is small and the pass key is 12345 hello world. " * 20, encoding="utf-8")
        read = s.read(open_document(str(doc)))
        ans = s.ask(read, "What is the pass key?", on_text=write)
        read.close()
    assert live_at_write and not any(live_at_write)
    answer = "".join(pieces)
    assert answer.strip() == ans.answer
    assert screen.getvalue()[first[0] :].startswith(answer)  # nothing drawn inside the answer


# -- 2. progress for the slow steps outside prefill ----------------------------------------------------------------


def _check_phase(events: list, name: str, unit: str) -> None:
    """One step's events: start at 0, never going back, finished exactly once, at the end, at its total."""
    mine = [e for e in events if e.name == name]
    assert mine, f"no events for {name!r} in {[e.name for e in events]}"
    assert mine[0].done == 0 and all(e.unit == unit for e in mine)
    assert [e.done for e in mine] == sorted(e.done for e in mine)
    assert len({e.total for e in mine}) == 1 and mine[-1].total is not None
    assert [e.finished for e in mine] == [False] * (len(mine) - 1) + [True]


def test_model_load_reports_a_phase(model_dir) -> None:
    from kvtool.runtime.events import PhaseProgress
    from kvtool.runtime.model import load_model

    said: list[str] = []
    events: list[PhaseProgress] = []
    load_model(model_dir, device="cpu", progress=said.append, phase=events.append)
    assert [(e.done, e.total) for e in events] == [(0, 1), (1, 1)]
    assert events[0].name.startswith("loading tiny (") and not said  # the event replaces the line
    _check_phase(events, events[0].name, "steps")


def test_embedded_conversion_reports_its_steps(tmp_path, monkeypatch) -> None:
    """The one-time GGUF conversion, with transformers' GGUF reader replaced by a tiny model."""
    import transformers

    from kvtool.runtime.events import PhaseProgress
    from kvtool.runtime.model import convert as kconv
    from tests.helpers import tiny_llama, tiny_tokenizer

    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("KVTOOL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(kconv, "embedded_gguf_path", lambda: gguf)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_tokenizer())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny_llama())
    events: list[PhaseProgress] = []
    target = kconv.embedded_checkpoint(lambda s: None, events.append)
    assert [(e.done, e.total) for e in events] == [(0, 3), (1, 3), (2, 3), (3, 3)]
    _check_phase(events, "converting embedded model (one time)", "steps")
    assert (target / kconv.CONVERSION_MARKER).is_file()
    events.clear()
    kconv.embedded_checkpoint(lambda s: None, events.append)
    assert events == []  # converted already: no step at all


def test_kvc_save_and_load_report_bytes_in_order(model_dir, tmp_path) -> None:
    from kvtool.documents import open_document
    from kvtool.runtime import store
    from kvtool.runtime.events import PhaseProgress
    from kvtool.runtime.session import Session
    from kvtool.runtime.settings import resolve_settings

    settings = {"model": model_dir, "policy": "h2o", "budget": "160", "block_size": 32, "device": "cpu", "recall": "64"}
    events: list[PhaseProgress] = []

    def listen(e: object) -> None:
        if isinstance(e, PhaseProgress):
            events.append(e)

    doc = tmp_path / "doc.txt"
    doc.write_text("the cache is small and the pass key is 12345 hello world. " * 40, encoding="utf-8")
    s = Session(resolve_settings(None, settings), listener=listen)
    read = s.read(open_document(str(doc)))
    events.clear()
    path = tmp_path / "doc.kvc"
    size = store.save_cache(str(path), s, read)
    read.close()
    names = list(dict.fromkeys(e.name for e in events))
    assert names == ["writing doc.kvc's archive", "writing doc.kvc"]  # the archive first, then the cache
    for name in names:
        _check_phase(events, name, "bytes")
    assert 0 < events[-1].total < size  # the tensor bytes, without the header

    events.clear()
    s2 = Session(resolve_settings(None, settings), listener=listen)
    loaded = store.load_cache(str(path), s2)
    loaded.close()
    names = list(dict.fromkeys(e.name for e in events))
    assert names[-2:] == ["loading doc.kvc", "loading doc.kvc's archive"] and names[0].startswith("loading tiny")
    for name in names:
        _check_phase(events, name, "bytes" if "doc.kvc" in name else "steps")
    assert [e.total for e in events if e.name == "loading doc.kvc"][0] == size
    archive = [e for e in events if e.name == "loading doc.kvc's archive"]
    assert len(archive) > 2 and archive[-1].total > 0


def _phase_run(dash: Dashboard) -> None:
    from kvtool.runtime.events import PhaseProgress

    with dash:
        dash(PhaseProgress("writing doc.kvc", 0, 4 << 20, "bytes"))
        dash(PhaseProgress("writing doc.kvc", 2 << 20, 4 << 20, "bytes"))
        if dash.mode == "live":
            text = _live_text(dash)
            assert "writing doc.kvc: 2.00 MiB / 4.00 MiB" in text and "waiting for the first block" not in text
        dash(PhaseProgress("writing doc.kvc", 4 << 20, 4 << 20, "bytes"))


def _live_text(dash: Dashboard) -> str:
    console = Console(file=io.StringIO(), width=130, record=True)
    console.print(dash.render())
    return console.export_text()


def test_dashboard_draws_phases_in_each_mode() -> None:
    plain = Console(file=io.StringIO(), record=True, force_terminal=False, width=130)
    _phase_run(Dashboard("plain", plain))
    assert plain.export_text() == ""  # a quick step says nothing in a log
    plain = Console(file=io.StringIO(), record=True, force_terminal=False, width=130)
    with patch.object(dashboard_module, "PLAIN_PHASE_SECONDS", 0.0):
        _phase_run(Dashboard("plain", plain))
    lines = plain.export_text().splitlines()
    assert len(lines) == 1 and re.fullmatch(r"writing doc\.kvc: done in \d+\.\d s", lines[0])

    live, _ = _terminal()
    dash = Dashboard("live", live)
    _phase_run(dash)
    assert re.search(r"writing doc\.kvc: done in \d+\.\d s", _live_text(dash))

    quiet = Console(file=io.StringIO(), record=True)
    _phase_run(Dashboard("quiet", quiet))
    assert quiet.export_text() == ""


def test_no_waiting_row_once_answering_without_prefill() -> None:
    """Asking a loaded .kvc: no prefill ever comes, so the frozen view must not say it is waiting for one."""
    from kvtool.runtime.events import PhaseProgress

    console, _ = _terminal()
    dash = Dashboard("live", console, live_during_decode=False)
    assert "waiting for the first block" in _live_text(dash)
    dash(PhaseProgress("loading doc.kvc", 0, 10, "bytes"))
    assert "waiting for the first block" not in _live_text(dash)  # the running step says what happens
    dash(PhaseProgress("loading doc.kvc", 10, 10, "bytes"))
    dash(DecodeStarting("q"))
    text = _live_text(dash)
    assert "waiting for the first block" not in text and "loading doc.kvc: done in" in text
