"""Functions run on every rank by tests/dist (must be importable by spawned processes)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from elastic_trainer.config import config_from_dict

TINY = {
    "model": {"vocab_size": 64, "seq_len": 16, "dim": 32, "n_layers": 2, "n_heads": 2, "mlp_ratio": 2},
    "train": {"seed": 11, "lr": 1e-2, "warmup_steps": 0, "steps": 50},
}


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
    parallel.shard_model(
        model,
        mesh,
        parallel.mixed_precision_policy(cfg.train, torch.device("cpu")),
        parallel.resolve_shard_classes(model, shard_names),
    )
    model.to_empty(device="cpu")
    parallel.deterministic_init(model, cfg.train.seed, init_param)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    return cfg, mesh, model, opt, sched


def full_state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        "model": get_model_state_dict(model, options=opts),
        "optim": get_optimizer_state_dict(model, opt, options=opts),
    }


def sharding_facts(rank, world):
    from torch.distributed.tensor import DTensor, Shard

    from elastic_trainer.worker.parallel import local_param_bytes

    _, mesh, model, _, _ = build(world)
    params = dict(model.named_parameters())
    all_dtensor = all(
        isinstance(p, DTensor) and p.placements == (Shard(0),) and p.device_mesh.size() == world
        for p in params.values()
    )
    total = sum(p.numel() * p.element_size() for p in params.values())
    full = {n: p.detach().full_tensor() for n, p in params.items()}
    return {
        "all_dtensor": all_dtensor,
        "local_bytes": local_param_bytes(model),
        "total_bytes": total,
        "full": full if rank == 0 else None,
        "bf16": bf16_user_loss(rank, world),
    }


def _backward_on_fixed_batch(model, cfg, seed: int, rank, world):
    """Forward and backward of this rank's share of the fixed synthetic global batch ``seed``
    (8 samples); returns this rank's share of the global loss."""
    import torch.nn.functional as F

    from elastic_trainer.runtime.sampler import rank_slice

    g = torch.Generator().manual_seed(1000 + seed)
    data = torch.randint(0, cfg.model.vocab_size, (8, cfg.model.seq_len + 1), generator=g)
    s, c = rank_slice(8, world, rank)
    x, y = data[s : s + c, :-1], data[s : s + c, 1:]
    loss = F.cross_entropy(model(x).reshape(-1, cfg.model.vocab_size), y.reshape(-1), reduction="sum") / (
        8 * cfg.model.seq_len
    )
    loss.backward()
    return loss


def _train_steps(model, opt, sched, cfg, n, rank, world, start=0):
    """n optimizer steps on a fixed synthetic global batch of 8 samples, split over ranks."""
    losses = []
    for step in range(start, start + n):
        loss = _backward_on_fixed_batch(model, cfg, step, rank, world)
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
    states = {
        "model": ModelState(model),
        "optim": OptimizerState(model, opt),
        "lr_scheduler": SchedulerState(sched),
        "train": train_state,
        "rng": RNGState(),
    }
    return CheckpointManager(
        ccfg,
        open_storage(ckpt_dir),
        states,
        rank=rank,
        world_size=world,
        mesh_shape=[world],
        group=group,
        fingerprint=cfg.model_fingerprint(),
    )


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
    # mutates params while the save may still upload
    next_losses = _train_steps(model, opt, sched, cfg, 4, rank, world, start=3)
    ok = mgr.finish()
    again = mgr.save(3).skipped  # a committed step is never rewritten
    mgr.close()
    return {
        "state": state if rank == 0 else None,
        "next": next_losses,
        "committed": ok,
        "lr": lr_at_save,
        "save_again": again,
    }


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
    return {
        "step": loaded.step if loaded else None,
        "saved_world": loaded.manifest["world_size"] if loaded else None,
        "state": state if rank == 0 else None,
        "next": next_losses,
        "train": (ts.step, ts.tokens_seen, ts.cursor),
        "lr": lr_after_load,
        "save_loaded": save_loaded,
    }


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


