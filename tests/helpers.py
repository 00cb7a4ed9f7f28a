"""Tiny random models and small drivers shared by the engine tests (no downloads, < 1 s each)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kvtool.core.cache import BoundedCache
from kvtool.core.engine import Engine, EngineConfig, model_env
from kvtool.policies import build_policy

VOCAB = 101


def tiny_llama(seed: int = 0, max_positions: int = 2048, **kw) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        intermediate_size=96,
        max_position_embeddings=max_positions,
        rope_theta=10000.0,
        **{"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, **kw},
    )
    return LlamaForCausalLM(cfg).eval()


def tiny_qwen2(seed: int = 0, max_positions: int = 2048, num_hidden_layers: int = 2) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        use_sliding_window=False,
    )
    return Qwen2ForCausalLM(cfg).eval()


def make_engine(
    model,
    policy: str,
    budget: int | None,
    block_size: int = 16,
    positions: str = "absolute",
    options: dict | None = None,
    sinks: int = 4,
    recent: int = 8,
    retrieval=None,
    **config,
) -> Engine:
    """An engine on ``model``; ``config``: more ``EngineConfig`` fields (recall, archive_dtype, archive_dir...)."""
    cfg = EngineConfig(budget=budget, block_size=block_size, sinks=sinks, recent=recent, positions=positions, **config)
    env = model_env(model, cfg, retrieval_heads=retrieval)
    pol = build_policy(policy, options or {}, env)
    return Engine(model, pol, cfg, env=env)


def dense_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """transformers' own logits: a plain forward (works before and after an Engine is built on the model)."""
    with torch.no_grad():
        return model(ids[None]).logits[0]


def stream_logits(
    engine: Engine, ids: torch.Tensor, cache: BoundedCache | None = None, check=None
) -> tuple[torch.Tensor, BoundedCache]:
    """Feed ``ids`` block by block, returning the logits of every position."""
    cache = cache or engine.new_cache()
    out = []
    for logits in engine.steps(cache, ids, logits_rows=None):
        out.append(logits)
        if check is not None:
            check(cache)
    return torch.cat(out), cache


