"""The cause of a failed save on one line, and whether a restart could change it."""

import errno

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from elastic_trainer.checkpoint import failure


def _dcp(inner: BaseException) -> CheckpointException:
    """A failure as DCP hands it back: wrapped per rank, the traceback text in its message."""
    return CheckpointException("save failed", {0: (inner, None), 1: (inner, None)})


def _chained(inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except OSError as e:
            raise RuntimeError("upload failed") from e
    except RuntimeError as outer:
        return outer


@pytest.mark.parametrize(
    "exc, permanent",
    [
        (_dcp(OSError(errno.ENOSPC, "No space left on device", "/ck/step-4/__0_0.distcp")), True),
        (_chained(PermissionError(errno.EACCES, "Permission denied", "/ck/x")), True),
        (_dcp(OSError(errno.EROFS, "Read-only file system")), True),
        (_dcp(OSError(errno.EDQUOT, "Disk quota exceeded")), True),
        (_dcp(FileNotFoundError("An error occurred (NoSuchBucket): The specified bucket does not exist")), True),
        (_dcp(TimeoutError("read timed out")), False),
        (_chained(ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")), False),
        (_dcp(OSError(errno.EIO, "Input/output error")), False),
        (RuntimeError("something else"), False),
    ],
)
def test_permanent_causes_are_those_a_restart_cannot_change(exc, permanent):
    assert failure.permanent(exc) is permanent


def test_the_cause_is_named_on_one_line_with_errno_and_file():
    exc = _dcp(OSError(errno.ENOSPC, "No space left on device", "/ck/step-4/__0_0.distcp"))
    line = failure.describe(exc)
    assert line == "OSError: [Errno 28] No space left on device: '/ck/step-4/__0_0.distcp' (in CheckpointException)"
    chained = failure.describe(_chained(PermissionError(errno.EACCES, "Permission denied", "/ck/x")))
    assert chained == "PermissionError: [Errno 13] Permission denied: '/ck/x' (in RuntimeError)"
    assert failure.describe(ValueError("bad\nvalue")) == "ValueError: bad value"
    assert "\n" not in failure.describe(_dcp(TimeoutError("read\ntimed out")))


def test_an_error_of_ours_is_named_in_its_own_words_not_the_one_it_chains():
    from elastic_trainer.errors import SharedMemoryFullError

    try:
        try:
            raise RuntimeError("unable to allocate shared memory")
        except RuntimeError:
            raise SharedMemoryFullError("this rank's state does not fit in shared memory") from None
    except SharedMemoryFullError as e:
        exc = _dcp(e)
    assert failure.describe(exc) == (
        "SharedMemoryFullError: this rank's state does not fit in shared memory (in CheckpointException)"
    )
    assert not failure.permanent(exc)
