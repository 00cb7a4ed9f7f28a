"""Saved caches at the session level: ``prefill`` saves a session's read, ``ask``/``summarize`` load one.

The file format, its checks, the atomic writer and the archive sidecar are ``kvtool.kvc``; this module
adds what needs a session: the metadata of a read (model identity, settings, prompt, document), the
reconciliation of a ``.kvc``'s fixed settings with the command line, and the checks that a file fits
the session's model, dtype, engine and chat template before its tensors are loaded.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import time
from typing import TYPE_CHECKING, Any

from kvtool import __version__
from kvtool.config import DTYPE_ALIASES, DTYPE_BYTES, dtype_name
from kvtool.errors import UsageError, first_line
from kvtool.kvc import archive
from kvtool.kvc.format import KvcHeader, corrupt, jsonable, read_header, require
from kvtool.kvc.load import load_into
from kvtool.kvc.write import check_output, write_kvc
from kvtool.runtime.events import PhaseProgress, phase_counter
from kvtool.runtime.memory import format_bytes

if TYPE_CHECKING:  # torch is imported lazily: header-only work (inspect, detection) stays fast
    from torch import Tensor

    from kvtool.runtime.session import ReadResult, Session

#: Settings a ``.kvc`` fixes: they built the cache, so a later run must use the same values.
FIXED_SETTINGS = ("policy", "policy_options", "budget", "block_size", "sinks", "recent", "positions", "dtype",
                  "kv_dtype")
_FLAGS = {
    "policy": "--policy",
    "policy_options": "--policy-opt",
    "budget": "--budget",
    "block_size": "--block-size",
    "sinks": "--sinks",
    "recent": "--recent",
    "positions": "--positions",
    "dtype": "--dtype",
    "kv_dtype": "--kv-dtype",
}


# -- settings ---------------------------------------------------------------------------------------------------
def settings_overrides(header: KvcHeader, overrides: dict[str, Any]) -> dict[str, Any]:
    """CLI overrides with the settings the cache was built with filled in.

    The ``.kvc`` fixes policy, policy options, budget, block size, sinks, recent window, position mode and
    dtype. Not giving one of them means "as in the file"; giving the same value is fine; giving another one
    is a ``UsageError`` (the cache cannot be re-read under other settings). ``quantize`` defaults to the
    file's but may be changed (K/V stay in the compute dtype). The model is never filled in: pass the same
    ``--model`` (``load_cache`` checks its identity).
    """
    meta = header.meta
    require(meta, header.path, "settings")
    stored: dict[str, Any] = meta["settings"]
    if not isinstance(stored, dict):
        raise corrupt(header.path, "settings is not an object")
    stored = {"kv_dtype": "auto", **stored}  # files from before --kv-dtype: K/V in the model's dtype
    require(stored, header.path, *FIXED_SETTINGS, "budget_tokens")
    out = dict(overrides)
    for key in FIXED_SETTINGS:
        given = overrides.get(key)
        if given is not None and not (key in ("dtype", "kv_dtype") and str(given).strip().lower() == "auto"):
            if not _same_setting(key, given, stored, meta):
                raise UsageError(
                    f"{header.path} was prefilled with {_FLAGS[key]} {_show(key, stored)}; "
                    f"drop {_FLAGS[key]} or prefill again"
                )
        if key == "budget":
            out[key] = str(stored["budget_tokens"]) if stored["budget_tokens"] is not None else stored["budget"]
        else:
            out[key] = stored[key]
    if overrides.get("quantize") is None and stored.get("quantize"):
        out["quantize"] = stored["quantize"]
    out.update(_archive_defaults(meta, overrides))
    return out


def _archive_defaults(meta: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """What the file's archive records (recall size, page size, dtype) for the settings not given.

    A ``.kvc`` with an archive recalls by default, as its prefill did; an explicit flag wins (a conflicting
    ``--archive-dtype`` or ``--recall-page`` is then a warning at load time). Unusable archive metadata
    fills nothing: loading says why it answers without recall.
    """
    info = meta.get("archive")
    # without an archive there is nothing to recall: ``auto`` (the default) is off, quietly
    off = {"recall": "off"} if overrides.get("recall") is None else {}
    if not info:
        return off
    try:
        _, page, dtype, recall = archive.settings_of(info)
    except archive.ArchiveUnusable:
        return {}
    out: dict[str, Any] = {}
    if overrides.get("recall") is None and recall:
        out["recall"] = str(recall)
    if overrides.get("recall_page") is None:
        out["recall_page"] = page
    if dtype is not None and str(overrides.get("archive_dtype") or "auto").strip().lower() == "auto":
        out["archive_dtype"] = dtype
    return out


def _show(key: str, stored: dict[str, Any]) -> str:
    if key == "policy_options":
        opts = stored["policy_options"] or {}
        return " ".join(f"{k}={v}" for k, v in sorted(opts.items())) or "(none)"
    if key == "budget":
        tokens = stored["budget_tokens"]
        text = str(stored["budget"])
        return text if tokens is None or text == str(tokens) else f"{text} ({tokens} tokens per KV head)"
    return str(stored[key])


def _same_setting(key: str, given: Any, stored: dict[str, Any], meta: dict[str, Any]) -> bool:
    want = stored[key]
    if key == "policy":
        return _norm_policy(str(given)) == _norm_policy(str(want))
    if key == "policy_options":
        if not isinstance(given, dict):
            return False
        have = {str(k): str(v) for k, v in (want or {}).items()}
        return all(str(k) in have and str(v).strip().lower() == have[str(k)].strip().lower() for k, v in given.items())
    if key == "dtype":
        return DTYPE_ALIASES.get(str(given).strip().lower()) == want
    if key in ("positions", "kv_dtype"):
        return str(given).strip().lower() == str(want)
    if key == "budget":
        return _same_budget(given, stored, meta)
    try:
        return int(given) == int(want)
    except (TypeError, ValueError):
        return False


def _norm_policy(spec: str) -> str:
    return "+".join(p.strip().lower() for p in spec.split("+") if p.strip())


def _same_budget(given: Any, stored: dict[str, Any], meta: dict[str, Any]) -> bool:
    """Whether ``--budget`` names the file's budget: its text, its tokens, or bytes that convert to them (with the
    archive's recall held inside them, as the prefill converted them, or without)."""
    from kvtool.core.costs import CacheCosts
    from kvtool.runtime.budget import parse_budget

    if stored["budget_tokens"] is None:  # policy full: the budget never mattered
        return True
    if str(given).strip() == str(stored["budget"]).strip():
        return True
    try:
        b = parse_budget(given)
    except UsageError:
        return False
    if b.tokens is not None:
        return b.tokens == stored["budget_tokens"]
    dims = (meta.get("model") or {}).get("dims") or {}
    recall = meta["archive"].get("recall") if isinstance(meta.get("archive"), dict) else None
    tokens = set()
    for with_recall in (False, True):
        if with_recall and not (isinstance(recall, int) and recall > 0):
            continue
        try:
            costs = CacheCosts.of(dims, DTYPE_BYTES[stored["dtype"]], str(stored["kv_dtype"]))
            tokens.add(costs.kept_and_recalled(b.nbytes or 0, recall, auto=False)[0] if with_recall
                       else costs.budget_tokens(b.nbytes or 0))
        except (KeyError, TypeError, ValueError, UsageError):
            continue
    return stored["budget_tokens"] in tokens



