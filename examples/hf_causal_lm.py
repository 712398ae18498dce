"""A Hugging Face causal-LM training loop in the style of transformers' ``run_clm_no_trainer``
(tokenise a text corpus, group it into blocks, ``default_data_collator``, AdamW with no weight
decay on biases and norms, a linear warm-up schedule from ``get_scheduler``), on elastic_trainer's
loop API instead of Accelerate; see docs/own-script.md for the diff.

The model is built from a ``config.json`` (``--config-dir``, default: the tiny Llama in
tests/data/hf); the corpus is any text files (default: this repository's docs), tokenised
byte-wise (no tokenizer files needed; use ``AutoTokenizer`` for a real run).

    elastic-trainer run --nproc-per-node 2 examples/hf_causal_lm.py --steps 20
"""

import argparse
import glob
import os

import torch
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, default_data_collator, get_scheduler

import elastic_trainer as et

HERE = os.path.dirname(os.path.abspath(__file__))


def grouped_blocks(paths: list[str], vocab_size: int, block_size: int) -> list[dict]:
    """run_clm's tokenise + group_texts: one token stream cut into blocks; labels = input_ids
    (the model shifts them)."""
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
    ap = argparse.ArgumentParser(description="causal LM fine-tuning on elastic_trainer")
    ap.add_argument("--config-dir", default=os.path.join(HERE, "..", "tests", "data", "hf", "tiny-llama"))
    ap.add_argument("--train-files", default=os.path.join(HERE, "..", "docs", "*.md"))
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = ap.parse_args()
    session = et.init(
        overrides=[
            "checkpoint.interval_steps=5",
            "train.global_batch_size=8",
            *args.overrides,
        ]
    )
    config = AutoConfig.from_pretrained(args.config_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model = session.shard(model, [type(model.model.layers[0])])
    no_decay = ("bias", "norm")
    groups = [
        {
            "params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
            "weight_decay": args.weight_decay,
        },
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=3e-3)
    scheduler = get_scheduler(
        "linear", optimizer=optimizer, num_warmup_steps=args.warmup_steps, num_training_steps=args.steps
    )
    train = grouped_blocks(glob.glob(args.train_files), config.vocab_size, args.block_size)
    loader = DataLoader(train, batch_size=8, collate_fn=default_data_collator)
    ckpt = et.Checkpointer(session, model=model, optimizer=optimizer, scheduler=scheduler, data=loader)
    for _, batch in ckpt.steps(args.steps):
        ckpt.optimizer_step(model(**batch).loss, max_norm=1.0)


if __name__ == "__main__":
    main()
