"""Storage seam: where checkpoints live (local path, file://, s3://, memory://)."""

from .fs import Storage, check_uri, open_storage

__all__ = ["Storage", "check_uri", "open_storage"]
