"""Attention-output error under eviction (CAOTE App. E.4, Fig. 3), per layer.

For each of K windows of N context + M continuation tokens (the same windows as ``kvtool eval ppl``):

* the **dense reference** is policy ``full`` through the engine (nothing evicted: exactly dense attention);
* each (policy, budget) run feeds the same tokens: the context in blocks, then the M continuation tokens one
  at a time, as in generation.

While the continuation is fed, a forward pre-hook on every layer's ``self_attn.o_proj`` captures its input —
the attention output before the output projection, ``[1, 1, H·d]`` — for both runs. The error of a layer is

    mean over the M tokens and the H query heads of  ‖o_dense − o_policy‖₂ / ‖o_dense‖₂

(:func:`kvtool.eval.metrics.normalised_error`), averaged over the K windows. Both runs are teacher-forced on
the same tokens, so a layer's error includes what earlier layers' eviction changed in its input, as in the
paper's end-to-end measurement. Hooks are removed afterwards.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kvtool.errors import KvtoolError
from kvtool.eval import CellLog, Reporter, Run, Timer, make_session, model_settings, report
from kvtool.eval.metrics import normalised_error
from kvtool.eval.ppl import Window, WindowTask, load_windows, window_cells
from kvtool.eval.stats import bootstrap_mean


def o_proj_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every decoder layer's ``self_attn.o_proj`` (Llama, Qwen2, Mistral, ... layouts)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    out = []
    for layer in layers or []:
        o = getattr(getattr(layer, "self_attn", None), "o_proj", None)
        if o is None:
            break
        out.append(o)
    if not out or len(out) != len(layers):
        raise KvtoolError("attn-error needs a model whose decoder layers have self_attn.o_proj (Llama/Qwen style)")
    return out


class OutputCapture:
    """Forward pre-hooks on each ``o_proj`` that record its input while ``active`` ([m, H, d] per call)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.modules = o_proj_modules(model)
        self.heads = model.config.num_attention_heads
        self.active = False
        self.rows: list[list[Tensor]] = [[] for _ in self.modules]
        self._handles: list[Any] = []

    def __enter__(self) -> OutputCapture:
        for i, mod in enumerate(self.modules):
            self._handles.append(mod.register_forward_pre_hook(self._hook(i)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, i: int) -> Any:
        def pre(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            if self.active:
                x = args[0].detach()
                self.rows[i].append(x[0].float().cpu().reshape(x.shape[1], self.heads, -1))

        return pre

    def take(self) -> list[Tensor]:
        """The captured outputs per layer, [tokens, H, d], and a fresh start."""
        out = [torch.cat(r) for r in self.rows]
        self.rows = [[] for _ in self.modules]
        return out


def capture_outputs(engine: Any, cap: OutputCapture, ids: Tensor, n_context: int) -> list[Tensor]:
    """Feed the context in blocks, then each continuation token alone; attention outputs of the latter."""
    cache = engine.new_cache()
    cap.active = False
    engine.feed(cache, [ids[:n_context]], progress=False)
    cap.active = True
    try:
        for _ in engine.steps(cache, ids[n_context:], block_size=1):
            pass
    finally:
        cap.active = False
    return cap.take()


def run_attn_error(task: WindowTask, reporter: Reporter) -> dict[str, Any]:
    timer = Timer()
    loaded, windows = load_windows(task, reporter)
    runs = task.grid.runs()
    settings = {**model_settings(loaded), **task.settings(), "windows": [w.key for w in windows],
                "num_heads": loaded.model.config.num_attention_heads,
                "reference": "policy full through the engine (no eviction)"}
    log = CellLog(task.resume, "attn-error", {**settings, "identity": loaded.identity})
    reference = make_session(task.grid, Run("full", None), loaded, reporter.say)
    sessions: dict[int, Any] = {}
    n = task.context
    errors: list[list[list[float]]] = [[] for _ in runs]  # run -> sample -> layer
    budgets: list[int | None] = [None] * len(runs)
    with OutputCapture(loaded.model) as cap, reporter.bar(len(windows) * (1 + len(runs))):
        num_layers = len(cap.modules)
        for k, w in enumerate(windows):
            reporter.doing(f"sample {k + 1}/{len(windows)} dense (full)")
            missing = any(f"{run.label}|{w.key}" not in log for run in runs)
            dense = capture_outputs(reference.engine, cap, w.ids, n) if missing else None
            reporter.advance()

            def measure(session: Any, w: Window = w, dense: list[Tensor] | None = dense) -> dict[str, Any]:
                got = capture_outputs(session.engine, cap, w.ids, n)
                assert dense is not None
                return {"layers": [normalised_error(a, b) for a, b in zip(dense, got, strict=True)],
                        "budget": session.budget_tokens}

            for r, rec in window_cells(task, loaded, log, reporter, sessions, f"sample {k + 1}/{len(windows)}",
                                       w.key, measure):
                budgets[r] = rec["budget"]
                errors[r].append(rec["layers"])
    results = []
    seed = task.grid.settings.seed
    for r, (run, per_sample) in enumerate(zip(runs, errors, strict=True)):
        layers = [sum(s[i] for s in per_sample) / len(per_sample) for i in range(num_layers)]
        window_means = [sum(s) / len(s) for s in per_sample]
        results.append({
            "policy": run.policy,
            "budget": budgets[r],
            "layers": layers,
            "mean": sum(layers) / len(layers),
            "mean_interval": bootstrap_mean(window_means, seed=seed).as_dict(),
            "max": max(layers),
        })
    settings["num_layers"] = num_layers
    return report("attn-error", settings, results, timer.seconds())
