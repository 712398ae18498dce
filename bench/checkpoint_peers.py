"""Peer checkpoint libraries driven through our training step, for ``bench/checkpoint_stall.py --peer``.

Each peer is wrapped in the surface of our ``CheckpointManager`` that ``Trainer.train`` and the
benchmark's blocks use (:class:`PeerManager`): ``save`` (timed as waiting for the previous save +
the save call), ``wait_for_staging`` (before the optimizer step), ``finish`` (until durable) and
``durable(step)``, what "durable" means for that library (``DURABLE``). Where a peer cannot run as
shipped on CPU, the smallest shim is applied and named in ``SHIMS`` (printed with the results).

Every peer is installed from its own pinned requirements file (``bench/requirements-<peer>.txt``,
with ``bench/constraints-torchtitan.txt`` keeping the CPU torch); they coexist in the bench venv,
so one invocation runs them all interleaved with ours under the same load.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
import types

# --peer name -> the B-block variants it adds (torchtitan: its two async paths)
PEER_MODES = {
    "torchtitan": ["torchtitan-async", "torchtitan-pinned-cpu"],
    "torch-checkpointing": ["torch-checkpointing"],
    "lm-resiliency": ["lm-resiliency"],
    "dlrover": ["dlrover"],
}
# a single variant may be named too (``--peer torchtitan-async``)
PEER_MODES.update({m: [m] for modes in list(PEER_MODES.values()) for m in modes if m not in PEER_MODES})
PEER_IMPORTS = {
    "torchtitan": "torchtitan",
    "torch-checkpointing": "torch_checkpointing",
    "lm-resiliency": "lm_resiliency",
    "dlrover": "dlrover",
}

DURABLE = {
    "thread": "rank 0 committed the step (manifest written after every rank's XXH3-checksummed, fsynced "
    "shards were proven complete): last_committed_step == step",
    "torchtitan-async": "dcp.async_save's future done (every rank's files + .metadata written, fsynced)",
    "torchtitan-pinned-cpu": "dcp.async_save's future done (saver process wrote and fsynced the files + .metadata)",
    "torch-checkpointing": "save()'s write future done: rank 0 renamed the temp dir onto the final path "
    "after the cross-rank barrier (no fsync anywhere in the library)",
    "lm-resiliency": "the peer rank's memory holds this rank's shard (host copy done, gloo send/recv "
    "to the replication peer finished)",
    "dlrover": "its commit: every shard persisted from shared memory by the forked saver (fsynced), "
    "done-files counted, tracker file dlrover_latest.txt == step and the done dir removed",
}

SHIMS = {
    "torchtitan-pinned-cpu": "DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=True, "
    "use_async_staging=True, use_non_blocking_copy=False)) pre-set: its own options need CUDA",
    "torch-checkpointing": "(1) DefaultMetadataManager._all_gather_pickled_data replaced by dist.all_gather_object "
    "(the shipped one builds CUDA tensors for the cross-rank gather); (2) "
    "LocalFileSystemStorageConfig(use_direct_io=False) (its O_DIRECT torch.save writes fail on ext4); "
    "(3) CheckpointStagerConfig(use_pinned_memory=False) (pinned memory needs CUDA); (4) DefaultResharder "
    "for torchtitan's DTensorResharder, which 0.1.1 does not ship",
    "lm-resiliency": "pin_memory=False (pinned memory needs CUDA), replication_jump=1 (its -1 auto = CUDA "
    "device count), disk_flush_interval=0 (the in-memory tier only); save_tensors() with local shards "
    "(its FSDP2 path); on CPU its 'async' host copy runs inside save() on the training thread",
    "dlrover": "the engine's CheckpointConfig gets rank=<this rank> (as shipped, FsdpCheckpointEngine "
    "names every rank's done-file '0', so with 2 ranks its commit never completes and times out after "
    "save_timeout); LOCAL_WORLD_SIZE=2 set (dlrover-run would)",
}


def missing_peers(peers: list[str]) -> list[str]:
    """The peers (as named on --peer) whose package is not importable here."""
    return [p for p in peers if importlib.util.find_spec(PEER_IMPORTS[_package(p)]) is None]


def _package(peer: str) -> str:
    return next(p for p in PEER_IMPORTS if peer == p or peer.startswith(p + "-"))


def install_hint(peer: str) -> str:
    pkg = _package(peer)
    return (
        f"--peer {peer}: {PEER_IMPORTS[pkg]} is not importable with this python. Create the bench venv "
        "(never the project's):\n"
        "  python -m venv .bench-venv && .bench-venv/bin/pip install torch==2.13.0\n"
        f"  .bench-venv/bin/pip install -r bench/requirements-{pkg}.txt -c bench/constraints-torchtitan.txt\n"
        "  .bench-venv/bin/pip install -e .\n"
        "then run the benchmark with .bench-venv/bin/python"
    )


def tree_cpu_seconds() -> float:
    """User + system CPU of this process and every live descendant (saver processes included)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [os.getpid()]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def watch_durable(probe, t0: float, marks: dict) -> tuple[threading.Thread, threading.Event]:
    """Poll ``probe()`` every 20 ms on a thread; the first time it holds, ``marks["durable"]``."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            if probe():
                marks["durable"] = time.monotonic() - t0
                return
            stop.wait(0.02)

    t = threading.Thread(target=run, daemon=True, name="bench-durable-watch")
    t.start()
    return t, stop


class _NoFaults:
    """The manager's ``fault_hooks`` (fault injection only): none in the benchmark."""

    def inject_local_faults(self, step: int) -> None:
        pass

    def commit_visible(self, step: int) -> bool:
        return False


