"""What kvtool can run from the local caches: every model snapshot of the Hugging Face cache, and the embedded model.

``kvtool models`` prints this. It reads config files only, never weights: each snapshot's ``config.json``
(its link followed only inside the cache, a regular file of at most 4 MiB, parsed with a cap on its
objects), the refs, and the sizes of the files. What a family needs that kvtool does not implement is
decided from the config by the same check that refuses it at load time (``check_config``), so the
listing and a run never disagree.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvtool.config import kvtool_home
from kvtool.core.layout import check_config
from kvtool.errors import UsageError, first_line
from kvtool.runtime.memory import dims_from_config, llama_param_count
from kvtool.runtime.model import hub
from kvtool.runtime.model.checkpoint_config import check_dims
from kvtool.runtime.model.convert import CONVERSION_MARKER, EMBEDDED_NAME, embedded_gguf_path
from kvtool.runtime.model.loading import READ_WHOLE_CAPS

#: the model types proven with their own tiny models (tests/test_families.py); docs/models.md lists them
PROVEN_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "gemma3_text"})
#: JSON objects a config may hold (a real one has a few dozen, a multimodal one a few hundred)
MAX_CONFIG_OBJECTS = 10_000
UNPROVEN = "goes through transformers' attention interface, but no test of kvtool proves this family"


@dataclass
class ModelEntry:
    """One row of ``kvtool models`` (its ``--json`` keys)."""

    id: str  # what --model takes: ORG/NAME, ORG/NAME@COMMIT for a snapshot no ref names, or "embedded"
    revision: str | None  # the refs naming this snapshot ("main", a tag), comma-separated; None: none does
    commit: str | None
    path: str
    family: str | None  # the config's model_type
    parameters: int | None  # from the config's shapes (the memory plan's count); None where it cannot tell
    dtype: str | None  # the weights' dtype the config names (with its quantization method), or "gguf"
    size_bytes: int  # on disk: every file of the snapshot, each blob once
    supported: str  # "yes" (a proven family), "unproven" (may work) or "no"
    why: str | None  # why not, or what is unproven, in one line
    problem: str | None  # why it cannot run as it is (a partial download, ...), in one line; None: it runs
    embedded: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def list_models() -> dict[str, Any]:
    """The ``kvtool models --json`` object: the cache folder searched and one entry per model snapshot."""
    cache = hub.hub_cache_dir()
    entries = [embedded_entry()]
    for folder in sorted(hub.entry_names(cache), key=str.lower):
        if not folder.startswith("models--"):
            continue
        try:
            entries.extend(repo_entries(cache, folder))
        except UsageError as exc:  # a folder that cannot be listed is one row saying so; the others still show
            repo = folder.removeprefix("models--").replace("--", "/")
            entries.append(ModelEntry(id=repo, revision=None, commit=None, path=str(cache / folder), family=None,
                                      parameters=None, dtype=None, size_bytes=0, supported="no", why=None,
                                      problem=str(exc)))
    return {"cache_dir": str(cache), "cache_found": cache.is_dir(), "models": [e.as_dict() for e in entries]}


def repo_entries(cache: Path, folder: str) -> list[ModelEntry]:
    """The entries of one repository folder of the cache: one per snapshot, newest ref first."""
    repo = folder.removeprefix("models--").replace("--", "/")
    repo_dir = cache / folder
    refs = hub.cached_refs(repo_dir)
    out = []
    for commit in hub.entry_names(repo_dir / "snapshots"):
        names = [name for name, target in refs.items() if target == commit]
        revision = names[0] if names else commit
        model_id = hub.ModelId(repo, None if revision == "main" else revision)
        out.append(snapshot_entry(model_id, cache, repo_dir, commit, ", ".join(names) or None))
    return sorted(out, key=lambda e: (e.revision is None, e.revision != "main", e.id))


def snapshot_entry(model_id: hub.ModelId, cache: Path, repo_dir: Path, commit: str, revision: str | None) -> ModelEntry:
    """One snapshot: what the cache says of it (complete or not), and what its config says of the model."""
    snapshot = repo_dir / "snapshots" / commit
    problem = None
    try:
        cached = hub.inspect_snapshot(model_id, repo_dir, snapshot, commit, need_weights=True)
        kind = cached.kind
    except UsageError as exc:  # the line --model would print, less the id and folder the entry names already
        problem, kind = str(exc), "dir"
        for named in (f"{model_id} ({snapshot}) ", f"{model_id} ({snapshot}): ", f"{model_id}: ", f"{model_id} "):
            problem = problem.removeprefix(named)
    entry = ModelEntry(id=str(model_id), revision=revision, commit=commit, path=str(snapshot), family=None,
                       parameters=None, dtype="gguf" if kind == "gguf" else None, size_bytes=size_on_disk(snapshot),
                       supported="no", why=None, problem=problem)
    if kind == "gguf":
        entry.supported, entry.why = "unproven", "a GGUF file: read by transformers' GGUF support (dequantized)"
        return entry
    try:
        raw = hub.read_small(snapshot / "config.json", READ_WHOLE_CAPS["config.json"], root=cache)
        config = _parse(raw) if raw is not None else None
    except UsageError as exc:
        entry.why = str(exc)
        return entry
    if config is None:
        entry.why = "no config.json"
        return entry
    describe(entry, config)
    return entry


def describe(entry: ModelEntry, config: dict[str, Any]) -> None:
    """Fill in family, parameters, dtype and whether kvtool supports the family, from a config's JSON."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    entry.family = model_type if isinstance(model_type, str) else None
    entry.dtype = entry.dtype or _dtype(config)
    if entry.family is None or entry.family not in CONFIG_MAPPING:
        entry.why = ("needs its own Python code (auto_map), which kvtool never runs" if "auto_map" in config
                     else f"model type {model_type!r} is unknown to transformers {transformers.__version__}")
        return
    try:
        check_dims(Path("config.json"), config, CONFIG_MAPPING[entry.family])  # as loading checks it
    except UsageError as exc:
        entry.why = str(exc)
        return
    try:
        built = CONFIG_MAPPING[entry.family].from_dict(config)
    except Exception as exc:  # noqa: BLE001 - a config transformers rejects is one line, whatever it raised
        entry.why = f"transformers rejects its config: {first_line(exc, 160)}"
        return
    entry.parameters = parameters(built)
    if entry.family not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        entry.why = "not a causal language model (transformers has no AutoModelForCausalLM for it)"
        return
    try:
        check_config(built)
    except UsageError as exc:
        entry.why = str(exc)
        return
    entry.supported, entry.why = ("yes", None) if entry.family in PROVEN_MODEL_TYPES else ("unproven", UNPROVEN)


