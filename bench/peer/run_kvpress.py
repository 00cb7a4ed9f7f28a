"""Run NVIDIA kvpress on kvtool's peer cases (inside bench/peer/.venv, never kvtool's environment).

    bench/peer/.venv/bin/python bench/peer/run_kvpress.py --cases CASES.json --press snapkv --budget 256 \
        --model CHECKPOINT_DIR --out OUT.json

kvpress prefills the whole context, then compresses it to ``compression_ratio`` (here 1 − budget/context
tokens, so every head keeps ``budget`` tokens of the document, as in kvtool), then answers. The question is
kvtool's own instruction text, so both tools see the same prompt: kvpress appends ``question`` right after
the document inside the user turn, which is exactly where kvtool's template puts its instruction.
This file imports no kvtool code: kvpress pins an older transformers.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch


def make_press(name: str, ratio: float):
    from kvpress import (
        KeyDiffPress,
        ObservedAttentionPress,
        SnapKVPress,
        StreamingLLMPress,
        TOVAPress,
    )

    presses = {
        "sink": lambda: StreamingLLMPress(compression_ratio=ratio, n_sink=4),
        "snapkv": lambda: SnapKVPress(compression_ratio=ratio),
        "tova": lambda: TOVAPress(compression_ratio=ratio),
        "keydiff": lambda: KeyDiffPress(compression_ratio=ratio),
        "h2o": lambda: ObservedAttentionPress(compression_ratio=ratio),
    }
    return None if name == "full" else presses[name]()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True)
    ap.add_argument("--press", required=True, help="full, sink, snapkv, tova, keydiff or h2o")
    ap.add_argument("--budget", type=int, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import kvpress  # noqa: F401 - registers the "kv-press-text-generation" pipeline
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    cases = json.load(open(args.cases, encoding="utf-8"))
    attn = "eager" if args.press == "h2o" else "sdpa"  # ObservedAttentionPress needs the attention weights
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation=attn).eval()
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok, device="cpu")
    out = {"impl": "kvpress", "policy": args.press, "budget": args.budget, "groups": []}
    t_all = time.perf_counter()
    for group in cases["groups"]:
        # count the context's tokens from the rendered text (apply_chat_template(tokenize=True) returns a
        # dict in recent transformers, whose len() is its number of keys)
        rendered = tok.apply_chat_template([{"role": "user", "content": group["document"]}], tokenize=False,
                                           add_generation_prompt=False)
        n_ctx = len(tok(rendered, add_special_tokens=False)["input_ids"])
        if n_ctx <= args.budget:
            raise SystemExit(f"{group['id']}: {n_ctx} context tokens do not exceed the budget {args.budget}")
        ratio = 1.0 - args.budget / n_ctx
        press = make_press(args.press, ratio)
        t0 = time.perf_counter()
        res = pipe(group["document"], questions=group["prompts"], press=press, max_new_tokens=group["max_new_tokens"])
        answers = res["answers"] if "answers" in res else [res["answer"]]
        out["groups"].append({"id": group["id"], "answers": [a.strip() for a in answers], "context_tokens": n_ctx,
                              "compression_ratio": ratio, "seconds": time.perf_counter() - t0})
    out["seconds"] = time.perf_counter() - t_all
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["versions"] = {"kvpress": __import__("kvpress").__version__ if hasattr(__import__("kvpress"), "__version__")
                       else "?", "transformers": __import__("transformers").__version__, "torch": torch.__version__}
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
