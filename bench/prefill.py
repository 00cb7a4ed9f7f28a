"""Prefill benchmark: kvtool's bounded engine against dense transformers, in one run.

    python bench/prefill.py                       # the default table (see --help), ~1 hour on 2 CPU cores
    python bench/prefill.py --quick               # 2K/8K/32K, sink only: the first dense comparison (~5 min)
    python bench/prefill.py --config llama-3.1-8b --lengths 4k,32k,128k --policies sink,tova   # real shapes

``--config NAME`` builds a randomly initialised model of a real model's shape (``bench/gpu.py``:
written there, nothing is downloaded) on the meta device and materialises it in bf16 on the target
device, so speed and memory can be measured at real sizes without weights; ``--layers N`` keeps N
layers (a CPU smoke test of the 8B shape). Documents are then random token ids and the block-size
sweep is skipped (perplexity of random weights means nothing). ``--list-configs`` prints the shapes.
With ``--sdpa-probe`` on CUDA every row also reports the share of its SDPA calls that only the math backend
could serve (``bench/gpu.SdpaProbe``; it adds host time to every SDPA call, so it is off by default and
``h2o``, which computes its own probabilities, would be favoured by it), and the GPU targets are printed
(``scripts/gpu-check.sh``).

Every row runs in a fresh child process so its peak memory is its own (peak RSS on CPU,
``torch.cuda.max_memory_allocated`` on CUDA). Rows:

* ``dense``     transformers, one plain forward of the whole document (SDPA), growing KV;
* ``chunked``   transformers' chunked prefill at the same block size (``DynamicCache``, no eviction);
* ``kvtool:P``  kvtool with policy P at the given budget and block size.

Each row reports prefill tokens/s (and the CPU seconds the prefill took: on a machine shared with other
work, tokens per CPU-second of a one-thread row stay comparable where wall-clock rates do not), peak memory,
the per-block time split (model forward, attention-probability computation, policy scoring,
eviction/gather), and decode tokens/s after
the document (``Engine.generate``: lazy eviction, one gather per block of generated tokens).
Ratios to dense and chunked come from the same run. It also measures the decode floor (transformers
decoding after a budget-sized document), the decode split (scoring + eviction share of decode
time) and two concurrent processes against one (``--concurrency-length``, at kvtool's default —
each process shares the cores with the other kvtool processes, ``kvtool/runtime/cores.py`` — and at
an explicit cores / 2 threads each). Targets are checked at the end and
every miss says by how much. ``--json PATH`` writes all rows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "corpus"
sys.path.insert(0, str(ROOT))

from bench.gpu import (  # noqa: E402
    CONFIGS,
    SdpaProbe,
    config_model,
    model_bytes,
    model_flops,
    nominal_peak,
    planned_peak,
    random_ids,
)
from bench.jsonfile import write_json  # noqa: E402
from bench.prefill_report import check_targets, print_markdown, print_row  # noqa: E402

#: the ``ask`` rows' question length (random ids, as the documents of ``--config`` rows are)
ASK_QUESTION_TOKENS = 32


def recall_archive_bytes(cache) -> int:
    from kvtool.core import recall

    return int(recall.archive_bytes(cache))


def parse_tokens(text: str) -> int:
    text = text.strip().lower()
    return int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)


# ---------------------------------------------------------------------------------------------- child
def corpus_ids(tokenizer, n: int):
    """The first n tokens of the shared corpus (novels first, then essays), cached per tokenizer."""
    import torch

    cache = Path(os.environ.get("KVTOOL_BENCH_CACHE", "/tmp/kvtool-bench")) / f"corpus-{tokenizer.vocab_size}.pt"
    if cache.exists():
        ids = torch.load(cache)
    else:
        files = [CORPUS / "sherlock_holmes.txt", CORPUS / "pride_and_prejudice.txt",
                 *sorted((CORPUS / "paul_graham_essays").glob("*.txt"))]
        ids = torch.tensor(
            [t for f in files for t in tokenizer(f.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]]
        )
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(ids, cache)
    if ids.numel() < n:
        ids = ids.repeat(n // ids.numel() + 1)
    return ids[:n]


def reset_peak(device) -> None:
    """Start the peak-memory measurement now (after the model is built): on CUDA the allocator's peak;
    on Linux CPU the process's peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs``), so that
    a random model's initialisation temporaries do not hide the prefill's own peak."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_bytes(device) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_one(spec: dict) -> dict:
    import torch
    import transformers  # noqa: F401 (imported before the baseline's first reading, as `kvtool profile` does)

    from kvtool.runtime.model import load_model, set_threads
    from kvtool.runtime.profiling import process_rss, warm_baseline

    torch.set_grad_enabled(False)
    out_threads = set_threads(spec.get("threads"))  # kvtool's own choice unless the spec says
    share = None
    if spec.get("threads") is None and spec["kind"] == "kvtool":  # as the CLI does: share the cores
        from kvtool.runtime.cores import process_share

        share = process_share()
        share.rebalance()
        out_threads = share.threads
    before_load = process_rss()
    if spec.get("config"):
        loaded = None
        model, device = config_model(spec["config"], spec.get("device", "auto"), spec.get("dtype", "auto"),
                                     spec.get("layers"))
        ids = random_ids(model.config.get_text_config().vocab_size, spec["length"] + spec.get("continuation", 0))
    else:
        loaded = load_model(spec.get("model"), spec.get("device", "auto"), spec.get("dtype", "auto"))
        model, device = loaded.model, loaded.device
        ids = corpus_ids(loaded.tokenizer, spec["length"] + spec.get("continuation", 0))
    doc, cont = ids[: spec["length"]], ids[spec["length"] :]
    out = {**spec, "params": sum(p.numel() for p in model.parameters()), "threads_used": out_threads,
           **model_bytes(model)}
    out["model_flops"] = model_flops(model, spec["kind"], spec["length"], spec["block_size"], spec["budget"])
    # the plan's runtime baseline as `kvtool profile` takes it: on a CPU the process's warm RSS less the weights
    # (Python, torch, the tokenizer); on CUDA 0, since the allocator's peak knows no CUDA context
    out["runtime_baseline_bytes"] = 0 if device.type == "cuda" else warm_baseline(model, device, before_load)
    if warm_up(spec, device):  # the same path over a short document first, untimed (see ``warm_up``)
        short = min(doc.numel(), spec["budget"] + 2 * spec["block_size"])
        _time_row({**spec, "decode_tokens": min(2, spec.get("decode_tokens", 0)), "continuation": 0}, model, device,
                  loaded, doc[:short], cont[:0], {}, share)
        sync(device)
        out["warmed_up_tokens"] = short
    probe = SdpaProbe(device, enabled=bool(spec.get("sdpa_probe")))
    reset_peak(device)
    with probe:
        _time_row(spec, model, device, loaded, doc, cont, out, share)
    out.update(probe.result())
    out["peak_bytes"] = peak_bytes(device)
    out["predicted_peak_bytes"] = planned_peak(model, spec, out["runtime_baseline_bytes"])
    out["device"] = str(device)
    if share is not None:
        out["threads_min"] = share.min_threads
    return out


