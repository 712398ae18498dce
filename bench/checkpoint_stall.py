"""Training-loop stall per checkpoint: async save vs synchronous DCP vs full state dict.

    python bench/checkpoint_stall.py [--rounds 3] [--every 20] [--dim 768 --layers 13]
                                     [--seq-len 64 --global-batch 2] [--device cpu|cuda] [--json-out F]
                                     [--peer torchtitan,torch-checkpointing,lm-resiliency,dlrover]

One run, 2 gloo ranks in-process (``tests/dist/harness.py``, no elastic agent; ``--device cuda``:
NCCL, one GPU per rank, bf16 mixed precision, the stager copying into pinned host memory as the
worker's does). Each rank builds
the demo GPT exactly as ``elastic_trainer.worker.main`` does (FSDP2 over the mesh, deterministic
init, AdamW, LambdaLR, a separate gloo group for checkpoints, the real ``CheckpointManager`` and
``Trainer.train`` on the demo byte data), scaled up so that params + AdamW moments are
>= 1 GiB across the ranks. Checkpoints go to a local temp dir, removed at the end.

Measured per round, interleaved so every method sees the same machine load:

* ``A``  ``--every`` training steps, no checkpoint;
* ``B``  ``--every`` training steps with one async save after the first of them, as
  ``Trainer.run`` does it, then ``finish()`` (in steady state that wait is the next save's
  ``wait_previous``), so ``A/B`` is the throughput with a checkpoint every ``--every`` steps
  divided by the throughput without;
* (a) async stall = the time the training thread was blocked by that save: ``save()`` (waiting
  for the previous save + ``dcp.async_save`` returning) + ``wait_for_staging()`` before the next
  ``optimizer.step``;
* (b) synchronous ``dcp.save`` of the same ``Stateful`` objects with the project's storage
  writer as torch runs it (zip CRC32s on); (b') the same with the manager's writer (CRC32s off,
  see ``checkpoint.manager._without_crc32``), side by side;
* (c) ``get_state_dict(full_state_dict=True, cpu_offload=True)`` + ``torch.save`` (+ fsync,
  as DCP's writer fsyncs) on rank 0 + barrier;
* floor: one plain ``clone()`` of the rank's state (local param shards + ``exp_avg`` +
  ``exp_avg_sq``), both ranks at once (as staging runs on both); also ``copy_`` into
  preallocated buffers (what the stager does from the second save on, its buffers cached);
  and the write floor: each rank ``write()``s those bytes to one file beside the checkpoints
  and fsyncs it (wall, and the CPU time of the writing thread, kernel included: what any save
  of the state costs the machine at least, the write into the page cache); the XXH3 of those
  bytes (the checksum every save keeps); and their sum with the copy, *an async save's byte
  work*: on cores that training keeps busy, the least an overlapped save can cost the steps.

Every number per checkpoint is the slowest rank's (the step is collective). Prints a Markdown
table and the machine facts; ``--json-out`` keeps every sample.

``--peer torchtitan,torch-checkpointing,lm-resiliency,dlrover`` adds, per library, B blocks driven
by that library's manager over the same model, optimizer, ranks and disk (``bench/checkpoint_peers.py``;
each library from its own pinned ``bench/requirements-<peer>.txt``, installed into the bench venv;
a library that is not importable stops the run with the command that installs it). For ours and
every peer variant the side-by-side table gives: blocked per save; save call -> durable (polled
every 20 ms from the save call; what durable means for each is printed); throughput with a save
every ``--every`` steps / none; CPU per save (the save call's CPU on the training thread + what the
block's other threads and child processes used beyond the no-checkpoint block's, both ranks); and
the shims a peer needs on CPU, by name.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.checkpoint_peers import (
    DURABLE,
    PEER_MODES,
    SHIMS,
    install_hint,
    missing_peers,
    titan_manager,
    tree_cpu_seconds,
    watch_durable,
)
from bench.checkpoint_peers import PeerManager as _PeerManager
from bench.common import REPO, loadavg, machine_info, median, parse_with_smoke, table


def _rank_main(rank: int, world: int, o: dict) -> dict:
    import dataclasses

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import xxhash
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.tensor import DTensor

    from elastic_trainer.checkpoint import integrity
    from elastic_trainer.checkpoint.manager import CheckpointManager
    from elastic_trainer.checkpoint.savers import remote_saver
    from elastic_trainer.checkpoint.state import ModelState, OptimizerState, RNGState, SchedulerState
    from elastic_trainer.config import config_from_dict
    from elastic_trainer.events import EventLog
    from elastic_trainer.metrics.sink import NullSink
    from elastic_trainer.runtime import Checkpointer
    from elastic_trainer.runtime.session import PreemptionFlag, Session, init_distributed
    from elastic_trainer.storage.fs import Storage
    from elastic_trainer.worker import parallel
    from elastic_trainer.worker.main import build_training
    from elastic_trainer.worker.train_loop import Trainer

    work = o["work"]
    cfg = config_from_dict(
        {
            "run": {"dir": os.path.join(work, "run")},
            "model": {
                "vocab_size": 256,
                "seq_len": o["seq_len"],
                "dim": o["dim"],
                "n_layers": o["layers"],
                "n_heads": o["heads"],
                "mlp_ratio": 4,
            },
            "data": {"path": o["data"], "dtype": "uint16"},
            "train": {
                "steps": 1_000_000,
                "global_batch_size": o["global_batch"],
                "micro_batch_size": o["micro_batch"],
                "seed": 1234,
                "lr": 3e-4,
                "min_lr": 3e-5,
                "warmup_steps": 10,
                "log_every": 1_000_000,
                "device": o["device"],
                "mixed_precision": "bf16" if o["device"] == "cuda" else "fp32",
            },
            "checkpoint": {
                "dir": os.path.join(work, "ckpt"),
                "interval_steps": o["every"],
                "keep_last": 1,
                "mode": "async",
            },
        }
    )
    # --- exactly the worker's build (elastic_trainer/worker/main.py: build_and_train) -----------
    d = init_distributed(cfg.train, timeout_seconds=600)
    model, optimizer, scheduler, batches, state = build_training(cfg, d)
    storage = Storage.for_checkpoint(cfg.checkpoint)
    events = EventLog(os.path.join(work, "events.jsonl"), enabled=rank == 0)
    states = {
        "model": ModelState(model),
        "optim": OptimizerState(model, optimizer),
        "lr_scheduler": SchedulerState(scheduler),
        "train": state,
        "rng": RNGState(),
    }

    cuda = d.device.type == "cuda"

    def sync_device() -> None:
        if cuda:
            torch.cuda.synchronize()

    def manager(ccfg, storage, **kw):
        kw.setdefault("use_cuda_staging", cuda)  # as the worker's checkpointer does
        return CheckpointManager(
            ccfg,
            storage,
            states,
            rank=d.rank,
            world_size=d.world_size,
            mesh_shape=list(d.mesh.shape),
            group=d.ckpt_group,
            fingerprint=cfg.model_fingerprint(),
            events=events,
            metrics=NullSink(),
            **kw,
        )

    ckpt = manager(cfg.checkpoint, storage)
    # --modes: one manager per upload variant, each in its own directory ("thread" is ``ckpt``).
    managers = {}
    for mode in o["modes"]:
        if mode == "thread":
            managers[mode] = ckpt
            continue
        if mode in DURABLE and mode != "thread":  # a peer library's variant
            managers[mode] = _peer_manager(mode, work, model, optimizer, states, d, o)
            continue
        # "thread-pageable": the thread writer staging CUDA tensors into pageable (not pinned) host memory;
        # "-buffered": shard files written through the page cache (checkpoint.direct_io = false)
        writer, _, nice = mode.removesuffix("-pageable").removesuffix("-buffered").partition("-nice")
        mcfg = dataclasses.replace(
            cfg.checkpoint,
            dir=os.path.join(work, f"ckpt-{mode}"),
            writer=writer,
            direct_io=not mode.endswith("-buffered"),
        )
        storage = Storage.for_checkpoint(mcfg)
        pinned = cuda and not mode.endswith("-pageable")
        remote = remote_saver(
            storage, d.ckpt_group, mode=mcfg.mode, writer=writer, cuda_staging=pinned, upload_nice=int(nice or 0)
        )
        managers[mode] = manager(mcfg, storage, remote=remote)

    class _BlockCheckpointer(Checkpointer):
        """The worker's checkpointer over one of the managers compared here (``manager`` is
        swapped per block); the blocks decide when to save: a step's end decides nothing."""

        def end_of_step(self, s, step: int, total_steps: int) -> None:
            return None

    session = Session(cfg, d, EventLog(None), NullSink(), PreemptionFlag())
    ck = _BlockCheckpointer(
        session,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        data=batches,
        train_state=state,
        fingerprint=cfg.model_fingerprint(),
        manager=lambda _: ckpt,  # over this benchmark's own states (the same model and optimizer)
    )
    ck.resume()  # a fresh start, as the worker's
    trainer = Trainer(cfg, model, ck)
    # ---------------------------------------------------------------------------------------

    def local(x):
        return x.to_local() if isinstance(x, DTensor) else x

    def run_block(n: int, save: bool, mgr=None) -> dict:
        """n steps as Trainer.run does them; with ``save``, one async save after the first."""
        mgr = mgr or ckpt
        ck.run.manager = mgr
        dist.barrier()
        times, stats, marks, watch = [], None, {}, []
        c0, tc0, th0 = time.process_time(), tree_cpu_seconds(), time.thread_time()
        save_cpu = [0.0]
        t0 = time.monotonic()
        last = [t0]

        def after_step(s) -> None:
            nonlocal stats, marks
            if save and stats is None:
                called, cpu0 = time.monotonic() - t0, time.thread_time()
                stats = mgr.save(s.step)
                save_cpu[0] = time.thread_time() - cpu0
                marks = {"save_called": called, "save_returned": time.monotonic() - t0}
                probe = _durable_probe(mgr, stats.step, rank)
                if probe is not None and not stats.skipped:
                    watch[:] = watch_durable(probe, t0, marks)
                inflight = mgr._inflight  # noqa: SLF001 - timing the save in flight from the inside
                for name, f in (
                    ("staged", inflight.stagings[0] if inflight.stagings else None),
                    ("uploaded", inflight.written),
                ):
                    if f is not None:
                        f.add_done_callback(
                            lambda _f, name=name, marks=marks: marks.__setitem__(name, time.monotonic() - t0)
                        )
            now = time.monotonic()
            times.append(now - last[0])
            last[0] = now

        trainer.train(state.step + n, after_step)
        t_fin = time.monotonic()
        if save:
            mgr.finish()
        end = time.monotonic()
        if watch:  # the durable mark lands once finish() returned, or soon after (its own poll)
            watch[0].join(timeout=120)
            watch[1].set()
        out = {
            "seconds": end - t0,
            "cpu_seconds": time.process_time() - c0,
            "tree_cpu_seconds": tree_cpu_seconds() - tc0,
            # CPU off the training thread (its other threads, dead ones included, and its child
            # processes): what a background save adds shows here, without the training's own noise
            "off_thread_cpu_seconds": tree_cpu_seconds() - tc0 - (time.thread_time() - th0),
            "save_call_cpu_seconds": save_cpu[0],
            "step_times": times,
            "finish_wait": end - t_fin,
            "marks": marks,
        }
        if stats is not None:
            out.update(
                step=stats.step,
                wait_previous=stats.wait_previous,
                call=stats.call,
                staging_wait=stats.staging_wait,
                stall=stats.stall,
                skipped=stats.skipped,
                durable=marks["durable"] - marks["save_called"] if "durable" in marks else None,
            )
        return out

    def copy_floor() -> dict:
        tensors = [local(p).detach() for p in model.parameters()]
        for st in optimizer.state.values():
            tensors += [local(st[k]) for k in ("exp_avg", "exp_avg_sq")]
        nbytes = sum(x.numel() * x.element_size() for x in tensors)
        dist.barrier()
        t0 = time.monotonic()
        clones = [x.clone() for x in tensors]
        sync_device()
        clone_s = time.monotonic() - t0
        dist.barrier()
        t0 = time.monotonic()
        for c, x in zip(clones, tensors, strict=True):
            c.copy_(x)
        sync_device()
        copy_s = time.monotonic() - t0
        del clones
        if cuda:  # the write floor and the checksum are of host bytes: one plain copy to host first
            tensors = [x.cpu() for x in tensors]
        # what any save of these bytes costs at least: writing them to the checkpoint's file
        # system (one file, plain write() of each tensor's memory, fsync), CPU of the writing thread
        path = os.path.join(work, f"write-floor-{rank}.bin")
        dist.barrier()
        t0, c0 = time.monotonic(), time.thread_time()
        with open(path, "wb") as f:
            for x in tensors:
                f.write(memoryview(x.contiguous().numpy()).cast("B"))
            f.flush()
            os.fsync(f.fileno())
        write_cpu, write_s = time.thread_time() - c0, time.monotonic() - t0
        os.remove(path)
        # the checksum every save keeps (XXH3 of every byte written), alone: CPU of this thread
        c0 = time.thread_time()
        for x in tensors:
            xxhash.xxh3_64_intdigest(memoryview(x.contiguous().numpy()).cast("B"))
        hash_cpu = time.thread_time() - c0
        return {
            "clone": clone_s,
            "copy_prealloc": copy_s,
            "bytes": nbytes,
            "write": write_s,
            "write_cpu": write_cpu,
            "hash_cpu": hash_cpu,
        }

    def sync_save(r: int, crc: bool = True) -> float:
        path = storage.join(f"sync-{r}-{crc}")
        if rank == 0:
            storage.makedirs(path)
        dist.barrier()
        t0 = time.monotonic()
        writer = storage.dcp.writer(path) if crc else integrity.ChecksummedWriter(storage.dcp.writer(path))
        dcp.save(states, storage_writer=writer, process_group=d.ckpt_group)
        dt = time.monotonic() - t0
        dist.barrier()
        if rank == 0:
            storage.delete_tree(path)
        return dt

    def full_save(r: int) -> float:
        path = os.path.join(work, f"full-{r}.pt")
        dist.barrier()
        t0 = time.monotonic()
        msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            with open(path, "wb") as f:
                torch.save({"model": msd, "optim": osd}, f)
                f.flush()
                os.fsync(f.fileno())
        dist.barrier()
        dt = time.monotonic() - t0
        del msd, osd
        if rank == 0:
            os.remove(path)
        return dt

    res: dict = {"rank": rank}
    res["params"] = sum(p.numel() for p in model.parameters())
    res["local_param_bytes"] = parallel.local_param_bytes(model)
    t0 = time.monotonic()
    trainer.train(state.step + o["warmup_steps"])
    res["warmup_seconds"] = time.monotonic() - t0
    # The first save allocates the stager's buffers and starts its threads: measured apart.
    res["cold_save"] = run_block(2, save=True)
    res["cold_save_modes"] = {m: run_block(2, save=True, mgr=g) for m, g in managers.items() if m != "thread"}
    res["floor"] = [copy_floor() for _ in range(o["rounds"])]
    res["rounds"] = []
    for r in range(o["rounds"]):
        rd = {}
        kinds = ["A"] + [f"B:{m}" for m in o["modes"]]
        kinds = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]  # rotate: slow drift in load hits all
        for kind in kinds:
            rd[kind] = run_block(o["every"], save=kind != "A", mgr=managers.get(kind[2:]))
        rd["B"] = rd["B:" + o["modes"][0]]
        if o["skip_sync"]:
            rd["sync"] = rd["sync_nocrc"] = rd["full"] = float("nan")
            res["rounds"].append(rd)
            if rank == 0:
                print(
                    f"round {r + 1}/{o['rounds']}: " + " ".join(f"{k} {rd[k]['seconds']:.2f}s" for k in kinds),
                    flush=True,
                )
            continue
        for crc in (True, False) if r % 2 == 0 else (False, True):
            rd["sync" if crc else "sync_nocrc"] = sync_save(r, crc)
        rd["full"] = full_save(r)
        res["rounds"].append(rd)
        if rank == 0:
            print(
                f"round {r + 1}/{o['rounds']}: A {rd['A']['seconds']:.2f}s B "
                f"{rd['B']['seconds']:.2f}s async stall {rd['B']['stall']:.3f}s "
                f"sync {rd['sync']:.2f}s sync-nocrc {rd['sync_nocrc']:.2f}s full {rd['full']:.2f}s",
                flush=True,
            )
    for g in managers.values():
        g.close()
    ckpt.close()
    return res


