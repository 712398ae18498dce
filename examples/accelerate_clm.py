"""A causal-LM training loop in the style of transformers' ``run_clm_no_trainer``, written for
Hugging Face Accelerate, on elastic_trainer by changing its import (docs/accelerate.md).

Grouped text blocks, ``default_data_collator``, AdamW without weight decay on biases and norms,
``get_scheduler("linear", ...)``, ``accelerator.accumulate``, ``clip_grad_norm_``, a progress
object under ``register_for_checkpointing``, ``save_state()`` every ``--save-every`` steps and
``load_state()`` at the start. The model is built from a ``config.json`` (``--config-dir``,
default: the tiny Llama in tests/data/hf); the corpus is any text files (default: this
repository's docs), tokenised byte-wise.

    elastic-trainer run --nproc-per-node 2 examples/accelerate_clm.py --steps 20
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_clm.py --steps 20   # also without GPUs
    python examples/accelerate_clm.py --steps 20
"""

import argparse
import glob
import json
import os

import torch
from accelerate.utils import FullyShardedDataParallelPlugin, ProjectConfiguration, set_seed
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, default_data_collator, get_scheduler

from elastic_trainer.accelerate import Accelerator

HERE = os.path.dirname(os.path.abspath(__file__))


class Progress:
    """Optimizer steps taken: checkpointed with the rest (register_for_checkpointing)."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])


def grouped_blocks(paths: list[str], vocab_size: int, block_size: int) -> list[dict]:
    """run_clm's tokenise + group_texts: one token stream cut into blocks; labels = input_ids."""
    ids: list[int] = []
    for p in sorted(paths):
        with open(p, "rb") as f:
            ids += [b % vocab_size for b in f.read()]
    n = len(ids) // block_size * block_size
    return [
        {"input_ids": torch.tensor(ids[i : i + block_size]), "labels": torch.tensor(ids[i : i + block_size])}
        for i in range(0, n, block_size)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description="causal LM training with Accelerate")
    ap.add_argument("--config-dir", default=os.path.join(HERE, "..", "tests", "data", "hf", "tiny-llama"))
    ap.add_argument("--train-files", default=os.path.join(HERE, "..", "docs", "*.md"))
    ap.add_argument("--output-dir", default="runs/accelerate_clm")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=3, help="per process")
    ap.add_argument("--gradient-accumulation-steps", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--total-limit", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument(
        "--fsdp2-plugin",
        action="store_true",
        help="Accelerate shards the model with FSDP2 (FullyShardedDataParallelPlugin(fsdp_version=2); GPUs only)",
    )
    args = ap.parse_args()

    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        step_scheduler_with_optimizer=False,  # the schedule counts optimizer steps
        project_config=ProjectConfiguration(
            project_dir=args.output_dir, automatic_checkpoint_naming=True, total_limit=args.total_limit
        ),
        fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2) if args.fsdp2_plugin else None,
    )
    set_seed(0)
    config = AutoConfig.from_pretrained(args.config_dir)
    model = AutoModelForCausalLM.from_config(config)
    train = grouped_blocks(glob.glob(args.train_files), config.vocab_size, args.block_size)
    train_loader = DataLoader(train, shuffle=True, batch_size=args.batch_size, collate_fn=default_data_collator)
    no_decay = ("bias", "norm.weight")
    groups = [
        {
            "params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    scheduler = get_scheduler(
        "linear", optimizer=optimizer, num_warmup_steps=args.warmup_steps, num_training_steps=args.steps
    )
    model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)
    if args.fsdp2_plugin:  # Accelerate applies the plugin on GPUs only
        accelerator.print(json.dumps({"fsdp2_sharded": isinstance(model, FSDPModule)}))
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    accelerator.load_state()  # the newest checkpoint, if any
    # at another world size the first launch's global batch takes other accumulation steps
    accumulation = accelerator.gradient_accumulation_steps

    steps_per_epoch = len(train_loader) // accumulation
    model.train()
    while progress.steps < args.steps:
        done_in_epoch = progress.steps % steps_per_epoch * accumulation
        loader = accelerator.skip_first_batches(train_loader, done_in_epoch) if done_in_epoch else train_loader
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            progress.steps += 1
            losses = accelerator.gather(loss.detach()[None])
            if accelerator.is_main_process:
                print(json.dumps({"step": progress.steps, "loss": losses.mean().item()}), flush=True)
            if progress.steps % args.save_every == 0 or progress.steps == args.steps:
                accelerator.save_state()
            if progress.steps == args.steps:
                break
    accelerator.end_training()


if __name__ == "__main__":
    main()
