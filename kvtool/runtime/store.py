"""Saved KV caches (``.kvc``): ``kvtool prefill`` writes one, ``ask``/``summarize`` load it, ``inspect`` shows it.

A ``.kvc`` file is a plain safetensors file (see ``docs/kvc-format.md``)::

    8 bytes   little-endian length N of the JSON header
    N bytes   JSON header: "__metadata__" {format, format_version, kvtool: <JSON text>} + one entry per tensor
    ...       tensor data: per layer l and head group g, l{l}.g{g}.keys / .values / .positions / .rotary / .state
              (and .comp_key_sum / .comp_value_sum / .comp_count for RazorAttention's compensated heads)

Only the tokens the cache holds are written, so the file is the K/V bytes the budget promises plus a few
bytes per token (positions, policy state) and a header of a few KB. Everything a later run needs to keep
evicting exactly as the in-process run would is in it: the post-document cache, the position counter and
mode, the per-token policy state and the settings that built the engine. The model is *not* stored: its
identity (a hash of config and weight names/shapes) and dtype are, and a mismatch is a one-line error.

Reading the header never needs torch or the model (``kvtool inspect`` is instant); writes are atomic
(temp file in the target directory, fsync, rename), so an interrupted prefill never leaves half a file.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtool import __version__
from kvtool.errors import KvtoolError, UsageError
from kvtool.runtime.memory import format_bytes

if TYPE_CHECKING:  # torch is imported lazily: header-only work (inspect, detection) stays fast
    from torch import Tensor

    from kvtool.runtime.session import ReadResult, Session

FORMAT = "kvtool-kvc"
FORMAT_VERSION = 1  # bump on any change an older kvtool could misread
MIN_FORMAT_VERSION = 1  # oldest format this kvtool still loads
META_KEY = "kvtool"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # sanity limit on the JSON header
_MARKER = b'"' + FORMAT.encode() + b'"'

#: Settings a ``.kvc`` fixes: they built the cache, so a later run must use the same values.
FIXED_SETTINGS = ("policy", "policy_options", "budget", "block_size", "sinks", "recent", "positions", "dtype")
_FLAGS = {
    "policy": "--policy",
    "policy_options": "--policy-opt",
    "budget": "--budget",
    "block_size": "--block-size",
    "sinks": "--sinks",
    "recent": "--recent",
    "positions": "--positions",
    "dtype": "--dtype",
}
_DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}  # fmt: skip
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# safetensors dtype codes -> bytes per element (for sizes computed from the header alone)
_ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


@dataclass
class KvcHeader:
    """What the header of a ``.kvc`` file says (read without touching the tensor data)."""

    path: str
    size: int  # bytes on disk
    header_bytes: int  # 8 + length of the JSON header
    meta: dict[str, Any]  # the ``kvtool`` JSON document (see docs/kvc-format.md)
    tensors: dict[str, dict[str, Any]]  # name -> {"dtype", "shape", "data_offsets"}

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V in the file (compensation slots included): what the budget promises to bound."""
        return sum(_nbytes(info) for name, info in self.tensors.items() if name.endswith((".keys", ".values")))

    def layer_lengths(self) -> list[list[int]]:
        """Tokens per KV head held, per layer and head group (from the tensor shapes)."""
        out: list[list[int]] = []
        for li in range(self.num_layers):
            row = []
            gi = 0
            while f"l{li}.g{gi}.positions" in self.tensors:
                row.append(int(self.tensors[f"l{li}.g{gi}.positions"]["shape"][1]))
                gi += 1
            out.append(row)
        return out

    @property
    def num_layers(self) -> int:
        layers = {name.split(".", 1)[0] for name in self.tensors if name.startswith("l")}
        return len(layers)


# -- small helpers ----------------------------------------------------------------------------------------------
def _nbytes(info: dict[str, Any]) -> int:
    start, end = info["data_offsets"]
    return int(end) - int(start)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _jsonable(value: Any) -> Any:
    """Policy options and the like as plain JSON values (anything else becomes its text)."""
    return json.loads(json.dumps(value, default=str, sort_keys=True))


MAX_INT = 2**40  # no count, capacity or position in a real cache comes near this


