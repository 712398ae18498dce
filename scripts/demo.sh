#!/usr/bin/env bash
# Set up .venv and train the demo: a small GPT on 2 CPU workers under the elastic agent.
# Checkpoints go to runs/demo/checkpoints, events to runs/demo/events.jsonl. Extra arguments
# are passed to 'elastic-trainer launch' (e.g. --set train.steps=100).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ELASTIC_TRAINER_EXTRAS="" ELASTIC_TRAINER_SYSTEM_DEPS=0 bash scripts/setup.sh
if [ ! -f runs/data/demo.bin ]; then
  .venv/bin/elastic-trainer data build --out runs/data/demo.bin
fi
exec .venv/bin/elastic-trainer launch configs/demo-cpu.toml "$@"
