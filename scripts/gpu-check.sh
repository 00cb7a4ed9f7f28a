#!/usr/bin/env bash
# One command for a CUDA machine, sized for one lease (≤ 9 minutes on one H100/H200, no network, a stock
# CUDA + PyTorch + transformers image, no .venv: it runs with PYTHONPATH=. and whatever python3 has).
#
#   scripts/gpu-check.sh [--dry-run] [OUT_DIR]      # default OUT_DIR: $OUT if set, else ./gpu-check
#
# Steps, each in its own child with a timeout (a hang costs its step, not the lease), in this order:
#   preflight   bench/preflight.py: python, torch/CUDA, the device, every module (one line each)
#   tests       pytest -m cuda tests/test_cuda.py tests/test_archive_device.py tests/test_decode_step.py (oracles in
#               bf16/fp16, the archive's sync-debug and staging-contiguity tests, bitsandbytes loading, device_map,
#               the captured decode step against the eager one), then
#               tests/test_column_sums.py natively (the Triton kernels against float64 brute force in fp16/bf16,
#               reads through them against the explicit path, dense equality and the masking reference); the
#               step's exit code is the worse of the two and is recorded as "tests_exit_code"
#   equality    bench/real_equality.py: Llama-3.1-8B shape, 4 layers, bf16, 4K tokens, nothing evicted
#   syncs       bench/sync_debug.py: set_sync_debug_mode("warn") over blocks, a question, decoded tokens
#   probs       bench/probs_cost.py --measure: per block at the 8B shape (4 layers), the model's own forward
#               against H2O's statistic (the column-sum kernel), the Triton forward against SDPA, the explicit
#               statistic; the share statistic / forward (target <= 10%) and the counted traffic (<= 1.2x)
#   decode      bench/decode_step.py --config llama-3.1-8b: transformers' own decode after 32K, then decode tok/s
#               after DECODE_LENGTHS (32k,4k,128k) for h2o and sink in DECODE_MODES (capture,eager: the step captured
#               and not; "blocks", the block path, read 14-41 tok/s on the H200 and cost a minute: opt-in)
#   bench       bench/prefill.py --config llama-3.1-8b: the default ask path (h2o + recall) and sink at
#               4K/32K/128K against transformers' dense SDPA (all lengths) and chunked prefill (to 32K), every
#               row warmed up once in its own child and timed between synchronisations; tok/s, MFU, the
#               per-block split (the statistic's share), question seconds, peak allocated against the plan,
#               decode tok/s; the GPU targets printed at its end
#   smi         nvidia-smi
#   blocks, quant (not in the default ONLY: run 1 has them) bench/block_forward.py (the block's knee) and
#               bench/quant_weights.py (none/8-bit/4-bit weights through kvtool's loader)
# It writes OUT_DIR/gpu-check.json (every step's figures, exit codes and the device) and OUT_DIR/gpu-check.log.
# Without CUDA (or with CUDA_VISIBLE_DEVICES=) it prints the plan and exits 0, as --dry-run does.
#
# Environment: DEADLINE (seconds for all steps, default 520: one call of the device tool with timeout_s 600,
# predicted ~502 s), ONLY (a comma list of steps, default preflight,tests,probs,decode,bench,smi: equality and
# syncs are opt-in, the tests step holds their bf16 oracles and sync-debug checks), LENGTHS
# (default 4k,32k,128k), BUDGET (4k), BLOCK (auto: what kvtool picks on the GPU), DECODE_TOKENS (0: the bench
# step's decode rows would include the step's capture; decode is measured by the decode step, warmed up),
# DECODE_LENGTHS (32k,4k,128k), DECODE_MODES (capture,eager), PYTHON (default: .venv's python if present, else
# python3).
# Exit code: 0 when every step ran and passed, 1 otherwise (the JSON says which).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT_DIR=${1:-${OUT:-gpu-check}}
[ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ] && . .venv/bin/activate
PY=${PYTHON:-$([ -n "${VIRTUAL_ENV:-}" ] && echo python || echo python3)}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
DEADLINE=${DEADLINE:-520}
LENGTHS=${LENGTHS:-4k,32k,128k}
BUDGET=${BUDGET:-4k}
BLOCK=${BLOCK:-auto}
DECODE_TOKENS=${DECODE_TOKENS:-0}
ONLY=${ONLY:-preflight,tests,probs,decode,bench,smi}
DECODE_LENGTHS=${DECODE_LENGTHS:-32k,4k,128k}
DECODE_MODES=${DECODE_MODES:-capture,eager}

