"""Position re-indexing (``--positions compact|auto``) on tiny RoPE models."""

from __future__ import annotations

import pytest
import torch

from kvtool.config import ROTATE_CHUNK
from kvtool.core.cache import HeadGroup
from kvtool.core.positions import Rotator
from kvtool.errors import UsageError
from tests.helpers import VOCAB, dense_logits, make_engine, stream_logits, tiny_llama, tiny_qwen2


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2])
@pytest.mark.parametrize("mode", ["compact", "auto"])
def test_compact_without_eviction_equals_dense(make, mode):
    model = make()
    ids = torch.randint(0, VOCAB, (100,), generator=torch.Generator().manual_seed(0))
    dense = dense_logits(model, ids)
    got, cache = stream_logits(make_engine(model, "sink", 128, block_size=16, positions=mode), ids)
    torch.testing.assert_close(got, dense, atol=1e-5, rtol=1e-5)
    assert cache.compact == (mode == "compact")


def test_compact_with_scaled_rope_equals_dense():
    model = tiny_llama(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    )
    ids = torch.randint(0, VOCAB, (80,), generator=torch.Generator().manual_seed(1))
    dense = dense_logits(model, ids)
    got, _ = stream_logits(make_engine(model, "sink", 128, block_size=16, positions="compact"), ids)
    torch.testing.assert_close(got, dense, atol=1e-5, rtol=1e-5)


def _rotate64(k: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    ang = delta.double()[..., None] * inv_freq.double()
    ang = torch.cat((ang, ang), -1)
    half = k.shape[-1] // 2
    k = k.double()
    return k * ang.cos() + torch.cat((-k[..., half:], k[..., :half]), -1) * ang.sin()


@pytest.mark.parametrize("max_positions", [2048, 64])  # 64: positions are also shifted back down (renormalised)
@pytest.mark.parametrize("policy", ["sink", "h2o", "keydiff"])
def test_rerotated_keys_equal_keys_rotated_once_to_their_slot(monkeypatch, policy, max_positions):
    """After many evictions every stored key equals its first key rotated once (float64) to its slot."""
    model = tiny_llama(max_positions=max_positions)
    first: dict[tuple[int, int, int], tuple[torch.Tensor, int]] = {}
    original_append = HeadGroup.append

    def spy(self, key_states, value_states, positions, rotary=None):
        li = self._layer_idx
        ks = key_states if self.all_heads else key_states.index_select(1, self.kv_index)
        for h, head in enumerate(self.heads):
            for j, p in enumerate(positions.tolist()):
                first[(li, head, p)] = (ks[0, h, j].clone(), int(rotary[j]))
        return original_append(self, key_states, value_states, positions, rotary)

    monkeypatch.setattr(HeadGroup, "append", spy)
    engine = make_engine(model, policy, 32, block_size=8, positions="compact")
    cache = engine.new_cache()
    for li, layer in enumerate(cache.layers):
        for g in layer.groups:
            g._layer_idx, g._owner = li, cache
    ids = torch.randint(0, VOCAB, (200,), generator=torch.Generator().manual_seed(2))
    stream_logits(engine, ids, cache=cache)
    assert cache.counters.evicted_tokens > 0
    inv = engine.rotator.inv_freq
    P = cache.rotary_next  # the next query's rotary position
    packed = 0
    for li, layer in enumerate(cache.layers):
        for g in layer.groups:
            n = g.length
            rot = g.rotary[:, :n]
            assert bool((rot[:, 1:] > rot[:, :-1]).all())  # order kept, one position per key
            # the largest distance a query sees: capacity + 2 blocks (holes are packed beyond one block)
            assert int(P - rot[:, 0].min()) <= 32 + 2 * 8
            packed += int((rot[:, -n:] == P - n + torch.arange(n)).all())
            for h, head in enumerate(g.heads):
                for r in range(n):
                    pos = int(g.positions[h, r])
                    k0, p0 = first[(li, head, pos)]
                    expected = _rotate64(k0, rot[h, r] - p0, inv)
                    torch.testing.assert_close(g.keys[0, h, g.off + r].double(), expected, atol=1e-5, rtol=1e-5)


def test_auto_switches_exactly_when_the_counter_would_leave_the_trained_range():
    model = tiny_llama(max_positions=64)
    engine = make_engine(model, "sink", 40, block_size=8, positions="auto")
    notes = []
    engine.listener = notes.append
    cache = engine.new_cache()
    ids = torch.randint(0, VOCAB, (120,), generator=torch.Generator().manual_seed(3))
    for s in range(0, 120, 8):
        before = cache.compact
        rotary = cache.seen  # absolute position the block would start at
        engine.step(cache, ids[s : s + 8], 1)
        if not before and cache.compact:
            assert rotary + 8 > 64 and rotary <= 64  # first block that would reach position 64
            assert cache.compact_since == rotary
    assert cache.compact and cache.compact_since == 64
    assert any("compact" in getattr(n, "message", "") for n in notes)


def test_auto_matches_absolute_until_the_switch():
    model = tiny_llama(max_positions=64)
    ids = torch.randint(0, VOCAB, (64,), generator=torch.Generator().manual_seed(4))
    a, _ = stream_logits(make_engine(model, "sink", 40, block_size=8, positions="auto"), ids)
    b, _ = stream_logits(make_engine(model, "sink", 40, block_size=8, positions="absolute"), ids)
    torch.testing.assert_close(a, b)


def test_compact_positions_keep_long_streams_in_range():
    model = tiny_qwen2(max_positions=64)
    engine = make_engine(model, "tova", 24, block_size=8, positions="compact")
    ids = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(5))
    cache = engine.new_cache()
    renormalized = 0
    for s in range(0, 300, 8):
        before = cache.rotary_next
        logits = engine.step(cache, ids[s : s + 8], 1)
        assert torch.isfinite(logits).all()
        assert cache.step.rotary_positions.max() < 64  # never past the trained range
        renormalized += int(cache.step.rotary_positions[0]) < before
    assert renormalized >= 3  # positions were shifted back down several times


