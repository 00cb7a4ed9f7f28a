"""The block loop: feed tokens in blocks, evict after every block, decode with blocks of one.

    feed(block) → BoundedCache.update appends K/V → kvtool_attention attends and evicts per layer
               → next block

Peak memory is independent of the document length: the cache holds at most ``capacity + block``
tokens per KV head in preallocated buffers, attention scratch is one layer × one block, and logits
are computed for the last token only (unless a caller asks for every row, as perplexity does).
The engine knows nothing about any particular policy: it asks the policy for its head layout
(``layer_groups``) and the cache/attention function do the rest. Sliding-window layers of hybrid
models are laid out by ``core/families.py`` instead (window eviction, no policy, no budget).
"""

from __future__ import annotations

import inspect
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kvtool.config import (
    AGAIN_AFTER,
    DEFAULT_RECALL_PLACEMENT,
    DEFAULT_RECALL_SELECT,
    RECALL_PLACEMENTS,
    recall_selection,
)
from kvtool.core import attention, recall
from kvtool.core.archive import DEFAULT_PAGE_SIZE
from kvtool.core.archive_stores import FILES_PER_GROUP, FileStore, MemoryStore, reserve_descriptors
from kvtool.core.cache import BoundedCache
from kvtool.core.contract import Policy, PolicyEnv
from kvtool.core.decode_step import DecodeStep, moves_positions, unsupported
from kvtool.core.events import DecodeProgress, Listener, Note, PrefillProgress
from kvtool.core.families import check_supported, window_specs
from kvtool.core.layout import layer_windows, text_config
from kvtool.core.meter import MemoryMeter
from kvtool.core.positions import Rotator
from kvtool.core.quant import codec_for
from kvtool.core.sampling import Chooser
from kvtool.core.timing import time_split
from kvtool.errors import UsageError

POSITION_MODES = ("absolute", "compact", "auto")
#: how tokens are decoded: the fixed-shape step, captured as a CUDA graph on a GPU ("capture") or always run
#: eagerly ("eager"), or a block of one token through the block path ("blocks": the step's reference)
DECODE_STEPS = ("capture", "eager", "blocks")
#: tokens decoded between two reads of the answer on an accelerator when nothing streams it (``--json``): a read
#: waits for the device, so the host stops queueing work; the price is at most this many − 1 steps past the end
READ_EVERY = 8


@dataclass
class EngineConfig:
    """Engine options that apply to every policy."""

    budget: int | None  # tokens per KV head and layer (None: unbounded, policy ``full``)
    block_size: int = 128
    sinks: int = 4  # first S tokens are never evicted
    recent: int = 8  # last R tokens are never evicted
    positions: str = "auto"  # absolute | compact | auto
    sync_timing: bool = False  # synchronise CUDA around timers (benchmarks)
    recall: int = 0  # tokens per KV head a question may bring back from the archive (0: no archive)
    page_size: int = DEFAULT_PAGE_SIZE  # archive page size in tokens
    recall_placement: str = DEFAULT_RECALL_PLACEMENT  # compact positions: recalled passages by relevance or in order
    recall_select: str = DEFAULT_RECALL_SELECT  # how recall chooses (``config.recall_selection``)
    archive_dtype: torch.dtype | None = None  # dtype of archived K/V (None: the cache's)
    archive_dir: str | None = None  # where the archive file lives (None: host memory)
    kv_dtype: str = "auto"  # how the cache stores K/V: auto (the compute dtype), a float dtype, int8, int4
    decode_step: str = "capture"  # DECODE_STEPS

    def validate(self) -> None:
        if self.block_size < 1:
            raise UsageError(f"block size must be at least 1 (got {self.block_size})", field="block_size")
        if self.sinks < 0 or self.recent < 0:
            raise UsageError("sinks and recent must be non-negative", field="sinks")
        if self.budget is not None and self.budget < self.sinks + self.recent + 1:
            raise UsageError(
                f"budget {self.budget} is too small: it must exceed sinks + recent = {self.sinks + self.recent}",
                field="budget")
        if self.positions not in POSITION_MODES:
            raise UsageError(f"positions must be one of {', '.join(POSITION_MODES)} (got {self.positions!r})",
                             field="positions")
        if self.recall < 0:
            raise UsageError(f"recall must be non-negative (got {self.recall})", field="recall")
        if self.page_size < 1:
            raise UsageError(f"archive page size must be at least 1 (got {self.page_size})", field="page_size")
        if self.decode_step not in DECODE_STEPS:
            raise UsageError(f"decode step must be one of {', '.join(DECODE_STEPS)} (got {self.decode_step!r})",
                             field="decode_step")
        if self.recall_placement not in RECALL_PLACEMENTS:
            raise UsageError(f"recall placement must be one of {', '.join(RECALL_PLACEMENTS)} "
                             f"(got {self.recall_placement!r})", field="recall_placement")
        recall_selection(self.recall_select)


