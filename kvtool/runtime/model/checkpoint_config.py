"""A checkpoint's ``config.json``: read under caps and checked once, for loading and for planning alike.

``kvtool profile --model DIR`` plans from the config alone when DIR holds no weights; ``load_model`` builds the
model from it. Both go through :func:`checked_config`, so the same config is refused (or planned) the same way
whether its weights are there or not:

* the file: a regular file (a FIFO or a device is refused, never waited on; a link to one too) of at most
  4 MiB, read once;
* the JSON: strict (NaN and Infinity are not JSON numbers), at most :data:`MAX_DEPTH` levels deep;
* every dimension within ``numbers.CONFIG_LIMITS``, in transformers' names and the family's own (``n_layer``
  for GPT-2), before transformers builds anything from it: a family's config builds per-layer lists as long as
  its layer count;
* a model type that transformers knows and has a causal language model for (kvtool never runs a directory's
  own code), built by transformers' own validation;
* attention heads that group: the KV heads divide the attention heads (none is not "as many as the attention
  heads"), and without a ``head_dim`` the heads divide the hidden size;
* the attention features ``core.layout.check_config`` refuses (sink logits, chunked, bidirectional, MLA).

:func:`parameter_counts` counts what the config describes by building it on the meta device (no memory, no
weights): a mixture of experts counts every expert, whatever the family, as loading it would.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import torch
import transformers

from kvtool.core.layout import check_config, text_config
from kvtool.errors import UsageError, first_line, shown
from kvtool.fileio import read_capped
from kvtool.kvc.format import loads
from kvtool.numbers import CONFIG_LIMITS, capped
from kvtool.runtime.memory import format_bytes

#: the most bytes a config.json may have (a real one is a few KiB; a multimodal one tens)
MAX_CONFIG_BYTES = 4 << 20
#: how deeply a config's JSON may nest (a real one: four or five levels)
MAX_DEPTH = 32
#: JSON objects a config may hold (a real one: a few dozen)
MAX_OBJECTS = 1 << 14


def read_config(directory: Path) -> dict[str, Any]:
    """``directory/config.json`` as a dict, read under the caps and checked (the module docstring's first three
    points, and the model type); one ``UsageError`` line otherwise. Nothing is built from it yet."""
    path = directory / "config.json"
    if not os.path.lexists(path):
        raise UsageError(f"not a Hugging Face checkpoint directory (no config.json): {directory}")
    check_read_whole(path, MAX_CONFIG_BYTES)
    raw = read_capped(path, MAX_CONFIG_BYTES, "model config")  # and a file swapped since: never waited on
    try:
        config = loads(raw, MAX_OBJECTS)
    except (UnicodeDecodeError, ValueError) as exc:
        raise UsageError(f"{path} is not a valid JSON config: {first_line(exc)[:120]}") from None
    if not isinstance(config, dict):
        raise UsageError(f"{path} is not a valid JSON config: not a JSON object")
    if _depth(config) > MAX_DEPTH:
        raise UsageError(f"{path} is not a valid JSON config: nested more than {MAX_DEPTH} levels deep (a config "
                         "needs a few)")
    cls = config_class(path, config)
    check_dims(path, config, cls)
    return config


def check_read_whole(file: Path, cap: int) -> None:
    """A checkpoint file transformers (or kvtool) reads whole: absent, or a regular file of at most ``cap`` bytes
    (a FIFO or a device, or a link to one, is refused, never opened)."""
    try:
        st = file.stat()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UsageError(f"cannot read {file}: {exc.strerror or first_line(exc)}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{file} is not a regular file; a checkpoint's files are read whole")
    if st.st_size > cap:
        raise UsageError(f"{file} is {format_bytes(st.st_size)}, more than the {format_bytes(cap)} such a file "
                         "ever needs: not a real checkpoint file; refused unread")


def checked_config(directory: Path) -> Any:
    """The transformers config of ``directory`` (``read_config``, then built and checked): what the model is
    loaded with, and what a plan from the config alone reads."""
    path = directory / "config.json"
    raw = read_config(directory)
    cls = config_class(path, raw)
    try:
        config = cls.from_dict(raw)
    except Exception as exc:  # noqa: BLE001 - transformers' own validation (types, ranges): one line
        why = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
        raise UsageError(f"{path} is not a valid {raw['model_type']} config: {why[:240]}") from None
    if type(config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UsageError(f"{path}: model type {shown(raw['model_type'])} is not a causal language model "
                         "transformers can build; kvtool reads documents with decoder language models")
    section = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    _check_heads(path, config, explicit_head_dim=section.get("head_dim") is not None)
    check_config(config)
    return config


def config_class(path: Path, config: dict[str, Any]) -> Any:
    """The transformers config class the ``model_type`` names; a missing or unknown type is one line."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise UsageError(f"{path} names no model_type (got {shown(model_type)}): not a transformers checkpoint "
                         "config")
    if model_type not in transformers.CONFIG_MAPPING:
        if "auto_map" in config:
            raise UsageError(f"{path.parent} needs its own Python code to load its config (auto_map in {path.name}); "
                             "kvtool never runs code from a model directory: use a checkpoint of a model family "
                             "transformers supports itself")
        raise UsageError(f"{path}: model type {shown(model_type)} is not one transformers "
                         f"{transformers.__version__} knows, and kvtool never runs code from a model directory")
    return transformers.CONFIG_MAPPING[model_type]


