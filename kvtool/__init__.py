"""kvtool: read documents longer than memory allows through a language model under a strict KV budget."""

import os

# kvtool never touches the network: models come from local paths or the embedded GGUF package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

__version__ = "0.2.0"
