"""``elastic-trainer report RUN_DIR``: a run's summary and goodput from its event log, and a PNG.

Everything here reads ``<run.dir>/events.jsonl`` (see :mod:`elastic_trainer.events`). The
accounting (:func:`account`, :func:`summarize`) is pure and works on any list of event records.

Goodput accounting. Wall time runs from the first to the last record and is split into:

* **productive** — step time (``step_time_s``) of every step whose result was kept;
* **recomputed** — step time of steps executed and then rolled back: a later incarnation resumed
  from a checkpoint older than them and ran them again (work lost since the last checkpoint);
* **interruptions** (restart, rendezvous, load) — from the end of the last step before a failure,
  preemption, restart or relaunch to the start of the first step after it; includes failure
  detection, backoff, rendezvous, process start-up and checkpoint loading (reported separately
  as ``load_seconds``);
* **startup** — from the first record (launch) to the start of the first step;
* **other** — the rest: time between steps (checkpoint save calls, logging) and shutdown.

``goodput = productive / wall``. A step's start is its record's ``time - step_time_s``.

The same wall time is also split into the finer categories of :mod:`elastic_trainer.goodput`
(``goodput.categories``), the ones the supervisor exports live as ``elastic_trainer_wall_seconds``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

from . import contract, exit_codes
from .events import read_events
from .goodput import CATEGORIES, Goodput, Interruption, Ledger, account  # noqa: F401 - the accounting lives in goodput


def kept_steps(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The step records whose results stand (a step redone after a restart keeps its last run),
    in step order: the run's continuous loss curve."""
    kept: list[dict[str, Any]] = []
    for e in events:
        if e.get("event") != "step":
            continue
        while kept and kept[-1]["step"] >= e["step"]:
            kept.pop()
        kept.append(e)
    return kept


def summarize(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's summary (steps, tokens, restarts, checkpoints, goodput). Pure."""
    kept = kept_steps(events)

    def by(name: str) -> list[dict[str, Any]]:
        return [e for e in events if e.get("event") == name]

    finished = by("finished")
    exits = by("supervisor_exit")
    if finished:
        status = "finished"
    elif by("preempted"):
        status = "preempted"
    elif by("job_failed") or (exits and exits[-1].get("exit_code") not in (0, None)):
        status = "failed"
    elif exits:
        status = "stopped"
    else:
        status = "running or killed"
    if finished and finished[-1].get("tokens_seen") is not None:
        tokens = int(finished[-1]["tokens_seen"])
    else:
        tokens = int(round(sum(float(e.get("tokens_per_s") or 0) * float(e.get("step_time_s") or 0) for e in kept)))
    restarts = by("restart")
    reasons: dict[str, int] = {}
    for r in restarts:
        reasons[r.get("reason", "?")] = reasons.get(r.get("reason", "?"), 0) + 1
    commits = by("checkpoint_committed")
    g = account(events)
    return {
        "status": status,
        "steps": kept[-1]["step"] if kept else 0,
        "tokens": tokens,
        "final_loss": kept[-1].get("loss") if kept else None,
        "restarts": len(restarts),
        "restart_reasons": reasons,
        "launches": len(by("launch")),
        "failures": len(by("failure")),
        "reshards": len(by("reshard")),
        "world_sizes": sorted({e["world_size"] for e in kept if e.get("world_size") is not None}),
        "checkpoints_committed": len(commits),
        "checkpoint_failures": len(by("checkpoint_failed")),
        "last_committed_step": commits[-1]["step"] if commits else None,
        "checkpoint_bytes": sum(int(c.get("bytes") or 0) for c in commits),
        "goodput": asdict(g),
    }


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole > 0 else "-"


def render_text(s: dict[str, Any], run_dir: str = "") -> str:
    g = s["goodput"]
    wall = g["wall_seconds"]
    loss = f", final loss {s['final_loss']:.4f}" if s["final_loss"] is not None else ""
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(s["restart_reasons"].items()))
    lines = [
        f"run {run_dir}: {s['status']} at step {s['steps']} ({s['tokens']:,} tokens){loss}",
        f"restarts {s['restarts']}"
        + (f" ({reasons})" if reasons else "")
        + f", reshards {s['reshards']}, world sizes {s['world_sizes'] or '-'}",
        f"checkpoints {s['checkpoints_committed']} committed, "
        f"{s['checkpoint_failures']} failed, last committed step {s['last_committed_step']}",
        f"wall {wall:.1f} s = productive {g['productive_seconds']:.1f} s ({_pct(g['productive_seconds'], wall)})"
        f" + recomputed {g['recompute_seconds']:.1f} s ({g['recompute_steps']} steps)"
        f" + restart/rendezvous/load {g['interruption_seconds']:.1f} s (load {g['load_seconds']:.1f} s)"
        f" + startup {g['startup_seconds']:.1f} s + other {g['other_seconds']:.1f} s",
        "goodput " + (f"{100 * g['goodput']:.1f}%" if g["goodput"] is not None else "unknown (no steps)"),
        "by category: " + ", ".join(f"{k} {v:.1f} s" for k, v in g["categories"].items()),
    ]
    for i in g["interruptions"]:
        ws = ""
        if i["world_size_before"] != i["world_size_after"]:
            ws = f", world {i['world_size_before']} -> {i['world_size_after']}"
        lines.append(
            f"  after step {i['after_step']}: {i['reason']}, resumed from step {i['resumed_step']} "
            f"({i['redone_steps']} steps redone), {i['seconds']:.1f} s (load {i['load_seconds']:.2f} s){ws}"
        )
    return "\n".join(lines)


