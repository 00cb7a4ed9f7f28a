"""Citations: which spans of the document an answer drew on, from the attention its tokens paid them.

Two halves:

* :class:`SourceMap`, built while the document is read: for every document token still held by some
  head of the cache, its stream position, token id and character span in the extracted text, plus
  the table of parts (page, chapter, section) by starting character. Entries of tokens no head holds
  any more are pruned as the prefill goes, so the map is bounded by the cache, not the document —
  except while the cache archives evicted tokens for recall: then every token is kept (a recalled
  passage must be citable), and the map grows with the archive (``prune_source``).
* :func:`cite`, after an answer: the cache's per-token attention mass (accumulated by the attention
  function over the upper half of the layers and all their heads while the answer was decoded, see
  ``BoundedCache.start_mass``) is summed per position, the heaviest tokens are grown into sentence
  spans over contiguous cached tokens, and the spans are ranked by the share of the answer's
  document attention they received.

Why the upper half: lower layers attend by position (the first document tokens and the last few
get most of their mass whatever the answer), upper layers by content — where the retrieval and
copy heads are. On 10 needle trials with SmolLM2-135M (9 answered) the needle was the top span
9/9 times from the upper half and 1/9 from all layers; it also halves the cost.

The core only knows stream positions; everything about pages and characters lives here.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kvtool.core import recall

#: how many cited spans an answer gets at most, and the least share of the top span's weight a span needs
MAX_CITATIONS = 3
MIN_RELATIVE_WEIGHT = 0.2
#: seed tokens tried (heaviest first) and the longest span grown around one, in tokens each way
SEEDS = 24
MAX_SPAN_TOKENS = 40
_SENTENCE_END = (".", "!", "?", "\u3002", ".\"", ".\u201d", "?\u201d", "!\u201d")


@dataclass
class Section:
    """Where a part of the document starts in the extracted text, and what it is."""

    start_char: int
    page: int | None = None
    chapter: int | None = None
    title: str | None = None

    def label(self, start_char: int, end_char: int) -> str:
        if self.page is not None:
            return f"p. {self.page}"
        if self.chapter is not None:
            return f"ch. {self.chapter}" + (f" \u201c{self.title}\u201d" if self.title else "")
        if self.title:
            return f"\u00a7 \u201c{self.title}\u201d"
        return f"chars {start_char:,}\u2013{end_char:,}"


class SourceMap:
    """Document tokens → (character span, token id), kept for the tokens some head still holds (or, while
    recall archives, every token)."""

    def __init__(self, first_position: int) -> None:
        self.first_position = first_position  # stream position of the document's first token
        self.count = 0  # document tokens added so far
        self.positions = torch.zeros(0, dtype=torch.long)
        self.spans = torch.zeros(0, 2, dtype=torch.long)
        self.ids = torch.zeros(0, dtype=torch.long)
        self.sections: list[Section] = []
        self._pending: list[tuple[Tensor, Tensor, Tensor]] = []
        self._pending_tokens = 0

    # -- building --------------------------------------------------------------------------------------
    def add_section(self, start_char: int, page: int | None, chapter: int | None, title: str | None) -> None:
        last = self.sections[-1] if self.sections else None
        if last is None or (last.page, last.chapter, last.title) != (page, chapter, title):
            self.sections.append(Section(start_char, page, chapter, title))

    def add(self, ids: list[int], spans: list[tuple[int, int]]) -> None:
        n = len(ids)
        if not n:
            return
        pos = torch.arange(self.first_position + self.count, self.first_position + self.count + n)
        self._pending.append((pos, torch.tensor(spans, dtype=torch.long).view(n, 2), torch.tensor(ids)))
        self.count += n
        self._pending_tokens += n

    def _flush(self) -> None:
        if self._pending:
            p, s, i = zip(*self._pending, strict=True)
            self.positions = torch.cat([self.positions, *p])
            self.spans = torch.cat([self.spans, *s])
            self.ids = torch.cat([self.ids, *i])
            self._pending, self._pending_tokens = [], 0

    @property
    def pending_tokens(self) -> int:
        return self._pending_tokens

    def prune(self, held: Tensor | None, seen: int) -> None:
        """Drop the entries of tokens already fed (position < ``seen``) that no head holds (not in ``held``;
        None: every token is still wanted, as with an archive recall may bring them back from)."""
        self._flush()
        if held is None:
            return
        keep = torch.isin(self.positions, held.to("cpu")) | (self.positions >= seen)
        self.positions, self.spans, self.ids = self.positions[keep], self.spans[keep], self.ids[keep]

    def __len__(self) -> int:
        return self.positions.numel() + self._pending_tokens

    def positions_in(self, start_char: int, end_char: int) -> Tensor:
        """Stream positions of the mapped tokens that overlap characters [``start_char``, ``end_char``)."""
        self._flush()
        hit = (self.spans[:, 0] < end_char) & (self.spans[:, 1] > start_char)
        return self.positions[hit]

    def ids_at(self, positions: Tensor) -> Tensor:
        """Token ids at stream ``positions`` (sorted); -1 where the map holds no token there."""
        self._flush()
        if self.positions.numel() == 0:
            return torch.full_like(positions, -1)
        idx = torch.searchsorted(self.positions, positions).clamp_(max=self.positions.numel() - 1)
        return torch.where(self.positions[idx] == positions, self.ids[idx], torch.full_like(positions, -1))

    # -- persistence (.kvc metadata) ----------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        """A JSON object: the section table, and the per-token arrays as base64 of zlib'd int32 (little-endian).

        It lives in the ``.kvc`` metadata rather than in tensors so that a kvtool without citations,
        which checks the tensor names, still loads the file (unknown metadata keys are ignored).
        """
        self._flush()
        return {"first_position": self.first_position, "tokens": self.count, "entries": self.positions.numel(),
                "sections": [[s.start_char, s.page, s.chapter, s.title] for s in self.sections],
                "positions": _pack(self.positions), "spans": _pack(self.spans.reshape(-1)), "ids": _pack(self.ids)}

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> SourceMap:
        """The inverse of :meth:`meta`; raises ValueError/KeyError/TypeError on damaged input."""
        m = cls(int(meta["first_position"]))
        m.count = int(meta.get("tokens", 0))
        entries = int(meta["entries"])
        m.positions = _unpack(meta["positions"], entries)
        m.spans = _unpack(meta["spans"], 2 * entries).view(-1, 2)
        m.ids = _unpack(meta["ids"], entries)
        m.sections = [Section(int(a), p, c, t) for a, p, c, t in meta.get("sections", [])]
        return m

    def section_at(self, char: int) -> Section:
        starts = [s.start_char for s in self.sections]
        i = bisect.bisect_right(starts, char) - 1
        return self.sections[max(0, i)] if self.sections else Section(0)


def _pack(t: Tensor) -> str:
    return base64.b64encode(zlib.compress(t.to(torch.int32).numpy().astype("<i4").tobytes(), 6)).decode("ascii")


def _unpack(text: str, count: int) -> Tensor:
    """``count`` int32 packed by :func:`_pack`; ValueError unless the data inflates to exactly that many.

    Decompression stops at the size ``count`` implies (a small header cannot inflate to gigabytes).
    """
    import numpy as np

    if count < 0:
        raise ValueError("negative entry count")
    want = 4 * count
    try:
        inflater = zlib.decompressobj()
        raw = inflater.decompress(base64.b64decode(text.encode("ascii"), validate=True), want)
        # the rest of the stream (its end marker and checksum) may yield nothing: one byte more is damage
        extra = b"" if inflater.eof else inflater.decompress(inflater.unconsumed_tail, 1)
    except (zlib.error, binascii.Error) as e:
        raise ValueError(str(e)) from None
    if len(raw) != want or extra or not inflater.eof:
        raise ValueError(f"a packed array does not hold the {count} entries the source map says")
    return torch.from_numpy(np.frombuffer(raw, dtype="<i4").astype(np.int64))


def held_positions(cache: Any) -> Tensor:
    """Every stream position some head of ``cache`` holds (the union over layers, groups and heads)."""
    return torch.cat([g.positions[:, : g.length].reshape(-1) for g in cache.groups()]).unique()


def prune_source(source: SourceMap, cache: Any, keep: bool = False) -> None:
    """Forget the source of the tokens no head holds, unless the cache archives evicted tokens (or ``keep``).

    While an archive exists, every document token is held or archived, and recall may bring any archived
    one back for an answer: ``--cite`` must find the passage recall brought back (it often is what answered),
    so the map keeps every token, growing with the archive (32 bytes per token beside the archive's
    kilobytes). Without an archive (recall off, or turned off when the disk ran short) it keeps the held ones.
    """
    if keep or recall.archives(cache):
        source.prune(None, cache.seen)
    else:
        source.prune(held_positions(cache), cache.seen)


@dataclass
class Citation:
    page: int | None
    chapter: int | None
    section: str | None
    start_char: int
    end_char: int
    text: str
    weight: float  # share of the answer's attention to the document that fell on this span
    label: str

    def json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"page": self.page}
        if self.chapter is not None:
            out["chapter"] = self.chapter
        if self.section is not None:
            out["section"] = self.section
        out.update(start_char=self.start_char, end_char=self.end_char, text=self.text, weight=round(self.weight, 4))
        return out

    def line(self, width: int = 160) -> str:
        text = " ".join(self.text.split())
        if len(text) > width:
            text = text[: width - 1].rstrip() + "\u2026"
        return f"{self.label}: \u00ab{text}\u00bb ({100 * self.weight:.0f}%)"


class AnswerMass:
    """The attention mass of one answer, over the upper half of the cache's layers (see the module docstring).

    A second recall (``--recall-select again``) rebuilds the cache after the answer's first tokens: the mass
    those tokens paid is kept by stream position, and the rest of the answer adds to the rebuilt cache's.
    :func:`cite` sums a position's mass over every entry, so the two parts cite as one answer's attention."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.parts: list[tuple[Tensor, Tensor]] = []

    def start(self) -> None:
        self.cache.start_mass(first_layer=len(self.cache.layers) // 2)

    def around(self, again: Callable[[list[int]], Tensor]) -> Callable[[list[int]], Tensor]:
        """``again`` with the mass so far kept while it restores the cache and recalls once more."""

        def kept(answer: list[int]) -> Tensor:
            self.parts.append(self.cache.stop_mass())
            logits = again(answer)
            self.start()
            return logits

        return kept

    def stop(self) -> tuple[Tensor, Tensor]:
        """(positions, mass) of every part, flat; accumulation stops."""
        positions, mass = zip(*self.parts, self.cache.stop_mass(), strict=True)
        self.parts = []
        return torch.cat(positions), torch.cat(mass)


def cite(source: SourceMap, positions: Tensor, mass: Tensor, tokenizer: Any,
         k: int = MAX_CITATIONS) -> list[Citation]:
    """The ≤ ``k`` document spans that got the most of the answer's attention, heaviest first.

    ``positions``/``mass``: flat per-(layer, head, token) stream positions and accumulated attention.
    """
    source._flush()
    if source.positions.numel() == 0 or positions.numel() == 0:
        return []
    pos = positions.to("cpu").reshape(-1)
    w = mass.to("cpu", torch.float32).reshape(-1)
    idx = torch.searchsorted(source.positions, pos).clamp_(max=source.positions.numel() - 1)
    hit = source.positions[idx] == pos
    per_token = torch.zeros(source.positions.numel(), dtype=torch.float32)
    per_token.index_add_(0, idx[hit], w[hit])
    total = float(per_token.sum())
    if total <= 0:
        return []
    texts: dict[int, str] = {}

    def token_text(i: int) -> str:
        if i not in texts:
            texts[i] = tokenizer.decode([int(source.ids[i])])
        return texts[i]

    n = source.positions.numel()
    P = source.positions

    def ends_sentence(i: int) -> bool:
        """Token i ends a sentence: end punctuation before whitespace (not ``2.4``), or a blank line."""
        t = token_text(i)
        if "\n\n" in t:
            return True
        if not t.rstrip(" ").endswith(_SENTENCE_END):
            return False
        return t[-1:].isspace() or i == n - 1 or P[i + 1] != P[i] + 1 or token_text(i + 1)[:1].isspace()

    spans: list[tuple[int, int]] = []
    for seed in torch.argsort(per_token, descending=True)[:SEEDS].tolist():
        if per_token[seed] <= 0 or any(a <= seed < b for a, b in spans):
            continue
        a = seed  # grow left to the start of the sentence (contiguous cached tokens only)
        while a > 0 and seed - a < MAX_SPAN_TOKENS and P[a - 1] == P[a] - 1 and not ends_sentence(a - 1):
            a -= 1
        b = seed  # grow right through the end of the sentence
        while b < n - 1 and b - seed < MAX_SPAN_TOKENS and not ends_sentence(b) and P[b + 1] == P[b] + 1:
            b += 1
        while a < b and not token_text(a).strip():  # a span starts and ends on text, not on a line break
            a += 1
        while b > a and not token_text(b).strip():
            b -= 1
        spans.append((a, b + 1))
    ranked = sorted(((float(per_token[a:b].sum()) / total, a, b) for a, b in spans), reverse=True)
    out: list[Citation] = []
    for weight, a, b in ranked[:k]:
        if out and weight < MIN_RELATIVE_WEIGHT * out[0].weight:
            break
        start, end = int(source.spans[a, 0]), int(source.spans[b - 1, 1])
        sec = source.section_at(start)
        text = tokenizer.decode(source.ids[a:b].tolist()).strip()
        out.append(Citation(page=sec.page, chapter=sec.chapter, section=sec.title, start_char=start, end_char=end,
                            text=text, weight=weight, label=sec.label(start, end)))
    return out

