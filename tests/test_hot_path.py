"""The per-layer path (append, attention, scoring, eviction, compact re-packing) makes no host sync.

On a GPU, ``.item()``, ``int(tensor)``, ``.tolist()``, ``.nonzero()``, ``bool(tensor)`` or ``.cpu()``
inside a layer stalls the pipeline once per layer per step. The test patches every such tensor
method to count its calls while the engine's per-layer code runs (``BoundedLayer.update`` and the
attention function's per-group body, which includes the policy's observe/score/select, the gather
and the compact re-pack) and asserts zero, for a decode step that evicts and for a prefill block.
"""

from __future__ import annotations

import pytest
import torch

from kvtool.core import attention
from kvtool.core.cache import BoundedLayer
from tests.helpers import VOCAB, make_engine, tiny_llama

SYNCING = ("item", "tolist", "nonzero", "cpu", "numpy", "__int__", "__index__", "__float__", "__bool__",
           "argwhere", "any", "all", "equal", "unique")


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
@pytest.mark.parametrize("policy", ["sink", "keydiff", "tova", "h2o", "scissorhands+vatp", "snapkv+caote",
                                    "tova+fastcaote"])
def test_per_layer_path_makes_no_host_sync(monkeypatch, policy, positions):
    model = tiny_llama()
    engine = make_engine(model, policy, 40, block_size=8, positions=positions)
    cache = engine.new_cache()
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
