"""Faults real networks make, on a virtual cluster of network namespaces (tests/fixtures/netcluster.py).

Two one-worker nodes of the demo config, each in its own network namespace with its own address,
the rendezvous store in a third; ``--local-addr`` and ``GLOO_SOCKET_IFNAME`` as on a cluster.

* ``test_link_cut_mid_step_then_back``: node ``a`` (rank 0, the committer) has its link cut while
  its processes keep running — a silent node: no reset, no FIN. The survivor trains at world 1
  within 10 s (``hang_timeout_seconds`` left at the demo's 60 s: liveness, not the watchdog), the
  cut-off node's workers are stopped before the survivor's new group exists and nothing it did
  after the cut committed; its link comes back, it rejoins (grow), and every loss of the job
  matches an uninterrupted world-2 run within 1e-5.
* ``test_faults_and_teardown``: each fault does what it says, and nothing is left behind.
* soak: ``test_packet_loss_no_false_node_loss`` (2 % random loss on every host and links limited
  to 300 Mbit/s for a whole run: no restart, no node_lost), ``test_store_partition_then_heal``,
  ``test_slow_lossy_object_store`` (checkpoints to S3 behind 3 MB/s with 5 % loss).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from elastic_trainer import exit_codes
from tests import runs
from tests.fixtures import s3 as s3fix
from tests.fixtures.netcluster import ClusterJob, NetCluster, start_s3, unavailable

pytestmark = pytest.mark.timing  # a tight wall-clock bound: run alone (scripts/pytest.sh)

DEMO = runs.REPO / "configs" / "demo-cpu.toml"
SCHEDULE_STEPS = 200  # train.steps (the lr schedule); both runs are stopped long before it
SHRINK_BOUND_S = 10.0


def demo_sets(run_dir: Path, token_file: str, steps: int = SCHEDULE_STEPS, backend: str = "c10d") -> list[str]:
    sets = [
        f"elastic.rdzv_backend={backend}",
        f"run.dir={run_dir}",
        f"checkpoint.dir={run_dir / 'ckpt'}",
        f"data.path={token_file}",
        f"train.steps={steps}",
    ]
    return [a for s in sets for a in ("--set", s)]


def reference_losses(tmp_path: Path, token_file: str, until: int) -> dict[int, float]:
    """The demo config uninterrupted at world 2 (one node, two workers), steps 1..``until``."""
    ref = tmp_path / "ref"
    proc = runs.start_launch(DEMO, *demo_sets(ref, token_file), log=tmp_path / "ref.log")
    try:
        runs.wait_event(ref, "step", 300, proc, where=lambda r: r["step"] >= until)
    finally:
        runs.stop(proc)
    return {s: loss for s, loss in runs.step_losses(ref).items() if s <= until}


def after(events: list[dict], t: float, name: str, **match) -> list[dict]:
    return [e for e in events if e["event"] == name and e["time"] > t and all(e.get(k) == v for k, v in match.items())]


def two_nodes(
    netcluster,
    token_file: str,
    tmp_path: Path,
    nnodes: str = "1:2",
    steps: int = SCHEDULE_STEPS,
    network=lambda cluster: None,
    backend: str = "c10d",
):
    """The store and nodes ``a`` (rank 0) and ``b`` running the demo, one worker each;
    ``network(cluster)`` runs before anything starts. Returns (cluster, job, run_dir, a, b)."""
    cluster = netcluster(["store", "a", "b"])
    network(cluster)
    run_dir = tmp_path / "run"
    job = ClusterJob(cluster, runs.CLI, DEMO, tmp_path, runs.env_for_tests(), runs.REPO, nnodes=nnodes)
    job.start_store()
    sets = demo_sets(run_dir, token_file, steps, backend)
    return cluster, job, run_dir, job.node("a", *sets), job.node("b", *sets)


def preempt(job: ClusterJob, a, b) -> None:
    """SIGTERM both supervisors: the workers commit the current step and both exit 75."""
    for p in (a, b):
        p.send_signal(signal.SIGTERM)
    assert b.wait(120) == exit_codes.PREEMPTED, job.log("b")
    assert a.wait(60) == exit_codes.PREEMPTED, job.log("a")


# torch's c10d rendezvous (one key holds every heartbeat) and the package's own (a key per node)
@pytest.mark.parametrize("backend", ["c10d", "elastic-trainer"])
def test_link_cut_mid_step_then_back(netcluster, token_file, tmp_path, backend):
    cluster, job, run_dir, a, b = two_nodes(netcluster, token_file, tmp_path, backend=backend)
    runs.wait_event(run_dir, "checkpoint_committed", 240, b, where=lambda r: r["step"] == 10)
    runs.wait_event(run_dir, "step", 60, b, where=lambda r: r["step"] >= 11 and r["world_size"] == 2)
    cut = time.time()
    cluster.link("a", up=False)  # a's processes keep running; nothing it sends arrives, nothing reaches it
    shrunk = runs.wait_event(run_dir, "step", 60, b, where=lambda r: r["world_size"] == 1 and r["time"] > cut)
    restored = time.time()
    cluster.link("a", up=True)
    grown = runs.wait_event(run_dir, "step", 90, b, where=lambda r: r["world_size"] == 2 and r["time"] > restored)
    runs.wait_event(run_dir, "step", 60, b, where=lambda r: r["step"] >= grown["step"] + 2)
    preempt(job, a, b)

    events = runs.read_events(run_dir)
    shrink_s = shrunk["time"] - cut
    print(
        f"\nnetcluster: link cut → first step at world 1 after {shrink_s:.1f}s; "
        f"link back → world 2 after {grown['time'] - restored:.1f}s"
    )
    assert shrink_s <= SHRINK_BOUND_S, f"first step at world 1 {shrink_s:.1f}s after the cut (bound {SHRINK_BOUND_S}s)"

    # Detected by liveness on both sides, as membership changes (no restart used up).
    [peer_lost] = after(events, cut, "node_lost", node="b")
    assert peer_lost["reason"] == "peer_lost" and peer_lost["lost"][0].startswith(cluster.addr("a") + "_"), peer_lost
    isolated = after(events, cut, "node_lost", node="a")
    # the default bound, 0.25 s × 8, then the contact watch's 0.2 s poll
    assert isolated and isolated[0]["reason"] == "isolated" and 2.0 <= isolated[0]["no_contact_seconds"] < 3, isolated
    restarts = after(events, cut, "restart")
    assert restarts and all(r["reason"] == "membership_change" and r["remaining_restarts"] == 3 for r in restarts), (
        restarts
    )

    # Fencing: the cut-off node's workers (rank 0, the committer) were stopped before the
    # survivor's new group started, and every commit after the cut is the new groups'.
    old_workers = [
        e["pids"] for e in events if e["event"] == "workers_started" and e["node"] == "a" and e["time"] < cut
    ][-1]
    assert isolated[0]["killed"] == old_workers, (isolated[0], old_workers)
    starts = after(events, cut, "start")
    assert isolated[0]["time"] < starts[0]["time"], "the cut-off node's workers still ran when the new group started"
    for c in after(events, cut, "checkpoint_committed"):
        gen = [s for s in starts if s["time"] < c["time"]]
        assert gen and gen[-1]["world_size"] == c["world_size"], f"commit {c} not made by a group started after the cut"

    # The loss curve continues through both reshards.
    losses = runs.step_losses(run_dir)
    last = max(losses)
    assert sorted(losses) == list(range(1, last + 1))
    reference = reference_losses(tmp_path, token_file, last)
    for step, ref in reference.items():
        assert runs.close_rel(losses[step], ref, 1e-5), f"step {step}: {losses[step]!r} vs reference {ref!r}"
    reshards = [(e["from_world_size"], e["to_world_size"]) for e in events if e["event"] == "reshard"]
    assert reshards == [(2, 1), (1, 2)], reshards


def _reaches(cluster: NetCluster, src: str, dst: str, port: int = 9) -> bool:
    """A TCP connect from ``src`` to ``dst``: refused (RST) counts as reachable, a timeout not."""
    code = (
        "import socket,sys\n"
        f"try: socket.create_connection(({cluster.addr(dst)!r}, {port}), timeout=0.5)\n"
        "except ConnectionRefusedError: sys.exit(0)\n"
        "except OSError: sys.exit(1)\n"
    )
    return cluster.exec(src, sys.executable, "-c", code, check=False).returncode == 0


def test_faults_and_teardown(tmp_path):
    """Each fault does what it says (silence: no answer at all, not even a reset; partition: only
    between the two), and the cluster leaves nothing behind, also when the test body fails."""
    reason = unavailable()
    if reason:
        pytest.skip(f"virtual cluster unavailable: {reason}")
    cluster = NetCluster(["store", "a", "b"], tag=f"et{os.getpid() % 100000}t")
    with pytest.raises(RuntimeError, match="test body failed"):
        with cluster:
            proc = cluster.popen("a", ["sleep", "300"], tmp_path / "sleep.log")
            assert _reaches(cluster, "a", "b") and _reaches(cluster, "a", "store")
            cluster.partition("a", "b")
            assert (
                not _reaches(cluster, "a", "b") and not _reaches(cluster, "b", "a") and _reaches(cluster, "a", "store")
            )
            cluster.heal()
            cluster.silence("b")
            assert not _reaches(cluster, "a", "b") and not _reaches(cluster, "store", "b")
            cluster.heal()
            cluster.link("b", up=False)
            assert not _reaches(cluster, "a", "b")
            cluster.link("b", up=True)
            cluster.rate_limit("b", 300)
            assert "tbf" in cluster.exec("b", "tc", "qdisc", "show", "dev", "eth0").stdout
            assert cluster.leftovers()
            raise RuntimeError("test body failed")
    assert cluster.leftovers() == []
    assert proc.wait(5) is not None  # killed with its namespace


@pytest.mark.soak
def test_packet_loss_no_false_node_loss(netcluster, token_file, tmp_path):
    steps = 150

    def lossy(cluster):
        cluster.packet_loss(2)
        for name in ("a", "b"):
            cluster.rate_limit(name, 300)

    cluster, job, run_dir, a, b = two_nodes(netcluster, token_file, tmp_path, nnodes="2:2", steps=steps, network=lossy)
    assert b.wait(900) == 0, job.log("b")
    assert a.wait(60) == 0, job.log("a")
    events = runs.read_events(run_dir)
    assert not [e for e in events if e["event"] in ("restart", "node_lost")]
    assert sorted(runs.step_losses(run_dir)) == list(range(1, steps + 1))


@pytest.mark.soak
def test_store_partition_then_heal(netcluster, token_file, tmp_path):
    """The store host unreachable for longer than the liveness bound: every node stops its own
    workers (none can tell a dead store from being cut off itself), so no group trains on; once
    the store is back, the nodes re-form and resume from the newest commit."""
    cluster, job, run_dir, a, b = two_nodes(netcluster, token_file, tmp_path)
    runs.wait_event(run_dir, "checkpoint_committed", 240, b, where=lambda r: r["step"] == 10)
    cut = time.time()
    cluster.silence("store")
    for node in ("a", "b"):
        runs.wait_event(run_dir, "node_lost", 30, b, where=lambda r, node=node: r["node"] == node and r["time"] > cut)
    quiet_from = time.time()
    time.sleep(5)
    healed = time.time()
    cluster.heal("store")
    resumed = runs.wait_event(run_dir, "step", 120, b, where=lambda r: r["world_size"] == 2 and r["time"] > healed)
    preempt(job, a, b)

    events = runs.read_events(run_dir)
    assert not [e for e in events if e["event"] == "step" and quiet_from < e["time"] < healed], (
        "a group trained while the store was unreachable"
    )
    newest = max(e["step"] for e in events if e["event"] == "checkpoint_committed" and e["time"] < healed)
    [resume] = [e for e in events if e["event"] == "resume" and e["time"] > healed][:1]
    assert resume["step"] == newest and resumed["step"] == newest + 1, (resume, newest)
    assert all(r["reason"] == "membership_change" for r in after(events, cut, "restart"))


@pytest.mark.soak
def test_slow_lossy_object_store(netcluster, token_file, tmp_path):
    """Checkpoints go to an S3 server (SeaweedFS) behind a 24 Mbit/s (3 MB/s) link with 5 %
    packet loss: saves take long, but they commit, no healthy worker is taken for hung (storage
    time is bounded by the save deadline, not the hang watchdog), and training goes on."""
    if s3fix.weed_binary() is None:
        pytest.skip("SeaweedFS `weed` binary not installed")
    cluster = netcluster(["store", "a", "b", "s3"])
    s3 = start_s3(cluster, "s3", tmp_path / "seaweedfs", client="a")
    cluster.rate_limit("s3", 24)
    cluster.packet_loss(5, ["s3"])

    run_dir = tmp_path / "run"
    job = ClusterJob(cluster, runs.CLI, DEMO, tmp_path, runs.env_for_tests(s3.env), runs.REPO, nnodes="2:2")
    job.start_store()
    sets = demo_sets(run_dir, token_file, steps=60) + [
        "--set",
        "checkpoint.dir=s3://ckpt/run",
        "--set",
        f"checkpoint.s3_endpoint_url={s3.endpoint}",
    ]
    a, b = job.node("a", *sets), job.node("b", *sets)
    assert b.wait(600) == 0, job.log("b")
    assert a.wait(60) == 0, job.log("a")
    events = runs.read_events(run_dir)
    assert not [e for e in events if e["event"] in ("restart", "node_lost")]
    commits = [e for e in events if e["event"] == "checkpoint_committed"]
    assert commits and commits[-1]["step"] == 60, commits
    assert sorted(runs.step_losses(run_dir)) == list(range(1, 61))
    print(f"\nslow object store: {len(commits)} commits, save seconds {[c['seconds'] for c in commits]}")