_ENDINGS = {  # exit code -> (how the launch ended, detail after "at step N/T")
    exit_codes.OK: ("finished", ""),
    exit_codes.PREEMPTED: ("preempted", ", final step committed"),
    exit_codes.PREEMPTED_UNCOMMITTED: (
        "preempted",
        ", final step not committed (a resume redoes the steps since the newest commit)",
    ),
    exit_codes.NONFINITE: ("stopped", " on a non-finite loss or gradient norm"),
    exit_codes.FENCED: ("stopped", ": a newer launch owns the checkpoint root"),
    exit_codes.FAILED: ("failed", ", restarts exhausted (the restart events in events.jsonl name the failing ranks)"),
}


def _without_override(argv: list[str], key: str) -> list[str]:
    """``argv`` without its ``--set KEY=...`` / ``--set=KEY=...`` items."""
    out: list[str] = []
    skip = False
    for i, a in enumerate(argv):
        if skip:
            skip = False
        elif a == "--set" and i + 1 < len(argv) and argv[i + 1].startswith(f"{key}="):
            skip = True
        elif not a.startswith(f"--set={key}="):
            out.append(a)
    return out


def closing_summary(
    run_dir: str,
    checkpoint_dir: str,
    target_steps: int,
    exit_code: int,
    prog: str,
    launch_args: list[str],
    pid: int | None = None,
) -> str | None:
    """What ``launch`` prints when it ends: how this launch ended, its steps, wall time and
    goodput (from its own records in ``run_dir/events.jsonl``), where the checkpoints are, and
    the commands to resume and to draw the report (``prog``: how the user ran elastic-trainer).
    None when this node holds no event log."""
    import shlex

    path = os.path.join(run_dir, contract.EVENTS_FILE)
    if not os.path.exists(path):
        return None
    events = list(read_events(path))
    starts = [i for i, e in enumerate(events) if e.get("event") == "launch" and (pid is None or e.get("pid") == pid)]
    mine = events[starts[-1] :] if starts else events
    s = summarize(mine)
    g = s["goodput"]
    goodput = f"goodput {100 * g['goodput']:.0f}%" if g["goodput"] is not None else "no steps"
    ending, detail = _ENDINGS.get(exit_code, (f"ended with exit code {exit_code}", ""))
    committed = s["last_committed_step"]
    launch = shlex.join([prog, "launch", *launch_args])
    if exit_code == exit_codes.OK:
        args = _without_override(launch_args, "train.steps")
        again = (
            f"  train longer: {shlex.join([prog, 'launch', *args, '--set', 'train.steps=N'])} "
            f"  (continues from step {committed})"
        )
    else:
        again = f"  resume:      {launch}   (continues from the newest commit)"
    return "\n".join(
        [
            f"{ending} at step {s['steps']}/{target_steps}{detail}: {g['wall_seconds']:.1f} s wall, {goodput}, "
            f"{s['restarts']} restart(s), {s['checkpoints_committed']} checkpoint(s) committed",
            f"  checkpoints: {checkpoint_dir}"
            + (f" (newest commit: step {committed})" if committed is not None else " (none committed by this launch)")
            + f"; list them: {shlex.join([prog, 'ckpt', 'list', checkpoint_dir])}",
            f"  report:      {shlex.join([prog, 'report', run_dir])}   (loss curve, "
            f"restarts, goodput -> {os.path.join(run_dir, 'report.png')})",
            again,
        ]
        # The launcher records its exit just before this: without it the log missed records.
        + ([] if any(e.get("event") == "supervisor_exit" for e in mine) else [INCOMPLETE_LOG])
    )


