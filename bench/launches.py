"""Kernel launches on kvtool's hot paths, counted on the CPU: aten ops per layer per block and per decoded token.

    python bench/launches.py                 # the table and the targets
    python bench/launches.py --json OUT.json --ops   # also every op's count (where the launches go)

A GPU pays 5–10 µs of host time per kernel launch, which a CPU's slow matrix products hide; on an H200 the
model's own forward of a 128-token block at Llama-3.1-8B's shape is launch-bound below ~1K tokens
(docs/performance.md). So the per-layer work kvtool adds is counted where it can be on any machine: a
``TorchDispatchMode`` sees every aten op a step dispatches (what a CUDA run would launch, give or take fused
kernels), and view ops (``view``, ``transpose``, ``slice``…: no kernel) are left out. Counting is deterministic,
so ``tests/test_launches.py`` pins the figures.

Per layer: a tiny Llama (hidden 64, 4/2 heads, block 16, budget 48, steady state: the cache full and evicting
every block) is run with 2 and with 4 layers; the per-layer count is the difference over 2, the per-block count
of the rest (embedding, norm, LM head, kvtool's per-block set-up) is what is left. Rows:

* ``transformers``: its own chunked prefill (``DynamicCache``, SDPA) and decode, the reference;
* ``ask (default)``: what ``kvtool ask`` runs by default (``h2o``, recall on: an int8 archive of evicted tokens);
* ``ask (GPU path)``: the same as a CUDA device runs it (``BoundedCache.fused_output``: the output from SDPA,
  H2O's probabilities computed for their column sums only);
* ``sink``, ``tova``, ``snapkv``, ``keydiff``, ``h2o``: eviction only.

Sync ops (a CUDA run would stop the host until the GPU catches up: ``item``, ``nonzero``, boolean indexing…)
are counted apart; the target is none per block.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.jsonfile import write_json  # noqa: E402

#: ops whose result a CUDA host must wait for (data-dependent sizes or a value read back)
SYNC_OPS = frozenset({"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique", "_unique2",
                      "unique_consecutive", "unique_dim", "is_nonzero", "equal", "allclose", "tolist"})
#: ops that launch no kernel although their schema does not say "view"
NO_KERNEL = frozenset({"detach", "lift_fresh", "alias", "_to_copy_noop", "empty", "empty_like", "empty_strided",
                       "new_empty", "new_empty_strided", "set_", "resize_", "_reshape_alias", "lift"})
BLOCK, BUDGET, HIDDEN = 16, 48, 64
#: targets: kvtool / transformers, per layer
TARGETS = {("ask (default)", "block"): 1.5, ("ask (default)", "token"): 1.3, ("ask (GPU path)", "block"): 1.5,
           ("ask (GPU path)", "token"): 1.3, ("sink", "block"): 1.2}


class OpCounter:
    """Counts the aten ops dispatched inside ``with counter:`` (``TorchDispatchMode``), views apart."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.record(func)
                return func(*args, **(kwargs or {}))

        self.mode = _Mode()
        self.ops: collections.Counter[str] = collections.Counter()

    def record(self, func) -> None:
        name = func.overloadpacket.__name__
        if getattr(func, "is_view", False) or name in NO_KERNEL:
            return
        self.ops[name] += 1

    def __enter__(self) -> OpCounter:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)

    @property
    def launches(self) -> int:
        return sum(n for op, n in self.ops.items() if op not in SYNC_OPS)

    @property
    def syncs(self) -> int:
        return sum(n for op, n in self.ops.items() if op in SYNC_OPS)


def tiny_llama(layers: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return LlamaForCausalLM(cfg).eval()


def _ids(n: int, seed: int):
    import torch

    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed))


