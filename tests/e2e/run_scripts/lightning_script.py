"""examples/lightning_fsdp2.py with each rank's sample ids recorded (tests/e2e/test_lightning.py).

    lightning_script.py SAMPLES_DIR [the example's arguments]

Each rank appends ``{"step", "rank", "world", "ids"}`` per training batch to
``SAMPLES_DIR/samples-<rank>.jsonl``: the global sample order a resume must continue. With
``EXPORT_TO`` set, ``trainer.save_checkpoint(EXPORT_TO)`` runs at the end of the fit.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

import lightning_fsdp2 as example

SAMPLES_DIR = sys.argv.pop(1)


class IdTokens(example.Tokens):
    def __getitem__(self, i):
        return i, self.data[i]


class Recorded(example.CausalLM):
    def training_step(self, batch, batch_idx):
        ids, tokens = batch
        with open(os.path.join(SAMPLES_DIR, f"samples-{self.global_rank}.jsonl"), "a") as f:
            step, world = self.trainer.global_step + 1, self.trainer.world_size
            f.write(json.dumps({"step": step, "rank": self.global_rank, "world": world, "ids": ids.tolist()}))
            f.write("\n")
        return super().training_step(tokens, batch_idx)

    def on_fit_end(self):
        if os.environ.get("EXPORT_TO"):
            self.trainer.save_checkpoint(os.environ["EXPORT_TO"])


if __name__ == "__main__":
    example.main(Recorded, IdTokens)
