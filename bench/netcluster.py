"""Silent node loss, rejoin, shrink and grow of the demo on a virtual cluster of network namespaces.

    python bench/netcluster.py [--config configs/demo-cpu.toml] [--rdzv-conf K=V,...] [--loss PCT]
                               [--rounds 1] [--steady SECONDS] [--phases] [--imports] [--set k=v ...]
                               [--pin NODE=CPUS ...]

Needs root, iproute2 and nftables (scripts/system-deps.d/50-netns.sh). Builds the namespace
cluster of tests/fixtures/netcluster.py (store + nodes a, b, c on a bridge, 198.51.100.0/24), runs
the config with one worker per node, and measures, on one job:

* silent   node a's network dropped (nftables, no reset) while its processes run → b's first step
           at world 1 (b's ``step`` event time − the cut);
* rejoin   a's network back → first step at world 2 again (a rejoins, or its supervisor stops);
* shrink   every process of node a SIGKILLed → b's first step at world 1;
* grow     node c started while b trains alone → b's first step at world 2 (also from c's
           supervisor being ready, its ``launch`` event: without the interpreter start and imports).

With ``--imports`` it first times what bounds a newcomer's start-up: a fresh interpreter importing
torch's elastic agent, alone and two at once (what a supervisor and a warm-start zygote of its own
interpreter would run), on the idle machine and while one node trains. ``--pin a=0 --pin b=0 --pin
c=1`` runs the nodes on the CPUs given (``taskset``): a newcomer with a core of its own. With
``--loss PCT`` every host drops PCT % of the packets it receives for the whole job, and the script
counts b's restarts beyond the four the faults cause (false node loss). With ``--steady S`` the
first round starts with fault-free windows of S seconds at world 2: clean, 2 % loss on every host,
every node's link limited to 300 Mbit/s, both, clean again; it reports each one's steps/s against
the clean ones and any restart or ``node_lost`` (false node loss) in them. Prints one JSON line
per round and a Markdown table of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, loadavg, machine_info, parse_with_smoke
from tests import runs
from tests.fixtures import netcluster

MEASURES = ("silent", "rejoin", "shrink", "grow", "grow_from_ready")


def first_step(run_dir: Path, node_proc, after: float, world: int, timeout: float = 180) -> float:
    rec = runs.wait_event(
        run_dir, "step", timeout, node_proc, where=lambda r: r["world_size"] == world and r["time"] > after
    )
    return rec["time"] - after


def _window(run_dir: Path, seconds: float) -> tuple[float, int]:
    """(steps per second, restarts + node_lost events) over the next ``seconds``."""
    t0 = time.time()
    time.sleep(seconds)
    events = [e for e in runs.read_events(run_dir) if e["time"] > t0]
    steps = [e for e in events if e["event"] == "step" and e.get("world_size") == 2]
    return len(steps) / (time.time() - t0), len([e for e in events if e["event"] in ("restart", "node_lost")])


def steady(args, cluster, run_dir: Path) -> dict:
    """Fault-free training at world 2 in windows side by side in one job: clean, ``--steady-loss``
    % loss on every host, every node's link limited to ``--steady-rate`` Mbit/s, both, clean
    again. Any restart or node_lost in a window is a false node loss."""
    nodes = ("a", "b")

    def loss():
        cluster.packet_loss(args.steady_loss)

    def rate():
        for n in nodes:
            cluster.rate_limit(n, args.steady_rate)

    def clear():
        cluster.heal()
        for n in nodes:
            cluster.unlimit(n)

    out, false = {}, 0
    for name, setup in (
        ("clean", clear),
        ("loss", loss),
        ("rate", lambda: (clear(), rate())),
        ("loss_rate", loss),
        ("clean2", clear),
    ):
        setup()
        out[name], n = _window(run_dir, args.steady)
        false += n
    if args.loss:
        cluster.packet_loss(args.loss)
    clean = (out.pop("clean") + out.pop("clean2")) / 2
    return {
        "steps_per_s_clean": round(clean, 3),
        **{f"ratio_{k}": round(v / clean, 3) for k, v in out.items()},
        "false_losses": false,
    }


def phases(events: list[dict], after: float, node: str = "b") -> dict:
    """Seconds from the fault to node ``node``'s restart, rendezvous done, worker start, resume."""
    out = {}
    for name in ("restart", "rendezvous", "start", "resume"):
        e = next((e for e in events if e["event"] == name and e["time"] > after and e.get("node", node) == node), None)
        out[name] = round(e["time"] - after, 2) if e else None
    return out


