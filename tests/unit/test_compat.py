"""Compatibility (the code cannot take intact bytes: stop, name the keys) is told apart from
integrity (bad bytes: quarantine, fall back), in one process without a process group."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from elastic_trainer.checkpoint import compat, layout
from elastic_trainer.checkpoint.catalog import Catalog
from elastic_trainer.checkpoint.load_planner import load_planner
from elastic_trainer.checkpoint.state import (
    ModelState,
    NamedStates,
    OptimizerState,
    PerRank,
    SchedulerState,
    state_types,
)
from elastic_trainer.errors import CheckpointIntegrityError
from elastic_trainer.storage.fs import open_storage


class Counter:
    optional_on_load = False

    def __init__(self, n=0):
        self.n = n

    def state_dict(self):
        return {"n": torch.tensor(self.n)}

    def load_state_dict(self, sd):
        self.n = int(sd["n"])


def _states(dim=4, opt_cls=torch.optim.AdamW, **extra):
    model = nn.Linear(dim, 2)
    opt = opt_cls(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    return {
        "model": ModelState(model),
        "optim": OptimizerState(model, opt),
        "lr_scheduler": SchedulerState(sched),
        **extra,
    }


def _save(tmp_path, states, world_size=1):
    path = str(tmp_path / "ck")
    dcp.save(states, checkpoint_id=path, no_dist=True)
    return dcp.FileSystemReader(path).read_metadata(), {"world_size": world_size, "state_types": state_types(states)}


def test_identical_state_fits(tmp_path):
    md, manifest = _save(tmp_path, _states())
    assert compat.check(_states(), md, manifest, 1).ok


def test_an_added_stateful_is_named_with_its_keys_unless_optional(tmp_path):
    md, manifest = _save(tmp_path, _states())
    report = compat.check(_states(counter=Counter()), md, manifest, 1)
    assert list(report.problems) == ["counter"] and "counter.n" in report.problems["counter"][0]
    msg = report.message("step-00000010")
    assert "step-00000010" in msg and "counter" in msg and "optional_on_load" in msg and "checkpoint.resume" in msg
    opt = Counter()
    opt.optional_on_load = True
    report = compat.check(_states(counter=opt), md, manifest, 1)
    assert report.ok and report.added == ["counter.n"] and report.absent == ["counter"]


def test_a_removed_stateful_is_ignored_and_named(tmp_path):
    md, manifest = _save(tmp_path, _states(counter=Counter()))
    report = compat.check(_states(), md, manifest, 1)
    assert report.ok and report.ignored == ["counter"]


def test_shape_dtype_and_optimizer_type_differences_are_named(tmp_path):
    md, manifest = _save(tmp_path, _states())
    report = compat.check(_states(dim=5), md, manifest, 1)
    assert any(
        "model.weight is float32[2, 4] in the checkpoint, float32[2, 5] in the code" in x
        for x in report.problems["model"]
    )
    report = compat.check(_states(opt_cls=torch.optim.Adam), md, manifest, 1)  # the same keys as AdamW
    assert report.problems["optim"] == [
        "the checkpoint holds torch.optim.adamw.AdamW, the code registers torch.optim.adam.Adam"
    ]
    doubled = _states()
    doubled["counter"] = Counter()
    md2, manifest2 = _save(tmp_path / "b", doubled)
    half = _states()
    half["counter"] = Counter()
    half["counter"].state_dict = lambda: {"n": torch.tensor(1.0)}  # float now
    report = compat.check(half, md2, manifest2, 1)
    assert report.problems["counter"] == ["counter.n is int64[] in the checkpoint, float32[] in the code"]


def test_a_dict_of_optimizers_records_each_type(tmp_path):
    model = nn.Linear(4, 2)
    a, b = torch.optim.AdamW([model.weight], lr=0.1), torch.optim.SGD([model.bias], lr=0.1)
    states = {
        "model": ModelState(model),
        "optim": NamedStates({"a": OptimizerState(model, a), "b": OptimizerState(model, b)}),
    }
    assert state_types(states)["optim"] == {"a": "torch.optim.adamw.AdamW", "b": "torch.optim.sgd.SGD"}
    md, manifest = _save(tmp_path, states)
    states2 = {
        "model": ModelState(model),
        "optim": NamedStates(
            {"a": OptimizerState(model, torch.optim.Adam([model.weight], lr=0.1)), "b": OptimizerState(model, b)}
        ),
    }
    assert compat.check(states2, md, manifest, 1).problems["optim"] == [
        "a: the checkpoint holds torch.optim.adamw.AdamW, the code registers torch.optim.adam.Adam"
    ]


def test_per_rank_state_at_another_world_size_is_refused_unless_it_reshards(tmp_path):
    tally = PerRank(Counter(3))
    tally.bind(0, 2)
    md, manifest = _save(tmp_path, {"tally": tally}, world_size=2)
    assert compat.check({"tally": tally}, md, manifest, 2).ok
    wider = PerRank(Counter())
    wider.bind(0, 3)
    (line,) = compat.check({"tally": wider}, md, manifest, 3).problems["tally"]
    assert "saved by 2 ranks cannot be loaded by 3" in line and "reshard_state_dict" in line

    class Resharding(Counter):
        def reshard_state_dict(self, saved, rank, world_size):
            return {"n": sum(s["n"] for s in saved)}

    ok = PerRank(Resharding())
    ok.bind(0, 3)
    assert compat.check({"tally": ok}, md, manifest, 3).ok


def test_per_rank_copies_round_trip_and_reshard_through_the_hook(tmp_path):
    class Resharding(Counter):
        def reshard_state_dict(self, saved, rank, world_size):
            return {"n": torch.tensor(sum(int(s["n"]) for s in saved) * 10 + rank)}

    path = str(tmp_path / "ck")
    copies = {}
    for rank in (0, 1):  # two ranks' copies in one checkpoint, as DCP writes them at world 2
        p = PerRank(Counter(rank + 5))
        p.bind(rank, 2)
        copies.update(p.state_dict())
    dcp.save({"tally": copies}, checkpoint_id=path, no_dist=True)
    back = PerRank(Counter())
    back.bind(1, 2)
    back.expect_world(2)
    dcp.load({"tally": back}, checkpoint_id=path, no_dist=True)
    assert back.obj.n == 6, "rank 1 gets rank 1's copy back"
    wider = PerRank(Resharding())
    wider.bind(2, 3)
    wider.expect_world(2)
    dcp.load({"tally": wider}, checkpoint_id=path, no_dist=True)
    assert wider.obj.n == (5 + 6) * 10 + 2


def test_scheduler_state_reads_checkpoints_written_before_the_full_state(tmp_path):
    """Legacy layout (``last_epoch``/``last_lr`` only): its position still resumes."""
    model = nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    old = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    for _ in range(3):
        opt.step()
        old.step()
    path = str(tmp_path / "ck")
    dcp.save(
        {"lr_scheduler": {"last_epoch": torch.tensor(3), "last_lr": torch.tensor([0.125], dtype=torch.float64)}},
        checkpoint_id=path,
        no_dist=True,
    )
    opt2 = torch.optim.AdamW(model.parameters(), lr=1.0)
    state = SchedulerState(torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 0.5**s))
    states = {"lr_scheduler": state}
    dcp.load(states, checkpoint_id=path, planner=load_planner(states), no_dist=True)
    assert state.scheduler.last_epoch == 3 and opt2.param_groups[0]["lr"] == 0.125


def test_plateau_scheduler_keeps_best_and_bad_epochs(tmp_path):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=3)
    for loss in (1.0, 0.5, 0.7, 0.8):
        sched.step(loss)
    path = str(tmp_path / "ck")
    dcp.save({"s": SchedulerState(sched)}, checkpoint_id=path, no_dist=True)
    back = SchedulerState(
        torch.optim.lr_scheduler.ReduceLROnPlateau(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0), patience=3)
    )
    dcp.load({"s": back}, checkpoint_id=path, planner=load_planner({"s": back}), no_dist=True)
    assert (back.scheduler.best, back.scheduler.num_bad_epochs) == (0.5, 2)


def test_integrity_and_compatibility_failures_are_told_apart():
    assert compat.is_integrity(CheckpointIntegrityError("x: checksum mismatch (corrupted shard)"))
    assert compat.is_integrity(FileNotFoundError("/abs/path/__0_0.distcp"))
    assert compat.is_integrity(pickle.UnpicklingError("invalid load key"))
    assert not compat.is_integrity(KeyError("n"))
    assert not compat.is_integrity(RuntimeError("Error(s) in loading state_dict: size mismatch"))
    line = compat.one_line(
        FileNotFoundError(2, "No such file or directory", "/very/secret/root/step-00000010/__0_0.distcp")
    )
    assert (
        line.startswith("FileNotFoundError: ") and "/very" not in line and "__0_0.distcp" in line and "\n" not in line
    )


def _commit(tmp_path, step, version=layout.MANIFEST_VERSION):
    root = tmp_path / "root"
    d = root / layout.step_dir_name(step)
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"m")
    (d / "__0_0.distcp").write_bytes(b"data")
    import xxhash

    files = {
        ".metadata": {"size": 1, "xxh3": xxhash.xxh3_64_intdigest(b"m")},
        "__0_0.distcp": {"size": 4, "xxh3": xxhash.xxh3_64_intdigest(b"data")},
    }
    m = layout.build_manifest(
        step=step, world_size=1, mesh_shape=[1], files=files, created=0.0, torch_version="x", fingerprint="f"
    )
    m["version"] = version
    (d / layout.MANIFEST).write_text(json.dumps(layout.seal(m, None)))
    return root


def test_a_format_this_version_cannot_read_stops_naming_both_versions(tmp_path):
    root = _commit(tmp_path, 5)
    _commit(tmp_path, 10, version=layout.MANIFEST_VERSION + 1)
    plan = Catalog(open_storage(str(root)), key=None).plan_resume("latest")
    assert plan.chosen is None and plan.incompatible[0] == "step-00000010", "never fall back past a newer format"
    reason = plan.stop_reason()
    assert (
        f"format version {layout.MANIFEST_VERSION + 1}" in reason
        and f"reads format {layout.MANIFEST_VERSION}" in reason
        and "upgrade" in reason
    )


@pytest.mark.parametrize("resume", ["latest"])
def test_commits_that_all_fail_stop_instead_of_a_fresh_start(tmp_path, resume):
    root = _commit(tmp_path, 5)
    cat = Catalog(open_storage(str(root)), key=None)
    assert cat.plan_resume(resume).stop_reason() is None
    cat.quarantine.mark("step-00000005", "load failed: OSError: reset")
    plan = cat.plan_resume(resume)
    assert plan.chosen is None and "step-00000005" in plan.stop_reason() and "ckpt release" in plan.stop_reason()
    assert cat.plan_resume("none").stop_reason() is None, "checkpoint.resume = none starts over on purpose"


def test_release_reverifies_every_byte(tmp_path):
    root = _commit(tmp_path, 5)
    cat = Catalog(open_storage(str(root)), key=None)
    cat.quarantine.mark("step-00000005", "load failed: OSError: reset")
    shard = root / "step-00000005" / "__0_0.distcp"
    shard.write_bytes(b"dat4")  # same size, bad bytes
    with pytest.raises(CheckpointIntegrityError, match="stays quarantined.*checksum mismatch"):
        cat.quarantine.release("step-00000005")
    assert (root / "step-00000005" / layout.QUARANTINE).exists()
    shard.write_bytes(b"data")
    assert cat.quarantine.release("step-00000005")["reason"] == "load failed: OSError: reset"
    assert (
        not (root / "step-00000005" / layout.QUARANTINE).exists()
        and cat.plan_resume("latest").chosen.name == "step-00000005"
    )


def test_a_dict_of_optimizers_and_schedulers_round_trips(tmp_path):
    """Several optimizers over one model (a Muon + AdamW split, a generator and a discriminator)."""

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        a, b = (
            torch.optim.AdamW(model[0].parameters(), lr=0.1),
            torch.optim.SGD(model[1].parameters(), lr=0.1, momentum=0.9),
        )
        sa, sb = torch.optim.lr_scheduler.StepLR(a, 2), torch.optim.lr_scheduler.ExponentialLR(b, 0.5)
        states = {
            "model": ModelState(model),
            "optim": NamedStates({"a": OptimizerState(model, a), "b": OptimizerState(model, b)}),
            "lr_scheduler": NamedStates({"a": SchedulerState(sa), "b": SchedulerState(sb)}),
        }
        return model, (a, b), (sa, sb), states

    model, opts, scheds, states = build()
    for _ in range(3):
        model(torch.ones(2, 4)).sum().backward()
        for o, s in zip(opts, scheds, strict=True):
            o.step()
            s.step()
            o.zero_grad()
    path = str(tmp_path / "ck")
    dcp.save(states, checkpoint_id=path, no_dist=True)
    model2, opts2, scheds2, states2 = build()
    md = dcp.FileSystemReader(path).read_metadata()
    assert compat.check(states2, md, {"world_size": 1, "state_types": state_types(states)}, 1).ok
    dcp.load(states2, checkpoint_id=path, planner=load_planner(states2), no_dist=True)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters(), strict=True))
    assert [s.get_last_lr() for s in scheds] == [s.get_last_lr() for s in scheds2] and scheds2[1].last_epoch == 3
    assert torch.equal(
        opts[1].state[model[1].weight]["momentum_buffer"], opts2[1].state[model2[1].weight]["momentum_buffer"]
    )