class PeerManager:
    """The surface of our ``CheckpointManager`` that ``Trainer.train`` and the blocks use, over a
    peer library. Subclasses implement ``_wait_previous``, ``_start``, ``_wait_staged``,
    ``_finish``, ``durable`` and ``close``."""

    fenced = None
    save_in_progress = False
    fault_hooks = _NoFaults()

    def __init__(self) -> None:
        self._inflight = None
        self._stats = None

    def votes(self):
        from elastic_trainer.checkpoint.agreement import SaveVotes

        return SaveVotes()

    def agreed(self, votes) -> None:
        pass

    def drain_after_failure(self) -> bool:
        return True

    def save(self, step: int, **_kw):
        from elastic_trainer.checkpoint.manager import SaveStats

        st = self._stats = SaveStats(step)
        t0 = time.monotonic()
        self._wait_previous()
        st.wait_previous = time.monotonic() - t0
        t1 = time.monotonic()
        st.skipped = self._start(step) or ""
        st.call = time.monotonic() - t1
        self._inflight = types.SimpleNamespace(stagings=[], written=None)
        return st

    def wait_for_staging(self) -> float:
        t0 = time.monotonic()
        self._wait_staged()
        waited = time.monotonic() - t0
        if self._stats is not None:
            self._stats.staging_wait += waited
        return waited

    def finish(self, timeout=None) -> bool:
        self._finish()
        self._inflight = None
        return True

    def _wait_previous(self) -> None:
        pass

    def _wait_staged(self) -> None:
        pass


class TitanPeer(PeerManager):
    """torchtitan's DCP ``CheckpointManager``: ``save`` = its ``maybe_wait_for_saving`` (timed as
    waiting for the previous save) + its ``save``; ``wait_for_staging`` = its
    ``maybe_wait_for_staging``; ``finish`` = its ``maybe_wait_for_saving``."""

    def __init__(self, mgr):
        super().__init__()
        self.mgr = mgr
        self._future = None

    def _wait_previous(self) -> None:
        self.mgr.maybe_wait_for_saving()

    def _start(self, step: int) -> None:
        self.mgr.save(step)
        self._future = self.mgr.save_future

    def save(self, step: int, **kw):
        st = super().save(step, **kw)
        self._inflight = types.SimpleNamespace(stagings=[self.mgr.staging_future], written=self._future)
        return st

    def _wait_staged(self) -> None:
        if self.mgr.staging_future is not None:
            self.mgr.maybe_wait_for_staging()

    def durable(self, step: int) -> bool:
        return self._future is None or self._future.done()

    def _finish(self) -> None:
        self.mgr.maybe_wait_for_saving()

    def close(self) -> None:
        self.mgr.close()