def _peer_manager(mode: str, work: str, model, optimizer, states: dict, d, o: dict):
    """A peer library's manager over the same model, optimizer, scheduler and ranks."""
    from bench import checkpoint_peers as peers

    if mode.startswith("torchtitan-"):
        return titan_manager(mode, work, model, states)
    if mode == "torch-checkpointing":
        return peers.TorchCheckpointingPeer(work, states)
    if mode == "lm-resiliency":
        return peers.LmResiliencyPeer(work, model, optimizer, d.world_size, o["every"])
    return peers.DlroverPeer(work, states, d.rank, d.world_size)


def _durable_probe(mgr, step: int, rank: int):
    """What says the save of ``step`` is durable, polled from the save call on (None: this rank
    cannot tell; ours: rank 0's commit)."""
    if isinstance(mgr, _PeerManager):
        return lambda: mgr.durable(step)
    if rank == 0:
        return lambda: mgr.last_committed_step == step
    return None


def _slowest_durable(ranks: list[dict], i: int, k: str) -> float:
    """Save call → durable of round ``i``'s save in block ``k``: the slowest rank that can tell
    (nan: none saw it durable before the block ended + 120 s)."""
    seen = [r["rounds"][i][k].get("durable") for r in ranks]
    seen = [x for x in seen if x is not None]
    return max(seen) if seen else float("nan")