ATTENTION_POLICIES = ["h2o", "tova", "snapkv", "scissorhands"]
ALL_POLICIES = [
    "full",
    "sink",
    "keydiff",
    *ATTENTION_POLICIES,
    "h2o+vatp",
    "scissorhands+vatp",
    "tova+caote",
    "snapkv+fastcaote",
    "h2o+vatp+caote",
]


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    """A byte-level BPE tokenizer trained in milliseconds: any UTF-8 text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["the cache is small and the pass key is 12345 hello world"] * 10, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


# -- chat families' tokenizers (tests/test_injection.py) --------------------------------------------------------------
# Tiny trained tokenizers with each family's control tokens, pre-tokenization and chat template: what a document
# holding those tokens' text must never turn into.

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}"
    "\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
    "{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}[/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
CHAT_FAMILIES = ["chatml", "llama3", "gemma", "mistral"]
#: the tiny model family each chat family's checkpoint uses (tests/helpers.py ``tiny_family``)
CHAT_MODEL = {"chatml": "qwen2", "llama3": "llama3", "gemma": "gemma3", "mistral": "mistral"}
_CORPUS = [
    "the cache is small and the pass key is 12345 hello world",
    "Revenue rose in the second quarter. How did revenue change? Answer the question about the text above.",
    "Summarize the text above in two or three sentences. user assistant model system",
]


def tiny_chat_tokenizer(family: str):
    """A tiny trained tokenizer of a chat family (``CHAT_FAMILIES``) with its control tokens and template.

    chatml: byte-level BPE (Qwen, SmolLM); llama3: byte-level BPE, ``<|begin_of_text|>`` prepended by the
    template; gemma: SentencePiece-style BPE without a word-start marker at the start of a string; mistral:
    SentencePiece-style BPE with one (``prepend_scheme="first"``), ``[INST]`` / ``[/INST]`` control tokens.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if family == "chatml":
        return tiny_tokenizer()
    ascii_chars = [chr(c) for c in range(32, 127)] + ["\n", "\u2581"]
    if family == "llama3":
        specials = [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|reserved_special_token_0|>",
        ]
        names = dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", unk_token="<|end_of_text|>")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet, template = pre_tokenizers.ByteLevel.alphabet(), LLAMA3_TEMPLATE
    elif family == "gemma":
        specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
        names = dict(bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>")
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
        tok.decoder = decoders.Metaspace(prepend_scheme="never")
        alphabet, template = ascii_chars, GEMMA_TEMPLATE
    elif family == "mistral":
        specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
        names = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>")
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
        tok.decoder = decoders.Metaspace(prepend_scheme="first", split=False)
        alphabet, template = ascii_chars, MISTRAL_TEMPLATE
    else:
        raise ValueError(f"unknown chat family {family!r}")
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(_CORPUS * 10, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **names)
    fast.chat_template = template
    return fast


def char_tokenizer(match_controls: bool = False):
    """A Python (not Rust-backed) tokenizer: one token per ASCII character, Mistral's control tokens and template.

    ``match_controls``: its plain-text tokenization makes the control tokens out of their text too, as a
    SentencePiece model whose control pieces are user-defined does (``split_special_tokens`` does not stop it).
    """
    from transformers import AddedToken
    from transformers.tokenization_python import PythonBackend

    class CharTokenizer(PythonBackend):
        model_input_names = ["input_ids", "attention_mask"]

        def __init__(self, **kw):
            self.chars = [chr(c) for c in range(32, 127)] + ["\n"]
            self.index = {c: i for i, c in enumerate(self.chars)}
            super().__init__(unk_token="<unk>", bos_token="<s>", eos_token="</s>", **kw)
            self.add_tokens(
                [AddedToken("[INST]", special=True), AddedToken("[/INST]", special=True)], special_tokens=True
            )

        @property
        def vocab_size(self) -> int:
            return len(self.chars)

        def get_vocab(self) -> dict[str, int]:
            return {**self.index, **self.added_tokens_encoder}

        def _tokenize(self, text: str, **kw) -> list[str]:
            controls = sorted(self.added_tokens_encoder, key=len, reverse=True) if match_controls else []
            out, i = [], 0
            while i < len(text):
                piece = next((c for c in controls if text.startswith(c, i)), text[i])
                out.append(piece)
                i += len(piece)
            return out

        def _convert_token_to_id(self, token: str) -> int:
            return self.index.get(token, self.unk_token_id)

        def _convert_id_to_token(self, index: int) -> str:
            return self.chars[index] if index < len(self.chars) else "<unk>"

        def convert_tokens_to_string(self, tokens: list[str]) -> str:
            return "".join(tokens)

    tok = CharTokenizer()
    tok.chat_template = MISTRAL_TEMPLATE
    return tok


def tiny_chat_checkpoint(directory, family: str, seed: int = 0):
    """A checkpoint directory of a tiny random model with ``tiny_chat_tokenizer(family)``."""
    from pathlib import Path

    tok = tiny_chat_tokenizer(family)
    model = tiny_family(CHAT_MODEL[family], seed=seed, vocab=len(tok))
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    return Path(directory)


def tiny_checkpoint(directory, seed: int = 0, layers: int = 2, hidden: int = 64):
    """A tiny random Llama checkpoint directory with a real tokenizer and chat template."""
    from pathlib import Path

    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=tok.eos_token_id,
    )
    LlamaForCausalLM(cfg).save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    return Path(directory)


# -- model families (tests/test_families.py) ---------------------------------------------------------------------
# Tiny random models built from transformers' own config classes, one per family kvtool claims to support.
# Every family has 2–3 layers, GQA (4 query heads over 2 KV heads) and head_dim 16. ``window`` is the sliding
# window of the families that have one: shorter than the tests' documents, so sliding layers really drop tokens.

FAMILY_WINDOW = 24


