"""The report of bench/prefill.py: its rows as lines and as a markdown table, and the targets each row is
checked against (every miss says by how much)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu import gpu_targets  # noqa: E402


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def row_label(r: dict) -> str:
    return r["kind"] if r["kind"] in ("dense", "chunked") else f"{r['kind']}:{row_tag(r)}"


def row_tag(r: dict) -> str:
    """A kvtool row's policy, with ``@BLOCK`` when its block size is not the run's (``--policies h2o@512``)."""
    return r.get("tag") or r.get("policy", "")


def flop_rate(r: dict) -> float:
    """A row's prefill GFLOP/s: its model FLOPs (``bench/gpu.model_flops``: the layers' matrices and the attended
    pairs, a sliding layer's over its window) per second; a row written before they were recorded counts 2 per
    parameter per token (the embedding included)."""
    flops = r.get("model_flops") or 2 * r["params"] * r["length"]
    return flops / r["prefill_seconds"] / 1e9


def find(rows, kind, n, policy=None):
    for r in rows:
        same_policy = policy is None or row_tag(r) == policy
        if r["kind"] == kind and r["length"] == n and same_policy and "error" not in r:
            return r
    return None


def print_row(r: dict, roof: float, rows: list[dict]) -> None:
    n = r["length"]
    if "error" in r:
        print(f"{n:>7} {row_label(r):<22} ERROR: {r['error']}", flush=True)
        return
    tps = n / r["prefill_seconds"]
    dense = find(rows, "dense", n)
    chunked = find(rows, "chunked", n)
    ratio_d = f"{tps / (n / dense['prefill_seconds']):5.2f}x" if dense else "   - "
    ratio_c = f"{tps / (n / chunked['prefill_seconds']):5.2f}x" if chunked else "   - "
    dec = r["decode_tokens"] / r["decode_seconds"] if r.get("decode_seconds") else 0.0
    flops = flop_rate(r)
    split = ""
    if "split_seconds" in r:
        s = r["split_seconds"]
        total = r["prefill_seconds"]
        fwd = total - s["probs"] - s["score"] - s["evict"]
        split = (f" split fwd {fwd / total:5.1%} probs {s['probs'] / total:5.1%} score {s['score'] / total:5.1%}"
                 f" evict {s['evict'] / total:5.1%}")
    plan = f" (plan {fmt_bytes(r['predicted_peak_bytes'])})" if r.get("predicted_peak_bytes") else ""
    question = f"  question {r['question_seconds']:.2f} s" if "question_seconds" in r else ""
    mfu = f" MFU {r['mfu']:5.1%}" if r.get("mfu") is not None else ""
    print(f"{n:>7} {row_label(r):<22} {tps:8.1f} tok/s{mfu}  vs dense {ratio_d} vs chunked {ratio_c}  peak "
          f"{fmt_bytes(r['peak_bytes']):>10}{plan}  decode {dec:6.1f} tok/s{question}  {flops:5.1f} GFLOP/s "
          f"({flops / roof:4.0%} of roofline){split}{math_note(r)}", flush=True)


def math_note(r: dict) -> str:
    """The row's share of SDPA calls that took the math backend (CUDA), else nothing."""
    if r.get("math_share") is None:
        return ""
    return f"  math backend {r['math_calls']}/{r['sdpa_calls']} SDPA calls ({r['math_share']:.0%})"