def newcomer_phases(events: list[dict], started: float, node: str = "c") -> dict:
    """Seconds from the newcomer's process start to its supervisor being ready (``launch``), its
    rendezvous done, its workers started (forked), its worker's start, the group's resume."""
    out = {}
    for name, mine in (("launch", True), ("rendezvous", True), ("workers_started", True), ("start", False)):
        e = next(
            (e for e in events if e["event"] == name and e["time"] > started and (not mine or e.get("node") == node)),
            None,
        )
        out["ready" if name == "launch" else name] = round(e["time"] - started, 2) if e else None
    e = next((e for e in events if e["event"] == "resume" and e["time"] > started and e["world_size"] == 2), None)
    out["resume"] = round(e["time"] - started, 2) if e else None
    return out


IMPORT = "import torch.distributed.run, torch.distributed.elastic.agent.server.local_elastic_agent"


def _import_seconds(n: int) -> float:
    """Wall time of ``n`` fresh interpreters importing what a supervisor needs to join, at once."""
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", IMPORT]) for _ in range(n)]
    for p in procs:
        p.wait()
    return time.monotonic() - t0


def import_bound(args, work: Path, data: str) -> dict:
    """What bounds a newcomer's start-up: the supervisor's torch import alone and two at once (the
    supervisor and its warm-start zygote), medians of 3, on the idle machine and while node b
    trains alone on the cluster."""

    def measure() -> dict:
        return {f"{n}_at_once": round(statistics.median(_import_seconds(n) for _ in range(3)), 2) for n in (1, 2)}

    out = {"idle": measure()}
    run_dir, cfg, extra = _job_files(args, work, data)
    with netcluster.NetCluster(["store", "b"], tag=f"eti{os.getpid() % 100000}") as cluster:
        job = netcluster.ClusterJob(cluster, runs.CLI, cfg, work, runs.env_for_tests(), runs.REPO)
        job.start_store()
        b = job.node("b", *extra)
        runs.wait_event(run_dir, "step", 300, b, where=lambda r: r["step"] >= 10)
        out["b_training"] = measure()
    return out


def _job_files(args, work: Path, data: str) -> tuple[Path, Path, list[str]]:
    """(run dir, config file, the nodes' ``--set`` arguments) of one job in ``work``."""
    run_dir = work / "run"
    sets = [
        f"run.dir={run_dir}",
        f"checkpoint.dir={run_dir / 'ckpt'}",
        f"data.path={data}",
        f"train.steps={args.steps}",
        *args.set,
    ]
    cfg = work / "job.toml"
    cfg.write_text(Path(args.config).read_text())
    return run_dir, cfg, [a for s in sets for a in ("--set", s)]