def warm_up(spec: dict, device) -> bool:
    """Whether a row first runs its own path untimed over ``budget + 2 · block`` tokens (``--warmup``; ``auto``: on a
    GPU). A GPU's first row pays lazy module loading, cuBLAS's handles, Triton's compilation and the clocks'
    ramp (a fresh machine's first dense row read 0.49× the same row later); the warm-up pays them instead,
    on the same shapes (every cache fill up to the budget, an eviction, the archive, a question, decoding)."""
    mode = spec.get("warmup", "auto")
    return device.type == "cuda" if mode == "auto" else mode == "on"


def _time_row(spec: dict, model, device, loaded, doc, cont, out: dict, share) -> None:
    """Prefill (and decode) one row, filling ``out`` with its timings."""
    import torch

    kind, block = spec["kind"], spec["block_size"]
    decode_n = spec.get("decode_tokens", 0)
    if kind in ("dense", "chunked"):
        from transformers import DynamicCache

        with contextlib.suppress(ValueError):  # Gemma 2 has no SDPA (softcapping): its own eager attention
            model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=model.config)
        sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        if kind == "dense":
            res = model(doc[None].to(device), past_key_values=cache, use_cache=True, logits_to_keep=1)
        else:
            none = torch.empty(0, dtype=torch.long, device=device)  # logits of the last block only, as kvtool
            for s in range(0, doc.numel(), block):
                res = model(doc[None, s : s + block].to(device), past_key_values=cache, use_cache=True,
                            logits_to_keep=1 if s + block >= doc.numel() else none)
        sync(device)
        out["prefill_seconds"] = time.perf_counter() - t0
        out["prefill_cpu_seconds"] = time.process_time() - c0
        logits = res.logits[0, -1]
        t1 = time.perf_counter()
        for _ in range(decode_n):
            tok = logits.argmax().view(1, 1)
            logits = model(tok, past_key_values=cache, use_cache=True).logits[0, -1]
        sync(device)
        out["decode_seconds"] = time.perf_counter() - t1
    else:
        from kvtool.config import AGAIN_AFTER, recall_selection
        from kvtool.core import recall
        from kvtool.core.engine import Engine, EngineConfig, model_env
        from kvtool.core.timing import PARTS
        from kvtool.policies import build_policy
        from kvtool.runtime.budget import DEFAULT_RECALL

        # the time split comes from device events on CUDA (read after the prefill's one sync); --sync-timing
        # synchronises around every section instead (a debugging mode: it slows kvtool's rows)
        ask = kind == "ask"  # the default `ask` path: recall on, an int8 archive on disk, a question after
        archive = tempfile.mkdtemp(prefix="kvtool-bench-archive-") if ask else None
        cfg = EngineConfig(budget=spec["budget"], block_size=block, positions=spec.get("positions", "auto"),
                           sync_timing=bool(spec.get("sync_timing")), recall=DEFAULT_RECALL if ask else 0,
                           archive_dtype=torch.int8 if ask else None, archive_dir=archive)
        retrieval = None
        if spec["policy"].startswith("razor"):
            if loaded is None:
                raise SystemExit("razor needs a real model (calibration), not --config")
            from kvtool.policies.razor.calibrate import calibrate
            from kvtool.runtime.model import kvtool_home

            def retrieval():
                data = calibrate(model, identity=loaded.identity, name=loaded.name, home=kvtool_home())
                return {int(k): v for k, v in data["kv_heads"].items()}

        env = model_env(model, cfg, retrieval_heads=retrieval)
        policy = build_policy(spec["policy"], {}, env)
        engine = Engine(model, policy, cfg, env=env, pacer=share.rebalance if share is not None else None)
        cache = engine.new_cache()
        sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        for s in range(0, doc.numel(), block):  # logits of the last block only (a document read: none)
            logits = engine.step(cache, doc[s : s + block], 1 if s + block >= doc.numel() else 0)
        sync(device)
        out["prefill_seconds"] = time.perf_counter() - t0
        out["prefill_cpu_seconds"] = time.process_time() - c0
        c = cache.counters
        split = cache.timer.totals(wait=True)
        out["split_seconds"] = {k: split[k] for k in PARTS}
        out["evicted_tokens"] = c.evicted_tokens
        out["cached_tokens_max"] = c.max_cached
        out["compact_since"] = cache.compact_since if cache.compact else None
        if spec.get("continuation"):
            out["continuation_logits"] = _continuation_nll(engine, cache, logits, cont)
        again = None
        if ask:  # snapshot, then a question: restore, record its queries, recall, feed it again
            question = random_ids(int(logits.shape[-1]), ASK_QUESTION_TOKENS, seed=1)
            t_q = time.perf_counter()
            snap = cache.snapshot()
            logits, recalled = engine.feed_question(cache, question, lambda: cache.restore(snap), decode_n + 1)
            sync(device)
            out["question_seconds"] = time.perf_counter() - t_q
            out["recalled_pages"] = recalled.pages if recalled is not None else 0
            out["archive_bytes"] = recall_archive_bytes(cache)
            # the default --recall-select (auto): a second recall after the answer's first tokens past one scan
            chosen = recall_selection(cfg.recall_select, recall.archived_per_head(cache))
            out["recall_select"] = "again" if "again" in chosen else "shared"
            again = (engine.recall_again(cache, question.tolist(), lambda: cache.restore(snap), None, lambda r: None)
                     if "again" in chosen and decode_n >= AGAIN_AFTER else None)
        before = cache.timer.totals(wait=True)
        t1 = time.perf_counter()
        if decode_n:  # Engine.generate: greedy, lazy eviction (one gather per block of generated tokens)
            engine.generate(cache, logits, decode_n + 1, eos_ids=set(), again=again)
        sync(device)
        out["decode_seconds"] = time.perf_counter() - t1
        after = cache.timer.totals(wait=True)
        out["decode_split_seconds"] = {k: after[k] - before[k] for k in ("score", "evict")}
        if archive is not None:  # the archive's files are unlinked already: the folder goes
            shutil.rmtree(archive, ignore_errors=True)