INCOMPLETE_LOG = (
    "  note:        the event log in run.dir is incomplete (it could not be written: disk full?); "
    "the steps and goodput above cover what it holds"
)


def plot(events: list[dict[str, Any]], summary: dict[str, Any], out: str):
    """Write the PNG: loss vs step (one continuous curve of the kept steps; rolled-back runs in
    grey) with restarts, reshards and checkpoint commits marked; tokens/s and world size below.
    Returns the matplotlib Figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    kept = kept_steps(events)
    fig = Figure(figsize=(11, 7), layout="constrained")
    FigureCanvasAgg(fig)
    ax, ax2 = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1.3))
    _plot_rolled_back(ax, events, kept)
    ax.plot([e["step"] for e in kept], [e["loss"] for e in kept], color="tab:blue", lw=1.5, label="loss", gid="loss")
    _plot_commits(ax, events, kept)
    _mark_restarts_and_reshards(ax, events, summary)
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(_plot_title(summary), fontsize=10)
    _plot_throughput(ax2, kept)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    return fig


def _step_runs(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The step records cut into runs: a new run starts wherever the step does not go up (a restart
    that went back to an older commit)."""
    runs: list[list[dict[str, Any]]] = [[]]
    for e in events:
        if e.get("event") == "step":
            if runs[-1] and e["step"] <= runs[-1][-1]["step"]:
                runs.append([])
            runs[-1].append(e)
    return runs


def _plot_rolled_back(ax, events: list[dict[str, Any]], kept: list[dict[str, Any]]) -> None:
    """Each run's steps that a restart threw away, as a grey dashed line (one legend entry for all)."""
    kept_ids = {id(e) for e in kept}
    label: str | None = "rolled back (redone after a restart)"
    for run in _step_runs(events):
        lost = [e for e in run if id(e) not in kept_ids]
        if lost:
            ax.plot(
                [e["step"] for e in lost],
                [e["loss"] for e in lost],
                color="0.6",
                lw=1,
                ls="--",
                marker="x",
                ms=3,
                label=label,
            )
            label = None


def _plot_commits(ax, events: list[dict[str, Any]], kept: list[dict[str, Any]]) -> None:
    """A marker on the loss curve at each committed checkpoint's step (those the curve holds)."""
    loss_at = {e["step"]: e["loss"] for e in kept}
    commits = [e["step"] for e in events if e.get("event") == "checkpoint_committed"]
    cs = [s for s in commits if s in loss_at]
    if cs:
        ax.plot(
            cs,
            [loss_at[s] for s in cs],
            ls="none",
            marker="v",
            color="tab:green",
            ms=7,
            label="checkpoint committed",
            gid="commits",
        )


