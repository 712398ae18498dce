"""elastic_trainer: fault-tolerant elastic FSDP2 training with async distributed checkpoints."""

__version__ = "0.1.0"
