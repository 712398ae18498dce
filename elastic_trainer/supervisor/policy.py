"""Pure decisions of the supervisor, table-tested."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: requeue/restart the job and it resumes from the last commit


def restart_backoff(restart_index: int, base: float = 1.0, cap: float = 30.0) -> float:
    """Seconds to wait before restart number ``restart_index`` (1-based) after a *failure*.
    Membership changes (a node joining) restart at once."""
    if restart_index <= 1:
        return 0.0
    return min(cap, base * 2 ** (restart_index - 2))


BACKOFF_RESET_SECONDS = 60.0


def failure_streak(previous: int, healthy_seconds: float, reset_after: float = BACKOFF_RESET_SECONDS) -> int:
    """1-based index of this failure restart for :func:`restart_backoff`: consecutive failures
    escalate the back-off; a group that ran ``reset_after`` seconds since the last restart
    starts over (an occasional failure on a long job restarts at once)."""
    return 1 if healthy_seconds >= reset_after else previous + 1


def launch_exit_code(*, failed: bool, signalled: bool, preempt_marker: dict | None) -> int:
    """Exit code of ``elastic-trainer launch`` from how the agent ended. Workers that all
    finished win over a preemption marker (one left by a group restarted for a membership
    change must not turn a finished job into "requeue me")."""
    if signalled:
        return EXIT_PREEMPTED
    if not failed:
        return EXIT_OK
    return EXIT_PREEMPTED if preempt_marker is not None else EXIT_FAILED


def preempted_by_exit_codes(failures: list[dict]) -> dict | None:
    """A preemption record when a worker ended with :data:`EXIT_PREEMPTED` (its own "I saved and
    stopped for preemption", e.g. a script under ``run`` that exits 75 on SIGTERM), else None.
    ``failures``: :func:`describe_failures` output."""
    codes = sorted({f.get("exit_code") for f in failures if f.get("exit_code") is not None})
    return {"exit_codes": codes} if EXIT_PREEMPTED in codes else None


FAILED_STOP_GRACE_SECONDS = 5.0


def stop_grace_seconds(*, failed: bool, preempt_shutdown: float) -> float:
    """Seconds the workers get between SIGTERM and SIGKILL when the agent restarts the group.

    A healthy group (a node joined) uses them to commit a preemption checkpoint, so it gets the
    preemption budget (``preempt_shutdown``); a failed group cannot complete a collective, and
    waiting for it only delays the restart."""
    return min(FAILED_STOP_GRACE_SECONDS, preempt_shutdown) if failed else preempt_shutdown


def refund_restart(*, failed: bool, nodes_before: int, nodes_after: int) -> bool:
    """Whether a failure restart after which the group has fewer nodes gives its restart back.

    Losing a node makes every surviving worker fail its next collective, which torch's agent
    counts as a failure of each survivor; it is a membership change, so it should not use up
    ``max_restarts`` (a join never does). Failures of the survivors themselves keep the node
    count and still count."""
    return failed and nodes_after < nodes_before


def describe_failures(failures: dict) -> list[dict]:
    """Restart-event payload from torch's ProcessFailure objects (which read the @record error files)."""
    out = []
    for local_rank, f in sorted(failures.items()):
        msg = f.message
        if isinstance(msg, dict):
            msg = msg.get("message", msg)
        out.append(
            {
                "local_rank": local_rank,
                "global_rank": getattr(f, "rank", None),
                "exit_code": getattr(f, "exitcode", None),
                "signal": f.signal_name() if getattr(f, "exitcode", 0) is not None and f.exitcode < 0 else None,
                "error": str(msg)[:500] if msg else None,
                "error_file": getattr(f, "error_file", None),
            }
        )
    return out