def titan_manager(mode: str, work: str, model, states: dict) -> TitanPeer:
    """torchtitan's DCP ``CheckpointManager`` over the same model, optimizer and scheduler.

    * ``torchtitan-async``: its ``async_mode="async"`` (``dcp.async_save`` THREAD mode on its own
      gloo group, staging on the caller's thread);
    * ``torchtitan-pinned-cpu``: its ``async_mode="async_with_pinned_mem"`` path (PROCESS mode +
      ``DefaultStager``) with the stager built for CPU (``SHIMS``).

    Its storage writer is DCP's default ``FileSystemWriter`` (torch.save's CRC32s on, no checksums).
    """
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torchtitan.components.checkpointer.dcp import CheckpointManager as TitanCheckpointManager

    async_mode = {"torchtitan-async": "async", "torchtitan-pinned-cpu": "async_with_pinned_mem"}[mode]
    cfg = TitanCheckpointManager.Config(enable=True, folder=mode, interval=1, keep_latest_k=2, async_mode=async_mode)
    mgr = TitanCheckpointManager(
        cfg,
        dataloader=states["train"],
        model_parts=[model],
        optimizers=states["optim"],
        lr_schedulers=states["lr_scheduler"],
        states={"rng": states["rng"]},
        sd_adapter=None,
        base_folder=work,
    )
    if async_mode == "async_with_pinned_mem":
        mgr.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=False, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=False
            )
        )
    return TitanPeer(mgr)


def _all_gather_pickled_cpu(self, data, process_group=None) -> dict:
    """Shim for ``DefaultMetadataManager._all_gather_pickled_data``: the same gather of every
    rank's picklable metadata, without the CUDA tensors."""
    import torch.distributed as dist

    out: list = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(out, data, group=process_group)
    return dict(enumerate(out))


class TorchCheckpointingPeer(PeerManager):
    """torch-checkpointing's ``CheckpointManager`` in torchtitan's configuration for it
    (``torchtitan/components/checkpointer/torch_checkpointing.py``: model and optimizer copied
    and resharded, the rest written as is, async saver, TCPStore barrier on port 43001),
    adapted to CPU as ``SHIMS`` says. ``save(path, payload)`` waits for the previous write inside;
    the staging wait is its ``lock()`` (what ``with manager.lock(): optimizer.step()`` waits for)."""

    def __init__(self, work: str, states: dict):
        super().__init__()
        from torch_checkpointing import CheckpointManager, ItemSpec
        from torch_checkpointing.barriers import TCPStoreBarrierConfig
        from torch_checkpointing.checkpoint_writer import CheckpointWriterConfig
        from torch_checkpointing.config import AsyncCheckpointSaverConfig
        from torch_checkpointing.default_resharder import DefaultResharder
        from torch_checkpointing.metadata_manager import DefaultMetadataManager
        from torch_checkpointing.staging import CheckpointStagerConfig
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        DefaultMetadataManager._all_gather_pickled_data = _all_gather_pickled_cpu  # noqa: SLF001 - shim (1)
        resharder = DefaultResharder()
        copied = ItemSpec(requires_copy=True, resharder=resharder, required=False)
        save = AsyncCheckpointSaverConfig(
            writer_config=CheckpointWriterConfig(
                checkpoint_write_barrier_timeout_sec=600,
                barrier_config=TCPStoreBarrierConfig(
                    master_address=os.environ.get("MASTER_ADDR", "localhost"),
                    tcpstore_port=43001,
                    timeout_barrier_init_sec=60,
                    use_checkpoint_barrier_tcpstore_libuv=True,
                ),
            ),
            staging_config=CheckpointStagerConfig(use_pinned_memory=False, use_non_blocking_copy=False),
            wait_timeout_secs=600,
        )
        self.mgr = CheckpointManager.Config(
            items={"model": copied, "optimizer": copied},
            default=ItemSpec(requires_copy=False),
            save=save,
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        ).build()
        self.states = states
        self.dir = os.path.join(work, "torch-checkpointing")
        self._write = None

    def _wait_previous(self) -> None:
        if self._write is not None:
            self._write.result()

    def _start(self, step: int) -> None:
        s = self.states
        payload = {
            "model": s["model"].state_dict(),
            "optimizer": s["optim"].state_dict(),
            "lr_scheduler": s["lr_scheduler"].state_dict(),
            "dataloader": s["train"].state_dict(),
            "rng": s["rng"].state_dict(),
        }
        self._write = self.mgr.save(os.path.join(self.dir, f"step-{step}"), payload)

    def _wait_staged(self) -> None:
        with self.mgr.lock():
            pass

    def durable(self, step: int) -> bool:
        return self._write is None or self._write.done()

    def _finish(self) -> None:
        if self._write is not None:
            self._write.result()

    def close(self) -> None:
        self.mgr.close()


