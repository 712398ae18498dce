#!/usr/bin/env bash
# Set up .venv and train the demo: a small GPT on 2 CPU workers under the elastic agent.
# The demo needs no GPU: ELASTIC_TRAINER_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# installs the CPU build of torch (see scripts/setup.sh).
# Checkpoints go to runs/demo/checkpoints, events to runs/demo/events.jsonl. Extra arguments
# are passed to 'elastic-trainer launch' (e.g. --set train.steps=100).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ELASTIC_TRAINER_EXTRAS="" ELASTIC_TRAINER_SYSTEM_DEPS=0 bash scripts/setup.sh
if [ ! -f runs/data/demo.bin ]; then
  echo "building the demo data: runs/data/demo.bin (the bytes of Python's standard library)"
  .venv/bin/elastic-trainer data build --out runs/data/demo.bin > /dev/null
fi
exec .venv/bin/elastic-trainer launch configs/demo-cpu.toml "$@"
