#!/usr/bin/env bash
# Set up .venv (see scripts/setup.sh), run ruff (lint and format) and the import-layering contract, then the whole test suite.
# Soak rounds are bounded by default; ELASTIC_TRAINER_SOAK=1 runs the long versions.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
export PATH="$ROOT/.venv/bin:$PATH"
# Static checks first: ruff lint and format (pyproject [tool.ruff]), and the import-layering contract
# (pyproject [tool.importlinter]).
PY_PATHS=(elastic_trainer tests bench examples)
.venv/bin/ruff check "${PY_PATHS[@]}"
.venv/bin/ruff format --check "${PY_PATHS[@]}"
PYTHONPATH="$ROOT" .venv/bin/lint-imports
exec .venv/bin/python -m pytest -p no:cacheprovider -ra "$@"