def _loads(text: str | bytes) -> Any:
    """``json.loads`` whose deep nesting is a ``ValueError`` (damage), not a ``RecursionError``.

    json's C scanner guards its recursion, so 200,000 nested brackets end in a catchable ``RecursionError``
    after a bounded amount of work; a real header nests five levels deep.
    """
    try:
        return json.loads(text.decode("utf-8") if isinstance(text, bytes) else text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _corrupt(path: str, why: str = "") -> UsageError:
    detail = f" ({why})" if why else ""
    return UsageError(f"{path} is truncated or corrupted{detail}; prefill it again")


def _require(meta: dict[str, Any], path: str, *keys: str) -> None:
    missing = [k for k in keys if k not in meta]
    if missing:
        raise _corrupt(path, f"metadata lacks {', '.join(missing)}")


# -- detection and header -------------------------------------------------------------------------------------
def is_kvc(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a ``.kvc`` file, by content (whatever its name); never raises.

    A safetensors file starts with an 8-byte little-endian header length and ``{``. A real header is far
    shorter than 4 GiB, so bytes 4..7 are NUL, which no UTF-8 text document contains (kvtool rejects NUL
    bytes in documents). A complete header is parsed and must carry ``__metadata__.format == "kvtool-kvc"``.
    Damaged files are still recognised, so the user hears "truncated or corrupted" rather than "binary
    file": a header that does not parse but holds the marker, a header cut short, or a binary file named
    ``*.kvc``. ``read_header`` then validates and reports.
    """
    try:
        if not os.path.isfile(path):  # never read a pipe or device here: that would consume its data
            return False
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(9)
            safetensors_like = len(head) == 9 and head[4:8] == b"\0\0\0\0" and head[8:9] == b"{"
            if safetensors_like:
                n = int.from_bytes(head[:8], "little")
                if 2 <= n <= MAX_HEADER_BYTES and 8 + n <= size:
                    raw = b"{" + f.read(n - 1)
                    try:
                        md = _loads(raw).get("__metadata__") or {}
                        return isinstance(md, dict) and md.get("format") == FORMAT
                    except (UnicodeDecodeError, ValueError, AttributeError):
                        return _MARKER in raw  # a damaged kvtool header
                return True  # the header is cut short (or its length damaged): only read_header can tell
            named = os.fspath(path).lower().endswith(".kvc")
            return named and b"\0" in head + f.read(8192)  # binary and named .kvc: never a text document
    except (OSError, ValueError, TypeError):
        return False


def read_header(path: str | os.PathLike[str]) -> KvcHeader:
    """Read and validate the header of a ``.kvc`` file (no tensor data is read, no torch needed).

    Raises a one-line ``UsageError`` when the file is unreadable, truncated or corrupted (header damaged, file
    shorter or longer than its tensors say), not a kvtool cache, or written in an incompatible format version.
    """
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise _corrupt(path, "shorter than a header")
            n = int.from_bytes(raw_len, "little")
            if n < 2 or n > MAX_HEADER_BYTES:
                raise _corrupt(path, f"header length {n} is not plausible")
            if 8 + n > size:
                raise _corrupt(path, f"{size} bytes, but the header alone needs {8 + n}")
            raw = f.read(n)
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        header = _loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise _corrupt(path, f"header is not valid JSON: {str(e).splitlines()[0][:80]}") from None
    md = header.pop("__metadata__", None)
    if not isinstance(md, dict) or md.get("format") != FORMAT:
        raise UsageError(f"{path} is not a kvtool cache (.kvc): no {FORMAT!r} marker in its metadata")
    meta = _parse_meta(path, md)
    _check_version(path, md, meta)
    tensors: dict[str, dict[str, Any]] = {}
    end = 0
    for name, info in header.items():
        try:
            start, stop = (int(x) for x in info["data_offsets"])
            shape = [int(x) for x in info["shape"]]
            dtype = str(info["dtype"])
        except (KeyError, TypeError, ValueError):
            raise _corrupt(path, f"bad entry for tensor {name!r}") from None
        if not 0 <= start <= stop or dtype not in _ST_BYTES:
            raise _corrupt(path, f"bad entry for tensor {name!r}")
        count = 1
        for s in shape:
            count *= s
        if count * _ST_BYTES[dtype] != stop - start:
            raise _corrupt(path, f"tensor {name!r} has {stop - start} bytes for shape {shape}")
        tensors[name] = {"dtype": dtype, "shape": shape, "data_offsets": [start, stop]}
        end = max(end, stop)
    expected = 8 + n + end
    if size < expected:
        raise _corrupt(path, f"{size} bytes on disk, {expected} expected")
    if size > expected:
        raise _corrupt(path, f"{size - expected} unexpected bytes after the tensor data")
    _check_meta_digest(path, meta)
    validate_meta(path, meta, tensors)
    return KvcHeader(path=path, size=size, header_bytes=8 + n, meta=meta, tensors=tensors)


def meta_digest(meta: dict[str, Any]) -> str:
    """SHA-256 of the metadata (itself excluded), canonical JSON: a damaged budget or layout is caught too."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=True).encode()).hexdigest()


def _check_meta_digest(path: str, meta: dict[str, Any]) -> None:
    want = meta.get("meta_sha256")
    if want is not None and want != meta_digest(meta):
        raise _corrupt(path, "metadata does not match its checksum")


# -- the metadata schema, checked once by read_header for every reader (ask, summarize, inspect) ----------------
def _is_int(v: Any, lo: int = 0, hi: int = MAX_INT) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _opt_int(lo: int = 0) -> Any:
    return lambda v: v is None or _is_int(v, lo)


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _opt_str(v: Any) -> bool:
    return v is None or isinstance(v, str)


def _dtype(v: Any) -> bool:
    return isinstance(v, str) and v in _DTYPE_BYTES


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


#: section -> {key: check}; a section, when present, must be an object whose listed keys pass their check
#: (``load_cache`` then requires the sections it uses). Types are checked before any value is used.
_SCHEMA: dict[str, dict[str, Any]] = {
    "model": {"name": _opt_str, "identity": _opt_str, "source": _opt_str, "dims": lambda v: isinstance(v, dict)
              and all(_is_int(v.get(k), 1, 2**20) for k in ("num_layers", "num_kv_heads", "num_attention_heads",
                                                               "head_dim"))},
    "policy": {"spec": _str, "options": lambda v: isinstance(v, dict)},
    "settings": {"policy": _str, "policy_options": lambda v: v is None or isinstance(v, dict),
                 "budget": lambda v: v is None or isinstance(v, (str, int)), "budget_tokens": _opt_int(1),
                 "block_size": lambda v: _is_int(v, 1), "sinks": lambda v: _is_int(v), "recent": lambda v: _is_int(v),
                 "positions": _str, "dtype": _dtype, "quantize": _opt_str},
    "prompt": {"prefix": _str, "prefix_tokens": lambda v: _is_int(v)},
    "document": {"name": _str, "sha256": _str, "tokens": lambda v: _is_int(v)},
    "cache": {"seen": lambda v: _is_int(v), "rotary_next": lambda v: v is None or _is_int(v),
              "compact": lambda v: isinstance(v, bool), "compact_since": _opt_int(),
              "pin_start": _opt_int(), "counters": lambda v: v is None or (isinstance(v, dict) and all(
                  _is_int(x) for x in v.values()))},
    "bytes": {"kv_stored": _opt_int(), "kv_promised": _opt_int(), "kv_allocated": _opt_int()},
}
_TOP: dict[str, Any] = {"kvtool_version": _str, "created": _str, "dtype": _dtype,
                        "prefill_seconds": _num, "tensors_sha256": _str, "meta_sha256": _str}


def validate_meta(path: str, meta: dict[str, Any], tensors: dict[str, dict[str, Any]]) -> None:
    """Check the metadata's types and ranges, and its agreement with the tensors' shapes and the document.

    Nothing is allocated from metadata that fails here; every failure is "truncated or corrupted" (exit 2).
    """
    for key, ok in _TOP.items():
        if key in meta and not ok(meta[key]):
            raise _corrupt(path, f"bad metadata value for {key!r}")
    for section, fields in _SCHEMA.items():
        if section not in meta:
            continue
        value = meta[section]
        if not isinstance(value, dict):
            raise _corrupt(path, f"metadata {section!r} is not an object")
        for key, ok in fields.items():
            if key in value and not ok(value[key]):
                raise _corrupt(path, f"bad metadata value for {section}.{key}")
    if "layout" in meta:
        _validate_layout(path, meta, tensors)
    doc, prompt_, cache = meta.get("document"), meta.get("prompt"), meta.get("cache")
    if doc and prompt_ and cache and {"tokens"} <= doc.keys() and "prefix_tokens" in prompt_ and "seen" in cache:
        if doc["tokens"] + prompt_["prefix_tokens"] != cache["seen"]:
            raise _corrupt(path, f"the cache has seen {cache['seen']} tokens, the document and prefix are "
                                 f"{doc['tokens'] + prompt_['prefix_tokens']}")


def _validate_layout(path: str, meta: dict[str, Any], tensors: dict[str, dict[str, Any]]) -> None:
    layout = meta["layout"]
    dims = (meta.get("model") or {}).get("dims") or {}
    seen = (meta.get("cache") or {}).get("seen")
    if not isinstance(layout, list) or not all(isinstance(row, list) for row in layout):
        raise _corrupt(path, "bad layout metadata")
    if dims and len(layout) != dims["num_layers"]:
        raise _corrupt(path, f"layout has {len(layout)} layers, the model {dims['num_layers']}")
    for li, row in enumerate(layout):
        for gi, g in enumerate(row):
            where = f"layout of layer {li} group {gi}"
            ok = (isinstance(g, dict) and isinstance(g.get("heads"), list) and g["heads"]
                  and all(_is_int(h, 0, 2**20) for h in g["heads"]) and _opt_int(1)(g.get("capacity"))
                  and isinstance(g.get("compensation", False), bool) and _is_int(g.get("length")))
            if not ok:
                raise _corrupt(path, f"bad {where}")
            info = tensors.get(f"l{li}.g{gi}.positions")
            keys = tensors.get(f"l{li}.g{gi}.keys")
            if info is None or keys is None:
                raise _corrupt(path, f"missing tensors for {where}")
            h, n, cap = len(g["heads"]), g["length"], g["capacity"]
            off = 1 if g.get("compensation") else 0
            if info["shape"] != [h, n] or len(keys["shape"]) != 3 or keys["shape"][:2] != [h, off + n]:
                raise _corrupt(path, f"{where} says {h} heads x {n} tokens, the tensors are {keys['shape']}")
            if dims and keys["shape"][2] != dims["head_dim"]:
                raise _corrupt(path, f"{where}: head size {keys['shape'][2]}, the model's is {dims['head_dim']}")
            if cap is not None and n > cap:
                raise _corrupt(path, f"{where} holds {n} tokens, more than its capacity {cap}")
            if seen is not None and n > seen:
                raise _corrupt(path, f"{where} holds {n} tokens, but only {seen} were seen")


def _parse_meta(path: str, md: dict[str, Any]) -> dict[str, Any]:
    text = md.get(META_KEY)
    if not isinstance(text, str):
        raise _corrupt(path, f"no {META_KEY!r} metadata")
    try:
        meta = _loads(text)
    except ValueError:
        raise _corrupt(path, f"{META_KEY!r} metadata is not valid JSON") from None
    if not isinstance(meta, dict):
        raise _corrupt(path, f"{META_KEY!r} metadata is not a JSON object")
    return meta


def _check_version(path: str, md: dict[str, Any], meta: dict[str, Any]) -> None:
    raw = md.get("format_version", meta.get("format_version"))
    try:
        version = int(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise _corrupt(path, f"format_version {raw!r} is not a number") from None
    if MIN_FORMAT_VERSION <= version <= FORMAT_VERSION:
        return
    writer = meta.get("kvtool_version", "unknown")
    supported = f"{MIN_FORMAT_VERSION}-{FORMAT_VERSION}" if MIN_FORMAT_VERSION < FORMAT_VERSION else str(FORMAT_VERSION)
    hint = "upgrade kvtool" if version > FORMAT_VERSION else "prefill it again with this kvtool"
    raise UsageError(
        f"{path} was written by kvtool {writer} (kvc format {version}); this kvtool {__version__} reads kvc "
        f"format {supported}: {hint}"
    )


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
    _require(meta, header.path, "settings")
    stored: dict[str, Any] = meta["settings"]
    if not isinstance(stored, dict):
        raise _corrupt(header.path, "settings is not an object")
    _require(stored, header.path, *FIXED_SETTINGS, "budget_tokens")
    out = dict(overrides)
    for key in FIXED_SETTINGS:
        given = overrides.get(key)
        if given is not None and not (key == "dtype" and str(given).strip().lower() == "auto"):
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
        return _DTYPE_ALIASES.get(str(given).strip().lower()) == want
    if key == "positions":
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
    from kvtool.runtime.settings import budget_tokens_from_bytes, parse_budget

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
    try:
        tokens = budget_tokens_from_bytes(
            b.nbytes or 0, int(dims["num_layers"]), int(dims["num_kv_heads"]), int(dims["head_dim"]),
            _DTYPE_BYTES[stored["dtype"]], int(dims.get("sliding_layers", 0)), int(dims.get("sliding_window", 0)),
        )
    except (KeyError, TypeError, ValueError, UsageError):
        return False
    return tokens == stored["budget_tokens"]


# -- writing ----------------------------------------------------------------------------------------------------
def check_output(path: str | os.PathLike[str], force: bool = False, source: str | None = None) -> str:
    """Validate an output path before any work is done; returns it as a string.

    Refuses an existing file without ``force``, a directory, a missing or non-directory parent, an
    unwritable directory, and the input document itself.
    """
    path = os.fspath(path)
    if not path or path.endswith(os.sep):
        raise UsageError(f"output path {path!r} is not a file name")
    if os.path.isdir(path):
        raise UsageError(f"output {path} is a directory")
    if source is not None and source != "-" and os.path.exists(source) and os.path.exists(path):
        with contextlib.suppress(OSError):
            if os.path.samefile(source, path):
                raise UsageError(f"output {path} is the input document; choose another -o")
    if os.path.lexists(path) and not force:
        raise UsageError(f"output {path} already exists; use --force to overwrite it")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(parent):
        raise UsageError(f"cannot write {path}: directory {parent} does not exist")
    if not os.path.isdir(parent):
        raise UsageError(f"cannot write {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write {path}: directory {parent} is not writable")
    return path


def tensors_digest(tensors: dict[str, Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order (detects damaged data)."""
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{_dtype_name(t.dtype)}|{list(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_kvc(path: str | os.PathLike[str], tensors: dict[str, Tensor], meta: dict[str, Any],
              force: bool = False) -> int:
    """Write tensors + ``meta`` as a ``.kvc`` file, atomically; returns the file size.

    The file is written to a temp file in the target directory, fsynced and renamed into place. Without
    ``force`` the final step is a hard link, which fails if the path appeared meanwhile (never clobbers).
    On any failure the temp file is removed and ``path`` is untouched.
    """
    import torch
    from safetensors.torch import save_file

    path = check_output(path, force)
    cpu: dict[str, Tensor] = {}
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        small = t.numel() == 0 or (int(t.max()) < 2**31 and int(t.min()) >= -(2**31))
        if name.endswith((".positions", ".rotary")) and t.dtype == torch.long and small:
            t = t.to(torch.int32)  # stream and RoPE positions fit int32: 4 bytes per token and head saved
        cpu[name] = t
    meta = dict(meta)
    meta["format"] = FORMAT
    meta["format_version"] = FORMAT_VERSION
    meta.setdefault("kvtool_version", __version__)
    meta["tensors_sha256"] = tensors_digest(cpu)
    meta = _jsonable(meta)
    meta["meta_sha256"] = meta_digest(meta)
    metadata = {"format": FORMAT, "format_version": str(FORMAT_VERSION), META_KEY: json.dumps(meta, sort_keys=True)}

    directory = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp", dir=directory)
    except OSError as e:
        raise _write_error(path, e) from None
    try:
        os.close(fd)
        save_file(cpu, tmp, metadata=metadata)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a cache file is an ordinary file
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        if force:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise UsageError(f"output {path} already exists; use --force to overwrite it") from None
            except OSError:  # no hard links on this filesystem: best effort no-clobber
                if os.path.lexists(path):
                    raise UsageError(f"output {path} already exists; use --force to overwrite it") from None
                os.replace(tmp, path)
        _fsync_dir(directory)
    except KvtoolError:
        raise
    except OSError as e:
        raise _write_error(path, e) from None
    except Exception as e:  # a safetensors failure: one line, never a traceback
        raise KvtoolError(f"cannot write {path}: {type(e).__name__}: {str(e).strip()[:200]}") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return os.path.getsize(path)


def _write_error(path: str, e: OSError) -> KvtoolError:
    why = e.strerror or str(e)
    if isinstance(e, (PermissionError, FileNotFoundError, NotADirectoryError, IsADirectoryError)):
        return UsageError(f"cannot write {path}: {why}")
    return KvtoolError(f"cannot write {path}: {why}")


def _fsync_dir(directory: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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
    kv_stored = sum(t.numel() * t.element_size() for n, t in tensors.items() if n.endswith((".keys", ".values")))
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
        "dtype": _dtype_name(loaded.dtype),
        "quantize": loaded.quantize,
        "policy": {"spec": session.policy.spec, "options": _jsonable(session.policy.options())},
        "settings": {
            "policy": s.policy,
            "policy_options": dict(s.policy_options),
            "budget": s.budget,
            "budget_tokens": session.budget_tokens,
            "block_size": s.block_size,
            "sinks": s.sinks,
            "recent": s.recent,
            "positions": s.positions,
            "dtype": _dtype_name(loaded.dtype),
            "quantize": loaded.quantize,
        },
        "prompt": {"prefix": prefix, "prefix_tokens": int(read.prefix_tokens)},
        "document": {
            "name": read.name, "sha256": read.sha256, "tokens": int(read.document_tokens), "format": read.fmt,
            **({"source_map": read.source.meta()} if read.source is not None else {}),
        },
        "cache": {
            **_jsonable(scalars),
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

    With recall on, the archive of evicted tokens goes to a sibling file ``<path>.archive`` (written
    first, same atomic write), which the ``.kvc`` names and checksums (docs/kvc-format.md).
    """
    tensors, scalars = read.snapshot if read.snapshot is not None else read.cache.snapshot()
    meta = build_meta(session, read, tensors, scalars)
    archived = archive_tensors(read.cache)
    if archived:
        from kvtool.core import recall

        check_output(path, force)  # fail before writing the (larger) archive
        apath = archive_path(path)
        size = write_kvc(apath, archived, {"archive_of": os.path.basename(os.fspath(path))}, force=True)
        meta["archive"] = {
            "file": os.path.basename(apath),
            "tensors_sha256": tensors_digest(_as_saved(archived)),
            "bytes": int(size),
            "page_size": _page_size(read.cache),
            "dtype": recall.archive_dtype(read.cache),
            "tokens": recall.archived_tokens(read.cache),
            "pages": int(sum(g.archive.pages * g.num_heads for g in read.cache.groups() if g.archive)),
        }
        try:
            return write_kvc(path, tensors, meta, force=force)
        except BaseException:  # no orphan archive beside a cache that was not written
            with contextlib.suppress(OSError):
                os.unlink(apath)
            raise
    return write_kvc(path, tensors, meta, force=force)


def archive_path(path: str | os.PathLike[str]) -> str:
    """Where the archive of the cache ``path`` lives: a sibling file ``<path>.archive``."""
    return os.fspath(path) + ".archive"


def archive_tensors(cache: Any) -> dict[str, Tensor]:
    """Every group archive's tensors (empty when the cache archived nothing)."""
    out: dict[str, Tensor] = {}
    for li, layer in enumerate(cache.layers):
        for gi, g in enumerate(layer.groups):
            if g.archive is not None and g.archive.length:
                out.update(g.archive.state_dict(f"l{li}.g{gi}"))
    return out


def _page_size(cache: Any) -> int:
    return next(g.archive.page_size for g in cache.groups() if g.archive is not None)


def _as_saved(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The tensors as ``write_kvc`` stores them (positions as int32), for the checksum the .kvc records."""
    import torch

    return {n: (t.to(torch.int32) if n.endswith(".positions") else t) for n, t in tensors.items()}


def load_archive(path: str, meta: dict[str, Any], cache: Any) -> str | None:
    """Fill ``cache``'s archives from the ``.kvc``'s sibling archive; returns a warning instead of failing.

    A missing, truncated or damaged archive (or one from another cache) leaves the archives empty: the
    questions are answered without recall, and the caller says so.
    """
    info = meta.get("archive")
    if not info:
        return f"{path} has no archive of evicted tokens: answering without recall (prefill with --recall)"
    from kvtool.core import recall

    saved, ours = info.get("dtype"), recall.archive_dtype(cache)
    if saved is not None and ours is not None and saved != ours:  # rows of another width: decided before reading
        return (f"{path}'s archive stores keys/values in {saved}, this run archives in {ours}: answering "
                f"without recall (pass --archive-dtype {saved})")
    apath = os.path.join(os.path.dirname(os.path.abspath(path)), str(info.get("file", "")))
    try:
        header = read_header(apath)
        tensors = load_tensors(header)
        if tensors_digest(_as_saved(tensors)) != info.get("tensors_sha256"):
            raise UsageError("checksum mismatch")
        page_size = int(info["page_size"])
        for li, layer in enumerate(cache.layers):
            for gi, g in enumerate(layer.groups):
                if g.archive is not None and f"l{li}.g{gi}.rows" in tensors:
                    g.archive.load_state_dict(tensors, f"l{li}.g{gi}", page_size)
    except (UsageError, OSError, ValueError, KeyError, TypeError) as e:
        for g in cache.groups():
            if g.archive is not None:
                g.archive.close()
                g.archive.length = 0
        why = str(e).split(":")[-1].strip() or type(e).__name__
        return f"the archive {apath} is missing or damaged ({why[:80]}): answering without recall"
    return None


# -- loading ----------------------------------------------------------------------------------------------------
def load_tensors(header: KvcHeader, device: Any = "cpu") -> dict[str, Tensor]:
    """The file's tensors, checked against the header's checksum; positions come back as int64."""
    import torch
    from safetensors.torch import load_file

    try:
        tensors = load_file(header.path, device="cpu")
    except Exception as e:  # SafetensorError, OSError: the file changed or is damaged
        raise _corrupt(header.path, str(e).strip().splitlines()[0][:120] if str(e).strip() else "") from None
    want = header.meta.get("tensors_sha256")
    if want is not None and tensors_digest(tensors) != want:
        raise _corrupt(header.path, "tensor data does not match its checksum")
    out = {}
    for name, t in tensors.items():
        if name.endswith((".positions", ".rotary")):
            t = t.to(torch.long)
        out[name] = t.to(device) if str(device) != "cpu" else t
    return out


def load_cache(path: str | os.PathLike[str], session: Session) -> ReadResult:
    """Load a ``.kvc`` into a fresh cache of ``session``'s engine; returns a ``ReadResult`` like ``read``.

    Checks, each a one-line ``UsageError``: the model identity and dtype, the engine settings (policy,
    options, budget, block size, sinks, recent, positions), the chat-template prefix and the head layout.
    """
    from kvtool.core.events import Note
    from kvtool.runtime import prompt
    from kvtool.runtime.citations import SourceMap
    from kvtool.runtime.session import ReadResult

    t0 = time.perf_counter()
    header = read_header(path)
    p = header.path
    meta = header.meta
    _require(meta, p, "model", "dtype", "settings", "policy", "prompt", "document", "cache", "layout")
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
    dtype = _dtype_name(loaded.dtype)
    if meta["dtype"] != dtype:
        raise UsageError(f"{p} was made in {meta['dtype']}, this run uses {dtype}; pass --dtype {meta['dtype']}")
    _check_engine(p, meta, session)
    prefix = prompt.document_prefix(session.tokenizer)
    if prefix != meta["prompt"].get("prefix"):
        raise UsageError(
            f"{p} was made with another chat template (the text before the document differs); prefill again"
        )
    cache = session.engine.new_cache()
    _check_layout(p, meta["layout"], cache)
    tensors = load_tensors(header)
    expected = set(cache.state_dict())
    if set(tensors) != expected:
        missing = sorted(expected - set(tensors))
        raise _corrupt(p, f"missing tensor {missing[0]}" if missing else "unexpected tensors")
    scalars = meta["cache"]
    try:
        cache.load(tensors, scalars)
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise _corrupt(p, str(e).splitlines()[0][:160] if str(e) else type(e).__name__) from None
    for key, value in (scalars.get("counters") or {}).items():
        if hasattr(cache.counters, key) and isinstance(value, int):
            setattr(cache.counters, key, value)
    doc = meta["document"]
    source = None
    if isinstance(doc.get("source_map"), dict):  # absent in caches from before citations: --cite says so
        try:
            source = SourceMap.from_meta(doc["source_map"])
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise _corrupt(p, f"bad source map: {str(e).splitlines()[0][:120] if str(e) else type(e).__name__}") \
                from None
    result = ReadResult(
        cache=cache,
        document_tokens=int(doc.get("tokens", 0)),
        prefix_tokens=int(meta["prompt"].get("prefix_tokens", 0)),
        seconds=float(meta.get("prefill_seconds", 0.0) or 0.0),
        sha256=str(doc.get("sha256", "")),
        name=str(doc.get("name", "")),
        loaded_from=str(p),
        load_seconds=time.perf_counter() - t0,
        source=source,
        fmt=str(doc.get("format", "text")),
    )
    if session.recall_tokens:
        warning = load_archive(p, meta, cache)
        if warning:
            session.emit(Note(f"warning: {warning}"))
    result.snapshot = cache.snapshot()
    session.last_read = result
    session.emit(Note(
        f"loaded {p}: {doc.get('name')} ({result.document_tokens:,} tokens), {format_bytes(header.size)}, "
        f"made by kvtool {meta.get('kvtool_version')} on {meta.get('created', '?')}"
    ))  # fmt: skip
    return result


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
        ("policy options", meta["policy"].get("options"), _jsonable(session.policy.options())),
    ]
    for what, want, have in checks:
        if want != have:
            raise UsageError(f"{path} was made with {what} {_brief(want)}, this run has {_brief(have)}; "
                             "use the same settings (and no profile that changes them) or prefill again")


def _brief(value: Any) -> str:
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True, default=str)
    return str(value)


def _check_layout(path: str, layout: Any, cache: Any) -> None:
    ours = [[(list(g.heads), g.capacity, bool(g.compensation)) for g in layer.groups] for layer in cache.layers]
    try:
        theirs = [[(list(g["heads"]), g["capacity"], bool(g["compensation"])) for g in layer] for layer in layout]
    except (KeyError, TypeError):
        raise _corrupt(path, "bad layout metadata") from None
    if ours != theirs:
        raise UsageError(
            f"{path} has another head layout than this run's cache (a different calibration?); prefill again"
        )
    fields = [[list(g.state_fields) for g in layer.groups] for layer in cache.layers]
    saved = [[list(g.get("state_fields", [])) if isinstance(g, dict) else [] for g in layer] for layer in layout]
    if fields != saved:  # e.g. a keydiff cache from before its per-token 1/‖k‖ (0.2)
        raise UsageError(f"{path} keeps per-token policy state {saved[0][0]}, this kvtool's policy keeps "
                         f"{fields[0][0]}; prefill it again with this kvtool")


# -- inspecting -------------------------------------------------------------------------------------------------
def describe(header: KvcHeader) -> dict[str, Any]:
    """What ``kvtool inspect --json`` prints: the metadata, per-layer lengths and sizes (no model needed)."""
    meta = header.meta
    lengths = header.layer_lengths()
    layout = meta.get("layout") or []
    layers = []
    for li, row in enumerate(lengths):
        groups = []
        for gi, n in enumerate(row):
            info = layout[li][gi] if li < len(layout) and gi < len(layout[li]) else {}
            groups.append({"heads": info.get("heads"), "capacity": info.get("capacity"), "length": n,
                           "compensation": info.get("compensation", False)})
        layers.append({"layer": li, "groups": groups})
    promised = (meta.get("bytes") or {}).get("kv_promised")
    smap = (meta.get("document") or {}).get("source_map")
    if isinstance(smap, dict):  # the packed per-token arrays are for --cite, not for reading: show their size
        meta = {**meta, "document": {**meta["document"], "source_map": {
            k: v for k, v in smap.items() if k not in ("positions", "spans", "ids")}}}
    return {
        "path": header.path,
        "size_bytes": header.size,
        "header_bytes": header.header_bytes,
        "kv_bytes": header.kv_bytes,
        "kv_promised_bytes": promised,
        "metadata": meta,
        "layers": layers,
        "archive": meta.get("archive"),
    }