def print_markdown(rows: list[dict], roof: float) -> None:
    """The same rows as a markdown table (for docs/performance.md)."""
    print("\n| tokens | row | prefill tok/s | MFU | vs dense | vs chunked | peak memory | plan | decode tok/s | "
          "forward / probs / score / evict | % of roofline |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            continue
        n = r["length"]
        tps = n / r["prefill_seconds"]
        d, c = find(rows, "dense", n), find(rows, "chunked", n)
        vs_d = f"{d['prefill_seconds'] / r['prefill_seconds']:.2f}×" if d else "–"
        vs_c = f"{c['prefill_seconds'] / r['prefill_seconds']:.2f}×" if c else "–"
        dec = r["decode_tokens"] / r["decode_seconds"] if r.get("decode_seconds") else 0.0
        split = "–"
        if "split_seconds" in r:
            sp, total = r["split_seconds"], r["prefill_seconds"]
            fwd = total - sp["probs"] - sp["score"] - sp["evict"]
            split = " / ".join(f"{x / total:.1%}" for x in (fwd, sp["probs"], sp["score"], sp["evict"]))
        flops = flop_rate(r)
        peak = fmt_bytes(r["peak_bytes"])
        label = f"{n // 1024}K" if n % 1024 == 0 else str(n)
        plan = fmt_bytes(r["predicted_peak_bytes"]) if r.get("predicted_peak_bytes") else "–"
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "–"
        print(f"| {label} | {row_label(r)} | {tps:.0f} | {mfu} | {vs_d} | {vs_c} | {peak} | {plan} | {dec:.1f} | "
              f"{split} | {flops / roof:.0%} |")


def decode_tps(r: dict | None) -> float:
    return r["decode_tokens"] / r["decode_seconds"] if r and r.get("decode_seconds") else 0.0


def check_targets(rows: list[dict], roof: float, budget: int, mem_lengths: list[int],
                  ratios: dict[str, float | None] | None = None) -> None:
    print("\ntargets:")

    def report(name: str, value: float, target: float, higher_is_better: bool = True, unit: str = "") -> None:
        ok = value >= target if higher_is_better else value <= target
        gap = "" if ok else f"  MISSED by {abs(value - target) / max(abs(target), 1e-9):.1%}"
        print(f"  {'ok  ' if ok else 'MISS'} {name}: {value:.3f}{unit} (target {'≥' if higher_is_better else '≤'} "
              f"{target}{unit}){gap}")

    policies = sorted({row_tag(r) for r in rows if r["kind"] == "kvtool"})
    if len(mem_lengths) == 2:
        a, b = mem_lengths
        for p in policies:
            ra, rb = find(rows, "kvtool", a, p), find(rows, "kvtool", b, p)
            if ra and rb:
                report(f"peak memory {b // 1024}K / {a // 1024}K, {p}", rb["peak_bytes"] / ra["peak_bytes"], 1.05,
                       higher_is_better=False)
    for p in policies:
        r, c = find(rows, "kvtool", 2048, p), find(rows, "chunked", 2048)
        if r and c:
            target = 0.95 if p in ("sink", "keydiff") else 0.85
            report(f"2K prefill vs chunked, {p}", c["prefill_seconds"] / r["prefill_seconds"], target)
    for p in policies:
        r, d = find(rows, "kvtool", 32768, p), find(rows, "dense", 32768)
        if r and d and not str(r.get("device", "")).startswith("cuda"):  # a CPU's: the GPU's targets are below
            report(f"32K prefill vs dense one-pass, {p}", d["prefill_seconds"] / r["prefill_seconds"], 3.0)
        r8, r128 = find(rows, "kvtool", 8192, p), find(rows, "kvtool", 131072, p)
        if r8 and r128:
            report(f"tok/s 128K / 8K, {p}", (131072 / r128["prefill_seconds"]) / (8192 / r8["prefill_seconds"]), 0.9)
        r4, r128d = find(rows, "kvtool", 4096, p) or find(rows, "kvtool", 2048, p), find(rows, "kvtool", 131072, p)
        if r4 and r128d and r4.get("decode_seconds") and r128d.get("decode_seconds"):
            report(f"decode tok/s after 128K / after {r4['length'] // 1024}K, {p}",
                   r4["decode_seconds"] / r128d["decode_seconds"], 0.95)
    floor, dense8 = find(rows, "dense", budget), find(rows, "dense", 8192)
    for p in policies:
        r8 = find(rows, "kvtool", 8192, p)
        if not (r8 and r8.get("decode_seconds")):
            continue
        if p in ("sink", "keydiff", "tova", "snapkv+caote"):
            if decode_tps(floor):
                report(f"decode after 8K at budget {budget} / transformers after {budget} tokens, {p}",
                       decode_tps(r8) / decode_tps(floor), 0.95)
            if decode_tps(dense8):
                report(f"decode after 8K / transformers after the same 8K, {p}", decode_tps(r8) / decode_tps(dense8),
                       1.4)
        if "decode_split_seconds" in r8:
            sp = r8["decode_split_seconds"]
            target = 0.05 if p in ("sink", "keydiff", "razor") else 0.15
            report(f"scoring + eviction share of decode time (8K), {p}",
                   (sp["score"] + sp["evict"]) / r8["decode_seconds"], target, higher_is_better=False)
    for how, ratio in (ratios or {}).items():
        if ratio is not None:
            report(f"two concurrent processes, each / one alone ({how} threads)", ratio, 0.45)
    for p in policies:
        r = find(rows, "kvtool", 2048, p)
        if r and "split_seconds" in r:
            s = r["split_seconds"]
            share = (s["score"] + s["evict"]) / r["prefill_seconds"]
            target = 0.05 if p in ("sink", "keydiff", "razor") else 0.15
            report(f"scoring + eviction share of block time, {p}", share, target, higher_is_better=False)
            flops = flop_rate(r)
            report(f"prefill FLOP rate / roofline, {p}", flops / roof, 0.45)
    print("\nGPU targets (scripts/gpu-check.sh; measured on a GPU run, printed wherever the rows exist):")
    gpu_targets(rows, budget, report, find)
