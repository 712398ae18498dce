"""examples/transformers_clm.py as it is, with the samples of every micro-batch logged:
``python transformers_logged.py LOG_DIR [the example's arguments]``. Each ``training_step``
appends ``{"step", "rows"}`` (a digest of each sample's tokens, the step it belongs to) to
``LOG_DIR/batches-rank<R>.jsonl``, so a test can compare the samples of every step, and the size
of every forward, across world sizes."""

import hashlib
import json
import os
import runpy
import sys

from elastic_trainer.transformers import Trainer

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "..", "..", "examples", "transformers_clm.py")

if __name__ == "__main__":
    log_dir = sys.argv.pop(1)
    step_once = Trainer.training_step

    def training_step(self, model, inputs, num_items_in_batch=None):
        rows = [hashlib.sha1(bytes(r.tolist())).hexdigest()[:12] for r in inputs["input_ids"]]
        with open(os.path.join(log_dir, f"batches-rank{self.args.process_index}.jsonl"), "a") as f:
            f.write(json.dumps({"step": self.state.global_step + 1, "rows": rows}) + "\n")
        return step_once(self, model, inputs, num_items_in_batch)

    Trainer.training_step = training_step
    sys.argv[0] = EXAMPLE
    runpy.run_path(EXAMPLE, run_name="__main__")