def _continuation_nll(engine, cache, logits, cont) -> float:
    """Mean negative log-likelihood of the continuation, fed token by token (eviction keeps running)."""
    import torch

    nll = 0.0
    for i in range(cont.numel()):
        nll -= float(torch.log_softmax(logits[-1].float(), -1)[cont[i]])
        logits = engine.step(cache, cont[i : i + 1], 1)
    return nll / max(1, cont.numel())


def dense_continuation_nll(spec: dict) -> float:
    import torch

    from kvtool.runtime.model import load_model

    torch.set_grad_enabled(False)
    loaded = load_model(spec.get("model"), spec.get("device", "auto"), spec.get("dtype", "auto"))
    ids = corpus_ids(loaded.tokenizer, spec["length"] + spec["continuation"])
    logits = loaded.model(ids[None].to(loaded.device)).logits[0].float()
    n = spec["length"]
    lp = torch.log_softmax(logits[n - 1 : -1], -1)
    return float(-lp.gather(1, ids[n:, None].to(lp.device)).mean())


# ---------------------------------------------------------------------------------------------- parent
#: seconds a child row may run before it is killed and reported as an error (``--child-timeout``; None: no limit)
CHILD_TIMEOUT: list[float | None] = [None]


def child(spec: dict) -> dict:
    return children([spec])[0]


