"""A session: model + tokenizer + settings, and the operations every command is made of.

    Session(settings) → read(document) → cache (snapshot) → answer(question) → restore → answer(...)

Settings are already merged (profile ⊕ flags) and validated; the session resolves what needs the
model (byte budgets, the policy's head layout, razor calibration) and owns the memory meter.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from kvtool.core.cache import BoundedCache
from kvtool.core.engine import Engine, EngineConfig, make_sampler, model_env
from kvtool.core.events import Listener, Note
from kvtool.errors import UsageError
from kvtool.policies import Policy, build_policy, check_policy
from kvtool.runtime import prompt
from kvtool.runtime.document import Document, estimate_tokens, iter_token_blocks
from kvtool.runtime.memory import dims_from_config, dtype_bytes
from kvtool.runtime.model import LoadedModel, kvtool_home, load_model, set_threads, usable_cores
from kvtool.runtime.settings import Settings, budget_tokens_from_bytes


@dataclass
class Answer:
    question: str
    answer: str
    tokens: int
    seconds: float
    prompt_tokens: int = 0

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


class Detokenizer:
    """Turns a growing list of token ids into newly printable text (multi-byte safe), incrementally.

    Each token decodes only a short window: the ids from ``prefix`` (the last printed piece, kept as
    context so a tokenizer that drops a leading space at the start of a decode sees the same start)
    to the end, minus the text of ``prefix:read``. Re-decoding the whole answer on every token
    would be quadratic in its length. A window that ends in an incomplete UTF-8 sequence (U+FFFD)
    waits for the next token.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the context window
        self.read = 0  # ids before this are printed

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        text = self.tokenizer.decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before) :]

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)


def rechunk(pieces: Iterable[Tensor], size: int) -> Iterator[Tensor]:
    """Regroup token tensors into blocks of exactly ``size`` (the last may be shorter)."""
    buf: list[Tensor] = []
    have = 0
    for t in pieces:
        buf.append(t)
        have += t.numel()
        while have >= size:
            flat = torch.cat(buf)
            yield flat[:size]
            rest = flat[size:]
            buf, have = ([rest] if rest.numel() else []), rest.numel()
    if have:
        yield torch.cat(buf)


