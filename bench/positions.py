"""Perplexity after reading long stretches of a book: ``--positions compact`` vs ``absolute``.

    python bench/positions.py                     # Sherlock Holmes, 4K/16K/64K/128K, budget 1k, sink

The continuation is one fixed passage — the ``--continuation`` tokens right after token
max(lengths) of the book — so the lengths differ only in how much was read before it: for length L
the engine reads the L tokens that lead up to the passage, then feeds the passage one token at a
time (eviction runs as in generation) and records its perplexity. Comparing different passages
would mostly measure how hard each passage is. SmolLM2-135M was trained on 8,192 positions: with
``absolute`` every length past that asks the model for positions it never saw.
The target: compact stays within 10% of its 4K figure at every length.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_tokens(text: str) -> int:
    text = text.strip().lower()
    return int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)


EVICT_SECONDS: dict[str, dict[int, tuple[float, float]]] = {}


def rotation_costs(loaded, budget: int, block: int) -> None:
    """Measured cost of the two ways to keep compact positions, per prefill block (all layers).

    * delta (what kvtool does): rotate only the keys whose slot moved, once per eviction — included
      in the engine's eviction time, compared here between compact and absolute runs;
    * rotate-at-attention (the alternative): keep un-rotated keys and rotate the whole cache of every
      layer for every block and every decoded token.
    """
    import torch

    from kvtool.core.engine import EngineConfig, model_env
    from kvtool.core.positions import Rotator

    env = model_env(loaded.model, EngineConfig(budget=budget, block_size=block))
    rot = Rotator.from_model(loaded.model)
    keys = torch.randn(env.num_kv_heads, budget + block, env.head_dim)
    delta = torch.randint(0, budget, (env.num_kv_heads, budget + block))
    for _ in range(3):
        rot.rotate(keys, delta)
    t0 = time.perf_counter()
    reps = 20
    for _ in range(reps):
        for _layer in range(env.num_layers):
            rot.rotate(keys, delta)
    whole = (time.perf_counter() - t0) / reps
    print(f"\nrotation cost per block ({env.num_layers} layers, {env.num_kv_heads} KV heads, {budget + block} tokens):")
    print(f"  rotate-at-attention (whole cache, every block and decoded token): {whole * 1e3:7.2f} ms")
    for mode, rows in EVICT_SECONDS.items():
        for L, (secs, blocks) in rows.items():
            per_step = secs / blocks * 1e3
            print(f"  {mode:>8} after {L // 1024:>4}K: eviction incl. delta rotation {per_step:7.2f} ms per step")


def run(mode: str, ids, lengths: list[int], cont: int, args, loaded) -> dict[int, float]:
    import torch

    from kvtool.core.engine import Engine, EngineConfig, model_env
    from kvtool.policies import build_policy

    cfg = EngineConfig(budget=parse_tokens(args.budget), block_size=args.block_size, positions=mode)
    env = model_env(loaded.model, cfg)
    engine = Engine(loaded.model, build_policy(args.policy, {}, env), cfg, env=env)
    end = max(lengths)
    passage = ids[end : end + cont]
    out: dict[int, float] = {}
    for L in lengths:
        t0 = time.perf_counter()
        cache = engine.new_cache()
        for s in range(end - L, end, args.block_size):
            logits = engine.step(cache, ids[s : min(s + args.block_size, end)], 1)
        nll = 0.0
        for i in range(cont):
            nll -= float(torch.log_softmax(logits[-1].float(), -1)[passage[i]])
            logits = engine.step(cache, passage[i : i + 1], 1)
        out[L] = math.exp(nll / cont)
        EVICT_SECONDS.setdefault(mode, {})[L] = (cache.timer.totals(wait=True)["evict"], L / args.block_size + cont)
        extra = f", compact since token {cache.compact_since}" if cache.compact else ""
        took = time.perf_counter() - t0
        print(f"  {mode:>8} after {L // 1024:>4}K tokens: ppl {out[L]:8.3f}  ({took:5.0f} s{extra})", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--book", default=str(ROOT.parent / "shared" / "corpus" / "sherlock_holmes.txt"))
    ap.add_argument("--lengths", default="4k,16k,64k,128k")
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--budget", default="1k")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--policy", default="sink")
    ap.add_argument("--modes", default="compact,absolute")
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args()

    import torch

    from kvtool.runtime.model import load_model

    torch.set_grad_enabled(False)
    loaded = load_model(args.model)
    text = Path(args.book).read_text(encoding="utf-8")
    ids = torch.tensor(loaded.tokenizer(text, add_special_tokens=False)["input_ids"])
    checkpoints = [parse_tokens(x) for x in args.lengths.split(",")]
    need = max(checkpoints) + args.continuation
    if ids.numel() < need:
        sys.exit(f"{args.book} has {ids.numel()} tokens; need {need}")
    print(f"{Path(args.book).name}: {ids.numel()} tokens; model range {loaded.model.config.max_position_embeddings}; "
          f"policy {args.policy}, budget {args.budget}, block {args.block_size}, continuation {args.continuation}")
    results = {m: run(m, ids, checkpoints, args.continuation, args, loaded) for m in args.modes.split(",")}
    print("\n| tokens read | " + " | ".join(f"{m} ppl" for m in results) + " |")
    print("|---|" + "---|" * len(results))
    for L in checkpoints:
        print(f"| {L // 1024}K | " + " | ".join(f"{results[m][L]:.3f}" for m in results) + " |")
    if "compact" in results:
        base = results["compact"][checkpoints[0]]
        worst = max(abs(results["compact"][L] / base - 1) for L in checkpoints)
        verdict = "ok" if worst <= 0.10 else "MISS"
        print(f"\n{verdict}: compact stays within {worst:.1%} of its {checkpoints[0] // 1024}K figure (target 10%)")
    rotation_costs(loaded, parse_tokens(args.budget), args.block_size)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