def parameter_counts(config: Any) -> tuple[int, int]:
    """(parameters, of which the input embeddings and the untied LM head) of the model ``config`` describes.

    Built on the meta device: no memory is allocated and no weight read, and every family transformers
    builds is counted as it is loaded (each expert of a mixture of experts, a multimodal model's towers).
    """
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # noqa: BLE001 - a config transformers accepts but cannot build: one line
        raise UsageError(f"cannot plan model type {shown(getattr(config, 'model_type', None))}: transformers "
                         f"could not build it from its config ({first_line(exc)[:120]})") from None
    total = sum(p.numel() for p in model.parameters())
    seen: set[int] = set()
    embeddings = 0
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        for p in module.parameters() if module is not None else ():
            if id(p) not in seen:
                seen.add(id(p))
                embeddings += p.numel()
    return int(total), int(embeddings)


def _depth(value: Any) -> int:
    """How deeply ``value`` nests (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if level <= MAX_DEPTH:  # past the cap the answer is known: stop walking
            stack.extend((c, level + 1) for c in children)
    return deepest


def check_dims(path: Path, config: dict[str, Any], cls: Any) -> None:
    """Each dimension the config (or a sub-config such as ``text_config``) names is in its range."""
    sections = [("", config, cls)] + [(f"{key}.", value, (getattr(cls, "sub_configs", None) or {}).get(key))
                                      for key, value in config.items() if isinstance(value, dict)]
    for where, section, section_cls in sections:
        aliases = dict(getattr(section_cls, "attribute_map", None) or {})
        for key, rng in CONFIG_LIMITS.items():
            for name in {key, aliases.get(key, key)}:
                value = section.get(name)
                if value is not None:
                    capped(f"{path}: {where}{name}", value, rng)


def _check_heads(path: Path, config: Any, explicit_head_dim: bool) -> None:
    """The text model has attention layers with heads (an RNN such as RWKV has none to keep); KV heads divide
    the attention heads; without a ``head_dim``, the heads divide the hidden size."""
    c = text_config(config)
    heads = getattr(c, "num_attention_heads", None)
    kv = getattr(c, "num_key_value_heads", None)
    hidden = getattr(c, "hidden_size", None)
    for name, value in (("num_attention_heads", heads), ("hidden_size", hidden),
                        ("num_hidden_layers", getattr(c, "num_hidden_layers", None))):
        if not isinstance(value, int) or isinstance(value, bool):
            raise UsageError(f"{path}: model type {shown(getattr(c, 'model_type', None))} names no {name}: kvtool "
                             "keeps the K/V of attention layers, and this family describes none it can plan")
    if isinstance(kv, int) and heads % kv:
        raise UsageError(f"{path}: num_key_value_heads ({kv}) must divide num_attention_heads ({heads})")
    if not explicit_head_dim and hidden % heads:  # (a family's config may derive head_dim = hidden // heads)
        raise UsageError(f"{path}: hidden_size ({hidden}) must be a multiple of num_attention_heads ({heads}) "
                         "when the config sets no head_dim")
