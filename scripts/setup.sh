#!/usr/bin/env bash
# Create .venv in the repo root and install everything: torch 2.13.0 first (the CPU build on
# local disk here; never let pip pull a CUDA build), then the project with its extras (test,hf:
# the tests also train a tiny transformers Llama), then, when running as root, the system
# components the tests start (Prometheus, SLURM, kustomize, hadolint). Idempotent.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
EXTRAS="${ELASTIC_TRAINER_EXTRAS:-test,hf}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  .venv/bin/pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
fi
if [ -n "$EXTRAS" ]; then
  .venv/bin/pip install -q -e ".[${EXTRAS}]" 2>&1 | grep -v "^WARNING: Location" || true
else
  .venv/bin/pip install -q -e . 2>&1 | grep -v "^WARNING: Location" || true
fi
.venv/bin/python -c "import torch, elastic_trainer; print('torch', torch.__version__, '| elastic_trainer', elastic_trainer.__version__)"
if [ "${ELASTIC_TRAINER_SYSTEM_DEPS:-1}" = "1" ] && [ "$(id -u)" = "0" ]; then
  for f in scripts/system-deps.d/*.sh; do
    [ -e "$f" ] || continue
    echo "system deps: $f"
    bash "$f"
  done
fi
