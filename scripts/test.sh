#!/usr/bin/env bash
# Set up .venv (see scripts/setup.sh), run ruff and the import-layering contract, then the whole test suite.
# Soak rounds are bounded by default; ELASTIC_TRAINER_SOAK=1 runs the long versions.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
export PATH="$ROOT/.venv/bin:$PATH"
# Static checks first: ruff, and the import-layering contract (pyproject [tool.importlinter]).
.venv/bin/ruff check elastic_trainer tests bench examples
PYTHONPATH="$ROOT" .venv/bin/lint-imports
exec .venv/bin/python -m pytest -p no:cacheprovider -ra "$@"
