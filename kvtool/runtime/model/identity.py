"""What a loaded model is: its identity (tags saved caches and reports) and the dimensions the budget maths needs."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import transformers

# Config keys that say how or where a model was loaded or saved, not what it computes. They are left out of the
# identity so that one model has one identity whatever dtype, device, quantization, transformers version or load
# path (GGUF vs. converted checkpoint) produced it. Keys starting with "_" (``_name_or_path``,
# ``_model_name_or_path``, ``_commit_hash``, ...) are bookkeeping and are dropped as well.
_VOLATILE_CONFIG_KEYS = frozenset(
    {"transformers_version", "torch_dtype", "dtype", "quantization_config", "architectures", "attn_implementation"}
)


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
