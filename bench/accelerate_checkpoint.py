"""An Accelerate loop's checkpoints: Accelerate's own ``save_state`` against elastic_trainer's
(``from elastic_trainer.accelerate import Accelerator``), side by side in one invocation.

Each variant trains the same Llama (``--hidden``/``--layers``) for ``--steps`` steps in a fresh
process (a world of one), variants interleaved over ``--repeats`` rounds:

* ``none``: no saves; ``accelerate``: Accelerate's ``save_state`` every ``--every`` steps;
  ``elastic``: elastic_trainer's ``save_state`` every ``--every`` steps;
* per save: the time inside ``save_state()``, and training blocked by it: that time plus what the
  next step took beyond the run's median step (a save still copying the state out holds it);
* throughput with saves ÷ without;
* time to resume: ``load_state()`` of what the run saved, in a new process.

    python bench/accelerate_checkpoint.py                 # the BENCHMARKS.md figures
    python bench/accelerate_checkpoint.py --smoke         # tiny, seconds: the harness works
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from common import REPO, loadavg, median, table

VARIANTS = ("none", "accelerate", "elastic")


def worker(a: argparse.Namespace) -> None:
    import torch
    from accelerate.utils import ProjectConfiguration, set_seed
    from torch.utils.data import DataLoader
    from transformers import LlamaConfig, LlamaForCausalLM

    if a.variant == "elastic":
        from elastic_trainer.accelerate import Accelerator
    else:
        from accelerate import Accelerator
    pc = ProjectConfiguration(project_dir=a.dir, automatic_checkpoint_naming=True, total_limit=2)
    acc = Accelerator(project_config=pc, cpu=True)
    set_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=a.hidden,
        intermediate_size=2 * a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 512, (512, 32), generator=g)]
    loader = DataLoader(data, batch_size=4, shuffle=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, loader = acc.prepare(model, opt, loader)
    if a.resume:
        t0 = time.perf_counter()
        acc.load_state()
        print(json.dumps({"resume_s": time.perf_counter() - t0}), flush=True)
        return
    calls, steps, step, t0 = [], [], 0, time.perf_counter()
    while step < a.steps:
        for batch in loader:
            s0 = time.perf_counter()
            acc.backward(model(**batch).loss)
            opt.step()
            opt.zero_grad()
            step += 1
            if a.variant != "none" and step % a.every == 0:
                c0 = time.perf_counter()
                acc.save_state()
                calls.append(time.perf_counter() - c0)
            steps.append(time.perf_counter() - s0)
            if step == a.steps:
                break
    train_s = time.perf_counter() - t0
    acc.end_training()
    # Training blocked by each save: its call, plus what the next step took beyond the run's median
    # step (a save still copying the state out holds the next optimizer step).
    typical = sorted(steps)[len(steps) // 2]
    blocked = [
        c + max(0.0, steps[s] - typical) for c, s in zip(calls, range(a.every, len(steps), a.every), strict=False)
    ]
    print(json.dumps({"train_s": train_s, "calls": calls, "blocked": blocked}), flush=True)


def run(variant: str, a: argparse.Namespace, d: str, resume: bool = False) -> dict:
    args = [sys.executable, __file__, "--worker", "--variant", variant, "--dir", d, "--steps", str(a.steps)]
    args += ["--every", str(a.every), "--hidden", str(a.hidden), "--layers", str(a.layers)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    r = subprocess.run(args + (["--resume"] if resume else []), capture_output=True, text=True, env=env, cwd=REPO)
    if r.returncode != 0:
        raise SystemExit(f"{variant}: exit {r.returncode}\n{r.stderr[-3000:]}")
    return json.loads([x for x in r.stdout.splitlines() if x.startswith("{")][-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=45)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny and fast: the harness works")
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    if a.smoke:
        a.steps, a.every, a.hidden, a.layers, a.repeats = 12, 5, 32, 1, 1
    res: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    resume: dict[str, list[float]] = {v: [] for v in VARIANTS[1:]}
    load = loadavg()[0]
    for _ in range(a.repeats):
        for v in VARIANTS:
            d = tempfile.mkdtemp(prefix=f"acc-bench-{v}-")
            try:
                res[v].append(run(v, a, d))
                if v != "none":
                    resume[v].append(run(v, a, d, resume=True)["resume_s"])
            finally:
                shutil.rmtree(d, ignore_errors=True)
    base = median([r["train_s"] for r in res["none"]])
    rows = []
    out = {}
    for v in VARIANTS[1:]:
        train = median([r["train_s"] for r in res[v]])
        calls = [c for r in res[v] for c in r["calls"]]
        out[v] = {
            "save_call_s": median(calls),
            "blocked_per_save_s": median([b for r in res[v] for b in r["blocked"]]),
            "throughput_ratio": base / train,
            "resume_s": median(resume[v]),
        }
        o = out[v]
        rows.append(
            [
                v,
                f"{o['save_call_s']:.4f}",
                f"{o['blocked_per_save_s']:.4f}",
                f"{o['throughput_ratio']:.3f}",
                f"{o['resume_s']:.3f}",
            ]  # fmt: skip
        )
    print(table(["variant", "save_state() s", "blocked per save s", "throughput vs none", "resume s"], rows))
    e, acc = out["elastic"], out["accelerate"]
    print(
        json.dumps(
            {
                "load_avg": load,
                "none_train_s": base,
                "blocked_ratio": e["blocked_per_save_s"] / acc["blocked_per_save_s"],
                "call_ratio": e["save_call_s"] / acc["save_call_s"],
                "throughput_ratio": e["throughput_ratio"],
                "resume_ratio": e["resume_s"] / acc["resume_s"],
                **{f"{v}_{k}": x for v, o in out.items() for k, x in o.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
