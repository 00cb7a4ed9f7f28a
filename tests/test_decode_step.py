"""The fixed-shape decode step (``kvtool/core/decode_step.py``) against the block path it replaces.

Oracles: the block path (``decode_step="blocks"``: each token fed as a block of one, today's decode) gives
the same answer token for token and the same kept positions after every eviction, on tiny models of the
families whose attention differs (GQA, sliding windows, QK-norm, logit softcapping) and for policies that
read nothing, the newest row, per-token constants and running sums; every tensor a step touches keeps its
address over 300 steps across evictions (what a CUDA graph replays); a dispatch trace of one step holds no
op that waits for a value and no op of kvtool's that allocates; the fixed-shape chooser equals the
host-indexed one. On CUDA (``-m cuda``) the captured step equals the same step run eagerly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.launches import SYNC_OPS
from kvtool.core.decode_step import DecodeStep
from kvtool.core.events import Note
from kvtool.core.sampling import Chooser
from tests.helpers import VOCAB, make_engine, tiny_family

BUDGET, BLOCK, NEW = 48, 16, 60  # 60 tokens fill the 16-token spare region three times: evictions in the answer
FAMILIES = ["llama3", "mistral", "qwen3", "gemma2"]  # GQA + llama3 RoPE, sliding window, QK-norm, softcapping
POLICIES = ["h2o", "sink", "tova", "keydiff", "snapkv+caote"]
KVTOOL = str(Path(__file__).resolve().parents[1] / "kvtool")


def decode(
    family: str,
    policy: str,
    mode: str,
    new: int = NEW,
    cite: bool = False,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    positions: str = "absolute",
    max_positions: int = 2048,
):
    """Prefill 100 tokens and decode ``new`` (guarded greedy); returns (tokens, kept positions after each eviction,
    the engine, the cache, citation mass)."""
    model = tiny_family(family, seed=3, max_positions=max_positions).to(device, dtype)
    engine = make_engine(model, policy, BUDGET, block_size=BLOCK, positions=positions, decode_step=mode)
    cache = engine.new_cache()
    kept: list[list] = []
    block_path = engine.step

    def step(c, ids, rows):  # the block path: every token in "blocks", the evicting ones with the fixed step
        before = c.counters.evicted_tokens
        logits = block_path(c, ids, rows)
        if c.counters.evicted_tokens != before:
            kept.append([g.positions[:, : g.length].tolist() for g in c.groups()])
        return logits

    ids = torch.randint(0, VOCAB, (100,), generator=torch.Generator().manual_seed(5)).to(device)
    logits = engine.feed(cache, [ids], progress=False)
    engine.step = step  # type: ignore[method-assign]
    if cite:
        cache.start_mass()
    out, _ = engine.generate(cache, logits, new, set(), Chooser(new, device, no_repeat_ngram=2))
    mass = None
    if cite:
        pos, m = cache.stop_mass()
        mass = dict(zip(pos.tolist(), m.tolist(), strict=True))
    return out, kept, engine, cache, mass


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", POLICIES)
def test_the_step_decodes_what_the_block_path_decodes(family, policy):
    want, want_kept, _, _, _ = decode(family, policy, "blocks")
    got, got_kept, engine, cache, _ = decode(family, policy, "eager")
    assert engine.decode_step_of(cache) is not None  # the fixed step ran (not a fallback)
    assert len(want) == NEW and len(want_kept) >= 3  # evictions inside the answer
    assert got == want
    assert got_kept == want_kept


@pytest.mark.parametrize("positions", ["compact", "auto"])
def test_compact_positions_and_a_switch_inside_the_answer(positions):
    """Compact positions (the step writes the RoPE position beside the stream one) and, with ``auto`` and a
    128-token model range, the switch to compact at token 28 of the answer and a renormalisation after it: steps
    the block path takes, the fixed step resuming from the host's counters."""
    want = decode("llama3", "h2o", "blocks", new=90, positions=positions, max_positions=128)
    got = decode("llama3", "h2o", "eager", new=90, positions=positions, max_positions=128)
    assert got[3].compact and got[2].decode_step_of(got[3]) is not None
    assert got[0] == want[0]
    assert got[1] == want[1]
    assert [g.rotary[:, : g.length].tolist() for g in got[3].groups()] == [
        g.rotary[:, : g.length].tolist() for g in want[3].groups()
    ]


