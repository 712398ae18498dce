"""Goodput at 1,024 and 16,384 GPUs, modelled from the control plane's measured figures.

Not a measurement: the expected goodput of a job at scale, from the anchors' failure rate and the
figures ``bench/scale.py`` measured for the control plane (BENCHMARKS.md, "The control plane from
16 to 4,096 nodes"), for this package's supervisor and for torch's plain elastic agent (torchrun,
its defaults, a synchronous DCP save). The model is the cadence's own
(:func:`elastic_trainer.checkpoint.cadence.expected_waste`, each agent at its best interval), so
the figures are the waste the product plans with.

What each failure costs, per agent (seconds):

* detection: a worker that dies is seen by its agent at once (both); a node that goes silent
  (power, NIC: no exit, no FIN) is seen by ours after the liveness bound, which at N nodes must
  be at least twice the c10d heartbeat period ``HEARTBEAT_TURN_SECONDS_PER_NODE × N²``
  (:func:`elastic_trainer.supervisor.liveness.scale_warning`), and by torch's plain agent only
  when NCCL's collective timeout (10 minutes by default) fails the survivors;
* the rendezvous round: the measured round of torch's handler (3.2 s at 8–32 nodes) plus the
  survivors' joins, one compare-and-set of the whole state each (one heartbeat period); torch's
  plain agent also waits its 30 s ``last_call_timeout`` (ours rejoins without it);
* under the package's own rendezvous (``elastic.rdzv_backend = "elastic-trainer"``): the
  settings docs/elasticity.md gives for the node count (``bench/scale_keyed.py``'s
  ``cadence_for``: a heartbeat and a poll every ``p`` seconds), a silent node seen after its
  liveness bound plus one poll, and a round of three polls and half a second (measured: 0.7 s
  at 1,024 nodes, 3.5 s at 4,096 with ``p`` = 1 s);
* the resume decision: ours reads the newest commit's manifest and checks it (measured per rank);
  the plain loop loads a path it was given (0);
* start-up and load: the same for both (``--restart``), assumed (a multi-node start is not
  measured): the warm start would shorten ours;
* lost work: half an interval, plus the commit lag: ours saves in the background (the write, then
  rank 0's commit, measured per rank), the plain save returns committed.

What each save costs training: the plain agent's synchronous save ``--sync-save`` seconds; ours
the blocked call plus the slowdown of the steps it overlaps, as ratios of a synchronous save
measured with a core free for the writer (0.01 and 0.08; "Where the targets stand").

    python bench/goodput_at_scale.py                       # the table in BENCHMARKS.md
    python bench/goodput_at_scale.py --sync-save 120 --restart 300
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.scale_keyed import cadence_for
from elastic_trainer.checkpoint.cadence import expected_waste, optimal_interval
from elastic_trainer.supervisor.liveness import heartbeat_period_seconds

# Llama 3 (Meta, 2024): 419 unexpected interruptions in 54 days of pre-training on 16,384 H100s
FAILURES_PER_GPU_SECOND = 419 / (54 * 86_400) / 16_384
GPUS_PER_NODE = 8
# bench/scale.py, BENCHMARKS.md (4,096 simulated ranks; linear in the ranks up to there)
COMMIT_SECONDS_PER_RANK = {"local": 0.976 / 4096, "s3": 8.812 / 4096}
DECISION_SECONDS_PER_RANK = {"local": 1.451 / 4096, "s3": 3.738 / 4096}
ROUND_SECONDS = 3.2  # torch's handler, 8-32 nodes, the package's cadence
DEFAULT_BOUND = 2.0  # elastic.rdzv_conf's liveness bound
TORCH_LAST_CALL = 30.0  # torch's rendezvous last_call_timeout
NCCL_TIMEOUT = 600.0  # torch's default collective timeout for NCCL
BLOCKED_RATIO, OVERLAP_RATIO = 0.01, 0.08  # of a synchronous save, a core free for the writer


@dataclass(frozen=True)
class Agent:
    name: str
    detection: float  # seconds, all below
    rendezvous: float
    decision: float
    save_cost: float
    commit_lag: float


def agents(gpus: int, storage: str, sync_save: float, silent: bool) -> list[Agent]:
    nodes = gpus // GPUS_PER_NODE
    period = heartbeat_period_seconds(nodes)
    bound = max(DEFAULT_BOUND, 2 * period)
    joins = period  # the survivors' joins, one compare-and-set of the whole state each
    ours = Agent(
        "elastic_trainer",
        detection=bound if silent else 0.1,
        rendezvous=ROUND_SECONDS + joins,
        decision=DECISION_SECONDS_PER_RANK[storage] * gpus,
        save_cost=(BLOCKED_RATIO + OVERLAP_RATIO) * sync_save,
        commit_lag=sync_save + COMMIT_SECONDS_PER_RANK[storage] * gpus,
    )
    c = cadence_for(nodes)
    own_bound = c["keep_alive_interval"] * c["keep_alive_max_attempt"]
    own = Agent(
        "elastic_trainer, own rendezvous",
        detection=own_bound + c["poll_seconds"] if silent else 0.1,
        rendezvous=3 * c["poll_seconds"] + 0.5,
        decision=ours.decision,
        save_cost=ours.save_cost,
        commit_lag=ours.commit_lag,
    )
    plain = Agent(
        "torchrun + sync DCP",
        # a crash: the others' agents see the failed node waiting at their next read of the store (~1 s)
        detection=NCCL_TIMEOUT if silent else 1.0,
        rendezvous=ROUND_SECONDS + joins + TORCH_LAST_CALL,
        decision=0.0,
        save_cost=sync_save,
        commit_lag=0.0,
    )
    return [ours, own, plain]


def row(agent: Agent, gpus: int, step: float, restart: float) -> dict:
    rate = FAILURES_PER_GPU_SECOND * gpus
    recovery = agent.detection + agent.rendezvous + agent.decision + restart
    n = optimal_interval(step, agent.save_cost, recovery, rate, agent.commit_lag)
    waste = expected_waste(n, step, agent.save_cost, recovery, rate, agent.commit_lag)
    return {"recovery": recovery, "interval": n * step, "goodput": 1 - waste, "mtbf_h": 1 / rate / 3600}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", default="1024,16384", help="comma-separated GPU counts (8 per node)")
    p.add_argument("--sync-save", type=float, default=30.0, help="a synchronous save's seconds (default 30)")
    p.add_argument("--restart", type=float, default=60.0, help="start-up and load seconds, both agents (60)")
    p.add_argument("--step", type=float, default=5.0, help="a training step's seconds (default 5)")
    p.add_argument("--storage", choices=sorted(COMMIT_SECONDS_PER_RANK), default="s3")
    p.add_argument("--smoke", action="store_true", help="the same table (it is arithmetic)")
    a = p.parse_args(argv)
    print(
        f"sync save {a.sync_save:g} s, start-up + load {a.restart:g} s, step {a.step:g} s, storage {a.storage}; "
        f"failures: Llama 3's rate, {FAILURES_PER_GPU_SECOND * 86_400 * 16_384:.2f} a day at 16,384 GPUs\n"
    )
    print(
        "| GPUs (nodes) | MTBF | failures | agent | detection (s) | round (s) | decision (s) | recovery (s) "
        "| save cost (s) | commit lag (s) | best interval (s) | goodput |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for gpus in (int(g) for g in a.gpus.split(",")):
        for silent in (False, True):
            for agent in agents(gpus, a.storage, a.sync_save, silent):
                r = row(agent, gpus, a.step, a.restart)
                kind = "silent node" if silent else "crash"
                print(
                    f"| {gpus:,} ({gpus // GPUS_PER_NODE:,}) | {r['mtbf_h']:.1f} h | {kind} | {agent.name} "
                    f"| {agent.detection:.1f} | {agent.rendezvous:.1f} | {agent.decision:.1f} | {r['recovery']:.0f} "
                    f"| {agent.save_cost:.1f} | {agent.commit_lag:.1f} | {r['interval']:.0f} | {r['goodput']:.4f} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
