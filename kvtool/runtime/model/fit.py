"""Before a checkpoint's model is built: does its config agree with its weights, and does it fit in memory?

transformers builds the model its ``config.json`` describes before it reads a weight, so a config that
claims far more layers than the weights hold (by mistake or on purpose) costs minutes and gigabytes before
the mismatch surfaces as a ``MemoryError``. Both checks here are cheap: the config gives a lower bound of
the parameter count, safetensors headers give the tensors' sizes without reading them, and the free
memory is one system call.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import torch

from kvtool.config import QUANT_BYTES_PER_PARAM
from kvtool.errors import UsageError
from kvtool.kvc.format import loads
from kvtool.runtime.memory import format_bytes

#: safetensors refuses headers larger than this; a larger claim is not a safetensors file
MAX_HEADER_BYTES = 100 * 1024 * 1024
#: JSON objects a safetensors header may hold (one per tensor): a 70B model's shards list a few hundred each
MAX_HEADER_OBJECTS = 1 << 18
#: the densest packing of weights on disk: two 4-bit parameters per byte
PARAMS_PER_BYTE_ON_DISK = 2


def implied_params(config: Any) -> int | None:
    """A lower bound of the parameter count ``config`` describes, or None when it does not say.

    Counted: each layer's query and output projections and two MLP matrices, and one embedding matrix.
    Every decoder has at least these (K/V projections, a third gated-MLP matrix, norms, biases and an
    untied head only add), so a checkpoint can never hold fewer parameters than this.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        hidden = int(text.hidden_size)
        heads = int(text.num_attention_heads)
        layers = int(text.num_hidden_layers)
        head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
        intermediate = int(getattr(text, "intermediate_size", None) or 0)
        vocab = int(getattr(text, "vocab_size", None) or 0)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return None
    if min(hidden, heads, layers) < 1:
        return None
    per_layer = 2 * hidden * heads * head_dim + 2 * hidden * max(intermediate, 0)
    return layers * per_layer + max(vocab, 0) * hidden


def safetensors_bytes(directory: Path) -> int | None:
    """Bytes of all tensors in the directory's ``*.safetensors`` files, read from their headers only.

    None when there is no safetensors file or a header cannot be read (transformers then reports it).
    """
    files = sorted(p for p in directory.iterdir() if p.name.endswith(".safetensors") and p.is_file())
    if not files:
        return None
    total = 0
    for path in files:
        size = _header_tensor_bytes(path)
        if size is None:
            return None
        total += size
    return total


def _header_tensor_bytes(path: Path) -> int | None:
    try:
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                return None
            (length,) = struct.unpack("<Q", raw)
            if length > MAX_HEADER_BYTES:
                return None
            header = loads(fh.read(length), MAX_HEADER_OBJECTS)  # stops early on a header of a million entries
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(header, dict):
        return None
    total = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = entry["data_offsets"]
            total += max(0, int(end) - int(start))
        except (KeyError, TypeError, ValueError):
            return None
    return total


def available_bytes(device: torch.device) -> int | None:
    """Memory free for the model's weights on ``device`` (None when unknown)."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - a missing figure only skips the check
        return None


def check_fits(directory: Path, config: Any, device: torch.device, dtype: torch.dtype, quantize: str) -> None:
    """Refuse (exit 2, with the figures) a checkpoint whose config implies more parameters than its weights
    on disk can hold, or more bytes of weights than the device has free."""
    params = implied_params(config)
    if params is None:
        return
    on_disk = safetensors_bytes(directory)
    if on_disk is not None and params > PARAMS_PER_BYTE_ON_DISK * on_disk:
        raise UsageError(
            f"{directory / 'config.json'} describes a model of at least {params:,} parameters, but its "
            f"safetensors weights hold {format_bytes(on_disk)} ({PARAMS_PER_BYTE_ON_DISK * on_disk:,} parameters "
            "at most): config and weights disagree"
        )
    per_param = QUANT_BYTES_PER_PARAM.get(quantize, torch.finfo(dtype).bits / 8)
    needed = int(params * per_param)
    free = available_bytes(device)
    if free is not None and needed > free:
        where = "GPU memory" if device.type == "cuda" else "memory"
        raise UsageError(
            f"{directory.name}: at least {params:,} parameters need {format_bytes(needed)} of weights in "
            f"{str(dtype).removeprefix('torch.')}, but only {format_bytes(free)} of {where} is available "
            f"({os.fspath(directory)})"
        )