def model_env(model: torch.nn.Module, config: EngineConfig, **extra: Any) -> PolicyEnv:
    """The model facts a policy may use when it is built."""
    c = text_config(model.config)  # multimodal wrappers (Gemma 3 ≥ 4B): the language model's config
    heads = c.num_attention_heads
    return PolicyEnv(
        num_layers=c.num_hidden_layers,
        num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
        num_attention_heads=heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        budget=config.budget,
        block_size=config.block_size,
        sinks=config.sinks,
        recent=config.recent,
        **extra,
    )


class Engine:
    """Streams tokens through ``model`` under ``policy`` with a bounded cache."""

    def __init__(
        self,
        model: torch.nn.Module,
        policy: Policy,
        config: EngineConfig,
        listener: Listener | None = None,
        env: PolicyEnv | None = None,
        pacer: Callable[[], None] | None = None,
    ) -> None:
        config.validate()
        check_supported(model, config.positions)
        self.model = model
        self.cache_keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.policy = policy
        self.config = config
        self.listener = listener
        # Called in the model's thread before every forward (a block or a decoded token): the runtime
        # uses it to share the CPU cores with other kvtool processes (runtime/cores.py). Must be cheap.
        self.pacer = pacer
        # a diagnosis (``kvtool eval needle --diagnose``): the next question's recall fills it; None: nothing kept
        self.recall_trace: recall.RecallTrace | None = None
        self.env = env or policy.env or model_env(model, config)
        attention.register()
        # The registered function falls through to SDPA without the engine's cache: a plain forward of
        # the model keeps working (see core/attention.py).
        model.set_attn_implementation(attention.NAME)
        self.device = next(model.parameters()).device
        # ``logits_to_keep`` for no row: transformers reads the int 0 as every row, an index tensor as rows
        self._no_rows = torch.empty(0, dtype=torch.long, device=self.device)
        self.dtype = _kv_dtype(model)
        self.codec = codec_for(config.kv_dtype, self.dtype, self.env.head_dim)  # None: K/V in ``dtype``
        c = text_config(model.config)
        self.max_positions: int | None = getattr(c, "max_position_embeddings", None)
        self.rotator: Rotator | None = Rotator.from_model(model) if config.positions != "absolute" else None
        self.meter = MemoryMeter(self.device)
        self.windows = layer_windows(c)
        self.layer_specs = [policy.layer_groups(i, self.env) if w is None else window_specs(w, self.env)
                            for i, w in enumerate(self.windows[: self.env.num_layers])]
        self._check_capacities()
        # the fixed-shape decode step (and its graph) of each live cache: weak keys, and a step holds its cache
        # weakly, so a cache's buffers and graph are freed with its last use (the memory plan counts one cache)
        self._decode_steps: weakref.WeakKeyDictionary[BoundedCache, DecodeStep] = weakref.WeakKeyDictionary()
        self._noted: set[str] = set()  # why decoding was eager, said once per engine

    # -- set-up ----------------------------------------------------------------------------------
    def _check_capacities(self) -> None:
        for specs in self.layer_specs:
            for s in specs:
                if s.capacity is None or s.window is not None:  # sliding layers protect nothing
                    continue
                recent = max(self.config.recent, s.policy.protected_recent(s.capacity))
                if s.capacity < self.config.sinks + recent + 1:
                    raise UsageError(
                        f"budget too small for policy {self.policy.spec!r}: a head group of capacity {s.capacity} "
                        f"must exceed sinks {self.config.sinks} + recent window {recent}"
                    )

    def new_cache(self) -> BoundedCache:
        cache = BoundedCache(
            self.layer_specs,
            num_kv_heads=self.env.num_kv_heads,
            num_attention_heads=self.env.num_attention_heads,
            head_dim=self.env.head_dim,
            block_size=self.config.block_size,
            sinks=self.config.sinks,
            recent=self.config.recent,
            dtype=self.dtype,
            device=self.device,
            positions_mode=self.config.positions,
            max_positions=self.max_positions,
            rotator=self.rotator,
            sync_timing=self.config.sync_timing,
            codec=self.codec,
        )
        self._attach_archive(cache)
        return cache

    def reuse_cache(self, cache: BoundedCache) -> BoundedCache:
        """``cache`` (from ``new_cache``) emptied for another document, its buffers kept, with a new archive
        when recall is on: what ``new_cache`` returns, without allocating the K/V buffers again."""
        recall.close(cache)  # the previous document's archive files go now
        cache.clear()
        self._attach_archive(cache)
        return cache

    def _attach_archive(self, cache: BoundedCache) -> None:
        if self.config.recall > 0:
            where = self.config.archive_dir
            if where is not None:
                reserve_descriptors(FILES_PER_GROUP * sum(recall.recallable(g) for g in cache.groups()))
            recall.attach(cache, self.config.recall, self.config.page_size, self.config.archive_dtype,
                          MemoryStore if where is None else lambda rb: FileStore(rb, where))

    def emit(self, event: Any) -> None:
        if self.listener is not None:
            self.listener(event)

    # -- feeding ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, cache: BoundedCache, ids: Tensor, logits_rows: int = 1) -> Tensor:
        """Feed one block (≤ block size) and return logits of its last ``logits_rows`` tokens (0: none, an empty
        tensor: a document read whose last logits nobody reads skips the vocabulary projection, the size of a
        few layers' weights, once per block). Its time is the timer's "step" section (``cache.timer``)."""
        t0 = cache.timer.start()
        m = ids.shape[-1]
        room = cache.room()
        if m > room:
            # Lazily decoded tokens still occupy the spare region: the block's head fills it (and
            # evicts), the rest then fits. Only after ``generate`` without a restore.
            head = self._forward(cache, ids.reshape(-1)[:room], min(logits_rows, room))
            tail = self._forward(cache, ids.reshape(-1)[room:], min(logits_rows, m - room))
            logits = tail if logits_rows <= m - room else torch.cat([head, tail])
        else:
            logits = self._forward(cache, ids, logits_rows)
        cache.timer.stop("step", t0)
        return logits

    def _forward(self, cache: BoundedCache, ids: Tensor, logits_rows: int) -> Tensor:
        if self.pacer is not None:
            self.pacer()
        m = ids.shape[-1]
        was_compact = cache.compact
        rotary = cache.begin_step(m)
        if cache.compact and not was_compact:
            self.emit(Note(f"positions: switched to compact at token {cache.seen} (model range {self.max_positions})"))
        out = self.model(
            input_ids=self._on_device(ids).view(1, m),
            position_ids=rotary.view(1, m),
            **{self.cache_keyword: cache},  # the name this transformers' forward takes
            use_cache=True,
            logits_to_keep=logits_rows if logits_rows > 0 else self._no_rows,
            kvtool_cache=cache,
        )
        cache.end_step()
        return out.logits[0]

    def _on_device(self, ids: Tensor) -> Tensor:
        """A block's token ids on the model's device without a host sync: a copy from pageable host memory
        blocks the host until the GPU has run everything queued before it, so the ids go through pinned
        memory (torch's caching host allocator: reused, and not handed out again before the copy is done)."""
        if ids.device == self.device:
            return ids
        if self.device.type == "cuda":
            return ids.pin_memory().to(self.device, non_blocking=True)
        return ids.to(self.device)

    def pin(self, cache: BoundedCache, length: int, answer_tokens: int | None = None) -> None:
        """Protect the next ``length`` tokens (a question) until the caller clears ``cache.pin_start``.

        The question is never evicted: it must fit each group's capacity together with everything else that
        is always kept (sinks and the larger of the engine's and the policy's recent window), else this is a
        ``UsageError`` before anything is fed. The answer's own tokens are not pinned: the newest of them
        sit in the recent windows, older ones are evictable like document tokens. While ``answer_tokens``
        (default: a whole window) are generated, the kept set is sinks + the larger of the window and the
        question plus the answer's windowed part; that must fit. RazorAttention's
        compensated (non-retrieval) heads keep only their local window by design and are not checked.
        """
        for g in cache.groups():
            # a sliding layer forgets the question anyway; RazorAttention's compensated heads are exempt by design
            if g.capacity is None or g.window is not None or g.compensation:
                continue
            window = max(self.config.recent, g.policy.protected_recent(g.capacity))
            answer = window if answer_tokens is None else min(answer_tokens, window)
            need = self.config.sinks + max(window, length + answer)
            if need > g.capacity:
                raise UsageError(
                    f"the question ({length} tokens with the chat template) does not fit the budget: a head group "
                    f"holds {g.capacity} tokens and must keep {self.config.sinks} sinks, a {window}-token recent "
                    f"window and the question while answering; raise the budget to at least {need} or shorten it",
                    field="budget")
        cache.pin_start = cache.seen
        cache.pin_end = cache.seen + length  # the answer is not pinned: it may outgrow the budget

    def feed_question(self, cache: BoundedCache, ids: Tensor, restore: Callable[[], None],
                      answer_tokens: int | None = None,
                      focus: slice | tuple[slice, ...] | None = None) -> tuple[Tensor, recall.RecallResult | None]:
        """Restore the post-document cache and feed a pinned question; with recall on, feed it twice.

        The first pass records the question's queries, the archive pages they point at come back
        beside the kept tokens (``kvtool/core/recall.py``), and the second pass lets the question's own
        hidden states see them; ``focus`` picks the rows of ``ids`` whose queries rank the archive
        (the question inside the instruction, and with ``--recall-select again`` the answer's first tokens;
        None: all). Returns the last logits and what was recalled (None: no recall).
        """
        if self.recall_trace is not None:
            self.recall_trace.reset()  # a second recall (``again``) replaces what the first one noted
        restore()
        self._question_frame(cache, ids.numel(), note=True)
        self.pin(cache, ids.numel(), answer_tokens)
        if self.config.recall == 0 or recall.archived_tokens(cache) == 0:
            if self.recall_trace is not None:
                self.recall_trace.hold(cache)
            logits = self.feed(cache, [ids], progress=False)
            assert logits is not None
            return logits, None
        t0 = cache.timer.now()
        log = cache.query_log = recall.QueryLog(cache, focus)  # the layers that recall, the focus rows only
        try:
            self.feed(cache, [ids], progress=False)
        finally:
            cache.query_log = None
        restore()
        self._question_frame(cache, ids.numel())
        result = recall.recall(cache, log, self.config.recall, None, self.config.recall_placement, self.recall_trace,
                               recall_selection(self.config.recall_select) - {"again"})
        self.pin(cache, ids.numel(), answer_tokens)
        result.seconds = cache.timer.now() - t0
        logits = self.feed(cache, [ids], progress=False)
        assert logits is not None
        return logits, result

    def recall_again(self, cache: BoundedCache, suffix: list[int], restore: Callable[[], None], focus: slice | None,
                     counted: Callable[[recall.RecallResult | None], None]) -> Callable[[list[int]], Tensor]:
        """``--recall-select again``: ``generate``'s ``again`` step. The question (``suffix``) and the answer so far
        are fed again with a second recall, the answer's rows voting beside ``focus`` (the question's; None: all
        rows); ``counted`` gets what was recalled."""

        def again(answer: list[int]) -> Tensor:
            rows = None if focus is None else (focus, slice(len(suffix), None))
            logits, recalled = self.feed_question(cache, torch.tensor(suffix + answer, dtype=torch.long), restore,
                                                  None, rows)
            counted(recalled)
            return logits

        return again

    def _question_frame(self, cache: BoundedCache, m: int, note: bool = False) -> None:
        """``--positions auto``: a question that would pass the model's range is fed at compact positions from
        its first token (not from the block that crosses), and again after the restore, so recall scores its
        queries and the archive in one frame and places what it brings back as compact positions do."""
        if cache.rope.prepare(cache.groups(), cache.seen, m) and note:
            self.emit(Note(f"positions: switched to compact at token {cache.seen} for the question "
                           f"(model range {self.max_positions})"))

    def feed(
        self,
        cache: BoundedCache,
        blocks: Iterable[Tensor],
        total: int | Callable[[], int | None] | None = None,
        logits_rows: int = 1,
        progress: bool = True,
    ) -> Tensor | None:
        """Feed token blocks (each ≤ block size; longer tensors are split). Returns the last logits.

        ``total`` (for progress events) may be a callable: a streamed document's length is an
        estimate that improves as it is read.
        """
        start_seen = cache.seen
        logits = None
        t_start = time.perf_counter()
        done = 0
        for block in blocks:
            for step_logits in self.steps(cache, block, logits_rows=logits_rows):
                logits = step_logits
                done = cache.seen - start_seen
                if progress and self.listener is not None:
                    expected = total() if callable(total) else total
                    self.emit(self.progress_event(cache, done, expected, time.perf_counter() - t_start))
        return logits

    def steps(self, cache: BoundedCache, ids: Tensor, block_size: int | None = None,
              logits_rows: int | None = 1) -> Iterator[Tensor]:
        """Feed ``ids`` in blocks of ``block_size`` (default: the engine's), yielding each block's logits.

        The one block loop of kvtool: ``feed``, the evaluators and the tests all go through it.
        ``logits_rows=None`` returns every row of each block (perplexity, dense-equality tests).
        """
        bs = block_size or self.config.block_size
        for start in range(0, ids.shape[-1], bs):
            block = ids[start : start + bs]
            yield self.step(cache, block, block.shape[-1] if logits_rows is None else logits_rows)

    def progress_event(self, cache: BoundedCache, done: int, total: int | None, seconds: float) -> PrefillProgress:
        lengths = cache.lengths()
        c = cache.counters
        split = cache.timer.totals()  # what the device has finished: on a GPU a block or so behind, no wait
        return PrefillProgress(
            tokens_done=done,
            tokens_total=total,
            seconds=seconds,
            cache_min=min(lengths),
            cache_mean=sum(lengths) / len(lengths),
            cache_max=max(lengths),
            evicted_total=c.evicted_tokens,
            memory=self.meter.sample(),
            time_split=time_split(split),
        )

    # -- decoding ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self,
        cache: BoundedCache,
        logits: Tensor,
        max_new_tokens: int,
        eos_ids: set[int],
        choose: Chooser | None = None,
        on_token: Callable[[int], None] | None = None,
        read_every: int | None = None,
        again: Callable[[list[int]], Tensor] | None = None,
    ) -> tuple[list[int], float]:
        """Decode from ``logits`` ([rows, vocab] or [vocab]: the last row is read) with blocks of one token; returns
        (ids, seconds).

        Tokens are chosen on the device (``choose``: greedy by default) and fed back without a host read; the
        answer is read back every ``read_every`` tokens (default: each token on a CPU, where a read costs
        nothing; ``READ_EVERY`` on an accelerator, where it waits for the device), and always before a step that
        evicts. So a read that finds an end token stops the answer exactly: the few steps fed after it changed
        nothing but the lazily decoded tokens and, when citing, no mass (the cache's mass gate closes on an end
        token), and no eviction ever runs on their account.

        Eviction is lazy: generated tokens fill each group's spare block region and one eviction
        per block of tokens brings it back to capacity (at most capacity + block per head at every
        step, at most capacity after every eviction).

        ``again`` (``--recall-select again``): after the answer's first ``AGAIN_AFTER`` tokens, instead of
        feeding the last one, ``again(answer so far)`` restores the cache, recalls once more and feeds the
        question and those tokens again, and returns the logits the answer goes on from.
        """
        out: list[int] = []
        t0 = time.perf_counter()
        logits = logits.view(-1, logits.shape[-1])  # rows of logits, or the last row alone
        choose = choose or Chooser(max_new_tokens, logits.device)
        every = read_every or (1 if self.device.type == "cpu" else READ_EVERY)
        lazy, cache.lazy = cache.lazy, True
        try:
            self._decode(cache, logits, max_new_tokens, eos_ids, choose, on_token, out, t0, every, again)
        finally:
            cache.lazy = lazy
        return out, time.perf_counter() - t0

    def _decode(self, cache: BoundedCache, logits: Tensor, max_new_tokens: int, eos_ids: set[int], choose: Chooser,
                on_token: Callable[[int], None] | None, out: list[int], t0: float, every: int,
                again: Callable[[list[int]], Tensor] | None = None) -> None:
        eos = self._on_device(torch.tensor(sorted(eos_ids), dtype=torch.long)) if cache.citing else None  # no sync
        step = self._decode_step(cache, choose, eos) if again is None else None  # a second recall changes the cache
        if step is not None:
            self._decode_fixed(step, cache, logits, max_new_tokens, eos_ids, eos, on_token, out, t0, every)
            return
        read = 0  # tokens of the answer read back so far
        quiet = cache.quiet_steps()  # single-token steps from here that evict nothing
        for t in range(max_new_tokens):
            tok = choose(logits[-1], t)
            last = t + 1 == max_new_tokens
            turn = again is not None and t + 1 == AGAIN_AFTER
            if last or turn or quiet == 0 or choose.reads_each_token or t + 1 - read >= every:
                if self._read(choose.read(read, t + 1), eos_ids, out, on_token, t0) or last:
                    return
                read = t + 1
            elif eos is not None:
                cache.close_mass_on(tok, eos)  # an unread end token: the steps after it add no citation mass
            if turn:
                assert again is not None
                logits = again(list(out))
                step = self._decode_step(cache, choose, eos, keep=t + 1)  # the cache stays put from here
                if step is not None:
                    self._decode_fixed(step, cache, logits, max_new_tokens, eos_ids, eos, on_token, out, t0, every,
                                       first=t + 1)
                    return
                quiet = cache.quiet_steps()
                continue
            logits = self.step(cache, tok, 1)
            quiet = cache.quiet_steps() if quiet == 0 else quiet - 1

    def _decode_fixed(self, step: DecodeStep, cache: BoundedCache, logits: Tensor, max_new_tokens: int,
                      eos_ids: set[int], eos: Tensor | None, on_token: Callable[[int], None] | None, out: list[int],
                      t0: float, every: int, first: int = 0) -> None:
        """``_decode`` with the fixed-shape step: replayed while nothing evicts; the step that evicts, or moves
        compact positions, takes the block path (``DecodeStep.eager``), host work between steps. ``first``: the
        answer's tokens already chosen and read (``--recall-select again`` hands over after its second recall)."""
        read = first
        quiet = cache.quiet_steps()
        step.start(logits[-1], eos, at=first)
        fixed = True
        for t in range(first, max_new_tokens):
            last = t + 1 == max_new_tokens
            if last or quiet == 0 or t + 1 - read >= every:
                if self._read(step.choose.read(read, t + 1), eos_ids, out, on_token, t0) or last:
                    return
                read = t + 1
            step.ensure_room(t + 1)
            if quiet == 0 or not fixed or moves_positions(cache):
                step.eager(self.step)
                fixed = fixed and step.signature == DecodeStep.key(cache, step.choose, eos)  # a switch to compact
            else:
                step.run()
                if (failure := step.take_failure()) is not None:
                    self._note(f"decode: the step could not be captured ({failure}); decoding eagerly")
            quiet = cache.quiet_steps() if quiet == 0 else quiet - 1

    def _read(self, chosen: list[int], eos_ids: set[int], out: list[int], on_token: Callable[[int], None] | None,
              t0: float) -> bool:
        """Append the answer's tokens read back (the one host read); True at an end token."""
        ended = _read_answer(chosen, eos_ids, out, on_token)
        if self.listener is not None:
            self.emit(DecodeProgress(tokens=len(out), seconds=time.perf_counter() - t0))
        return ended

    def _decode_step(self, cache: BoundedCache, choose: Chooser, eos: Tensor | None,
                     keep: int = 0) -> DecodeStep | None:
        """The fixed-shape step for ``cache`` (the one kept when its buffers are the same: its graph replays), or
        None where the configuration decodes through the block path (noted on an accelerator); ``keep``: the
        answer's first tokens ``choose`` holds, carried into the step's ring."""
        if self.config.decode_step == "blocks":
            return None
        why = unsupported(cache, choose)
        if why is not None:
            if self.device.type != "cpu":
                self._note(f"decode: eager block path ({why})")
            return None
        step = self._decode_steps.get(cache)
        if step is None or step.signature != DecodeStep.key(cache, choose, eos):
            step = self._decode_steps[cache] = DecodeStep(self.model, self.cache_keyword, cache, choose, eos,
                                            capture=self.config.decode_step == "capture")
        step.adopt(choose, keep)
        return step

    def decode_step_of(self, cache: BoundedCache) -> DecodeStep | None:
        """The fixed-shape step ``cache`` decoded with last (None: none yet, or the block path)."""
        return self._decode_steps.get(cache)

    def _note(self, message: str) -> None:
        if message not in self._noted:
            self._noted.add(message)
            self.emit(Note(message))


def _read_answer(chosen: list[int], eos_ids: set[int], out: list[int], on_token: Callable[[int], None] | None) -> bool:
    """Append the tokens ``chosen`` (read back from the device) to ``out`` up to an end token; True at one."""
    for tok in chosen:
        if tok in eos_ids:
            return True
        out.append(tok)
        if on_token is not None:
            on_token(tok)
    return False


def _kv_dtype(model: torch.nn.Module) -> torch.dtype:
    """K/V are stored in the activations' dtype (the model's compute dtype, also under 4/8-bit)."""
    dtype = getattr(model, "dtype", None)
    if dtype in (torch.float32, torch.float16, torch.bfloat16):
        return dtype
    for p in model.parameters():
        if p.dtype in (torch.float32, torch.float16, torch.bfloat16):
            return p.dtype
    return torch.float32
