"""``ckpt audit`` in one process: its verdicts beside the commits (never in their files), the
resume that skips a suspect commit and everything descending from it, the retention that keeps
them and the newest certified one, and the audit's own decisions (which commits, the replay's
config, which rank and tensor differ) with the replay's launch replaced by a fake that writes
what a replay would. tests/e2e/test_audit.py runs the real replay."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from elastic_trainer import cli, contract
from elastic_trainer.checkpoint import audit, integrity, layout, tools
from elastic_trainer.checkpoint.catalog import Catalog
from elastic_trainer.checkpoint.layout import Candidate
from elastic_trainer.config import Config, config_from_dict, toml_text
from elastic_trainer.errors import ConfigError
from elastic_trainer.events import EventLog
from elastic_trainer.storage.fs import open_storage
from tests.unit.test_catalog import _commit

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(step: int, flipped: bool = False, log: str | None = None) -> dict:
    w = torch.full((16,), float(step))
    if flipped:
        w[3] += 2**-10  # what a flipped low bit leaves: finite, close
    train: dict = {"step": step} if log is None else {"step": step, "log": log}  # log: bookkeeping, an object
    return {"model": {"w": w, "b": torch.arange(4.0) + step}, "train": train}


def _recorded(run_dir: Path, root: Path) -> dict:
    cfg = Config().to_dict()
    cfg["run"]["dir"], cfg["checkpoint"]["dir"] = str(run_dir), str(root)
    return cfg


def _save(
    cat: Catalog, step: int, parent: str | None, *, flipped: bool = False, extra: dict | None = None, log=None
) -> str:
    """A real world-1 DCP save through the checksummed writer, committed with ``parent``."""
    name = layout.next_dir_name(step, {c.name for c in cat.scan()})
    writer = integrity.ChecksummedWriter(cat.storage.dcp.writer(cat.storage.join(name)))
    dcp.save(_state(step, flipped, log), storage_writer=writer)
    _commit(cat, name, step, parent, seq=step, extra=extra)
    return name


def _chain(
    cat: Catalog, steps: list[int], flipped_from: int | None = None, extra: dict | None = None, log=None
) -> list[str]:
    names, parent = [], None
    for s in steps:
        parent = _save(cat, s, parent, flipped=flipped_from is not None and s >= flipped_from, extra=extra, log=log)
        names.append(parent)
    return names


def _verdict(cat: Catalog, name: str, verdict: str, **fields) -> None:
    c = next(c for c in cat.scan() if c.name == name)
    assert c.manifest is not None
    audit.record_verdict(cat.storage, name, {"verdict": verdict, "manifest_checksum": c.manifest["checksum"], **fields})


@pytest.fixture
def cat(tmp_path) -> Catalog:
    return Catalog(open_storage(str(tmp_path / "ckpt")), key=None, events=EventLog(None))


# ------------------------------------------------------------------ verdicts and the resume
def test_a_verdict_lies_beside_the_commit_and_leaves_its_files_alone(cat):
    (five,) = _chain(cat, [5])
    root = Path(cat.storage.root)
    before = {p.name: p.read_bytes() for p in (root / five).iterdir()}
    _verdict(cat, five, layout.SUSPECT, rank=0, tensor="model.w")
    after = {p.name: p.read_bytes() for p in (root / five).iterdir()}
    assert after.pop(layout.AUDIT) and after == before
    (c,) = cat.scan()
    assert c.verdict == layout.SUSPECT and layout.AUDIT not in c.files and cat.problem(c) is None


def test_a_verdict_on_other_bytes_counts_for_nothing(cat):
    (five,) = _chain(cat, [5])
    audit.record_verdict(cat.storage, five, {"verdict": layout.SUSPECT, "manifest_checksum": "another commit's"})
    assert cat.scan()[0].verdict is None and layout.suspect_reasons(cat.scan()) == {}


def test_latest_skips_a_suspect_commit_and_its_descendants_and_quarantines_nothing(cat):
    five, ten, fifteen, twenty = _chain(cat, [5, 10, 15, 20], flipped_from=15)
    _verdict(cat, ten, layout.CERTIFIED)
    _verdict(cat, fifteen, layout.SUSPECT, rank=1, tensor="model.w")
    plan = cat.plan_resume("latest")
    assert plan.chosen is not None and plan.chosen.name == ten
    assert [s for s, _ in plan.skipped] == [20, 15]
    assert all(layout.is_suspect_reason(r) for _, r in plan.skipped)
    assert "descends from suspect checkpoint step-00000015" in plan.skipped[0][1]
    assert "rank 1, tensor model.w" in plan.skipped[1][1]
    assert plan.corrupt == [] and plan.stop_reason() is None, "never quarantined; an older commit loads"
    head = cat.head()
    assert head is not None and head.name == ten
    rows = {r["name"]: r["status"] for r in tools.list_checkpoints(cat.storage.root)}
    assert rows == {five: "lineage", ten: "head", fifteen: "suspect", twenty: "suspect"}
    assert {c.name for c in cat.scan()} == {five, ten, fifteen, twenty}, "nothing deleted"


def test_resume_certified_only_loads_the_newest_certified_commit_and_keeps_the_newer_ones(cat):
    five, ten, fifteen = _chain(cat, [5, 10, 15])
    strict = Catalog(cat.storage, key=None, events=EventLog(None), certified_only=True)
    plan = strict.plan_resume("latest")
    assert plan.chosen is None and plan.corrupt == [] and "not certified" in (plan.stop_reason() or ""), (
        "commits, none certified: stop (exit 2), never train from step 0"
    )
    _verdict(cat, five, layout.CERTIFIED)
    _verdict(cat, ten, layout.CERTIFIED)
    plan = strict.plan_resume("latest")
    assert plan.chosen is not None and plan.chosen.name == ten
    assert [s for s, _ in plan.skipped] == [15] and layout.UNCERTIFIED_REASON in plan.skipped[0][1]
    assert not layout.is_suspect_reason(plan.skipped[0][1]) and plan.corrupt == []
    assert cat.plan_resume("latest").chosen.name == fifteen, "off by default"  # type: ignore[union-attr]
    assert {c.name for c in cat.scan()} == {five, ten, fifteen}, "nothing deleted"


def test_an_explicit_resume_of_a_suspect_step_is_refused_naming_why(cat):
    _, _, fifteen = _chain(cat, [5, 10, 15])
    _verdict(cat, fifteen, layout.SUSPECT, rank=0, tensor="model.w")
    sel = layout.select_for_resume(cat.scan(), "15")
    assert sel.chosen is None and layout.is_suspect_reason(sel.skipped[0][1])


def test_when_every_commit_is_suspect_the_start_stops_rather_than_train_from_zero(cat):
    (five,) = _chain(cat, [5])
    _verdict(cat, five, layout.SUSPECT)
    plan = cat.plan_resume("latest")
    stop = plan.stop_reason()
    assert plan.chosen is None and stop is not None and "suspect" in stop


def test_retention_keeps_suspect_commits_and_the_newest_certified_one(cat):
    """A run resumed from the certified step 10 past its suspect 15 and 20: its own commits
    (15.1, 20.1, 25, 30) take the lineage; with keep_last=2 retention deletes the older of them
    and step 5, but never the certified step 10 nor the suspect ones (off the lineage)."""
    five, ten, fifteen, twenty = _chain(cat, [5, 10, 15, 20], flipped_from=15)
    _verdict(cat, ten, layout.CERTIFIED)
    _verdict(cat, fifteen, layout.SUSPECT)
    parent = ten
    for s in (15, 20, 25, 30):
        parent = _save(cat, s, parent)
    deleted = cat.pruner.retention(parent, keep_last=2, keep_every=0)
    assert sorted(deleted) == [5, 15, 20]
    left = {c.name for c in cat.scan()}
    assert {ten, fifteen, twenty, "step-00000025", "step-00000030"} == left


# ------------------------------------------------------------------ the audit's decisions
def test_the_audited_chain_follows_the_lineage_of_the_last_step(cat):
    _, ten, _ = _chain(cat, [5, 10, 15])
    again = _save(cat, 15, ten)  # a resumed run's own commit of step 15: the newest of that step
    chain = audit.audit_chain(cat.scan(), 5, 15, None)
    assert [c.name for c in chain] == ["step-00000005", ten, again]


@pytest.mark.parametrize(
    "first, last, flag, words",
    [
        (10, 10, "--from", "a commit below --to"),
        (15, 10, "--from", "a commit below --to"),
        (7, 15, "--from", "step 7 is not a valid commit under ROOT (valid commits: 5, 10, 15)"),
        (5, 25, "--to", "step 25 is not a valid commit"),
    ],
)
def test_a_bad_range_is_refused_naming_the_flag(cat, first, last, flag, words):
    _chain(cat, [5, 10, 15])
    with pytest.raises(ConfigError, match=flag) as e:
        audit.audit_chain(cat.scan(), first, last, None)
    assert words in str(e.value)


def test_a_step_off_the_lineage_is_refused(cat):
    _chain(cat, [5, 10])
    _save(cat, 15, None)  # a fresh lineage
    with pytest.raises(ConfigError, match="step 5 is not an ancestor of the commit of step 15"):
        audit.audit_chain(cat.scan(), 5, 15, None)


def test_the_replay_config_is_the_runs_own_but_where_it_writes_and_how_it_runs(tmp_path):
    recorded = _recorded(tmp_path / "run", tmp_path / "ckpt")
    recorded["model"]["init_from"] = "/weights"
    recorded["elastic"].update(nnodes="2:4", rdzv_endpoint="store:29400", nproc_per_node=8)
    manifest = {"step": 5, "world_size": 3}
    base = Candidate(5, "step-00000005", manifest, {})
    cfg = audit.replay_config(recorded, str(tmp_path / "scratch"), base, [10, 15, 20])
    parsed = config_from_dict(tomllib.loads(toml_text(cfg)))
    c = parsed.checkpoint
    assert c.dir == str(tmp_path / "scratch" / "checkpoints") and parsed.run.dir == str(tmp_path / "scratch" / "run")
    assert (c.resume, c.interval_steps, c.keep_last, c.local_dir) == ("5", 5, 4, "")
    assert parsed.data.cache_dir == str(tmp_path / "run" / "data-cache")
    e = parsed.elastic
    assert (e.nnodes, e.nproc_per_node, e.rdzv_endpoint, e.max_restarts) == ("1", 3, "", 0)
    assert parsed.model.init_from == "" and "model.init_from" in c.allow_changes
    assert parsed.train == Config().train and parsed.model.dim == Config().model.dim, "the run's own training"


def test_the_differing_shards_are_named_by_rank_and_metadata_never_compared():
    ours = {"files": {".metadata": {"xxh3": 1}, "__0_0.distcp": {"xxh3": 2}, "__1_0.distcp": {"xxh3": 3}}}
    same = {"files": {".metadata": {"xxh3": 9}, "__0_0.distcp": {"xxh3": 2}, "__1_0.distcp": {"xxh3": 3}}}
    assert audit.differing_files(ours, same) == []
    other = {"files": {".metadata": {"xxh3": 1}, "__0_0.distcp": {"xxh3": 2}, "__1_0.distcp": {"xxh3": 4}}}
    assert audit.differing_files(ours, other) == [(1, "__1_0.distcp")]


def test_the_rank_and_tensor_that_differ_most_are_named():
    scores = {(0, "optim.state.w.exp_avg"): 1e-7, (1, "model.w"): 3e-4, (0, "model.w"): 2e-6}
    assert audit.locate(scores) == (1, "model.w")
    assert audit.locate({(1, "b"): 0.0, (0, "a"): 0.0}) == (0, "a"), "a tie: the lowest rank"


# ------------------------------------------------------------------ the audit, its replay faked
class _FakeReplay:
    """What the replay's launch does, in this process: the clean state of every step it saves,
    committed under the scratch root its config names, from the commit it was given."""

    def __init__(self, faulty_calls: tuple[int, ...] = ()):
        self.calls: list[tuple[list[str], dict[str, str]]] = []
        self.faulty_calls = faulty_calls  # the calls that compute wrong (a faulty audit machine): flipped saves
        self.resumes: list[str] = []  # each call's checkpoint.resume
        self.log: str | None = None  # bookkeeping the replay writes (an object, not a tensor)

    def __call__(self, argv: list[str], env: dict[str, str], log: str, cwd: str | None) -> int:
        self.calls.append((argv, env))
        cfg = tomllib.loads(Path(argv[-1]).read_text())
        c = cfg["checkpoint"]
        self.resumes.append(c["resume"])
        scratch = Catalog(open_storage(c["dir"]), key=None)
        if c["resume"] == "latest":  # --from 0: the run's start, nothing copied
            assert scratch.scan() == []
            first, parent = 1, None
        else:
            (base,) = scratch.scan()
            assert base.step == int(c["resume"]) and scratch.problem(base) is None, "the base commit, copied whole"
            first, parent = base.step + 1, base.name
        stop = int(env[contract.REPLAY_TO_STEP_ENV])
        for step in range(first, stop + 1):
            if step % c["interval_steps"] == 0 or step == stop:  # the cadence, and the final commit
                parent = _save(scratch, step, parent, flipped=len(self.calls) - 1 in self.faulty_calls, log=self.log)
        return 0


def test_the_audit_certifies_what_the_replay_reproduces_and_names_where_it_does_not(cat, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _, ten, fifteen, twenty = _chain(
        cat, [5, 10, 15, 20], flipped_from=15, extra={"config": _recorded(run_dir, Path(cat.storage.root))}
    )
    fake = _FakeReplay()
    os.environ[contract.INJECT_FAULT_ENV] = "bitflip@rank=0,step=13"
    try:
        verdicts = audit.audit(cat.storage.root, 5, 20, scratch_parent=str(tmp_path), replay=fake)
    finally:
        del os.environ[contract.INJECT_FAULT_ENV]
    assert [v.line() for v in verdicts] == [
        "step 10 certified",
        "step 15 suspect: rank 0 (node 0), first tensor model.w",
        "step 20 suspect: rank 0 (node 0), first tensor model.w",
    ]
    assert len(fake.calls) == 2 and [v.replays for v in verdicts] == [2, 2, 2], "a second replay confirmed it"
    argv, env = fake.calls[0]
    assert argv[-2] == "launch" and contract.INJECT_FAULT_ENV not in env and env[contract.REPLAY_TO_STEP_ENV] == "20"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("elastic-trainer-audit-")] == [], "scratch removed"
    by_name = {c.name: c for c in cat.scan()}
    assert by_name[ten].verdict == layout.CERTIFIED and by_name[fifteen].verdict == layout.SUSPECT
    assert json.loads((Path(cat.storage.root) / twenty / layout.AUDIT).read_text())["tensor"] == "model.w"
    events = [json.loads(line) for line in (run_dir / contract.EVENTS_FILE).read_text().splitlines()]
    assert [(e["event"], e["step"], e["verdict"]) for e in events] == [
        ("checkpoint_audited", 10, "certified"),
        ("checkpoint_audited", 15, "suspect"),
        ("checkpoint_audited", 20, "suspect"),
    ]
    assert all(not contract.event_problems(e["event"], set(e) - {"event", "time"}) for e in events)
    assert cat.plan_resume("latest").chosen.name == ten  # type: ignore[union-attr]


def test_a_commit_that_records_no_config_cannot_be_replayed(cat):
    _chain(cat, [5, 10])
    with pytest.raises(ConfigError, match="records no configuration"):
        audit.audit(cat.storage.root, 5, 10, replay=_FakeReplay())


@pytest.mark.parametrize(
    "args, words",
    [
        (["--from", "5", "--to", "10"], "no checkpoint root at"),
        (["--from", "10", "--to", "5"], "a commit below --to"),
        (["--to", "10"], "'--from': required (or --follow)"),
        (["--follow", "--from", "5"], "leave --from and --to out"),
    ],
)
def test_the_command_exits_2_on_bad_input_naming_the_problem(tmp_path, capsys, args, words):
    root = tmp_path / "missing" if "no checkpoint root" in words else tmp_path
    assert cli.main(["ckpt", "audit", str(root), *args]) == 2
    assert words in capsys.readouterr().err


def test_a_range_across_a_change_of_world_size_is_refused(cat):
    five, _ = _chain(cat, [5, 10])
    c = next(c for c in cat.scan() if c.name == five)
    manifest = layout.seal({**(c.manifest or {}), "step": 15, "world_size": 2, "parent": "step-00000010"}, None)
    grown = Candidate(15, "step-00000015", manifest, c.files)
    candidates = [*cat.scan(), grown]
    with pytest.raises(ConfigError, match=r"world size changed from 1 \(step 10\) to 2 \(step 15\)"):
        audit.audit_chain(candidates, 5, 15, None)


def _relaunched_chain(cat: Catalog, run_dir: Path, flipped_from: int | None = None) -> list[str]:
    """Steps 5 and 10 by a launch of 20 steps, 15 and 20 by its relaunch to train longer (30)."""
    short, longer = _recorded(run_dir, Path(cat.storage.root)), _recorded(run_dir, Path(cat.storage.root))
    short["train"]["steps"], longer["train"]["steps"] = 20, 30
    names, parent = [], None
    for s in (5, 10, 15, 20):
        flipped = flipped_from is not None and s >= flipped_from
        parent = _save(cat, s, parent, flipped=flipped, extra={"config": short if s <= 10 else longer})
        names.append(parent)
    return names


def test_a_range_across_a_relaunch_with_other_train_settings_is_replayed_in_segments(cat, tmp_path):
    _relaunched_chain(cat, tmp_path / "run")
    segments = audit.replay_segments(audit.audit_chain(cat.scan(), 5, 20, None))
    assert [(base.step, [c.step for c in commits]) for base, commits in segments] == [(5, [10]), (10, [15, 20])]
    fake = _FakeReplay()
    verdicts = audit.audit(cat.storage.root, 5, 20, scratch_parent=str(tmp_path), replay=fake)
    assert [v.line() for v in verdicts] == ["step 10 certified", "step 15 certified", "step 20 certified"]
    replays = [tomllib.loads(Path(argv[-1]).read_text()) if Path(argv[-1]).exists() else None for argv, _ in fake.calls]
    assert len(fake.calls) == 2 and replays == [None, None], "two replays, their scratch removed"
    assert [env[contract.REPLAY_TO_STEP_ENV] for _, env in fake.calls] == ["10", "20"]


def test_after_a_suspect_commit_later_segments_are_not_replayed(cat, tmp_path):
    _relaunched_chain(cat, tmp_path / "run", flipped_from=10)
    fake = _FakeReplay()
    verdicts = audit.audit(cat.storage.root, 5, 20, scratch_parent=str(tmp_path), replay=fake)
    assert [v.line() for v in verdicts] == [
        "step 10 suspect: rank 0 (node 0), first tensor model.w",
        "step 15 suspect: descends from suspect step 10",
        "step 20 suspect: descends from suspect step 10",
    ]
    assert len(fake.calls) == 2, "the first segment, replayed twice (a suspect confirmed); the later ones not"
    assert cat.plan_resume("latest").chosen.step == 5  # type: ignore[union-attr]


class _Counters:
    def __init__(self):
        self.counted: dict[str, float] = {}

    def counter(self, name: str, value: float = 1.0, **labels) -> None:
        self.counted[name] = self.counted.get(name, 0.0) + value


def test_the_resume_event_and_a_counter_name_the_suspect_commits_passed_over(tmp_path):
    import time
    from types import SimpleNamespace

    from elastic_trainer.checkpoint.manager import LoadResult
    from elastic_trainer.checkpoint.state import TrainState
    from elastic_trainer.checkpoint.timeline import Timeline
    from elastic_trainer.runtime import ends

    events = EventLog(str(tmp_path / "events.jsonl"))
    metrics = _Counters()
    session = SimpleNamespace(events=events, metrics=metrics, started=time.monotonic(), world_size=2, rank=0)
    skipped = [
        (20, "suspect: descends from suspect checkpoint step-00000015"),
        (15, "suspect: silent data corruption found by ckpt audit (rank 1, tensor model.w)"),
        (12, "uncommitted (no manifest)"),
    ]
    loaded = LoadResult(10, "step-00000010", {"world_size": 2}, 0.1, skipped)
    fields = {"decision_reads": 3}  # what the restore adds
    ends.resumed(session, loaded, TrainState(), "restored", fields, Timeline())  # type: ignore[arg-type]
    (rec,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert rec["event"] == "resume" and rec["suspect"] == [15, 20] and len(rec["skipped"]) == 3
    assert metrics.counted == {"elastic_trainer_checkpoint_suspect_skipped_total": 2}


def test_the_replay_runs_the_built_in_trainer_or_the_recorded_script_in_its_directory(tmp_path):
    for manifest in ({}, {"command": {"entry": "launch"}}):
        argv, cwd, only = audit.replay_command(manifest, "r.toml")
        assert argv[-2:] == ["launch", "r.toml"] and cwd is None and only is None, "the whole recorded config"
    with pytest.raises(ConfigError, match="another launcher"):
        audit.replay_command({"command": {"entry": "other"}}, "r.toml")
    command = {"entry": "run", "argv": ["-m", "pkg.train", "--steps", "20"], "cwd": str(tmp_path)}
    argv, cwd, only = audit.replay_command({"command": {**command, "set": ["run.dir"]}}, "r.toml")
    assert argv[-7:] == ["run", "--config", "r.toml", "-m", "pkg.train", "--steps", "20"] and cwd == str(tmp_path)
    assert only == ["run.dir"], "the keys its command line set"
    with pytest.raises(ConfigError, match="not a directory here"):
        audit.replay_command({"command": {**command, "cwd": str(tmp_path / "gone")}}, "r.toml")


def test_a_second_replay_breaks_the_tie_when_the_audits_own_machine_computed_wrong(cat, tmp_path):
    _chain(cat, [5, 10, 15], extra={"config": _recorded(tmp_path / "run", Path(cat.storage.root))})
    fake = _FakeReplay(faulty_calls=(0,))
    verdicts = audit.audit(cat.storage.root, 5, 15, scratch_parent=str(tmp_path), replay=fake)
    assert [v.line() for v in verdicts] == ["step 10 certified", "step 15 certified"]
    assert [v.replays for v in verdicts] == [2, 2] and len(fake.calls) == 2
    single = audit.audit(cat.storage.root, 5, 15, replay=_FakeReplay(faulty_calls=(0,)), confirm=False)
    assert [v.suspect for v in single] == [True, True], "one replay, and it computed wrong"


def test_the_tie_break_keeps_the_first_replays_location_when_neither_reproduces():
    a = [audit.Verdict(10, "s10", 5, True, rank=1, node=0, tensor="w", seconds=1.0)]
    b = [audit.Verdict(10, "s10", 5, True, rank=0, node=0, tensor="v", seconds=2.0)]
    (v,) = audit.tie_break(a, b)
    assert (v.suspect, v.rank, v.tensor, v.replays, v.seconds) == (True, 1, "w", 2, 3.0)
    (v,) = audit.tie_break(a, [audit.Verdict(10, "s10", 5, False, seconds=2.0)])
    assert not v.suspect and v.replays == 2


def test_from_0_replays_the_run_from_its_start_and_judges_its_first_commit(cat, tmp_path):
    _chain(cat, [5, 10], extra={"config": _recorded(tmp_path / "run", Path(cat.storage.root))})
    fake = _FakeReplay()
    verdicts = audit.audit(cat.storage.root, 0, 10, scratch_parent=str(tmp_path), replay=fake)
    assert [v.line() for v in verdicts] == ["step 5 certified", "step 10 certified"]
    assert [v.from_step for v in verdicts] == [0, 0] and len(fake.calls) == 1
    with pytest.raises(ConfigError, match="must be 0"):
        audit.audit_chain(cat.scan(), -1, 10, None)


def test_follow_audits_each_new_head_from_the_newest_certified_commit_until_told(cat, tmp_path):
    recorded = {"config": _recorded(tmp_path / "run", Path(cat.storage.root))}
    five, ten = _chain(cat, [5, 10], extra=recorded)
    fake, lines = _FakeReplay(), []

    def sleep(seconds):  # the running job commits step 15 while the follower waits
        assert seconds == 7.0
        _save(cat, 15, ten, extra=recorded)

    done = audit.follow(
        cat.storage.root, until=15, poll_seconds=7.0, report=lambda v: lines.append(v.line()), sleep=sleep, replay=fake
    )
    assert done is True
    assert lines == ["step 5 certified", "step 10 certified", "step 15 certified"]
    assert [env[contract.REPLAY_TO_STEP_ENV] for _, env in fake.calls] == ["10", "15"]
    assert fake.resumes == ["latest", "10"], "the run's start, then the newest certified commit"


def test_follow_ends_false_at_the_first_suspect_commit(cat, tmp_path):
    _chain(cat, [5, 10], flipped_from=10, extra={"config": _recorded(tmp_path / "run", Path(cat.storage.root))})
    lines: list[str] = []
    done = audit.follow(cat.storage.root, report=lambda v: lines.append(v.line()), replay=_FakeReplay(), confirm=False)
    assert done is False and lines[0] == "step 5 certified" and lines[1].startswith("step 10 suspect")


def test_bookkeeping_objects_that_differ_leave_a_commit_certified_and_are_named(cat, tmp_path):
    """A framework's state may hold wall-clock times (the Transformers ``TrainerState``'s log): only
    tensors decide; the objects that differed are named in the verdict."""
    _chain(
        cat,
        [5, 10, 15],
        flipped_from=15,
        extra={"config": _recorded(tmp_path / "run", Path(cat.storage.root))},
        log="t=1.0",
    )
    fake = _FakeReplay()
    fake.log = "t=2.5"
    verdicts = audit.audit(cat.storage.root, 5, 15, replay=fake, confirm=False)
    assert [v.line().split(":")[0] for v in verdicts] == ["step 10 certified", "step 15 suspect"]
    assert verdicts[0].objects == ("train.log",) and verdicts[0].event_fields()["objects"] == ["train.log"]
    assert verdicts[1].tensor == "model.w", "a tensor that differs decides"