def children(specs: list[dict]) -> list[dict]:
    """Run the specs in concurrent child processes (one each); their rows in the same order."""
    procs = [subprocess.Popen([sys.executable, __file__, "--run-one", json.dumps(spec)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=dict(os.environ)) for spec in specs]
    rows = []
    for spec, proc in zip(specs, procs, strict=True):
        try:
            stdout, stderr = proc.communicate(timeout=CHILD_TIMEOUT[0])
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            rows.append({**spec, "error": f"timed out after {CHILD_TIMEOUT[0]:.0f} s (--child-timeout)"})
            continue
        if proc.returncode != 0:
            rows.append({**spec, "error": (stderr.strip().splitlines() or ["?"])[-1]})
        else:
            rows.append(json.loads(stdout.strip().splitlines()[-1]))
    return rows


def concurrency(base: dict, policy: str, n: int, threads: int | None) -> float | None:
    """Per-process prefill tok/s of two concurrent processes / that of one process alone."""
    spec = {**base, "kind": "kvtool", "policy": policy, "length": n, "decode_tokens": 0, "threads": threads}
    alone = child(spec)
    pair = children([spec, spec])
    if "error" in alone or any("error" in r for r in pair):
        print(f"  concurrency ({policy}, {n} tokens): ERROR "
              f"{alone.get('error') or next(r['error'] for r in pair if 'error' in r)}")
        return None
    one = n / alone["prefill_seconds"]
    each = [n / r["prefill_seconds"] for r in pair]
    ratio = min(each) / one
    shared = "" if threads is not None else (f" (sharing: {min(r.get('threads_min', 0) for r in pair)} thread(s) each "
                                             "while both ran)")
    print(f"  concurrency ({policy}, {n} tokens, {alone['threads_used']} thread(s) alone{shared}): alone {one:.1f} "
          f"tok/s, two at once {each[0]:.1f} + {each[1]:.1f} tok/s: each keeps {ratio:.2f}x, together "
          f"{sum(each) / one:.2f}x of one", flush=True)
    return ratio


def roofline_gflops(device_name: str) -> float:
    """The best matmul rate in the dtype the rows compute in: float32 on a CPU, bf16 (and a larger product, to
    fill the card) on CUDA, where the models are materialised in bf16."""
    import torch

    dev = torch.device(device_name)
    n, dtype = (8192, torch.bfloat16) if dev.type == "cuda" else (2048, torch.float32)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    best = 0.0
    for _ in range(5):
        sync(dev)
        t0 = time.perf_counter()
        a @ b
        sync(dev)
        best = max(best, 2 * n**3 / (time.perf_counter() - t0) / 1e9)
    return best


def policy_specs(text: str, kind: str, base: dict) -> list[dict]:
    """``--policies``/``--ask-policies`` items as row specs; ``NAME@BLOCK`` runs NAME at block size BLOCK."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, _, block = item.partition("@")
        spec = {**base, "kind": kind, "policy": name, "tag": item}
        if block:
            spec["block_size"] = int(block)
        out.append(spec)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-one", help=argparse.SUPPRESS)
    ap.add_argument("--lengths", default="2k,8k,32k,128k")
    ap.add_argument("--policies", default="sink,keydiff,tova,snapkv+caote,h2o+vatp,razor")
    ap.add_argument("--budget", default="1k")
    ap.add_argument("--block-size", default="128",
                    help="tokens per block, or auto: what kvtool picks on the device (runtime/settings.py)")
    ap.add_argument("--dense-max", default="32k", help="longest document for the dense and chunked rows")
    ap.add_argument("--chunked-max", default="8k", help="longest document for the chunked row (targets use 2K)")
    ap.add_argument("--long-policies", default=None,
                    help="policies run at lengths above 32k (default: all of --policies)")
    ap.add_argument("--decode-tokens", type=int, default=256,
                    help="greedy tokens decoded after each document (≥ block size, so lazy eviction runs)")
    ap.add_argument("--sweep", default="32,64,128,256,512", help="block sizes for the speed/fidelity sweep ('' = skip)")
    ap.add_argument("--sweep-length", default="4k")
    ap.add_argument("--sweep-policy", default="snapkv+caote")
    ap.add_argument("--sweep-continuation", type=int, default=64)
    ap.add_argument("--memory-lengths", default="4k,128k", help="the two lengths of the flat-memory target")
    ap.add_argument("--model", default=None)
    ap.add_argument("--config", default=None, help="random model of a real shape: " + ", ".join(CONFIGS))
    ap.add_argument("--list-configs", action="store_true", help="print the --config shapes and exit")
    ap.add_argument("--layers", type=int, default=None, help="--config only: keep this many layers (smoke tests)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quick", action="store_true", help="2k,8k,32k, sink only, no sweep (the first dense comparison)")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--concurrency-length", default="2k", help="document of the two-processes test ('' = skip)")
    ap.add_argument("--concurrency-policy", default="keydiff")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per child (default: kvtool's choice)")
    ap.add_argument("--ask-policies", default="",
                    help="policies run as `kvtool ask` runs them by default: recall on (an int8 archive on disk), "
                         "then a question (snapshot, restore, recall) before decoding; 'h2o' is the default path")
    ap.add_argument("--sync-timing", action="store_true",
                    help="CUDA: synchronize around kvtool's timers to measure the per-block split (slows its rows)")
    ap.add_argument("--child-timeout", type=float, default=None, help="seconds per row before it is killed")
    ap.add_argument("--warmup", choices=("auto", "on", "off"), default="auto",
                    help="run each row's path once untimed first (auto: on a GPU)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the MFU column's peak (default: the card's dense bf16 peak, bench/gpu.PEAK_TFLOPS; else "
                         "the measured matmul roofline)")
    ap.add_argument("--sdpa-probe", action="store_true",
                    help="CUDA: count the SDPA calls only the math backend serves (adds host time to every call)")
    args = ap.parse_args()
    if args.run_one:
        print(json.dumps(run_one(json.loads(args.run_one))))
        return
    if args.list_configs:
        for name, spec in CONFIGS.items():
            print(f"{name:16} {spec['class']:17} layers {spec['num_hidden_layers']:3} hidden {spec['hidden_size']:5} "
                  f"heads {spec['num_attention_heads']}/{spec['num_key_value_heads']} "
                  f"window {spec.get('sliding_window', '-')}")
        return
    if args.config is not None:
        if args.config not in CONFIGS:
            raise SystemExit(f"prefill.py: error: unknown --config {args.config!r}; one of {', '.join(CONFIGS)}")
        if args.model is not None:
            raise SystemExit("prefill.py: error: --config and --model are exclusive")
        if args.layers is not None and args.layers < 1:
            raise SystemExit("prefill.py: error: --layers must be at least 1")
        args.sweep = ""  # random weights: continuation perplexity means nothing
    if args.quick:
        args.lengths, args.policies, args.sweep, args.memory_lengths = "2k,8k,32k", "sink", "", ""
    CHILD_TIMEOUT[0] = args.child_timeout
    lengths = [parse_tokens(x) for x in args.lengths.split(",") if x]
    policies = [p for p in args.policies.split(",") if p]
    long_policies = policies if args.long_policies is None else [p for p in args.long_policies.split(",") if p]
    budget = parse_tokens(args.budget)
    dense_max = parse_tokens(args.dense_max)
    chunked_max = parse_tokens(args.chunked_max)
    base = {"model": args.model, "config": args.config, "device": args.device, "dtype": args.dtype, "budget": budget,
            "block_size": None, "decode_tokens": args.decode_tokens, "threads": args.threads,
            "layers": args.layers if args.config else None, "sync_timing": args.sync_timing,
            "sdpa_probe": args.sdpa_probe, "warmup": args.warmup}

    import torch

    from kvtool.runtime.settings import default_block_size

    device_name = "cuda" if (args.device in ("auto", "cuda") and torch.cuda.is_available()) else "cpu"
    block = default_block_size(device_name, budget) if args.block_size == "auto" else int(args.block_size)
    base["block_size"] = block
    roof = roofline_gflops(device_name)
    roof_dtype = "bf16" if device_name == "cuda" else "fp32"
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads "
          f"{torch.get_num_threads()}, device {device_name}; {roof_dtype} matmul roofline {roof:.0f} GFLOP/s",
          flush=True)
    nominal = nominal_peak(device_label(device_name)) if device_name == "cuda" else None
    peak = args.peak_tflops * 1e12 if args.peak_tflops else nominal or roof * 1e9
    peak_source = ("--peak-tflops" if args.peak_tflops else "the card's bf16 peak" if nominal else
                   f"the measured {roof_dtype} roofline")
    print(f"MFU: model FLOPs (bench/gpu.model_flops) / {peak / 1e12:.4g} TFLOP/s ({peak_source})", flush=True)

    def measured(r: dict) -> dict:
        if "error" not in r and r.get("model_flops"):
            r["peak_flops"], r["mfu"] = peak, r["model_flops"] / r["prefill_seconds"] / peak
        return r
    rows: list[dict] = []
    sweep_rows: list[dict] = []

    def save() -> None:  # after every row, so a run cut short keeps what it measured
        if args.json_path:
            doc = {"device": device_label(device_name), "torch": torch.__version__, "roofline_gflops": roof,
                   "peak_flops": peak, "peak_source": peak_source,
                   "rows": rows, "sweep": sweep_rows}
            write_json(args.json_path, doc)

    mem_lengths = [parse_tokens(x) for x in args.memory_lengths.split(",") if x]
    floor_policies = {"sink", "keydiff", "tova", "snapkv+caote"} & set(policies)
    if floor_policies and budget not in lengths:
        # the decode floor: transformers decoding after a budget-sized document
        r = measured(child({**base, "kind": "dense", "length": budget}))
        rows.append(r)
        print_row(r, roof, rows)
    for n in sorted(set(lengths) | set(mem_lengths)):
        specs = []
        if n <= dense_max and n in lengths:
            specs.append({**base, "kind": "dense", "length": n})
        if n <= chunked_max and n in lengths:
            specs.append({**base, "kind": "chunked", "length": n})
        run_policies = policies if n <= 32 * 1024 else long_policies
        specs += policy_specs(args.ask_policies, "ask", {**base, "length": n})
        specs += policy_specs(",".join(run_policies), "kvtool", {**base, "length": n})
        for spec in specs:
            r = measured(child(spec))
            rows.append(r)
            print_row(r, roof, rows)
            save()
    if args.sweep:
        n = parse_tokens(args.sweep_length)
        ref = dense_continuation_nll({**base, "length": n, "continuation": args.sweep_continuation})
        print(f"\nblock-size sweep: {args.sweep_policy}, budget {budget}, {n} tokens, dense continuation "
              f"ppl {pow(2.718281828, ref):.3f}", flush=True)
        for bs in [int(x) for x in args.sweep.split(",")]:
            r = child({**base, "kind": "kvtool", "policy": args.sweep_policy, "length": n, "block_size": bs,
                       "continuation": args.sweep_continuation, "decode_tokens": 0})
            r["dense_continuation_nll"] = ref
            sweep_rows.append(r)
            if "error" in r:
                print(f"  block {bs:4d}: ERROR {r['error']}")
                continue
            ppl = pow(2.718281828, r["continuation_logits"])
            gap = ppl / pow(2.718281828, ref) - 1
            print(f"  block {bs:4d}: {n / r['prefill_seconds']:7.1f} tok/s   continuation ppl {ppl:8.3f} "
                  f"(gap to dense {gap * 100:+.2f}%)", flush=True)
    ratios = {}
    if args.concurrency_length:
        n = parse_tokens(args.concurrency_length)
        print(f"\ntwo concurrent processes, {os.cpu_count()} CPUs:", flush=True)
        ratios["default"] = concurrency(base, args.concurrency_policy, n, args.threads)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if args.threads is None and cores > 1:
            ratios["split"] = concurrency(base, args.concurrency_policy, n, max(1, cores // 2))
    check_targets(rows, roof, budget, mem_lengths, ratios)
    print_markdown(rows, roof)
    save()


def device_label(device_name: str) -> str:
    import torch

    if device_name == "cuda":
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs)"


if __name__ == "__main__":
    main()
