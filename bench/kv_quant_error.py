"""Attention error of quantized K/V on the embedded model: per-token scales, Hadamard-rotated or not (kvtool
rotates), vs KIVI's per-channel keys.

    python bench/kv_quant_error.py                 # 1,024 tokens of Pride and Prejudice, int8 and int4

Each layer's queries and K/V are captured under policy ``full`` with the whole text in one block, then
quantized offline in several ways; the figure is the relative L2 error of the causal attention output
against full precision over the same tokens (float64), mean and worst over the layers. It decides how
``--kv-dtype`` scales keys (see ``kvtool/core/quant.py`` and docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def capture(tokens: int, text_path: Path) -> list[tuple]:
    """(queries [H, n, d], keys [h, n, d], values [h, n, d], scaling) of every layer, float32."""
    import torch

    from kvtool.core import attention
    from kvtool.core.engine import Engine, EngineConfig, model_env
    from kvtool.policies import build_policy
    from kvtool.runtime.model import load_model

    loaded = load_model(None)
    text = text_path.read_text(encoding="utf-8")[20000:]
    ids = torch.tensor(loaded.tokenizer(text[: tokens * 8])["input_ids"][:tokens])
    cfg = EngineConfig(budget=None, block_size=tokens, positions="absolute")
    env = model_env(loaded.model, cfg)
    engine = Engine(loaded.model, build_policy("full", {}, env), cfg, env=env)
    caught: list[tuple] = []
    real = attention._attend_group

    def spy(layer, g, q, scaling, softcap=None):
        k, v = g.kv()
        caught.append((q[0].float().clone(), k[0].float().clone(), v[0].float().clone(), scaling))
        return real(layer, g, q, scaling, softcap)

    attention._attend_group = spy
    try:
        with torch.inference_mode():
            list(engine.steps(engine.new_cache(), ids, logits_rows=1))
    finally:
        attention._attend_group = real
    return caught


def attend(q, k, v, scaling: float):
    import torch

    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0).double(), v.repeat_interleave(rep, 0).double()
    n = k.shape[1]
    s = (q.double() @ k.transpose(-1, -2)) * scaling
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v


def per_token(x, name: str, rotate: bool = True):
    import torch

    from kvtool.core.quant import KVCodec

    codec = KVCodec(name, rotate=rotate)
    data, scale = codec.encode(x)
    return codec.decode(data, scale, torch.empty_like(x))


def per_channel(x, name: str, group: int = 32):
    """KIVI's keys: one scale per channel over each group of ``group`` tokens (a partial last group as is)."""
    qmax = 127 if name == "int8" else 7
    h, n, d = x.shape
    full = n // group * group
    xg = x[:, :full].reshape(h, n // group, group, d)
    scale = (xg.abs().amax(2, keepdim=True) / qmax).clamp_min(1e-8)
    out = x.clone()
    out[:, :full] = ((xg / scale).round().clamp(-qmax, qmax) * scale).reshape(h, full, d)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--text", type=Path, default=ROOT.parent / "shared" / "corpus" / "pride_and_prejudice.txt")
    args = ap.parse_args()
    layers = capture(args.tokens, args.text)
    ways = {
        "K and V per token, rotated (this cache)": lambda k, v, n: (per_token(k, n), per_token(v, n)),
        "K and V per token, not rotated": lambda k, v, n: (per_token(k, n, False), per_token(v, n, False)),
        "K per token, rotated": lambda k, v, n: (per_token(k, n), v),
        "K per token, not rotated": lambda k, v, n: (per_token(k, n, False), v),
        "V per token, rotated": lambda k, v, n: (k, per_token(v, n)),
        "V per token, not rotated": lambda k, v, n: (k, per_token(v, n, False)),
        "K per channel (KIVI, 32)": lambda k, v, n: (per_channel(k, n), v),
        "K per channel (KIVI, 32) + V per token, not rotated": lambda k, v, n: (per_channel(k, n),
                                                                                per_token(v, n, False)),
    }
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name in ("int8", "int4"):
        out[name] = {}
        for way, quantize in ways.items():
            errs = []
            for q, k, v, scaling in layers:
                ref = attend(q, k, v, scaling)
                errs.append(float((attend(q, *quantize(k, v, name), scaling) - ref).norm() / ref.norm()))
            out[name][way] = {"mean": sum(errs) / len(errs), "worst": max(errs)}
    print(json.dumps({"tokens": args.tokens, "layers": len(layers), "relative_error": out}, indent=1))


if __name__ == "__main__":
    main()