def summarise(ranks: list[dict], o: dict, info: dict) -> dict:
    n = len(ranks[0]["rounds"])
    worst = lambda f: [max(f(r, i) for r in ranks) for i in range(n)]  # noqa: E731 - slowest rank per sample
    s = {
        "async_stall": worst(lambda r, i: r["rounds"][i]["B"]["stall"]),
        "async_call": worst(lambda r, i: r["rounds"][i]["B"]["call"]),
        "async_staging_wait": worst(lambda r, i: r["rounds"][i]["B"]["staging_wait"]),
        "async_wait_previous": worst(lambda r, i: r["rounds"][i]["B"]["wait_previous"]),
        "sync": worst(lambda r, i: r["rounds"][i]["sync"]),
        "sync_nocrc": worst(lambda r, i: r["rounds"][i]["sync_nocrc"]),
        "full": worst(lambda r, i: r["rounds"][i]["full"]),
        "floor_clone": worst(lambda r, i: r["floor"][i]["clone"]),
        "floor_copy": worst(lambda r, i: r["floor"][i]["copy_prealloc"]),
        "floor_write": worst(lambda r, i: r["floor"][i]["write"]),
        "floor_write_cpu": worst(lambda r, i: r["floor"][i]["write_cpu"]),
        "floor_hash_cpu": worst(lambda r, i: r["floor"][i]["hash_cpu"]),
        # what every async save of these bytes does at least: copy them out, checksum, write
        "floor_bytes_cpu": worst(
            lambda r, i: r["floor"][i]["copy_prealloc"] + r["floor"][i]["hash_cpu"] + r["floor"][i]["write_cpu"]
        ),
        "block_A": worst(lambda r, i: r["rounds"][i]["A"]["seconds"]),
        "block_B": worst(lambda r, i: r["rounds"][i]["B"]["seconds"]),
        "B_finish_wait": worst(lambda r, i: r["rounds"][i]["B"]["finish_wait"]),
        "cpu_A": [sum(r["rounds"][i]["A"]["cpu_seconds"] for r in ranks) for i in range(n)],
        "cpu_B": [sum(r["rounds"][i]["B"]["cpu_seconds"] for r in ranks) for i in range(n)],
    }
    for mode in o["modes"]:
        k = "B:" + mode
        s[f"block_{k}"] = worst(lambda r, i, k=k: r["rounds"][i][k]["seconds"])
        s[f"stall_{k}"] = worst(lambda r, i, k=k: r["rounds"][i][k]["stall"])
        s[f"cpu_{k}"] = [sum(r["rounds"][i][k]["cpu_seconds"] for r in ranks) for i in range(n)]
        # the step right after the save (index 1; the save follows step index 0) vs the block's median step
        s[f"after_{k}"] = worst(lambda r, i, k=k: r["rounds"][i][k]["step_times"][1])
        s[f"step_{k}"] = worst(lambda r, i, k=k: median(r["rounds"][i][k]["step_times"][2:]))
        s[f"durable_{k}"] = [_slowest_durable(ranks, i, k) for i in range(n)]
        # the save call's CPU on the training thread + what the block's other threads and processes
        # used beyond the no-checkpoint block's (gloo's own threads, chiefly), both ranks
        s[f"cpu_per_save_{k}"] = [
            sum(
                r["rounds"][i][k]["save_call_cpu_seconds"]
                + r["rounds"][i][k]["off_thread_cpu_seconds"]
                - r["rounds"][i]["A"]["off_thread_cpu_seconds"]
                for r in ranks
            )
            for i in range(n)
        ]
        s[f"cpu_block_diff_{k}"] = [
            sum(r["rounds"][i][k]["tree_cpu_seconds"] - r["rounds"][i]["A"]["tree_cpu_seconds"] for r in ranks)
            for i in range(n)
        ]
    s["after_A"] = worst(lambda r, i: r["rounds"][i]["A"]["step_times"][1])
    s["step_A"] = worst(lambda r, i: median(r["rounds"][i]["A"]["step_times"][2:]))
    m = {k: median(v) for k, v in s.items()}
    ratios = {
        "async_over_sync": m["async_stall"] / m["sync"],
        "async_over_sync_nocrc": m["async_stall"] / m["sync_nocrc"],
        "full_over_sync": m["full"] / m["sync"],
        "async_over_floor": m["async_stall"] / m["floor_clone"],
        "sync_over_floor": m["sync"] / m["floor_clone"],
        "full_over_floor": m["full"] / m["floor_clone"],
        "throughput_ckpt_over_none": m["block_A"] / m["block_B"],
        "throughput_ckpt_over_none_totals": sum(s["block_A"]) / sum(s["block_B"]),
        "per_round_throughput": [a / b for a, b in zip(s["block_A"], s["block_B"], strict=True)],
        "cpu_A_over_B": m["cpu_A"] / m["cpu_B"],
        "modes": {
            mode: {
                "throughput": m["block_A"] / m[f"block_B:{mode}"],
                "per_round": [a / b for a, b in zip(s["block_A"], s[f"block_B:{mode}"], strict=True)],
                "cpu_A_over_B": m["cpu_A"] / m[f"cpu_B:{mode}"],
            }
            for mode in o["modes"]
        },
    }
    state_bytes = sum(r["floor"][0]["bytes"] for r in ranks)
    steps_A = [x for r in ranks for rd in r["rounds"] for x in rd["A"]["step_times"]]
    return {
        "samples": s,
        "median": m,
        "ratios": ratios,
        "model": {
            "params": ranks[0]["params"],
            "state_bytes_all_ranks": state_bytes,
            "state_bytes_per_rank": [r["floor"][0]["bytes"] for r in ranks],
            "dim": o["dim"],
            "layers": o["layers"],
            "seq_len": o["seq_len"],
            "global_batch": o["global_batch"],
            "micro_batch": o["micro_batch"],
        },
        "step_seconds_median": median(steps_A),
        "cold_save": {
            k: max(r["cold_save"].get(k, 0.0) for r in ranks)
            for k in ("call", "staging_wait", "stall", "seconds", "finish_wait")
        },
        "info": info,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--every", type=int, default=20, help="steps per block; the async save cadence")
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--layers", type=int, default=13)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: NCCL, bf16 mixed precision, staging into pinned host memory (mode thread-pageable: without)",
    )
    ap.add_argument("--data", default=str(REPO / "runs/data/demo.bin"))
    ap.add_argument("--workdir", default=None, help="parent of the temp checkpoint dir (default: the system temp dir)")
    ap.add_argument(
        "--modes",
        default="thread",
        help="comma-separated upload variants measured side by side as B blocks: "
        "thread, process, thread-nice10, process-nice10, thread-pageable (CUDA staging without pinned memory), "
        "thread-buffered, process-buffered (shard files through the page cache: checkpoint.direct_io = false)",
    )
    ap.add_argument(
        "--peer",
        default="",
        help="comma-separated peer libraries measured side by side with ours, each as B blocks: torchtitan "
        "(its async and pinned-memory paths; or one: torchtitan-async, torchtitan-pinned-cpu), "
        "torch-checkpointing, lm-resiliency, dlrover; run with the bench venv's python, see BENCHMARKS.md",
    )
    ap.add_argument(
        "--skip-sync", action="store_true", help="only the A/B blocks (no sync, full-state-dict or floor comparisons)"
    )
    ap.add_argument("--json-out")
    a = parse_with_smoke(
        ap,
        [
            "--rounds",
            "1",
            "--every",
            "2",
            "--dim",
            "64",
            "--layers",
            "1",
            "--heads",
            "2",
            "--seq-len",
            "16",
            "--warmup-steps",
            "1",
        ],  # fmt: skip
    )

    peers = [p for p in a.peer.split(",") if p]
    unknown = [p for p in peers if p not in PEER_MODES]
    if unknown:
        ap.error(f"--peer {','.join(unknown)}: not one of {', '.join(PEER_MODES)}")
    missing = missing_peers(peers)
    if missing:
        print("\n\n".join(install_hint(p) for p in missing), file=sys.stderr)
        return 2
    from tests.dist.harness import run_ranks

    if not os.path.exists(a.data):
        import subprocess

        subprocess.run(
            [sys.executable, "-m", "elastic_trainer.cli", "data", "build", "--out", a.data], check=True, cwd=REPO
        )
    info = machine_info()
    info["loadavg_start"] = loadavg()
    work = tempfile.mkdtemp(prefix="bench-ckpt-stall-", dir=a.workdir)
    o = {
        "work": work,
        "data": a.data,
        "rounds": a.rounds,
        "every": a.every,
        "dim": a.dim,
        "layers": a.layers,
        "heads": a.heads,
        "seq_len": a.seq_len,
        "global_batch": a.global_batch,
        "micro_batch": a.micro_batch,
        "warmup_steps": a.warmup_steps,
        "modes": a.modes.split(",") + [m for p in peers for m in PEER_MODES[p]],
        "skip_sync": a.skip_sync,
        "device": a.device,
    }
    t0 = time.monotonic()
    try:
        ranks = run_ranks(_rank_main, a.world, o, timeout=1800, daemon=False)  # PROCESS mode spawns a saver
        committed = []
        ev = Path(work) / "events.jsonl"
        if ev.exists():
            committed = [json.loads(x) for x in ev.read_text().splitlines() if '"checkpoint_committed"' in x]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info["loadavg_end"] = loadavg()
    info["wall_seconds"] = round(time.monotonic() - t0, 1)
    info["command"] = " ".join(
        [os.path.relpath(sys.executable, REPO) if sys.executable.startswith(str(REPO)) else "python", *sys.argv]
    )
    out = summarise(ranks, o, info)
    out["async_save_seconds_to_commit"] = [c.get("seconds") for c in committed]
    print_report(out)
    print()
    print_side_by_side(out, a.every)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"summary": out, "ranks": ranks}, indent=1))
    return 0