def tiny_family(name: str, seed: int = 0, window: int = FAMILY_WINDOW, max_positions: int = 2048, vocab: int = VOCAB):
    """A tiny randomly initialised model of family ``name`` (see ``FAMILIES``), in eval mode."""
    import transformers as T

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
    )
    if name == "llama3":  # Llama 3.x RoPE scaling: low frequencies stretched, high ones kept
        cfg = T.LlamaConfig(
            num_hidden_layers=2,
            rope_scaling={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            **common,
        )
    elif name == "qwen2":
        cfg = T.Qwen2Config(num_hidden_layers=2, use_sliding_window=False, **common)
    elif name == "qwen3":  # QK-norm (RMSNorm on each head's query and key before RoPE)
        cfg = T.Qwen3Config(num_hidden_layers=2, head_dim=16, **common)
    elif name == "mistral":  # every layer slides (Mistral v0.1-style config)
        cfg = T.MistralConfig(num_hidden_layers=2, sliding_window=window, **common)
    elif name == "phi3":  # fused qkv_proj / gate_up_proj; Phi-3-mini also slides every layer
        cfg = T.Phi3Config(num_hidden_layers=2, sliding_window=window + 8, pad_token_id=0, **common)
    elif name == "gemma2":  # local/global layers, attention logit softcapping (small cap so that it bites)
        cfg = T.Gemma2Config(
            num_hidden_layers=3,
            head_dim=16,
            sliding_window=window,
            attn_logit_softcapping=1.5,
            query_pre_attn_scalar=16,
            pad_token_id=0,
            **common,
        )
    elif name in ("gemma3", "gemma3-multimodal"):  # local/global layers, QK-norm, one RoPE per layer type
        text = dict(
            num_hidden_layers=3,
            head_dim=16,
            sliding_window=window,
            pad_token_id=0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0},
            },
            **common,
        )
        if name == "gemma3":  # Gemma 3 1B / 270M: text only
            cfg = T.Gemma3TextConfig(**text)
        else:  # Gemma 3 4B–27B checkpoints: the text model inside Gemma3ForConditionalGeneration
            text["vocab_size"] = vocab + 3  # image tokens above the ids the tests feed
            cfg = T.Gemma3Config(
                text_config=text,
                mm_tokens_per_image=4,
                boi_token_index=vocab,
                eoi_token_index=vocab + 1,
                image_token_index=vocab + 2,
                vision_config=dict(
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    image_size=28,
                    patch_size=14,
                ),
            )
    else:
        raise ValueError(f"unknown family {name!r}")
    torch.manual_seed(seed)
    # Gemma 2's reference is its eager attention: transformers before 5.2x gave it SDPA by default, which
    # silently drops the logit softcapping (later versions refuse ``softcap`` in SDPA and default to eager)
    extra = {"attn_implementation": "eager"} if name == "gemma2" else {}
    model = T.AutoModelForCausalLM.from_config(cfg, **extra).eval()
    if name == "gemma2":  # random init gives logits far below the cap: sharpen queries/keys so capping matters
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(12)
                layer.self_attn.k_proj.weight.mul_(12)
    return model


