"""The time split: seconds per section of the block loop (``kvtool/core/timing.py``).

On CPU the host clock is the sections' time; the engine's progress events split a block into the model's
forward, the probabilities, scoring and eviction, adding up to the steps' time. On a GPU a section is a
pair of device events read later: a CPU has no device events, so the bookkeeping (events pooled, at most
``MAX_PENDING`` unread, reads that wait for nothing unless asked) is checked here with a stand-in that has
``torch.Event``'s four methods and a device clock the test moves; ``tests/test_cuda.py`` checks real CUDA
events against a synchronised clock.
"""

from __future__ import annotations

import pytest
import torch

from kvtool.core.events import PrefillProgress
from kvtool.core.timing import MAX_PENDING, SectionTimer, time_split
from tests.helpers import VOCAB, make_engine, tiny_family, tiny_llama


class _Device:
    """A device queue: events record the time at which the queued work before them will have run."""

    def __init__(self) -> None:
        self.now = 0.0  # what the device has finished, in ms
        self.queued = 0.0  # where the queue ends
        self.syncs = 0
        self.made = 0

    def event(self) -> _Event:
        self.made += 1
        return _Event(self)


class _Event:
    def __init__(self, device: _Device) -> None:
        self.device, self.at = device, None

    def record(self) -> None:
        self.at = self.device.queued

    def query(self) -> bool:
        return self.at is not None and self.at <= self.device.now

    def synchronize(self) -> None:
        self.device.syncs += 1
        self.device.now = max(self.device.now, self.at)

    def elapsed_time(self, end: _Event) -> float:
        assert self.query() and end.query(), "elapsed_time of an event the device has not reached"
        return end.at - self.at


def test_host_mode_adds_up_sections_and_resets():
    timer = SectionTimer(torch.device("cpu"))
    assert timer.mode == "host"
    t = timer.start()
    sum(range(10_000))
    timer.stop("probs", t)
    totals = timer.totals()
    assert totals["probs"] > 0 and totals["score"] == 0
    timer.reset()
    assert set(timer.totals().values()) == {0.0}


def test_events_are_read_without_waiting_and_waited_for_only_when_asked():
    dev = _Device()
    timer = SectionTimer(torch.device("cpu"), event=dev.event)
    assert timer.mode == "events"
    for ms in (3.0, 5.0):  # two sections queued: 3 ms then 5 ms of device work
        t = timer.start()
        dev.queued += ms
        timer.stop("evict", t)
    assert timer.totals()["evict"] == 0.0 and dev.syncs == 0  # the device has run nothing yet
    dev.now = 3.0
    assert timer.totals()["evict"] == 0.003 and dev.syncs == 0  # the first is done: read, no wait
    assert abs(timer.totals(wait=True)["evict"] - 0.008) < 1e-12 and dev.syncs == 1  # one wait for both


def test_events_are_pooled_and_unread_pairs_are_bounded():
    dev = _Device()
    timer = SectionTimer(torch.device("cpu"), event=dev.event)
    for _ in range(3 * MAX_PENDING):  # a device that never catches up on its own
        t = timer.start()
        dev.queued += 1.0
        timer.stop("probs", t)
        assert len(timer._pending) <= MAX_PENDING
    assert dev.made <= 2 * (MAX_PENDING + 1)  # the oldest pair is read and reused
    made = dev.made
    dev.now = dev.queued
    timer.totals()
    for _ in range(MAX_PENDING):  # everything read: a steady loop makes no new event
        t = timer.start()
        dev.queued += 1.0
        timer.stop("probs", t)
    assert dev.made == made
    assert abs(timer.totals(wait=True)["probs"] - 4 * MAX_PENDING / 1000.0) < 1e-9
    timer.reset()
    assert not timer._pending and timer.totals()["probs"] == 0.0


def test_time_split_parts_add_up_to_the_steps_time():
    split = time_split({"step": 1.0, "probs": 0.2, "score": 0.1, "evict": 0.05})
    assert list(split) == ["forward", "probs", "score", "evict"] and abs(split["forward"] - 0.65) < 1e-12
    assert time_split({"step": 0.1, "probs": 0.2})["forward"] == 0.0  # never negative


def test_progress_events_split_each_block_and_add_up_to_the_steps():
    events: list[PrefillProgress] = []
    engine = make_engine(tiny_llama(), "h2o", 32, block_size=16)
    engine.listener = lambda e: events.append(e) if isinstance(e, PrefillProgress) else None
    cache = engine.new_cache()
    engine.feed(cache, [torch.arange(16 * 8) % VOCAB], total=16 * 8)
    assert len(events) == 8 and cache.counters.evicted_tokens > 0
    last = events[-1].time_split
    assert set(last) == {"forward", "probs", "score", "evict"} and min(last.values()) > 0
    assert abs(sum(last.values()) - cache.timer.totals()["step"]) < 1e-9
    assert all(a.time_split["forward"] <= b.time_split["forward"] for a, b in zip(events, events[1:], strict=False))
    cache.clear()
    assert cache.timer.totals()["step"] == 0.0


@pytest.mark.parametrize(("family", "policy"), [("llama3", "h2o"), ("gemma2", "sink")])
def test_every_section_the_engine_opens_it_closes(family, policy):
    """On a GPU an opened section holds two pooled events until read: a mark the engine started and never
    stopped would leak one per block, and the pool would make new events in the loop. With the stand-in
    events on a real engine (evicting h2o + recall; Gemma 2's softcapped attention with a policy that reads
    no probabilities), then a decode, a second read makes no new event."""
    dev = _Device()
    dev.now = float("inf")  # every recorded event counts as finished
    engine = make_engine(tiny_family(family), policy, 32, block_size=16, recall=16)
    engine.listener = lambda e: None
    cache = engine.new_cache()
    cache.timer = SectionTimer(torch.device("cpu"), event=dev.event)
    ids = torch.arange(16 * 6) % VOCAB

    def read() -> None:
        cache.clear()
        logits = engine.feed(cache, [ids], total=ids.numel())
        engine.generate(cache, logits, 6, eos_ids=set())
        cache.timer.totals()

    read()
    made = dev.made
    read()
    assert dev.made == made and cache.counters.evicted_tokens > 0
    totals = cache.timer.totals()
    assert all(totals[k] == 0.0 for k in totals)  # the stand-in's device time: nothing queued
