"""Decode speed after a document: the fixed-shape step captured and not, the block path, transformers' own decode.

    python bench/decode_step.py --config llama-3.1-8b --json decode.json          # a GPU: 4K/32K/128K, h2o + sink
    python bench/decode_step.py --config tiny --lengths 512 --budget 128 --decode-tokens 16   # a CPU start (seconds)
    python bench/decode_step.py --config embedded --lengths 8k,32k --budget 1k --block-size 128 --policies h2o \
        --modes blocks,eager --rounds 3 --baseline-lengths ''      # a CPU: the step against the block path

For each policy and document length, one engine reads the document (random token ids, blocks as ``ask``
reads them) and the cache after it is kept (``BoundedCache.snapshot``); then each decode mode answers from
that same cache, ``--decode-tokens`` greedy tokens with the default ``ask`` chooser (the no-repeat 4-gram
guard), no end token:

* ``capture``  the fixed-shape step (``kvtool/core/decode_step.py``), a CUDA graph replayed per token (on a
  CPU it runs eagerly: the same as ``eager``);
* ``eager``    the same step, never captured;
* ``blocks``   each token fed as a block of one through the block path (kvtool before the step).

Each mode first answers a few tokens untimed (the step is built and captured there: ``first_seconds``), then
the timed answer, ``--rounds`` times with the modes interleaved (the fastest kept: a loaded machine slows each
mode alike); ``decode_tokens_per_second`` is tokens over its wall time, the device synchronised at both
ends. ``tokens_equal`` says whether the mode's answer equals ``eager``'s, token for token (``blocks`` runs
other kernels: in bf16 it may part from the step after a few tokens; ``capture`` must not). ``transformers`` rows
(``--baseline-lengths``) decode with transformers' own eager loop (``DynamicCache``, SDPA, one forward per
token) after a chunked prefill of the same document: the baseline the GPU targets divide by, run first. The JSON is
rewritten after every row, so a run stopped by a time limit keeps what it measured.

The GPU targets (``docs/performance.md``, "The decode step"): after 32K at the Llama-3.1-8B shape in bf16,
``capture`` ≥ 150 tok/s on an H200 (≥ 100 on an H100) and ≥ 5× ``transformers`` in the same run, for h2o
and sink; ``capture`` after 128K within 5% of after 4K.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.jsonfile import write_json  # noqa: E402

MODES = ("capture", "eager", "blocks")
WARM_TOKENS = 8


def parse_count(text: str) -> int:
    """``4k`` → 4096; a plain number as is."""
    text = text.strip().lower()
    return int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)


def build_model(config: str, device: str, layers: int | None):
    """A random model of ``config``'s shape (``bench/gpu.py``) in bf16, ``tiny`` (a 2-layer float32 Llama), or
    ``embedded`` (the SmolLM2-135M-Instruct kvtool ships: the model of the CPU rows in docs/performance.md)."""
    import torch

    if config == "tiny":
        from bench.launches import tiny_llama

        return tiny_llama(layers or 2).to(device), torch.device(device)
    if config == "embedded":
        from kvtool.runtime.model import load_model

        loaded = load_model(None, device, "auto")
        return loaded.model, next(loaded.model.parameters()).device
    from bench.gpu import config_model

    return config_model(config, device, "auto", layers)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kvtool_rows(model, device, policy: str, length: int, args) -> list[dict]:
    """Each decode mode answering from the cache one document read under ``policy`` left (module docstring)."""
    import dataclasses

    import torch

    from bench.gpu import random_ids
    from kvtool.core.engine import Engine, EngineConfig, model_env
    from kvtool.core.events import Note
    from kvtool.core.sampling import Chooser
    from kvtool.policies import build_policy

    cfg = EngineConfig(budget=args.budget, block_size=args.block_size)
    env = model_env(model, cfg)
    pol = build_policy(policy, {}, env)
    notes: list[str] = []
    modes = [m for m in args.modes.split(",") if m]
    engines = {  # one engine per mode on the same model: each keeps its own step (and graph)
        m: Engine(
            model,
            pol,
            dataclasses.replace(cfg, decode_step=m),
            env=env,
            listener=lambda e: notes.append(e.message) if isinstance(e, Note) else None,
        )
        for m in modes
    }
    engine = engines[modes[0]]
    cache = engine.new_cache()
    doc = random_ids(model.get_output_embeddings().weight.shape[0], length)
    t0 = time.perf_counter()
    logits = None
    with torch.inference_mode():
        for s in range(0, length, args.block_size):
            logits = engine.step(cache, doc[s : s + args.block_size], 1 if s + args.block_size >= length else 0)
    sync(device)
    prefill = time.perf_counter() - t0
    snap = cache.snapshot()

    def answer(mode: str, n: int) -> tuple[list[int], float]:
        cache.restore(snap)
        sync(device)
        t = time.perf_counter()
        out, _ = engines[mode].generate(cache, logits, n, set(), Chooser(n, device, no_repeat_ngram=4))
        sync(device)
        return out, time.perf_counter() - t

    first = {m: answer(m, WARM_TOKENS)[1] for m in modes}  # the step built, and captured, here
    timed: dict[str, list[float]] = {m: [] for m in modes}
    answers: dict[str, list[int]] = {}
    for _ in range(max(1, args.rounds)):  # interleaved: a loaded machine slows every mode alike
        for m in modes:
            answers[m], seconds = answer(m, args.decode_tokens)
            timed[m].append(seconds)
    rows = []
    for m in modes:
        step, seconds = engines[m].decode_step_of(cache), min(timed[m])
        rows.append(
            {
                "row": f"kvtool:{policy}",
                "mode": m,
                "length": length,
                "budget": args.budget,
                "block_size": args.block_size,
                "prefill_seconds": prefill,
                "decode_tokens": len(answers[m]),
                "decode_seconds": seconds,
                "decode_seconds_all": timed[m],
                "decode_tokens_per_second": len(answers[m]) / seconds,
                "first_seconds": first[m],
                "captured": bool(step is not None and step.graph is not None),
                "tokens_equal": answers[m] == answers.get("eager", answers[modes[0]]),
                "notes": sorted(set(notes)),
            }
        )
    return rows


def transformers_row(model, device, length: int, args) -> dict:
    """transformers' own decode after a chunked prefill of the same document (its eager loop, SDPA)."""
    import contextlib
    import inspect

    import torch
    from transformers import DynamicCache

    from bench.gpu import random_ids

    with contextlib.suppress(ValueError):
        model.set_attn_implementation("sdpa")
    vocab = model.get_output_embeddings().weight.shape[0]
    doc = random_ids(vocab, length).to(device)
    cache = DynamicCache(config=model.config)
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    chunk = max(args.block_size, 2048)
    with torch.inference_mode():
        for s in range(0, length, chunk):
            res = model(doc[None, s : s + chunk], **{kw: cache}, use_cache=True, logits_to_keep=1)
        logits = res.logits[0, -1]
        sync(device)
        t = time.perf_counter()
        for _ in range(args.decode_tokens):
            logits = model(logits.argmax().view(1, 1), **{kw: cache}, use_cache=True).logits[0, -1]
        sync(device)
    seconds = time.perf_counter() - t
    return {
        "row": "transformers",
        "mode": "eager",
        "length": length,
        "decode_tokens": args.decode_tokens,
        "decode_seconds": seconds,
        "decode_tokens_per_second": args.decode_tokens / seconds,
    }


