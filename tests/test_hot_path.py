"""The per-layer path (append, attention, scoring, eviction, compact re-packing) makes no host sync.

On a GPU, ``.item()``, ``int(tensor)``, ``.tolist()``, ``.nonzero()``, ``bool(tensor)`` or ``.cpu()``
inside a layer stalls the pipeline once per layer per step. The test patches every such tensor
method to count its calls while the engine's per-layer code runs (``BoundedLayer.update`` and the
attention function's per-group body, which includes the policy's observe/score/select, the gather
and the compact re-pack) and asserts zero, for a decode step that evicts and for a prefill block.
The cache is told it runs on an accelerator (``host_reads = False``): on CPU a compact re-pack
reads the position deltas to rotate only the moved prefix, which costs nothing there since CPU
tensors are host memory.
"""

from __future__ import annotations

import pytest
import torch

from kvtool.core import attention
from kvtool.core.cache import BoundedLayer
from tests.helpers import VOCAB, make_engine, tiny_llama

SYNCING = (
    "item",
    "tolist",
    "nonzero",
    "cpu",
    "numpy",
    "__int__",
    "__index__",
    "__float__",
    "__bool__",
    "argwhere",
    "any",
    "all",
    "equal",
    "unique",
)


def _count_syncs(monkeypatch) -> tuple[dict[str, int], list[int]]:
    """Patch the syncing tensor methods; count their calls only while the per-layer path runs."""
    calls: dict[str, int] = {}
    depth = [0]
    for name in SYNCING:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            if depth[0] and not (_name in ("any", "all") and (args or kwargs)):  # any(dim) stays on device
                calls[_name] = calls.get(_name, 0) + 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)

    def inside(fn):
        def wrapped(*args, **kwargs):
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return wrapped

    layer_calls = [0]
    attend = attention._attend_group

    def attend_counted(*args, **kwargs):
        layer_calls[0] += 1
        return inside(attend)(*args, **kwargs)

    monkeypatch.setattr(attention, "_attend_group", attend_counted)
    monkeypatch.setattr(BoundedLayer, "update", inside(BoundedLayer.update))
    return calls, layer_calls


@pytest.mark.parametrize("positions", ["absolute", "compact"])
@pytest.mark.parametrize(
    "policy", ["sink", "keydiff", "tova", "h2o", "scissorhands+vatp", "snapkv+caote", "tova+fastcaote"]
)
def test_per_layer_path_makes_no_host_sync(monkeypatch, policy, positions):
    model = tiny_llama()
    # decoded through the block path, the per-layer path this counts (the fixed-shape decode step has its own
    # dispatch trace in tests/test_decode_step.py)
    engine = make_engine(model, policy, 40, block_size=8, positions=positions, decode_step="blocks")
    cache = engine.new_cache()
    cache.host_reads = False  # the accelerator path (on CPU, compact re-packing reads host memory, which is free)
    ids = torch.randint(0, VOCAB, (100,), generator=torch.Generator().manual_seed(1))
    logits = engine.feed(cache, [ids], progress=False)
    calls, layer_calls = _count_syncs(monkeypatch)
    evicted = cache.counters.evicted_tokens
    engine.step(cache, ids[:8], 1)  # a prefill block (evicts)
    engine.generate(cache, logits, 12, eos_ids=set())  # 11 decode steps: the spare region fills, one eviction
    assert cache.counters.evicted_tokens > evicted
    assert layer_calls[0] == model.config.num_hidden_layers * 12
    assert calls == {}


def test_caote_greedy_select_makes_no_host_sync(monkeypatch):
    model = tiny_llama()
    engine = make_engine(model, "tova+caote", 40, block_size=8, options={"greedy": "true"})
    cache = engine.new_cache()
    ids = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(2))
    engine.feed(cache, [ids[:48]], progress=False)
    calls, layer_calls = _count_syncs(monkeypatch)
    engine.step(cache, ids[48:56], 1)
    assert layer_calls[0] == model.config.num_hidden_layers
    assert calls == {}


