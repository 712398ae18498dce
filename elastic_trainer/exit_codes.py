"""Process exit codes shared by workers and the supervisor (``elastic-trainer launch``).

The supervisor exits with what the workers reported: 75 only when a commit of the final step
exists in storage. 2, 65 and 73 are terminal: every rank reaches them alike and a restart would
only repeat them, so the supervisor does not restart the group for them.
"""

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

TERMINAL = frozenset({CONFIG, NONFINITE, FENCED})
