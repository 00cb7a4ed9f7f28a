"""The live view and the streamed answer on one terminal, and progress rows for slow phases.

A fake terminal is a rich console forced into terminal mode over a buffer that the "stdout" writes go to as well,
so the buffer holds exactly what a person would see scroll by, in order.
"""

from __future__ import annotations

import io
import time

import pytest
from rich.console import Console

from kvtool.cli.dashboard import Dashboard
from kvtool.core.events import DecodeProgress, MemorySample, PrefillProgress
from kvtool.runtime.events import DecodeStarting
from tests.helpers import tiny_checkpoint

ANSWER = "Irene Adler is the woman."


def _prefill(done: int) -> PrefillProgress:
    return PrefillProgress(tokens_done=done, tokens_total=1000, seconds=0.1 * done / 100, cache_min=10,
                           cache_mean=10.0, cache_max=10, evicted_total=0, memory=MemorySample(1, 1))


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
    after = screen.getvalue()[len(before):]
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
        s = Session(resolve_settings(None, {"model": model_dir, "budget": "160", "block_size": 32,
                                            "max_new_tokens": 6}), listener=dash)
        doc = tmp_path / "doc.txt"
        doc.write_text("the cache is small and the pass key is 12345 hello world. " * 20, encoding="utf-8")
        read = s.read(open_document(str(doc)))
        ans = s.ask(read, "What is the pass key?", on_text=write)
        read.close()
    assert live_at_write and not any(live_at_write)
    answer = "".join(pieces)
    assert answer.strip() == ans.answer
    assert screen.getvalue()[first[0]:].startswith(answer)  # nothing drawn inside the answer
