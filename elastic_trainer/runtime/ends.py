"""What each ending of a run decides, with its events: the resume's report, fencing (73),
preemption (75/76), the non-finite policy (a rollback, a replay, or 65) and the final commit (0, 73, 74).

Every decision here is agreed by all ranks (each rests on the step's all-reduce or on the
manager's agreements), so every rank enters the same collectives and returns the same code.
:class:`~.run.Run` calls these; nothing else does.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .. import exit_codes
from ..checkpoint import layout
from ..checkpoint.manager import CheckpointManager, LoadResult
from ..checkpoint.state import TrainState
from ..checkpoint.timeline import Timeline
from . import anomaly
from .session import Session

logger = logging.getLogger(__name__)


def resumed(
    s: Session, loaded: LoadResult, state: TrainState, rng: str, fields: dict[str, Any], timeline: Timeline
) -> None:
    """The ``resume`` event (and ``reshard`` when the world size changed) of a load."""
    saved_world = loaded.manifest.get("world_size")
    suspect = sorted({step for step, reason in loaded.skipped if layout.is_suspect_reason(reason)})
    if suspect:
        s.metrics.counter("elastic_trainer_checkpoint_suspect_skipped_total", len(suspect))
    s.events.emit(
        "resume",
        step=loaded.step,
        from_world_size=saved_world,
        world_size=s.world_size,
        load_seconds=round(loaded.seconds, 4),
        since_start_seconds=round(time.monotonic() - s.started, 4),
        cursor=state.cursor,
        skipped=[list(x) for x in loaded.skipped],
        suspect=suspect,
        rng=rng,
        tier=loaded.tier,
        **({"tiers": loaded.tiers} if loaded.tiers else {}),
        **fields,
        **timeline.as_fields(),
    )
    logger.debug("rank %d resume timeline: %s", s.rank, timeline.describe())
    if saved_world != s.world_size:
        s.events.emit(
            "reshard",
            step=loaded.step,
            from_world_size=saved_world,
            to_world_size=s.world_size,
            from_mesh=loaded.manifest.get("mesh_shape"),
            to_mesh=list(s.mesh.shape),
            rng=rng,
        )
        s.metrics.counter("elastic_trainer_reshard_events_total")
    if s.rank == 0:
        logger.info(
            "resumed from step %d (saved at world %s, now %d) in %.2fs",
            loaded.step,
            saved_world,
            s.world_size,
            loaded.seconds,
        )


def fenced(s: Session, m: CheckpointManager, step: int) -> int:
    """A newer launch owns the checkpoint root: stop, exit 73."""
    reason = m.fenced or "a newer launch owns the checkpoint root"
    s.events.emit("fenced", step=step, error=reason)
    logger.error("stopping: %s", reason)
    return exit_codes.FENCED


def _settle(s: Session, m: CheckpointManager) -> bool:
    """Collective: :meth:`CheckpointManager.settle` bounded by ``checkpoint.save_timeout_seconds``
    from now; True when no save is in flight any more on any rank."""
    return m.settle(time.monotonic() + s.cfg.checkpoint.save_timeout_seconds)


def preempted(s: Session, m: CheckpointManager, state: TrainState) -> int:
    """Preemption: commit the final step within ``checkpoint.preempt_grace_seconds``. 75 only
    when a commit of the final step exists in storage (already, or written now), else 76."""
    done = state.step
    grace = s.cfg.checkpoint.preempt_grace_seconds
    started = s.preempt.received_at or time.monotonic()
    deadline = started + grace
    s.events.emit("preempt_requested", step=done, signal=s.preempt.signal_name, grace_seconds=grace)
    logger.warning("preemption (%s): saving step %d within %.0fs", s.preempt.signal_name, done, grace)
    committed = False
    if m.settle(deadline):
        committed = m.verdicts.committed_everywhere(done)
        if not committed and done > 0:
            m.save(done, force=True, meta={"skipped_ranges": state.skipped})
            committed = m.settle(deadline) and m.verdicts.committed_everywhere(done)
    if not committed:
        reason = "grace budget exceeded" if time.monotonic() >= deadline else "final checkpoint not committed"
        s.events.emit("preempted", step=done, committed=False, reason=reason)
        code = exit_codes.PREEMPTED_UNCOMMITTED
        logger.error("preemption checkpoint of step %d not committed (%s); exiting %d", done, reason, code)
        return code
    s.events.emit("preempted", step=done, committed=True, seconds=round(time.monotonic() - started, 3))
    return exit_codes.PREEMPTED


def anomalous(s: Session, ctx: Any, sample_range: list[int]) -> None:
    """A step the guard refused (``ctx.anomaly``: a non-finite loss or gradient norm, or a loss
    spike; the optimizer step was not taken): its event, metric and log line, before the policy acts."""
    mode = s.cfg.train.on_nonfinite
    if ctx.anomaly == anomaly.LOSS_SPIKE:
        s.events.emit(
            "loss_spike",
            step=ctx.step,
            loss=ctx.loss,
            threshold=ctx.spike_threshold,
            sample_range=sample_range,
            action=mode,
        )
        s.metrics.counter("elastic_trainer_train_loss_spike_events_total")
        logger.error(
            "loss spike %s (above %s) at step %d (samples %s)", ctx.loss, ctx.spike_threshold, ctx.step, sample_range
        )
        return
    s.events.emit(
        "nonfinite", step=ctx.step, loss=ctx.loss, grad_norm=ctx.grad_norm, sample_range=sample_range, action=mode
    )
    s.metrics.counter("elastic_trainer_train_nonfinite_events_total")
    logger.error(
        "non-finite loss %s / grad norm %s at step %d (samples %s)", ctx.loss, ctx.grad_norm, ctx.step, sample_range
    )


def reload(s: Session, m: CheckpointManager) -> LoadResult | None:
    """Reload the newest commit of this lineage (a save still writing past its deadline is
    abandoned, never committed); None: there is none."""
    _settle(s, m)
    return m.load(resume="latest")


def rolled_back(
    s: Session, m: CheckpointManager, state: TrainState, ctx: Any, sample_range: list[int], sampler: Any
) -> bool:
    """``train.on_nonfinite = rollback`` (the optimizer step was not taken), or a replay that
    reproduced the anomaly: :func:`reload` and skip the global sample range that produced the
    event (kept in the data position, so later resumes skip it too). False: there is no commit
    to go back to."""
    loaded = reload(s, m)
    if loaded is None:
        return False
    if sampler is not None:
        sampler.skip(sample_range)
    else:
        state.skipped.append(sample_range)
    s.events.emit(
        "rollback", from_step=ctx.step, to_step=loaded.step, skipped_range=sample_range, skipped_ranges=state.skipped
    )
    logger.warning("rolled back to step %d; skipping samples %s", loaded.step, sample_range)
    return True


def replaying(s: Session, ctx: Any, from_step: int) -> None:
    """``train.on_nonfinite = replay``: the run reloaded the commit of ``from_step`` to replay up to ``ctx``'s step."""
    s.events.emit("anomaly_replay", step=ctx.step, reason=ctx.anomaly, from_step=from_step)
    logger.warning(
        "replaying steps %d-%d from the commit of step %d (%s)", from_step + 1, ctx.step, from_step, ctx.anomaly
    )


