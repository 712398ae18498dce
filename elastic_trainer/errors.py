"""Typed error hierarchy.

User input problems are ``ConfigError`` (a ``ValueError``) and name the offending key.
Infrastructure problems carry ``retryable`` so callers decide without string matching.
"""


class ElasticTrainerError(Exception):
    """Base class of every error this package raises on purpose."""

    retryable = False


class ConfigError(ElasticTrainerError, ValueError):
    """A configuration value is unknown, mistyped or impossible. ``key`` names it."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"config error at '{key}': {message}")


class StorageError(ElasticTrainerError):
    """A storage operation failed."""


class TransientStorageError(StorageError):
    retryable = True


class CheckpointError(ElasticTrainerError):
    """A checkpoint is unusable (missing files, truncated shard, wrong model)."""


class SharedMemoryFullError(CheckpointError):
    """A rank's state does not fit in the node's shared memory (``/dev/shm``), where the process
    writer (``checkpoint.writer = "process"``) stages it."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A checkpoint does not fit the configured model. ``key`` names the state-dict key or config key."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"checkpoint does not match the model at '{key}': {message}")


class CheckpointIntegrityError(CheckpointError):
    """Bytes read from (or about to be committed to) a checkpoint do not match their checksums."""


class CheckpointStopError(CheckpointError):
    """A resume that must stop before training, with exit code 2 and nothing quarantined,
    deleted or written: retrying, falling back to an older checkpoint or starting over would
    each lose or hide the user's committed state. Raised identically on every rank."""


class CheckpointIncompatibleError(CheckpointStopError):
    """The checkpoint is intact but does not fit the code: keys missing or unexpected, shapes,
    dtypes or state types that differ, per-rank state at another world size, an unknown format
    version. The message names the checkpoint, every key grouped by ``Stateful``, and the ways
    forward."""


class NoUsableCheckpointError(CheckpointStopError):
    """Commits exist in the lineage being resumed, but none of them can be loaded (all
    quarantined or incomplete): training from step 0 would silently discard them."""


class FencedError(CheckpointError):
    """A newer launch owns the checkpoint root: this writer must not commit, clean or delete."""


class RunChangedError(ConfigError):
    """A resume would continue a checkpoint with run-defining settings changed: one line per key."""

    def __init__(self, changes: list[tuple[str, object, object]]):
        self.changes = changes
        key, old, new = changes[0]
        super().__init__(key, f"checkpoint has {old!r}, config has {new!r}")
        self.args = (
            "\n".join(f"config error at '{k}': checkpoint has {o!r}, config has {n!r}" for k, o, n in changes)
            + "\n(to continue this checkpoint with these changes on purpose, "
            "set checkpoint.allow_changes = [...] naming them)",
        )

    def __str__(self) -> str:
        return self.args[0]
