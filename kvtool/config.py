"""One vocabulary for the settings every layer spells: devices, dtypes, quantization, where files live.

Plain strings and paths only (no torch): the CLI validates with it before heavy imports, the model
loader, the ``.kvc`` format, the memory plan and the settings all read the same names from here.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

from kvtool.errors import UsageError

#: ``--device`` values. ``mps`` is refused here, once, for every command: the engine has not been tested on it.
DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
DEVICE_HELP = "auto, cpu, cuda or cuda:N"

#: model dtypes (``--dtype``); ``auto`` is the checkpoint's own (float32 on CPU)
DTYPES = ("auto", "float32", "float16", "bfloat16")
#: the recall archive's dtypes (``--archive-dtype``); ``auto`` is the model's dtype
ARCHIVE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8")
#: where recalled passages go with compact positions (``--recall-placement``): after the kept tokens, the most
#: relevant nearest the question, or merged back at their document positions
RECALL_PLACEMENTS = ("relevance", "document")
#: the placement every layer defaults to (the settings, the engine, ``recall.recall``)
DEFAULT_RECALL_PLACEMENT = "relevance"
#: how recall selects (``--recall-select``): ``shared`` (one ranking for every head, each question row's attention
#: maximised over the rows, a fixed number of tokens per head), or ``+``-joined variants of it: ``sum`` (the rows'
#: attention summed instead), ``layer`` (each layer recalls by its own heads' ranking), ``grow`` (the tokens per head
#: grow with the archive's square root past ``SCAN``), ``again`` (a second recall after the answer's first
#: ``AGAIN_AFTER`` tokens, their queries voting beside the question's)
RECALL_SELECT_VARIANTS = ("sum", "layer", "grow", "again")
SHARED_RECALL_SELECT = "shared"
#: ``auto``: ``shared`` while every head's archive fits one scan (``SCAN`` archived tokens), ``again`` past it, where
#: the second recall was measured to find what ``shared`` misses and to keep what it finds (docs/results.md, "Far
#: recall"); below the scan the two give the same answers
AUTO_RECALL_SELECT = "auto"
DEFAULT_RECALL_SELECT = AUTO_RECALL_SELECT
#: ``--recall-select again``: answer tokens decoded before the second recall
AGAIN_AFTER = 4


def recall_selection(spec: str, archived: int = 0) -> frozenset[str]:
    """The variants of ``--recall-select`` ``spec``: ``shared`` (none), ``auto`` (``again`` when a head's archive
    holds more than ``SCAN`` tokens: ``archived``, the most any head holds) or ``+``-joined names of
    ``RECALL_SELECT_VARIANTS``; a one-line ``UsageError`` otherwise."""
    parts = [p.strip().lower() for p in str(spec).split("+")]
    if parts == [SHARED_RECALL_SELECT]:
        return frozenset()
    if parts == [AUTO_RECALL_SELECT]:
        return frozenset({"again"}) if archived > SCAN else frozenset()
    bad = [p for p in parts if p not in RECALL_SELECT_VARIANTS]
    if bad or len(set(parts)) != len(parts):
        raise UsageError(f"recall select must be {SHARED_RECALL_SELECT}, {AUTO_RECALL_SELECT} or +-joined variants "
                         f"of {', '.join(RECALL_SELECT_VARIANTS)}, each once (got {spec!r})", field="recall_select")
    return frozenset(parts)


def recall_select_spec(spec: str) -> str:
    """``spec`` normalised: ``auto``, or its variants in ``RECALL_SELECT_VARIANTS`` order (``grow+sum`` is
    ``sum+grow``)."""
    chosen = recall_selection(spec)
    if str(spec).strip().lower() == AUTO_RECALL_SELECT:
        return AUTO_RECALL_SELECT
    return "+".join(v for v in RECALL_SELECT_VARIANTS if v in chosen) or SHARED_RECALL_SELECT
#: how the bounded cache stores K/V (``--kv-dtype``); ``auto`` is the model's compute dtype, int8 / int4 keep
#: one float16 scale per token, KV head and K/V (int4 packs two values per byte)
KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "int4")
#: weight quantization (``--quantize``, bitsandbytes on CUDA)
QUANTIZE = ("none", "8bit", "4bit")
#: bytes per weight of a quantized linear layer: 8-bit one byte (its per-row float32 scales are negligible);
#: 4-bit NF4 half a byte, plus its absmax per block of 64 quantized to one byte, plus a float32 scale per 256
#: such blocks (double quantization), as bitsandbytes stores them
QUANT_BYTES_PER_PARAM: dict[str, float] = {"8bit": 1.0, "4bit": 0.5 + 1 / 64 + 4 / (64 * 256)}

#: every spelling a user or a file may use → the canonical dtype name
DTYPE_ALIASES: dict[str, str] = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "int8": "int8",
}
#: bytes per element of each canonical dtype name
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


def dtype_name(value: object) -> str:
    """The canonical name of a dtype given as a name or alias ("bf16"), or a ``torch.dtype`` (by its repr)."""
    text = str(value).removeprefix("torch.")
    try:
        return DTYPE_ALIASES[text]
    except KeyError:
        raise ValueError(f"unknown dtype {value!r}") from None


#: ``--kv-dtype`` values whose newest tokens are also kept in 16 bits (KIVI's full-precision residual), and how
#: many: int4's perplexity gap at equal tokens falls from +16% to within 1% with 128 (docs/results.md); int8
#: is within 1% without one
KV_WINDOW_TOKENS = {"int4": 128}
#: tokens compact positions rotate per step (``positions.Rotator.rotate``): the float64 angles and float32
#: terms of one step are the rotation's work buffers, however many keys a re-pack turns
ROTATE_CHUNK = 1024
# -- recall's scoring (``core/archive.py``, ``core/recall.py``; ``runtime/memory.py`` plans them) -----------------
#: archived tokens per head whose exact scores recall holds at once; past it, with absolute positions
#: only the pages Quest's bound ranks best are scored (bounded work per question), and with compact
#: positions every token is, held up to ``SCAN_BYTES`` of scores and else in two passes (the bound's
#: summaries sit at original positions, the question at compact ones, so the bound does not hold across
#: the two frames)
SCAN = 32768
#: the held scores ([h, rows, scanned] float32) are recall's largest transient buffer: a long
#: question holds fewer tokens' scores rather than allocate more than this
SCAN_BYTES = 64 << 20
#: pages whose keys are read at once while scanning (fewer when their scores would pass ``SCORE_BYTES``)
SCAN_CHUNK = 16
#: scores ([h, rows, tokens] float32) computed at once: a chunk of archived or of kept tokens
SCORE_BYTES = 16 << 20


def kvtool_home() -> Path:
    """kvtool's per-user directory: ``$KVTOOL_HOME``, else ``$XDG_CACHE_HOME/kvtool``, else ``~/.cache/kvtool``.

    It holds converted models and user profiles (everything in it can be rebuilt), hence the XDG *cache*
    directory. Empty variables count as unset; a relative ``$XDG_CACHE_HOME`` is ignored, as the XDG spec says.
    A path that cannot be a directory (it, or a directory above it, is a file) is a usage error (exit 2)
    naming the variable, before anything is written there.
    """
    home = os.environ.get("KVTOOL_HOME", "").strip()
    if home:
        return _directory(Path(home).expanduser(), "KVTOOL_HOME")
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if xdg and os.path.isabs(os.path.expanduser(xdg)):
        return _directory(Path(xdg).expanduser(), "XDG_CACHE_HOME") / "kvtool"
    return Path.home() / ".cache" / "kvtool"


def _directory(path: Path, variable: str) -> Path:
    """``path`` when it is, or can become, a directory: the nearest part of it that exists is one."""
    for part in (path, *path.parents):
        if os.path.lexists(part):
            if not part.is_dir():
                what = "is" if part == path else f"is under {part}, which is"
                raise UsageError(f"{variable}={path} {what} not a directory (it holds kvtool's converted models, "
                                 "profiles and calibrations)")
            break
    return path


def packaged_profiles_dir() -> Path:
    """The profiles that ship inside the package (``kvtool/profiles/*.yaml``)."""
    return Path(__file__).resolve().parent / "profiles"


def profile_dirs() -> list[Path]:
    """Where a profile named without a path is looked up, in order: ``./profiles``, the user's
    ``$KVTOOL_HOME/profiles``, then the packaged ones (duplicates removed)."""
    out: list[Path] = []
    seen: set[Path] = set()
    for d in (Path.cwd() / "profiles", kvtool_home() / "profiles", packaged_profiles_dir()):
        key = d.resolve() if d.exists() else d
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


#: bytes of float32 attention probabilities one chunk of query rows may take (``core/attention.py``): a GPU-sized
#: block over a long budget (Llama-3.1-8B, block 1,024 over 5K keys: 640 MiB per layer at once) is scored in
#: chunks instead, so the working set stays bounded whatever the block (the memory plan counts one chunk)
PROBS_CHUNK_BYTES = 64 << 20


def probs_chunk_rows(attention_heads: int, keys: int) -> int:
    """Query rows per chunk of explicit probabilities: ``PROBS_CHUNK_BYTES`` of float32 over ``keys`` keys."""
    return max(1, PROBS_CHUNK_BYTES // (attention_heads * keys * 4))


#: the fewest rows a part of a split batched matmul keeps (``batch_split``): its copy of the shared operand
#: (keys × head dim) must stay small against its product (rows × keys × head dim)
MIN_PART_ROWS = 128


def batch_split(batch: int, threads: int, rows: int) -> int:
    """Parts to split each ``rows``-row entry of a CPU batched matmul of ``batch`` entries into (1: none).

    torch's CPU ``bmm`` hands whole batch entries to its threads: 3 KV heads on 2 threads leave one thread
    idle a third of the time. Split so the batch is a multiple of the thread count, at most 4 parts of at least
    ``MIN_PART_ROWS`` rows (each part multiplies against its own copy of the shared operand, ``core/attention.py``'s
    ``_head_bmm``: a decoded token's few rows, or a short chunk, would spend more on the copy than it saves).
    """
    parts = threads // math.gcd(batch, threads)
    return parts if parts <= 4 and rows % parts == 0 and rows // parts >= MIN_PART_ROWS else 1
