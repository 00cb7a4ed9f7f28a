"""Where recalled passages sit with compact positions, and how much to recall: one read, several answers.

    python bench/recall_placement.py --length 32k --kind name --cells 0.1:1,0.5:1,0.9:0,0.9:1 --modes document,last
    python bench/recall_placement.py --length 8k --kind name --modes document,last,threshold0.5,recall512

kvtool merges a recalled passage at its document position: recalling every archived token then gives
exactly ``full`` (the oracle in tests/test_recall.py, in both position modes). With compact positions
(documents past the model's range) the positions are synthetic anyway, so a passage could sit elsewhere.
This measures alternatives without changing kvtool, on the needles of ``kvtool eval needle`` (seed 0):

    document      kvtool's recall (the default settings, ``--budget 256``)
    last          the recalled tokens packed after every kept one, right before the question, in
                  document order (a compact re-pack with the recalled ranks moved last)
    recallN       N tokens per KV head recalled instead of the default
    thresholdA    only archived positions whose relevance is at least A × the best one's

Each trial's document is read once and asked once per mode. Prints one JSON line per answer and a
found/trials summary per mode on stdout (progress on stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvtool.core import positions as P  # noqa: E402
from kvtool.core.archive import GroupArchive  # noqa: E402
from kvtool.documents import text_document  # noqa: E402
from kvtool.eval import load_text  # noqa: E402
from kvtool.eval import needle as N  # noqa: E402
from kvtool.eval.metrics import contains_answer  # noqa: E402
from kvtool.runtime.model import load_model  # noqa: E402
from kvtool.runtime.session import Session  # noqa: E402
from kvtool.runtime.settings import Settings  # noqa: E402


def pack_recalled_last(self: P.CompactPositions, g) -> None:
    """``CompactPositions.settle`` for ``last``: kept tokens first (slot order), then the recalled ones."""
    n = g.length
    if not self.compact or n == 0 or g.recalled is None:
        return ORIGINAL_SETTLE(self, g)
    pos, rec = g.positions[:, :n], g.recalled
    at = torch.searchsorted(rec, pos.contiguous()).clamp_(max=rec.shape[1] - 1)
    is_rec = rec.gather(1, at) == pos
    kept = (~is_rec).sum(1, keepdim=True)
    rank = torch.where(is_rec, kept + is_rec.cumsum(1) - 1, (~is_rec).cumsum(1) - 1)
    target = (self.next - n) + rank
    origin = g.origin_keys(n)
    if origin is None:
        g.write_keys(g.rotator.rotate(g.stored_keys()[:, :n], target - g.rotary[:, :n]))
    else:
        g.write_keys(g.rotator.rotate(origin, target - pos))
    g.rotary[:, :n] = target
    g.rotary_floor = self.next - n


ORIGINAL_SETTLE = P.CompactPositions.settle
ORIGINAL_TOP = GroupArchive.top_by_position


@contextmanager
def mode(session: Session, name: str, default_recall: int) -> Iterator[None]:
    """Patch kvtool for one answer in mode ``name``; restored afterwards."""
    if name.startswith("recall"):
        session.engine.config.recall = int(name.removeprefix("recall"))
    elif name == "last":
        P.CompactPositions.settle = pack_recalled_last
    elif name.startswith("threshold"):
        alpha = float(name.removeprefix("threshold"))

        def top(self: GroupArchive, relevance: Tensor, tokens: int) -> Tensor:
            key = relevance[self.all_positions()]
            keep = int((key >= alpha * float(relevance.max())).sum(1).max())
            return ORIGINAL_TOP(self, relevance, max(1, min(tokens, keep)))

        GroupArchive.top_by_position = top
    elif name != "document":
        raise SystemExit(f"unknown mode {name!r}")
    try:
        yield
    finally:
        session.engine.config.recall = default_recall
        P.CompactPositions.settle = ORIGINAL_SETTLE
        GroupArchive.top_by_position = ORIGINAL_TOP


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", default="32k", help="haystack tokens (8k, 32k, ...)")
    ap.add_argument("--kind", choices=N.NEEDLE_KINDS, default="name")
    ap.add_argument("--cells", default="0.1:0,0.1:1,0.1:2,0.5:0,0.5:1,0.5:2,0.9:0,0.9:1,0.9:2",
                    help="depth:trial pairs (the trials of eval needle's cells)")
    ap.add_argument("--modes", default="document,last")
    ap.add_argument("--haystack", default=str(ROOT.parent / "shared" / "corpus" / "paul_graham_essays"))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    length = int(args.length[:-1]) * 1024 if args.length.endswith("k") else int(args.length)
    torch.set_num_threads(args.threads)
    loaded = load_model(None, "auto", "auto", "none")
    tok = loaded.tokenizer
    hay = N.Haystack(load_text(Path(args.haystack), "haystack"), tok, length)
    settings = dataclasses.replace(Settings(), budget="256", threads=args.threads)
    session = Session(settings, listener=None, say=lambda m: None, loaded=loaded)
    default_recall = session.engine.config.recall
    found: dict[str, list[bool]] = {m: [] for m in args.modes.split(",")}
    for cell in args.cells.split(","):
        depth, trial = float(cell.split(":")[0]), int(cell.split(":")[1])
        needle = (N.name_needle if args.kind == "name" else N.passkey_needle)(0, trial)
        ntok = len(tok(" " + needle.text + " ", add_special_tokens=False)["input_ids"])
        text, _, _ = N.build_document(hay, [needle], length, depth, 0, trial, ntok)
        t0 = time.perf_counter()
        read = session.read(text_document(text, "haystack"))
        seconds = time.perf_counter() - t0
        try:
            for m in found:
                with mode(session, m, default_recall):
                    answer = session.ask(read, needle.question).answer
                ok = contains_answer(answer, needle.answer)
                found[m].append(ok)
                print(json.dumps({"length": length, "kind": args.kind, "depth": depth, "trial": trial, "mode": m,
                                  "expected": needle.answer, "found": ok, "answer": answer[:80],
                                  "read_seconds": round(seconds)}), flush=True)
        finally:
            read.close()
    for m, oks in found.items():
        print(json.dumps({"mode": m, "found": sum(oks), "trials": len(oks)}), flush=True)


if __name__ == "__main__":
    main()
