#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite, real-model tests included, plus ruff; then the
# README's install in a fresh venv with a stock pip (scripts/fresh-install-check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check kvtool tests bench
lint-imports                       # the layer contract in pyproject.toml (core → policies → runtime → eval → cli)
python -m pytest -p no:cacheprovider "$@"
bash scripts/fresh-install-check.sh  # the README's install with a stock pip, then every format read