def parameters(config: Any) -> int | None:
    """The memory plan's parameter count for ``config`` (a Llama-style decoder: exact for the proven families up
    to their norms and biases); None for mixtures of experts, whose count this formula does not describe."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any((getattr(text, key, None) or 0) > 1 for key in ("num_local_experts", "num_experts", "n_routed_experts")):
        return None
    try:
        return llama_param_count(dims_from_config(config), bool(getattr(text, "tie_word_embeddings", False)))
    except (AttributeError, TypeError, ValueError, KeyError, ZeroDivisionError):
        return None


def embedded_entry() -> ModelEntry:
    """The model that ships with kvtool (``--model embedded``, the default): its GGUF, and its converted copy."""
    entry = ModelEntry(id="embedded", revision=None, commit=None, path="", family=None, parameters=None,
                       dtype="gguf", size_bytes=0, supported="yes", why=None, problem=None, embedded=True)
    try:
        gguf = embedded_gguf_path()
    except UsageError as exc:
        entry.problem = str(exc)
        return entry
    entry.path, entry.size_bytes = str(gguf), gguf.stat().st_size
    converted = kvtool_home() / "models" / EMBEDDED_NAME
    if not (converted / CONVERSION_MARKER).is_file():
        entry.why = f"{EMBEDDED_NAME}; converted once on first use into {converted}"
        return entry
    entry.why = EMBEDDED_NAME
    with contextlib.suppress(UsageError, OSError):
        raw = hub.read_small(converted / "config.json", READ_WHOLE_CAPS["config.json"], root=converted)
        if raw is not None:
            describe(entry, _parse(raw))
            entry.why, entry.dtype = EMBEDDED_NAME, "gguf (Q4_1), converted to float32"
    return entry


def size_on_disk(snapshot: Path) -> int:
    """Bytes of every file of the snapshot (links into ``blobs/`` followed), each blob counted once."""
    seen: dict[str, int] = {}
    for path in hub.walk_files(snapshot, depth=4, links=True):
        with contextlib.suppress(OSError, RuntimeError):
            real = path.resolve(strict=True)
            seen[str(real)] = real.stat().st_size
    return sum(seen.values())


def _parse(raw: bytes) -> dict[str, Any]:
    from kvtool.kvc.format import loads

    try:
        config = loads(raw, MAX_CONFIG_OBJECTS)
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"config.json is not valid JSON: {first_line(exc, 120)}") from None
    if not isinstance(config, dict):
        raise UsageError("config.json is not a JSON object")
    return config


def _dtype(config: dict[str, Any]) -> str | None:
    """The dtype the config names for the weights (transformers 5 writes ``dtype``, older ones ``torch_dtype``)."""
    sections = [config, config.get("text_config") if isinstance(config.get("text_config"), dict) else {}]
    dtype = next((s.get(k) for s in sections for k in ("dtype", "torch_dtype") if isinstance(s.get(k), str)), None)
    quant = config.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if isinstance(method, str):
        bits = next((f"{n}bit" for n in (4, 8) if isinstance(quant, dict) and quant.get(f"load_in_{n}bit")), None)
        return " ".join(x for x in (dtype, method, bits) if x)
    return dtype
