"""Functions run on every rank by tests/dist (must be importable by spawned processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from elastic_trainer.config import config_from_dict

TINY = {"model": {"vocab_size": 64, "seq_len": 16, "dim": 32, "n_layers": 2, "n_heads": 2, "mlp_ratio": 2}, "train": {"seed": 11, "lr": 1e-2, "warmup_steps": 0, "steps": 50}}


def build(world: int, cfg_dict=None):
    """Model (FSDP2 over all ranks) + AdamW + scheduler, as the worker builds them."""
    from torch.distributed.device_mesh import init_device_mesh

    from elastic_trainer.worker import parallel
    from elastic_trainer.worker.model_factory import build_model
    from elastic_trainer.worker.train_loop import lr_lambda

    cfg = config_from_dict(cfg_dict or TINY)
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model, init_param, shard_names = build_model(cfg.model)
    parallel.shard_model(model, mesh, parallel.mixed_precision_policy(cfg.train, torch.device("cpu")), parallel.resolve_shard_classes(model, shard_names))
    model.to_empty(device="cpu")
    parallel.deterministic_init(model, cfg.train.seed, init_param)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    return cfg, mesh, model, opt, sched


def full_state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"model": get_model_state_dict(model, options=opts), "optim": get_optimizer_state_dict(model, opt, options=opts)}


def sharding_facts(rank, world):
    from torch.distributed.tensor import DTensor, Shard

    from elastic_trainer.worker.parallel import local_param_bytes

    _, mesh, model, _, _ = build(world)
    params = dict(model.named_parameters())
    all_dtensor = all(isinstance(p, DTensor) and p.placements == (Shard(0),) and p.device_mesh.size() == world for p in params.values())
    total = sum(p.numel() * p.element_size() for p in params.values())
    full = {n: p.detach().full_tensor() for n, p in params.items()}
    return {"all_dtensor": all_dtensor, "local_bytes": local_param_bytes(model), "total_bytes": total, "full": full if rank == 0 else None}


def _train_steps(model, opt, sched, cfg, n, rank, world, start=0):
    """n optimizer steps on a fixed synthetic global batch of 8 samples, split over ranks."""
    import torch.nn.functional as F

    from elastic_trainer.runtime.sampler import rank_slice

    losses = []
    for step in range(start, start + n):
        g = torch.Generator().manual_seed(1000 + step)
        data = torch.randint(0, cfg.model.vocab_size, (8, cfg.model.seq_len + 1), generator=g)
        s, c = rank_slice(8, world, rank)
        x, y = data[s : s + c, :-1], data[s : s + c, 1:]
        loss = F.cross_entropy(model(x).reshape(-1, cfg.model.vocab_size), y.reshape(-1), reduction="sum") / (8 * cfg.model.seq_len)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total))
    return losses


def _manager(cfg, ckpt_dir, model, opt, sched, train_state, rank, world, mode="sync"):
    import dataclasses

    from elastic_trainer.checkpoint.manager import CheckpointManager
    from elastic_trainer.checkpoint.state import ModelState, OptimizerState, RNGState, SchedulerState
    from elastic_trainer.storage.fs import open_storage

    ccfg = dataclasses.replace(cfg.checkpoint, dir=ckpt_dir, mode=mode)
    group = dist.new_group(backend="gloo")
    states = {"model": ModelState(model), "optim": OptimizerState(model, opt), "lr_scheduler": SchedulerState(sched), "train": train_state, "rng": RNGState()}
    return CheckpointManager(ccfg, open_storage(ckpt_dir), states, rank=rank, world_size=world, mesh_shape=[world], group=group, fingerprint=cfg.model_fingerprint())


def save_after_training(rank, world, ckpt_dir, mode):
    """Train 3 steps, save (sync or async) step 3, return the full state and the next 4 losses."""
    from elastic_trainer.checkpoint.state import TrainState

    cfg, _, model, opt, sched = build(world)
    _train_steps(model, opt, sched, cfg, 3, rank, world)
    ts = TrainState(step=3, tokens_seen=3 * 8 * 16, cursor=24)
    mgr = _manager(cfg, ckpt_dir, model, opt, sched, ts, rank, world, mode)
    mgr.save(3)
    mgr.wait_for_staging()
    state = full_state(model, opt)
    lr_at_save = sched.get_last_lr()
    next_losses = _train_steps(model, opt, sched, cfg, 4, rank, world, start=3)  # mutates params while the save may still upload
    ok = mgr.finish()
    again = mgr.save(3).skipped  # a committed step is never rewritten
    mgr.close()
    return {"state": state if rank == 0 else None, "next": next_losses, "committed": ok, "lr": lr_at_save, "save_again": again}


def load_and_continue(rank, world, ckpt_dir):
    from elastic_trainer.checkpoint.state import TrainState

    cfg, _, model, opt, sched = build(world)
    ts = TrainState()
    mgr = _manager(cfg, ckpt_dir, model, opt, sched, ts, rank, world)
    loaded = mgr.load()
    state = full_state(model, opt)
    lr_after_load = sched.get_last_lr()
    save_loaded = mgr.save(loaded.step).skipped if loaded else None  # the step just loaded: never rewritten
    next_losses = _train_steps(model, opt, sched, cfg, 4, rank, world, start=3)
    mgr.close()
    return {"step": loaded.step if loaded else None, "saved_world": loaded.manifest["world_size"] if loaded else None, "state": state if rank == 0 else None, "next": next_losses, "train": (ts.step, ts.tokens_seen, ts.cursor), "lr": lr_after_load,
            "save_loaded": save_loaded}


def logits_after_load(rank, world, ckpt_dir):
    """Load the newest checkpoint into the sharded model; logits of a fixed batch (rank 0)."""
    from elastic_trainer.checkpoint.state import TrainState

    cfg, _, model, opt, sched = build(world)
    mgr = _manager(cfg, ckpt_dir, model, opt, sched, TrainState(), rank, world)
    assert mgr.load() is not None
    x = torch.randint(0, cfg.model.vocab_size, (3, cfg.model.seq_len), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = model(x)
    mgr.close()
    return {"x": x, "logits": logits.detach().clone()} if rank == 0 else None
