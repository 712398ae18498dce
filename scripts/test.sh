#!/usr/bin/env bash
# Set up .venv (see scripts/setup.sh), run ruff (lint and format), the import-layering contract and mypy, then the whole test suite.
# Soak rounds are bounded by default; ELASTIC_TRAINER_SOAK=1 runs the long versions.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
export PATH="$ROOT/.venv/bin:$PATH"
# Static checks first: ruff lint and format (pyproject [tool.ruff]), the import-layering contract
# (pyproject [tool.importlinter]) and the type check of the package (pyproject [tool.mypy]).
PY_PATHS=(elastic_trainer tests bench examples)
.venv/bin/ruff check "${PY_PATHS[@]}"
.venv/bin/ruff format --check "${PY_PATHS[@]}"
PYTHONPATH="$ROOT" .venv/bin/lint-imports
.venv/bin/mypy
exec bash scripts/pytest.sh "$@"