def count_transformers(layers: int) -> tuple[OpCounter, OpCounter]:
    """transformers' chunked prefill (one steady block) and decode (one token) with its own cache."""
    import torch
    from transformers import DynamicCache

    model = tiny_llama(layers)
    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    ids = _ids(BUDGET + 3 * BLOCK, 1)
    with torch.inference_mode():  # as kvtool's engine runs (composite ops such as linear stay one op)
        for s in range(0, BUDGET + 2 * BLOCK, BLOCK):
            model(ids[None, s : s + BLOCK], past_key_values=cache, use_cache=True, logits_to_keep=1)
        block = ids[None, -BLOCK:]
        with OpCounter() as per_block:
            out = model(block, past_key_values=cache, use_cache=True, logits_to_keep=1)
        tok = out.logits[0, -1].argmax().view(1, 1)
        model(tok, past_key_values=cache, use_cache=True)  # a first decode step: steady state after it
        with OpCounter() as per_token:
            model(tok, past_key_values=cache, use_cache=True)
    return per_block, per_token


def _engine(layers: int, policy: str, archive: str | None = None, listener=None):
    """kvtool's engine on the tiny Llama; ``archive``: recall 32 with an int8 archive in that directory."""
    import torch

    from kvtool.core.engine import Engine, EngineConfig, model_env
    from kvtool.policies import build_policy

    model = tiny_llama(layers)
    cfg = EngineConfig(budget=BUDGET, block_size=BLOCK, sinks=4, recent=8, positions="absolute",
                       recall=32 if archive else 0, archive_dtype=torch.int8 if archive else None,
                       archive_dir=archive)
    env = model_env(model, cfg)
    return Engine(model, build_policy(policy, {}, env), cfg, env=env, listener=listener)


def count_kvtool(layers: int, policy: str, recall: bool, fused: bool = False) -> tuple[OpCounter, OpCounter]:
    """kvtool's engine: one steady evicting block, then one decoded token (a lazy step: no eviction)."""
    import torch


    with tempfile.TemporaryDirectory(prefix="kvtool-launches-") as archive:
        engine = _engine(layers, policy, archive if recall else None)
        cache = engine.new_cache()
        cache.fused_output = fused  # the GPU's way for H2O: output from SDPA, probabilities for their sums only
        ids = _ids(BUDGET + 4 * BLOCK, 1)
        with torch.inference_mode():
            for s in range(0, BUDGET + 3 * BLOCK, BLOCK):  # past the first evictions: a steady block next
                engine.step(cache, ids[s : s + BLOCK], 1)
            with OpCounter() as per_block:
                logits = engine.step(cache, ids[-BLOCK:], 1)
            assert cache.counters.evicted_tokens > 0
            tok = torch.tensor([int(logits[-1].argmax())])
            lazy, cache.lazy = cache.lazy, True  # as Engine.generate decodes: evicting once per block of tokens
            try:
                engine.step(cache, tok, 1)
                with OpCounter() as per_token:
                    engine.step(cache, tok, 1)
            finally:
                cache.lazy = lazy
    return per_block, per_token


