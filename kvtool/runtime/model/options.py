"""``--device``, ``--dtype``, ``--quantize`` and ``--threads`` turned into what torch and transformers take.

The names come from :mod:`kvtool.config` (one vocabulary for every layer); this module adds what needs torch:
the concrete device, the torch dtype, the bitsandbytes config and the intra-op thread count.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import transformers

from kvtool.config import DEVICE_HELP, DEVICE_RE, DTYPE_ALIASES
from kvtool.errors import UsageError, first_line

#: the model dtypes ``--dtype`` may name (canonical names, see ``config.DTYPE_ALIASES``); int8 is for archives only
_TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    if DEVICE_RE.match(text) is None:
        raise UsageError(f"unknown device {spec!r}: use {DEVICE_HELP}")
    if not torch.cuda.is_available():
        raise UsageError(f"--device {spec}: CUDA is not available here (torch {torch.__version__}); use --device cpu")
    _, _, index = text.partition(":")
    return _cuda_device(int(index) if index else None)


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
    dtype = _TORCH_DTYPES.get(DTYPE_ALIASES.get(text, ""))
    if dtype is None:
        raise UsageError(f"unknown dtype {spec!r}: use auto, float32 (fp32), bfloat16 (bf16) or float16 (fp16)")
    return dtype


def quantization_config(quantize: str, device: torch.device, dtype: torch.dtype) -> Any | None:
    """The ``BitsAndBytesConfig`` for ``--quantize``, or None for ``none``.

    Checked before seconds are spent loading weights: bitsandbytes must import and quantize a few values on
    ``device`` (its CUDA kernels, or the CPU backend that 0.48 and later ship), else one line saying so.
    """
    if quantize == "none":
        return None
    # bitsandbytes logs warnings at import (an optional CPU kernel package it would download) and per call
    # (8-bit: "inputs will be cast from bfloat16 to float16", every linear layer of every block): errors only
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    try:
        import bitsandbytes
        import bitsandbytes.functional as bnb_functional
    except Exception as exc:  # a broken CUDA setup raises more than ImportError
        raise UsageError(
            f"--quantize {quantize} needs bitsandbytes ({first_line(exc)}): `pip install 'kvtool[gpu]'`"
        ) from None
    try:  # a probe of the kernels the load will use, on the device they will run on
        if quantize == "4bit":
            bnb_functional.quantize_4bit(torch.ones(64, 64, device=device), quant_type="nf4")
        else:
            bnb_functional.int8_vectorwise_quant(torch.ones(4, 64, dtype=torch.float16, device=device))
    except Exception as exc:
        raise UsageError(f"--quantize {quantize}: bitsandbytes {getattr(bitsandbytes, '__version__', '?')} cannot "
                         f"quantize on {device.type} ({first_line(exc)}); use --quantize none") from None
    if quantize == "8bit":
        return transformers.BitsAndBytesConfig(load_in_8bit=True)
    # NF4 (the 4-bit code of QLoRA, fitted to normally distributed weights) with its absmax scales quantized
    # too ("double quantization"): what the profiles' bytes per parameter assume
    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                           bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=dtype)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, which containers and ``taskset`` narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


def set_threads(requested: int | None, say: Callable[[str], None] | None = None) -> int:
    """Set torch's intra-op thread count once, deliberately; returns it.

    Default: the cores this process may use (torch's own default counts every core of the machine,
    also those another cgroup or ``taskset`` gives away). ``--threads N`` overrides it: several
    kvtool processes sharing the cores (``xargs -P``) should each take ``cores / processes``, since
    oversubscribed intra-op threads wait on each other in every small per-layer operation. For the
    same reason more threads than usable cores only slow a run down: such a request is capped at the
    usable cores, with a one-line note through ``say``.
    """
    cores = usable_cores()
    n = requested if requested is not None else cores
    if n > cores:
        if say is not None:
            say(f"note: --threads {n} is more than the {cores} usable core(s); using {cores}")
        n = cores
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
