"""The documented snippets run as written. The five-call block of docs/own-script.md (the
package docstring shows the same text) and its lower-level loop, pasted into a script that
imports only what the documents say is the user's (a model with ``Block``s, a map-style dataset, a
``collate_fn``, a loss, a plain ``DataLoader(batch_size=8)``) from a module next to it — so a
snippet that lacks an import of its own fails here as it would for a user —, under
``elastic-trainer run`` with the default config: at 1, 2 and 3 workers with the loop body
unchanged, and a resume at another world size continues the run (within 1e-5, no dropout). The
``train.*`` table of docs/own-script.md names every key; docs/own-model.md's factory builds."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import elastic_trainer
from tests import runs

DOC = runs.REPO / "docs" / "own-script.md"

# What the snippets leave to the user, in a module of its own: the script imports these names
# from it and nothing else, so the snippets' own imports are all the script has. No dropout: across
# world sizes the per-rank random streams are reseeded, so only a dropout-free model continues
# within 1e-5.
USER_DEFS = """
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


def build_model():
    torch.manual_seed(0)  # the same first weights at every world size
    return nn.Sequential(Block(), Block(), nn.Linear(16, 1))


class Points(Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(200, 16, generator=g)
        self.y = self.x.sum(1, keepdim=True).sin()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def collate(items):
    return {k: torch.stack([item[k] for item in items]) for k in items[0]}


def compute_loss(model, batch):
    return F.mse_loss(model(batch["x"]), batch["y"])


def batch_for(step):  # the lower-level loop's data: this rank's part of a fixed global batch of 4
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, 16, generator=g)[dist.get_rank() :: dist.get_world_size()]
    return {"x": x, "y": x.sum(1, keepdim=True).sin()}


dataset = Points()
total_steps = int(os.environ["SNIPPET_STEPS"])
"""
USER_NAMES = "Block, batch_for, build_model, collate, compute_loss, dataset, total_steps"


def user_script(tmp_path: Path, name: str, code: str) -> Path:
    """``code`` as a script in ``tmp_path`` that imports the user's names from a module next to it."""
    (tmp_path / "user_defs.py").write_text(USER_DEFS)
    path = tmp_path / name
    path.write_text(f"from user_defs import {USER_NAMES}\n\n" + code)
    return path


def blocks(text: str) -> list[str]:
    return [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]


def five_call_block() -> str:
    return DOC.read_text().split("## Your loop in five calls\n\n```python\n", 1)[1].split("```", 1)[0]


def lower_level_block() -> str:
    [block] = [b for b in blocks(DOC.read_text()) if "\nstep = ckpt.resume()" in b]
    return block


def test_the_package_docstring_shows_the_five_call_block_of_the_docs():
    shown = elastic_trainer.__doc__.split("::\n\n", 1)[1].split("\n\n``batch``", 1)[0]
    assert textwrap.dedent(shown).strip() == five_call_block().strip()
    assert [b.split("\n", 1)[0] for b in blocks(DOC.read_text())] == ["import torch", "import sys"], (
        "a new code block in docs/own-script.md needs a run here"
    )


def _run(tmp_path: Path, script: Path, run_dir: Path, ckpt: Path, nproc: int, steps: int, *flags: str):
    env = runs.env_for_tests({"SNIPPET_STEPS": str(steps)})
    return subprocess.run(
        runs.run_args(run_dir, ckpt, *flags, nproc=nproc, max_restarts=0) + [str(script)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=240,
    )


def test_the_five_call_block_runs_at_one_two_and_three_workers_and_resumes_at_another(tmp_path):
    five_calls = user_script(tmp_path, "five_calls.py", five_call_block())
    # the reference: 2 workers, 6 steps; then 2 workers to step 2, 1 worker to step 4 and 3 workers
    # to step 6, each from the last one's checkpoint: the first launch's global batch (8 × 2) throughout
    two = _run(tmp_path, five_calls, tmp_path / "two", tmp_path / "two-ckpt", 2, 6)
    assert two.returncode == 0, two.stderr[-3000:]
    got: dict[int, float] = {}
    for nproc, steps in ((2, 2), (1, 4), (3, 6)):
        r = _run(tmp_path, five_calls, tmp_path / f"w{nproc}", tmp_path / "ckpt", nproc, steps)
        assert r.returncode == 0, r.stderr[-3000:]
        got.update(runs.step_losses(tmp_path / f"w{nproc}"))
    [resume] = runs.read_events(tmp_path / "w3", "resume")
    assert (resume["step"], resume["from_world_size"], resume["world_size"]) == (4, 1, 3)
    ref = runs.step_losses(tmp_path / "two")
    assert sorted(ref) == sorted(got) == list(range(1, 7))
    assert all(runs.close_rel(ref[k], got[k], 1e-5) for k in ref), (ref, got)
    # what the loop uses of train.* is never silently replaced: the recorded global batch, and
    # a micro-batch that disagrees with the DataLoader's batch_size, stop with exit 2 naming the key
    for key, value, ckpt in (("global_batch_size", 24, "ckpt"), ("micro_batch_size", 2, "fresh")):
        r = _run(tmp_path, five_calls, tmp_path / key, tmp_path / ckpt, 1, 8, "--set", f"train.{key}={value}")
        assert r.returncode == 2 and f"train.{key}" in r.stderr, (key, r.stderr[-3000:])


def test_the_lower_level_block_runs_at_one_and_two_workers(tmp_path):
    setup = five_call_block().split("\nfor step, batch in ckpt.steps", 1)[0].replace(", data=loader)", ")")
    lower_level = user_script(tmp_path, "lower_level.py", setup + "\n" + lower_level_block())
    for nproc in (1, 2):
        r = _run(tmp_path, lower_level, tmp_path / f"run{nproc}", tmp_path / f"ckpt{nproc}", nproc, 3)
        assert r.returncode == 0, r.stderr[-3000:]
        assert sorted(runs.step_losses(tmp_path / f"run{nproc}")) == [1, 2, 3]


def test_the_train_key_table_of_the_docs_names_every_train_key():
    import dataclasses

    from elastic_trainer.config import TrainConfig

    table = DOC.read_text().split("**Which `train.*` keys your loop uses.**", 1)[1].split("\n\n", 2)[1]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `train.")]
    named = {k.strip("` ") for row in rows for k in row.split(",")}
    keys = {f.name for f in dataclasses.fields(TrainConfig)}
    assert {k.removeprefix("train.") for k in named} == keys


def test_the_own_model_factory_block_builds_shards_and_runs(tmp_path, monkeypatch):
    """docs/own-model.md's factory and its [model] table, as the built-in trainer takes them."""
    import importlib
    import tomllib

    import torch

    from elastic_trainer.config import config_from_dict
    from elastic_trainer.models.spec import on_meta
    from elastic_trainer.worker import parallel
    from elastic_trainer.worker.model_factory import build_model_spec

    text = (runs.REPO / "docs" / "own-model.md").read_text().split("## In under 20 lines", 1)[1]
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    table = tomllib.loads(text.split("```toml\n", 1)[1].split("```", 1)[0])
    (tmp_path / "mymodels.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = config_from_dict(table)
    with on_meta():
        spec = build_model_spec(cfg.model)
    assert [c.__name__ for c in parallel.resolve_shard_classes(spec.model, spec.shard_modules)] == ["Layer"]
    logits = importlib.import_module("mymodels").build(cfg.model)(torch.zeros(2, 8, dtype=torch.long))
    assert logits.shape == (2, 8, cfg.model.vocab_size)