def count_decode_loop(tokens: int = 64, every: int = 8) -> dict:
    """The whole decode loop as ``ask --json`` runs it on a GPU: ``Engine.generate`` with the default chooser
    (greedy, the no-repeat 4-gram guard) reading the answer back every ``every`` tokens. Returns the sync ops in
    its dispatch trace (a read of the answer is a device-to-host copy there, not an aten op on a CPU) and the
    reads themselves (one progress event each)."""
    import torch

    from kvtool.core.events import DecodeProgress
    from kvtool.core.sampling import Chooser

    reads: list = []
    engine = _engine(2, "h2o", listener=reads.append)
    cache = engine.new_cache()
    with torch.inference_mode():
        logits = engine.feed(cache, [_ids(BUDGET + 2 * BLOCK, 1)], progress=False)
        with OpCounter() as ops:
            out, _ = engine.generate(cache, logits, tokens, set(), Chooser(tokens, "cpu", no_repeat_ngram=4),
                                     read_every=every)
    return {"tokens": len(out), "every": every, "sync_ops": ops.syncs, "launches": ops.launches,
            "reads": sum(isinstance(e, DecodeProgress) for e in reads), "evictions_possible": tokens // BLOCK + 1}


ROWS = {"transformers": None, "ask (default)": ("h2o", True), "ask (GPU path)": ("h2o", True, True),
        "sink": ("sink", False), "tova": ("tova", False),
        "snapkv": ("snapkv", False), "keydiff": ("keydiff", False), "h2o": ("h2o", False)}


def measure(rows: list[str]) -> dict[str, dict]:
    """Per row: launches and syncs per layer (the 4 − 2 layers difference over 2) and per block/token rest."""
    import torch

    torch.set_num_threads(1)
    out: dict[str, dict] = {}
    for name in rows:
        counts = {}
        for layers in (2, 4):
            spec = ROWS[name]
            counts[layers] = count_transformers(layers) if spec is None else count_kvtool(layers, *spec)
        row: dict = {}
        for i, unit in enumerate(("block", "token")):
            two, four = counts[2][i], counts[4][i]
            per_layer = (four.launches - two.launches) / 2
            row[unit] = {"per_layer": per_layer, "rest": two.launches - 2 * per_layer,
                         "syncs_per_layer": (four.syncs - two.syncs) / 2, "syncs_rest": two.syncs - (four.syncs
                                                                                                   - two.syncs),
                         "ops_per_layer": {op: (four.ops[op] - two.ops[op]) / 2
                                           for op in sorted(set(four.ops) | set(two.ops))
                                           if four.ops[op] != two.ops[op]}}
        out[name] = row
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(ROWS), help="rows to count (" + ", ".join(ROWS) + ")")
    ap.add_argument("--ops", action="store_true", help="print every op's count per layer per block")
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args()
    rows = [r for r in (x.strip() for x in args.rows.split(",")) if r]
    if "transformers" not in rows:
        rows.insert(0, "transformers")
    with contextlib.redirect_stderr(open(os.devnull, "w")):  # noqa: SIM115 (transformers' deprecation notes)
        result = measure(rows)
    ref = result["transformers"]
    print(f"non-view aten ops (tiny Llama, block {BLOCK}, budget {BUDGET}; per layer = (4 layers − 2 layers) / 2)")
    print(f"{'row':<16}{'per layer·block':>16}{'×':>7}{'rest/block':>12}{'per layer·token':>17}{'×':>7}"
          f"{'rest/token':>12}{'syncs/block':>13}{'syncs/token':>13}")
    for name, row in result.items():
        b, t = row["block"], row["token"]
        print(f"{name:<16}{b['per_layer']:>16.1f}{b['per_layer'] / ref['block']['per_layer']:>7.2f}"
              f"{b['rest']:>12.0f}{t['per_layer']:>17.1f}{t['per_layer'] / ref['token']['per_layer']:>7.2f}"
              f"{t['rest']:>12.0f}{4 * b['syncs_per_layer'] + b['syncs_rest']:>13.0f}"
              f"{4 * t['syncs_per_layer'] + t['syncs_rest']:>13.0f}")
        row["block"]["ratio"] = b["per_layer"] / ref["block"]["per_layer"]
        row["token"]["ratio"] = t["per_layer"] / ref["token"]["per_layer"]
    print("\ntargets (per layer, kvtool / transformers; syncs per block at 4 layers):")
    for (name, unit), target in TARGETS.items():
        if name in result:
            ratio = result[name][unit]["ratio"]
            print(f"  {'ok  ' if ratio <= target else 'MISS'} {name} per {unit}: {ratio:.2f}× (target ≤ {target}×)")
    for name, row in result.items():
        syncs = 4 * row["block"]["syncs_per_layer"] + row["block"]["syncs_rest"]
        print(f"  {'ok  ' if syncs == 0 else 'MISS'} {name}: {syncs:.0f} sync ops per block (target 0)")
    loop = count_decode_loop()
    print(f"  {'ok  ' if loop['sync_ops'] == 0 else 'MISS'} decode loop ({loop['tokens']} tokens, read every "
          f"{loop['every']} as `ask --json` on a GPU): {loop['sync_ops']} sync ops (target 0), {loop['reads']} reads "
          f"of the answer (one per {loop['every']} tokens and one before each lazy eviction)")
    result["decode_loop"] = loop
    if args.ops:
        for name, row in result.items():
            ops = ", ".join(f"{op} {n:g}" for op, n in sorted(row["block"]["ops_per_layer"].items(),
                                                              key=lambda kv: -kv[1]))
            print(f"\n{name} per layer per block: {ops}")
    if args.json_path:
        write_json(args.json_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