# name | cap (s) | predicted (s) | command (run from the repository root; $W is the step-JSON folder)
STEPS=(
  "preflight|30|5|$PY bench/preflight.py --json \$W/preflight.json"
  "tests|180|120|$PY -m pytest -m cuda tests/test_cuda.py tests/test_archive_device.py tests/test_decode_step.py -p no:cacheprovider -q -rs; \
a=\$?; $PY -m pytest tests/test_column_sums.py -p no:cacheprovider -q -rs; b=\$?; exit \$(( a > b ? a : b ))"
  "equality|90|30|$PY bench/real_equality.py --config llama-3.1-8b --layers 4 --tokens 4k --json \$W/equality.json"
  "syncs|90|30|$PY bench/sync_debug.py --config llama-3.1-8b --layers 4 --json \$W/syncs.json"
  "probs|90|25|$PY bench/probs_cost.py --measure --config llama-3.1-8b --layers 4 --budget $BUDGET --blocks 128,1024 \
--json \$W/probs.json"
  "decode|240|130|$PY bench/decode_step.py --config llama-3.1-8b --lengths $DECODE_LENGTHS --policies h2o,sink \
--modes $DECODE_MODES --budget $BUDGET --decode-tokens 256 --baseline-lengths 32k --json \$W/decode.json"
  "bench|300|220|$PY bench/prefill.py --config llama-3.1-8b --lengths $LENGTHS --ask-policies h2o --policies sink \
--budget $BUDGET --block-size $BLOCK --dense-max 128k --chunked-max 32k --memory-lengths 4k,128k --warmup on \
--concurrency-length '' --decode-tokens $DECODE_TOKENS --child-timeout 150 --json \$W/bench.json"
  "smi|15|2|nvidia-smi"
  "blocks|60|20|$PY bench/block_forward.py --config llama-3.1-8b --layers 4 --context 4k --json \$W/blocks.json"
  "quant|120|60|$PY bench/quant_weights.py --config llama-3.1-8b --layers 4 --tokens 4k --json \$W/quant.json"
)

has_cuda() { "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)" 2>/dev/null; }

if [ "$DRY" = 1 ] || ! has_cuda; then
  [ "$DRY" = 1 ] || echo "gpu-check: no CUDA device here (torch.cuda.is_available() is false): nothing to run" >&2
  total=0
  echo "gpu-check plan ($PY; JSON and log into $OUT_DIR/; all steps within DEADLINE=${DEADLINE} s):" >&2
  for s in "${STEPS[@]}"; do
    IFS='|' read -r name cap pred cmd <<<"$s"
    if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then continue; fi
    total=$((total + pred))
    printf '  %-9s ~%3d s (timeout %3d s)  %s\n' "$name" "$pred" "$cap" "$cmd" >&2
  done
  echo "  predicted: ~${total} s of device time, plus the machine's start" >&2
  exit 0
fi

mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
W=$(mktemp -d)
cleanup() { rm -rf "$W"; }
trap cleanup EXIT
trap 'cleanup; exit 130' INT TERM
LOG="$OUT_DIR/gpu-check.log"
: >"$LOG"
START=$(date +%s)
RESULTS=()
for s in "${STEPS[@]}"; do
  IFS='|' read -r name cap pred cmd <<<"$s"
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then continue; fi
  left=$((DEADLINE - ($(date +%s) - START)))
  limit=$((cap < left ? cap : left))
  [ "$name" = smi ] && limit=$cap  # the device's state is read whatever time is left
  if [ "$limit" -lt 10 ]; then
    echo "gpu-check: $name skipped: ${left} s left of DEADLINE=${DEADLINE}" | tee -a "$LOG" >&2
    RESULTS+=("$name|skipped|0")
    continue
  fi
  echo "=== gpu-check: $name (timeout ${limit} s): ${cmd//\$W/$W}" | tee -a "$LOG" >&2
  t0=$(date +%s)
  W="$W" timeout -k 10 "$limit" bash -c "W='$W'; $cmd" > >(tee "$W/$name.out" >>"$LOG") 2>&1
  rc=$?
  sleep 0.2  # let tee finish the step's output
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && echo "gpu-check: $name timed out after ${limit} s" | tee -a "$LOG" >&2
  echo "=== gpu-check: $name exit $rc in $(($(date +%s) - t0)) s" | tee -a "$LOG" >&2
  RESULTS+=("$name|$rc|$(($(date +%s) - t0))")
done

"$PY" - "$OUT_DIR/gpu-check.json" "$W" "${RESULTS[@]}" <<'EOF'
import json, os, sys, time
from pathlib import Path

out, work, results = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
doc = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "steps": {}}
for item in results:
    name, rc, seconds = item.split("|")
    lines = [x for x in (work / f"{name}.out").read_text(errors="replace").splitlines() if x.strip()] \
        if (work / f"{name}.out").exists() else []
    step = {"exit_code": None if rc == "skipped" else int(rc), "seconds": int(seconds), "tail": lines[-40:]}
    data = work / f"{name}.json"
    if data.exists():
        step["data"] = json.loads(data.read_text())
    doc["steps"][name] = step
pre = doc["steps"].get("preflight", {}).get("data", {})
doc["device"] = pre.get("device")
doc["torch"] = pre.get("modules", {}).get("torch")
doc["transformers"] = pre.get("modules", {}).get("transformers")
doc["cuda"] = pre.get("torch_cuda")
doc["tests_exit_code"] = doc["steps"].get("tests", {}).get("exit_code")  # the CUDA tests: 0 before any timing counts
doc["passed"] = all(s["exit_code"] == 0 for s in doc["steps"].values())
part = out.with_name(out.name + ".tmp")
part.write_text(json.dumps(doc, indent=1))
os.replace(part, out)
failed = [n for n, s in doc["steps"].items() if s["exit_code"] != 0]
print(f"gpu-check: wrote {out} ({doc['device']}); {'all steps passed' if not failed else 'not passed: ' + ', '.join(failed)}",
      file=sys.stderr)
sys.exit(0 if doc["passed"] else 1)
EOF
