"""The model's own forward of one block against the block's size: where a block stops being launch-bound.

    python bench/block_forward.py --config llama-3.1-8b --layers 4 --context 4k --json OUT.json

A block of B new tokens is fed after ``--context`` cached tokens (transformers' ``DynamicCache``, cropped back
after every timed forward) for B in ``--blocks``; each forward is timed with CUDA events (median of
``--repeat``). Tokens per second rise with B while the GPU waits on launches and weight reads, then flatten
once the matrix units are busy: the knee (the smallest B within 10% of the best rate) is the block a GPU
read should use, bounded by the budget. On CPU the host clock times the same loop.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu import CONFIGS, config_model, random_ids, timed  # noqa: E402
from bench.jsonfile import write_json  # noqa: E402
from bench.prefill import parse_tokens  # noqa: E402


def main() -> int:
    import torch
    from transformers import DynamicCache

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama-3.1-8b", choices=sorted(CONFIGS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", default="4k")
    ap.add_argument("--blocks", default="32,64,128,256,512,1024,2048")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    model, device = config_model(args.config, args.device, "auto", args.layers)
    cuda = device.type == "cuda"
    ctx = parse_tokens(args.context)
    sizes = [int(x) for x in args.blocks.split(",") if x]
    ids = random_ids(model.config.vocab_size, ctx + max(sizes)).to(device)
    cache = DynamicCache(config=model.config)
    model(ids[None, :ctx], past_key_values=cache, use_cache=True, logits_to_keep=1)
    rows = []
    for b in sizes:
        block = ids[None, ctx : ctx + b]

        def forward(block=block) -> None:
            model(block, past_key_values=cache, use_cache=True, logits_to_keep=1)
            for layer in cache.layers:  # back to the context (``crop``'s argument changed meaning in 5.x)
                layer.keys, layer.values = layer.keys[:, :, :ctx], layer.values[:, :, :ctx]

        forward()  # warm-up (kernel selection, allocator)
        seconds = statistics.median(timed(forward, cuda) for _ in range(args.repeat))
        rows.append({"block": b, "seconds": seconds, "tokens_per_second": b / seconds})
    best = max(r["tokens_per_second"] for r in rows)
    knee = next(r["block"] for r in rows if r["tokens_per_second"] >= 0.9 * best)
    for r in rows:
        r["share_of_best"] = r["tokens_per_second"] / best
        print(f"  block {r['block']:5d}: {r['seconds'] * 1e3:8.2f} ms  {r['tokens_per_second']:10.0f} tok/s  "
              f"({r['share_of_best']:.0%} of the best)", flush=True)
    print(f"knee: block {knee} (the smallest within 10% of the best rate; {args.config}, {args.layers} layers, "
          f"{ctx} cached tokens, {device})", flush=True)
    if args.json_path:
        write_json(args.json_path, {"config": args.config, "layers": args.layers, "context": ctx,
                                    "device": str(device), "rows": rows, "knee_block": knee})
    return 0


if __name__ == "__main__":
    sys.exit(main())
