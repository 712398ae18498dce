"""Supervised fine-tuning with TRL's ``SFTTrainer`` on elastic_trainer: one class line
(docs/transformers.md#trl-and-other-trainer-subclasses).

A small GPT-2 built from a config (no download) with a byte-level tokenizer made here, fine-tuned
on lines of text (default: this repository's docs), each line one example of its own length,
padded per micro-batch, the loss normalised by the step's token count.

    elastic-trainer run --nproc-per-node 2 examples/trl_sft.py --steps 20
    torchrun --nproc-per-node 2 examples/trl_sft.py --steps 20
    python examples/trl_sft.py --steps 20

TRL's ``SFTConfig`` turns on ``bf16`` mixed precision by default (also on CPU): a resume at the same
world size stays bit for bit, a resume at another one agrees to bf16's precision; pass
``--no-bf16`` for float32.
"""

import argparse
import glob
import os

import torch
import trl
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, set_seed

from elastic_trainer.transformers import Trainer

HERE = os.path.dirname(os.path.abspath(__file__))


class SFTTrainer(trl.SFTTrainer, Trainer):
    """TRL's trainer over elastic_trainer's (method order: TRL's, then ours, then Transformers')."""


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2's byte-level encoding without its merges: one token per byte, plus pad and end."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)} | {"<|pad|>": 256, "<|endoftext|>": 257}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|endoftext|>")


def lines(pattern: str) -> Dataset:
    text = [ln.strip() for p in sorted(glob.glob(pattern)) for ln in open(p, encoding="utf-8")]
    return Dataset.from_dict({"text": [t for t in text if 16 <= len(t) <= 200]})


def main() -> None:
    ap = argparse.ArgumentParser(description="supervised fine-tuning with TRL's SFTTrainer")
    ap.add_argument("--train-files", default=os.path.join(HERE, "..", "docs", "*.md"))
    ap.add_argument("--output-dir", default="runs/trl_sft")
    ap.add_argument("--max-length", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=4, help="per device")
    ap.add_argument("--gradient-accumulation-steps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save-steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--no-bf16", action="store_true", help="float32 (TRL's default is bf16 mixed precision)")
    args = ap.parse_args()

    set_seed(0)
    tokenizer = byte_tokenizer()
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=args.max_length,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=args.dropout,
        embd_pdrop=args.dropout,
        attn_pdrop=args.dropout,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    sft_args = trl.SFTConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=2,
        max_length=args.max_length,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        seed=0,
        use_cpu=not torch.cuda.is_available(),  # bf16 on a machine without a GPU needs it said
        **({"bf16": False} if args.no_bf16 else {}),
    )
    trainer = SFTTrainer(
        model=GPT2LMHeadModel(config), args=sft_args, train_dataset=lines(args.train_files), processing_class=tokenizer
    )
    trainer.train(resume_from_checkpoint=True)
    trainer.save_model()


if __name__ == "__main__":
    main()
