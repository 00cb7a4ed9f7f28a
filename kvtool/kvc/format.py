"""The ``.kvc`` container: detection, header parsing, the metadata schema and its checksum (no torch).

A ``.kvc`` file is a plain safetensors file (see ``docs/kvc-format.md``)::

    8 bytes   little-endian length N of the JSON header
    N bytes   JSON header: "__metadata__" {format, format_version, kvtool: <JSON text>} + one entry per tensor
    ...       tensor data: per layer l and head group g, l{l}.g{g}.keys / .values / .positions / .rotary / .state
              (and .comp_key_sum / .comp_value_sum / .comp_count for RazorAttention's compensated heads;
              .key_scale / .value_scale for int8 / int4 K/V, ``--kv-dtype``)

Every file is written as format ``FORMAT_VERSION`` (3). Formats 1 and 2 were written before document text
was kept apart from control tokens: their caches may hold a document's ``<|im_end|>`` as the real control
token, so they are refused with a line that says so (prefill again). A file that needs something an older
kvtool would misread lists it in ``required_features``; a feature this kvtool does not know is refused in
one line as well, so a later feature needs no new version.

Everything here reads the header only, so ``kvtool inspect`` and input detection stay instant and never
import torch. Every value a reader later allocates from is checked here first: types, ranges, agreement
between the layout and the tensor shapes, and the metadata's own checksum, which is required.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
from dataclasses import dataclass
from typing import Any

from kvtool import __version__
from kvtool.config import DTYPE_BYTES, KV_DTYPES
from kvtool.errors import UsageError, first_line, shown
from kvtool.fileio import open_regular

FORMAT = "kvtool-kvc"
FORMAT_VERSION = 3  # what every file is written as; bump on any change an older kvtool misreads
READ_FORMAT_VERSION = 3  # newest format this kvtool loads
#: oldest format this kvtool still loads: the first whose document tokens are plain text (a document's
#: ``<|im_end|>`` its characters, not the control token)
MIN_FORMAT_VERSION = 3
#: what formats 1 (no required features) and 2 (with them) lack, in the line that refuses them
_BEFORE_PLAIN_TEXT = "written before document text was kept apart from control tokens"
#: features a file may require that this kvtool reads: ``kv_dtype`` = K/V stored in another format than the
#: model's dtype (``--kv-dtype``: a narrower float, or int8 / int4 codes with per-token scales)
KNOWN_FEATURES = ("kv_dtype",)
META_KEY = "kvtool"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # sanity limit on the JSON header
_MARKER = b'"' + FORMAT.encode() + b'"'

#: K/V dtypes a cache may hold (the archive may also hold int8)
MODEL_DTYPES = tuple(d for d in DTYPE_BYTES if d != "int8")
# safetensors dtype codes -> bytes per element (for sizes computed from the header alone)
ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
#: safetensors dtype codes -> the dtype names the tensor checksum spells (torch's)
ST_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
            "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
#: an archive's name: ``<cache file name>.<16 hex digits>.archive`` (``<cache file name>.archive`` before the id)
_ARCHIVE_ID = re.compile(r"[0-9a-f]{16}")


@dataclass
class KvcHeader:
    """What the header of a ``.kvc`` file says (read without touching the tensor data)."""

    path: str
    size: int  # bytes on disk
    header_bytes: int  # 8 + length of the JSON header
    meta: dict[str, Any]  # the ``kvtool`` JSON document (see docs/kvc-format.md)
    tensors: dict[str, dict[str, Any]]  # name -> {"dtype", "shape", "data_offsets"}

    @property
    def data_start(self) -> int:
        """Offset of the tensor data in the file (``data_offsets`` count from here)."""
        return self.header_bytes

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V in the file (compensation slots included): what the budget promises to bound."""
        kv = (".keys", ".values", ".key_scale", ".value_scale")
        return sum(_nbytes(info) for name, info in self.tensors.items() if name.endswith(kv))

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


def jsonable(value: Any) -> Any:
    """Policy options and the like as plain JSON values (anything else becomes its text)."""
    return json.loads(json.dumps(value, default=str, sort_keys=True))


MAX_INT = 2**40  # no count, capacity or position in a real cache comes near this