def _finite(xs) -> list[float]:
    return [x for x in xs if x == x]


def print_side_by_side(out: dict, every: int) -> None:
    """Ours and every peer variant: blocked, save call → durable, throughput, CPU per save; the
    shims; and the ratios against the peers."""
    s, r = out["samples"], out["ratios"]["modes"]

    def med(key: str) -> float:
        return median(_finite(s[key]))

    def fmt(xs) -> str:
        return ", ".join(f"{x:.3f}" if x == x else "never" for x in xs)

    rows = []
    for mode, x in r.items():
        k = "B:" + mode
        rows.append(
            [
                mode if mode in DURABLE and mode != "thread" else f"ours ({mode})",
                f"{med('stall_' + k):.3f} ({fmt(s['stall_' + k])})",
                f"{med('durable_' + k):.2f} ({fmt(s['durable_' + k])})",
                f"{x['throughput']:.3f} ({fmt(x['per_round'])})",
                f"{med('cpu_per_save_' + k):.2f} ({fmt(s['cpu_per_save_' + k])})",
            ]
        )
    print(
        table(
            [
                "save path",
                "blocked per save s (samples)",
                "save call → durable s (samples)",
                f"throughput, a save every {every} ÷ none (per round)",
                "CPU s per save: save call + off-training-thread − A's, both ranks (per round)",
            ],
            rows,
        )
    )
    print()
    for mode in r:
        print(f"durable, {mode}: {DURABLE.get(mode, DURABLE['thread'])}")
    for mode in r:
        if mode in SHIMS:
            print(f"shim, {mode}: {SHIMS[mode]}")
    ours = next((m for m in r if m not in DURABLE or m == "thread"), None)
    peers = [m for m in r if m in DURABLE and m != "thread"]
    if ours is None or not peers:
        return
    k = "B:" + ours
    best_blocked = min(peers, key=lambda m: med("stall_B:" + m))
    best_tp = max(peers, key=lambda m: r[m]["throughput"])
    print()
    if "torch-checkpointing" in peers:
        print(
            "ours save → committed (checksummed, fsynced, manifest) ÷ torch-checkpointing save → renamed: "
            f"{med('durable_' + k) / med('durable_B:torch-checkpointing'):.2f}"
        )
    print(f"ours blocked ÷ best peer's ({best_blocked}): {med('stall_' + k) / med('stall_B:' + best_blocked):.2f}")
    print(
        f"ours throughput ratio {r[ours]['throughput']:.3f} vs best peer's ({best_tp}) {r[best_tp]['throughput']:.3f}: "
        f"{r[ours]['throughput'] / r[best_tp]['throughput']:.3f}"
    )


