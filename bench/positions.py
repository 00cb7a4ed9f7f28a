"""Perplexity after reading long prefixes of a book: ``--positions compact`` vs ``absolute``.

    python bench/positions.py                     # Sherlock Holmes, 4K/16K/64K/128K, budget 1k, sink

The book is streamed once per position mode. At each checkpoint L the next ``--continuation``
tokens are fed one at a time (eviction runs as in generation) and their perplexity is recorded;
reading then continues from there. So "ppl at L" is the perplexity of tokens L..L+M given
everything read before, under the bounded cache. SmolLM2-135M was trained on 8,192 positions:
with ``absolute`` every checkpoint past that asks the model for positions it never saw.
The target (issue 8): compact stays within 10% of its 4K figure at every length.
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


def run(mode: str, ids, checkpoints: list[int], cont: int, args, loaded) -> dict[int, float]:
    import torch

    from kvtool.engine import Engine, EngineConfig, model_env
    from kvtool.policies import build_policy

    cfg = EngineConfig(budget=parse_tokens(args.budget), block_size=args.block_size, positions=mode)
    env = model_env(loaded.model, cfg)
    engine = Engine(loaded.model, build_policy(args.policy, {}, env), cfg, env=env)
    cache = engine.new_cache()
    out: dict[int, float] = {}
    pos = 0
    logits = None
    t0 = time.perf_counter()
    for L in checkpoints:
        while pos < L:
            step = min(args.block_size, L - pos)
            logits = engine.step(cache, ids[pos : pos + step], 1)
            pos += step
        nll = 0.0
        for _ in range(cont):
            nll -= float(torch.log_softmax(logits[-1].float(), -1)[ids[pos]])
            logits = engine.step(cache, ids[pos : pos + 1], 1)
            pos += 1
        out[L] = math.exp(nll / cont)
        extra = f", compact since {cache.compact_since}" if cache.compact else ""
        print(f"  {mode:>8} after {L // 1024:>4}K tokens: ppl {out[L]:8.3f}  "
              f"({time.perf_counter() - t0:6.0f} s elapsed{extra})", flush=True)
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

    from kvtool.model import load_model

    torch.set_grad_enabled(False)
    loaded = load_model(args.model)
    text = Path(args.book).read_text(encoding="utf-8")
    ids = torch.tensor(loaded.tokenizer(text, add_special_tokens=False)["input_ids"])
    checkpoints = [parse_tokens(x) for x in args.lengths.split(",")]
    need = max(checkpoints) + args.continuation * len(checkpoints)
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
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