@pytest.mark.parametrize("positions", ["compact", "auto"])
def test_compact_positions_in_16_bits_keep_the_original_keys_in_the_step(positions):
    """A 16-bit cache at compact positions keeps each key at its original position too (re-packs turn keys from
    there): the step writes it, turned back by the stream-minus-rotary delta exactly as the block path's append
    does, so the answer, the rotary positions and the original keys are the block path's (the switch at the
    question of a document past the model's range is what a 128K read of a 128K-position model does)."""
    want = decode("llama3", "h2o", "blocks", new=90, positions=positions, max_positions=128, dtype=torch.bfloat16)
    got = decode("llama3", "h2o", "eager", new=90, positions=positions, max_positions=128, dtype=torch.bfloat16)
    assert got[3].compact and got[2].decode_step_of(got[3]) is not None  # the step ran, not the block path
    assert all(g.origin_keys(g.length) is not None for g in got[3].groups())
    assert got[0] == want[0]
    assert got[1] == want[1]
    for mine, theirs in zip(got[3].groups(), want[3].groups(), strict=True):
        assert torch.equal(mine.rotary[:, : mine.length], theirs.rotary[:, : theirs.length])
        assert torch.equal(mine.origin_keys(mine.length), theirs.origin_keys(theirs.length))
        assert torch.equal(mine.stored_keys()[:, : mine.length], theirs.stored_keys()[:, : theirs.length])


def test_citation_mass_is_the_block_paths():
    want = decode("llama3", "tova", "blocks", cite=True)
    got = decode("llama3", "tova", "eager", cite=True)
    assert got[0] == want[0] and got[4] is not None and want[4] is not None
    assert got[4].keys() == want[4].keys()
    assert all(got[4][p] == pytest.approx(m, abs=1e-5) for p, m in want[4].items())


def test_every_buffer_keeps_its_address_over_300_steps_across_evictions(monkeypatch):
    seen: list[list[int]] = []
    run = DecodeStep.run

    def recording(self: DecodeStep) -> None:
        run(self)
        seen.append([t.data_ptr() for t in self.buffers()])

    monkeypatch.setattr(DecodeStep, "run", recording)
    out, kept, _, _, _ = decode("llama3", "h2o", "eager", new=310)
    assert len(out) == 310 and len(kept) >= 15 and len(seen) >= 290  # the steps between 15+ evictions
    assert all(ptrs == seen[0] for ptrs in seen)


class StepTrace(TorchDispatchMode):
    """Every aten op of one step: its name, whether kvtool's code called it (not the model's), and the storage
    it writes in place (``None`` for a functional op)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, bool, int | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        written = None
        if func._schema.is_mutable and args and isinstance(args[0], torch.Tensor):
            written = args[0].untyped_storage().data_ptr()
        if isinstance(kwargs.get("out"), torch.Tensor):
            written = kwargs["out"].untyped_storage().data_ptr()
        self.ops.append((name, _called_from_kvtool(), written))
        return func(*args, **kwargs)


def _called_from_kvtool() -> bool:
    """Whether the innermost frame outside torch (and this test) is kvtool's."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if "/torch/" not in path and path != __file__:
            return path.startswith(KVTOOL)
        frame = frame.f_back
    return False


#: ops that allocate a new tensor of their own (not an op's result): kvtool's step must call none of them
ALLOCATING = frozenset(
    {
        "cat",
        "stack",
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "zeros",
        "zeros_like",
        "new_zeros",
        "ones",
        "ones_like",
        "new_ones",
        "full",
        "full_like",
        "new_full",
        "arange",
        "clone",
        "resize_",
        "set_",
        "scalar_tensor",
        "tensor",
    }
)
#: the in-place ops that may write the cache's per-token buffers: the token's slot, and the running sums
CACHE_WRITES = {
    "keys": {"index_copy_"},
    "values": {"index_copy_"},
    "positions": {"index_copy_"},
    "rotary": {"index_copy_"},
    "state": {"index_copy_", "add_"},
}


@pytest.mark.parametrize(("family", "policy"), [("llama3", "h2o"), ("gemma2", "keydiff"), ("mistral", "tova")])
def test_one_step_syncs_nothing_and_allocates_no_cache_state(family, policy):
    """Asserts, over every aten op of one step (model included): none reads a value back (``SYNC_OPS``); none
    that kvtool's code calls allocates (``ALLOCATING``: the cache, masks, counters and the chooser's work all
    live in the step's buffers; the model's activations, and the results of kvtool's compute ops such as the
    attention output, are fresh tensors, which a CUDA graph serves from its own pool); the cache's K/V,
    positions and policy state are written only in place, by ``index_copy_`` at the fill slot (and H2O's
    ``add_``); and the cache keeps its storages (no buffer is replaced)."""
    _, _, engine, cache, _ = decode(family, policy, "eager", new=20)
    step = engine.decode_step_of(cache)
    assert step is not None
    names = {b.data.untyped_storage().data_ptr(): name for g in cache.groups() for name, b in g.buffers.items.items()}
    before = [t.data_ptr() for t in step.buffers()]
    trace = StepTrace()
    with torch.inference_mode(), trace:
        step.run()
    assert len(trace.ops) > 50
    assert [op for op, _, _ in trace.ops if op in SYNC_OPS] == []
    assert [op for op, ours, _ in trace.ops if ours and op in ALLOCATING] == []
    writes = {(names[w], op) for op, _, w in trace.ops if w in names}
    assert {name for name, _ in writes} >= {"keys", "values", "positions", "rotary"}
    assert all(op in CACHE_WRITES[name] for name, op in writes), writes
    assert [t.data_ptr() for t in step.buffers()] == before


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_the_fixed_chooser_is_the_host_indexed_one(penalty):
    """``choose_at`` (whole buffer, masked past ``t``) against ``__call__`` (slices at a host ``t``) over a run
    of logits that make the guard and the penalty bite; letters on half the vocabulary."""
    gen = torch.Generator().manual_seed(0)
    letters = torch.rand(VOCAB, generator=gen) < 0.5
    host = Chooser(80, "cpu", repetition_penalty=penalty, no_repeat_ngram=2, letters=letters)
    fixed = Chooser(80, "cpu", repetition_penalty=penalty, no_repeat_ngram=2, letters=letters)
    t_dev, out = torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)
    for t in range(80):
        logits = torch.randn(VOCAB, generator=gen)
        logits[:5] += 6  # a few favourites: repeats the guard must ban
        t_dev.fill_(t)
        fixed.choose_at(logits, t_dev, out)
        assert int(out) == int(host(logits, t)), t
    assert fixed.read(0, 80) == host.read(0, 80)


