"""An Accelerate loop over a model the user sharded with ``fully_shard`` before ``prepare`` (on
CPU Accelerate would wrap a plain model in DDP): ``python accelerate_fsdp2.py PROJECT_DIR STEPS
[NAN_AT]`` (the loss of step NAN_AT made NaN)."""

import sys

import torch
from accelerate.utils import ProjectConfiguration
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from elastic_trainer.accelerate import Accelerator

if __name__ == "__main__":
    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=sys.argv[1]))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(60, 8, generator=g), torch.randn(60, 1, generator=g))
    loader = DataLoader(data, batch_size=3, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.load_state()
    steps, done = int(sys.argv[2]), accelerator.completed_steps
    nan_at = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    while done < steps:
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss * float("nan") if done + 1 == nan_at else loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            done += 1
            if done % 3 == 0:
                accelerator.save_state()
            if done == steps:
                break
    accelerator.end_training()
