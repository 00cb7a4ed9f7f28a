"""What H2O's statistic costs a block, against the block's forward: counted from the shapes, and measured.

    python bench/probs_cost.py                          # Llama-3.1-8B, budget 4K, blocks 128 and 1,024: the counts
    python bench/probs_cost.py --config qwen3-8b --budget 8k --blocks 256,1024
    python bench/probs_cost.py --measure --layers 4 --blocks 1024 --json OUT.json   # on a GPU (scripts/gpu-check.sh)

H2O needs, per cached token, its attention probability summed over the block's query rows. Two ways are
counted per block, from the shapes (no GPU needed):

* **explicit** (a CPU's path; a GPU's without Triton): float32 probabilities ``[heads, rows, keys]`` per layer,
  in chunks of ``PROBS_CHUNK_BYTES``: written by the score product, read and written by the mask and the softmax,
  read for the sums — ``PASSES`` passes over float32 per element;
* **two-pass** (a GPU's path, ``core/column_sums.py``): the forward returns each row's log-sum-exp (a float32 per
  row and head, written once), then the key-major kernel reads K once and the queries of each KV head's group
  once per key tile (L2 holds one group's queries — 1 MiB at the 8B shape, block 1,024 — while the tiles of its
  KV head run, so DRAM sees them about once; without that reuse, once per tile: ``--no-l2``), one
  ``q·kᵀ`` product (the forward's FLOPs' share of one attention matmul) and an exp per element.

Each against the forward: its weights read once per block plus K/V per layer; its FLOPs (linear layers and
attention over budget + block keys). Times are floors at a device's ceilings (default: an H200 of this workplace,
4.3 TB/s copy, 790 TFLOP/s bf16). Targets: the statistic within 10% of the forward's time, the traffic of
forward + statistic within 1.2× the forward's.

``--measure`` times them on this machine (CUDA events on a GPU, the host clock on a CPU), a random model of
``--config``'s shape with ``--layers`` layers in bf16 (float32 on a CPU): the model's own forward of one block
after ``budget`` cached tokens (transformers' decoder, SDPA, no logits), and per layer at the real shape (the
block's queries over ``budget + block`` keys) the folded SDPA call, the explicit statistic in chunks, and the
two passes (Triton on CUDA, the torch form elsewhere). The share is the per-layer two-pass statistic × layers /
the block's forward.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu import CONFIGS, config_model, random_ids, timed  # noqa: E402
from bench.jsonfile import write_json  # noqa: E402
from bench.prefill import parse_tokens  # noqa: E402

#: passes over the float32 probability matrix: score product writes, mask add reads+writes, softmax reads+writes,
#: the bf16 copy for the output product reads (and writes half), the output product reads the copy
PASSES = 7.5
#: the column-sum kernel's key tile at head dim 128 (``column_sums_triton._tiles``): the queries' re-reads without L2
KEY_TILE = 128


def costs(name: str, budget: int, block: int, bandwidth: float, flops_rate: float, l2: bool = True) -> dict:
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
    rereads = 1 if l2 else -(-keys // KEY_TILE)
    two_bytes = L * (H * block * d * 2 * rereads + KV * keys * d * 2 + 2 * H * block * 4 + KV * keys * 4)
    two_flops = 2 * L * H * block * keys * d
    chunk = min(block, probs_chunk_rows(H, keys))
    floor = 1e3 * max(fwd_flops / flops_rate, fwd_bytes / bandwidth)
    return {"block": block, "keys": keys, "fwd_flops": fwd_flops, "fwd_bytes": fwd_bytes, "fwd_ms": floor,
            "explicit_bytes": PASSES * probs, "explicit_ms": 1e3 * PASSES * probs / bandwidth,
            "two_pass_bytes": two_bytes, "two_pass_flops": two_flops,
            "two_pass_ms": 1e3 * max(two_flops / flops_rate, two_bytes / bandwidth),
            "set_whole": H * block * keys * 4, "set_chunked": H * chunk * keys * 4, "chunk_rows": chunk}


def print_counts(args, budget: int) -> list[dict]:
    print(f"{args.config}, budget {budget}: per block, floors at {args.bandwidth / 1e12:.1f} TB/s and "
          f"{args.flops / 1e12:.0f} TFLOP/s{'' if args.l2 else ' (no L2 reuse of the queries)'}")
    print(f"{'block':>6}{'fwd GB':>8}{'fwd ms':>8} | {'explicit GB':>12}{'ms':>7}{'traffic':>9} | "
          f"{'two-pass GB':>12}{'GFLOP':>7}{'ms':>6}{'share':>7}{'traffic':>9}")
    out = []
    for block in (int(x) for x in args.blocks.split(",") if x):
        c = costs(args.config, budget, block, args.bandwidth, args.flops, args.l2)
        out.append(c)
        print(f"{block:>6}{c['fwd_bytes'] / 1e9:>8.2f}{c['fwd_ms']:>8.2f} | {c['explicit_bytes'] / 1e9:>12.2f}"
              f"{c['explicit_ms']:>7.2f}{1 + c['explicit_bytes'] / c['fwd_bytes']:>8.2f}x | "
              f"{c['two_pass_bytes'] / 1e9:>12.2f}{c['two_pass_flops'] / 1e9:>7.0f}{c['two_pass_ms']:>6.2f}"
              f"{c['two_pass_ms'] / c['fwd_ms']:>7.1%}{1 + c['two_pass_bytes'] / c['fwd_bytes']:>8.2f}x")
    print("traffic: (forward + statistic) / forward bytes (target ≤ 1.2×); share: statistic / forward time (target "
          "≤ 10%); floors only, launches not counted")
    return out


def _timer(device):
    """``fn`` → seconds of one call (``bench.gpu.timed``: CUDA events on a GPU, the host clock elsewhere)."""
    return partial(timed, cuda=device.type == "cuda")


def median_seconds(fn, timed, repeat: int) -> float:
    fn()  # warm-up: compilation, kernel selection, the allocator
    return statistics.median(timed(fn) for _ in range(repeat))


def layer_paths(q, k, v, scaling: float, rows_per_chunk: int):
    """Per layer at the real shape: (name → a call) for the folded SDPA output, the explicit statistic in chunks,
    and the two passes (the form a cache on this device uses)."""
    import torch
    import torch.nn.functional as F

    from kvtool.core import column_sums
    from kvtool.core.column_sums import Visibility

    H, m, d = q.shape[1], q.shape[2], q.shape[3]
    h, n = k.shape[1], k.shape[2]
    qk, vis = H // h, Visibility(n - m)
    mask = torch.zeros(m, n, device=q.device).masked_fill_(~vis.mask(torch.arange(m, device=q.device),
                                                                      torch.arange(n, device=q.device)), float("-inf"))
    folded = mask.to(q.dtype).repeat(qk, 1)
    impl = column_sums
    if q.device.type == "cuda" and column_sums.default_form(q.device) == "triton":
        from kvtool.core import column_sums_triton as impl
    lse = torch.empty(H, m, dtype=torch.float32, device=q.device)
    sums = torch.empty(h, n, dtype=torch.float32, device=q.device)
    scratch = torch.empty(h, qk * rows_per_chunk, n, dtype=torch.float32, device=q.device)

    def sdpa():
        F.scaled_dot_product_attention(q.reshape(1, h, qk * m, d), k, v, attn_mask=folded, scale=scaling)

    def explicit():
        acc = torch.zeros(h, n, device=q.device)
        for r0 in range(0, m, rows_per_chunk):
            r1 = min(m, r0 + rows_per_chunk)
            s = scratch[:, : qk * (r1 - r0)]
            torch.bmm(q[0, :, r0:r1].float().reshape(h, -1, d), k[0].float().transpose(1, 2), out=s).mul_(scaling)
            s.view(h, qk, r1 - r0, n).add_(mask[r0:r1])
            torch.softmax(s, dim=-1, out=s)
            acc.add_(s.sum(1))

    paths = {"sdpa": sdpa, "explicit statistic": explicit,
             "pass 1 (forward + lse)": lambda: impl.forward(q, k, v, scaling, vis, lse),
             "pass 2 (statistic)": lambda: impl.column_sums(q, k, lse, scaling, vis, 0, sums)}
    if q.device.type == "cuda":  # a yardstick for pass 1, not a path kvtool takes: the op is private to torch
        bias = folded.view(1, 1, qk * m, n).expand(1, h, qk * m, n)  # the op checks the bias's head dimension
        efficient = torch.ops.aten._scaled_dot_product_efficient_attention
        folded_q = q.reshape(1, h, qk * m, d)
        paths["sdpa efficient + lse (private aten op)"] = lambda: efficient(folded_q, k, v, bias, True, scale=scaling)
    return paths


def measure(args, budget: int) -> list[dict]:
    import torch
    from transformers import DynamicCache

    from kvtool.config import probs_chunk_rows

    torch.set_grad_enabled(False)
    model, device = config_model(args.config, args.device, "auto" if args.dtype == "auto" else args.dtype,
                                 args.layers)
    c = model.config
    H, KV = c.num_attention_heads, c.num_key_value_heads
    d = getattr(c, "head_dim", None) or c.hidden_size // H
    dtype, timed, out = next(model.parameters()).dtype, _timer(device), []
    print(f"measured on {torch.cuda.get_device_name(0) if device.type == 'cuda' else 'cpu'}, {args.layers} layers, "
          f"{dtype}: per block (the statistic × {c.num_hidden_layers} layers)")
    for block in (int(x) for x in args.blocks.split(",") if x):
        ids = random_ids(c.vocab_size, budget + block).to(device)
        cache = DynamicCache(config=c)
        decoder = model.get_decoder()  # no logits: a document's read computes none (a question's last row only)
        decoder(ids[None, :budget], past_key_values=cache, use_cache=True)

        def forward(block_ids=ids[None, budget:], decoder=decoder, cache=cache) -> None:
            decoder(block_ids, past_key_values=cache, use_cache=True)
            for layer in cache.layers:  # back to the budget's tokens
                layer.keys, layer.values = layer.keys[:, :, :budget], layer.values[:, :, :budget]

        row = {"block": block, "keys": budget + block, "forward_seconds": median_seconds(forward, timed, args.repeat)}
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(1, block, H, d, generator=g, device=device, dtype=dtype).transpose(1, 2)
        k = torch.randn(1, KV, budget + block, d, generator=g, device=device, dtype=dtype)
        v = torch.randn(1, KV, budget + block, d, generator=g, device=device, dtype=dtype)
        rows = min(block, probs_chunk_rows(H, budget + block))
        for name, fn in layer_paths(q, k, v, d**-0.5, rows).items():
            row[name] = median_seconds(fn, timed, args.repeat) * c.num_hidden_layers
        row["share"] = row["pass 2 (statistic)"] / row["forward_seconds"]
        out.append(row)
        timings = [name for name in row if name not in ("block", "keys", "forward_seconds", "share")]
        print(f"  block {block:5d}: forward {row['forward_seconds'] * 1e3:8.2f} ms | "
              + " | ".join(f"{name} {row[name] * 1e3:.2f} ms" for name in timings)
              + f" | statistic / forward {row['share']:.1%} (target ≤ 10%)", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama-3.1-8b", choices=sorted(CONFIGS))
    ap.add_argument("--budget", default="4k")
    ap.add_argument("--blocks", default="128,1024")
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s (read + write counted)")
    ap.add_argument("--flops", type=float, default=790e12, help="bf16 FLOP/s")
    ap.add_argument("--no-l2", dest="l2", action="store_false", help="count the queries' re-read per key tile")
    ap.add_argument("--measure", action="store_true", help="time the paths on this machine (see above)")
    ap.add_argument("--layers", type=int, default=4, help="--measure: layers of the random model")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="--measure: auto = bf16 on a GPU, float32 on a CPU")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args()
    budget = parse_tokens(args.budget)
    doc = {"config": args.config, "budget": budget, "counted": print_counts(args, budget)}
    if args.measure:
        if args.dtype == "auto" and args.device in ("auto", "cpu"):
            import torch

            args.dtype = "auto" if torch.cuda.is_available() and args.device == "auto" else "float32"
        doc["measured"] = measure(args, budget)
    if args.json_path:
        write_json(args.json_path, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