def test_an_unsupported_configuration_decodes_through_the_block_path():
    """Sampling reads each token on the host: no step is built, the answer is the block path's."""
    model = tiny_family("llama3", seed=3)
    engine = make_engine(model, "sink", BUDGET, block_size=BLOCK)
    notes: list = []
    engine.listener = notes.append
    cache = engine.new_cache()
    logits = engine.feed(cache, [torch.arange(40) % VOCAB], progress=False)
    engine.generate(cache, logits, 20, set(), Chooser(20, "cpu", temperature=1.0, seed=1))
    assert engine.decode_step_of(cache) is None
    assert not [n for n in notes if isinstance(n, Note)]  # a CPU decodes eagerly either way: nothing to say


CUDA = torch.cuda.is_available()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.cuda
@pytest.mark.parametrize(("policy", "positions"), [("h2o", "absolute"), ("sink", "absolute"), ("h2o", "compact")])
def test_cuda_the_captured_step_is_the_eager_step(policy, positions):
    """bf16 on the GPU, 256 tokens: the replayed graph gives the eager step's tokens and kept positions after
    every eviction (the same kernels, so exactly), and the step was captured; at compact positions with a
    128-token range, original keys kept and renormalised on the way (what a read past the range decodes with)."""
    kw = {"positions": positions, "max_positions": 128 if positions == "compact" else 2048}
    eager = decode("llama3", policy, "eager", new=256, device="cuda", dtype=torch.bfloat16, **kw)
    captured = decode("llama3", policy, "capture", new=256, device="cuda", dtype=torch.bfloat16, **kw)
    step = captured[2].decode_step_of(captured[3])
    assert step is not None and step.graph is not None and step.failure is None
    assert len(eager[1]) >= 10
    assert captured[0] == eager[0]
    assert captured[1] == eager[1]


def test_the_decode_bench_runs_every_row_on_a_tiny_shape(tmp_path):
    """``bench/decode_step.py`` (gpu-check's decode step) starts and writes its rows on a CPU: the three modes
    answer alike, transformers' row and the ratios are there."""
    import json

    from bench.decode_step import main

    out = tmp_path / "decode.json"
    args = ["--config", "tiny", "--lengths", "256", "--budget", "64", "--block-size", "16", "--policies", "sink"]
    assert main([*args, "--decode-tokens", "40", "--baseline-lengths", "256", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {(r["row"], r["mode"]): r for r in doc["rows"]}
    assert set(rows) == {("kvtool:sink", m) for m in ("capture", "eager", "blocks")} | {("transformers", "eager")}
    assert all(r["decode_tokens_per_second"] > 0 for r in rows.values())
    assert all(rows["kvtool:sink", m]["tokens_equal"] for m in ("capture", "eager", "blocks"))
    assert "kvtool:sink capture / transformers at 256" in doc["summary"]


def test_a_cache_and_its_step_are_freed_with_the_last_use_of_the_cache():
    """The engine keeps a step per live cache only: dropping the cache frees it, its K/V and its step at once
    (reference counting, no cycle), so the memory plan's one cache holds across documents."""
    import gc
    import weakref

    _, _, engine, cache, _ = decode("llama3", "sink", "eager", new=20)
    step = engine.decode_step_of(cache)
    assert step is not None
    refs = [weakref.ref(cache), weakref.ref(step), weakref.ref(cache.groups()[0].buffers.items["keys"].data)]
    gc.disable()  # freed by reference counting alone: a cycle would wait for the collector
    try:
        del cache, step
        assert [r() for r in refs] == [None, None, None]
    finally:
        gc.enable()
