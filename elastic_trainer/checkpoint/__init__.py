"""Checkpointing: the manager and its save state machine, savers, agreement and resume plan; layout (pure naming
and selection), catalog, integrity, cadence, the local tier, Stateful adapters."""
