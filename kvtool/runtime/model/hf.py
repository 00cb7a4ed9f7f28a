"""Small helpers around transformers shared by loading and conversion: quiet loading, a chat template."""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator

import transformers

# The embedded model's conversion writes this template when its GGUF brings none: SmolLM2-135M-Instruct is a ChatML
# instruct model. Any other checkpoint without a chat template is taken for a base model and gets a plain prompt
# (kvtool/runtime/prompt.py), since a base model knows no chat markup.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def ensure_chat_template(tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    """Give the embedded model's tokenizer ChatML, the template it was trained with, if its GGUF brought none."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE


@contextlib.contextmanager
def quiet_transformers(gguf: bool = False) -> Iterator[None]:
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