class LmResiliencyPeer(PeerManager):
    """lm-resiliency's GEMINI ``InMemoryCheckpointManager``: ``save_tensors`` after the optimizer
    step (its FSDP2 path: local shards of the parameters and AdamW moments), host copy, then the
    shard exchanged with the replication peer over gloo in the background; ``maybe_wait`` before
    the next optimizer step; ``finalize_replication`` to finish."""

    def __init__(self, work: str, model, optimizer, world: int, every: int):
        super().__init__()
        from lm_resiliency import InMemoryCkptConfig
        from lm_resiliency.checkpointing import InMemoryCheckpointManager

        cfg = InMemoryCkptConfig(
            interval=every,
            replication_jump=1,
            disk_flush_interval=0,
            disk_folder=os.path.join(work, "lm-resiliency"),
            run_id="bench",
            pin_memory=False,
        )
        fsdp = types.SimpleNamespace(dp_replicate=1, dp_shard=world)
        self.mgr = InMemoryCheckpointManager(cfg, parallelism_info=fsdp)
        self.model, self.optimizer = model, optimizer

    def _tensors(self) -> list:
        from torch.distributed.tensor import DTensor

        local = [p.to_local() if isinstance(p, DTensor) else p for p in self.model.parameters()]
        for st in self.optimizer.state.values():
            local += [st[k].to_local() if isinstance(st[k], DTensor) else st[k] for k in ("exp_avg", "exp_avg_sq")]
        return [t.detach() for t in local]

    def _start(self, step: int) -> None:
        self.mgr.save_tensors(self._tensors(), step)

    def _wait_staged(self) -> None:
        self.mgr.maybe_wait()

    def durable(self, step: int) -> bool:
        m = self.mgr
        t = m._completion_thread  # noqa: SLF001 - the host copy's thread: done before the exchange starts
        return (t is None or not t.is_alive()) and not m._replicator.in_flight  # noqa: SLF001 - the exchange

    def _finish(self) -> None:
        self.mgr.finalize_replication()

    def close(self) -> None:
        self.mgr.close()


class DlroverPeer(PeerManager):
    """DLRover Flash Checkpoint's ``FsdpCheckpointEngine`` (its engine API for FSDP/DCP):
    ``save_to_storage(step, state_dict, paths)`` = ``dcp.save`` into shared memory on the training
    thread + barrier + an event to the saver process (forked by local rank 0, as without
    ``dlrover-run``), which persists every shard, counts done-files and commits."""

    def __init__(self, work: str, states: dict, rank: int, world: int):
        super().__init__()
        os.environ["LOCAL_WORLD_SIZE"] = str(world)  # dlrover-run exports it; the harness does not
        import functools

        from dlrover.python.common.storage import PosixDiskStorage
        from dlrover.python.elastic_agent.torch.ckpt_saver import CheckpointConfig
        from dlrover.trainer.torch.flash_checkpoint import fsdp_engine

        fsdp_engine.CheckpointConfig = functools.partial(CheckpointConfig, rank=rank)  # shim: done-file per rank
        self.dir = os.path.join(work, "dlrover")
        self.engine = fsdp_engine.FsdpCheckpointEngine(self.dir, PosixDiskStorage())
        self.states = states

    def _start(self, step: int) -> str:
        s = self.states
        sd = {"model": s["model"].state_dict(), "optim": s["optim"].state_dict()}
        sd["extra"] = {"lr_scheduler": s["lr_scheduler"].state_dict(), "train": s["train"].state_dict()}
        self.engine.save_to_storage(step, sd, {"model_states": os.path.join(self.dir, str(step))})
        return "" if self.engine.latest_step == step else "saver busy persisting"

    def durable(self, step: int) -> bool:
        try:
            with open(os.path.join(self.dir, "dlrover_latest.txt")) as f:
                latest = f.read().strip()
        except FileNotFoundError:
            return False
        done_dir = os.path.join(self.dir, "._dlrover_ckpt_stage", f"{step}.done")
        return latest == str(step) and not os.path.exists(done_dir)

    def _finish(self) -> None:
        step = self._stats.step if self._stats is not None else None
        deadline = time.monotonic() + 120
        while step is not None and not self._stats.skipped and not self.durable(step):
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)

    def close(self) -> None:
        self.engine.close()
