"""A session: model + tokenizer + settings, and the operations every command is made of.

    Session(settings) → read(document) → cache (snapshot) → answer(question) → restore → answer(...)

Settings are already merged (profile ⊕ flags) and validated; the session resolves what needs the
model (byte budgets, the policy's head layout, razor calibration) and owns the memory meter.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from kvtool.config import kvtool_home, recall_selection
from kvtool.core import recall
from kvtool.core.cache import BoundedCache
from kvtool.core.engine import Engine, EngineConfig, model_env
from kvtool.core.events import Listener, Note, PrefillProgress
from kvtool.core.sampling import Chooser
from kvtool.core.timing import PARTS
from kvtool.documents import Document
from kvtool.errors import UsageError, first_line
from kvtool.policies import Policy, build_policy, check_policy
from kvtool.runtime import prompt
from kvtool.runtime.archive_disk import DiskWatch, archive_dir, fits
from kvtool.runtime.budget import resolve_budget_and_recall
from kvtool.runtime.citations import AnswerMass, Citation, SourceMap, cite, prune_source
from kvtool.runtime.cores import process_share
from kvtool.runtime.detokenize import Detokenizer, letter_tokens
from kvtool.runtime.document import estimate_tokens, iter_token_blocks, rechunk
from kvtool.runtime.events import CalibrationProgress, DecodeStarting
from kvtool.runtime.memory import dims_from_config, format_bytes
from kvtool.runtime.model import LoadedModel, load_model, resolve_dtype, set_threads, usable_cores
from kvtool.runtime.settings import TABLE_BLOCK, Settings, default_block_size


def _weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` as a callable that does not keep its object alive.

    The engine and the policy environment hold the session's callbacks; a bound method would make
    session → engine → method → session a cycle, and the session's last read (a dense cache is
    hundreds of MB) would then outlive the session until Python's cyclic GC happens to run.
    """
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        assert bound is not None, "a session callback used after its session was freed"
        return bound(*args, **kwargs)

    return call


