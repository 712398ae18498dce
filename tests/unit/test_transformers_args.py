"""What each ``TrainingArguments`` field means under elastic_trainer.transformers (the table of
docs/transformers.md), in one process: the settings it maps, the ones it refuses (exit 2 naming
the field, before training), the resume argument, and the Trainer state a checkpoint holds."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from accelerate.state import AcceleratorState
from transformers import TrainingArguments
from transformers.trainer_callback import EarlyStoppingCallback, TrainerControl, TrainerState

from elastic_trainer.config import Config
from elastic_trainer.errors import ConfigError
from elastic_trainer.transformers import (
    _TrainerState,
    apply_settings,
    check_args,
    commit_step,
    launch_settings,
    train_settings,
)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """``TrainingArguments`` sets up Accelerate's process state; later tests start without it."""
    yield
    AcceleratorState._reset_state(True)


def args(tmp_path, **kw) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), report_to="none", **kw)


def test_seed_data_seed_and_save_total_limit_become_the_run_s_settings(tmp_path):
    assert launch_settings(args(tmp_path, seed=5)) == {"train.seed": 5}
    assert launch_settings(args(tmp_path, seed=5, data_seed=9, save_total_limit=4)) == {
        "train.seed": 9,
        "checkpoint.keep_last": 4,
    }


@pytest.mark.parametrize(
    ("strategy", "steps", "resume", "want"),
    [
        ("steps", 25, None, {"checkpoint.interval_steps": 25}),
        ("epoch", 25, None, {"checkpoint.interval_steps": 0}),
        ("best", 25, None, {"checkpoint.interval_steps": 0}),
        ("no", 25, 40, {"checkpoint.interval_steps": 0, "checkpoint.resume": "40"}),
    ],
)
def test_save_strategy_and_save_steps_become_the_cadence(strategy, steps, resume, want):
    assert train_settings(strategy, steps, resume) == want


def test_settings_of_the_command_line_win_and_the_rest_are_set():
    session = SimpleNamespace(cfg=Config(), explicit=frozenset({"checkpoint.keep_last"}), rank=1)
    apply_settings(session, {"checkpoint.keep_last": 9, "checkpoint.interval_steps": 7, "train.seed": 3})
    assert session.cfg.checkpoint.keep_last == Config().checkpoint.keep_last
    assert session.cfg.checkpoint.interval_steps == 7 and session.cfg.train.seed == 3


@pytest.mark.parametrize(
    ("field", "kw"),
    [
        ("load_best_model_at_end", {"load_best_model_at_end": True, "eval_strategy": "no", "save_strategy": "no"}),
        ("save_only_model", {"save_only_model": True}),
        ("auto_find_batch_size", {"auto_find_batch_size": True}),
        ("train_sampling_strategy", {"train_sampling_strategy": "group_by_length"}),
    ],
)
def test_what_cannot_be_served_is_refused_naming_the_field(tmp_path, field, kw):
    with pytest.raises(ConfigError, match=f"TrainingArguments.{field}"):
        check_args(args(tmp_path, **kw))


def test_the_defaults_and_the_example_s_arguments_are_served(tmp_path):
    check_args(args(tmp_path))
    check_args(args(tmp_path, save_steps=5, save_total_limit=2, lr_scheduler_type="cosine", warmup_steps=3))


def test_resume_from_checkpoint_names_the_newest_commit_or_one_commit():
    assert commit_step(None) is None and commit_step(True) is None and commit_step(False) is None
    assert commit_step("s3://bucket/run/step-00000040/") == 40
    with pytest.raises(ConfigError, match="TrainingArguments.resume_from_checkpoint"):
        commit_step("out/checkpoint-40")


def test_the_trainer_state_and_the_callbacks_state_round_trip():
    early = EarlyStoppingCallback(early_stopping_patience=3)
    early.early_stopping_patience_counter = 2
    restored = []

    def trainer(state):
        t = SimpleNamespace(state=state, control=TrainerControl(), callback_handler=SimpleNamespace(callbacks=[early]))
        t._load_callback_state = lambda: restored.append(dict(t.state.stateful_callbacks))
        return t

    saved = trainer(TrainerState(global_step=7, epoch=0.5, max_steps=20, log_history=[{"loss": 1.5, "step": 7}]))
    blob = _TrainerState(saved).state_dict()
    assert json.loads(blob["trainer_state"])["global_step"] == 7
    fresh = trainer(TrainerState(max_steps=30))
    _TrainerState(fresh).load_state_dict(blob)
    assert fresh.state.global_step == 7 and fresh.state.epoch == 0.5 and fresh.state.log_history[-1]["loss"] == 1.5
    assert fresh.state.max_steps == 30, "this launch's max_steps, not the checkpoint's"
    [callbacks] = restored
    assert callbacks["EarlyStoppingCallback"]["attributes"]["early_stopping_patience_counter"] == 2
