"""docs/lightning.md's precision recipe for FSDP1 migrators — ``Trainer(precision="32-true")`` with
an FSDP2 ``MixedPrecisionPolicy`` in ``configure_model`` — keeps the master weights and the optimizer
state fp32, in memory and in the committed checkpoint, while the sharded blocks compute in bf16.

The recipe is taken from the document itself (its ``configure_model`` lines, its policy and its
``precision=``) and run with the real ``lightning`` and ``elastic_trainer.lightning.Strategy`` in one
process (``python script.py``: a world of one, gloo on CPU), two optimizer steps. The same run's step
events carry the learning rate each optimizer step used (Lightning steps an ``interval="step"``
scheduler before ``on_train_batch_end``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

from tests import runs

DOC = runs.REPO / "docs" / "lightning.md"

pytestmark = pytest.mark.timeout(180)


def recipe() -> tuple[str, str, str]:
    """The FSDP1 section's diff: (its import line, its ``configure_model`` method, its ``precision=``)."""
    section = DOC.read_text().split("## Coming from `FSDPStrategy", 1)[1]
    diff = section.split("```diff\n", 1)[1].split("```", 1)[0].splitlines()
    added = [line[1:] for line in diff if line.startswith("+")]
    [imports] = [line for line in added if line.startswith("from torch.distributed.fsdp import")]
    start = next(i for i, line in enumerate(added) if line.strip() == "def configure_model(self):")
    end = next(i for i, line in enumerate(added) if line.strip().startswith("fully_shard(self,"))
    method = textwrap.dedent("\n".join(added[start : end + 1]))
    [precision] = re.findall(r'precision="([^"]+)"', "\n".join(added))
    return imports, method, precision


SCRIPT = """
import json
import sys

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from elastic_trainer.checkpoint.tools import inspect_checkpoint
from elastic_trainer.lightning import Strategy
{imports}


class LitModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 1)
        self.computed = set()

    def forward(self, x):
        for block in self.model.layers:
            x = torch.tanh(block(x))
            self.computed.add(str(x.dtype))
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x).float(), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        return {{"optimizer": opt, "lr_scheduler": {{"scheduler": sched, "interval": "step"}}}}

{method}


run_dir = sys.argv[1]
g = torch.Generator().manual_seed(0)
data = DataLoader(TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)), batch_size=4)
module = LitModel()
trainer = L.Trainer(
    accelerator="cpu",
    strategy=Strategy(overrides=[f"run.dir={{run_dir}}", f"checkpoint.dir={{run_dir}}/ckpt"]),
    precision="{precision}",
    max_steps=2,
    enable_checkpointing=False,
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(module, data)
state = [v for s in trainer.optimizers[0].state.values() for v in s.values() if torch.is_tensor(v)]
saved = inspect_checkpoint(f"{{run_dir}}/ckpt")
# the tensors of the model's and the optimizer's state (param_groups' hyper-parameters are objects)
entries = {{k: e["dtype"] for k, e in saved["entries"].items() if k.startswith(("model.", "optim.")) and "dtype" in e}}
result = {{
    "params": sorted({{f"{{type(p).__name__}} {{p.dtype}}" for p in module.parameters()}}),
    "optimizer_state": sorted({{str(v.dtype) for v in state if v.is_floating_point()}}),
    "optimizer_tensors": len(state),
    "computed": sorted(module.computed),
    "saved_step": saved["step"],
    "saved": sorted(set(entries.values())),
    "saved_weights": sum(k.startswith("model.") for k in entries),
    "saved_moments": sum(k.startswith("optim.") and k.endswith(".exp_avg") for k in entries),
}}
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def fit(tmp_path_factory):
    """The recipe's run: (what the script reports, its run directory)."""
    tmp = tmp_path_factory.mktemp("lightning-precision")
    imports, method, precision = recipe()
    assert precision == "32-true" and "param_dtype=torch.bfloat16" in method and "mp_policy=" in method
    script = tmp / "recipe.py"
    script.write_text(SCRIPT.format(imports=imports, method=textwrap.indent(method, "    "), precision=precision))
    r = subprocess.run(
        [sys.executable, str(script), str(tmp / "run")],
        capture_output=True,
        text=True,
        env=runs.env_for_tests(),
        cwd=tmp,
        timeout=150,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), tmp / "run"


def test_the_fsdp1_sections_recipe_keeps_master_weights_and_optimizer_state_fp32(fit):
    got, _ = fit
    assert got["computed"] == ["torch.bfloat16"], "the policy casts: the blocks compute in bf16"
    assert got["params"] == ["DTensor torch.float32"], "sharded master weights stay fp32"
    assert got["optimizer_tensors"] > 0 and got["optimizer_state"] == ["torch.float32"], "AdamW's state stays fp32"
    assert got["saved_step"] == 2 and got["saved_weights"] == got["saved_moments"] == 6, "the final step's commit"
    assert got["saved"] == ["float32"], "the checkpoint holds fp32 weights and optimizer state"


def test_the_step_events_lr_is_the_rate_the_step_used(fit):
    _, run_dir = fit
    assert [(e["step"], e["lr"]) for e in runs.read_events(run_dir, "step")] == [(1, 1e-2), (2, 5e-3)]
