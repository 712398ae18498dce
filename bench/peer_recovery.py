"""Recovery of a lost node's state from its peers' memory vs from slow object storage, side by side.

    python bench/peer_recovery.py [--config configs/demo-cpu.toml] [--repeats 1] [--variants off,on]
                                  [--cut-step 25] [--remote-every 10] [--interval 1] [--after 10]
                                  [--rate-mbit 24] [--set k=v ...] [--keep] [--smoke]

Needs root, iproute2 and nftables (scripts/system-deps.d/50-netns.sh) and SeaweedFS (``weed``,
from the test extras). Each run builds the namespace cluster of tests/fixtures/netcluster.py: the
rendezvous store, an S3 host (SeaweedFS behind a proxy that logs every request, its link limited
to ``--rate-mbit``, 24 Mbit/s = 3 MB/s) and nodes a, b, c with one worker each (``--nnodes 2:3``).
The job saves every ``--interval`` steps to each node's ``checkpoint.local_dir`` (its own
directory in /dev/shm) and every ``--remote-every``-th save to ``checkpoint.dir`` on S3, with the
checkpoint key set. At world 3, once a remote commit exists and the job reached ``--cut-step``,
node a's link is cut (its bridge-side veth down: silent), the survivors b and c re-form at world
2 and resume; the job runs ``--after`` steps more and is stopped. Per run it records:

* ``recovery_s``  the cut → the survivors' first step at world 2 (``step`` event time − the cut),
  and its phases: ``detect_s`` (a survivor's ``node_lost``), ``start_s`` (the world-2 group's
  ``start``), ``resume_s`` (its ``resume``), ``restore_s`` (start → resume: what the tier
  changes), ``load_s`` (the resume event's load time);
* ``resumed_step`` vs ``newest_local_step`` (the newest in-memory save before the cut, rank 0's
  ``checkpoint_local_saved``) and ``newest_remote_step`` (``checkpoint_committed``); ``tier``:
  the resume event's tier field(s);
* ``gets``: the GET requests the S3 server received between the cut and that first step for
  objects under this run's ``checkpoint.dir`` (``gets_data``: the ``.distcp`` shards among them;
  the rest are manifests, metadata, the lineage's epoch files), ``lists``: the bucket listings,
  ``heads``: HEAD requests (``gets_before_cut``: the GETs from the job's start to the cut);
  ``s3_sent_mb``: what the S3 host sent on its link from the cut until the first step was seen
  (the bytes read back, polled: a few hundred ms after the step at most) vs ``checkpoint_mb``, the
  size of a commit;
* ``max_rel_diff``: the losses of the steps after the resume vs an uninterrupted run of the same
  training config (one launch of two workers on this machine, run once per invocation). The
  global batch and data order are world-size invariant, so a world-2 reference compares with the
  world-3 steps before the cut (``max_rel_diff_before``) and the world-2 steps after the resume.

Variants, alternated in each repeat: ``off`` (``checkpoint.peer_replicas=0``: the survivors read
``checkpoint.dir``) and ``on`` (the peer tier at its default). A build without the peer tier
(no ``checkpoint.peer_replicas`` key) runs ``off`` only and says so. Prints one JSON line per
run, then a Markdown table of the medians per variant and the ratios on/off. ``--smoke``: a tiny
model and an early cut, one repeat (checks that the script runs; minutes, not a figure).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO, TINY_DEMO, loadavg, machine_info, median, parse_with_smoke, table
from tests import runs
from tests.fixtures import netcluster
from tests.fixtures import s3 as s3fix

NODES = ("a", "b", "c")
KEY = "peer-recovery-bench-key"
BUCKET = "ckpt"


def peer_tier_available() -> bool:
    from elastic_trainer.config import CheckpointConfig

    return "peer_replicas" in {f.name for f in dataclasses.fields(CheckpointConfig)}


def _pairs(sets: list[str]) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


def _training_sets(args, run_dir: Path, data: str) -> list[str]:
    """What defines the training (identical in the cluster runs and the reference)."""
    return [f"run.dir={run_dir}", f"data.path={data}", f"train.steps={args.steps}", *args.set]


def classify(requests: list[dict], t0: float, t1: float, prefix: str) -> dict:
    """The S3 requests received in [t0, t1]: GETs of objects under ``prefix`` (``gets``; the
    ``.distcp`` shards among them: ``gets_data``; per kind of object: ``got``), listings of the
    bucket (``lists``), HEADs."""
    out: dict = {"gets": 0, "gets_data": 0, "lists": 0, "heads": 0}
    got: Counter[str] = Counter()
    for r in requests:
        if not t0 <= r["time"] <= t1:
            continue
        path = urlsplit(r["target"]).path.strip("/")
        obj, bucket = path.startswith(prefix + "/"), path == BUCKET
        if r["method"] == "GET" and obj:
            out["gets"] += 1
            out["gets_data"] += path.endswith(".distcp")
            kind = re.sub(r"step-\d+", "step-*", path[len(prefix) + 1 :])
            got[kind.split("/")[0] + "/*" if kind.startswith("_") else kind] += 1
        elif r["method"] == "GET" and bucket:
            out["lists"] += 1
        elif r["method"] == "HEAD" and (obj or bucket):
            out["heads"] += 1
    out["got"] = dict(sorted(got.items()))
    return out


def _first(events: list[dict], name: str, after: float, **match) -> dict | None:
    return next(
        (
            e
            for e in events
            if e["event"] == name and e["time"] > after and all(e.get(k) == v for k, v in match.items())
        ),
        None,
    )


def one_run(args, variant: str, work: Path, data: str, peer: bool) -> dict:
    run_dir = work / "run"
    tag = f"etp{os.getpid() % 100000}"
    local = {n: Path(f"/dev/shm/{tag}-{variant}-{n}") for n in NODES}
    prefix = f"{BUCKET}/{variant}"
    try:
        with netcluster.NetCluster(["store", "s3", *NODES], tag=tag) as cluster:
            s3 = netcluster.start_s3(cluster, "s3", work / "s3", client="a", bucket=BUCKET, count_requests=True)
            cluster.rate_limit("s3", args.rate_mbit)
            ckpt = [
                f"checkpoint.dir=s3://{prefix}",
                f"checkpoint.s3_endpoint_url={s3.endpoint}",
                f"checkpoint.interval_steps={args.interval}",
                f"checkpoint.remote_every={args.remote_every}",
            ]
            if peer and variant == "off":
                ckpt.append("checkpoint.peer_replicas=0")
            env = runs.env_for_tests({**s3.env, "ELASTIC_TRAINER_CHECKPOINT_KEY": KEY})
            cfg = work / "job.toml"
            cfg.write_text(Path(args.config).read_text())
            job = netcluster.ClusterJob(cluster, runs.CLI, cfg, work, env, runs.REPO, nnodes="2:3", run_id=tag)
            job.start_store()
            sets = _pairs([*_training_sets(args, run_dir, data), *ckpt])
            for n in NODES:
                job.node(n, *sets, "--set", f"checkpoint.local_dir={local[n]}")
            b = job.nodes["b"]
            runs.wait_event(run_dir, "checkpoint_committed", 600, b)
            runs.wait_event(
                run_dir, "step", 600, b, where=lambda r: r["world_size"] == 3 and r["step"] >= args.cut_step
            )
            sent = cluster.sent_bytes("s3")
            cut = time.time()
            cluster.link("a", up=False)
            first = runs.wait_event(run_dir, "step", 300, b, where=lambda r: r["world_size"] == 2 and r["time"] > cut)
            sent = cluster.sent_bytes("s3") - sent
            runs.wait_event(run_dir, "step", 300, b, where=lambda r: r["step"] >= first["step"] + args.after)
            requests = s3.requests()
    finally:  # after the cluster's teardown: its processes write local copies until they are killed
        for d in local.values():
            shutil.rmtree(d, ignore_errors=True)
    events = runs.read_events(run_dir)
    before = [e for e in events if e["time"] < cut]
    resume = _first(events, "resume", cut, world_size=2) or {}
    lost = next((e for e in events if e["event"] == "node_lost" and e["time"] > cut and e["node"] != "a"), None)
    start = _first(events, "start", cut, world_size=2)
    out = {
        "variant": variant,
        "recovery_s": first["time"] - cut,
        "detect_s": lost["time"] - cut if lost else None,
        "start_s": start["time"] - cut if start else None,
        "resume_s": resume["time"] - cut if resume else None,
        "restore_s": resume["time"] - start["time"] if resume and start else None,
        "load_s": resume.get("load_seconds"),
        "cut_at_step": max(e["step"] for e in before if e["event"] == "step"),
        "newest_local_step": max((e["step"] for e in before if e["event"] == "checkpoint_local_saved"), default=None),
        "newest_remote_step": max((e["step"] for e in before if e["event"] == "checkpoint_committed"), default=None),
        "resumed_step": resume.get("step"),
        "tier": {k: v for k, v in resume.items() if "tier" in k},
        **classify(requests, cut, first["time"], prefix),
        "gets_before_cut": classify(requests, 0, cut, prefix)["gets"],
        "s3_sent_mb": sent / 1e6,
        "checkpoint_mb": max((e["bytes"] for e in before if e["event"] == "checkpoint_committed"), default=0) / 1e6,
        "losses": {
            "before": {e["step"]: e["loss"] for e in before if e["event"] == "step"},
            "after": {e["step"]: e["loss"] for e in events if e["event"] == "step" and e["time"] >= first["time"]},
        },
    }
    return out


def reference_losses(args, work: Path, data: str, until: int) -> dict[int, float]:
    """The same training config uninterrupted: one launch of two workers (world 2) on this machine."""
    run_dir = work / "ref"
    sets = [*_training_sets(args, run_dir, data), f"checkpoint.dir={work / 'ref-ckpt'}", "checkpoint.interval_steps=0"]
    sets = _pairs(sets)  # no saves: nothing writes after it is stopped
    cfg = work / "ref.toml"
    cfg.write_text(Path(args.config).read_text())
    proc = runs.start_launch(cfg, *sets, "--nproc-per-node", "2", log=work / "ref.log")
    try:
        runs.wait_event(run_dir, "step", 900, proc, where=lambda r: r["step"] >= until)
    finally:
        runs.stop(proc)
    return runs.step_losses(run_dir)


def max_rel(losses: dict[int, float], ref: dict[int, float]) -> float | None:
    diffs = [abs(v - ref[s]) / max(abs(ref[s]), 1e-12) for s, v in losses.items() if s in ref]
    return max(diffs) if diffs else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs" / "demo-cpu.toml"))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--variants", default="off,on", help="off: checkpoint.peer_replicas=0; on: the peer tier's default")
    p.add_argument("--steps", type=int, default=300, help="train.steps (the lr schedule; the job is stopped earlier)")
    p.add_argument("--cut-step", type=int, default=25, help="cut node a's link once the job trained this many steps")
    p.add_argument("--remote-every", type=int, default=10, help="checkpoint.remote_every")
    p.add_argument("--interval", type=int, default=1, help="checkpoint.interval_steps (the in-memory cadence)")
    p.add_argument("--after", type=int, default=10, help="steps trained after the resume (compared with the reference)")
    p.add_argument("--rate-mbit", type=float, default=24, help="the S3 host's link, Mbit/s (24 = 3 MB/s)")
    p.add_argument("--set", action="append", default=[], help="config override for every run and the reference")
    p.add_argument("--workdir", default=None, help="where the scratch directories go (kept with --keep)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directories (logs, events, request logs)")
    args = parse_with_smoke(
        p,
        [*TINY_DEMO, "--set", "checkpoint.interval_steps=1", "--cut-step", "8", "--remote-every", "4", "--after", "3"],
    )
    reason = netcluster.unavailable() or (None if s3fix.weed_binary() else "SeaweedFS `weed` binary not installed")
    if reason:
        print(f"virtual cluster unavailable: {reason}", file=sys.stderr)
        return 0 if args.smoke else 2
    peer = peer_tier_available()
    variants = [v for v in args.variants.split(",") if v]
    if not set(variants) <= {"off", "on"}:
        p.error(f"--variants: off and/or on, got {args.variants!r}")
    if "on" in variants and not peer:
        print(json.dumps({"skipped": "on", "reason": "this build has no peer tier (checkpoint.peer_replicas)"}))
        variants.remove("on")
    print(json.dumps({"machine": machine_info(), "loadavg": loadavg(), "args": vars(args), "peer_tier": peer}))
    scratch = Path(tempfile.mkdtemp(prefix="peerbench", dir=args.workdir))
    rows: list[dict] = []
    try:
        from elastic_trainer.worker.tokens import build_token_file, default_demo_texts

        data = scratch / "tokens.bin"
        build_token_file(default_demo_texts(1 << 20), str(data))
        for i in range(1 if args.smoke else args.repeats):
            for variant in variants if i % 2 == 0 else variants[::-1]:
                work = scratch / f"{variant}{i}"
                work.mkdir()
                r = one_run(args, variant, work, str(data), peer)
                rows.append({"repeat": i, **r, "loadavg": loadavg()})
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "losses"}, default=str), flush=True)
        until = max(max(r["losses"]["after"]) for r in rows)
        ref = reference_losses(args, scratch, str(data), until)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
        else:
            print(json.dumps({"kept": str(scratch)}))
    for r in rows:
        r["max_rel_diff_before"] = max_rel(r["losses"]["before"], ref)
        r["max_rel_diff"] = max_rel(r["losses"]["after"], ref)
        print(
            json.dumps(
                {
                    "repeat": r["repeat"],
                    "variant": r["variant"],
                    **{k: r[k] for k in ("max_rel_diff_before", "max_rel_diff")},
                }
            )
        )
    print(summary(rows, variants))
    print(json.dumps({"loadavg_end": loadavg()}))
    return 0


COLUMNS = (
    "recovery_s",
    "detect_s",
    "start_s",
    "resume_s",
    "restore_s",
    "load_s",
    "gets",
    "gets_data",
    "lists",
    "s3_sent_mb",
    "max_rel_diff",
)


def summary(rows: list[dict], variants: list[str]) -> str:
    """Medians per variant, the steps each run resumed from, the objects read, and with both
    variants the on/off ratios and the issue's targets (recovery ratio ≤ 0.2, no GET of
    checkpoint.dir with the peer tier, losses within 1e-5)."""

    def med(v: str, k: str):
        xs = [r[k] for r in rows if r["variant"] == v and r[k] is not None]
        return median(xs) if xs else None

    def fmt(x) -> str:
        return "–" if x is None else (f"{x:.3g}" if isinstance(x, float) else str(x))

    body = []
    for v in variants:
        mine = [r for r in rows if r["variant"] == v]
        resumed = ", ".join(f"{r['resumed_step']}/{r['newest_local_step']}/{r['newest_remote_step']}" for r in mine)
        tiers = sorted({json.dumps(r["tier"], sort_keys=True) for r in mine})
        got = Counter()
        for r in mine:
            got |= Counter(r["got"])  # the most of each kind in one run
        got_text = ", ".join(f"{k} ×{n}" for k, n in sorted(got.items()))
        body.append([v, len(mine), *(fmt(med(v, k)) for k in COLUMNS), resumed, "; ".join(tiers), got_text])
    header = ["variant", "runs", *COLUMNS, "resumed / newest local / newest remote step", "resume tier", "GETs (most)"]
    out = table(header, body)
    if {"on", "off"} <= set(variants):
        ratios = {k: round(med("on", k) / med("off", k), 3) for k in ("recovery_s", "restore_s") if med("off", k)}
        on = [r for r in rows if r["variant"] == "on"]
        targets = {
            "recovery_ratio_le_0.2": ratios.get("recovery_s", 1) <= 0.2,
            "no_get_with_peer_tier": all(r["gets"] == 0 for r in on),
            "no_shard_get_with_peer_tier": all(r["gets_data"] == 0 for r in on),
            "losses_within_1e-5": all(r["max_rel_diff"] is not None and r["max_rel_diff"] <= 1e-5 for r in rows),
        }
        out += "\n\n" + json.dumps({"ratio_on_off": ratios, "targets": targets})
    return out


if __name__ == "__main__":
    raise SystemExit(main())
