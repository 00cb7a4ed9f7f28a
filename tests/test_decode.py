"""Decoding on the device: the answer is read back every few tokens, and reading late changes nothing.

Oracles: reading each token (the host's view of every step) against reading every 7 — the same answer,
the same evictions, the same citation mass — with an end token placed at every depth of the answer; and a
dispatch trace of the whole decode loop, which must hold no op that reads a value back.
"""

from __future__ import annotations

import pytest
import torch

from bench.launches import count_decode_loop
from kvtool.core.events import DecodeProgress
from kvtool.core.sampling import Chooser
from tests.helpers import VOCAB, make_engine, tiny_llama

BUDGET, BLOCK, NEW = 48, 16, 60  # 60 tokens pass the 16-token spare region three times: lazy evictions run


def decode(end: int | None, every: int, cite: bool = False, policy: str = "h2o"):
    """Prefill 100 tokens, then decode ``NEW`` (guarded greedy) reading every ``every``; ``end``: an end token."""
    engine = make_engine(tiny_llama(seed=3), policy, BUDGET, block_size=BLOCK)
    events: list = []
    engine.listener = events.append
    cache = engine.new_cache()
    ids = torch.randint(0, VOCAB, (100,), generator=torch.Generator().manual_seed(5))
    logits = engine.feed(cache, [ids], progress=False)
    if cite:
        cache.start_mass()
    out, _ = engine.generate(
        cache, logits, NEW, set() if end is None else {end}, Chooser(NEW, "cpu", no_repeat_ngram=2), read_every=every
    )
    mass = None
    if cite:  # per group and head: position → mass received
        mass = [
            [
                dict(zip(p.tolist(), m.tolist(), strict=True))
                for p, m in zip(g.positions[:, : g.length], g.mass[:, : g.length], strict=True)
            ]
            for g in cache.groups()
            if g.mass is not None
        ]
        cache.stop_mass()
    reads = sum(isinstance(e, DecodeProgress) for e in events)
    return out, cache.counters.evicted_tokens, mass, reads


@pytest.fixture(scope="module")
def free_answer():
    out, evicted, _, _ = decode(None, 1)
    assert len(out) == NEW and evicted > 0
    return out


def test_the_guarded_answer_varies_enough_to_place_an_end_anywhere(free_answer):
    firsts = {tok: i for i, tok in reversed(list(enumerate(free_answer)))}
    assert len(firsts) >= 20  # first occurrences spread over the answer: the end tokens below


@pytest.mark.parametrize("depth", [0.1, 0.3, 0.5, 0.7, 0.9])
def test_reading_every_7_tokens_ends_where_reading_each_does(free_answer, depth):
    firsts = {tok: i for i, tok in reversed(list(enumerate(free_answer)))}
    end, at = min(firsts.items(), key=lambda kv: abs(kv[1] - depth * NEW))
    each = decode(end, 1, cite=True)
    late = decode(end, 7, cite=True)  # 7: reads fall out of step with the 16-token spare region
    assert each[0] == late[0] == free_answer[:at]
    assert late[1] == each[1]  # no eviction ran for a token past the end
    # each head's tokens got the same mass; the late reader also holds the unread tokens it fed: with none
    for want_layer, got_layer in zip(each[2], late[2], strict=True):
        for want, got in zip(want_layer, got_layer, strict=True):
            assert set(want) <= set(got)
            assert all(got[p] == pytest.approx(m, abs=1e-6) for p, m in want.items())
            assert all(m == 0.0 for p, m in got.items() if p not in want)


def test_the_decode_loop_reads_nothing_back_but_the_answer():
    """``bench/launches.py``'s dispatch trace of ``generate`` (chooser, guard, steps, lazy evictions): no op that
    waits for a value; the answer read once per 8 tokens and before each lazy eviction."""
    loop = count_decode_loop(tokens=NEW, every=8)
    assert loop["tokens"] == NEW and loop["sync_ops"] == 0
    assert NEW // 8 <= loop["reads"] <= NEW // 8 + loop["evictions_possible"] + 1


def test_sampling_reads_each_token_and_stays_seeded():
    a = decode_sampled(seed=7)
    assert a == decode_sampled(seed=7)
    assert a != decode_sampled(seed=8)


def decode_sampled(seed: int) -> list[int]:
    engine = make_engine(tiny_llama(seed=3), "sink", BUDGET, block_size=BLOCK)
    cache = engine.new_cache()
    logits = engine.feed(cache, [torch.arange(40) % VOCAB], progress=False)
    out, _ = engine.generate(cache, logits, 20, set(), Chooser(20, "cpu", temperature=1.0, top_p=0.9, seed=seed))
    return out
