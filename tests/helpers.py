"""Tiny random models and small drivers shared by the engine tests (no downloads, < 1 s each)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kvtool.core.cache import BoundedCache
from kvtool.core.engine import Engine, EngineConfig, model_env
from kvtool.policies import build_policy

VOCAB = 101


def tiny_llama(seed: int = 0, max_positions: int = 2048, **kw) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_positions, rope_theta=10000.0, **{"num_hidden_layers": 2, **kw},
    )
    return LlamaForCausalLM(cfg).eval()


def tiny_qwen2(seed: int = 0, max_positions: int = 2048, num_hidden_layers: int = 2) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=num_hidden_layers,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=max_positions,
        use_sliding_window=False,
    )
    return Qwen2ForCausalLM(cfg).eval()


def make_engine(model, policy: str, budget: int | None, block_size: int = 16, positions: str = "absolute",
                options: dict | None = None, sinks: int = 4, recent: int = 8, retrieval=None) -> Engine:
    cfg = EngineConfig(budget=budget, block_size=block_size, sinks=sinks, recent=recent, positions=positions)
    env = model_env(model, cfg, retrieval_heads=retrieval)
    pol = build_policy(policy, options or {}, env)
    return Engine(model, pol, cfg, env=env)


def dense_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """transformers' own logits: a plain forward (works before and after an Engine is built on the model)."""
    with torch.no_grad():
        return model(ids[None]).logits[0]


def stream_logits(engine: Engine, ids: torch.Tensor, cache: BoundedCache | None = None,
                  check=None) -> tuple[torch.Tensor, BoundedCache]:
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
    "full", "sink", "keydiff", *ATTENTION_POLICIES, "h2o+vatp", "scissorhands+vatp", "tova+caote",
    "snapkv+fastcaote", "h2o+vatp+caote",
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
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["the cache is small and the pass key is 12345 hello world"] * 10, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def tiny_checkpoint(directory, seed: int = 0, layers: int = 2, hidden: int = 64):
    """A tiny random Llama checkpoint directory with a real tokenizer and chat template."""
    from pathlib import Path

    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    return Path(directory)
