"""Recall: bring back the archived passages a question points at, into the cache for one answer.

    attach(cache)            every bounded group gets an archive and ``recall`` extra slots
    feed(question)           with ``cache.query_log`` a ``QueryLog``: the queries of the layers that
                             recall are recorded (the question's own rows only)
    restore(snapshot)        back to the cache as it was after the document
    recall(cache, log, N)    every KV head scores its archive against the recorded queries; the
                             positions all heads attend to most (with their sentences) come back,
                             ≤ N tokens per head, merged beside the kept tokens in position order
                             (compact mode re-packs them)
    feed(question) again     the question's own hidden states now see what was recalled

A group holds at most ``capacity + recalled + block`` tokens per head during an answer, where
``recalled`` ≤ min(recall, archived tokens): its slots grow once, at the first recall, by what the
archive can give (``HeadGroup.make_room``); ``capacity`` and the room a group may fill (``max_slots``) are
raised by the recalled count for that answer only and lowered again by the next restore
(``HeadGroup.load_state_dict``), so a question decodes as it would right after the read; the grown slots
serve the document's next questions and are given back when the cache is cleared for another document
(``BoundedCache.clear``). Only global, budgeted, uncompensated groups archive and recall (``recallable``).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from kvtool.config import DEFAULT_RECALL_PLACEMENT, SCAN, SCAN_BYTES, SCORE_BYTES
from kvtool.core.archive import AppendWork, GroupArchive
from kvtool.core.archive_stores import ArchiveStore
from kvtool.core.cache import BoundedCache, HeadGroup
from kvtool.core.staging import to_device

StoreFactory = Callable[[int], ArchiveStore]  # row bytes → a fresh store
#: stream positions before and after a matching token that come back with it (the rest of its sentence)
SPAN = (8, 24)
#: inside one span, the weight of a token's own relevance (it breaks the span's tie)
TIE = 1e-3


def grown(tokens: int, archived: int) -> int:
    """``--recall-select grow``: the tokens a head recalls from an archive of ``archived`` tokens: ``tokens`` up to
    ``SCAN`` archived, then in proportion to the square root (twice as many at four times ``SCAN``)."""
    return round(tokens * math.sqrt(max(1.0, archived / SCAN)))


@dataclass
class RecallResult:
    tokens: int = 0  # largest number of tokens recalled into one head
    pages: int = 0  # pages touched, summed over layers and KV heads
    seconds: float = 0.0


@dataclass
class GroupTrace:
    """One recalling group's part of a :class:`RecallTrace`, per KV head."""

    layer: int
    archived: Tensor  # [h, W] bool: whether each watched position is in the head's archive
    held: Tensor  # [h, W] bool: whether the head holds it after the recall (kept or recalled)
    cutoff: Tensor  # [h] ranking of the lowest-ranked token recalled into the head (-inf: none recalled)
    recalled: Tensor  # [h, T] stream positions recalled into the head


@dataclass
class RecallTrace:
    """What one recall saw and chose, for a diagnosis (``kvtool eval needle --diagnose``).

    ``watch``: the stream positions to follow (a needle's tokens). ``recall`` fills each voting layer's
    own relevance (the attention its heads gave each position, summed: the ranking that layer alone
    would make), the shared ranking, and a :class:`GroupTrace` per recalling group; without recall
    (``hold``) only what each head holds. Recall reads nothing back from it: an answer is the same
    with a trace or without (tested).
    """

    watch: Tensor
    layer_relevance: dict[int, Tensor] = field(default_factory=dict)
    ranking: Tensor | None = None
    groups: list[GroupTrace] = field(default_factory=list)

    def reset(self) -> None:
        """Forget what an earlier recall of the same answer noted (the trace describes the last one)."""
        self.layer_relevance.clear()
        self.ranking = None
        self.groups.clear()

    def note(self, layer: int, g: HeadGroup, archived: Tensor, recalled: Tensor, ranking: Tensor | None) -> None:
        """Record group ``g`` of ``layer`` after its recall: ``archived`` [h, n] the positions its archive held,
        ``recalled`` [h, T] the positions brought back (ranked by ``ranking``; None: nothing recalled)."""
        held = g.positions[:, : g.length].cpu()
        cutoff = (ranking[recalled].amin(1) if ranking is not None and recalled.numel()
                  else torch.full((g.num_heads,), -float("inf")))
        self.groups.append(GroupTrace(layer, _holds(archived, self.watch), _holds(held, self.watch), cutoff,
                                      recalled))

    def hold(self, cache: BoundedCache) -> None:
        """Record what every global group (sliding layers lose what leaves their window by definition) holds of
        ``watch`` when nothing is recalled (recall 0, or ``full``)."""
        for li, layer in enumerate(cache.layers):
            for g in layer.groups:  # type: ignore[attr-defined]
                if g.window is None:
                    archived = g.archive.all_positions() if g.archive is not None else torch.zeros(
                        g.num_heads, 0, dtype=torch.long)
                    self.note(li, g, archived, torch.zeros(g.num_heads, 0, dtype=torch.long), None)