def build_meta(session: Session, read: ReadResult, tensors: dict[str, Tensor], scalars: dict[str, Any]) -> dict:
    """The ``kvtool`` metadata document for a cache read by ``session`` (see docs/kvc-format.md)."""
    from kvtool.runtime import prompt

    cache = read.cache
    s = session.settings
    loaded = session.loaded
    dims = session.dims
    layout = []
    for li, layer in enumerate(cache.layers):
        groups = []
        for gi, g in enumerate(layer.groups):  # type: ignore[attr-defined]
            groups.append({
                "heads": list(g.heads),
                "capacity": g.capacity,
                "compensation": bool(g.compensation),
                "state_fields": list(g.state_fields),
                "length": int(tensors[f"l{li}.g{gi}.positions"].shape[1]),
            })  # fmt: skip
        layout.append(groups)
    kv_names = (".keys", ".values", ".key_scale", ".value_scale")
    kv_stored = sum(t.numel() * t.element_size() for n, t in tensors.items() if n.endswith(kv_names))
    c = cache.counters
    prefix = prompt.document_prefix(session.tokenizer)
    return {
        "kvtool_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "model": {
            "name": loaded.name,
            "identity": loaded.identity,
            "source": loaded.source,
            "dims": {k: int(dims[k]) for k in ("num_layers", "num_kv_heads", "num_attention_heads", "head_dim",
                                               "sliding_layers", "sliding_window") if k in dims},
            "max_position_embeddings": getattr(session.model.config, "max_position_embeddings", None),
        },
        "dtype": dtype_name(loaded.dtype),
        "quantize": loaded.quantize,
        "policy": {"spec": session.policy.spec, "options": jsonable(session.policy.options())},
        "settings": {
            "policy": s.policy,
            "policy_options": dict(s.policy_options),
            "budget": s.budget,
            "budget_tokens": session.budget_tokens,
            "block_size": s.block_size,
            "sinks": s.sinks,
            "recent": s.recent,
            "positions": s.positions,
            "dtype": dtype_name(loaded.dtype),
            "quantize": loaded.quantize,
            "kv_dtype": s.kv_dtype,
        },
        # coded K/V (int8 / int4 with scales, or a float other than the model's): format 2, refused by older kvtool
        **({"required_features": ["kv_dtype"]} if cache.codec is not None else {}),
        "prompt": {"prefix": prefix, "prefix_tokens": int(read.prefix_tokens)},
        "document": {
            "name": read.name, "sha256": read.sha256, "tokens": int(read.document_tokens), "format": read.fmt,
            **({"source_map": read.source.meta()} if read.source is not None else {}),
        },
        "cache": {
            **jsonable(scalars),
            "counters": {"evicted_tokens": c.evicted_tokens, "prob_rows": c.prob_rows,
                         "max_cached": c.max_cached, "max_stored": c.max_stored},
        },
        "layout": layout,
        "bytes": {
            "kv_stored": int(kv_stored),
            "kv_promised": cache.promised_bytes(),
            "kv_allocated": int(cache.allocated_bytes()),
        },
        "prefill_seconds": round(float(read.seconds), 4),
    }