@dataclass
class Answer:
    question: str
    answer: str
    tokens: int
    seconds: float
    prompt_tokens: int = 0
    citations: list[Citation] | None = None  # with ``cite``: the document spans the answer drew on
    cite_seconds: float = 0.0  # time spent ranking citations after decoding
    ids: list[int] = field(default_factory=list)  # the generated token ids (eval agreement teacher-forces them)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class ReadResult:
    """A document read into a bounded cache (and what it cost)."""

    cache: BoundedCache
    document_tokens: int
    prefix_tokens: int
    seconds: float
    sha256: str = ""
    name: str = ""
    snapshot: Any = field(default=None, repr=False)
    loaded_from: str | None = None  # a .kvc file: ``seconds`` is then the original prefill's time
    load_seconds: float = 0.0
    source: SourceMap | None = field(default=None, repr=False)  # document tokens → characters (citations)
    fmt: str = "text"
    notes: list[str] = field(default_factory=list)

    def close(self) -> None:
        """Release the read's files now (its recall archive's descriptors and disk blocks); the cache's
        stored tokens stay usable for stats, but recall is off for it afterwards. Releasing the read
        does the same later; callers that are done with a read call this so nothing waits on the GC."""
        recall.close(self.cache)

    def __enter__(self) -> ReadResult:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Session:
    """Loads the model once and runs reads and answers with one policy and budget."""

    def __init__(
        self,
        settings: Settings,
        listener: Listener | None = None,
        say: Callable[[str], None] | None = None,
        loaded: LoadedModel | None = None,
    ) -> None:
        self.settings = settings
        self.calibration: dict[str, Any] | None = None
        self.say = say or (lambda s: None)
        self.listener = listener
        if loaded is None:  # fail fast on bad options, before seconds of model loading
            check_policy(settings.policy, settings.policy_options)
            if settings.parsed_budget.tokens is not None and settings.policy.strip().lower() != "full":
                EngineConfig(budget=settings.parsed_budget.tokens, block_size=settings.block_size or TABLE_BLOCK,
                             sinks=settings.sinks, recent=settings.recent, positions=settings.positions).validate()
        self.threads = set_threads(settings.threads, self.say)
        self.loaded = loaded or load_model(settings.model, settings.device, settings.dtype, settings.quantize,
                                           progress=self.say, phase=self.emit if listener else None)
        self._share_cores()
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.dims = dims_from_config(self.model.config)
        settings = self._resolve_sizes()
        # recall needs an archive, which only a bounded cache fills (``full`` evicts nothing); ``auto``
        # archives unless the disk is short, decided per read (``_auto_recall``)
        self.recall_mode = "off" if not self.recall_tokens else "auto" if settings.recall == "auto" else "set"
        self.recall_note: str | None = None  # why ``auto`` recalls or not, for the dashboard and the stats
        # an unlinked file there: KVTOOL_ARCHIVE_DIR, else the system's temporary directory (TMPDIR)
        self.archive_dir = archive_dir()
        self.recall_seconds = 0.0
        self.recalled_pages = 0
        self.recalled_tokens_max = 0
        self.engine_config = EngineConfig(
            budget=self.budget_tokens,
            block_size=settings.block_size,
            sinks=settings.sinks,
            recent=settings.recent,
            positions=settings.positions,
            recall=self.recall_tokens,
            page_size=settings.recall_page,
            recall_placement=settings.recall_placement,
            recall_select=settings.recall_select,
            archive_dtype=None if settings.archive_dtype == "auto" else torch.int8 if settings.archive_dtype == "int8"
            else resolve_dtype(settings.archive_dtype, self.loaded.device),
            archive_dir=self.archive_dir if self.recall_tokens else None,
            kv_dtype=settings.kv_dtype,
        )
        self.engine_config.validate()
        if self.recall_mode == "set":
            stored = settings.archive_dtype if settings.archive_dtype != "auto" else str(self.loaded.dtype).replace(
                "torch.", "")
            self.say(f"recall: {self.recall_tokens} tokens per KV head; evicted tokens archived in {self.archive_dir} "
                     f"(unlinked temporary file), {stored}, pages of {settings.recall_page} tokens")
        env = model_env(self.model, self.engine_config, retrieval_heads=_weakly(self._retrieval_heads))
        self.policy: Policy = build_policy(settings.policy, settings.policy_options, env)
        self._reading: Document | None = None
        relay = _weakly(self._relay) if listener else None
        self.engine = Engine(self.model, self.policy, self.engine_config, listener=relay, env=env,
                             pacer=self.share.rebalance if self.share is not None else None)
        self.eos = prompt.eos_ids(self.tokenizer, self.model.config, getattr(self.model, "generation_config", None))
        if not prompt.has_chat_template(self.tokenizer):
            self.say(prompt.base_model_note(self.loaded.name))
        self._letters: Tensor | None = None  # which tokens spell a letter (the repeat guard's), once per model
        self.last_read: ReadResult | None = None
        self.answers: list[Answer] = []
        # many documents in one run (kvtool/runtime/many.py): each read empties and refills one cache, and
        # writes its snapshot over the last one's
        self.reuse_cache = False
        # a diagnosis (``kvtool eval needle --diagnose``): the source map keeps every document token, so that an
        # evicted needle's positions are known even without an archive
        self.keep_source = False
        self._spare: BoundedCache | None = None
        self._snapshot_store: dict[str, Tensor] = {}

    # -- set-up -----------------------------------------------------------------------------------
    def _share_cores(self) -> None:
        """Without --threads, share the cores with the other kvtool processes running now (runtime/cores.py)."""
        settings = self.settings
        self.share = process_share() if settings.threads is None and self.loaded.device.type == "cpu" else None
        if self.share is not None:
            self.share.rebalance()
            self.threads = self.share.threads
        if self.loaded.device.type == "cpu":
            shared = self.share.peers if self.share is not None else 0
            peers = f"; {shared} other kvtool process(es) share them" if shared else ""
            self.say(f"threads: {self.threads} (of {usable_cores()} usable cores"
                     f"{', --threads' if settings.threads is not None else ''}{peers})")

    def _resolve_sizes(self) -> Settings:
        """The budget, recall's tokens and the block for this model and device; the settings with the block set.

        A byte budget holds the kept and the recalled tokens together; ``full`` has no budget and recalls
        nothing; ``--block-size auto`` is chosen for the device (``settings.default_block_size``)."""
        settings = self.settings
        self.budget_tokens, self.recall_tokens, self.budget_note = resolve_budget_and_recall(
            settings, self.dims, self.loaded.dtype)
        self.block_auto = settings.block_size is None
        self.block_note: str | None = None
        if settings.block_size is None:
            settings = self.settings = dataclasses.replace(
                settings, block_size=default_block_size(self.loaded.device.type, self.budget_tokens))
            if self.loaded.device.type == "cuda":
                self.block_note = (f"block {settings.block_size} tokens (auto on a GPU: up to a quarter of the budget; "
                                   "--block-size to choose)")
        return settings

    @property
    def kv_dtype(self) -> str:
        """How the cache stores K/V (``--kv-dtype``; ``auto`` is the model's dtype)."""
        kv = self.settings.kv_dtype
        return str(self.loaded.dtype).replace("torch.", "") if kv == "auto" else kv

    def _chooser(self, logits: Tensor, max_new_tokens: int) -> Chooser:
        """One answer's token chooser; the repeat guard's table of letter tokens is built on first use."""
        s = self.settings
        if s.no_repeat_ngram > 0 and self._letters is None:
            self._letters = letter_tokens(self.tokenizer, logits.shape[-1], logits.device)
        return Chooser(max_new_tokens, logits.device, s.temperature, s.top_p, s.seed, s.repetition_penalty,
                       s.no_repeat_ngram, self._letters)

    def _retrieval_heads(self, induction_frac: float = 0.14, echo_frac: float = 0.01) -> dict[int, list[int]]:
        """RazorAttention's head map: calibrated once per model and reused (kvtool/policies/razor/calibrate.py)."""
        from kvtool.policies.razor.calibrate import calibrate

        self.calibration = calibrate(
            self.model,
            identity=self.loaded.identity,
            name=self.loaded.name,
            home=kvtool_home(),
            induction_frac=induction_frac,
            echo_frac=echo_frac,
            exclude_ids=list(self.tokenizer.all_special_ids),
            progress=lambda done, total: self.emit(CalibrationProgress(done, total)),
        )
        return {int(k): list(v) for k, v in self.calibration["kv_heads"].items()}

    # -- reading --------------------------------------------------------------------------------------
    def read(self, doc: Document) -> ReadResult:
        """Prefill the chat prefix and the document, block by block; snapshot the cache."""
        for note in (self.budget_note, self.block_note):
            if note:
                self.emit(Note(note))
        cache = self.new_cache()
        prefix = torch.tensor(prompt.prefix_ids(self.tokenizer), dtype=torch.long)
        watch = self._auto_recall(cache, estimate_tokens(doc), prefix.numel())
        source = SourceMap(first_position=prefix.numel())
        bs = self.settings.block_size
        blocks = rechunk(itertools.chain([prefix], iter_token_blocks(doc, self.tokenizer, bs, source)), bs)

        def expected() -> int | None:
            n = estimate_tokens(doc)
            return None if n is None else n + prefix.numel()

        def pruned(blocks: Iterator[Tensor]) -> Iterator[Tensor]:
            """Forget the source of tokens every head evicted, every few dozen blocks (bounded map; kept while
            an archive can recall them: ``prune_source``); with ``--recall auto``, drop the archive if the
            disk runs short."""
            disk_watch = watch
            for block in blocks:
                if source.pending_tokens > max(PRUNE_BLOCKS * bs, source.positions.numel()):
                    prune_source(source, cache, self.keep_source)
                if disk_watch is not None:
                    short = disk_watch.short(recall.archive_bytes(cache))
                    if short is not None:
                        self._recall_off(cache, f"recall off from token {cache.seen:,}: {short}")
                        disk_watch = None
                yield block

        t0 = time.perf_counter()
        self._reading = doc
        try:
            self.engine.feed(cache, pruned(blocks), total=expected, logits_rows=0)  # a question follows
        finally:
            self._reading = None
        seconds = time.perf_counter() - t0
        prune_source(source, cache, self.keep_source)
        for note in doc.notes:
            self.emit(Note(note))
        result = ReadResult(
            cache=cache,
            document_tokens=doc.tokens,
            prefix_tokens=prefix.numel(),
            seconds=seconds,
            sha256=doc.sha256,
            name=doc.name,
            source=source,
            fmt=doc.fmt,
            notes=doc.notes,
        )
        result.snapshot = self.snapshot(cache)
        self.last_read = result
        return result

    def snapshot(self, cache: BoundedCache) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """``cache``'s post-document snapshot; with ``reuse_cache`` written over the last one's buffers (a read is
        then valid until the next one): a run over many documents holds one snapshot."""
        return cache.snapshot(self._snapshot_store if self.reuse_cache else None)

    def new_cache(self) -> BoundedCache:
        """The empty cache a document is read (or a ``.kvc`` loaded) into: with ``reuse_cache`` the run's one cache,
        emptied to a new one's state (``Engine.reuse_cache``), else a new one. With ``--recall auto``, one without
        an archive (and a line saying why) when the archive cannot be created (an unwritable directory, too few
        descriptors) instead of an error. Recall starts again too: a disk that ran short turned it off for its
        document only."""
        self.recall_tokens = self.engine_config.recall
        self.recall_note = None
        spare = self._spare

        def make() -> BoundedCache:
            return self.engine.reuse_cache(spare) if spare is not None else self.engine.new_cache()

        try:
            cache = make()
        except UsageError as e:
            if self.recall_mode != "auto" or e.field != "recall":
                raise
            recall_tokens, self.engine_config.recall = self.engine_config.recall, 0
            try:
                cache = make()
            finally:
                self.engine_config.recall = recall_tokens
            self._recall_off(cache, f"recall off: {first_line(e)}")
        if self.reuse_cache:
            self._spare = cache
        return cache

    def _auto_recall(self, cache: BoundedCache, expected: int | None, prefix: int) -> DiskWatch | None:
        """``--recall auto``: keep the new cache's archive if it fits the archive directory (predicted
        from the document's estimated length), and watch the disk while reading; else recall off."""
        if self.recall_mode != "auto" or not recall.archives(cache):
            return None
        where = self.archive_dir
        if expected is None:
            self.recall_note = f"recall {self.recall_tokens} tokens per KV head (default); length unknown: " \
                               f"the archive in {where} is watched while reading"
        else:
            evicted = max(0, expected + prefix - min(g.capacity or 0 for g in recall.recallable_groups(cache)))
            ok, why = fits(evicted * recall.bytes_per_token(cache), where)
            if not ok:
                self._recall_off(cache, f"recall off: {why}; set KVTOOL_ARCHIVE_DIR to a larger disk or "
                                        f"--recall {self.recall_tokens} to archive anyway")
                return None
            self.recall_note = f"recall {self.recall_tokens} tokens per KV head (default): {why}"
        self.emit(Note(self.recall_note))
        return DiskWatch(where)

    def _recall_off(self, cache: BoundedCache, why: str) -> None:
        recall.close(cache)
        self.recall_tokens = 0
        self.recall_note = why
        self.emit(Note(why))

    def _relay(self, event: Any) -> None:
        """The engine's events to the listener; prefill progress learns the pages/chapters read so far."""
        doc = self._reading
        if doc is not None and isinstance(event, PrefillProgress):
            event.parts_done, event.parts_total, event.parts_unit = doc.parts_done, doc.parts_total, doc.unit
        self.emit(event)

    def emit(self, event: Any) -> None:
        if self.listener is not None:
            self.listener(event)

    # -- answering ---------------------------------------------------------------------------------------
    def answer(
        self,
        read: ReadResult,
        suffix_prompt: prompt.Rendered,
        label: str,
        on_text: Callable[[str], None] | None = None,
        max_new_tokens: int | None = None,
        cite_spans: bool = False,
        focus: str | None = None,
    ) -> Answer:
        """Restore the post-document cache, feed the pinned suffix, decode; the cache keeps evicting.

        ``cite_spans``: also find the document spans the answer attended to (``Answer.citations``).
        ``focus``: the part of the suffix whose queries choose what recall brings back (the question;
        None: the whole suffix, e.g. a summary instruction).
        """
        if cite_spans and read.source is None:
            raise UsageError(f"{read.loaded_from or read.name} has no source map (a .kvc from an older kvtool?); "
                             "prefill it again to use --cite")
        cache, logits, suffix_tokens = self._begin_answer(read, suffix_prompt, max_new_tokens, focus)
        again = self._again(read, suffix_prompt, focus)
        mass = AnswerMass(cache) if cite_spans else None
        if mass is not None and again is not None:  # the second recall rebuilds the cache the mass is kept in
            again = mass.around(again)
        detok = Detokenizer(self.tokenizer)

        def on_token(tok: int) -> None:
            piece = detok.push(tok)
            if piece and on_text is not None:
                on_text(piece)

        max_new_tokens = max_new_tokens or self.settings.max_new_tokens
        choose = self._chooser(logits, max_new_tokens)
        if mass is not None:
            mass.start()
        self.emit(DecodeStarting(label))
        try:
            ids, seconds = self.engine.generate(cache, logits, max_new_tokens, self.eos, choose, on_token,
                                                read_every=1 if on_text is not None else None, again=again)
        finally:
            positions, weights = mass.stop() if mass is not None else (None, None)
        cache.pin_start = cache.pin_end = None
        ans = Answer(question=label, answer=detok.text().strip(), tokens=len(ids), seconds=seconds,
                     prompt_tokens=suffix_tokens, ids=list(ids))
        if read.source is not None and positions is not None and weights is not None:
            t0 = time.perf_counter()
            ans.citations = cite(read.source, positions, weights, self.tokenizer)
            ans.cite_seconds = time.perf_counter() - t0
        self.answers.append(ans)
        return ans

    def _again(self, read: ReadResult, suffix: prompt.Rendered,
               focus: str | None) -> Callable[[list[int]], Tensor] | None:
        """``--recall-select again`` (``Engine.recall_again``); None when recall is off for this answer or not asked."""
        archived = recall.archived_per_head(read.cache)
        if not self.recall_tokens or "again" not in recall_selection(self.engine_config.recall_select, archived):
            return None
        rows = prompt.focus_rows(self.tokenizer, suffix, focus) if focus else None
        return self.engine.recall_again(read.cache, prompt.encode(self.tokenizer, suffix),
                                        lambda: read.cache.restore(read.snapshot), rows,
                                        lambda result: self._count_recall(read.cache, result))

    def _begin_answer(self, read: ReadResult, suffix_prompt: prompt.Rendered, max_new_tokens: int | None = None,
                      focus: str | None = None) -> tuple[BoundedCache, Tensor, int]:
        """Restore the post-document cache and feed the pinned suffix (with recall when it is on).

        Returns (cache, the suffix's logits, suffix length); the question stays pinned until the caller
        clears ``cache.pin_start``.
        """
        cache = read.cache
        suffix = torch.tensor(prompt.encode(self.tokenizer, suffix_prompt), dtype=torch.long)
        rows = prompt.focus_rows(self.tokenizer, suffix_prompt, focus) if focus else None
        if focus and rows is None and self.recall_tokens:
            self.emit(Note("recall: the question is not verbatim in the chat template's prompt; every prompt row "
                           "ranks the archive (the template's rows can outrank the question's)"))
        logits, recalled = self.engine.feed_question(cache, suffix, lambda: cache.restore(read.snapshot),
                                                     max_new_tokens or self.settings.max_new_tokens, rows)
        self._count_recall(cache, recalled)
        return cache, logits, suffix.numel()

    def _count_recall(self, cache: BoundedCache, recalled: recall.RecallResult | None) -> None:
        if recalled is not None:
            self.recall_seconds += recalled.seconds
            self.recalled_pages += recalled.pages
            self.recalled_tokens_max = max(self.recalled_tokens_max, recalled.tokens)
            self.emit(Note(f"recall: {recalled.pages:,} pages, {recalled.tokens} tokens per KV head in "
                           f"{recalled.seconds:.2f} s (archive {format_bytes(recall.archive_bytes(cache))})"))

    def forced_logits(self, read: ReadResult, question: str, forced: list[int]) -> Tensor:
        """Next-token logits [len(forced), V] (float32, CPU) while teacher-forcing ``forced`` as the answer.

        Row i is the distribution the model gives the i-th answer token after the question and the
        forced tokens before it: ``eval agreement`` compares these rows between ``full`` and a policy on
        the *same* context (the dense answer), so KL and top-1 measure what eviction changed.
        """
        if not forced:
            raise ValueError("nothing to force")
        cache, logits, _ = self._begin_answer(read, prompt.question_suffix(self.tokenizer, question), len(forced),
                                              question)
        rows = [logits[-1].float().cpu()]
        for step in self.engine.steps(cache, torch.tensor(forced[:-1], dtype=torch.long), block_size=1):
            rows.append(step[-1].float().cpu())
        cache.pin_start = None
        return torch.stack(rows)

    def reset_counters(self) -> None:
        """Start the answer and recall figures of :meth:`stats` again: a run over many documents reports
        each answer's own, not the sum over every document before it."""
        self.answers = []
        self.recall_seconds = 0.0
        self.recalled_pages = 0
        self.recalled_tokens_max = 0

    def ask(self, read: ReadResult, question: str, on_text: Callable[[str], None] | None = None,
            cite_spans: bool = False) -> Answer:
        if not question.strip():
            raise UsageError("empty question")
        return self.answer(read, prompt.question_suffix(self.tokenizer, question), question, on_text,
                           cite_spans=cite_spans, focus=question)

    def summarize(self, read: ReadResult, length: str, on_text: Callable[[str], None] | None = None) -> Answer:
        if length not in prompt.SUMMARY_LENGTHS:
            raise UsageError(f"--length must be one of {', '.join(prompt.SUMMARY_LENGTHS)} (got {length!r})")
        return self.answer(read, prompt.summary_suffix(self.tokenizer, length), f"summary ({length})", on_text)

    # -- reporting ------------------------------------------------------------------------------------------
    def stats(self, read: ReadResult | None = None, peak_bytes: int | None = None) -> dict[str, Any]:
        """The ``--json`` stats object (docs/cli.md documents every key; tests/test_docs.py checks it)."""
        read = read or self.last_read
        cache = read.cache if read else None
        dec_tokens = sum(a.tokens for a in self.answers)
        dec_seconds = sum(a.seconds for a in self.answers)
        c = cache.counters if cache else None
        out: dict[str, Any] = {
            "model": self.loaded.name,
            "policy": self.policy.spec,
            "policy_options": {k: v for k, v in self.policy.options().items() if _jsonable(v)},
            "budget": self.budget_tokens,
            "block_size": self.settings.block_size,
            "sinks": self.settings.sinks,
            "recent": self.settings.recent,
            "device": str(self.loaded.device),
            "dtype": str(self.loaded.dtype).replace("torch.", ""),
            "quantize": self.loaded.quantize,
            "kv_dtype": self.kv_dtype,
            "kv_bytes_per_token": cache.kv_bytes_per_token() if cache else None,
            "document_tokens": read.document_tokens if read else 0,
            "prefix_tokens": read.prefix_tokens if read else 0,
            "cached_tokens_max": c.max_cached if c else 0,
            "stored_tokens_max": c.max_stored if c else 0,
            "evicted_tokens": c.evicted_tokens if c else 0,
            "prefill_seconds": round(read.seconds, 4) if read else 0.0,
            "prefill_tokens_per_second": round((read.document_tokens + read.prefix_tokens) / read.seconds, 2)
            if read and read.seconds > 0
            else 0.0,
            "decode_tokens": dec_tokens,
            "decode_tokens_per_second": round(dec_tokens / dec_seconds, 2) if dec_seconds > 0 else 0.0,
            "kv_cache_bytes": cache.allocated_bytes() if cache else 0,
            "kv_cache_bytes_by_layer_kind": _bytes_by_layer_kind(cache),
            "kv_cache_stored_bytes": cache.stored_bytes() if cache else 0,
            "kv_budget_bytes": cache.promised_bytes() if cache else None,
            "peak_memory_bytes": peak_bytes if peak_bytes is not None else self.engine.meter.peak_bytes(),
            "positions": self.settings.positions,
            "threads": self.threads,
            # fewest threads this process ran with while sharing the cores with other kvtool processes
            "threads_min": self.share.min_threads if self.share is not None else self.threads,
            "compact_since_token": cache.compact_since if cache and cache.compact else None,
            # device time on a GPU (events), read once here, at the end
            "time_split_seconds": {k: round(v, 4) for k, v in cache.timer.totals(wait=True).items()
                                   if k in PARTS}
            if cache
            else {},
            "model_load_seconds": round(self.loaded.load_seconds, 3),
        }
        out.update(self.recall_stats(cache))
        if read is not None and read.loaded_from:
            out["loaded_from"] = read.loaded_from
            out["cache_load_seconds"] = round(read.load_seconds, 4)
        split = getattr(self.policy, "budget_split", None)
        if callable(split) and self.budget_tokens is not None:
            out["budget_split"] = split(self.engine.env)
        if self.budget_note:
            out["budget_conversion"] = self.budget_note
        return out

    def recall_stats(self, cache: BoundedCache | None) -> dict[str, Any]:
        """Recall's part of the stats: budget, archive size and place, time and pages recalled."""
        return {
            "recall_tokens": self.recall_tokens,
            "recall_mode": self.recall_mode,  # auto (the default), set (--recall N) or off
            "recall_kv_bytes": recall.kv_bytes(cache, self.recall_tokens) if cache is not None else 0,
            "recall_note": self.recall_note,
            "archive_bytes": recall.archive_bytes(cache) if cache is not None else 0,
            "archived_tokens": recall.archived_tokens(cache) if cache is not None else 0,
            "archive_path": str(self.archive_dir) if self.recall_tokens else None,  # its (unlinked) files' directory
            "archive_dtype": recall.archive_dtype(cache) if cache is not None else None,
            "recall_page": self.engine_config.page_size,
            "recall_placement": self.engine_config.recall_placement,
            "recall_select": self.engine_config.recall_select,
            "recall_seconds": round(self.recall_seconds, 4),
            "recalled_pages": self.recalled_pages,
            "recalled_tokens_max": self.recalled_tokens_max,
        }


def _bytes_by_layer_kind(cache: Any) -> dict[str, int]:
    """Allocated K/V bytes of global (budgeted) and sliding-window layers (hybrid models)."""
    out = {"global": 0, "sliding": 0}
    for g in cache.groups() if cache else []:
        out["global" if g.window is None else "sliding"] += g.allocated_bytes()
    return out


#: the source map forgets evicted tokens once this many blocks of new tokens are in it
PRUNE_BLOCKS = 32


def _jsonable(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))
