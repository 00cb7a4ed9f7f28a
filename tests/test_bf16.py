"""bfloat16 numerics on CPU (``pytest -m bf16``): the engine's oracles with the model in bfloat16.

1. Dense equality: with nothing evicted, kvtool in bfloat16 equals transformers in bfloat16 (any block
   size, both position modes), for every family of ``tests/helpers.py`` and the two engine test models.
   Two checks: kvtool against transformers directly, and each against transformers in float32 — kvtool's
   error must not exceed transformers' own bfloat16 error (plus a little).
2. Masking reference after eviction: kvtool in bfloat16 against the float64 masking reference built on
   the same (bfloat16-valued) weights; its error must stay within transformers' own bfloat16 error, the
   dense bfloat16 forward against the dense float64 forward of the same weights.

Tolerances were set by measurement (100 tokens, block 1 and 16; seeds as below; logits of magnitude
≤ 0.75, where one bfloat16 step is 2⁻⁸ ≈ 0.0039): kvtool against transformers differed by at most 0.0088
(gemma2, whose softcapped layers kvtool computes in float32 and transformers' eager path in bfloat16),
0 for the families without sliding or softcapped layers at block 16; kvtool's error against float32 was at
most 1.0× transformers' (both ≤ 0.012). After eviction (tova and h2o, budget 40, block 8, absolute
positions) kvtool's error against the masking reference was at most 1.23× the dense bfloat16 error
(gemma2 h2o: 0.0114 against 0.0093). Compact positions after eviction drift further in bfloat16; that
is the compact re-packing's own test, not this file's.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kvtool.core.layout import layer_windows
from tests.helpers import (
    FAMILIES,
    VOCAB,
    dense_logits,
    make_engine,
    masking_reference_logits,
    record_visibility,
    stream_logits,
    tiny_family,
    tiny_llama,
    tiny_qwen2,
)

pytestmark = pytest.mark.bf16

#: kvtool-bf16 against transformers-bf16, absolute (measured ≤ 0.0088: about 2 bfloat16 steps at |logit| < 1)
DIRECT_ATOL = 0.016
#: kvtool's error against a float32/float64 reference ≤ RATIO × transformers' own bfloat16 error + SLACK
RATIO, SLACK = 1.5, 0.002

MODELS = {**{f: (lambda f=f: tiny_family(f)) for f in FAMILIES}, "tiny_llama": tiny_llama, "tiny_qwen2": tiny_qwen2}


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("positions", ["absolute", "compact"])
def test_bf16_nothing_evicted_equals_transformers_bf16(name, block_size, positions):
    ids = _ids(100, 1)
    reference = dense_logits(MODELS[name](), ids)  # float32
    model = MODELS[name]().to(torch.bfloat16)
    theirs = dense_logits(model, ids)
    got, cache = stream_logits(make_engine(model, "sink", 128, block_size=block_size, positions=positions), ids)
    assert got.dtype == torch.bfloat16
    for window, layer in zip(layer_windows(model.config), cache.layers, strict=True):  # sliding layers drop exactly
        assert window is not None or all(g.length == ids.numel() for g in layer.groups)
    assert _err(got, theirs) <= DIRECT_ATOL
    assert _err(got, reference) <= RATIO * _err(theirs, reference) + SLACK


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("policy", ["tova", "h2o"])
def test_bf16_outputs_after_eviction_equal_masking_reference(monkeypatch, name, policy):
    ids = _ids(100, 1)
    model = MODELS[name]().to(torch.bfloat16)
    seen = record_visibility(monkeypatch)
    got, cache = stream_logits(make_engine(model, policy, 40, block_size=8), ids)
    monkeypatch.undo()
    assert cache.counters.evicted_tokens > 0
    exact = copy.deepcopy(model).double()  # the same bfloat16-valued weights, computed in float64
    reference = masking_reference_logits(exact, ids, seen)
    bf16_noise = _err(dense_logits(model, ids), dense_logits(exact, ids))
    assert _err(got, reference) <= RATIO * bf16_noise + SLACK