# ------------------------------------------------------------------------------- schedulers
def _scheduler(name: str, opt):
    from torch.optim import lr_scheduler as L

    if name == "sequential":  # linear warm-up, then cosine
        return L.SequentialLR(opt, [L.LinearLR(opt, 0.1, total_iters=4), L.CosineAnnealingLR(opt, 10)], milestones=[4])
    if name == "warm_restarts":
        return L.CosineAnnealingWarmRestarts(opt, T_0=3)
    if name == "plateau":  # stepped on the loss
        return L.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.5)
    if name == "chained":
        return L.ChainedScheduler([L.ConstantLR(opt, 0.5, total_iters=3), L.ExponentialLR(opt, 0.9)])
    if name == "one_cycle":
        return L.OneCycleLR(opt, max_lr=0.05, total_steps=20)
    if name == "hf_cosine_warmup":  # transformers' get_*_schedule_with_warmup: a LambdaLR over a partial
        import functools
        import math

        def lam(step, warmup, total):
            return (
                step / warmup if step < warmup else 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
            )

        return L.LambdaLR(opt, functools.partial(lam, warmup=3, total=20))
    raise ValueError(name)


# One block: the schedulers drive the learning rate of any model; each FSDP unit costs collectives
# every step, and 18 runs of 5-10 steps are this file's cost.
SCHED_TINY = {**TINY, "model": {**TINY["model"], "n_layers": 1}}
SCHEDULERS = ("sequential", "warm_restarts", "plateau", "chained", "one_cycle", "hf_cosine_warmup")


def _sched_steps(model, opt, sched, cfg, first, last, rank, world, mgr=None, save_at=None):
    """Steps ``first..last`` (1-based) of the fixed synthetic batches; (loss, lr) per step.
    Saves at ``save_at`` through ``mgr``."""
    out = {}
    for step in range(first, last + 1):
        loss = _backward_on_fixed_batch(model, cfg, step, rank, world)
        total = loss.detach().clone()
        dist.all_reduce(total)
        opt.step()
        opt.zero_grad()
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            sched.step(float(total))
        else:
            sched.step()
        out[step] = (float(total), float(opt.param_groups[0]["lr"]))
        if mgr is not None and step == save_at:
            mgr.save(step, blocking=True)
    return out


def scheduler_runs(rank, world, root, mode):
    """Every scheduler family in one process group. ``mode == "ref"``: steps 1..10 uninterrupted,
    a checkpoint committed at step 5 on the way. ``"resume"``: load step 5 (a new process group, as
    after a kill or at another world size), then steps 6..10. Returns {family: {step: (loss, lr)}}."""
    import os

    from elastic_trainer.checkpoint.state import TrainState

    out = {}
    for name in SCHEDULERS:
        cfg, _, model, opt, _ = build(world, SCHED_TINY)
        sched = _scheduler(name, opt)
        mgr = _manager(cfg, os.path.join(root, name), model, opt, sched, TrainState(), rank, world)
        if mode == "ref":
            out[name] = _sched_steps(model, opt, sched, cfg, 1, 10, rank, world, mgr, save_at=5)
        else:
            loaded = mgr.load()
            assert loaded is not None and loaded.step == 5, loaded
            out[name] = _sched_steps(model, opt, sched, cfg, 6, 10, rank, world)
        mgr.close()
    return out


