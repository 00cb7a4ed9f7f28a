"""4- and 8-bit weights (bitsandbytes) through kvtool's own loader at a real model's shape.

    python bench/quant_weights.py --config llama-3.1-8b --layers 4 --tokens 4k --json OUT.json

A random checkpoint of the shape (``--layers`` of them, bf16 safetensors and a small tokenizer) is written to a
temporary directory and loaded by ``kvtool.runtime.model.load_model`` with ``--quantize none``, ``8bit`` and
``4bit``. For each: the weight bytes the allocator holds after loading against the two figures kvtool prints
(``kvtool profile``'s count of the loaded parameters, and the plan's formula ``memory.weights_bytes``); kvtool's
stream with nothing evicted against the quantized model's own forward; prefill tokens/s of ``h2o`` at the
given length; and the lines the load and the read wrote to stderr (a warning per linear call is a flood).
Needs CUDA unless bitsandbytes supports the CPU (then ``--device cpu``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu import CONFIGS, config_model, random_ids  # noqa: E402
from bench.jsonfile import write_json  # noqa: E402
from bench.prefill import parse_tokens  # noqa: E402


def write_checkpoint(name: str, layers: int, directory: Path) -> int:
    """A random bf16 checkpoint of ``CONFIGS[name]``'s shape with a small tokenizer; returns its parameter count."""
    import torch

    from tests.helpers import tiny_tokenizer

    model, _ = config_model(name, "cuda" if torch.cuda.is_available() else "cpu", "auto", layers)
    model.config.eos_token_id = 2
    model.save_pretrained(str(directory))
    tiny_tokenizer().save_pretrained(str(directory))
    count = sum(p.numel() for p in model.parameters())
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return count


def measure(directory: Path, quantize: str, device: str, n: int, params: int) -> dict:
    import torch

    from kvtool.core.engine import Engine, EngineConfig, model_env
    from kvtool.policies import build_policy
    from kvtool.runtime.memory import weights_bytes
    from kvtool.runtime.model import load_model
    from kvtool.runtime.profiling import parameter_bytes

    cuda = device.startswith("cuda")
    base = torch.cuda.memory_allocated() if cuda else 0
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        loaded = load_model(str(directory), device=device, dtype="bfloat16", quantize=quantize)
        load_seconds = time.perf_counter() - t0
        model = loaded.model
        held = (torch.cuda.memory_allocated() - base) if cuda else None
        counted = parameter_bytes(model)[1]  # what `kvtool profile` counts
        text = model.config.get_text_config()
        embed = text.vocab_size * text.hidden_size
        unquantized = embed * (1 if text.tie_word_embeddings else 2)
        formula = weights_bytes(params, 2, quantize, unquantized if quantize != "none" else 0)
        ids = random_ids(text.vocab_size, n)
        short = ids[:512].to(loaded.device)
        own = model(short[None]).logits[0, -1].float()
        block = 128
        whole = EngineConfig(budget=640, block_size=block)  # room for the 512 tokens: nothing is evicted
        env = model_env(model, whole)
        engine = Engine(model, build_policy("sink", {}, env), whole, env=env)
        cache = engine.new_cache()
        for s in range(0, 512, block):
            last = engine.step(cache, short[s : s + block], 1)
        equal = float((last[-1].float() - own).abs().max())
        cfg = EngineConfig(budget=1024, block_size=block)
        env = model_env(model, cfg)
        engine = Engine(model, build_policy("h2o", {}, env), cfg, env=env)
        cache = engine.new_cache()
        if cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        for s in range(0, n, block):
            engine.step(cache, ids[s : s + block], 1)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t1
    lines = [x for x in stderr.getvalue().splitlines() if x.strip()] + [str(w.message) for w in caught]
    out = {"quantize": quantize, "load_seconds": round(load_seconds, 2), "weights_allocated_bytes": held,
           "profile_counted_bytes": counted, "formula_bytes": formula,
           "engine_vs_own_forward_max_abs": equal, "h2o_prefill_tokens_per_second": round(n / seconds, 1),
           "stderr_lines": len(lines), "stderr_first": lines[:3]}
    del engine, cache, model, loaded
    if cuda:
        torch.cuda.empty_cache()
    return out


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama-3.1-8b", choices=sorted(CONFIGS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", default="4k")
    ap.add_argument("--quantize", default="none,8bit,4bit")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    n = parse_tokens(args.tokens)
    work = Path(tempfile.mkdtemp(prefix="kvtool-quant-"))
    rows = []
    try:
        params = write_checkpoint(args.config, args.layers, work)
        for q in [x for x in args.quantize.split(",") if x]:
            try:
                r = measure(work, q, args.device, n, params)
            except Exception as exc:  # one line per failing mode; the others still run
                r = {"quantize": q, "error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"}
            rows.append(r)
            if "error" in r:
                print(f"FAIL {q}: {r['error']}", flush=True)
                continue
            held = r["weights_allocated_bytes"]
            gib = 2**30
            print(f"ok   {q:5}: weights held {held / gib if held else float('nan'):.3f} GiB, profile counts "
                  f"{r['profile_counted_bytes'] / gib:.3f}, plan formula {r['formula_bytes'] / gib:.3f}; engine vs "
                  f"own forward max |Δ| {r['engine_vs_own_forward_max_abs']:.4f}; h2o prefill "
                  f"{r['h2o_prefill_tokens_per_second']:.0f} tok/s; load {r['load_seconds']:.1f} s; "
                  f"stderr lines {r['stderr_lines']}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json_path:
        write_json(args.json_path, {"config": args.config, "layers": args.layers, "tokens": n, "rows": rows})
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