def _mark_restarts_and_reshards(ax, events: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    """A red line at each restart (the steps it redid shaded) and a purple one at each reshard,
    each kind labelled once in the legend."""
    labelled = set()
    for it in summary["goodput"]["interruptions"]:
        lbl = f"restart ({it['reason']})"
        ax.axvline(it["after_step"], color="tab:red", ls="--", lw=1.2, label=None if lbl in labelled else lbl)
        labelled.add(lbl)
        if it["resumed_step"] is not None and it["resumed_step"] != it["after_step"]:
            ax.axvspan(it["resumed_step"], it["after_step"], color="tab:red", alpha=0.08)
    for r in (e for e in events if e.get("event") == "reshard"):
        ax.axvline(r["step"], color="tab:purple", lw=1.5, ls=":", label=None if "reshard" in labelled else "reshard")
        labelled.add("reshard")
        ax.annotate(
            f"world {r.get('from_world_size')}\u2192{r.get('to_world_size')}",
            (r["step"], 1),
            xycoords=("data", "axes fraction"),
            xytext=(3, -12),
            textcoords="offset points",
            color="tab:purple",
            fontsize=8,
        )


def _plot_title(summary: dict[str, Any]) -> str:
    g = summary["goodput"]
    gp = f"{100 * g['goodput']:.1f}%" if g["goodput"] is not None else "unknown"
    return (
        f"{summary['status']} at step {summary['steps']} | "
        f"{summary['tokens']:,} tokens | restarts {summary['restarts']} | "
        f"reshards {summary['reshards']} | checkpoints {summary['checkpoints_committed']} | goodput {gp}"
    )


def _plot_throughput(ax2, kept: list[dict[str, Any]]) -> None:
    """The lower panel: tokens/s, with the world size on a second axis and one legend for both."""
    ax2.plot(
        [e["step"] for e in kept], [e.get("tokens_per_s", 0) for e in kept], color="tab:orange", lw=1, label="tokens/s"
    )
    ax2.set_ylabel("tokens/s")
    ax2.set_xlabel("step")
    ax2.grid(alpha=0.3)
    ax3 = ax2.twinx()
    ax3.step(
        [e["step"] for e in kept],
        [e.get("world_size", 0) for e in kept],
        where="post",
        color="tab:gray",
        lw=1.2,
        label="world size",
    )
    ax3.set_ylabel("world size")
    ax3.set_ylim(bottom=0)
    ax3.yaxis.get_major_locator().set_params(integer=True)
    handles = ax2.get_legend_handles_labels()[0] + ax3.get_legend_handles_labels()[0]
    ax2.legend(handles=handles, loc="lower right", fontsize=8)


def load_events(source: str, endpoint_url: str = "") -> tuple[list[dict[str, Any]], str] | None:
    """The run's records from ``<source>/events.jsonl`` (a run directory), else from the event
    logs mirrored under ``<source>/_events/`` (a checkpoint root: local, ``file://`` or ``s3://``).
    Returns ``(events, where)``, or None when neither holds a log."""
    if "://" not in source:
        path = os.path.join(source, contract.EVENTS_FILE)
        if os.path.exists(path):
            return list(read_events(path)), path
    from .config import check_uri
    from .storage.fs import open_storage
    from .supervisor.history import read_mirrored_events

    check_uri(source, "RUN_DIR|CHECKPOINT_ROOT")  # errors name the argument the user gave
    storage = open_storage(source, endpoint_url)
    events = read_mirrored_events(storage)
    return (events, storage.join(contract.EVENTS_MIRROR_DIR)) if events else None


def main(args) -> int:
    """CLI entry: ``args.run_dir`` (a run directory or a checkpoint root), ``args.out`` (PNG),
    ``args.json``, ``args.endpoint_url``."""
    loaded = load_events(args.run_dir, getattr(args, "endpoint_url", "") or "")
    if loaded is None:
        print(
            f"elastic-trainer: no event log at {args.run_dir} (neither events.jsonl nor _events/ of a checkpoint root)",
            file=sys.stderr,
        )
        return 2
    events, where = loaded
    summary = summarize(events)
    local_run_dir = "://" not in args.run_dir and os.path.exists(os.path.join(args.run_dir, contract.EVENTS_FILE))
    out = args.out or (
        None if args.json else os.path.join(args.run_dir, "report.png") if local_run_dir else "report.png"
    )
    if out is not None:  # --json alone only reads: it draws nothing unless --out asks for it
        plot(events, summary, out)
    summary["run_dir"] = args.run_dir
    summary["events"] = where
    summary["plot"] = out
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(render_text(summary, args.run_dir))
        print(f"plot: {out}")
    return 0