def save_cache(path: str | os.PathLike[str], session: Session, read: ReadResult, force: bool = False) -> int:
    """Write the post-document cache of ``read`` (its snapshot, not a cache a question modified).

    With recall on, the archive of evicted tokens is written first, complete and fsynced, under a fresh
    name the ``.kvc`` records (``kvtool.kvc.archive``); the ``.kvc`` is renamed into place after it.
    """
    from kvtool.core.storage import file_tensors  # torch: this module is imported before bad input is refused

    path = check_output(path, force)  # fail before writing the (larger) archive
    tensors, scalars = read.snapshot if read.snapshot is not None else read.cache.snapshot()
    tensors = file_tensors(tensors)  # a loaded cache rebuilds the original keys' copy itself
    meta = build_meta(session, read, tensors, scalars)
    name = os.path.basename(path)
    info = archive.save_archive(path, read.cache, phase_counter(session.emit, f"writing {name}'s archive"))
    if info is not None:
        meta["archive"] = {**info, "recall": int(session.recall_tokens)}
    try:
        return write_kvc(path, tensors, meta, force=force, progress=phase_counter(session.emit, f"writing {name}"))
    except BaseException:  # no orphan archive beside a cache that was not written
        archive.remove(path, info)
        raise


def load_cache(path: str | os.PathLike[str], session: Session) -> ReadResult:
    """Load a ``.kvc`` into an empty cache of ``session`` (``Session.new_cache``: the one cache of a run over many
    documents); returns a ``ReadResult`` like ``read``.

    Checks, each a one-line ``UsageError``: the model identity and dtype, the engine settings (policy,
    options, budget, block size, sinks, recent, positions), the chat-template prefix and the head layout.
    With recall on, the archive is loaded too, or the answers go without recall and a warning says why.
    """
    from kvtool.core.events import Note
    from kvtool.runtime.session import ReadResult

    t0 = time.perf_counter()
    header = read_header(path)
    p, meta = header.path, header.meta
    require(meta, p, "model", "dtype", "settings", "policy", "prompt", "document", "cache", "layout")
    _check_fits(header, session)
    cache = session.new_cache()  # many documents: the run's one cache, not a second one beside it
    what = f"loading {os.path.basename(p)}"
    session.emit(PhaseProgress(what, 0, header.size, "bytes"))
    load_into(header, cache)  # read whole and checksummed: the budget bounds it
    session.emit(PhaseProgress(what, header.size, header.size, "bytes"))
    doc = meta["document"]
    result = ReadResult(
        cache=cache,
        document_tokens=int(doc.get("tokens", 0)),
        prefix_tokens=int(meta["prompt"].get("prefix_tokens", 0)),
        seconds=float(meta.get("prefill_seconds", 0.0) or 0.0),
        sha256=str(doc.get("sha256", "")),
        name=str(doc.get("name", "")),
        loaded_from=str(p),
        load_seconds=time.perf_counter() - t0,
        source=_source_map(p, doc),
        fmt=str(doc.get("format", "text")),
    )
    if session.recall_tokens:
        for warning in _load_archive(p, meta, cache, session):
            session.emit(Note(f"warning: {warning}"))
    result.snapshot = session.snapshot(cache)
    session.last_read = result
    session.emit(Note(
        f"loaded {p}: {doc.get('name')} ({result.document_tokens:,} tokens), {format_bytes(header.size)}, "
        f"made by kvtool {meta.get('kvtool_version')} on {meta.get('created', '?')}"
    ))  # fmt: skip
    return result


