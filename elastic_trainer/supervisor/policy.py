"""Pure decisions of the supervisor, table-tested."""

from __future__ import annotations

from collections.abc import Sequence

from .. import exit_codes


def restart_backoff(restart_index: int, base: float = 1.0, cap: float = 30.0) -> float:
    """Seconds to wait before restart number ``restart_index`` (1-based) after a *failure*.
    Membership changes (a node joining) restart at once."""
    if restart_index <= 1:
        return 0.0
    return min(cap, base * 2 ** (restart_index - 2))


BACKOFF_RESET_SECONDS = 60.0


def failure_streak(
    previous: int, healthy_seconds: float, progressed: bool = False, reset_after: float = BACKOFF_RESET_SECONDS
) -> int:
    """1-based index of this failure restart for :func:`restart_backoff`: consecutive failures
    escalate the back-off; the streak starts over when the group ran ``reset_after`` seconds
    since the last restart (an occasional failure on a long job restarts at once) or when it
    ``progressed`` (committed a newer checkpoint than at the previous failure: a job that moves
    forward between frequent failures is not a crash loop, and waiting would only lose time)."""
    return 1 if healthy_seconds >= reset_after or progressed else previous + 1


def backoff_may_apply(previous: int, healthy_seconds: float, reset_after: float = BACKOFF_RESET_SECONDS) -> bool:
    """Whether this failure restart would be backed off unless the group progressed (then the
    supervisor reads the newest commit; otherwise it does not wait for storage)."""
    return restart_backoff(failure_streak(previous, healthy_seconds, reset_after=reset_after)) > 0


def terminal_code(worker_exit_codes: list[int | None], marker: dict | None = None) -> int | None:
    """The terminal exit code (non-finite stop, fenced) when every failed worker reported the
    same one: the group is not restarted for it. None otherwise. A failed final save (74) is
    terminal when rank 0's ``marker`` says a restart cannot change its cause (``restartable``
    false: no space, permission denied, ...)."""
    codes = set(worker_exit_codes)
    if len(codes) == 1:
        (code,) = codes
        if code in exit_codes.TERMINAL:
            return code
        if code == exit_codes.FINAL_SAVE_FAILED and (marker or {}).get("restartable") is False:
            return code
    return None


def ends_round(worker_exit_codes: Sequence[int | None]) -> str | None:
    """How this node's workers ended a round together after excluding a node
    (``elastic.exclude_corrupt_node``): ``"leave"`` (every one 69: this node is the excluded
    one; its supervisor leaves the rendezvous without closing it), ``"regroup"`` (every one 79:
    restart them as a membership change, without the excluded node), else None."""
    codes = set(worker_exit_codes)
    if codes == {exit_codes.EXCLUDED}:
        return "leave"
    if codes == {exit_codes.REGROUP}:
        return "regroup"
    return None


def launch_exit_code(
    *, failed: bool, signalled: bool, preempt_marker: dict | None, worker_exit_codes: Sequence[int | None] = ()
) -> int:
    """Exit code of ``elastic-trainer launch`` from how the agent ended: what the workers
    reported. 75 only when rank 0's marker says the final step's commit exists; a preemption
    without that proof is 76. Workers that all finished win over a preemption marker (one left
    by a group restarted for a membership change must not turn a finished job into "requeue me")."""
    marker_code = (preempt_marker or {}).get("exit_code")
    codes = {c for c in worker_exit_codes if c is not None}
    preempted = {exit_codes.PREEMPTED, exit_codes.PREEMPTED_UNCOMMITTED}
    # Without rank 0's marker (e.g. a script under ``run``), the workers' own exit codes say it.
    reported = (
        (exit_codes.PREEMPTED_UNCOMMITTED if exit_codes.PREEMPTED_UNCOMMITTED in codes else exit_codes.PREEMPTED)
        if codes and codes <= preempted
        else None
    )
    if signalled:
        return marker_code if marker_code in preempted else reported or exit_codes.PREEMPTED_UNCOMMITTED
    if not failed:
        return exit_codes.OK
    terminal = terminal_code(list(worker_exit_codes))
    if terminal is not None:
        return terminal
    if marker_code in preempted:
        return marker_code
    if codes == {exit_codes.FINAL_SAVE_FAILED}:  # every failed worker trained to the end; the final commit is missing
        return exit_codes.FINAL_SAVE_FAILED
    return reported or exit_codes.FAILED


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
