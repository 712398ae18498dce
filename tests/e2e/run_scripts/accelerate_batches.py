"""An Accelerate loop with ``DataLoader(batch_size=4, shuffle=True)`` (``SHUFFLE=0``: ``False``,
with an unshuffled evaluation loader prepared beside it) and 2 accumulation steps:
``python accelerate_batches.py OUT_DIR STEPS``. Each micro-batch's sample ids go to
``OUT_DIR/batches-rank<R>.jsonl`` with the step they belong to, so a test can check the forward's
size and the samples of every step at every world size."""

import json
import os
import sys

import torch
from torch.utils.data import DataLoader, Dataset

from elastic_trainer.accelerate import Accelerator


class Samples(Dataset):
    def __len__(self):
        return 96

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"id": i, "x": torch.randn(8, generator=g), "y": torch.randn(1, generator=g)}


if __name__ == "__main__":
    out, steps = sys.argv[1], int(sys.argv[2])
    accelerator = Accelerator(gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    shuffle = os.environ.get("SHUFFLE", "1") == "1"
    loader = DataLoader(Samples(), batch_size=4, shuffle=shuffle)
    evaluation = DataLoader(Samples(), batch_size=8)
    model, optimizer, loader, evaluation = accelerator.prepare(model, optimizer, loader, evaluation)
    assert len(evaluation) == 96 // 8 // accelerator.num_processes, "the evaluation loader is Accelerate's"
    accelerator.load_state()
    done = accelerator.completed_steps
    with open(os.path.join(out, f"batches-rank{accelerator.process_index}.jsonl"), "a") as log:
        while done < steps:
            for batch in loader:
                with accelerator.accumulate(model):
                    loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                log.write(json.dumps({"step": done + 1, "ids": batch["id"].tolist()}) + "\n")
                if accelerator.sync_gradients:
                    done += 1
                    if done == steps:
                        break
    accelerator.end_training()
