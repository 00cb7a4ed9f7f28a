"""How long a question takes from the end of the read to its first answer logits, recall on.

    python bench/question.py --lengths 4k,32k --repeats 3 [--json OUT.json]

A random tiny-shape Llama (``--layers`` 4, hidden 256, 8 query / 2 KV heads of 32, random weights: the
figures are about recall's mechanics, not about what it finds) reads ``L`` random tokens under the default
``ask`` policy (``h2o``, budget ``--budget``, block 256, absolute positions, a float16 archive in host memory) and
answers a 32-token question ``--repeats`` times (restore, first pass, recall, second pass:
``Engine.feed_question``). Prints one JSON object: per length the median question seconds, of which recall's
own seconds (``RecallResult.seconds``).

``before``/``after``: run it once with this checkout's kvtool and once with another's first on the path
(``PYTHONPATH=/path/to/other/checkout python bench/question.py``): the script imports whichever kvtool
comes first. On a shared 2-core VM, pass ``OMP_NUM_THREADS`` explicitly and compare runs of the same call.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: another checkout may go first


def tokens(text: str) -> int:
    """"4k" → 4096 (``bench.prefill.parse_tokens``); capped at 1M tokens (a bench, not a stress test)."""
    from bench.prefill import parse_tokens

    n = parse_tokens(text)
    if not 0 < n <= 1 << 20:
        raise SystemExit(f"length must be between 1 and 1M tokens (got {text})")
    return n


def measure(length: int, layers: int, budget: int, repeats: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import kvtool
    from kvtool.core.engine import Engine, EngineConfig, model_env
    from kvtool.policies import build_policy

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=length + 1024)
    model = LlamaForCausalLM(cfg).eval()
    ecfg = EngineConfig(budget=budget, block_size=256, positions="absolute", recall=256, page_size=32,
                        archive_dtype=torch.float16)
    env = model_env(model, ecfg)
    engine = Engine(model, build_policy("h2o", {}, env), ecfg, env=env)
    gen = torch.Generator().manual_seed(1)
    doc, question = torch.randint(0, 256, (length,), generator=gen), torch.randint(0, 256, (32,), generator=gen)
    cache = engine.new_cache()
    t0 = time.perf_counter()
    engine.feed(cache, [doc], progress=False)
    read = time.perf_counter() - t0
    snap = cache.snapshot()
    total, own = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _, res = engine.feed_question(cache, question, functools.partial(cache.restore, snap))
        total.append(time.perf_counter() - t0)
        own.append(res.seconds if res is not None else 0.0)
    return {"length": length, "read_s": round(read, 2), "question_s": round(statistics.median(total), 4),
            "recall_s": round(statistics.median(own), 4), "kvtool": str(Path(kvtool.__file__).parent)}


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="4k,32k")
    ap.add_argument("--layers", type=int, default=4, choices=range(1, 65), metavar="1..64")
    ap.add_argument("--budget", type=int, default=1024, choices=range(64, 65537), metavar="64..65536")
    ap.add_argument("--repeats", type=int, default=3, choices=range(1, 21), metavar="1..20")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = [measure(tokens(t), args.layers, args.budget, args.repeats) for t in args.lengths.split(",")]
    out = {"threads": torch.get_num_threads(), "layers": args.layers, "budget": args.budget, "rows": rows}
    text = json.dumps(out, indent=1)
    print(text)
    if args.json is not None:
        from bench.jsonfile import write_json

        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