def _holds(positions: Tensor, watch: Tensor) -> Tensor:
    """[h, W] bool: whether each head's ``positions`` [h, n] include each of ``watch`` [W]."""
    return torch.stack([torch.isin(watch, row) for row in positions])


def attach(cache: BoundedCache, recall: int, page_size: int, dtype: torch.dtype | None, store: StoreFactory) -> None:
    """Give every recallable group an archive (cache still empty); slots for recalled tokens are added at
    recall time, sized by what was archived (``HeadGroup.make_room``).

    ``dtype``: how archived K/V are stored (None: as the cache holds them); recalled tokens are cast
    back to the cache's dtype, so a narrower archive costs only its rounding (``--archive-dtype``).
    """
    # layers append in turn: one set of append buffers for the whole cache, kept when it is reused
    work = cache.archive_work = cache.archive_work or AppendWork()
    for g in cache.groups():
        if not recallable(g):
            continue
        dt = dtype or g.dtype
        g.archive = GroupArchive(g.num_heads, g.head_dim, dt, page_size, store, work)
    if cache.archive_closer is not None:  # a cache reused for another document: the old archives are closed
        cache.archive_closer.detach()
    # released cache → its archive files closed
    cache.archive_closer = weakref.finalize(cache, _close_all, archives(cache))


def _close_all(items: list[GroupArchive]) -> None:
    for a in items:
        a.close()


def recallable(g: HeadGroup) -> bool:
    """Whether a group archives and recalls: global, budgeted, uncompensated groups only.

    A sliding-window layer's queries never see a key past its window, so what leaves the window is
    gone by the model's own definition (archiving it would only cost disk, and recalling into it
    would show a local layer keys it must not see; with no archive its queries do not vote either).
    A compensated group (RazorAttention's non-retrieval heads) already holds the mean of every
    dropped token in its compensation slot: a recalled token would count there and again itself.
    """
    return g.capacity is not None and g.window is None and not g.compensation


def recallable_groups(cache: BoundedCache) -> list[HeadGroup]:
    return [g for g in cache.groups() if recallable(g)]


