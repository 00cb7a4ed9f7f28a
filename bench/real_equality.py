"""kvtool equals the model at a real model's shape: nothing evicted, kvtool's block-wise stream in bf16 against
transformers in bf16, each against a float32 reference of the same random weights.

    python bench/real_equality.py --config llama-3.1-8b --layers 4 --tokens 4k --json OUT.json

The unit tests check this on tiny models; a real width (4096 hidden, 32 heads over 8 KV heads, head_dim 128,
a 128K vocabulary) exercises the kernels a user's run takes (flash or memory-efficient SDPA with kvtool's
masks on CUDA). Verdict: kvtool's largest logit error ≤ 2 × transformers' own + 0.004, the tolerance of the
CUDA tests (``tests/test_cuda.py``). Exit code 0 when it holds, 1 when not.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu import CONFIGS, config_model, random_ids  # noqa: E402
from bench.jsonfile import write_json  # noqa: E402
from bench.prefill import parse_tokens  # noqa: E402

RATIO, SLACK = 2.0, 0.004


def errors(got, ref) -> dict[str, float]:
    """Largest absolute error and relative Frobenius error of ``got`` against ``ref`` (float32 on the device)."""
    diff = got.float() - ref
    return {"max_abs": float(diff.abs().max()), "rel_fro": float(diff.norm() / ref.norm())}


def main() -> int:
    import torch

    from kvtool.core.engine import Engine, EngineConfig, model_env
    from kvtool.policies import build_policy

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama-3.1-8b", choices=sorted(CONFIGS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", default="4k")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    n, block = parse_tokens(args.tokens), args.block_size

    model, device = config_model(args.config, args.device, "float32", args.layers)
    ids = random_ids(model.config.vocab_size, n).to(device)
    ref = model(ids[None]).logits[0].float()  # float32 reference, every row
    for param in model.parameters():  # the weights only: RoPE's inverse frequencies stay float32, as they do
        param.data = param.data.to(torch.bfloat16)  # when a checkpoint is loaded in bf16
    theirs = errors(model(ids[None]).logits[0], ref)

    cfg = EngineConfig(budget=n + block, block_size=block)  # room for every token: nothing is evicted
    env = model_env(model, cfg)
    engine = Engine(model, build_policy("sink", {}, env), cfg, env=env)
    cache = engine.new_cache()
    t0 = time.perf_counter()
    rows = [engine.step(cache, ids[s : s + block], min(block, n - s)) for s in range(0, n, block)]
    got = torch.cat(rows)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ours = errors(got, ref)
    ok = bool(torch.isfinite(got).all()) and ours["max_abs"] <= RATIO * theirs["max_abs"] + SLACK
    doc = {"config": args.config, "layers": args.layers, "tokens": n, "block_size": block, "device": str(device),
           "dtype": "bfloat16", "evicted_tokens": cache.counters.evicted_tokens, "kvtool": ours,
           "transformers": theirs, "tolerance": f"kvtool max_abs <= {RATIO} x transformers' + {SLACK}",
           "passed": ok, "seconds": round(time.perf_counter() - t0, 3)}
    print(f"{'ok  ' if ok else 'FAIL'} real-shape bf16 equality ({args.config}, {args.layers} layers, {n} tokens, "
          f"block {block}, nothing evicted: {cache.counters.evicted_tokens}): kvtool max |Δ| {ours['max_abs']:.4f} "
          f"(rel {ours['rel_fro']:.2e}), transformers {theirs['max_abs']:.4f} (rel {theirs['rel_fro']:.2e}) "
          f"against float32", flush=True)
    if args.json_path:
        write_json(args.json_path, doc)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
