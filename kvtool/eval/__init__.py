"""Evaluation tasks (``kvtool eval ...``): needle-in-a-haystack, perplexity and attention-output error.

Every task runs a grid of (policy, budget) *runs* over the same inputs with one model loaded once:

    parse + validate options (no model)  →  load_model once  →  one Session per run (``loaded=``)
    →  task loop reporting progress to a Reporter  →  data the CLI draws as tables, or one JSON object

``full`` ignores budgets, so it is one run (budget ``null``) however many budgets are given.

JSON (one object on stdout)::

    {"task": "needle" | "ppl" | "attn-error", "settings": {...}, "results": [...], "seconds": float, ...}

This package only holds what the three tasks share; the metrics are in :mod:`kvtool.eval.metrics`.
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import io
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtool.config import SHARED_RECALL_SELECT
from kvtool.documents import SNIFF_BYTES, Document, detect_format, extract_text
from kvtool.errors import UsageError, json_text
from kvtool.numbers import LIMITS, capped
from kvtool.runtime.budget import parse_budget
from kvtool.runtime.settings import TABLE_BLOCK, Settings, resolve_settings

#: What a directory of inputs may hold (other files are ignored).
DOCUMENT_SUFFIXES = (".txt", ".md", ".markdown", ".html", ".htm", ".pdf", ".epub", ".docx")
#: Text larger than this is cut (perplexity windows and haystacks never need more).
MAX_TEXT_BYTES = 64 * 1024 * 1024


# --------------------------------------------------------------------------------------------- option parsing


def split_list(text: str, name: str) -> list[str]:
    items = [t.strip() for t in str(text).split(",")]
    items = [t for t in items if t]
    if not items:
        raise UsageError(f"{name} must be a comma-separated list (got {text!r})")
    return items


def parse_tokens(text: str | int, name: str, minimum: int = 1) -> int:
    """A token count: ``512``, ``2k`` (= 2048), ``1.5k``. Byte sizes are rejected."""
    try:
        b = parse_budget(text)
    except UsageError:
        raise UsageError(f"{name} must be a token count like 512 or 2k (got {text!r})") from None
    if b.tokens is None:
        raise UsageError(f"{name} must be a token count like 512 or 2k, not a size (got {text!r})")
    if b.tokens < minimum:
        raise UsageError(f"{name} must be at least {minimum} (got {text!r})")
    return capped(name, b.tokens, LIMITS["eval_tokens"])  # an evaluation holds a document this long in memory


def parse_token_list(text: str, name: str, minimum: int = 1) -> list[int]:
    out: list[int] = []
    for item in split_list(text, name):
        n = parse_tokens(item, name, minimum)
        if n not in out:
            out.append(n)
    return out


def parse_policies(text: str, always_full: bool = False) -> list[str]:
    """Comma list of policy specs (``h2o+vatp`` allowed), deduplicated; checked against the registry."""
    from kvtool.policies import PolicyEnv, build_policy

    specs: list[str] = []
    for item in split_list(text, "--policies"):
        spec = "+".join(p.strip().lower() for p in item.split("+") if p.strip())
        if spec not in specs:
            specs.append(spec)
    if always_full and "full" not in specs:
        specs.insert(0, "full")
    dummy = PolicyEnv(num_layers=2, num_kv_heads=2, num_attention_heads=4, head_dim=8, budget=64)
    for spec in specs:
        build_policy(spec, {}, dummy)  # names, modifiers and their bases: UsageError if wrong
    return specs


def parse_budgets(text: str, sinks: int, recent: int) -> list[str]:
    """Comma list of budgets (tokens per KV head like 256 or 1k; byte sizes like 64MiB also work)."""
    out: list[str] = []
    for item in split_list(text, "--budgets"):
        b = parse_budget(item)
        if b.tokens is not None and b.tokens <= sinks + recent:
            raise UsageError(f"budget {item} is too small: it must exceed sinks + recent = {sinks + recent}")
        text = str(b.tokens) if b.tokens is not None else b.text
        if text not in out:
            out.append(text)
    return out


def parse_depths(text: str) -> list[float]:
    out: list[float] = []
    for item in split_list(text, "--depths"):
        try:
            d = float(item)
        except ValueError:
            raise UsageError(f"--depths must be numbers between 0 and 1 (got {item!r})") from None
        if not 0.0 <= d <= 1.0:
            raise UsageError(f"--depths must be between 0 and 1 (got {item!r})")
        if d not in out:
            out.append(d)
    return out


# --------------------------------------------------------------------------------------------- the grid


@dataclass(frozen=True)
class Run:
    """One (policy, budget) cell of the grid; ``budget`` is None for ``full``."""

    policy: str
    budget: str | None

    @property
    def label(self) -> str:
        return self.policy if self.budget is None else f"{self.policy}@{self.budget}"


#: settings added or changed after the first resume logs were written, with the value those logs meant:
#: a fingerprint records them only when they differ from it, so the old logs still match their commands
LEGACY_DEFAULTS: dict[str, Any] = {"recall_page": 32, "archive_dtype": "auto", "repetition_penalty": 1.1,
                                   "no_repeat_ngram": 0, "recall": "off", "recall_placement": "document",
                                   "recall_select": SHARED_RECALL_SELECT}
#: a reading setting added later (every task's fingerprint), with the value older logs meant
LEGACY_READING: dict[str, Any] = {"kv_dtype": "auto"}


@dataclass
class Grid:
    settings: Settings  # shared settings (model, device, block size, ...); policy/budget set per run
    policies: list[str]
    budgets: list[str]

    def runs(self) -> list[Run]:
        out: list[Run] = []
        for p in self.policies:
            if p == "full":
                out.append(Run("full", None))
            else:
                out.extend(Run(p, b) for b in self.budgets)
        return out

    def settings_for(self, run: Run) -> Settings:
        return dataclasses.replace(self.settings, policy=run.policy, budget=run.budget or self.settings.budget)

    def describe(self, answers: bool = False, recall: bool = False, placement: bool = True,
                 select: bool = False) -> dict[str, Any]:
        """The grid's settings for a resume fingerprint; ``answers``: with how answers are generated and
        archived (needle, agreement), ``recall``: with the recall setting itself (agreement);
        ``placement``: with where recalled passages go, which acts only at compact positions (a task
        whose documents stay inside the model's range gives the same answers under either placement);
        ``select``: with how recall chooses (``--recall-select``), which a needle grid keys per trial and
        which acts only where recall is on and an archive can pass one scan (``auto`` is ``shared`` below it)."""
        s = self.settings
        select = select and s.recall != "off"
        return {
            "policies": self.policies,
            "budgets": [int(b) if b.isdigit() else b for b in self.budgets],
            "block_size": s.block_size,
            "sinks": s.sinks,
            "recent": s.recent,
            "positions": s.positions,
            "seed": s.seed,
            # settings added later appear only when changed: resume logs written before them still match
            **{k: getattr(s, k) for k, legacy in LEGACY_DEFAULTS.items()
               if answers and (recall or k != "recall") and (placement or k != "recall_placement")
               and (select or k != "recall_select")
               and getattr(s, k) != legacy},
            **{k: getattr(s, k) for k, legacy in LEGACY_READING.items() if getattr(s, k) != legacy},
        }


def make_grid(policies: str, budgets: str, always_full: bool = False, **overrides: Any) -> Grid:
    """Validate the shared settings and the (policy, budget) grid; loads nothing."""
    settings = resolve_settings(None, {k: v for k, v in overrides.items() if v is not None})
    if settings.block_size is None:  # evaluation reads in one block on every device: tables stay comparable
        settings = dataclasses.replace(settings, block_size=TABLE_BLOCK)
    return Grid(
        settings=settings,
        policies=parse_policies(policies, always_full),
        budgets=parse_budgets(budgets, settings.sinks, settings.recent),
    )


def load_once(grid: Grid, say: Any = None) -> Any:
    """Load the model once for the whole grid (every Session gets it through ``loaded=``)."""
    from kvtool.runtime.model import load_model

    s = grid.settings
    return load_model(s.model, s.device, s.dtype, s.quantize, progress=say)


def make_session(grid: Grid, run: Run, loaded: Any, say: Any = None, **overrides: Any) -> Any:
    """A session for one run of the grid; ``overrides``: settings replaced for it (e.g. a reference's)."""
    from kvtool.runtime.session import Session

    return Session(dataclasses.replace(grid.settings_for(run), **overrides), listener=None, say=say, loaded=loaded)


#: tokens a read streams around the document's own (the chat template's opening, the instruction), counted
#: generously where a task asks whether a read passes the model's range: over-counting only keeps a setting in
#: a resume fingerprint that could have been left out
PROMPT_MARGIN = 512


def model_range(loaded: Any) -> int | None:
    """The model's trained range (``max_position_embeddings``, of the text model for a multimodal one), where
    ``--positions auto`` turns compact, as the engine reads it."""
    from kvtool.core.layout import text_config

    return getattr(text_config(loaded.model.config), "max_position_embeddings", None)


def model_settings(loaded: Any) -> dict[str, Any]:
    return {
        "model": loaded.name,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).replace("torch.", ""),
        "quantize": loaded.quantize,
    }


# --------------------------------------------------------------------------------------------- text


def default_corpus() -> Path:
    """``shared/corpus`` beside the repository (``<repo>/../shared/corpus``)."""
    import kvtool

    return Path(kvtool.__file__).resolve().parents[2] / "shared" / "corpus"


def resolve_input(path: str | None, default_name: str, option: str) -> Path:
    """The path given, else ``default_corpus()/default_name``; a clear UsageError when neither exists."""
    if path is not None:
        p = Path(path).expanduser()
        if not p.exists():
            raise UsageError(f"{option}: no such file or directory: {p}")
        return p
    p = default_corpus() / default_name
    if not p.exists():
        raise UsageError(f"no {option} given and the default {p} does not exist; pass {option} PATH")
    return p


def load_text(path: Path, option: str, max_bytes: int = MAX_TEXT_BYTES) -> str:
    """A document, or a directory's documents concatenated in sorted order (blank line between).

    Text is read as it is; PDF, EPUB, HTML and DOCX files are extracted (:mod:`kvtool.documents`).
    At most ``max_bytes`` are read in all (the tasks need far less).
    """
    if path.is_dir():
        files = sorted(f for f in path.iterdir() if f.is_file() and f.suffix.lower() in DOCUMENT_SUFFIXES)
        if not files:
            raise UsageError(f"{option}: {path} has no documents ({', '.join(DOCUMENT_SUFFIXES)})")
    else:
        files = [path]
    parts: list[str] = []
    left = max_bytes
    for f in files:
        if left <= 0:
            break
        try:
            with open(f, "rb") as fh:
                data = fh.read(left)
        except OSError as e:
            raise UsageError(f"{option}: cannot read {f}: {e.strerror or e}") from None
        if data.strip() and detect_format(data[:SNIFF_BYTES], str(f)) in ("pdf", "epub", "docx", "html"):
            try:
                text = extract_text(str(f), left).strip()
            except UsageError as e:
                raise UsageError(f"{option}: {e}") from None
            left -= len(text.encode("utf-8"))
            if text:
                parts.append(text)
            continue
        left -= len(data)
        if b"\x00" in data:
            raise UsageError(f"{option}: {f} looks binary (NUL bytes); kvtool reads UTF-8 text")
        try:
            text = codecs.getincrementaldecoder("utf-8")().decode(data, final=left > 0)
        except UnicodeDecodeError as e:
            raise UsageError(f"{option}: {f} is not UTF-8 text (invalid byte at offset {e.start})") from None
        text = text.replace("\r\n", "\n").strip()
        if text:
            parts.append(text)
    joined = "\n\n".join(parts)
    if not joined.strip():
        raise UsageError(f"{option}: {path} is empty")
    return joined


def text_document(text: str, name: str) -> Document:
    """An in-memory ``Document`` (what ``open_document`` returns for a file) for ``Session.read``."""
    data = text.encode("utf-8")
    return Document(path=name, size=len(data), head=data[:SNIFF_BYTES], stream=io.BytesIO(data[SNIFF_BYTES:]))


# --------------------------------------------------------------------------------------------- progress


class Reporter:
    """Where a task reports while it runs: notes, and progress over its units of work.

    This base reports nothing (a library caller, a test); the CLI passes a subclass that draws a bar on
    stderr. Tasks call ``say`` for a note, ``bar(total)`` around their loop, ``doing`` when they start a
    unit and ``advance`` when they finish one.
    """

    def say(self, msg: str) -> None:
        """A one-line note for the user."""

    @contextmanager
    def bar(self, total: int) -> Iterator[Reporter]:
        """Progress over ``total`` units for the duration of the ``with`` block."""
        yield self

    def doing(self, what: str) -> None:
        """The unit of work now running."""

    def advance(self, n: int = 1) -> None:
        """``n`` more units done."""


class Timer:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def seconds(self) -> float:
        return round(time.perf_counter() - self.t0, 3)


def report(task: str, settings: dict[str, Any], results: list[dict[str, Any]], seconds: float,
           **extra: Any) -> dict[str, Any]:
    """The ``--json`` object every task prints."""
    return {"task": task, "settings": settings, "results": results, **extra, "seconds": seconds}


# --------------------------------------------------------------------------------------------- resumption


#: settings that only say how big the grid is (its cells carry their own keys)
GRID_EXTENT = frozenset({"policies", "budgets", "lengths", "depths", "trials", "windows", "samples", "seconds",
                         "recalls", "selects"})


class CellLog:
    """``--resume FILE.jsonl``: finished units of work, appended as they complete, reused on the next run.

    Each line is ``{"task", "fingerprint", "key", "record"}``. The fingerprint hashes the task's settings
    that change what a key means (model, seed, block size, prompt, lengths of windows, ...), so lines
    written under other settings are ignored, never mixed in. The grid's extent (policies, budgets,
    lengths, depths, trials, windows) is left out: keys name their cell, so a grid can grow and reuse
    every cell it already has.
    A line is written and flushed (and fsynced) as soon as its unit is done: a run killed at any point
    loses at most the unit in flight; a torn last line is skipped.
    """

    def __init__(self, path: str | os.PathLike[str] | None, task: str, settings: dict[str, Any]) -> None:
        self.path = Path(path) if path is not None else None
        self.task = task
        meaning = {k: v for k, v in settings.items() if k not in GRID_EXTENT}
        blob = json.dumps(meaning, sort_keys=True, default=str).encode()
        self.fingerprint = hashlib.sha256(blob).hexdigest()[:16]
        self.done: dict[str, Any] = {}
        self.ignored = 0
        if self.path is None:
            return
        if self.path.is_dir():
            raise UsageError(f"--resume: {self.path} is a directory")
        if self.path.exists():
            try:
                lines = self.path.read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as e:
                raise UsageError(f"--resume: cannot read {self.path}: {e}") from None
            for line in lines:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line torn by a kill
                if not isinstance(row, dict) or "key" not in row:
                    continue
                if row.get("task") == task and row.get("fingerprint") == self.fingerprint:
                    self.done[str(row["key"])] = row.get("record")
                else:
                    self.ignored += 1
        else:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.path.touch()
            except OSError as e:
                raise UsageError(f"--resume: cannot create {self.path}: {e.strerror or e}") from None

    def get(self, key: str) -> Any:
        return self.done.get(key)

    def __contains__(self, key: str) -> bool:
        return key in self.done

    def put(self, key: str, record: Any) -> None:
        self.done[key] = record
        if self.path is None:
            return
        line = json_text({"task": self.task, "fingerprint": self.fingerprint, "key": key, "record": record})
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def cached(self, key: str, compute: Any) -> Any:
        """The record of ``key``: from the log when it is there, else ``compute()`` (then logged)."""
        if key in self.done:
            return self.done[key]
        record = compute()
        self.put(key, record)
        return record
