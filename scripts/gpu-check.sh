#!/usr/bin/env bash
# One command for a CUDA machine: the CUDA-marked tests (tests/test_cuda.py: the oracles on CUDA in bf16
# and fp16, bitsandbytes 8/4-bit loading when installed, device_map), then the real-shape benchmark
# (bench/prefill.py --config llama-3.1-8b at 4K, 32K and 128K against dense SDPA and chunked prefill:
# tok/s, peak allocated, math-backend share of SDPA calls, the GPU targets), written to one JSON file
# with the device name. On a machine without CUDA it says so and exits 0.
#
#   scripts/gpu-check.sh [OUT.json]          # default: gpu-check.json
#   BLOCK=1024 BUDGET=4k POLICIES=sink,tova LENGTHS=4k,32k,128k scripts/gpu-check.sh
#
# Exit code: 0 when the tests and the benchmark ran (targets are printed, not enforced), 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
[ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ] && . .venv/bin/activate
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
OUT=${1:-gpu-check.json}

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)" 2>/dev/null; then
  echo "gpu-check: no CUDA device here (torch.cuda.is_available() is false): nothing to check" >&2
  exit 0
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
echo "gpu-check: CUDA tests (pytest -m cuda tests/test_cuda.py)" >&2
"$PY" -m pytest -m cuda tests/test_cuda.py -p no:cacheprovider -q -rs 2>&1 | tee "$WORK/tests.log"
TESTS_RC=${PIPESTATUS[0]}

echo "gpu-check: real-shape benchmark (bench/prefill.py --config llama-3.1-8b)" >&2
"$PY" bench/prefill.py --config llama-3.1-8b --lengths "${LENGTHS:-4k,32k,128k}" \
  --policies "${POLICIES:-sink,tova}" --budget "${BUDGET:-4k}" --block-size "${BLOCK:-1024}" \
  --dense-max 128k --chunked-max 4k --memory-lengths 4k,128k --concurrency-length '' \
  --decode-tokens "${DECODE_TOKENS:-256}" --json "$WORK/bench.json" 2>&1 | tee "$WORK/bench.log"
BENCH_RC=${PIPESTATUS[0]}

"$PY" - "$OUT" "$WORK" "$TESTS_RC" "$BENCH_RC" <<'EOF'
import json, os, sys, time
from pathlib import Path

import torch

out, work, tests_rc, bench_rc = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
lines = [x for x in (work / "tests.log").read_text(errors="replace").splitlines() if x.strip()]
bench = work / "bench.json"
doc = {
    "device": torch.cuda.get_device_name(0),
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "tests": {"exit_code": tests_rc, "summary": lines[-1] if lines else ""},
    "bench": {"exit_code": bench_rc, **(json.loads(bench.read_text()) if bench.exists() else {}),
              "targets": [x.strip() for x in (work / "bench.log").read_text(errors="replace").splitlines()
                          if x.strip().startswith(("ok ", "MISS", "n/a", "math-backend"))]},
}
tmp = out.with_name(out.name + ".tmp")
tmp.write_text(json.dumps(doc, indent=1))
os.replace(tmp, out)
print(f"gpu-check: wrote {out} ({doc['device']})", file=sys.stderr)
EOF
MERGE_RC=$?
[ "$TESTS_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ] && [ "$MERGE_RC" -eq 0 ] && exit 0
exit 1