@pytest.mark.parametrize(
    "text",
    [
        "the cache is small and the pass key is 12345",
        "héllo wörld — 日本語 🙂 the cache 🙂🙂 key",
        " leading space, then\nnew lines\n\n and tabs\t.",
    ],
)
def test_incremental_detokenizer_streams_the_full_text_with_short_windows(monkeypatch, text):
    from kvtool.runtime.detokenize import Detokenizer
    from tests.helpers import tiny_tokenizer

    tok = tiny_tokenizer()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    ids = ids * 3  # a longer answer than any window
    assert len(ids) > 20
    widths: list[int] = []
    decode = type(tok).decode

    def spy(self, token_ids, *args, **kwargs):
        widths.append(len(token_ids))
        return decode(self, token_ids, *args, **kwargs)

    detok = Detokenizer(tok)
    monkeypatch.setattr(type(tok), "decode", spy)
    pieces = [detok.push(t) for t in ids]
    # Every emoji is several byte tokens: the window waits for the whole character (no U+FFFD piece).
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == decode(tok, ids, skip_special_tokens=True)
    assert max(widths) <= 8  # a window of a few tokens, never the whole answer


def test_memory_sampler_wakes_at_most_every_50_ms():
    from kvtool.core.meter import MemoryMeter

    assert MemoryMeter(torch.device("cpu")).interval >= 0.05


def test_threads_default_to_usable_cores_and_validate():
    import os

    from kvtool.errors import UsageError
    from kvtool.runtime.model import set_threads, usable_cores
    from kvtool.runtime.settings import Settings

    before = torch.get_num_threads()
    try:
        assert usable_cores() == len(os.sched_getaffinity(0))
        assert set_threads(None) == usable_cores() == torch.get_num_threads()
        assert set_threads(1) == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert Settings(threads=3).validate().threads == 3
    for bad in (0, -1, "2", 1.5, True):
        with pytest.raises(UsageError, match="threads"):
            Settings(threads=bad).validate()


def test_core_share_divides_the_cores_among_live_kvtool_processes(tmp_path):
    """Each process takes its cores // (1 + live peers on one of them); dead peers' files are removed."""
    import os
    import subprocess
    import sys

    from kvtool.runtime.cores import CoreShare

    before = torch.get_num_threads()
    share = CoreShare(tmp_path, interval=0.0)
    cores = share.cores
    try:
        assert (tmp_path / str(os.getpid())).exists()
        share.rebalance()
        assert share.peers == 0 and share.threads == len(cores) == torch.get_num_threads()
        # Peers are real registrations (a locked entry each); "elsewhere" rewrites its cores to others.
        code = (
            "import os, sys, time; from kvtool.runtime.cores import CoreShare; s = CoreShare(sys.argv[1]); "
            "cores = sys.argv[2].encode(); os.ftruncate(s._entry_fd, 0) if cores else None; "
            "os.pwrite(s._entry_fd, cores, 0) if cores else None; print('ready', flush=True); time.sleep(60)"
        )
        peer = subprocess.Popen([sys.executable, "-c", code, str(tmp_path), ""], stdout=subprocess.PIPE)
        elsewhere = subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path), str(max(cores) + 1000)], stdout=subprocess.PIPE
        )
        try:
            assert peer.stdout.readline() == b"ready\n" and elsewhere.stdout.readline() == b"ready\n"
            share.rebalance()
            assert share.peers == 1
            assert share.threads == max(1, len(cores) // 2) == torch.get_num_threads()
            assert share.min_threads == share.threads
        finally:
            for p in (peer, elsewhere):
                p.kill()
                p.wait()
                p.stdout.close()
        share.rebalance()  # both died: their files go, the cores come back
        assert share.peers == 0 and share.threads == len(cores) == torch.get_num_threads()
        assert sorted(p.name for p in tmp_path.iterdir()) == [str(os.getpid())]
    finally:
        share.close()
        torch.set_num_threads(before)
    assert not (tmp_path / str(os.getpid())).exists()


def test_core_share_checks_at_most_every_interval(tmp_path, monkeypatch):
    from kvtool.runtime.cores import CoreShare

    share = CoreShare(tmp_path, interval=3600.0)
    calls = []
    monkeypatch.setattr(share, "fair_threads", lambda: calls.append(1) or share.threads)
    try:
        for _ in range(100):  # one per forward: one directory scan, then a clock read each
            share.rebalance()
        assert len(calls) == 1
    finally:
        share.close()
