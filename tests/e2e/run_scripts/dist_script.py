"""A plain torch.distributed script for ``elastic-trainer run`` tests (no elastic_trainer API).

    dist_script.py MODE OUT_DIR [extra args...]

Every rank joins a gloo group and all-reduces its rank; rank 0 writes
``OUT_DIR/result-<restart>.json`` (world size, sum, the argv it got, its environment's
TORCHELASTIC_* values). Modes:

* ``ok``: exit 0.
* ``crash_once``: rank 1 exits 3 in the first incarnation (restart count 0), later ones succeed.
* ``preempt``: write ``OUT_DIR/ready-<rank>``, then wait; SIGTERM -> exit 75 ("saved, requeue me").
* ``hang_once``: under torch's file-timer watchdog (TORCHELASTIC_TIMER_FILE, set by the
  supervisor), rank 0 of the first incarnation stops making progress inside a 2 s scope.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist


def main() -> int:
    mode, out = sys.argv[1], sys.argv[2]
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if mode == "preempt":
        signal.signal(signal.SIGTERM, lambda *_: os._exit(75))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if mode == "crash_once" and restart == 0 and rank == 1:
        return 3
    if mode == "hang_once":
        from torch.distributed.elastic import timer

        timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
        with timer.expires(after=2):
            if restart == 0 and rank == 0:
                time.sleep(600)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    if mode == "preempt":
        open(os.path.join(out, f"ready-{rank}"), "w").close()
        while True:
            time.sleep(0.1)
    if rank == 0:
        env = {k: v for k, v in os.environ.items() if k.startswith(("TORCHELASTIC_", "ELASTIC_TRAINER_RUN"))}
        with open(os.path.join(out, f"result-{restart}.json"), "w") as f:
            json.dump({"world": world, "sum": t.item(), "argv": sys.argv[1:], "restart": restart, "env": env}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