def summary(rows: list[dict]) -> dict:
    """The ratios the targets read: capture against transformers at the same length, 128K (longest) against 4K."""
    out: dict = {}
    base = {r["length"]: r["decode_tokens_per_second"] for r in rows if r["row"] == "transformers"}
    for r in rows:
        if r["row"] != "transformers" and r["mode"] == "capture" and r["length"] in base:
            rate = r["decode_tokens_per_second"] / base[r["length"]]
            out[f"{r['row']} capture / transformers at {r['length']}"] = rate
    for name in {r["row"] for r in rows if r["row"] != "transformers"}:
        cap = sorted(
            (r["length"], r["decode_tokens_per_second"]) for r in rows if r["row"] == name and r["mode"] == "capture"
        )
        if len(cap) > 1:
            out[f"{name} capture after {cap[-1][0]} / after {cap[0][0]}"] = cap[-1][1] / cap[0][1]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama-3.1-8b", help="a shape of bench/gpu.py, tiny or embedded")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--lengths", default="4k,32k,128k")
    ap.add_argument("--baseline-lengths", default="32k", help="lengths of the transformers rows ('' = none)")
    ap.add_argument("--policies", default="h2o,sink")
    ap.add_argument("--budget", type=parse_count, default=4096)
    ap.add_argument("--block-size", default="auto", help="tokens per block, or auto: what kvtool picks on the device")
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--modes", default=",".join(MODES), help="decode modes, in the order run")
    ap.add_argument("--rounds", type=int, default=1, help="times each mode answers, interleaved (the best is kept)")
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args(argv)
    import torch

    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    model, dev = build_model(args.config, device, args.layers)
    if args.block_size == "auto":
        from kvtool.runtime.settings import default_block_size

        args.block_size = default_block_size(dev.type, args.budget)
    else:
        args.block_size = parse_count(args.block_size)
    doc: dict = {
        "config": args.config,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": str(next(model.parameters()).dtype),
        "rows": [],
    }
    for n in [parse_count(x) for x in args.baseline_lengths.split(",") if x.strip()]:
        row = transformers_row(model, dev, n, args)
        doc["rows"].append(row)
        print(f"transformers     eager    after {n:>7}: {row['decode_tokens_per_second']:8.1f} tok/s", flush=True)
        doc["summary"] = summary(doc["rows"])
        if args.json_path:
            write_json(args.json_path, doc)
    lengths = [parse_count(x) for x in args.lengths.split(",") if x.strip()]
    for n in lengths:  # in the order given: gpu-check puts 32K first, so a cut run keeps the targets' rows
        for policy in [p for p in args.policies.split(",") if p]:
            for row in kvtool_rows(model, dev, policy, n, args):
                doc["rows"].append(row)
                print(
                    f"{row['row']:<16} {row['mode']:<8} after {n:>7}: {row['decode_tokens_per_second']:8.1f} tok/s"
                    f"  (captured {row['captured']}, same tokens as eager {row['tokens_equal']})",
                    flush=True,
                )
                doc["summary"] = summary(doc["rows"])
                if args.json_path:
                    write_json(args.json_path, doc)
    for name, value in doc.get("summary", {}).items():
        print(f"{name}: {value:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
