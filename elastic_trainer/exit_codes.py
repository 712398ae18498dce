"""Process exit codes shared by workers and the supervisor (``elastic-trainer launch``).

The supervisor exits with what the workers reported: 75 only when a commit of the final step
exists in storage. 2, 65 and 73 are terminal: every rank reaches them alike and a restart would
only repeat them, so the supervisor does not restart the group for them; 69 is terminal for the
excluded node only (its workers alone report it). :func:`exit_now` is how
the command and the processes forked from the zygote end with their code.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

OK = 0
FAILED = 1
# bad input, named: configuration, storage, or a checkpoint the code cannot take (or none of its commits loads); nothing
# quarantined or written
CONFIG = 2
# EX_DATAERR: non-finite loss or gradient norm (train.on_nonfinite = "stop"), nothing after the last finite step
# committed
NONFINITE = 65
# EX_IOERR: training reached its last step but the final checkpoint was not committed (failed or past
# checkpoint.save_timeout_seconds; event final_checkpoint_failed); a restart resumes from the previous commit
FINAL_SAVE_FAILED = 74
FENCED = 73  # EX_CANTCREAT: a newer launch owns the checkpoint root; this one stopped without committing
PREEMPTED = 75  # EX_TEMPFAIL: preemption checkpoint of the final step committed; requeue/restart resumes from it
# preempted, final checkpoint not committed (grace budget missed); resume uses the previous commit
PREEMPTED_UNCOMMITTED = 76
# EX_UNAVAILABLE: this node computed a step its replay did not reproduce (silent data corruption) and
# elastic.exclude_corrupt_node is set: its supervisor leaves the job; the other nodes go on without it
EXCLUDED = 69
# a worker of a node that stays: the group re-forms without the excluded node (the supervisor restarts
# its workers as a membership change; never the exit code of a supervisor)
REGROUP = 79

TERMINAL = frozenset({CONFIG, NONFINITE, FENCED, EXCLUDED})


def exit_now(code: int) -> NoReturn:
    """End this process with ``code`` as the interpreter's exit would (``atexit`` handlers, then
    flushed output) but without its teardown. Torch keeps daemon threads of its own (the
    rendezvous keep-alive calls the store every few seconds); one that is inside a store call
    when the interpreter finalizes aborts the process on its way back (SIGABRT, "terminate
    called without an active exception"), replacing the exit code already decided and
    reported. Every process of ours that torch's threads may run in ends here."""
    try:
        import atexit

        atexit._run_exitfuncs()  # noqa: SLF001 - what the interpreter's exit runs (logging's flush, multiprocessing's)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)