def _load_archive(path: str, meta: dict[str, Any], cache: Any, session: Session) -> list[str]:
    """Load the archive into ``cache``; the warnings to show (an explicit ``--recall-page`` it overrides)."""
    warnings = []
    warning = archive.load_archive(path, meta, cache,
                                   phase_counter(session.emit, f"loading {os.path.basename(path)}'s archive"))
    if warning:
        warnings.append(warning)
    else:
        saved = meta["archive"]["page_size"]
        if saved != session.engine_config.page_size:
            warnings.append(f"{path}'s archive has pages of {saved} tokens: recall uses them "
                            f"(--recall-page {session.engine_config.page_size} applies to new archives only)")
    return warnings


def _check_fits(header: KvcHeader, session: Session) -> None:
    """The file was made with this session's model, dtype, engine settings and chat template."""
    from kvtool.runtime import prompt

    p, meta = header.path, header.meta
    model = meta["model"]
    loaded = session.loaded
    if model.get("identity") != loaded.identity:
        from kvtool.runtime.model import EMBEDDED_NAME

        if model.get("name") == EMBEDDED_NAME:  # its source is kvtool's own converted copy: not for --model
            raise UsageError(f"{p} was made with the embedded model {EMBEDDED_NAME}, not {loaded.name} "
                             f"({loaded.source}); drop --model or prefill again")
        raise UsageError(
            f"{p} was made with model {model.get('name')} ({model.get('source')}), not {loaded.name} "
            f"({loaded.source}); pass --model {model.get('source')} or prefill again"
        )
    dtype = dtype_name(loaded.dtype)
    if meta["dtype"] != dtype:
        raise UsageError(f"{p} was made in {meta['dtype']}, this run uses {dtype}; pass --dtype {meta['dtype']}")
    _check_engine(p, meta, session)
    if prompt.document_prefix(session.tokenizer) != meta["prompt"].get("prefix"):
        raise UsageError(
            f"{p} was made with another chat template (the text before the document differs); prefill again"
        )


def _source_map(path: str, doc: dict[str, Any]) -> Any:
    """The document's source map for ``--cite`` (None in caches from before citations: --cite says so)."""
    from kvtool.runtime.citations import SourceMap

    if not isinstance(doc.get("source_map"), dict):
        return None
    try:
        return SourceMap.from_meta(doc["source_map"])
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise corrupt(path, f"bad source map: {first_line(e, 120)}") from None


def _check_engine(path: str, meta: dict[str, Any], session: Session) -> None:
    s = meta["settings"]
    cfg = session.engine_config
    checks = [
        ("budget", s.get("budget_tokens"), session.budget_tokens),
        ("block size", s.get("block_size"), cfg.block_size),
        ("sinks", s.get("sinks"), cfg.sinks),
        ("recent window", s.get("recent"), cfg.recent),
        ("position mode", s.get("positions"), cfg.positions),
        ("policy", meta["policy"].get("spec"), session.policy.spec),
        ("policy options", meta["policy"].get("options"), jsonable(session.policy.options())),
    ]
    for what, want, have in checks:
        if want != have:
            raise UsageError(f"{path} was made with {what} {_brief(want)}, this run has {_brief(have)}; "
                             "use the same settings (and no profile that changes them) or prefill again")


def _brief(value: Any) -> str:
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True, default=str)
    return str(value)
