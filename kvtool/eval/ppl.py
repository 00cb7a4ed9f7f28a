"""Perplexity under eviction (CAOTE §4.3 / Table 4): M continuation tokens given N context tokens.

For each of K windows of N + M tokens taken at seeded offsets from one or more texts (round-robin):

* **dense reference**: one plain transformers forward over the N + M tokens with ``attn_implementation="sdpa"``
  (no kvtool cache, no eviction), keeping the logits that predict the M continuation tokens; past
  ``2 · DENSE_CHUNK`` tokens transformers' own chunked prefill (its ``DynamicCache``), the same attention;
* **policy run** (every (policy, budget) of the grid, ``full`` included when listed): the engine feeds the N
  context tokens in blocks of ``--block-size`` (evicting after each block), then the continuation **one token
  at a time** (``Engine.step(cache, ids[i:i+1], 1)``) so eviction runs exactly as in generation. The first
  continuation token is predicted by the last context logits; the last continuation token is never fed.

Reported per run (pooled over the K·M predicted tokens): perplexity, gap to dense (absolute and %),
mean KL(dense ‖ policy) of the next-token distributions and top-1 agreement with dense; and the mean
per-window gap % with a 95% bootstrap interval over windows, KL and top-1 likewise, and whether the
run's gap differs significantly from the best run's at the same budget (paired bootstrap over the
same windows).

If the tokenizer adds a BOS token by default, each window starts with it (it counts as one of the N context
tokens), so the model sees what it was trained to see at the start of a sequence.
"""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch import Tensor

from kvtool.errors import UsageError
from kvtool.eval import CellLog, Grid, Reporter, Timer, load_once, make_session, model_settings, report
from kvtool.eval.metrics import kl_divergence, mean_nll, top1_agreement
from kvtool.eval.stats import best_in_group, bootstrap_mean, paired_difference
from kvtool.runtime.tokens import bos_prefix, encode_text

#: Only this much of the text is tokenized to draw windows from.
MAX_WINDOW_TEXT_CHARS = 16 * 1024 * 1024


@dataclass
class WindowTask:
    """Options shared by ``ppl`` and ``attn-error``: K windows of N context + M continuation tokens.

    ``texts`` are (name, text) pairs, e.g. several books: the K windows are spread over them round-robin,
    so a figure is not the property of one book's style.
    """

    grid: Grid
    texts: list[tuple[str, str]]
    context: int
    continuation: int
    samples: int
    resume: str | None = None  # a JSONL file of finished (run, window) units (--resume)

    def settings(self) -> dict[str, Any]:
        return {
            "texts": [name for name, _ in self.texts],
            "context": self.context,
            "continuation": self.continuation,
            "samples": self.samples,
            **self.grid.describe(),
        }


@dataclass
class Window:
    source: str  # the text (file) the window comes from
    offset: int  # token offset of the window in the tokenized text
    ids: Tensor  # [N + M] (BOS first when the tokenizer adds one)

    @property
    def key(self) -> str:
        return f"{self.source}@{self.offset}"


def pick_offsets(total: int, width: int, samples: int, seed: int) -> list[int]:
    """K window offsets in ``[0, total − width]``, deterministic under ``seed``.

    When the windows fit side by side, the text is cut into K equal segments with one window at a random
    offset inside each (no overlap, spread over the whole text); otherwise offsets are drawn uniformly.
    """
    if total < width:
        raise UsageError(f"the text has {total} tokens, fewer than context + continuation = {width}")
    rng = random.Random(seed)
    if samples * width <= total:
        seg = total // samples
        return [i * seg + rng.randint(0, seg - width) for i in range(samples)]
    return sorted(rng.randint(0, total - width) for _ in range(samples))


def make_windows(task: WindowTask, tokenizer: Any) -> list[Window]:
    """K windows spread round-robin over the texts (text i gets ⌈(K − i)/T⌉ of them), seeded offsets."""
    prefix = bos_prefix(tokenizer)
    width = task.context + task.continuation - len(prefix)
    T = len(task.texts)
    windows: list[Window] = []
    for i, (name, text) in enumerate(task.texts):
        k = (task.samples - i + T - 1) // T
        if k <= 0:
            continue
        ids = encode_text(tokenizer, text[:MAX_WINDOW_TEXT_CHARS])
        try:
            offsets = pick_offsets(len(ids), width, k, task.grid.settings.seed + i)
        except UsageError as e:
            raise UsageError(f"{name}: {e}") from None
        windows += [Window(name, o, torch.tensor(prefix + list(ids[o : o + width]), dtype=torch.long)) for o in offsets]
    return windows


