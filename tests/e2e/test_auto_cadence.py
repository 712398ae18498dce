"""checkpoint.interval_steps = "auto" under the elastic agent: 2 real gloo workers agree on the
interval rank 0 measures, announce it, and save (commit) at exactly the steps it implies."""

from tests import runs

STEPS = 30  # saves at 10 (the incarnation's first: no measurement), 20 (measured), then the new interval


def test_auto_interval_is_announced_and_every_rank_saves_at_its_steps(tmp_path, token_file):
    run = tmp_path / "run"
    # A prior of one failure per 0.01 s: once a save is measured, the optimum is the lower bound.
    # Young's sqrt(2 x save cost x MTBF) stays under 3 steps unless a save costs more than
    # (3 steps)^2 / 0.02 s: 0.28 s at 25 ms steps. (0.5 s left a fast machine's optimum at ~10.)
    cfg = runs.write_config(
        tmp_path / "c.toml",
        token_file,
        run,
        train={"steps": STEPS},
        checkpoint={
            "interval_steps": "auto",
            "auto_min_steps": 3,
            "auto_max_steps": 100,
            "auto_prior_mtbf_seconds": 0.01,
            "keep_last": 20,
        },
    )
    r = runs.run_launch(cfg, log=tmp_path / "c.log")
    assert r.returncode == 0, (tmp_path / "c.log").read_text()[-3000:]
    changes = runs.read_events(run, "checkpoint_interval_changed")
    first = changes[0]
    assert (first["step"], first["interval_steps"], first["previous"], first["reason"]) == (1, 10, None, "initial")
    assert first["failure_rate_per_h"] > 3600
    measured = [c for c in changes if c["reason"] == "measured"]
    # a high failure prior shortens it (toward auto_min_steps)
    assert measured and measured[0]["previous"] == 10 and 3 <= measured[0]["interval_steps"] < 10, changes
    assert measured[0]["save_cost_s"] >= 0 and measured[0]["step_seconds"] > 0 and measured[0]["step"] > 20
    # The steps the announced intervals imply (a change agreed at step s applies from the end of s).
    in_force, last, expect = None, 0, []
    by_step = {c["step"]: c["interval_steps"] for c in changes}
    for step in range(1, STEPS + 1):
        in_force = by_step.get(step, in_force)
        if step - last >= in_force or step == STEPS:
            expect.append(step)
            last = step
    committed = sorted(e["step"] for e in runs.read_events(run, "checkpoint_committed"))
    assert committed == expect, (committed, changes)
    assert expect[:2] == [10, 20] and len(expect) >= 4
