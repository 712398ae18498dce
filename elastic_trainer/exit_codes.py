"""Process exit codes shared by workers and the supervisor (``elastic-trainer launch``).

The supervisor exits with what the workers reported: 75 only when a commit of the final step
exists in storage. 65 and 73 are terminal: the supervisor does not restart the group for them.
"""

OK = 0
FAILED = 1
CONFIG = 2  # bad input, named before any worker starts
NONFINITE = 65  # EX_DATAERR: non-finite loss or gradient norm (train.on_nonfinite = "stop"), nothing after the last finite step committed
FENCED = 73  # EX_CANTCREAT: a newer launch owns the checkpoint root; this one stopped without committing
PREEMPTED = 75  # EX_TEMPFAIL: preemption checkpoint of the final step committed; requeue/restart resumes from it
PREEMPTED_UNCOMMITTED = 76  # preempted, final checkpoint not committed (grace budget missed); resume uses the previous commit

TERMINAL = frozenset({NONFINITE, FENCED})
