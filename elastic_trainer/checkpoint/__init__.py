"""Checkpointing: layout (pure naming and selection), Stateful adapters, the manager."""
