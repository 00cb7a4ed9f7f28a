"""What H2O's attention probabilities cost a block, against the block's forward, at a real model's shape.

    python bench/probs_cost.py                          # Llama-3.1-8B, budget 4K, blocks 128 and 1,024
    python bench/probs_cost.py --config qwen3-8b --budget 8k --blocks 256,1024

H2O needs every query row's attention probabilities (their column sums): kvtool computes them explicitly
(float32 scores, mask, softmax, then the output from them: no second pass) instead of SDPA's fused kernel. The
forward's cost is its weights read once per block plus K/V read per layer; the probabilities' is memory traffic
over a float32 ``[heads, rows, keys]`` matrix per layer (written by the score product, read and written by the
mask and the softmax, read by the output product). Counted here per block, from the shapes (no GPU needed):

* FLOPs and bytes of the forward, and of the probability path's extra passes;
* the working set of one layer's probabilities: the whole block at once, and in kvtool's chunks of
  ``PROBS_CHUNK_BYTES`` (``core/attention.py``), which bound it whatever the block;
* times at a device's measured ceilings (default: an H200 of this workplace, 4.3 TB/s copy, 790 TFLOP/s bf16).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu import CONFIGS  # noqa: E402
from bench.prefill import parse_tokens  # noqa: E402

#: passes over the float32 probability matrix: score product writes, mask add reads+writes, softmax reads+writes,
#: the bf16 copy for the output product reads (and writes half), the output product reads the copy
PASSES = 7.5


def costs(name: str, budget: int, block: int, bandwidth: float, flops_rate: float) -> dict[str, float]:
    import transformers

    from kvtool.config import probs_chunk_rows
    from kvtool.runtime.memory import dims_from_config, llama_param_count

    spec = dict(CONFIGS[name])
    config = getattr(transformers, spec.pop("class"))(**spec)
    dims = dims_from_config(config)
    L, H, KV, d = dims["num_layers"], dims["num_attention_heads"], dims["num_kv_heads"], dims["head_dim"]
    params = llama_param_count(dims, bool(getattr(config, "tie_word_embeddings", False)))
    embed = dims["vocab_size"] * dims["hidden_size"]
    keys = budget + block
    fwd_flops = 2 * (params - embed) * block + 4 * L * H * d * block * keys  # linear layers + attention
    fwd_bytes = 2 * params + L * keys * 2 * KV * d * 2  # bf16 weights once + K/V read per layer
    probs = L * H * block * keys * 4  # one float32 probability matrix per layer
    extra_bytes = PASSES * probs
    extra_flops = 6 * L * H * block * keys  # scale, mask, softmax (max, exp, sum, divide) per element
    chunk = min(block, probs_chunk_rows(H, keys))
    return {"block": block, "keys": keys, "fwd_flops": fwd_flops, "fwd_bytes": fwd_bytes, "extra_bytes": extra_bytes,
            "extra_flops": extra_flops, "set_whole": H * block * keys * 4, "set_chunked": H * chunk * keys * 4,
            "chunk_rows": chunk, "fwd_ms": 1e3 * max(fwd_flops / flops_rate, fwd_bytes / bandwidth),
            "extra_ms": 1e3 * extra_bytes / bandwidth}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama-3.1-8b", choices=sorted(CONFIGS))
    ap.add_argument("--budget", default="4k")
    ap.add_argument("--blocks", default="128,1024")
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s (read + write counted)")
    ap.add_argument("--flops", type=float, default=790e12, help="bf16 FLOP/s")
    args = ap.parse_args()
    budget = parse_tokens(args.budget)
    print(f"{args.config}, budget {budget}: per block, at {args.bandwidth / 1e12:.1f} TB/s and "
          f"{args.flops / 1e12:.0f} TFLOP/s")
    print(f"{'block':>6}{'fwd GFLOP':>11}{'fwd GB':>8}{'probs GB':>10}{'probs/fwd bytes':>17}"
          f"{'fwd ms':>8}{'probs ms':>10}{'one layer, whole':>18}{'chunked':>10}{'rows':>6}")
    for block in (int(x) for x in args.blocks.split(",") if x):
        c = costs(args.config, budget, block, args.bandwidth, args.flops)
        print(f"{block:>6}{c['fwd_flops'] / 1e9:>11.0f}{c['fwd_bytes'] / 1e9:>8.2f}{c['extra_bytes'] / 1e9:>10.2f}"
              f"{c['extra_bytes'] / c['fwd_bytes']:>17.2f}{c['fwd_ms']:>8.2f}{c['extra_ms']:>10.2f}"
              f"{c['set_whole'] / 2**20:>16.0f} MiB{c['set_chunked'] / 2**20:>6.0f} MiB{c['chunk_rows']:>6}")
    print("probs GB: the probability path's traffic beyond the forward (FLOPs beyond it are negligible: "
          f"{PASSES} passes over float32 per element against one multiply-add); ms: the larger of bytes and FLOPs "
          "over the ceilings, i.e. the floor, launches not counted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
