"""Checkpointing: the manager and its save state machine, lineage position, savers, commit, agreement, resume plan
and restore; layout (pure naming and selection), catalog, integrity, cadence, the local tier, Stateful adapters."""