def replayed(
    s: Session, outcome: anomaly.Outcome, loss: float | None, replayed_loss: float | None, per_node: int
) -> None:
    """The end of a replay: ``anomaly_reproduced`` (the data: the caller skips its samples), or
    ``silent_corruption`` naming the ranks whose state differed, their nodes and first tensor."""
    o = outcome
    if o.reproduced:
        s.events.emit("anomaly_reproduced", step=o.step, from_step=o.from_step, loss=replayed_loss)
        logger.warning("the replay reproduced the anomaly of step %d: skipping its samples", o.step)
        return
    rank = o.ranks[0] if o.ranks else None
    node = rank // per_node if rank is not None else None
    s.events.emit(
        "silent_corruption",
        step=o.step,
        from_step=o.from_step,
        loss=loss,
        replayed_loss=replayed_loss,
        ranks=o.ranks,
        rank=rank,
        node=node,
        tensor=o.tensor,
    )
    s.metrics.counter("elastic_trainer_silent_corruption_events_total")
    where = f"rank {rank} (node {node}), first tensor {o.tensor}" if rank is not None else "no rank's state differed"
    logger.error(
        "silent data corruption at step %d: the replay from step %d did not reproduce it (loss %s, replayed %s): %s",
        o.step,
        o.from_step,
        loss,
        replayed_loss,
        where,
    )


def excluded(s: Session, m: CheckpointManager, step: int, node: int, nodes: int, mine: int) -> int:
    """``elastic.exclude_corrupt_node`` after a replay that did not reproduce its anomaly: the
    replayed ``step`` was saved (its state is the replay's, computed again); wait (bounded by
    ``checkpoint.save_timeout_seconds``) for its commit, record ``node_excluded`` and end this
    round. The ranks of ``node`` (this rank's node: ``mine``) exit 69, their supervisor leaves the
    job; the others exit 79, their supervisors re-form the group of ``nodes - 1`` nodes without it."""
    committed = _settle(s, m) and m.verdicts.committed_everywhere(step)
    s.events.emit("node_excluded", step=step, node=node, nodes=nodes, committed=committed)
    logger.error(
        "node %d leaves the job (elastic.exclude_corrupt_node); the %d other node(s) go on from %s",
        node,
        nodes - 1,
        f"step {step}" if committed else "the newest commit (the replayed step did not commit)",
    )
    return exit_codes.EXCLUDED if mine == node else exit_codes.REGROUP


def nonfinite_stop(
    s: Session, m: CheckpointManager, state: TrainState, ctx: Any, sample_range: list[int], why: str
) -> int:
    """Stop after a non-finite step: exit 65 (nothing after the last finite step is committed)."""
    _settle(s, m)
    s.events.emit("nonfinite_stop", step=ctx.step, reason=why, last_finite_step=state.step)
    logger.error("stopping at step %d (%s); last finite step %d", ctx.step, why, state.step)
    return exit_codes.NONFINITE


def finished(s: Session, m: CheckpointManager, step: int, final: int | None) -> tuple[int, bool]:
    """Wait (bounded) for the last save and its commit: (exit code, restartable). 0; 73 when a
    newer launch fenced the final commit; 74 when ``final``, the final save's step, did not
    commit (restartable False when its cause is one a restart cannot change)."""
    settled = _settle(s, m)
    if m.verdicts.fenced_everywhere():  # the final commit was refused: a newer launch owns the root
        return fenced(s, m, step), True
    if final is None or (settled and m.verdicts.committed_everywhere(final)):
        return exit_codes.OK, True
    reason = "the save or its commit failed" if settled else "still writing after checkpoint.save_timeout_seconds"
    cause = m.verdicts.failed_permanently() if settled else None
    if cause is not None:
        reason = f"the save failed for a cause a restart cannot change: {cause}"
    code = exit_codes.FINAL_SAVE_FAILED
    logger.error("final checkpoint of step %d not committed (%s); exiting %d", final, reason, code)
    s.events.emit(
        "final_checkpoint_failed",
        step=final,
        reason=reason,
        last_committed_step=m.last_committed_step,
        restartable=cause is None,
    )
    return code, cause is None
