"""Where recalled passages sit with compact positions, and how much to recall: one read, several answers.

    python bench/recall_placement.py --length 32k --kind name --cells 0.1:1,0.5:1 --modes document,relevance --show 8
    python bench/recall_placement.py --length 8k --kind name --modes document,last,threshold0.5,recall512

With compact positions (documents past the model's range) positions are synthetic, so a recalled passage
can sit anywhere. kvtool places a selection by relevance (``--recall-placement relevance``, the default); the
whole archive goes back at its document positions, so recalling every archived token gives exactly ``full``
(the oracle in tests/test_recall.py, in both position modes). This compares placements and recall sizes on
the needles of ``kvtool eval needle`` (seed 0):

    document      recall merged at document positions (``--recall-placement document``; ``--budget 256``)
    last          the recalled tokens packed after every kept one, right before the question, in
                  document order (a compact re-pack with the recalled ranks moved last)
    relevance     kvtool's default (``--recall-placement relevance``): a selection after the kept tokens,
                  passage by passage in ascending relevance, the best right before the question
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
from kvtool.core import recall as R  # noqa: E402
from kvtool.core.archive import GroupArchive  # noqa: E402
from kvtool.core.engine import Engine  # noqa: E402
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
ORIGINAL_RANKING = R._ranking
#: the ranking of the last recall (``--show``)
LAST: list[Tensor] = []


def recorded(ranking_fn):
    def ranking(relevance: Tensor) -> Tensor:
        out = ranking_fn(relevance)
        LAST[:] = [out]
        return out
    return ranking


def recalled_passages(tok, ranking: Tensor, tokens: int, show: int) -> list[str]:
    """The text of the ``show`` best passages among the ``tokens`` best-ranked positions (approximately what
    each head recalls: a head takes them among the tokens it archived)."""
    top = torch.sort(torch.topk(ranking, min(tokens, ranking.numel())).indices).values
    runs: list[list[int]] = []
    for p in top.tolist():
        if runs and p - runs[-1][-1] <= 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    runs.sort(key=lambda r: -float(ranking[r].max()))
    return [f"@{r[0]}: " + tok.decode(STREAM[r[0] : r[-1] + 1].clamp(min=0).tolist()) for r in runs[:show]]


ORIGINAL_FORWARD = Engine._forward
#: the token ids fed at each stream position (the last read's), for ``--show``
STREAM = torch.full((1 << 20,), -1, dtype=torch.long)


def recording_forward(self: Engine, cache, ids: Tensor, logits_rows: int) -> Tensor:
    STREAM[cache.seen : cache.seen + ids.numel()] = ids.reshape(-1).cpu()
    return ORIGINAL_FORWARD(self, cache, ids, logits_rows)


Engine._forward = recording_forward


@contextmanager
def mode(session: Session, name: str, default_recall: int, default_placement: str) -> Iterator[None]:
    """Patch kvtool for one answer in mode ``name``; restored afterwards."""
    R._ranking = recorded(ORIGINAL_RANKING)  # every mode records its ranking (``--show``)
    if name.startswith("recall"):
        session.engine.config.recall = int(name.removeprefix("recall"))
    elif name == "last":
        session.engine.config.recall_placement = "document"
        P.CompactPositions.settle = pack_recalled_last
    elif name in ("document", "relevance"):
        session.engine.config.recall_placement = name
    elif name.startswith("threshold"):
        alpha = float(name.removeprefix("threshold"))

        def top(self: GroupArchive, relevance: Tensor, tokens: int) -> Tensor:
            key = relevance[self.all_positions()]
            keep = int((key >= alpha * float(relevance.max())).sum(1).max())
            return ORIGINAL_TOP(self, relevance, max(1, min(tokens, keep)))

        GroupArchive.top_by_position = top
    else:
        raise SystemExit(f"unknown mode {name!r}")
    try:
        yield
    finally:
        session.engine.config.recall = default_recall
        session.engine.config.recall_placement = default_placement
        P.CompactPositions.settle = ORIGINAL_SETTLE
        GroupArchive.top_by_position = ORIGINAL_TOP
        R._ranking = ORIGINAL_RANKING


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", default="32k", help="haystack tokens (8k, 32k, ...)")
    ap.add_argument("--kind", choices=N.NEEDLE_KINDS, default="name")
    ap.add_argument("--cells", default="0.1:0,0.1:1,0.1:2,0.5:0,0.5:1,0.5:2,0.9:0,0.9:1,0.9:2",
                    help="depth:trial pairs (the trials of eval needle's cells)")
    ap.add_argument("--modes", default="document,last")
    ap.add_argument("--haystack", default=str(ROOT.parent / "shared" / "corpus" / "paul_graham_essays"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--show", type=int, default=0, help="print the text of this many recalled passages per answer")
    ap.add_argument("--max-new-tokens", type=int, default=16, help="answer length (eval needle's tables: 16)")
    ap.add_argument("--log", type=Path, help="append each answer's line here too, and skip the cells it already has")
    args = ap.parse_args()
    length = int(args.length[:-1]) * 1024 if args.length.endswith("k") else int(args.length)
    torch.set_num_threads(args.threads)
    loaded = load_model(None, "auto", "auto", "none")
    tok = loaded.tokenizer
    hay = N.Haystack(load_text(Path(args.haystack), "haystack"), tok, length)
    settings = dataclasses.replace(Settings(), budget="256", threads=args.threads, max_new_tokens=args.max_new_tokens)
    session = Session(settings, listener=None, say=lambda m: None, loaded=loaded)
    default_recall = session.engine.config.recall
    default_placement = session.engine.config.recall_placement
    found: dict[str, list[bool]] = {m: [] for m in args.modes.split(",")}
    done = {}
    if args.log and args.log.exists():
        for line in args.log.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a kill: that cell runs again
            done[(row["length"], row["kind"], row["depth"], row["trial"], row["mode"])] = row
    for cell in args.cells.split(","):
        depth, trial = float(cell.split(":")[0]), int(cell.split(":")[1])
        logged = [done.get((length, args.kind, depth, trial, m)) for m in found]
        if all(logged):
            for m, row in zip(found, logged, strict=True):
                found[m].append(row["found"])
            continue
        needle = (N.name_needle if args.kind == "name" else N.passkey_needle)(0, trial)
        ntok = len(tok(" " + needle.text + " ", add_special_tokens=False)["input_ids"])
        text, _, _ = N.build_document(hay, [needle], length, depth, 0, trial, ntok)
        t0 = time.perf_counter()
        STREAM.fill_(-1)
        read = session.read(text_document(text, "haystack"))
        seconds = time.perf_counter() - t0
        try:
            for m in found:
                LAST.clear()
                with mode(session, m, default_recall, default_placement):
                    answer = session.ask(read, needle.question).answer
                ok = contains_answer(answer, needle.answer)
                found[m].append(ok)
                shown = recalled_passages(tok, LAST[0], default_recall, args.show) if args.show and LAST else []
                line = json.dumps({"length": length, "kind": args.kind, "depth": depth, "trial": trial, "mode": m,
                                   "expected": needle.answer, "found": ok, "answer": answer[:80],
                                   "read_seconds": round(seconds), **({"recalled": shown} if shown else {})})
                print(line, flush=True)
                if args.log:
                    with args.log.open("a") as f:
                        f.write(line + "\n")
        finally:
            read.close()
    for m, oks in found.items():
        print(json.dumps({"mode": m, "found": sum(oks), "trials": len(oks)}), flush=True)


if __name__ == "__main__":
    main()
