#!/usr/bin/env bash
# Create .venv in the repo root and install everything: torch first, then the project with its
# extras (default test,hf,lightning,accelerate,transformers,trl: the tests also train a tiny
# transformers Llama, a Lightning module, an Accelerate loop, a Transformers Trainer and TRL's SFTTrainer), then,
# when running as root, the system components the tests start (Prometheus, SLURM, kustomize,
# hadolint).
# ELASTIC_TRAINER_VENV names another virtualenv (default .venv). Idempotent. pip's output goes to
# the venv's setup.log and is shown only when a step fails.
#
# Choosing the torch build (the project needs torch>=2.11; the suite runs on 2.13.0):
#   ELASTIC_TRAINER_TORCH            what to install for torch: a requirement ("torch==2.13.0",
#                                    the default; "torch>=2.13") or a wheel file/URL
#   ELASTIC_TRAINER_TORCH_INDEX_URL  the package index for torch only, e.g.
#                                    https://download.pytorch.org/whl/cpu  (the CPU build: no GPU
#                                    libraries to download; what the demo needs), or
#                                    https://download.pytorch.org/whl/cu128 for a CUDA build
# Without either, pip installs torch==2.13.0 from your configured index (on PyPI for Linux that
# is the CUDA build, several GB). A torch that already satisfies the choice is kept.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
EXTRAS="${ELASTIC_TRAINER_EXTRAS:-test,hf,lightning,accelerate,transformers,trl}"
PY="${PYTHON:-python3}"
TORCH="${ELASTIC_TRAINER_TORCH:-torch==2.13.0}"
TORCH_INDEX="${ELASTIC_TRAINER_TORCH_INDEX_URL:-}"
VENV="${ELASTIC_TRAINER_VENV:-.venv}"
if [ ! -x "$VENV"/bin/python ]; then
  "$PY" -m venv "$VENV"
fi
LOG="$VENV"/setup.log
: > "$LOG"
step() {  # step DESCRIPTION CMD...: run CMD with its output in $LOG; show the log if it fails
  local what="$1"; shift
  echo "+ $*" >> "$LOG"
  if ! "$@" >> "$LOG" 2>&1; then
    echo "setup: $what failed; pip's output ($LOG):" >&2
    tail -n 40 "$LOG" >&2
    exit 1
  fi
}
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$VENV"/bin/python -m pip install -q --upgrade pip >> "$LOG" 2>&1 || true
# pip keeps an installed torch that already satisfies the choice (no download, no index query).
step "installing torch ($TORCH)" "$VENV"/bin/pip install -q ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "$TORCH"
if [ -n "$EXTRAS" ]; then
  step "installing elastic-trainer[$EXTRAS]" "$VENV"/bin/pip install -q -e ".[${EXTRAS}]"
else
  step "installing elastic-trainer" "$VENV"/bin/pip install -q -e .
fi
# Byte-compile the project's own sources once: with PYTHONDONTWRITEBYTECODE set (as in many
# containers) every process (supervisor, zygote, CLI) would otherwise compile them again at import.
"$VENV"/bin/python -m compileall -q elastic_trainer tests bench examples > /dev/null
"$VENV"/bin/python -c "import torch, elastic_trainer; print('set-up done: $VENV with torch', torch.__version__, '| elastic_trainer', elastic_trainer.__version__)"
if [ "${ELASTIC_TRAINER_SYSTEM_DEPS:-1}" = "1" ] && [ "$(id -u)" = "0" ]; then
  for f in scripts/system-deps.d/*.sh; do
    [ -e "$f" ] || continue
    echo "system deps: $f"
    bash "$f"
  done
fi