# --------------------------------------------------------------------------------------------- forward passes


#: a window longer than twice this is read by the dense reference in chunks of this many tokens
DENSE_CHUNK = 4096


@torch.inference_mode()
def dense_logits(model: torch.nn.Module, ids: Tensor, m: int) -> Tensor:
    """Logits [m, V] predicting the last ``m`` tokens of ``ids`` with transformers' own SDPA, no eviction.

    Up to ``2 · DENSE_CHUNK`` tokens: one plain forward. Longer: transformers' own chunked prefill into its
    ``DynamicCache`` (the same attention, summed in another order), because one forward holds a T × T mask
    and, on sliding-window layers, computes every masked score (SDPA cannot skip an explicit mask's blocks):
    for Gemma 3 270M at 32K tokens that is ten times the work of the unmasked scores and gigabytes of mask.
    """
    device = next(model.parameters()).device
    ids = ids.view(1, -1).to(device)
    total = ids.shape[1]
    if total <= 2 * DENSE_CHUNK:
        # A plain forward: the engine's registered attention falls through to SDPA without its cache.
        out = model(input_ids=ids, use_cache=False, logits_to_keep=m + 1)
        return out.logits[0, :m].float().cpu()
    cache = transformers.DynamicCache(config=model.config)
    keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    first_kept = total - (m + 1)  # the logits of positions first_kept .. total-1 are kept (as logits_to_keep=m+1)
    rows = []
    for start in range(0, total, DENSE_CHUNK):
        end = min(total, start + DENSE_CHUNK)
        keep = end - max(start, first_kept)
        # logits_to_keep=0 would mean every row; a chunk before the kept positions computes its last only
        out = model(input_ids=ids[:, start:end], **{keyword: cache}, use_cache=True, logits_to_keep=max(keep, 1))
        if keep > 0:
            rows.append(out.logits[0, -keep:].float().cpu())
    return torch.cat(rows)[:m]


def stream_logits(engine: Any, ids: Tensor, n_context: int) -> Tensor:
    """Logits [M, V] predicting ``ids[n_context:]``: context in blocks, then the continuation token by token."""
    cache = engine.new_cache()
    logits = engine.feed(cache, [ids[:n_context]], progress=False)
    assert logits is not None
    rows = [logits[-1].float().cpu()]
    rows += [step[-1].float().cpu() for step in engine.steps(cache, ids[n_context:-1], block_size=1)]
    return torch.stack(rows)


# --------------------------------------------------------------------------------------------- task


def load_windows(task: WindowTask, reporter: Reporter) -> tuple[Any, list[Window]]:
    """Seed torch with the grid's seed, load the model once and cut the task's windows from its texts."""
    torch.manual_seed(task.grid.settings.seed)
    loaded = load_once(task.grid, reporter.say)
    return loaded, make_windows(task, loaded.tokenizer)