def bytes_per_token(cache: BoundedCache) -> int:
    """Archive bytes per evicted stream token, summed over the archives: K/V rows, positions, and each
    page's share of its summary (an upper bound: rounded up)."""
    total = 0
    for a in archives(cache):
        total += a.store.row_bytes + a.index.row_bytes + -(-a.summaries.row_bytes // a.page_size)
    return total


def kv_bytes(cache: BoundedCache, tokens: int) -> int:
    """K+V bytes of ``tokens`` recalled tokens per KV head in the groups that recall: what recall adds to the
    budget's promise for an answer (a byte budget holds it)."""
    return sum(tokens * g.num_heads * 2 * g.bytes_per_token_head() for g in recallable_groups(cache))


def archives(cache: BoundedCache) -> list[GroupArchive]:
    return [g.archive for g in cache.groups() if g.archive is not None]


def archive_dtype(cache: BoundedCache) -> str | None:
    """How archived K/V are stored ("float16", …), or None without an archive."""
    return next((str(a.dtype).removeprefix("torch.") for a in archives(cache)), None)


def archive_bytes(cache: BoundedCache) -> int:
    return sum(a.nbytes() for a in archives(cache))


def archived_per_head(cache: BoundedCache) -> int:
    """The most tokens any KV head has archived (0 without an archive)."""
    return max((a.length for a in archives(cache)), default=0)


def archived_tokens(cache: BoundedCache) -> int:
    """Archived tokens summed over groups and heads."""
    return sum(a.length * a.h for a in archives(cache))


def close(cache: BoundedCache) -> None:
    """Close every archive of ``cache`` now (its files' descriptors); recall is off for it afterwards."""
    for g in cache.groups():
        if g.archive is not None:
            g.archive.close()
            g.archive = None


class QueryLog:
    """The queries of a question fed with recall on, recorded by the attention function layer by layer.

    Only what recall scores with is kept: the layers with a group that has archived something (a
    sliding layer's queries never vote) and, of each block, the ``focus`` rows of the fed suffix (the
    question itself; None: every row), copied out so that the rest of the block's queries are freed.
    Its size is rows x layers that recall x attention heads x head dim in the compute dtype
    (``memory.recall_scratch_bytes`` plans it).
    """

    def __init__(self, cache: BoundedCache, focus: slice | tuple[slice, ...] | None = None) -> None:
        self.layers = {li for li, layer in enumerate(cache.layers)
                       if any(g.archive is not None and g.archive.length for g in layer.groups)}  # type: ignore[attr-defined]
        self.focus = (focus,) if isinstance(focus, slice) else focus
        self.fed: dict[int, int] = {}  # rows fed so far, per layer
        self.entries: list[tuple[int, Tensor, float]] = []

    def append(self, entry: tuple[int, Tensor, float]) -> None:
        """Record a layer's queries [1, heads, m, d] of the suffix's next ``m`` rows, and its scaling."""
        layer_idx, query, scaling = entry
        if layer_idx not in self.layers:
            return
        first = self.fed.get(layer_idx, 0)
        m = query.shape[2]
        self.fed[layer_idx] = first + m
        if self.focus is None:
            self.entries.append((layer_idx, query, scaling))
            return
        for part in self.focus:
            lo = max(part.start or 0, first)
            hi = min(part.stop if part.stop is not None else first + m, first + m)
            if hi > lo:
                self.entries.append((layer_idx, query[:, :, lo - first : hi - first].clone(), scaling))

    def __iter__(self) -> Iterator[tuple[int, Tensor, float]]:
        return iter(self.entries)


def _group_queries(g: HeadGroup, queries: list[Tensor], rows: slice) -> Tensor:
    """The group's query rows ``rows`` of the fed question, as they attended: [h, q_per_kv · rows, d].

    ``queries``: the logged [1, heads, m, d] queries of the layer, block after block."""
    q = torch.cat([x[0] if g.all_heads else x[0].index_select(0, g.q_index) for x in queries], dim=1)[:, rows]
    return q.reshape(g.num_heads, -1, q.shape[-1])


def _landing(g: HeadGroup, compact: bool) -> Callable[[Tensor, Tensor], Tensor] | None:
    """Compact positions: rotate archived keys to where they would sit in position order among the kept.

    The question's queries sit at compact positions, the archived keys at their original ones; on
    a document past the model's trained range, scoring them there would put relative distances
    out of range, where RoPE's scores mean nothing. Each is scored at ``rotary_floor + rank``, its
    rank among the kept tokens: where the whole archive goes back when all of it is recalled. (A
    selection is then placed by relevance after the kept tokens, ``_placement``; scoring each key
    there would need the ranking being computed.)
    """
    if not compact:
        return None
    assert g.rotator is not None
    kept = g.positions[:, : g.length].contiguous()  # on the device, where the archived keys are scored
    floor, rotator = g.rotary_floor, g.rotator

    def place(keys: Tensor, positions: Tensor) -> Tensor:
        return rotator.rotate(keys, floor + torch.searchsorted(kept, positions.contiguous()) - positions)

    return place


def insert(g: HeadGroup, keys: Tensor, values: Tensor, positions: Tensor, ranking: Tensor | None = None) -> None:
    """Add recalled tokens ([h, T, d] keys at original positions [h, T]) to the kept ones: merged in position
    order, or with ``ranking`` placed after them passage by passage (``_placement``)."""
    if ranking is None:
        g.insert(keys, values, positions)
        return
    order = _placement(positions, ranking)
    pick = order.unsqueeze(-1).expand_as(keys)
    g.insert(keys.gather(1, pick), values.gather(1, pick), positions.gather(1, order), merge=False)


def _placement(positions: Tensor, ranking: Tensor) -> Tensor:
    """The order recalled tokens are placed in after the kept ones: [h, T] indices into ``positions`` [h, T].

    A passage is a run of consecutive recalled positions; passages go in ascending order of their best
    ``ranking``, so the most relevant one ends right before the question, and each passage keeps its
    document order. Why: with compact positions the places are synthetic anyway, and a small model
    copies from what is nearest the question: at 32K tokens, merged in document order, an essay's
    closing "Get funded by Y Combinator" recalled beside the needle sat nearer the question than the
    needle's sentence and was the answer to "What is the secret name?".
    """
    h, T = positions.shape
    by_position = torch.sort(positions, dim=1, stable=True).indices
    pos = positions.gather(1, by_position)
    starts = torch.ones(h, T, dtype=torch.bool, device=pos.device)
    starts[:, 1:] = pos[:, 1:] - pos[:, :-1] > 1
    run = starts.cumsum(1) - 1  # the passage of each token, in document order
    best = torch.full((h, T), -float("inf"), device=pos.device).scatter_reduce_(
        1, run, ranking.to(pos.device)[pos].float(), "amax")
    order = torch.sort(best.gather(1, run), dim=1, stable=True).indices  # ties (one passage) keep document order
    return by_position.gather(1, order)


@torch.inference_mode()
def recall(cache: BoundedCache, log: Iterable[tuple[int, Tensor, float]], tokens: int,
           focus: slice | None = None, placement: str = DEFAULT_RECALL_PLACEMENT,
           trace: RecallTrace | None = None, select: frozenset[str] = frozenset()) -> RecallResult:
    """Bring back the archived tokens of the passages the question attends to (≤ ``tokens`` per head).

    ``log``: each layer's recorded queries and scaling, in feeding order (a ``QueryLog``). ``focus``: the
    rows of the fed suffix whose queries count (the question itself, not the instruction and chat
    template around it, whose rows attend to the same generic attractors for every question; None:
    every row, or a ``QueryLog`` that kept only those rows). ``placement``: with compact positions,
    where a selection goes (``relevance``: after the kept tokens, ``_placement``; ``document``: merged
    at its positions). ``trace``: filled with what was seen and chosen (a diagnosis; changes nothing).
    ``select``: the variants of ``--recall-select`` (``selection``; none: the shared ranking below).

    Two passes over the groups. First, each KV head scores its archive exactly (every page, or with
    absolute positions past ``SCAN`` tokens the pages Quest's bound ranks best) and turns the scores
    into the attention its question rows would give each archived token beside the kept ones
    (``_attention``); those probabilities are summed per stream position over every head of every
    layer. Second, a position's relevance is the best sum within ``SPAN`` of it (so a match brings
    back the rest of its sentence), and every head recalls its archived tokens at the most relevant
    positions.

    All of it is computed on the cache's device (``GroupArchive.scores``: the archive's rows are sent there
    chunk by chunk, one copy each); the host waits for the device twice per question, whatever the
    number of layers: for the candidate pages of every group at once (only past ``SCAN``), and for the
    rankings. The recalled K/V of every group go back with one copy.

    Why one ranking for all heads: a needle is usually pointed at by a few retrieval heads, but
    copying it out takes the needle's tokens in the other layers too; with each head choosing by its
    own scores most heads miss part of the passage.
    """
    t0 = cache.timer.now()
    by_layer: dict[int, list[Tensor]] = {}
    scaling: dict[int, float] = {}
    for layer_idx, q, scale in log:
        by_layer.setdefault(layer_idx, []).append(q)
        scaling[layer_idx] = scale
    work = [(li, g, _group_queries(g, by_layer[li], focus or slice(None)).float())
            for li, layer in enumerate(cache.layers) for g in layer.groups  # type: ignore[attr-defined]
            if g.archive is not None and g.archive.length and by_layer.get(li)]
    holds = [_hold(g, q, cache.compact) for _, g, q in work]
    relevance = torch.zeros(cache.seen + 1, device=cache.device)
    own_relevance: dict[int, Tensor] = {}
    per_layer = "layer" in select or trace is not None
    pool = "sum" if "sum" in select else "max"
    for (li, g, q), hold, pages in zip(work, holds, _candidates(cache, work, holds), strict=True):
        a = g.archive
        assert a is not None
        place = _landing(g, cache.compact)
        own = own_relevance.setdefault(li, torch.zeros_like(relevance)) if per_layer else None
        for positions, probs in _attention(g, q, partial(a.scores, q, pages, place), scaling[li], hold,
                                           pool):
            relevance.scatter_add_(0, positions.flatten(), probs.flatten())
            if own is not None:
                own.scatter_add_(0, positions.flatten(), probs.flatten())
    ranking, layer_ranking, own_host = _rankings(relevance, own_relevance, "layer" in select)
    if trace is not None:
        trace.ranking = ranking[0]
        trace.layer_relevance.update(own_host)
    out = _bring_back(cache, [(li, g) for li, g, _ in work], tokens, ranking, layer_ranking, placement, trace,
                      select)
    out.seconds = cache.timer.now() - t0
    return out


def _bring_back(cache: BoundedCache, groups: list[tuple[int, HeadGroup]], tokens: int, ranking: tuple[Tensor, Tensor],
                layer_ranking: dict[int, tuple[Tensor, Tensor]], placement: str, trace: RecallTrace | None,
                select: frozenset[str]) -> RecallResult:
    """Recall into each of ``groups`` (layer, group) its archived tokens at the best-ranked positions: read on the
    host, every group's K/V (in the cache's dtype) sent to the device with one copy, then inserted."""
    out = RecallResult()
    chosen = [(li, g, min(grown(tokens, g.archive.length) if "grow" in select else tokens, g.archive.length))
              for li, g in groups]
    picks = [(g.archive.top_by_position(layer_ranking.get(li, ranking)[0], T), g) for li, g, T in chosen]
    reads = [(a.read(idx), g.dtype) for idx, g in picks if (a := g.archive) is not None]
    sent = to_device([t for (k, v, p), dt in reads for t in (k.to(dt), v.to(dt), p)], cache.device)
    for n, ((li, g, T), (idx, _)) in enumerate(zip(chosen, picks, strict=True)):
        a = g.archive
        assert a is not None
        g.make_room(T)
        rank = layer_ranking.get(li, ranking)
        keys, values, pos = sent[3 * n : 3 * n + 3]
        # compact positions: a selection is placed by relevance (``_placement``); the whole archive goes back
        # where it was, so recalling everything is the document again
        by_relevance = placement == "relevance" and cache.compact and idx.shape[1] < a.length
        insert(g, keys, values, pos, rank[1] if by_relevance else None)
        cache.rope.settle(g)
        if trace is not None:
            trace.note(li, g, a.all_positions(), reads[n][0][2], rank[0])
        out.tokens = max(out.tokens, idx.shape[1])
        out.pages += a.touched(idx)
    return out


def _hold(g: HeadGroup, q: Tensor, compact: bool) -> int:
    """Archived tokens per head whose exact scores ``_attention`` holds between its softmax's two passes.

    At most ``SCAN_BYTES`` of scores ([h, rows] float32 per token; at least a page's). With absolute positions
    also at most ``SCAN``: past it the Quest bound picks that many tokens' pages, and only those are scored.
    With compact positions every archived token is scored: a question whose scores fit ``SCAN_BYTES`` is
    scored once, not read, rotated and scored a second time (the plan, ``memory.recall_scratch_bytes``,
    already holds ``SCAN_BYTES`` for its planned question).
    """
    fits = SCAN_BYTES // (4 * q.shape[0] * q.shape[1])
    return max(g.archive.page_size, fits if compact else min(SCAN, fits))  # type: ignore[union-attr]


def _candidates(cache: BoundedCache, work: list[tuple[int, HeadGroup, Tensor]], holds: list[int]) -> list[Tensor]:
    """The pages each group scores exactly, [h, k] on the host: all of them, or with absolute positions past
    its ``hold`` the ones Quest's bound ranks best (``GroupArchive.candidate_pages``' choice). The bounds are
    computed on the device for every group first and read back with one copy."""
    pages: list[Tensor | None] = []
    best: list[Tensor] = []
    for (_, g, q), hold in zip(work, holds, strict=True):
        a = g.archive
        assert a is not None
        # Quest's bound needs the queries and the summaries in one frame: absolute positions only
        if cache.compact or a.length <= hold:
            pages.append(torch.arange(a.pages).expand(a.h, -1))
        else:
            pages.append(None)
            best.append(a.candidate_pages(q, hold))
    if best:
        back = iter(torch.cat([b.flatten() for b in best]).cpu().split([b.numel() for b in best]))
        shapes = iter([b.shape for b in best])
        pages = [p if p is not None else next(back).view(next(shapes)) for p in pages]
    return pages  # type: ignore[return-value]


def _rankings(relevance: Tensor, own: dict[int, Tensor], by_layer: bool
              ) -> tuple[tuple[Tensor, Tensor], dict[int, tuple[Tensor, Tensor]], dict[int, Tensor]]:
    """The shared ranking and, with ``by_layer``, each layer's own (``--recall-select layer``), each as (host,
    device) tensors, and each layer's relevance on the host: computed on the device, read back with one copy."""
    layers = sorted(own)
    rows = [passage_ranking(relevance)] + [passage_ranking(own[li]) for li in layers if by_layer]
    stacked = torch.stack(rows + [own[li] for li in layers])
    host = stacked.cpu()
    ranking = (host[0], stacked[0])
    layer_ranking = {li: (host[1 + i], stacked[1 + i]) for i, li in enumerate(layers)} if by_layer else {}
    return ranking, layer_ranking, {li: host[len(rows) + i] for i, li in enumerate(layers)}


def passage_ranking(relevance: Tensor) -> Tensor:
    """The order archived positions are recalled in: a position's passage relevance (the best within
    ``SPAN`` of it), and inside one passage the matching tokens themselves first."""
    before, after = SPAN
    best = F.max_pool1d(F.pad(relevance.view(1, 1, -1), (after, before)), before + after + 1, stride=1).view(-1)
    return best + TIE * relevance


def _kept_logsumexp(g: HeadGroup, q: Tensor, scaling: float) -> Tensor:
    """log Σ exp(scaled q·k) over the group's kept tokens, per query row: [h, r, 1] float32.

    Scored ``SCORE_BYTES`` at a time (a chunk of kept keys as float32, on the queries' device), never as one
    [h, r, kept] matrix: with an 8B model's 8K-token budget and a 500-token question that would be 0.5 GB.
    """
    keys = g.stored_keys()
    h, r = q.shape[0], q.shape[1]
    step = max(1, SCORE_BYTES // (4 * h * max(r, 1)))
    z = torch.full((h, r, 1), -float("inf"), device=q.device)
    for a in range(0, keys.shape[1], step):
        scores = torch.bmm(q, keys[:, a : a + step].float().transpose(1, 2)).mul_(scaling)
        z = torch.logaddexp(z, torch.logsumexp(scores, dim=2, keepdim=True))
    return z


def _attention(g: HeadGroup, q: Tensor, chunks: Callable[[], Iterator[tuple[Tensor, Tensor]]], scaling: float,
               hold: int, pool: str = "max") -> Iterator[tuple[Tensor, Tensor]]:
    """Each scored token's attention probability, maximised over the question rows (``pool="sum"``: summed).

    ``chunks()`` yields (positions [h, a], scores [h, r, a]) of the archived tokens; this yields
    (positions, probabilities [h, a]) for the same chunks. The softmax runs over the kept tokens and
    every scored one, so a head that attends to its kept tokens anyway lends the archive little. Its
    normaliser needs every score first: up to ``hold`` tokens' scores are kept from the first pass,
    past that they are computed again (``chunks()`` a second time) — exact either way, in memory
    bounded by ``hold``. Scores are consumed in place; the kept tokens' are summed in chunks.
    """
    z = _kept_logsumexp(g, q, scaling)  # [h, r, 1]
    held: list[tuple[Tensor, Tensor]] = []
    count = 0
    for positions, scores in chunks():
        z = torch.logaddexp(z, torch.logsumexp(scores.mul_(scaling), dim=2, keepdim=True))
        count += scores.shape[2]
        if count <= hold:
            held.append((positions, scores))
        else:
            held.clear()  # too many to hold: freed now, computed again below
    again = held if count <= hold else ((p, s.mul_(scaling)) for p, s in chunks())
    for positions, scores in again:
        probs = scores.sub_(z).exp_()
        yield positions, probs.sum(1) if pool == "sum" else probs.amax(1)
