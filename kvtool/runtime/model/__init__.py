"""Models for the engine: options (device, dtype, quantize, threads), loading, the embedded model's one-time
conversion, the fit check before building, and a loaded model's identity and dimensions.

One module per job; this package names what the rest of kvtool uses.
"""

from kvtool.config import kvtool_home
from kvtool.runtime.model.convert import EMBEDDED_GGUF, EMBEDDED_NAME, embedded_gguf_path
from kvtool.runtime.model.hf import CHATML_TEMPLATE
from kvtool.runtime.model.hub import ModelId, hub_cache_dir, parse_model_id
from kvtool.runtime.model.identity import model_dimensions, model_identity
from kvtool.runtime.model.loading import LoadedModel, config_directory, load_model
from kvtool.runtime.model.options import resolve_device, resolve_dtype, set_threads, usable_cores

__all__ = [
    "CHATML_TEMPLATE",
    "EMBEDDED_GGUF",
    "EMBEDDED_NAME",
    "LoadedModel",
    "ModelId",
    "config_directory",
    "embedded_gguf_path",
    "hub_cache_dir",
    "kvtool_home",
    "load_model",
    "model_dimensions",
    "model_identity",
    "parse_model_id",
    "resolve_device",
    "resolve_dtype",
    "set_threads",
    "usable_cores",
]
