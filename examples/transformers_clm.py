"""Causal-LM pre-training with the Hugging Face Transformers ``Trainer``, on elastic_trainer by
changing its import (docs/transformers.md).

A small GPT-2 built from a config (no download; dropout on), trained on any text files (default:
this repository's docs) cut into blocks of bytes, with ``TrainingArguments`` as a Trainer user
writes them: ``save_steps``, ``save_total_limit``, a cosine schedule with warm-up, gradient
accumulation 2, ``resume_from_checkpoint=True``.

    elastic-trainer run --nproc-per-node 2 examples/transformers_clm.py --steps 20
    torchrun --nproc-per-node 2 examples/transformers_clm.py --steps 20
    python examples/transformers_clm.py --steps 20
"""

import argparse
import glob
import os

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments, set_seed
from transformers.trainer_utils import get_last_checkpoint

from elastic_trainer.transformers import Trainer

HERE = os.path.dirname(os.path.abspath(__file__))


class Blocks(Dataset):
    """run_clm's tokenise + group_texts, byte-wise: one token stream cut into blocks; labels = input_ids."""

    def __init__(self, paths: list[str], block_size: int):
        data = b"".join(open(p, "rb").read() for p in sorted(paths))
        ids = torch.tensor(list(data[: len(data) // block_size * block_size]), dtype=torch.long)
        self.blocks = ids.view(-1, block_size)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def main() -> None:
    ap = argparse.ArgumentParser(description="causal LM training with the Transformers Trainer")
    ap.add_argument("--train-files", default=os.path.join(HERE, "..", "docs", "*.md"))
    ap.add_argument("--output-dir", default="runs/transformers_clm")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=4, help="per device")
    ap.add_argument("--gradient-accumulation-steps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--save-steps", type=int, default=5)
    ap.add_argument("--save-total-limit", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--dropout", type=float, default=0.1)
    args = ap.parse_args()

    set_seed(0)
    config = GPT2Config(
        vocab_size=256,
        n_positions=args.block_size,
        n_embd=32,
        n_layer=args.n_layer,
        n_head=2,
        resid_pdrop=args.dropout,
        embd_pdrop=args.dropout,
        attn_pdrop=args.dropout,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.lr,
        weight_decay=0.01,
        lr_scheduler_type="cosine",
        warmup_steps=args.warmup_steps,
        max_grad_norm=1.0,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=args.save_total_limit,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(
        model=model, args=training_args, train_dataset=Blocks(glob.glob(args.train_files), args.block_size)
    )
    # run_clm's resume: the newest checkpoint-N folder of output_dir, if any (under elastic_trainer:
    # None, and train() resumes from the newest valid commit, wherever checkpoint.dir is)
    last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    trainer.train(resume_from_checkpoint=last)
    trainer.save_model()  # output_dir: config.json + model.safetensors, for from_pretrained


if __name__ == "__main__":
    main()