#: JSON objects a header may hold (one per tensor, plus the metadata's): a real cache lists a few thousand
#: tensors; 1.2 million empty ones would cost gigabytes of dicts before any check could look at them
MAX_OBJECTS = 1 << 16


def loads(text: str | bytes, max_objects: int | None = None) -> Any:
    """``json.loads`` whose deep nesting is a ``ValueError`` (damage), not a ``RecursionError``.

    json's C scanner guards its recursion, so 200,000 nested brackets end in a catchable ``RecursionError``
    after a bounded amount of work; a real header nests five levels deep. ``max_objects``: parsing stops
    (``ValueError``) at that many JSON objects, before the rest is built.
    """
    hook = None
    if max_objects is not None:
        count = 0

        def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
            nonlocal count
            count += 1
            if count > max_objects:
                raise ValueError(f"more than {max_objects:,} JSON objects")
            return dict(pairs)

    try:
        return json.loads(text.decode("utf-8") if isinstance(text, bytes) else text, object_pairs_hook=hook,
                          parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _no_constant(name: str) -> Any:
    """``NaN``/``Infinity`` are not JSON: a number a header holds is finite, so that ``--json`` stays valid JSON."""
    raise ValueError(f"{name} is not a JSON number")


def corrupt(path: str, why: str = "") -> UsageError:
    detail = f" ({why})" if why else ""
    return UsageError(f"{path} is truncated or corrupted{detail}; prefill it again")


def require(meta: dict[str, Any], path: str, *keys: str) -> None:
    missing = [k for k in keys if k not in meta]
    if missing:
        raise corrupt(path, f"metadata lacks {', '.join(missing)}")


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
        # and never wait on one: the name may have become a FIFO since (the open file itself is checked)
        with os.fdopen(open_regular(path, follow=True), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(9)
            safetensors_like = len(head) == 9 and head[4:8] == b"\0\0\0\0" and head[8:9] == b"{"
            if safetensors_like:
                n = int.from_bytes(head[:8], "little")
                if 2 <= n <= MAX_HEADER_BYTES and 8 + n <= size:
                    raw = b"{" + f.read(n - 1)
                    try:
                        md = loads(raw).get("__metadata__") or {}
                        return isinstance(md, dict) and md.get("format") == FORMAT
                    except (UnicodeDecodeError, ValueError, AttributeError):
                        return _MARKER in raw  # a damaged kvtool header
                return True  # the header is cut short (or its length damaged): only read_header can tell
            named = os.fspath(path).lower().endswith(".kvc")
            return named and b"\0" in head + f.read(8192)  # binary and named .kvc: never a text document
    except (OSError, ValueError, TypeError):
        return False


def read_header(path: str | os.PathLike[str], fd: int | None = None) -> KvcHeader:
    """Read and validate the header of a ``.kvc`` file (no tensor data is read, no torch needed).

    ``fd``: read through this open descriptor instead of opening ``path`` (a confined, no-follow open of
    an archive; ``path`` then only names it in messages). Raises a one-line ``UsageError`` when the file is
    unreadable, truncated or corrupted (header damaged, file shorter or longer than its tensors say, the
    metadata checksum missing or wrong), not a kvtool cache, or written in an incompatible format version.
    """
    path = os.fspath(path)
    try:
        if fd is None:
            with os.fdopen(open_regular(path, follow=True), "rb") as f:  # a FIFO is refused, never waited on
                size, n, raw = _read_raw(path, f.fileno())
        else:
            size, n, raw = _read_raw(path, fd)
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        header = loads(raw, MAX_OBJECTS)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise corrupt(path, f"header is not valid JSON: {first_line(e, 80)}") from None
    md = header.pop("__metadata__", None)
    if not isinstance(md, dict) or md.get("format") != FORMAT:
        raise UsageError(f"{path} is not a kvtool cache (.kvc): no {FORMAT!r} marker in its metadata")
    meta = _parse_meta(path, md)
    _check_version(path, md, meta)
    tensors = _parse_tensors(path, header, size - 8 - n)
    _check_meta_digest(path, meta)
    validate_meta(path, meta, tensors)
    return KvcHeader(path=path, size=size, header_bytes=8 + n, meta=meta, tensors=tensors)


def _read_raw(path: str, fd: int) -> tuple[int, int, bytes]:
    """(file size, header length, header bytes) read with ``pread`` (the descriptor's offset is not used)."""
    size = os.fstat(fd).st_size
    raw_len = os.pread(fd, 8, 0)
    if len(raw_len) < 8:
        raise corrupt(path, "shorter than a header")
    n = int.from_bytes(raw_len, "little")
    if n < 2 or n > MAX_HEADER_BYTES:
        raise corrupt(path, "header length is not plausible")
    if 8 + n > size:
        raise corrupt(path, "the file is shorter than its header says")
    chunks, got = [], 0
    while got < n:
        chunk = os.pread(fd, min(n - got, 1 << 24), 8 + got)
        if not chunk:
            raise corrupt(path, "the file is shorter than its header says")
        chunks.append(chunk)
        got += len(chunk)
    return size, n, b"".join(chunks)


def _parse_tensors(path: str, header: dict[str, Any], data_bytes: int) -> dict[str, dict[str, Any]]:
    """The tensor entries, each checked (dtype, shape, offsets); together they must fill the data exactly."""
    tensors: dict[str, dict[str, Any]] = {}
    end = 0
    for name, info in header.items():
        try:
            start, stop = (int(x) for x in info["data_offsets"])
            shape = [int(x) for x in info["shape"]]
            dtype = str(info["dtype"])
        except (KeyError, TypeError, ValueError):
            raise corrupt(path, f"bad entry for tensor {name!r:.80}") from None
        if not 0 <= start <= stop or dtype not in ST_BYTES or any(s < 0 for s in shape):
            raise corrupt(path, f"bad entry for tensor {name!r:.80}")
        count = 1
        for s in shape:
            count *= s
        if count * ST_BYTES[dtype] != stop - start:
            raise corrupt(path, f"tensor {name!r:.80} has {stop - start} bytes for shape {shape}")
        tensors[name] = {"dtype": dtype, "shape": shape, "data_offsets": [start, stop]}
        end = max(end, stop)
    if data_bytes < end:
        raise corrupt(path, f"{data_bytes} bytes of tensor data, {end} expected")
    if data_bytes > end:
        raise corrupt(path, f"{data_bytes - end} unexpected bytes after the tensor data")
    return tensors


class TensorDigest:
    """The ``tensors_sha256`` checksum, fed tensor by tensor in name order and chunk by chunk.

    For each tensor: ``name|dtype|shape|`` (dtype as torch spells it, shape as a list), then its raw bytes.
    """

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def begin(self, name: str, code: str, shape: list[int]) -> None:
        self._h.update(f"{name}|{ST_NAMES[code]}|{[int(s) for s in shape]}|".encode())

    def update(self, data: bytes | memoryview) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def new_archive_name(cache_name: str) -> str:
    """A fresh archive name for the cache file ``cache_name`` (a basename): unique per write."""
    return f"{cache_name}.{secrets.token_hex(8)}.archive"


def is_archive_name(cache_name: str, name: str) -> bool:
    """Whether ``name`` is an archive name kvtool gives the cache file ``cache_name`` (with or without an id)."""
    if not name.startswith(cache_name + "."):
        return False
    rest = name[len(cache_name) + 1 :]
    return rest == "archive" or (rest.endswith(".archive") and bool(_ARCHIVE_ID.fullmatch(rest[: -len(".archive")])))


def meta_digest(meta: dict[str, Any]) -> str:
    """SHA-256 of the metadata (itself excluded), canonical JSON: a damaged budget or layout is caught too."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=True).encode()).hexdigest()


def _check_meta_digest(path: str, meta: dict[str, Any]) -> None:
    """Both checksums are required: a file whose ``meta_sha256`` was deleted is as damaged as a wrong one."""
    require(meta, path, "meta_sha256", "tensors_sha256")
    if meta["meta_sha256"] != meta_digest(meta):
        raise corrupt(path, "metadata does not match its checksum")


# -- the metadata schema, checked once by read_header for every reader (ask, summarize, inspect) ----------------
def is_int(v: Any, lo: int = 0, hi: int = MAX_INT) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _opt_int(lo: int = 0) -> Any:
    return lambda v: v is None or is_int(v, lo)


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _opt_str(v: Any) -> bool:
    return v is None or isinstance(v, str)


def _dtype(v: Any) -> bool:
    return isinstance(v, str) and v in MODEL_DTYPES


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


#: section -> {key: check}; a section, when present, must be an object whose listed keys pass their check
#: (``load_cache`` then requires the sections it uses). Types are checked before any value is used.
_SCHEMA: dict[str, dict[str, Any]] = {
    "model": {"name": _opt_str, "identity": _opt_str, "source": _opt_str, "dims": lambda v: isinstance(v, dict)
              and all(is_int(v.get(k), 1, 2**20) for k in ("num_layers", "num_kv_heads", "num_attention_heads",
                                                               "head_dim"))},
    "policy": {"spec": _str, "options": lambda v: isinstance(v, dict)},
    "settings": {"policy": _str, "policy_options": lambda v: v is None or isinstance(v, dict),
                 "budget": lambda v: v is None or isinstance(v, (str, int)), "budget_tokens": _opt_int(1),
                 "block_size": lambda v: is_int(v, 1), "sinks": lambda v: is_int(v), "recent": lambda v: is_int(v),
                 "positions": _str, "dtype": _dtype, "quantize": _opt_str, "kv_dtype": lambda v: v in KV_DTYPES},
    "prompt": {"prefix": _str, "prefix_tokens": lambda v: is_int(v)},
    "document": {"name": _str, "sha256": _str, "tokens": lambda v: is_int(v)},
    "cache": {"seen": lambda v: is_int(v), "rotary_next": lambda v: v is None or is_int(v),
              "compact": lambda v: isinstance(v, bool), "compact_since": _opt_int(),
              "pin_start": _opt_int(), "counters": lambda v: v is None or (isinstance(v, dict) and all(
                  is_int(x) for x in v.values()))},
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
            raise corrupt(path, f"bad metadata value for {key!r}")
    for section, fields in _SCHEMA.items():
        if section not in meta:
            continue
        value = meta[section]
        if not isinstance(value, dict):
            raise corrupt(path, f"metadata {section!r} is not an object")
        for key, ok in fields.items():
            if key in value and not ok(value[key]):
                raise corrupt(path, f"bad metadata value for {section}.{key}")
    if "layout" in meta:
        _validate_layout(path, meta, tensors)
    doc, prompt_, cache = meta.get("document"), meta.get("prompt"), meta.get("cache")
    if doc and prompt_ and cache and {"tokens"} <= doc.keys() and "prefix_tokens" in prompt_ and "seen" in cache:
        if doc["tokens"] + prompt_["prefix_tokens"] != cache["seen"]:
            raise corrupt(path, f"the cache has seen {cache['seen']} tokens, the document and prefix are "
                                 f"{doc['tokens'] + prompt_['prefix_tokens']}")
    if isinstance(doc, dict) and "source_map" in doc:
        _validate_source_map(path, doc["source_map"], doc.get("tokens"))


def _validate_source_map(path: str, smap: Any, tokens: Any) -> None:
    """A source map's entry count is what its packed arrays may decompress to: at most the document's tokens."""
    ok = (isinstance(smap, dict) and is_int(smap.get("entries"), 0, tokens if is_int(tokens) else MAX_INT)
          and is_int(smap.get("first_position")) and all(isinstance(smap.get(k), str)
                                                          for k in ("positions", "spans", "ids")))
    if not ok:
        raise corrupt(path, "bad document.source_map")


def _validate_layout(path: str, meta: dict[str, Any], tensors: dict[str, dict[str, Any]]) -> None:
    layout = meta["layout"]
    dims = (meta.get("model") or {}).get("dims") or {}
    seen = (meta.get("cache") or {}).get("seen")
    if not isinstance(layout, list) or not all(isinstance(row, list) for row in layout):
        raise corrupt(path, "bad layout metadata")
    if dims and len(layout) != dims["num_layers"]:
        raise corrupt(path, f"layout has {len(layout)} layers, the model {dims['num_layers']}")
    groups = {f"l{li}.g{gi}" for li, row in enumerate(layout) for gi in range(len(row))}
    stray = next((name for name in tensors if name.rsplit(".", 1)[0] not in groups), None)
    if stray is not None:
        raise corrupt(path, f"tensor {stray!r:.80} belongs to no layer group of its layout")
    for li, row in enumerate(layout):
        for gi, g in enumerate(row):
            where = f"layout of layer {li} group {gi}"
            ok = (isinstance(g, dict) and isinstance(g.get("heads"), list) and g["heads"]
                  and all(is_int(h, 0, 2**20) for h in g["heads"]) and _opt_int(1)(g.get("capacity"))
                  and isinstance(g.get("compensation", False), bool) and is_int(g.get("length")))
            if not ok:
                raise corrupt(path, f"bad {where}")
            info = tensors.get(f"l{li}.g{gi}.positions")
            keys = tensors.get(f"l{li}.g{gi}.keys")
            if info is None or keys is None:
                raise corrupt(path, f"missing tensors for {where}")
            h, n, cap = len(g["heads"]), g["length"], g["capacity"]
            off = 1 if g.get("compensation") else 0
            if info["shape"] != [h, n] or len(keys["shape"]) != 3 or keys["shape"][:2] != [h, off + n]:
                raise corrupt(path, f"{where} says {h} heads x {n} tokens, the tensors are {keys['shape']}")
            packed = (meta.get("settings") or {}).get("kv_dtype") == "int4"  # two values per byte
            if dims and keys["shape"][2] != (dims["head_dim"] // 2 if packed else dims["head_dim"]):
                raise corrupt(path, f"{where}: head size {keys['shape'][2]}, the model's is {dims['head_dim']}")
            if cap is not None and n > cap:
                raise corrupt(path, f"{where} holds {n} tokens, more than its capacity {cap}")
            if seen is not None and n > seen:
                raise corrupt(path, f"{where} holds {n} tokens, but only {seen} were seen")


def _parse_meta(path: str, md: dict[str, Any]) -> dict[str, Any]:
    text = md.get(META_KEY)
    if not isinstance(text, str):
        raise corrupt(path, f"no {META_KEY!r} metadata")
    try:
        meta = loads(text, MAX_OBJECTS)
    except ValueError:
        raise corrupt(path, f"{META_KEY!r} metadata is not valid JSON") from None
    if not isinstance(meta, dict):
        raise corrupt(path, f"{META_KEY!r} metadata is not a JSON object")
    return meta


def _check_version(path: str, md: dict[str, Any], meta: dict[str, Any]) -> None:
    raw = md.get("format_version", meta.get("format_version"))
    try:
        version = int(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        raise corrupt(path, f"format_version {shown(raw)} is not a number") from None
    writer = shown(meta.get("kvtool_version", "unknown")).strip("'")
    if MIN_FORMAT_VERSION <= version <= READ_FORMAT_VERSION:
        features = meta.get("required_features", [])
        if not isinstance(features, list) or not all(isinstance(f, str) for f in features):
            raise corrupt(path, "bad required_features")
        unknown = [f for f in features if f not in KNOWN_FEATURES]
        if unknown:
            raise UsageError(f"{path} was written by kvtool {writer} and needs {', '.join(unknown)[:200]}, which "
                             f"this kvtool {__version__} does not read: upgrade kvtool")
        return
    if 1 <= version < MIN_FORMAT_VERSION:
        raise UsageError(f"{path} was written by kvtool {writer} (kvc format {version}), {_BEFORE_PLAIN_TEXT}; "
                         "prefill it again")
    supported = f"{MIN_FORMAT_VERSION}-{READ_FORMAT_VERSION}" if MIN_FORMAT_VERSION < READ_FORMAT_VERSION else str(
        READ_FORMAT_VERSION)
    hint = "upgrade kvtool" if version > READ_FORMAT_VERSION else "prefill it again with this kvtool"
    raise UsageError(
        f"{path} was written by kvtool {writer} (kvc format {shown(version)}); this kvtool {__version__} reads kvc "
        f"format {supported}: {hint}"
    )




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