def print_report(out: dict) -> None:
    m, r, mod, info = out["median"], out["ratios"], out["model"], out["info"]
    s = out["samples"]

    def fmt(xs) -> str:
        return ", ".join(f"{x:.3f}" for x in xs)

    print()
    print(
        f"machine: {info['nproc']} CPUs ({info['cpu']}), "
        f"{info['mem_total_gib']} GiB, torch {info['torch']}, python {info['python']}"
    )
    print(
        "load average start "
        f"{info['loadavg_start'][0]:.2f}/{info['loadavg_start'][1]:.2f}/{info['loadavg_start'][2]:.2f}, "
        f"end {info['loadavg_end'][0]:.2f}/{info['loadavg_end'][1]:.2f}/{info['loadavg_end'][2]:.2f}; "
        f"wall {info['wall_seconds']}s"
    )
    print(
        f"model: {mod['params'] / 1e6:.1f}M params (dim {mod['dim']}, "
        f"{mod['layers']} layers), seq {mod['seq_len']}, global batch {mod['global_batch']}; "
        f"state (params + exp_avg + exp_avg_sq) {mod['state_bytes_all_ranks'] / 1e9:.3f} GB across ranks "
        f"({', '.join(f'{b / 1e6:.0f}' for b in mod['state_bytes_per_rank'])} "
        f"MB per rank); median step {out['step_seconds_median']:.3f}s"
    )
    print(f"command: {info['command']}")
    print()

    def vs_sync(label: str, key: str) -> list[str]:
        """A floor's row: its median, samples and ratio to the synchronous save."""
        return [label, f"{m[key]:.3f}", fmt(s[key]), f"{m[key] / m['sync']:.3f}", ""]

    rows = [
        [
            "(a) async save (ours): save() + wait_for_staging()",
            f"{m['async_stall']:.3f}",
            fmt(s["async_stall"]),
            f"{r['async_over_sync']:.3f}",
            f"{r['async_over_floor']:.2f}",
        ],
        ["  of which save() call", f"{m['async_call']:.3f}", fmt(s["async_call"]), "", ""],
        ["  of which wait_for_staging()", f"{m['async_staging_wait']:.3f}", fmt(s["async_staging_wait"]), "", ""],
        [
            "(b) synchronous dcp.save (torch default: zip CRC32s)",
            f"{m['sync']:.3f}",
            fmt(s["sync"]),
            "1.000",
            f"{r['sync_over_floor']:.2f}",
        ],
        [
            "(b') synchronous dcp.save, manager's writer (no CRC32)",
            f"{m['sync_nocrc']:.3f}",
            fmt(s["sync_nocrc"]),
            f"{m['sync_nocrc'] / m['sync']:.3f}",
            f"{m['sync_nocrc'] / m['floor_clone']:.2f}",
        ],
        [
            "(c) full state dict + torch.save on rank 0",
            f"{m['full']:.3f}",
            fmt(s["full"]),
            f"{r['full_over_sync']:.3f}",
            f"{r['full_over_floor']:.2f}",
        ],
        [
            "floor: clone() of a rank's state",
            f"{m['floor_clone']:.3f}",
            fmt(s["floor_clone"]),
            f"{m['floor_clone'] / m['sync']:.3f}",
            "1.00",
        ],
        [
            "  copy_() into preallocated buffers",
            f"{m['floor_copy']:.3f}",
            fmt(s["floor_copy"]),
            "",
            f"{m['floor_copy'] / m['floor_clone']:.2f}",
        ],
        vs_sync("floor: write() of a rank's bytes to the checkpoint's file system + fsync (wall)", "floor_write"),
        vs_sync("  CPU of the writing thread (user + kernel)", "floor_write_cpu"),
        vs_sync("floor: XXH3 of a rank's bytes (CPU)", "floor_hash_cpu"),
        vs_sync("floor: an async save's byte work (copy_ + XXH3 + write CPU)", "floor_bytes_cpu"),
    ]
    print(table(["training thread blocked per checkpoint", "median s", "samples s", "÷ sync", "÷ copy floor"], rows))
    print()
    rows = [
        [
            f"{out['model']['global_batch']}×{out['model']['seq_len']} "
            "tokens/step, block of steps without checkpoint (A)",
            f"{m['block_A']:.2f}",
            fmt(s["block_A"]),
        ],
        ["same block with one async checkpoint (B), incl. finish()", f"{m['block_B']:.2f}", fmt(s["block_B"])],
        ["  of which finish() at block end", f"{m['B_finish_wait']:.2f}", fmt(s["B_finish_wait"])],
        ["CPU seconds (both ranks, all threads) in A", f"{m['cpu_A']:.2f}", fmt(s["cpu_A"])],
        ["CPU seconds (both ranks, all threads) in B", f"{m['cpu_B']:.2f}", fmt(s["cpu_B"])],
    ]
    print(table(["throughput", "median s", "samples s"], rows))
    print()
    print(
        f"throughput with a checkpoint every block ÷ without: {r['throughput_ckpt_over_none']:.3f} (medians), "
        f"{r['throughput_ckpt_over_none_totals']:.3f} (totals), per round {fmt(r['per_round_throughput'])}"
    )
    print(f"CPU time without ÷ with a checkpoint (load-independent view of the same ratio): {r['cpu_A_over_B']:.3f}")
    print(
        f"effective cost per checkpoint (B − A, medians): {m['block_B'] - m['block_A']:.2f}s; "
        f"async save to commit (s): {fmt([x for x in out['async_save_seconds_to_commit'] if x is not None])}"
    )
    if len(out["ratios"]["modes"]) > 1 or out["samples"].get("after_A"):
        sync = m["sync"]
        rows = [
            [
                "A (no checkpoint)",
                f"{m['block_A']:.2f}",
                "1.000",
                "",
                "",
                "",
                f"{m['after_A']:.2f}",
                "",
                f"{m['step_A']:.2f}",
                f"{m['cpu_A']:.1f}",
            ]
        ]
        for mode, x in out["ratios"]["modes"].items():
            k = "B:" + mode
            extra = m["after_" + k] - m["step_A"]
            rows.append(
                [
                    mode,
                    f"{m['block_' + k]:.2f}",
                    f"{x['throughput']:.3f}",
                    fmt(x["per_round"]),
                    f"{m['stall_' + k]:.3f}",
                    f"{m['stall_' + k] / sync:.4f}",
                    f"{m['after_' + k]:.2f}",
                    f"{extra:+.2f} ({extra / sync:+.2f} × sync)",
                    f"{m['step_' + k]:.2f}",
                    f"{m['cpu_' + k]:.1f}",
                ]
            )
        print(
            table(
                [
                    "save path",
                    "block s",
                    "throughput ÷ A",
                    "per round",
                    "blocked s",
                    "blocked ÷ sync",
                    "step after save s",
                    "extra vs A's median step",
                    "other steps s",
                    "CPU s",
                ],
                rows,
            )
        )
        print()
    cs = out["cold_save"]
    print(
        f"first (cold) async save, not in the medians: stall {cs['stall']:.3f}s "
        f"(call {cs['call']:.3f}, staging wait {cs['staging_wait']:.3f})"
    )
    print()
    print(
        f"targets (earlier goals): async ≤ 0.05 × sync: {r['async_over_sync']:.3f} (÷ sync without CRC32s: "
        f"{r['async_over_sync_nocrc']:.3f}) {'met' if r['async_over_sync'] <= 0.05 else 'MISSED'}; "
        f"async ≤ 2 × floor: {r['async_over_floor']:.2f} {'met' if r['async_over_floor'] <= 2 else 'MISSED'}; "
        f"throughput ratio ≥ 0.97: {r['throughput_ckpt_over_none']:.3f} "
        f"{'met' if r['throughput_ckpt_over_none'] >= 0.97 else 'MISSED'}"
    )
    peers = {k: v for k, v in m.items() if k.startswith("stall_B:torchtitan")}
    if peers:
        best = min(peers.values())
        ours = m["stall_B:thread"] if "stall_B:thread" in m else m["async_stall"]
        extra = m.get("after_B:thread", float("nan")) - m["step_A"]
        print(
            "targets: blocked ≤ 0.01 × sync: "
            f"{ours / m['sync']:.4f} {'met' if ours / m['sync'] <= 0.01 else 'MISSED'}; "
            f"≤ 0.5 × best peer ({best:.3f}s): {ours / best:.2f} {'met' if ours / best <= 0.5 else 'MISSED'}; "
            "extra time of the overlapped step ≤ 0.25 × sync: "
            f"{extra / m['sync']:.2f} {'met' if extra / m['sync'] <= 0.25 else 'MISSED'} "
            f"(an async save's byte work alone — copy, XXH3, write — is {m['floor_bytes_cpu'] / m['sync']:.2f} "
            "× sync of CPU per rank: with every core busy training, an overlapped save costs the steps at least "
            "that)"
        )


if __name__ == "__main__":
    sys.exit(main())
