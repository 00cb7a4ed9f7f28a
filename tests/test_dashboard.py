"""Dashboard tests: synthetic engine events in, recorded console text out (no model, no sleeping)."""

from __future__ import annotations

import io
import re
from typing import Any

import pytest
from rich.console import Console

from kvtool.cli.dashboard import Dashboard, choose_mode, format_bytes, format_duration, format_rate, make_listener
from kvtool.core.events import DecodeProgress, MemorySample, Note, PrefillProgress, RunSummary

GIB = 1024**3
ANSI = re.compile(r"\x1b\[")

STATS: dict[str, Any] = {
    "model": "[org]/tiny-model",  # brackets: must not be eaten as rich markup
    "policy": "snapkv",
    "budget": 2048,
    "block_size": 512,
    "device": "cuda",
    "dtype": "bfloat16",
    "document_tokens": 100_000,
    "cached_tokens_max": 1024,
    "prefill_seconds": 50.0,
    "prefill_tokens_per_second": 2000.0,
    "decode_tokens_per_second": 10.0,
    "kv_cache_bytes": 12_345_678,
    "peak_memory_bytes": 2 * GIB,
    "evicted_tokens": 98_976,
    "per_layer": {"0": 1024, "1": 1000},
    "missing": None,
}


def prefill(
    i: int, total: int | None = 100_000, cuda: bool = False, step: int = 1000, seconds_per_step: float = 0.5
) -> PrefillProgress:
    """The i-th of 100 blocks over a 100,000-token document at 2,000 tok/s."""
    memory = MemorySample(
        rss_bytes=int(1.5 * GIB),
        peak_rss_bytes=2 * GIB,
        cuda_allocated_bytes=3 * GIB if cuda else None,
        cuda_reserved_bytes=4 * GIB if cuda else None,
        cuda_peak_bytes=int(3.5 * GIB) if cuda else None,
    )
    return PrefillProgress(
        tokens_done=step * i,
        tokens_total=total,
        seconds=seconds_per_step * i,
        cache_min=1000,
        cache_mean=1012.5,
        cache_max=1024,
        evicted_total=max(0, step * i - 1024),
        memory=memory,
        time_split={"forward": 0.40, "probs": 0.05, "score": 0.03, "evict": 0.02},
    )


def run(dash: Dashboard, cuda: bool = False, summary: bool = True) -> None:
    """A whole synthetic run: 100 prefill blocks, a note, 20 decoded tokens, the summary."""
    with dash:
        for i in range(1, 101):
            dash(prefill(i, cuda=cuda))
        dash(Note("switched to compact positions"))
        for t in range(1, 21):
            dash(DecodeProgress(tokens=t, seconds=0.1 * t, text="x"))
        if summary:
            dash(RunSummary(stats=STATS))


def live_console() -> Console:
    return Console(file=io.StringIO(), record=True, width=120, force_terminal=True)


def plain_console() -> Console:
    return Console(file=io.StringIO(), record=True, force_terminal=False)


def rendered(dash: Dashboard) -> str:
    """The live view as it would be drawn right now."""
    console = Console(file=io.StringIO(), record=True, width=160, force_terminal=True)
    console.print(dash.render())
    return console.export_text()


# --------------------------------------------------------------------------- mode selection


@pytest.mark.parametrize(
    ("quiet", "tty", "mode"),
    [(False, True, "live"), (False, False, "plain"), (True, True, "quiet"), (True, False, "quiet")],
)
def test_choose_mode(quiet: bool, tty: bool, mode: str) -> None:
    assert choose_mode(quiet=quiet, stderr_is_tty=tty) == mode


def test_unknown_mode_rejected() -> None:
    with pytest.raises(ValueError, match="fancy"):
        make_listener("fancy")


