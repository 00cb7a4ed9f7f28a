#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite, real-model tests included, plus ruff.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check kvtool tests bench
lint-imports                       # the layer contract in pyproject.toml (core → policies → runtime → eval → cli)
python -m pytest -p no:cacheprovider "$@"
