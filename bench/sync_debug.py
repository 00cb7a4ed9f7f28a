"""Host syncs on kvtool's hot paths, counted by ``torch.cuda.set_sync_debug_mode("warn")``.

    python bench/sync_debug.py --config llama-3.1-8b --layers 4 --json OUT.json

The default ``ask`` path (``h2o``, recall on with an int8 archive on disk) at a real model's width: a few
evicting blocks of a document, a question (snapshot, restore, recall) and a few decoded tokens. Every
synchronizing CUDA call torch reports is counted per phase and per source line, so the lines to fix are named.
On a machine without CUDA there is nothing to count: it says so and exits 0.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu import CONFIGS, config_model, random_ids  # noqa: E402
from bench.jsonfile import write_json  # noqa: E402


@contextlib.contextmanager
def counting(phase: str, found: dict[str, collections.Counter], cuda: bool = True):
    """Count the sync warnings raised inside the block under ``phase`` (source file:line of each); without
    CUDA (``--cpu``, a dry run of the steps) there is nothing to count."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    where = found.setdefault(phase, collections.Counter())
    for w in caught:
        if "called a synchronizing" in str(w.message):  # not the mode's own "prototype feature" notice
            where[f"{os.path.relpath(w.filename, ROOT)}:{w.lineno}"] += 1


def main() -> int:
    import torch

    from kvtool.core.engine import Engine, EngineConfig, model_env
    from kvtool.core.sampling import Chooser
    from kvtool.policies import build_policy
    from kvtool.runtime.budget import DEFAULT_RECALL

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama-3.1-8b", choices=sorted(CONFIGS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--policy", default="h2o")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=12, help="document blocks (the last few are counted)")
    ap.add_argument("--decode", type=int, default=32, help="tokens decoded as `ask --json` does (read every 8)")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--cpu", action="store_true", help="run the steps on the CPU, counting nothing (a dry run)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda and not args.cpu:
        print("n/a  sync-debug pass: no CUDA device here")
        return 0
    torch.set_grad_enabled(False)
    model, device = config_model(args.config, "cuda" if cuda else "cpu", "auto", args.layers)
    block, archive = args.block_size, tempfile.mkdtemp(prefix="kvtool-sync-")
    cfg = EngineConfig(budget=args.budget, block_size=block, recall=DEFAULT_RECALL, archive_dtype=torch.int8,
                       archive_dir=archive)
    env = model_env(model, cfg)
    engine = Engine(model, build_policy(args.policy, {}, env), cfg, env=env)
    cache = engine.new_cache()
    ids = random_ids(model.config.vocab_size, args.blocks * block + 32)
    doc, question = ids[: args.blocks * block], ids[args.blocks * block :]
    found: dict[str, collections.Counter] = {}
    warm = max(1, (args.budget // block) + 2)  # past the first evicting blocks: the steady state is counted
    for s in range(0, warm * block, block):
        logits = engine.step(cache, doc[s : s + block], 1)
    counted_blocks = args.blocks - warm
    with counting("prefill", found, cuda):
        for s in range(warm * block, doc.numel(), block):
            logits = engine.step(cache, doc[s : s + block], 1)
        if cuda:
            torch.cuda.synchronize()
    snap = cache.snapshot()
    with counting("question", found, cuda):
        logits, _ = engine.feed_question(cache, question, lambda: cache.restore(snap), args.decode + 1)
    with counting("decode", found, cuda):
        engine.generate(cache, logits, args.decode, set(), Chooser(args.decode, device, no_repeat_ngram=4))
    shutil.rmtree(archive, ignore_errors=True)
    per = {"prefill": max(1, counted_blocks), "question": 1, "decode": args.decode}
    unit = {"prefill": "block", "question": "question", "decode": "token"}
    doc_out = {"config": args.config, "layers": args.layers, "policy": args.policy, "budget": args.budget,
               "block_size": block, "recall": DEFAULT_RECALL, "phases": {}}
    for phase, where in found.items():
        total = sum(where.values())
        doc_out["phases"][phase] = {"syncs": total, f"per_{unit[phase]}": total / per[phase],
                                    "sites": dict(where.most_common(12))}
        print(f"{'ok  ' if total == 0 else 'SYNC'} {phase}: {total} syncs ({total / per[phase]:.1f} per "
              f"{unit[phase]})" + "".join(f"\n       {n:4d}  {site}" for site, n in where.most_common(8)),
              flush=True)
    if args.json_path:
        write_json(args.json_path, doc_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