@pytest.mark.parametrize("mode", ["live", "plain"])
def test_default_console_writes_to_stderr_only(mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    dash = make_listener(mode)
    assert dash.console.stderr
    run(dash)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "snapkv" in captured.err


# --------------------------------------------------------------------------- live mode


def test_live_run_shows_figures() -> None:
    console = live_console()
    run(Dashboard("live", console, live_during_decode=True))
    text = console.export_text()
    assert "done · 100,000 tokens · 2,000 tok/s" in text
    assert "min 1,000 · mean 1,012.5 · max 1,024" in text
    assert "evicted 98,976" in text
    assert "RSS 1.50 GiB (peak 2.00 GiB)" in text
    assert "CUDA" not in text.split("run summary")[0]  # not on CPU
    assert "10.0% of block time (score 6.0% · evict 4.0%)" in text
    assert "20 tokens · 10.0 tok/s" in text
    assert "note: switched to compact positions" in text
    # Summary table: every key, values human-readable.
    for key in STATS:
        assert key in text
    assert "[org]/tiny-model" in text
    assert "11.8 MiB" in text  # kv_cache_bytes
    assert "2,000 tok/s" in text
    assert "50.0 s" in text
    assert '{"0":1024,"1":1000}' in text
    assert "n/a" in text


def test_live_shows_cuda_memory() -> None:
    console = live_console()
    run(Dashboard("live", console, live_during_decode=True), cuda=True)
    text = console.export_text()
    assert "CUDA allocated 3.00 GiB · reserved 4.00 GiB · peak 3.50 GiB" in text


def test_live_view_mid_prefill() -> None:
    dash = Dashboard("live", live_console())
    assert "waiting for the first block" in rendered(dash)
    dash(prefill(45, seconds_per_step=1 / 3))  # 45,000 tokens in 15 s: 3,000 tok/s, 55,000 left: 18 s
    text = rendered(dash)
    assert "45% 45,000 / 100,000 tokens" in text
    assert "3,000 tok/s" in text
    assert "elapsed 0:00:15" in text
    assert "ETA 0:00:18" in text
    assert "evicted 43,976 tokens" in text


@pytest.mark.parametrize("total", [None, 20_000])  # unknown, and a stale estimate below what is read
def test_live_view_unknown_or_outgrown_total(total: int | None) -> None:
    dash = Dashboard("live", live_console())
    dash(prefill(45, total=total))
    text = rendered(dash)
    assert "45,000 / ? tokens" in text
    assert "ETA ?" in text
    assert "%" not in text.split("\n")[0]


def test_live_freezes_before_decode_when_answer_streams_to_terminal() -> None:
    console = live_console()
    dash = Dashboard("live", console, live_during_decode=False)
    with dash:
        dash(prefill(100))
        live = dash.live
        assert live is not None and live.is_started
        dash(DecodeProgress(tokens=1, seconds=0.1))
        assert not live.is_started and dash.live is None
        dash(DecodeProgress(tokens=20, seconds=2.0))
        dash(RunSummary(stats={"policy": "snapkv"}))
    text = console.export_text()
    assert text.count("decode: 20 tokens in 2.0 s (10.0 tok/s)") == 1
    assert "snapkv" in text


@pytest.mark.parametrize("exc_type", [RuntimeError, KeyboardInterrupt])
def test_exit_on_exception_stops_live(exc_type: type[BaseException]) -> None:
    console = live_console()
    dash = Dashboard("live", console)
    with pytest.raises(exc_type):
        with dash:
            dash(prefill(3))
            live = dash.live
            assert live is not None and live.is_started
            raise exc_type("boom")
    assert not live.is_started
    assert dash.live is None
    assert console.file.getvalue().endswith("\x1b[?25h")  # cursor shown again, nothing drawn after
    assert "3,000 / 100,000 tokens" in console.export_text()  # last frame kept on screen


def test_live_listener_is_cheap() -> None:
    """Listener calls only store the event, so thousands of them cost no rendering at all."""
    console = live_console()
    dash = Dashboard("live", console)
    with dash:
        before = len(console.file.getvalue())
        for i in range(1, 5001):
            dash(prefill(i, total=5_000_000))
        assert dash._prefill is not None and dash._prefill.tokens_done == 5_000_000
    # At most the frames the 4 Hz refresh thread drew plus the final one, never one per event.
    frames = console.file.getvalue()[before:].count("prefill")
    assert frames < 50


# --------------------------------------------------------------------------- plain mode


def test_plain_run_is_a_handful_of_plain_lines() -> None:
    console = plain_console()
    run(Dashboard("plain", console))
    raw = console.file.getvalue()
    assert not ANSI.search(raw)
    lines = raw.splitlines()
    prefill_lines = [line for line in lines if line.startswith("prefill:")]
    assert 3 <= len(prefill_lines) <= 12  # start, one per ~10 %, done: for 100 events
    assert prefill_lines[0] == "prefill: started, document 100,000 tokens"
    assert "prefill: 50,000 / 100,000 tokens (50%), 2,000 tok/s" in raw
    assert "prefill: done, 100,000 tokens in 50.0 s (2,000 tok/s), evicted 98,976, peak RSS 2.00 GiB" in lines
    assert "note: switched to compact positions" in lines
    assert "decode: 20 tokens in 2.0 s (10.0 tok/s)" in lines
    assert "  model: [org]/tiny-model" in lines
    assert "  kv_cache_bytes: 11.8 MiB" in lines
    assert "  peak_memory_bytes: 2.00 GiB" in lines
    assert "  evicted_tokens: 98,976" in lines
    assert len(lines) - len(STATS) <= 16


def test_plain_unknown_total_prints_by_time() -> None:
    console = plain_console()
    dash = Dashboard("plain", console)
    with dash:
        for i in range(1, 101):  # 50 s of engine time, total never known
            dash(prefill(i, total=None))
    lines = console.export_text().splitlines()
    assert lines[0] == "prefill: started, document length unknown"
    assert lines[-1].startswith("prefill: done, 100,000 tokens in 50.0 s")
    assert 4 <= len(lines) <= 8  # every 10 s
    assert all("%" not in line for line in lines)


def test_plain_cuda_peak_in_done_line() -> None:
    console = plain_console()
    run(Dashboard("plain", console), cuda=True, summary=False)
    assert "peak CUDA 3.50 GiB" in console.export_text()


# --------------------------------------------------------------------------- quiet mode


def test_quiet_prints_nothing() -> None:
    console = live_console()
    dash = make_listener("quiet", console)
    run(dash)
    assert dash.live is None
    assert console.export_text() == ""
    assert console.file.getvalue() == ""


# --------------------------------------------------------------------------- summary table and helpers


def test_summary_table_values() -> None:
    console = Console(file=io.StringIO(), record=True, width=120)
    console.print(Dashboard("live", console).summary_table({"ok": True, "budget": 2048, "layers": list(range(100))}))
    text = console.export_text()
    assert "yes" in text and "2,048" in text
    assert "…" in text  # long nested values are cut; --json has them whole


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1536, "1.50 KiB"), (12_345_678, "11.8 MiB"), (3 * GIB, "3.00 GiB"), (None, "n/a")],
)
def test_format_bytes(n: int | None, text: str) -> None:
    assert format_bytes(n) == text


@pytest.mark.parametrize(
    ("x", "text"),
    [
        (2000.0, "2,000 tok/s"),
        (12.34, "12.3 tok/s"),
        (1.5, "1.50 tok/s"),
        (None, "n/a tok/s"),
        (float("inf"), "n/a tok/s"),
    ],
)
def test_format_rate(x: float | None, text: str) -> None:
    assert format_rate(x) == text


def test_format_duration() -> None:
    assert format_duration(3725) == "1:02:05"
    assert format_duration(None) == "?"
