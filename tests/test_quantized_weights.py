"""4- and 8-bit weights (bitsandbytes) through kvtool's own loader, on the CPU backend bitsandbytes ships.

The loader's quantized path is what a GPU user of ``--quantize`` runs; bitsandbytes 0.48+ runs the same
layers on CPU, so CI checks it: the layers really are bitsandbytes', nothing evicted equals the quantized
model's own forward, 4-bit is NF4 with double quantization, ``profile`` counts what the weights occupy
(packed codes and their scales), and ``ask`` answers end to end with stderr free of per-call warnings.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from kvtool.cli.app import app
from kvtool.config import QUANT_BYTES_PER_PARAM
from kvtool.runtime.memory import weights_bytes
from kvtool.runtime.model import load_model
from kvtool.runtime.profiling import parameter_bytes
from tests.helpers import dense_logits, make_engine, stream_logits, tiny_checkpoint

pytest.importorskip("bitsandbytes")
MODES = ["8bit", "4bit"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # hidden 128: every linear layer's weights split into whole 64-value blocks of 4-bit scales
    return tiny_checkpoint(tmp_path_factory.mktemp("quant") / "tiny", hidden=128)


@pytest.fixture(params=MODES)
def quantized(request, checkpoint):
    """A fresh load per test: bitsandbytes' CPU backend re-packs 4-bit weights at their first forward."""
    return request.param, load_model(str(checkpoint), device="cpu", quantize=request.param)


def _stored_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct tensor the model's state dict holds (quantized codes, scales, code tables;
    not the JSON blob of settings that bitsandbytes packs into a tensor only for saving)."""
    seen: dict[int, int] = {}
    for key, t in model.state_dict().items():
        if isinstance(t, torch.Tensor) and ".quant_state." not in key:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def test_the_linear_layers_are_bitsandbytes_and_nothing_evicted_equals_their_own_forward(quantized):
    quantize, loaded = quantized
    assert loaded.quantize == quantize
    kinds = {type(m).__name__ for m in loaded.model.modules()}
    assert ("Linear4bit" if quantize == "4bit" else "Linear8bitLt") in kinds
    ids = torch.randint(0, len(loaded.tokenizer), (70,), generator=torch.Generator().manual_seed(2))
    own = dense_logits(loaded.model, ids)
    got, cache = stream_logits(make_engine(loaded.model, "sink", 96, block_size=16), ids)
    assert cache.counters.evicted_tokens == 0
    torch.testing.assert_close(got.float(), own.float(), atol=1e-4, rtol=1e-4)


def test_4bit_is_nf4_with_double_quantization(quantized):
    quantize, loaded = quantized
    if quantize != "4bit":
        pytest.skip("4-bit only")
    state = loaded.model.model.layers[0].self_attn.q_proj.weight.quant_state
    assert state.quant_type == "nf4" and state.nested


def test_profile_counts_the_weights_as_stored_and_the_plan_formula_is_within_5_percent(quantized):
    quantize, loaded = quantized
    model = loaded.model
    params, counted = parameter_bytes(model)
    stored = _stored_bytes(model)
    assert abs(counted - stored) <= 0.01 * stored, (counted, stored)
    linear = sum(
        math.prod(m.weight.quant_state.shape) if quantize == "4bit" else m.weight.numel()
        for m in model.modules()
        if type(m).__name__ in ("Linear4bit", "Linear8bitLt")
    )
    assert params == sum(p.numel() for p in load_model(loaded.source, device="cpu").model.parameters())
    formula = weights_bytes(params, 4, quantize, params - linear)  # float32 on CPU; embeddings unquantized
    assert abs(formula - stored) <= 0.05 * stored, (formula, stored, QUANT_BYTES_PER_PARAM[quantize])


@pytest.mark.parametrize("quantize", MODES)
def test_ask_with_quantized_weights_end_to_end(checkpoint, tmp_path, quantize):
    doc = tmp_path / "d.txt"
    doc.write_text("the cache is small and the pass key is 12345. " * 30)
    r = CliRunner().invoke(
        app,
        [
            "ask",
            str(doc),
            "What is the pass key?",
            "--model",
            str(checkpoint),
            "--quantize",
            quantize,
            "--device",
            "cpu",
            "--budget",
            "96",
            "--block-size",
            "16",
            "--max-new-tokens",
            "4",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["stats"]["quantize"] == quantize and out["stats"]["evicted_tokens"] > 0
    assert "MatMul8bitLt" not in r.stderr and "kernels-community" not in r.stderr