def window_cells(
    task: WindowTask,
    loaded: Any,
    log: CellLog,
    reporter: Reporter,
    sessions: dict[int, Any],
    sample: str,
    window_key: str,
    measure: Callable[[Any], dict[str, Any]],
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Each run's record for one window, ``(run index, record)``, in the grid's order.

    A record already in the resume log is read back; otherwise ``measure(session)`` computes it with
    the run's session (built on first need, so a resumed run loads nothing it does not use) and it
    is logged first. The progress bar advances once per run, after the caller has used the record.
    """
    for r, run in enumerate(task.grid.runs()):
        reporter.doing(f"{sample} {run.label}")
        key = f"{run.label}|{window_key}"
        if key not in log:
            if r not in sessions:
                sessions[r] = make_session(task.grid, run, loaded, reporter.say)
            log.put(key, measure(sessions[r]))
        yield r, log.get(key)
        reporter.advance()


def run_ppl(task: WindowTask, reporter: Reporter) -> dict[str, Any]:
    timer = Timer()
    loaded, windows = load_windows(task, reporter)
    runs = task.grid.runs()
    sessions: dict[int, Any] = {}  # built on first need: a resumed run loads nothing it does not use
    n, m = task.context, task.continuation
    limit = getattr(loaded.model.config, "max_position_embeddings", None)
    if limit is not None and n + m > limit:
        reporter.say(f"note: context + continuation = {n + m} exceeds the model's {limit} positions; the dense "
                     "reference runs past its trained range")
    settings = {**model_settings(loaded), **task.settings(), "windows": [w.key for w in windows],
                "reference": "dense transformers forward (sdpa, no eviction)"
                + (f"; chunks of {DENSE_CHUNK} through its DynamicCache" if n + m > 2 * DENSE_CHUNK else "")}
    log = CellLog(task.resume, "ppl", {**settings, "identity": loaded.identity})
    dense_nll: list[float] = []
    per_run: list[list[dict[str, Any]]] = [[] for _ in runs]
    budgets: list[int | None] = [None] * len(runs)
    with reporter.bar(len(windows) * (1 + len(runs))):
        for k, w in enumerate(windows):
            reporter.doing(f"sample {k + 1}/{len(windows)} dense")
            targets = w.ids[n:]
            dense_key = f"dense|{w.key}"
            missing = any(f"{run.label}|{w.key}" not in log for run in runs)
            dense = dense_logits(loaded.model, w.ids, m) if missing or dense_key not in log else None
            if dense_key not in log:
                log.put(dense_key, mean_nll(dense, targets))
            d_nll = log.get(dense_key)
            dense_nll.append(d_nll)
            reporter.advance()

            def measure(session: Any, w: Window = w, ref: Tensor | None = dense, targets: Tensor = targets,
                        d_nll: float = d_nll) -> dict[str, Any]:
                t = Timer()
                q = stream_logits(session.engine, w.ids, n)
                assert ref is not None
                return {"window": w.key, "nll": mean_nll(q, targets), "dense_nll": d_nll,
                        "kl": kl_divergence(ref, q), "top1": top1_agreement(ref, q),
                        "seconds": t.seconds(), "budget": session.budget_tokens}

            for r, rec in window_cells(task, loaded, log, reporter, sessions, f"sample {k + 1}/{len(windows)}",
                                       w.key, measure):
                budgets[r] = rec["budget"]
                per_run[r].append(rec)
    dense_ppl = math.exp(sum(dense_nll) / len(dense_nll))
    results = _ppl_results(runs, per_run, budgets, dense_ppl, task.grid.settings.seed, m)
    reference = {"ppl": dense_ppl, "samples": [{"window": w.key, "ppl": math.exp(x)}
                                               for w, x in zip(windows, dense_nll, strict=True)]}
    return report("ppl", settings, results, timer.seconds(), reference=reference)


def _ppl_results(runs: list[Any], per_run: list[list[dict[str, Any]]], budgets: list[int | None], dense_ppl: float,
                 seed: int, m: int) -> list[dict[str, Any]]:
    """One result row per run: pooled perplexity, its gap to dense with intervals, KL and top-1 agreement."""
    gaps = [[100.0 * (math.exp(x["nll"] - x["dense_nll"]) - 1.0) for x in rows] for rows in per_run]
    best = best_in_group(budgets, [sum(g) / len(g) for g in gaps], higher_is_better=False)
    results = []
    for r, (run, rows) in enumerate(zip(runs, per_run, strict=True)):
        ppl = math.exp(sum(x["nll"] for x in rows) / len(rows))  # every sample has M tokens: pooled mean
        gap = ppl - dense_ppl
        b = best[r]
        results.append({
            "policy": run.policy,
            "budget": budgets[r],
            "ppl": ppl,
            "dense_ppl": dense_ppl,
            "ppl_gap": gap,
            "ppl_gap_pct": 100.0 * gap / dense_ppl,
            "window_gap_pct": bootstrap_mean(gaps[r], seed=seed).as_dict(),
            "kl": bootstrap_mean([x["kl"] for x in rows], seed=seed).value,
            "kl_interval": bootstrap_mean([x["kl"] for x in rows], seed=seed).as_dict(6),
            "top1": bootstrap_mean([x["top1"] for x in rows], seed=seed).value,
            "top1_interval": bootstrap_mean([x["top1"] for x in rows], seed=seed).as_dict(),
            "best": r == b,
            "significant": b is not None and r != b and paired_difference(gaps[r], gaps[b], seed=seed).excludes(0.0),
            "tokens": len(rows) * m,
            "seconds": round(sum(x["seconds"] for x in rows), 3),
            "samples": [
                {"window": x["window"], "ppl": math.exp(x["nll"]), "dense_ppl": math.exp(x["dense_nll"]),
                 "kl": x["kl"], "top1": x["top1"]}
                for x in rows
            ],
        })
    return results