def one_round(args, work: Path, data: str, first: bool) -> dict:
    run_dir, cfg, extra = _job_files(args, work, data)
    with netcluster.NetCluster(["store", "a", "b", "c"], tag=f"etb{os.getpid() % 100000}") as cluster:
        job = netcluster.ClusterJob(
            cluster, runs.CLI, cfg, work, runs.env_for_tests(), runs.REPO, rdzv_conf=args.rdzv_conf, pin=args.pin
        )
        if args.loss:
            cluster.packet_loss(args.loss)
        job.start_store()
        a, b = job.node("a", *extra), job.node("b", *extra)
        runs.wait_event(run_dir, "step", 300, b, where=lambda r: r["world_size"] == 2 and r["step"] >= 10)
        out: dict = {}
        marks: dict = {}
        if args.steady and first:
            out["steady"] = steady(args, cluster, run_dir)
        cut = marks["silent"] = time.time()
        cluster.silence("a")
        out["silent"] = first_step(run_dir, b, cut, 1)
        healed = marks["rejoin"] = time.time()
        cluster.heal("a")
        if args.loss:
            cluster.packet_loss(args.loss, ["a"])
        try:
            out["rejoin"] = first_step(run_dir, b, healed, 2, timeout=120)
        except AssertionError:
            out["rejoin"] = None  # a's supervisor stopped instead (see its exit code)
            job.node("a", *extra)
            runs.wait_event(run_dir, "step", 180, b, where=lambda r: r["world_size"] == 2 and r["time"] > healed)
        time.sleep(3)  # a few steps at world 2 (and a commit) before the next fault
        killed = marks["shrink"] = time.time()
        cluster.kill_host("a")
        out["shrink"] = first_step(run_dir, b, killed, 1)
        joined = marks["grow"] = time.time()
        c = job.node("c", *extra)
        out["grow"] = first_step(run_dir, b, joined, 2)
        ready = next(e for e in runs.read_events(run_dir, "launch") if e["time"] > joined and e["node"] == "c")
        out["grow_from_ready"] = out["grow"] - (ready["time"] - joined)
        events = runs.read_events(run_dir)
        if args.phases:
            out["phases"] = {m: phases(events, t) for m, t in marks.items()}
            out["phases"]["grow_newcomer"] = newcomer_phases(events, joined)
        faults = 3  # the cut, the rejoin, the kill; a grow is the 4th membership change
        out["node_lost"] = [(e["node"], e["reason"]) for e in events if e["event"] == "node_lost"]
        out["restarts"] = len([e for e in events if e["event"] == "restart" and e["node"] == "b"])
        out["unexplained_restarts_b"] = max(0, out["restarts"] - (faults + 1))
        out["codes"] = {n: p.poll() for n, p in {"a": a, "c": c}.items()}
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in out.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs" / "demo-cpu.toml"))
    p.add_argument(
        "--rdzv-conf", default=None, help="--rdzv-conf for every node (default: the config's elastic.rdzv_conf)"
    )
    p.add_argument("--loss", type=int, default=0, help="percent of packets every host drops, whole run")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=2000, help="train.steps (the job is stopped after the measurements)")
    p.add_argument("--set", action="append", default=[])
    p.add_argument(
        "--steady",
        type=float,
        default=0,
        help="seconds per window of the fault-free throughput check (clean, lossy, clean), first round only",
    )
    p.add_argument("--steady-loss", type=int, default=2, help="percent loss of the lossy window")
    p.add_argument("--steady-rate", type=float, default=300, help="Mbit/s rate limit of the lossy window (0: none)")
    p.add_argument(
        "--imports",
        action="store_true",
        help="first time the supervisor's torch import alone and two at once, idle and while a node trains",
    )
    p.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="NODE=CPUS",
        help="run node NODE (a, b, c) on CPUS only (taskset -c), e.g. --pin a=0 --pin b=0 --pin c=1: a newcomer "
        "with a core of its own",
    )
    p.add_argument("--workdir", default=None, help="where the scratch directory goes (kept with --keep)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory (logs, events)")
    p.add_argument(
        "--phases",
        action="store_true",
        help="also print when b restarted, rendezvoused, started, resumed, and the grow's newcomer's own phases",
    )
    args = parse_with_smoke(p, [])
    args.pin = dict(item.split("=", 1) for item in args.pin)
    reason = netcluster.unavailable()
    if reason:
        print(f"virtual cluster unavailable: {reason}", file=sys.stderr)
        return 0 if args.smoke else 2
    if args.smoke:  # the cluster is built and torn down; a job on it takes minutes
        with netcluster.NetCluster(["store", "a"], tag=f"etb{os.getpid() % 100000}") as cluster:
            print(json.dumps({"smoke": "virtual cluster up", "tag": cluster.tag}))
        return 0
    print(
        json.dumps(
            {"machine": machine_info(), "loadavg": loadavg(), "rdzv_conf": args.rdzv_conf, "loss_pct": args.loss}
        )
    )
    if args.imports:
        d = tempfile.mkdtemp(prefix="netbench", dir=args.workdir)
        try:
            from elastic_trainer.worker.tokens import build_token_file, default_demo_texts

            build_token_file(default_demo_texts(1 << 20), str(Path(d) / "tokens.bin"))
            print(json.dumps({"import_seconds": import_bound(args, Path(d), str(Path(d) / "tokens.bin"))}), flush=True)
        finally:
            shutil.rmtree(d, ignore_errors=True)
    rows = []
    for i in range(args.rounds):
        d = tempfile.mkdtemp(prefix="netbench", dir=args.workdir)
        try:
            data = Path(d) / "tokens.bin"
            from elastic_trainer.worker.tokens import build_token_file, default_demo_texts

            build_token_file(default_demo_texts(1 << 20), str(data))
            r = one_round(args, Path(d), str(data), first=i == 0)
        finally:
            if not args.keep:
                shutil.rmtree(d, ignore_errors=True)
        print(json.dumps({"round": i, **r}), flush=True)
        rows.append(r)
    med = {m: statistics.median([r[m] for r in rows if r.get(m) is not None] or [float("nan")]) for m in MEASURES}
    print("| " + " | ".join(f"{m} (s)" for m in MEASURES) + " |")
    print("|" + "---|" * len(MEASURES))
    print("| " + " | ".join(f"{med[m]:.1f}" for m in MEASURES) + " |")
    print(json.dumps({"loadavg_end": loadavg()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