# ------------------------------------------------------------------------------- the loop API
class _Pairs(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(200, 8, generator=g), torch.randn(200, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def _collate(items):
    """A collate_fn of the user's (a dict of stacked tensors): it must reach the loop unchanged."""
    return {"x": torch.stack([i["x"] for i in items]), "y": torch.stack([i["y"] for i in items]), "n": len(items)}


def loop_api_losses(rank, world, root, micro_batch, workers, counted=False):
    """The five-call loop over a plain DataLoader (worker processes, a collate_fn) whose
    ``batch_size`` is the micro-batch: the global losses of 6 steps, the per-rank batch sizes seen
    in each step, and the refusal of a backward pass the loop did not run. ``counted``: then the
    same 6 steps again from the same start, each batch's loss a sum over its samples normalised by
    the step's global count of them (``steps(count=...)``): their losses and recorded counts."""
    import dataclasses

    import torch.nn.functional as F
    from torch import nn

    import elastic_trainer as et

    session = et.init(
        {
            "run": {"dir": f"{root}/run-{world}"},
            "checkpoint": {"dir": f"{root}/ckpt-{world}", "interval_steps": 0},
            "train": {"global_batch_size": 8, "seed": 5},
            "metrics": {"port": 0},
        }
    )
    torch.manual_seed(0)
    model = session.shard(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)), [nn.Linear])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(_Pairs(), batch_size=micro_batch, num_workers=workers, collate_fn=_collate)
    ckpt = et.Checkpointer(session, model=model, optimizer=opt, data=loader)
    losses, sizes, refused = [], {}, None
    for step, batch in ckpt.steps(6, exit_on_stop=False):
        sizes.setdefault(step, []).append(batch["n"])
        loss = F.mse_loss(model(batch["x"]), batch["y"])
        if step == 6 and refused is None:  # the wrong usage: a backward of its own first
            loss.backward(retain_graph=True)
            try:
                ckpt.optimizer_step(loss)
            except RuntimeError as e:
                refused = str(e)
            opt.zero_grad(set_to_none=True)
        done = ckpt.optimizer_step(loss)
        if done is not None:
            losses.append(done)
    out = {"losses": losses, "sizes": list(sizes.values()), "code": ckpt.exit_code, "refused": refused}
    if counted:
        torch.manual_seed(0)
        model = session.shard(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)), [nn.Linear])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        c = session.cfg
        session.cfg = dataclasses.replace(
            c, checkpoint=dataclasses.replace(c.checkpoint, dir=f"{c.checkpoint.dir}-counted")
        )
        loader = torch.utils.data.DataLoader(_Pairs(), batch_size=micro_batch, collate_fn=_collate)
        ckpt = et.Checkpointer(session, model=model, optimizer=opt, data=loader)
        counted_losses, tokens = [], []
        for _, batch in ckpt.steps(
            6,
            exit_on_stop=False,
            count=lambda b: b["n"],
            after_step=lambda s: tokens.append(s.event["tokens_per_s"] > 0),
        ):
            done = ckpt.optimizer_step(F.mse_loss(model(batch["x"]), batch["y"], reduction="sum"))
            if done is not None:
                counted_losses.append(done)
        out.update(
            counted=counted_losses, counted_code=ckpt.exit_code, tokens_seen=ckpt.state.tokens_seen, tokens=tokens
        )
    return out


class Tensors:
    """A ``Stateful`` holding a dict of tensors (``t``), loaded back in place."""

    def __init__(self, t: dict):
        self.t = t

    def state_dict(self):
        return dict(self.t)

    def load_state_dict(self, sd):
        for k, v in sd.items():
            self.t[k].copy_(v)


def one_state_manager(ccfg, root: str, obj, rank: int, world: int, group, **kw):
    """A CheckpointManager of one Stateful (``{"model": obj}``) on a 1-D mesh of ``world`` ranks
    (this node's place among the peer holders as the environment says, as a worker's)."""
    from elastic_trainer.checkpoint.manager import CheckpointManager
    from elastic_trainer.checkpoint.peer_tier import PeerNode
    from elastic_trainer.storage.fs import open_storage

    kw.setdefault("peer_node", PeerNode.from_environ(os.environ))
    return CheckpointManager(
        ccfg,
        open_storage(root),
        {"model": obj},
        rank=rank,
        world_size=world,
        mesh_shape=[world],
        group=group,
        fingerprint="f",
        **kw,
    )


def bf16_user_loss(rank, world):
    """A user's model sharded by ``session.shard``'s policy under bf16 and a plain fp32 loss."""
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from elastic_trainer.config import TrainConfig
    from elastic_trainer.runtime.sharding import mixed_precision_policy, shard_model

    torch.manual_seed(rank)  # the ranks' batches differ, as a data-parallel loader's do
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2)), nn.Linear(8, 1))
    policy = mixed_precision_policy(TrainConfig(mixed_precision="bf16"), torch.device("cpu"))
    shard_model(model, init_device_mesh("cpu", (world,)), policy, [nn.Sequential])
    computed = []
    model[0].register_forward_hook(lambda _m, _i, out: computed.append(str(out.dtype)))
    x, y = torch.randn(4, 8), torch.randn(4, 1)  # fp32 inputs and targets, as a user's loader gives
    out = model(x)
    F.mse_loss(out, y).backward()
    grads = [p.grad for p in model.parameters()]
    return {
        "output": str(out.dtype),
        "computed": computed,
        "grads": all(g is not None and bool(g.full_tensor().isfinite().all()) for g in grads),
        "grad_dtype": {str(g.dtype) for g in grads},
    }
