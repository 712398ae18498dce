"""The supervisor–worker contract: every name the two sides (and the tools reading a run) share.

* the environment variables the supervisor, torch's elastic agent and the workers pass each
  other (:data:`ENV_VARS`);
* the files they hand over in ``run.dir`` (:data:`EVENTS_FILE`, :data:`PREEMPT_MARKER`, ...);
* the warm-start zygote's protocol (``supervisor/warm.py`` ↔ ``worker/zygote.py``);
* the event log's catalogue (:data:`EVENTS`): every event name written to ``events.jsonl``,
  its fields (required or optional) and its meaning. docs/operations.md's event table is
  generated from it (:func:`events_table`).

These names are read by programs outside this package (alert rules, log pipelines, a user's
dashboards, SLURM scripts): they are never renamed; new events and fields may be added.
Pure data and pure functions; imports nothing of the package.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# ---------------------------------------------------------------------------------------------
# Environment variables


@dataclass(frozen=True)
class EnvVar:
    name: str
    set_by: str
    read_by: str
    meaning: str


CONFIG_ENV = "ELASTIC_TRAINER_CONFIG_JSON"
CONFIG_SET_ENV = "ELASTIC_TRAINER_CONFIG_SET"
CONFIG_FILE_ENV = "ELASTIC_TRAINER_CONFIG"  # a config file for any launcher: what `run --config FILE` takes
OVERRIDES_ENV = "ELASTIC_TRAINER_SET"  # `--set` overrides for any launcher, one per line or separated by ';'
SUPERVISOR_PID_ENV = "ELASTIC_TRAINER_SUPERVISOR_PID"
PARENT_PID_ENV = "ELASTIC_TRAINER_PARENT_PID"
CHECKPOINT_EPOCH_ENV = "ELASTIC_TRAINER_CHECKPOINT_EPOCH"
CHECKPOINT_ROOT_ENV = "ELASTIC_TRAINER_CHECKPOINT_ROOT"
CHECKPOINT_KEY_ENV = "ELASTIC_TRAINER_CHECKPOINT_KEY"
METRICS_TOKEN_ENV = "ELASTIC_TRAINER_METRICS_TOKEN"  # the bearer token of every node's metrics endpoint
NODE_ENV = "ELASTIC_TRAINER_NODE"
# elastic.rdzv_backend / --rdzv-backend: the package's own rendezvous (a store key per node)
OWN_RDZV_BACKEND = "elastic-trainer"
PEER_HOLDER_ENV = "ELASTIC_TRAINER_PEER_HOLDER"
LOG_LEVEL_ENV = "ELASTIC_TRAINER_LOG_LEVEL"
INJECT_FAULT_ENV = "ELASTIC_TRAINER_INJECT_FAULT"
REPLAY_TO_STEP_ENV = "ELASTIC_TRAINER_REPLAY_TO_STEP"  # `ckpt audit`'s replay: the step it stops at
# what the supervisor runs, recorded for `ckpt audit` (JSON: "entry" "launch", or "run" with "argv",
# the script or -m module and its arguments, and "cwd"); unset: another launcher started the script
SCRIPT_COMMAND_ENV = "ELASTIC_TRAINER_SCRIPT_COMMAND"
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
# torch's elastic agent
SIGNALS_TO_HANDLE_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
ENABLE_FILE_TIMER_ENV = "TORCHELASTIC_ENABLE_FILE_TIMER"
TIMER_FILE_ENV = "TORCHELASTIC_TIMER_FILE"
SHARE_RDZV_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
USE_AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
RANK_ENV = "RANK"
LOCAL_RANK_ENV = "LOCAL_RANK"
WORLD_SIZE_ENV = "WORLD_SIZE"
LOCAL_WORLD_SIZE_ENV = "LOCAL_WORLD_SIZE"
GROUP_RANK_ENV = "GROUP_RANK"
MASTER_ADDR_ENV = "MASTER_ADDR"
MASTER_PORT_ENV = "MASTER_PORT"
OMP_THREADS_ENV = "OMP_NUM_THREADS"
TORCHRUN_ENV_PREFIX = "PET_"  # torchrun reads option --foo-bar from PET_FOO_BAR

_SUP, _AGENT = "supervisor", "torch's agent"
ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar(CONFIG_ENV, _SUP, "workers", "The resolved configuration as JSON."),
    EnvVar(
        CONFIG_SET_ENV,
        _SUP,
        "workers",
        "The keys its command line set (`--config`, `--set`), as a JSON list: they win over a script's own.",
    ),
    EnvVar(
        CONFIG_FILE_ENV,
        "user",
        "`run`, `et.init`",
        "A TOML config file, as `run --config` takes (a `--config` flag wins); read by `et.init` under any launcher "
        "when no supervisor passed its config. Its keys count as the command line's.",
    ),
    EnvVar(
        OVERRIDES_ENV,
        "user",
        "`run`, `et.init`",
        "`section.key=value` overrides, one per line or separated by `;`, applied over that file (a `--set` "
        "flag wins); keys as the command line's.",
    ),
    EnvVar(SUPERVISOR_PID_ENV, _SUP, "workers, zygote", "The supervisor's PID: a child with another parent exits."),
    EnvVar(PARENT_PID_ENV, "zygote", "workers it forks", "The zygote's PID: the parent a warm-started worker checks."),
    EnvVar(CHECKPOINT_EPOCH_ENV, _SUP, "rank 0", "This launch's fencing epoch on the checkpoint root."),
    EnvVar(CHECKPOINT_ROOT_ENV, _SUP, "rank 0", "The checkpoint.dir of that epoch (a script elsewhere takes its own)."),
    EnvVar(CHECKPOINT_KEY_ENV, "user", "supervisor, workers, ckpt", "Key of the manifests' HMAC (never logged)."),
    EnvVar(
        METRICS_TOKEN_ENV,
        "user",
        "supervisor",
        "Bearer token every request to a node's metrics endpoint must carry (never logged); "
        "unset: a random one, in metrics.token in the supervisor's runtime directory.",
    ),
    EnvVar(PEER_HOLDER_ENV, _SUP, "workers", "host:port of this node's peer holder (checkpoint.peer_replicas)."),
    EnvVar(NODE_ENV, "user", "supervisor, logs", "This node's name in events and logs (default: the host name)."),
    EnvVar(LOG_LEVEL_ENV, "user", "every process", "Log level of the elastic_trainer logger (default INFO)."),
    EnvVar(INJECT_FAULT_ENV, "tests", "workers", "Fault injection for the test suites (faults.py)."),
    EnvVar(
        REPLAY_TO_STEP_ENV,
        "`ckpt audit`",
        "workers",
        "The step a replay stops at (with its final commit), on the run's own schedule; a script's process ends there.",
    ),
    EnvVar(
        SCRIPT_COMMAND_ENV,
        "supervisor",
        "workers",
        "What the supervisor runs — the built-in trainer, or a script (or `-m` module) with its arguments and "
        "working directory — recorded in every manifest for `ckpt audit`'s replay.",
    ),
    EnvVar(METRICS_DIR_ENV, _SUP, "workers", "prometheus_client's multiprocess directory the supervisor exports."),
    EnvVar(SIGNALS_TO_HANDLE_ENV, _SUP, "torch's agent", "Signals the agent forwards (FORWARDED_SIGNALS)."),
    EnvVar(ENABLE_FILE_TIMER_ENV, _SUP, "torch's agent", "Turns on the file-based hang watchdog."),
    EnvVar(TIMER_FILE_ENV, _SUP, "torch's agent, workers", "The hang watchdog's pipe (TIMER_FILE in RUNTIME_DIR)."),
    EnvVar(SHARE_RDZV_STORE_ENV, _SUP, "torch's agent", "1: no reuse of the rendezvous store (stale addresses)."),
    EnvVar(RUN_ID_ENV, _AGENT, "workers", "The rendezvous id: the launch id fencing records."),
    EnvVar(RESTART_COUNT_ENV, _AGENT, "workers", "How many times the agent restarted the worker group."),
    EnvVar(USE_AGENT_STORE_ENV, _AGENT, "workers", "Whether the workers may use the agent's TCP store."),
    EnvVar(RANK_ENV, _AGENT, "workers", "Global rank."),
    EnvVar(LOCAL_RANK_ENV, _AGENT, "workers, zygote", "Rank on this node."),
    EnvVar(WORLD_SIZE_ENV, _AGENT, "workers", "Number of workers in the group."),
    EnvVar(LOCAL_WORLD_SIZE_ENV, _AGENT, "workers", "Workers on this node (the Lightning strategy's devices)."),
    EnvVar(GROUP_RANK_ENV, _AGENT, "log lines, peer tier", "This node's rank in the group."),
    EnvVar(MASTER_ADDR_ENV, _AGENT, "workers", "Host of the group's store."),
    EnvVar(MASTER_PORT_ENV, _AGENT, "workers", "Port of the group's store."),
    EnvVar(OMP_THREADS_ENV, "agent or user", "workers, zygote", "Threads per worker (the zygote applies it at fork)."),
)

# Signals the supervisor forwards to the workers (which then checkpoint); the zygote ignores
# them, so a scheduler signalling every process of the job does not kill it mid-checkpoint.
FORWARDED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")

# ---------------------------------------------------------------------------------------------
# Files shared in run.dir (and the checkpoint root)

EVENTS_FILE = "events.jsonl"  # run.dir: the event log (rank 0 and the supervisor append)
# run.dir: each node's local rank 0 writes it when it exits non-zero; its supervisor reads and removes it
PREEMPT_MARKER = "PREEMPTED"
PREEMPT_MARKER_FIELDS = ("step", "exit_code", "committed_step", "restartable")  # its JSON object
RESOLVED_CONFIG_FILE = "config.json"  # run.dir: the resolved config of the last start (rank 0)
RUNTIME_DIR = ".runtime"  # run.dir/.runtime/<host>-<supervisor pid>/: the supervisor's per-launch files
TIMER_FILE = "watchdog.timer"  # in the runtime directory: the hang watchdog's pipe (TIMER_FILE_ENV)
METRICS_TOKEN_FILE = "metrics.token"  # in the runtime directory: the metrics token made when METRICS_TOKEN_ENV is unset
EVENTS_MIRROR_DIR = "_events"  # checkpoint root: each supervisor's mirrored event log segments


def runtime_dir(run_dir: str, host: str, pid: int) -> str:
    """The per-launch directory in ``run_dir`` of the supervisor ``pid`` on ``host``: named by
    both, as nodes that share run.dir have their own pid spaces."""
    return os.path.join(run_dir, RUNTIME_DIR, f"{host}-{pid}")


# ---------------------------------------------------------------------------------------------
# The warm-start zygote's protocol (supervisor/warm.py ↔ worker/zygote.py): one JSON object per
# SOCK_SEQPACKET packet on a socketpair whose zygote end is the FD argument of
# ``python -m ZYGOTE_MODULE FD [PRELOAD ...]``.

ZYGOTE_MODULE = "elastic_trainer.worker.zygote"
ZYGOTE_NAME = "et-zygote"  # its process name (/proc/PID/comm), also when forked from the supervisor
ZYGOTE_MAX_MESSAGE = 4 << 20  # bytes of one packet
ZYGOTE_PRELOAD_TRAINER = "@trainer"  # PRELOAD argument: launch's trainer modules
ZYGOTE_PRELOAD_SCRIPT = "@script"  # PRELOAD argument: elastic_trainer's public API for a user's script
ZYGOTE_STREAMS = {"stdout": 1, "stderr": 2}  # names in a start request's "fds" -> the worker's descriptor
# Message kind -> its keys; the first key tells the kinds apart.
ZYGOTE_MESSAGES: dict[str, tuple[str, ...]] = {
    "ready": ("ready", "threads", "preload_seconds", "missing", "cuda", "process_group"),  # zygote -> supervisor, once
    "start": ("id", "argv", "env", "cwd", "fds"),  # supervisor -> zygote, descriptors attached (SCM_RIGHTS)
    "started": ("id", "pid"),  # zygote -> supervisor
    "refused": ("id", "error"),  # zygote -> supervisor
    "exit": ("exit", "code"),  # zygote -> supervisor, per child (Popen.returncode convention)
}

# ---------------------------------------------------------------------------------------------
# The event log: name, writer, fields, meaning

RECORD_FIELDS = ("event", "time")  # every record; added by EventLog.emit


@dataclass(frozen=True)
class Field:
    name: str
    note: str = ""  # shown next to the name in docs/operations.md
    required: bool = True


@dataclass(frozen=True)
class Event:
    name: str
    writer: str
    meaning: str
    fields: tuple[Field, ...]
    extensible: bool = False  # the caller may add fields of its own (a script's)

    @property
    def required(self) -> frozenset[str]:
        return frozenset(f.name for f in self.fields if f.required)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.fields)


WRITERS = (
    "supervisor",
    "rank 0",
    "supervisor / rank 0",
    "the failing rank",
    "`ckpt release`",
    "`ckpt audit`",
    "`deploy/slurm` script",
)


def _e(name: str, writer: str, meaning: str, fields: str, /, extensible: bool = False, **notes: str) -> Event:
    """``fields``: names separated by spaces, ``name?`` for an optional one; ``notes``: what a field holds, by name."""
    specs = fields.split()
    unknown = set(notes) - {f.rstrip("?") for f in specs}
    assert not unknown, f"{name}: notes for fields it does not have: {unknown}"
    return Event(
        name,
        writer,
        meaning,
        tuple(Field(f.rstrip("?"), notes.get(f.rstrip("?"), ""), not f.endswith("?")) for f in specs),
        extensible,
    )


_SUPERVISOR, _RANK0 = "supervisor", "rank 0"
_RESEEDED = "reseeded from (train.seed, rank, step)"

EVENTS: tuple[Event, ...] = (
    # supervisor lifecycle
    _e(
        "launch",
        _SUPERVISOR,
        "A supervisor started (one per `launch`/`run` per node).",
        "nnodes nproc_per_node max_restarts rdzv_endpoint rdzv_backend entrypoint node pid mono",
    ),
    _e(
        "rendezvous",
        _SUPERVISOR,
        "A rendezvous round completed on this node.",
        "node pid group_rank nodes world_size seconds mono",
        group_rank="this node's rank",
        seconds="the rendezvous round",
    ),
    _e(
        "workers_started",
        _SUPERVISOR,
        "The agent started this node's worker group.",
        "warm pids zygote_pid zygote_forked zygote_threads seconds node mono",
        warm="forked from the zygote, `elastic.warm_start`",
        zygote_forked="the zygote was forked from the supervisor (else started as its own interpreter)",
        seconds="the agent starting the group",
    ),
    _e(
        "warm_start_unavailable",
        _SUPERVISOR,
        "Workers were started cold (see docs/elasticity.md).",
        "reason zygote_restarted",
    ),
    _e(
        "restart",
        _SUPERVISOR,
        "The worker group is restarted.",
        "reason restart_count remaining_restarts node mono failures backoff_seconds progressed",
        reason="`worker_failure`, `membership_change`",
        failures="local/global rank, exit code, signal, error from torch's `@record` error file",
        progressed="a failure restart that would be backed off: whether a newer checkpoint was committed since "
        "the previous failure, which resets the back-off; `null` when not read",
    ),
    _e(
        "node_lost",
        _SUPERVISOR,
        "A silent peer or this node cut off; a `restart{reason: membership_change}` follows "
        '(docs/elasticity.md, "Silent nodes").',
        "reason lost no_contact_seconds? killed? node mono",
        reason="`peer_lost`: a peer of this node's round stopped heartbeating for longer than the liveness bound; "
        "`isolated`: this node was dropped from the round, or has not reached the rendezvous store for longer "
        "than the bound",
        lost="the dropped peers' rendezvous ids, `<address>_<pid>_<n>`",
        no_contact_seconds="when the store was out of reach",
        killed="worker PIDs SIGKILLed, when the store was out of reach",
    ),
    _e(
        "membership_change",
        _SUPERVISOR,
        "Nodes left or joined; the group restarts at the new size.",
        "from_nodes to_nodes from_world_size to_world_size restart_refunded remaining_restarts node",
        restart_refunded="a node loss or join does not use up a restart",
    ),
    _e(
        "job_stopped",
        _SUPERVISOR,
        "Every failed worker ended with a code a restart would only repeat, so the group is not restarted: "
        "2 (configuration, a checkpoint the code cannot take), 65 (non-finite stop), 73 (fenced), or 74 when "
        "the final save failed for a cause a restart cannot change (no space, permission denied, ...). "
        "Written while restarts remain; with none left the supervisor ends with the same code.",
        "exit_code failures",
    ),
    _e("job_failed", _SUPERVISOR, "Restarts exhausted.", "failures", failures="the last failures, as in `restart`"),
    _e(
        "supervisor_exit",
        _SUPERVISOR,
        "The supervisor exits with `exit_code`.",
        "exit_code preempted signalled",
        preempted='the preemption marker, or `{"exit_codes": [...]}` when a worker exited 75',
    ),
    _e(
        "checkpoint_epoch",
        "supervisor / rank 0",
        "This launch took its fencing epoch on the checkpoint root.",
        "epoch previous",
    ),
    # workers: start and resume
    _e("start", _RANK0, "A worker group started.", "world_size restart_count pid checkpoint_dir rank0_host"),
    _e(
        "resume",
        _RANK0,
        "Resumed from a checkpoint; a script's `after_load` may add fields.",
        "step tier from_world_size world_size load_seconds since_start_seconds cursor skipped suspect rng tiers? "
        "data_view? phases decision_reads",
        extensible=True,
        suspect="steps of the commits passed over because `ckpt audit` found them suspect or they descend from one "
        "(each also in `skipped`, with the reason)",
        tier="`remote`: `checkpoint.dir`; `local`: every rank's `checkpoint.local_dir` copy; `peer`: the nodes' "
        "copies (own node first, then other nodes' holders), resharded if need be",
        tiers="with `peer`: per rank, `local` (read only its node's copies) or `peer` (read from another node)",
        rng=f"`restored` or `{_RESEEDED}`",
        data_view="`recorded`, or `resolved now (the checkpoint has none)` for a checkpoint written before data "
        "views were recorded",
        phases="rank 0's seconds per phase between the worker's start and the resume, in the order they ran: "
        "`session` (process groups), `build` (model, sharding, optimizer), `decision` (rank 0's catalog), "
        "`agreement` (the plan shared), `state_init` (every rank's state initialised), `check` (the layout "
        "against the code), `planning`, `reading`, `verifying` (checksums), `set_state_dict`, `data_position`; "
        "`peer_load` with the peer tier",
        decision_reads="storage operations of rank 0's decision (listings and objects of `checkpoint.dir`)",
    ),
    _e("init_from", _RANK0, "A fresh start loaded `model.init_from`.", "path files tensors seconds"),
    _e(
        "reshard",
        _RANK0,
        "Resumed at a world size other than the checkpoint's.",
        "step from_world_size to_world_size from_mesh to_mesh rng",
        rng=f"always `{_RESEEDED}`: see [Resume and reshard](#resume-and-reshard)",
    ),
    _e(
        "data_view_frozen",
        _RANK0,
        "The files a run reads were recorded at its first start.",
        "files ignored ignored_count",
        files="how many files the run reads",
        ignored="up to 100 paths `data.path` resolves to now that the run does not read",
    ),
    _e(
        "config_changed",
        _RANK0,
        "Resumed with configuration changes `checkpoint.allow_changes` allows.",
        "step changes",
        changes="`key`, `checkpoint`, `config`",
    ),
    _e("state_added", _RANK0, "Optional state the checkpoint lacks, left as initialised.", "step name keys"),
    _e("state_ignored", _RANK0, "State the code no longer registers, not loaded.", "step name keys"),
    # workers: training
    _e(
        "step",
        _RANK0,
        "One optimizer step; a script adds fields with `s.record(...)`.",
        "step loss lr grad_norm world_size step_time_s tokens_per_s",
        extensible=True,
        lr="the learning rate this step's update used, the first optimizer's; `null` when none is recorded",
    ),
    _e(
        "nonfinite",
        _RANK0,
        "A step's loss or gradient norm was not finite; its update was not applied.",
        "step loss grad_norm sample_range action",
        action="`stop`/`rollback`/`replay`",
    ),
    _e(
        "loss_spike",
        _RANK0,
        "A step's global loss was above `train.loss_spike_factor` times the median of the steps before it; "
        "its update was not applied (the same policy as a non-finite step).",
        "step loss threshold sample_range action",
        threshold="the loss it exceeded",
        action="`stop`/`rollback`/`replay`",
    ),
    _e(
        "rollback",
        _RANK0,
        "After a non-finite or spiking step: reloaded the newest commit; the offending samples are skipped.",
        "from_step to_step skipped_range skipped_ranges",
    ),
    _e(
        "anomaly_replay",
        _RANK0,
        '`train.on_nonfinite = "replay"`: reloaded the newest commit to replay the same batches up to the '
        "anomalous step.",
        "step reason from_step",
        step="the anomalous step",
        reason="`non-finite` or `loss spike`",
    ),
    _e(
        "anomaly_reproduced",
        _RANK0,
        "The replay reproduced the anomaly: it is in the data (or the model); a `rollback` skipping its samples "
        "follows.",
        "step from_step loss",
        loss="the replay's loss at the step",
    ),
    _e(
        "silent_corruption",
        _RANK0,
        "The replay did not reproduce the anomaly: silent data corruption. The run goes on from the replay, "
        "skipping nothing.",
        "step from_step loss replayed_loss ranks rank node tensor",
        loss="the anomalous step's loss",
        replayed_loss="the replay's loss at that step",
        ranks="the ranks whose state at the step differed from the replay's, the one that moved most first",
        rank="the first of `ranks` (`null`: no rank's state differed: the fault was in the step itself)",
        node="the node (group rank) that rank ran on",
        tensor="its first parameter that differed",
    ),
    _e(
        "node_excluded",
        _RANK0,
        "`elastic.exclude_corrupt_node`: after `silent_corruption`, the replayed step is committed and the "
        "node that computed the corrupt state leaves the job (its supervisor exits 69); the other nodes "
        "re-form the group without it and go on from that commit.",
        "step node nodes committed",
        step="the replayed step, saved before the round ends",
        node="the node (group rank) that leaves",
        nodes="the nodes of the round it leaves",
        committed="the replayed step's commit landed (`false`: the others resume from the newest commit)",
    ),
    _e(
        "nonfinite_stop",
        _RANK0,
        "Stopped on a non-finite or spiking step (exit 65).",
        "step reason last_finite_step",
    ),
    _e(
        "checkpoint_interval_changed",
        _RANK0,
        '`checkpoint.interval_steps = "auto"` chose an interval.',
        "step interval_steps previous reason save_cost_s restart_cost_s failure_rate_per_h step_seconds commit_lag_s "
        "failures",
        step="agreed at",
        reason="`initial`, `lineage`, `measured`",
    ),
    _e("preempt_requested", _RANK0, "A preemption signal reached the workers.", "step signal grace_seconds"),
    _e(
        "preempted",
        _RANK0,
        "Stopped for a preemption: 75 when the final step was committed (`seconds` since the signal), "
        "76 when not (`reason`).",
        "step committed seconds? reason?",
    ),
    _e("finished", _RANK0, "Training reached its last step.", "step tokens_seen last_committed_step"),
    _e(
        "failure",
        "the failing rank",
        "A worker raised; the supervisor restarts the group while restarts remain.",
        "rank error restart_count",
    ),
    _e("fenced", _RANK0, "A newer launch owns the checkpoint root: this one stops (exit 73).", "step error"),
    # workers: checkpoints
    _e(
        "checkpoint_committed",
        _RANK0,
        "A checkpoint was committed.",
        "step name bytes seconds world_size",
        name="the directory",
    ),
    _e(
        "checkpoint_failed",
        _RANK0,
        "A save failed or missed its deadline; not committed, training continues.",
        "step error seconds",
    ),
    _e("checkpoint_fenced", _RANK0, "A commit found a newer launch's epoch: this one stops (exit 73).", "step error"),
    _e(
        "checkpoint_writer_restarted",
        _RANK0,
        '`checkpoint.writer = "process"` replaced every rank\'s writer process before a save (one died or failed '
        "a save, a save was still writing past its deadline, or a save that failed on another rank was still being "
        "written).",
        "reason step",
        step="the save in flight, if any",
    ),
    _e(
        "checkpoint_writer_fallback",
        _RANK0,
        "`checkpoint.writer = \"process\"` could not stage a rank's state in the node's shared memory "
        "(`/dev/shm` too small; that save failed): every rank writes with the thread writer from the next save on.",
        "writer reason",
    ),
    _e(
        "checkpoint_local_saved",
        _RANK0,
        "Rank 0's local-tier copy committed; every rank commits its own.",
        "step bytes seconds",
    ),
    _e(
        "checkpoint_local_failed",
        _RANK0,
        "Rank 0's local-tier copy failed and was not committed (`checkpoint.dir` is unaffected): `error` names the "
        "cause in one line (exception type, errno, message, file name). Every rank counts its own failures in "
        "`elastic_trainer_checkpoint_local_save_failures_total`.",
        "step error seconds",
    ),
    _e(
        "checkpoint_local_skipped",
        _RANK0,
        "The local tier could not be used at this start (not every rank had the copy, or a load failed); "
        "every rank loaded the peer tier (`checkpoint.peer_replicas`) or `checkpoint.dir`.",
        "step reason remote_step",
    ),
    _e(
        "checkpoint_peer_skipped",
        _RANK0,
        "The peer tier could not be used at this start (no step whose every shard every rank could reach, or a "
        "load failed: the copy that failed is dropped); every rank loaded `checkpoint.dir`.",
        "step reason remote_step",
    ),
    _e(
        "final_checkpoint_failed",
        _RANK0,
        "Training reached its last step but the final checkpoint was not committed (exit 74). `restartable` false: "
        "the save failed for a cause a restart cannot change (no space, permission, read-only file system, quota, "
        "a missing bucket; `reason` names it) and no node's supervisor restarts the group.",
        "step reason last_committed_step restartable",
    ),
    _e(
        "checkpoint_skipped",
        _RANK0,
        "A checkpoint passed over at resume (it failed to load, or the resume plan skipped it).",
        "step name? reason",
    ),
    _e(
        "checkpoint_ignored",
        _RANK0,
        "An entry under the checkpoint root that is not a step directory, left alone.",
        "path reason",
    ),
    _e(
        "checkpoint_cleaned",
        _RANK0,
        "An uncommitted directory of this launch or an older one was removed.",
        "step name reason",
    ),
    _e("checkpoint_deleted", _RANK0, "A committed checkpoint left the retention window.", "step name reason"),
    _e(
        "checkpoint_quarantined",
        _RANK0,
        "A checkpoint whose bytes failed to load: marked, never deleted.",
        "step name reason",
        reason="one line",
    ),
    _e(
        "checkpoint_audited",
        "`ckpt audit`",
        "A replay of the run from an earlier commit judged a commit: `certified` (the same bytes) or `suspect` "
        "(silent data corruption: never resumed from, nor anything descending from it). Written to the run's "
        "`run.dir` event log where `ckpt audit` can reach it.",
        "step name from_step verdict rank? node? tensor? descends_from? objects? seconds replays",
        rank="suspect: the rank whose state differs most from the replay's",
        node="suspect: the node (group rank) that rank ran on",
        tensor="suspect: the tensor of that rank that differs most",
        descends_from="suspect, not replayed: the suspect step an earlier replay of the same audit found, which this "
        "commit descends from",
        objects="certified: the items that are not tensors (a framework's bookkeeping, such as a log with "
        "wall-clock times) whose bytes differed while every tensor was equal",
        seconds="the replays' wall time",
        replays="1, or 2 when the first replay found a suspect commit and a second one broke the tie (a commit "
        "either replay reproduces is certified)",
    ),
    _e(
        "checkpoint_released",
        "`ckpt release`",
        "The quarantine lifted after every byte re-verified.",
        "step name reason",
    ),
    _e(
        "checkpoint_incompatible",
        _RANK0,
        "An intact checkpoint the code cannot take; the start stops with exit 2.",
        "name step? problems? reason?",
        problems="by `Stateful`",
        reason="format version",
    ),
    _e(
        "resume_refused",
        _RANK0,
        "Commits of the lineage exist but none loads; the start stops with exit 2 instead of training from step 0.",
        "reason unusable",
    ),
    # the SLURM batch script (deploy/slurm/elastic-trainer.sbatch)
    _e(
        "slurm_job",
        "`deploy/slurm` script",
        "One per run of the batch script.",
        "job_id restart_count nodes nnodes rdzv_endpoint",
    ),
    _e(
        "slurm_exit",
        "`deploy/slurm` script",
        "The batch script ends.",
        "job_id restart_count launcher_exit_code signal job_state requeued",
    ),
)

EVENT_NAMES: dict[str, Event] = {e.name: e for e in EVENTS}

_SNAKE = re.compile(r"^[a-z][a-z0-9_]*[a-z0-9]$")


def event_problems(
    event: str, fields: Mapping[str, Any] | set[str] | frozenset[str], *, partial: bool = False
) -> list[str]:
    """Why a record ``event`` with ``fields`` (names) breaks the catalogue; empty when it fits.
    ``partial``: the fields are only some of the record's (a call that also passes ``**x``),
    so missing required ones are not a problem."""
    spec = EVENT_NAMES.get(event)
    if spec is None:
        return [f"event {event!r} is not in the catalogue (elastic_trainer/contract.py EVENTS)"]
    names = set(fields)
    out = [f"event {event!r}: field {n!r} is reserved" for n in sorted(names & set(RECORD_FIELDS))]
    if not spec.extensible:
        out += [
            f"event {event!r}: field {n!r} is not in the catalogue"
            for n in sorted(names - spec.names - set(RECORD_FIELDS))
        ]
    if not partial:
        out += [f"event {event!r}: required field {n!r} missing" for n in sorted(spec.required - names)]
    return out


def problems(events: tuple[Event, ...] = EVENTS) -> list[str]:
    """Convention violations in an event catalogue (empty when it is sound). Pure; used by the tests."""
    counts = Counter(e.name for e in events)
    out = [f"{name}: defined twice" for name, n in counts.items() if n > 1]
    for e in events:
        if not _SNAKE.match(e.name):
            out.append(f"{e.name}: not snake_case")
        if e.writer not in WRITERS:
            out.append(f"{e.name}: unknown writer {e.writer!r}")
        if not e.meaning.strip() or "\n" in e.meaning or "|" in e.meaning:
            out.append(f"{e.name}: the meaning is one line of text (no '|')")
        if len(e.names) != len(e.fields):
            out.append(f"{e.name}: a field listed twice")
        for f in e.fields:
            if not _SNAKE.match(f.name) or f.name in RECORD_FIELDS:
                out.append(f"{e.name}.{f.name}: not a snake_case field name of its own")
            if "|" in f.note:
                out.append(f"{e.name}.{f.name}: '|' in a note breaks the table")
    return out


def events_table(events: tuple[Event, ...] = EVENTS) -> str:
    """docs/operations.md's event table (Markdown), generated from the catalogue."""

    def field(f: Field) -> str:
        return f"`{f.name}`" + (f" ({f.note})" if f.note else "")

    lines = ["| event | written by | fields | meaning |", "|---|---|---|---|"]
    for e in events:
        cell = ", ".join(field(f) for f in e.fields if f.required)
        optional = [field(f) for f in e.fields if not f.required]
        if optional:
            cell += "; optional: " + ", ".join(optional)
        lines.append(f"| `{e.name}` | {e.writer} | {cell} | {e.meaning} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(events_table(), end="")