def test_unsupported_position_schemes_are_clear_errors():
    with pytest.raises(UsageError):
        Rotator(torch.ones(4), head_dim=16)  # partial rotary
    model = tiny_llama(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(UsageError, match="dynamic"):
        make_engine(model, "sink", 64, positions="compact")
    make_engine(model, "sink", 64, positions="absolute")  # absolute needs no rotation


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_equals_the_rope_formula_and_reuses_its_buffers(dtype):
    """``Rotator.rotate`` against RoPE written out in float64 (the pairs (k1, k2) turned by δ·θ), over
    several work steps and with a shared [n] delta; calls no larger than the largest one reuse every buffer."""
    d = 16
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    rot = Rotator(inv, d)
    g = torch.Generator().manual_seed(0)
    n = 2 * ROTATE_CHUNK + 7
    keys = torch.randn(3, n, d, generator=g).to(dtype)
    for delta in (torch.randint(-40000, 40000, (3, n), generator=g), torch.randint(-9, 9, (n,), generator=g)):
        angles = delta.expand(3, n).double().unsqueeze(-1) * inv.double()
        k = keys.double()
        k1, k2 = k[..., : d // 2], k[..., d // 2 :]
        want = torch.cat((k1 * angles.cos() - k2 * angles.sin(), k2 * angles.cos() + k1 * angles.sin()), -1)
        got = rot.rotate(keys, delta)
        assert got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.double(), want.to(dtype).double(), atol=tol, rtol=tol)
    buffers = {key: b.data_ptr() for key, b in rot.work.buffers.items()}
    rot.rotate(keys[:, :5], torch.zeros(3, 5, dtype=torch.long))
    assert torch.equal(rot.rotate(keys[:, :5], torch.zeros(3, 5, dtype=torch.long)), keys[:, :5])  # δ = 0: identical
    assert {key: b.data_ptr() for key, b in rot.work.buffers.items()} == buffers


@pytest.mark.parametrize("positions", ["compact", "auto"])
def test_compact_reads_rotate_in_buffers_the_plan_counts_and_never_grow_them_per_block(positions):
    """Once a compact read has re-packed a full group, later blocks and decoded tokens rotate in the same
    buffers (no allocation per block or token), and ``rotation_scratch_bytes`` covers them."""
    from kvtool.runtime.memory import rotation_scratch_bytes

    model = tiny_llama(max_positions=64)
    budget, block = 40, 8
    engine = make_engine(model, "h2o", budget, block_size=block, positions=positions)
    ids = torch.randint(0, VOCAB, (400,), generator=torch.Generator().manual_seed(6))
    cache = engine.new_cache()
    seen: list[dict] = []
    for s in range(0, 400, block):
        engine.step(cache, ids[s : s + block], 1)
        seen.append({key: b.data_ptr() for key, b in engine.rotator.work.buffers.items()})
    for tok in ids[:20]:
        engine.step(cache, tok.view(1), 1)
    assert engine.rotator.calls > 0
    assert all(x == seen[-1] for x in seen[len(seen) // 2 :])  # the second half of the read allocates nothing
    assert {key: b.data_ptr() for key, b in engine.rotator.work.buffers.items()} == seen[-1]  # nor decoding
    dims = {
        "num_kv_heads": model.config.num_key_value_heads,
        "head_dim": model.config.hidden_size // model.config.num_attention_heads,
    }
    assert 0 < engine.rotator.work.nbytes() <= rotation_scratch_bytes(dims, torch.float32, budget + block)
