"""Every metric elastic_trainer exports: name, type, help, labels, who records it, and how the
supervisor aggregates it across processes. Pure data; no prometheus_client here.

Who records a metric (``scope``):

* ``"global"`` — a job-wide value (loss, tokens, checkpoint commits). Recorded by global rank 0
  only; the same call on other ranks is dropped, so counters are not multiplied by the world
  size. Exported by the node hosting rank 0.
* ``"rank"`` — a per-process value (memory). Recorded by every rank with a ``rank`` label.
* ``"supervisor"`` — recorded by the node's supervisor, which outlives worker restarts
  (restarts, rendezvous rounds, recovery, hang detections).

How the supervisor aggregates (prometheus_client multiprocess mode; one file per process):
counters and histograms are summed over every process that ever wrote them, including exited
workers, so they keep growing across restarts. Gauges say which value wins: ``livemostrecent``
(the most recent value of a live process; gone while the workers are down) for values that
describe the running job, ``mostrecent`` (also from exited processes) for facts that stay true
after a worker dies, such as the last committed checkpoint.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

COUNTER = "counter"
GAUGE = "gauge"
HISTOGRAM = "histogram"

SCOPES = ("global", "rank", "supervisor")
GAUGE_MODES = ("livemostrecent", "mostrecent", "livemax", "max", "livesum", "sum", "liveall", "all", "livemin", "min")
LABELS = ("rank", "category", "version", "torch_version")
# Every series also carries ``run`` (= ``run.name``), added by the exporter, so that concurrent runs
# scraped by one Prometheus (one namespace, one job name) never merge.
RUN_LABEL = "run"

# Bucket layouts (seconds).
_FAST = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_STALL = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_SLOW = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
_RECOVERY = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


@dataclass(frozen=True)
class Metric:
    name: str
    type: str
    help: str
    scope: str
    labels: tuple[str, ...] = ()
    mode: str | None = None  # gauges: prometheus_client multiprocess_mode
    buckets: tuple[float, ...] | None = None  # histograms

    def sample_names(self) -> tuple[str, ...]:
        """Names of the samples this metric puts in the exposition."""
        if self.type == HISTOGRAM:
            return (f"{self.name}_bucket", f"{self.name}_count", f"{self.name}_sum")
        return (self.name,)


def _g(name, help, scope="global", mode="livemostrecent", labels=()):
    return Metric(name, GAUGE, help, scope, tuple(labels), mode=mode)


def _c(name, help, scope="global", labels=()):
    return Metric(name, COUNTER, help, scope, tuple(labels))


def _h(name, help, buckets, scope="global"):
    return Metric(name, HISTOGRAM, help, scope, buckets=buckets)


CATALOG: tuple[Metric, ...] = (
    # training
    _g("elastic_trainer_train_step", "Last completed optimizer step."),
    _g("elastic_trainer_train_loss", "Training loss of the last step (mean over the global batch)."),
    _g("elastic_trainer_train_learning_rate", "Learning rate used by the last step."),
    _g("elastic_trainer_train_grad_norm", "Global gradient norm of the last step, before clipping."),
    _c(
        "elastic_trainer_train_nonfinite_events_total",
        "Steps whose loss or global gradient norm was non-finite (the optimizer step was not taken).",
    ),
    _c(
        "elastic_trainer_train_loss_spike_events_total",
        "Steps whose loss spiked above train.loss_spike_factor times the recent median (the optimizer step "
        "was not taken).",
    ),
    _c(
        "elastic_trainer_silent_corruption_events_total",
        "Anomalous steps a replay did not reproduce (train.on_nonfinite = replay): silent data corruption.",
    ),
    _g("elastic_trainer_train_tokens_per_second", "Tokens per second of the last step (whole job)."),
    _h("elastic_trainer_train_step_duration_seconds", "Wall time of one training step.", _FAST),
    _c(
        "elastic_trainer_train_samples_total", "Samples (sequences) trained on, including steps redone after a restart."
    ),
    _c("elastic_trainer_train_tokens_total", "Target tokens trained on, including steps redone after a restart."),
    # checkpoint
    _h(
        "elastic_trainer_checkpoint_stall_seconds",
        "Time a checkpoint save blocked training (waiting for the previous save, the save call and staging).",
        _STALL,
    ),
    _h(
        "elastic_trainer_checkpoint_wait_previous_seconds",
        "Time a save waited for the previous save to finish.",
        _STALL,
    ),
    _h(
        "elastic_trainer_checkpoint_save_duration_seconds",
        "Time from starting an (asynchronous) save to its commit.",
        _SLOW,
    ),
    _h(
        "elastic_trainer_checkpoint_resume_load_seconds",
        "Time to load the checkpoint a worker group resumed from.",
        _SLOW,
    ),
    _c("elastic_trainer_checkpoint_written_bytes_total", "Bytes of committed checkpoints."),
    _c("elastic_trainer_checkpoint_save_failures_total", "Checkpoint saves that failed and were not committed."),
    _g("elastic_trainer_checkpoint_last_committed_step", "Step of the last committed checkpoint.", mode="mostrecent"),
    _g(
        "elastic_trainer_checkpoint_last_commit_timestamp_seconds",
        "Unix time of the last checkpoint commit.",
        mode="mostrecent",
    ),
    _g("elastic_trainer_checkpoint_saves_in_flight", "Checkpoint saves started and not yet finished (0 or 1)."),
    _c(
        "elastic_trainer_checkpoint_local_saves_total",
        "Local-tier copies (checkpoint.local_dir) a rank wrote and committed.",
        scope="rank",
        labels=("rank",),
    ),
    _c(
        "elastic_trainer_checkpoint_local_save_failures_total",
        "Local-tier copies that failed on a rank (checkpoint.dir is unaffected).",
        scope="rank",
        labels=("rank",),
    ),
    _c(
        "elastic_trainer_checkpoint_local_resumes_total",
        "Resumes that loaded every rank's local-tier copy instead of checkpoint.dir.",
    ),
    _c(
        "elastic_trainer_checkpoint_peer_sent_bytes_total",
        "Bytes of local-tier copies a rank sent to other nodes' holders (checkpoint.peer_replicas).",
        scope="rank",
        labels=("rank",),
    ),
    _c(
        "elastic_trainer_checkpoint_peer_send_seconds_total",
        "Seconds a rank's background sender spent sending copies to other nodes' holders.",
        scope="rank",
        labels=("rank",),
    ),
    _c(
        "elastic_trainer_checkpoint_peer_send_failures_total",
        "Copies a rank failed to send to a holder (that replica is missing until the next save).",
        scope="rank",
        labels=("rank",),
    ),
    _c(
        "elastic_trainer_checkpoint_peer_resumes_total",
        "Resumes that loaded the nodes' copies (the peer tier) instead of checkpoint.dir.",
    ),
    # elasticity
    _g("elastic_trainer_world_size", "Number of worker processes in the current worker group."),
    _g(
        "elastic_trainer_world_size_expected",
        "Number of worker processes the job is configured for at full size (max nodes x processes per node); "
        "above elastic_trainer_world_size while the job runs degraded.",
        scope="supervisor",
    ),
    _c("elastic_trainer_reshard_events_total", "Resumes from a checkpoint saved at a different world size."),
    _c(
        "elastic_trainer_checkpoint_suspect_skipped_total",
        "Commits a resume passed over because ckpt audit found them suspect (silent data corruption) or they "
        "descend from one.",
    ),
    _c(
        "elastic_trainer_restarts_total",
        "Worker-group restarts by this node's supervisor (failures and membership changes).",
        scope="supervisor",
    ),
    _c(
        "elastic_trainer_rendezvous_rounds_total",
        "Completed rendezvous rounds on this node (the first one included).",
        scope="supervisor",
    ),
    _h(
        "elastic_trainer_recovery_seconds",
        "Time from detecting a failure or membership change to the new worker group being started "
        "(stop, backoff, rendezvous, spawn); checkpoint loading is elastic_trainer_checkpoint_resume_load_seconds.",
        _RECOVERY,
        scope="supervisor",
    ),
    _c(
        "elastic_trainer_hang_detections_total",
        "Workers killed by the hang watchdog (elastic.hang_timeout_seconds).",
        scope="supervisor",
    ),
    # goodput (the supervisor's live ledger of events.jsonl; same accounting as `elastic-trainer report`)
    _g(
        "elastic_trainer_wall_seconds",
        "Wall time of the run so far (its whole event log, across restarts and relaunches), split by category: "
        "productive, recompute, restart, rendezvous, startup, "
        "checkpoint_load, checkpoint_stall, preemption_save, idle.",
        scope="supervisor",
        labels=("category",),
    ),
    _g(
        "elastic_trainer_goodput_ratio",
        "Productive step time / wall time over the whole run so far.",
        scope="supervisor",
    ),
    _g(
        "elastic_trainer_goodput_recent_ratio",
        "Productive step time / wall time over the last 10 minutes.",
        scope="supervisor",
    ),
    # stragglers
    _c(
        "elastic_trainer_rank_compute_seconds_total",
        "Step time a rank spent outside the step's explicit all-reduces (data, forward, backward, optimizer; "
        "FSDP's own collectives included). A straggler's grows faster than the others'.",
        scope="rank",
        labels=("rank",),
    ),
    _c(
        "elastic_trainer_rank_collective_wait_seconds_total",
        "Step time a rank spent in the step's explicit all-reduces, mostly waiting for the slowest rank.",
        scope="rank",
        labels=("rank",),
    ),
    _c(
        "elastic_trainer_rank_steps_total",
        "Training steps run by a rank (divides the two above into per-step times).",
        scope="rank",
        labels=("rank",),
    ),
    # build and configuration
    _g(
        "elastic_trainer_build_info",
        "Always 1; labels name the elastic_trainer and torch versions.",
        scope="supervisor",
        labels=("version", "torch_version"),
    ),
    _g(
        "elastic_trainer_checkpoint_interval_steps",
        'Checkpoint interval in steps in force (fixed, or chosen by checkpoint.interval_steps = "auto").',
    ),
    # process
    _g(
        "elastic_trainer_process_resident_memory_bytes",
        "Resident memory of a worker process.",
        scope="rank",
        labels=("rank",),
    ),
    _g(
        "elastic_trainer_process_cuda_memory_allocated_bytes",
        "CUDA memory allocated by tensors of a worker process.",
        scope="rank",
        labels=("rank",),
    ),
    _g(
        "elastic_trainer_process_cuda_memory_reserved_bytes",
        "CUDA memory reserved by the caching allocator of a worker process.",
        scope="rank",
        labels=("rank",),
    ),
)

METRICS: dict[str, Metric] = {m.name: m for m in CATALOG}

_NAME = re.compile(r"^elastic_trainer_[a-z][a-z0-9_]*[a-z0-9]$")


def problems(metrics: tuple[Metric, ...] = CATALOG) -> list[str]:
    """Convention violations in a catalogue (empty when it is sound). Pure; used by the tests."""
    out = []
    seen = set()
    for m in metrics:
        if m.name in seen:
            out.append(f"{m.name}: defined twice")
        seen.add(m.name)
        if not _NAME.match(m.name):
            out.append(f"{m.name}: not snake_case with the elastic_trainer_ prefix")
        if m.type not in (COUNTER, GAUGE, HISTOGRAM):
            out.append(f"{m.name}: unknown type {m.type!r}")
        if (m.type == COUNTER) != m.name.endswith("_total"):
            out.append(f"{m.name}: counters, and only counters, end in _total")
        if m.type == HISTOGRAM and not m.name.endswith(("_seconds", "_bytes")):
            out.append(f"{m.name}: a histogram's name ends in its unit")
        if m.scope not in SCOPES:
            out.append(f"{m.name}: unknown scope {m.scope!r}")
        if not m.help.strip():
            out.append(f"{m.name}: empty help")
        if any(lbl not in LABELS for lbl in m.labels):
            out.append(f"{m.name}: labels {m.labels} outside the allowed {LABELS}")
        if (m.scope == "rank") != ("rank" in m.labels):
            out.append(f"{m.name}: per-rank metrics, and only they, carry a rank label")
        if m.type == GAUGE and m.mode not in GAUGE_MODES:
            out.append(f"{m.name}: gauge needs a multiprocess mode, got {m.mode!r}")
        if m.type != GAUGE and m.mode is not None:
            out.append(f"{m.name}: only gauges have a multiprocess mode")
        if (m.type == HISTOGRAM) != (m.buckets is not None):
            out.append(f"{m.name}: histograms, and only histograms, have buckets")
        if m.buckets is not None and list(m.buckets) != sorted(set(m.buckets)):
            out.append(f"{m.name}: buckets must be strictly increasing")
        for bad in ("_ms", "_millis", "_kb", "_mb", "_gb", "_percent"):
            if bad + "_" in m.name + "_":
                out.append(f"{m.name}: use base units (seconds, bytes, ratios), not {bad}")
    return out


def exported_sample_names(metrics: tuple[Metric, ...] = CATALOG) -> set[str]:
    return {s for m in metrics for s in m.sample_names()}