class Session:
    """Loads the model once and runs reads and answers with one policy and budget."""

    def __init__(
        self,
        settings: Settings,
        listener: Listener | None = None,
        say: Callable[[str], None] | None = None,
        loaded: LoadedModel | None = None,
        show_progress: bool = False,
    ) -> None:
        self.settings = settings
        self.show_progress = show_progress
        self.calibration: dict[str, Any] | None = None
        self.say = say or (lambda s: None)
        self.listener = listener
        if loaded is None:  # fail fast on bad options, before seconds of model loading
            check_policy(settings.policy, settings.policy_options)
            if settings.parsed_budget.tokens is not None and settings.policy.strip().lower() != "full":
                EngineConfig(budget=settings.parsed_budget.tokens, block_size=settings.block_size,
                             sinks=settings.sinks, recent=settings.recent, positions=settings.positions).validate()
        self.threads = set_threads(settings.threads)
        self.loaded = loaded or load_model(settings.model, settings.device, settings.dtype, settings.quantize,
                                           progress=self.say)
        if self.loaded.device.type == "cpu":
            self.say(f"threads: {self.threads} (of {usable_cores()} usable cores"
                     f"{', --threads' if settings.threads is not None else ''})")
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.dims = dims_from_config(self.model.config)
        self.budget_tokens, self.budget_note = self._resolve_budget()
        self.engine_config = EngineConfig(
            budget=self.budget_tokens,
            block_size=settings.block_size,
            sinks=settings.sinks,
            recent=settings.recent,
            positions=settings.positions,
        )
        self.engine_config.validate()
        env = model_env(self.model, self.engine_config, retrieval_heads=self._retrieval_heads)
        self.policy: Policy = build_policy(settings.policy, settings.policy_options, env)
        self.engine = Engine(self.model, self.policy, self.engine_config, listener=listener, env=env)
        self.eos = prompt.eos_ids(self.tokenizer, self.model.config)
        self.last_read: ReadResult | None = None
        self.answers: list[Answer] = []

    # -- set-up -----------------------------------------------------------------------------------
    def _resolve_budget(self) -> tuple[int | None, str | None]:
        if self.settings.policy.strip().lower() == "full":
            return None, None
        b = self.settings.parsed_budget
        if b.tokens is not None:
            return b.tokens, None
        assert b.nbytes is not None
        elem = dtype_bytes(self.loaded.dtype)
        d = self.dims
        tokens = budget_tokens_from_bytes(b.nbytes, d["num_layers"], d["num_kv_heads"], d["head_dim"], elem)
        per_token = 2 * d["num_layers"] * d["num_kv_heads"] * d["head_dim"] * elem
        dtype = str(self.loaded.dtype).replace("torch.", "")
        note = f"budget {b.text} = {tokens} tokens per KV head ({per_token} bytes of K+V per token in {dtype})"
        return tokens, note

    def _retrieval_heads(self, induction_frac: float = 0.14, echo_frac: float = 0.01) -> dict[int, list[int]]:
        """RazorAttention's head map: calibrated once per model and reused (kvtool/calibrate.py)."""
        from rich.console import Console
        from rich.progress import Progress

        from kvtool.policies.razor.calibrate import calibrate

        console = Console(stderr=True)
        with Progress(console=console, disable=not self.show_progress, transient=True) as bar:
            task = bar.add_task("razor: calibrating retrieval heads", total=None)
            self.calibration = calibrate(
                self.model,
                identity=self.loaded.identity,
                name=self.loaded.name,
                home=kvtool_home(),
                induction_frac=induction_frac,
                echo_frac=echo_frac,
                exclude_ids=list(self.tokenizer.all_special_ids),
                progress=lambda done, total: bar.update(task, completed=done, total=total),
            )
        return {int(k): list(v) for k, v in self.calibration["kv_heads"].items()}

    # -- reading --------------------------------------------------------------------------------------
    def read(self, doc: Document) -> ReadResult:
        """Prefill the chat prefix and the document, block by block; snapshot the cache."""
        if self.budget_note:
            self.emit(Note(self.budget_note))
        cache = self.engine.new_cache()
        prefix = torch.tensor(prompt.encode(self.tokenizer, prompt.document_prefix(self.tokenizer)), dtype=torch.long)
        blocks = rechunk(_chain([prefix], iter_token_blocks(doc, self.tokenizer, self.settings.block_size)),
                         self.settings.block_size)
        def expected() -> int | None:
            n = estimate_tokens(doc)
            return None if n is None else n + prefix.numel()

        t0 = time.perf_counter()
        self.engine.feed(cache, blocks, total=expected)
        seconds = time.perf_counter() - t0
        result = ReadResult(
            cache=cache,
            document_tokens=doc.tokens,
            prefix_tokens=prefix.numel(),
            seconds=seconds,
            sha256=doc.sha256,
            name=doc.name,
        )
        result.snapshot = cache.snapshot()
        self.last_read = result
        return result

    def emit(self, event: Any) -> None:
        if self.listener is not None:
            self.listener(event)

    # -- answering ---------------------------------------------------------------------------------------
    def answer(
        self,
        read: ReadResult,
        suffix_text: str,
        label: str,
        on_text: Callable[[str], None] | None = None,
        max_new_tokens: int | None = None,
    ) -> Answer:
        """Restore the post-document cache, feed the pinned suffix, decode; the cache keeps evicting."""
        cache = read.cache
        cache.restore(read.snapshot)
        suffix = torch.tensor(prompt.encode(self.tokenizer, suffix_text), dtype=torch.long)
        self.engine.pin(cache, suffix.numel())
        logits = self.engine.feed(cache, [suffix], progress=False)
        assert logits is not None
        detok = Detokenizer(self.tokenizer)

        def on_token(tok: int) -> None:
            piece = detok.push(tok)
            if piece and on_text is not None:
                on_text(piece)

        s = self.settings
        sampler = make_sampler(s.temperature, s.top_p, s.seed, s.repetition_penalty)
        ids, seconds = self.engine.generate(
            cache, logits, max_new_tokens or s.max_new_tokens, self.eos, sampler, on_token
        )
        cache.pin_start = cache.pin_end = None
        ans = Answer(question=label, answer=detok.text().strip(), tokens=len(ids), seconds=seconds,
                     prompt_tokens=suffix.numel())
        self.answers.append(ans)
        return ans

    def ask(self, read: ReadResult, question: str, on_text: Callable[[str], None] | None = None) -> Answer:
        if not question.strip():
            raise UsageError("empty question")
        return self.answer(read, prompt.question_suffix(self.tokenizer, question), question, on_text)

    def summarize(self, read: ReadResult, length: str, on_text: Callable[[str], None] | None = None) -> Answer:
        if length not in prompt.SUMMARY_LENGTHS:
            raise UsageError(f"--length must be one of {', '.join(prompt.SUMMARY_LENGTHS)} (got {length!r})")
        return self.answer(read, prompt.summary_suffix(self.tokenizer, length), f"summary ({length})", on_text)

    # -- reporting ------------------------------------------------------------------------------------------
    def stats(self, read: ReadResult | None = None, peak_bytes: int | None = None) -> dict[str, Any]:
        """The ``--json`` stats object (README documents every key)."""
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
            "kv_cache_stored_bytes": cache.stored_bytes() if cache else 0,
            "kv_budget_bytes": cache.promised_bytes() if cache else None,
            "peak_memory_bytes": peak_bytes if peak_bytes is not None else self.engine.meter.peak_bytes(),
            "positions": self.settings.positions,
            "threads": self.threads,
            "compact_since_token": cache.compact_since if cache and cache.compact else None,
            "time_split_seconds": {
                "probs": round(c.probs_seconds, 4),
                "score": round(c.score_seconds, 4),
                "evict": round(c.evict_seconds, 4),
            }
            if c
            else {},
            "model_load_seconds": round(self.loaded.load_seconds, 3),
        }
        if read is not None and read.loaded_from:
            out["loaded_from"] = read.loaded_from
            out["cache_load_seconds"] = round(read.load_seconds, 4)
        split = getattr(self.policy, "budget_split", None)
        if callable(split) and self.budget_tokens is not None:
            out["budget_split"] = split(self.engine.env)
        if self.budget_note:
            out["budget_conversion"] = self.budget_note
        return out


def _chain(*iterables: Iterable[Tensor]) -> Iterator[Tensor]:
    for it in iterables:
        yield from it


def _jsonable(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))