FAMILIES = ["llama3", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3", "gemma3-multimodal"]


def record_visibility(monkeypatch) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per layer and step: the block's query positions and the stream positions each KV head held
    (before eviction, i.e. what the block attended over; -1 where a head's group holds nothing)."""
    from kvtool.core.cache import BoundedLayer

    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    original = BoundedLayer.after_attention

    def spy(self, g, probs):
        n = g.length
        full = torch.full((self.owner.num_kv_heads, n), -1, dtype=torch.long)
        full[g.kv_index] = g.positions[:, :n].cpu()
        seen.setdefault(self.layer_idx, []).append((self.owner.step_original_positions.cpu().clone(), full))
        return original(self, g, probs)

    monkeypatch.setattr(BoundedLayer, "after_attention", spy)
    return seen


def masking_reference_logits(model, ids: torch.Tensor, visibility) -> torch.Tensor:
    """A dense float64 forward of the whole sequence in which layer l / KV head h / query t attends to
    exactly the keys the cache held when t was processed — intersected with the model's own sliding
    window (``sliding_window`` as transformers passes it) and with its own logit softcap."""
    from transformers import AttentionInterface

    c = model.config.get_text_config()
    T = ids.numel()
    kv_heads = c.num_key_value_heads
    q_per_kv = c.num_attention_heads // kv_heads
    masks = {}
    for layer, steps in visibility.items():
        allowed = torch.zeros(kv_heads, T, T, dtype=torch.bool)
        for q_pos, kv in steps:
            for h in range(kv_heads):
                pos = kv[h][kv[h] >= 0]
                for t in q_pos.tolist():
                    allowed[h, t, pos[pos <= t]] = True
        masks[layer] = allowed.repeat_interleave(q_per_kv, dim=0)

    def ref_attention(
        module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, softcap=None, **kw
    ):
        allowed = masks[module.layer_idx]
        if sliding_window is not None:
            t = torch.arange(T)
            allowed = allowed & ((t[:, None] - t[None, :]) < sliding_window)
        k = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1).double()
        v = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1).double()
        s = (query.double() @ k.transpose(-1, -2)) * scaling
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~allowed[None], float("-inf"))
        out = torch.softmax(s, -1) @ v
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    AttentionInterface.register("kvtool_ref", ref_attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation("kvtool_ref")
    try:
        with torch.no_grad():
            return model(ids[None]).logits[0]
    finally:
        model.set_attn_implementation(previous)


def tiny_family_checkpoint(directory, family: str, seed: int = 0):
    """A checkpoint directory of ``tiny_family(family)`` with the tiny tokenizer (for CLI tests)."""
    from pathlib import Path

    tok = tiny_tokenizer()
    model = tiny_family(family, seed=seed, vocab=len(tok))
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    return Path(directory)


def token_state(policy, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """Policy state of freshly stored tokens ([h, m, d] keys/values → {field: [h, m]}), as the cache
    sets it (``HeadGroup.new_state``): 0 for running fields, the policy's per-token constants."""
    consts = policy.constants(keys, values)
    return {f: consts[f] if f in consts else torch.zeros(keys.shape[:2]) for f in policy.state_fields}


def hf_cache_layout(
    cache, repo: str, source, commit: str = "0123456789abcdef0123456789abcdef01234567", ref: str | None = "main"
):
    """Lay ``source``'s files out in a Hugging Face hub cache as huggingface_hub does; returns the snapshot folder.

    ``cache/models--ORG--NAME/``: each file's content in ``blobs/<sha256>``, ``snapshots/<commit>/<name>`` a
    relative link to it, and ``refs/<ref>`` holding the commit (no ref when ``ref`` is None).
    """
    import hashlib
    import os
    from pathlib import Path

    repo_dir = Path(cache) / ("models--" + repo.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(Path(source).iterdir()):
        if not file.is_file():
            continue
        data = file.read_bytes()
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / file.name
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(os.path.join("..", "..", "blobs", blob.name), link)
    if ref is not None:
        (repo_dir / "refs").mkdir(exist_ok=True)
        (repo_dir / "refs" / ref).write_text(commit)
    return snapshot


def strip_chat_template(directory):
    """Make a checkpoint directory a base model's: no chat template in any of the files that may carry one."""
    import json
    from pathlib import Path

    directory = Path(directory)
    for name in ("chat_template.jinja", "chat_template.json"):
        (directory / name).unlink(missing_ok=True)
    config = directory / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data.pop("chat_template", None)
    config.write_text(json.dumps(data))
    return directory


def block_network(monkeypatch) -> list:
    """Every socket connection and name lookup raises from now on; returns the list of attempts (to assert empty).

    A library that tried the network and fell back on a cache would hide the attempt, so each is recorded."""
    import socket

    attempts: list = []

    def refuse(*args, **kwargs):
        attempts.append(args[1:] if args and isinstance(args[0], socket.socket) else args)
        raise OSError("network disabled by the test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    return attempts


#: ``python -c OFFLINE_MAIN ARGS...``: the kvtool CLI in a process whose sockets refuse to connect; a process that
#: tried anyway ends with exit 99 and ``NETWORK ATTEMPTED`` on stderr, whatever the command did
OFFLINE_MAIN = """
import socket, sys
tried = []
def refuse(*args, **kwargs):
    tried.append(args)
    raise OSError("network disabled by the test")
socket.socket.connect = socket.socket.connect_ex = refuse
socket.create_connection = socket.getaddrinfo = refuse
from kvtool.cli.app import main
rc = 0
for argv in [a.split("\\x1f") for a in sys.argv[1:]]:
    rc = rc or main(argv)
if tried:
    print(f"NETWORK ATTEMPTED: {tried[:3]}", file=sys.stderr)
    rc = 99
sys.exit(rc)
"""


class WordTokenizer:
    """Words and the spaces before them, with exact offsets (what fast tokenizers give) and no control tokens.

    Stands in for a tokenizer where only token counts and character spans matter (document reading).
    """

    all_special_ids: list[int] = []
    added_tokens_decoder: dict = {}

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False, split_special_tokens=False):
        spans = [(m.start(), m.end()) for m in re.finditer(r"\s*\S+|\s+", text)]
        out = {"input_ids": [hash(text[a:b]) % 1000 for a, b in spans]}
        if return_offsets_mapping:
            out["offset_mapping"] = spans
        return out


# -- measured memory ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def tensor_peak() -> Iterator[dict[str, int]]:
    """The peak of CPU tensor bytes allocated while the block runs, above what was allocated when it began: every
    allocation and free of torch's CPU allocator, as its profiler reports them in order (a measurement, inside
    every op included, not a sum of sizes). Yields a dict that holds ``peak`` and ``end`` once the block is done."""
    from torch.profiler import ProfilerActivity, profile

    out: dict[str, int] = {}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield out
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    out.update(peak=peak, end=live)
