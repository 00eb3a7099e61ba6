"""Planning from a training script whose loss and model classes are defined in the script
itself (``__main__``), where the planner's child process must find them.

Inside a job with a real process group the planner runs in a child process, and pickle sends
functions and classes by reference: the child prepares the parent's main script as Python's
``spawn`` does (fsdp_compile/planning/child_process.py). One run under torchrun (2 ranks, a tiny
model) of a script with everything at its top level, which ``spawn`` itself cannot take, and one
plain run of a script that keeps its program under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

DEFINITIONS = '''
import os

import torch
import torch.nn.functional as F
from torch import nn

import fsdp_compile
from fsdp_compile.planning import Cluster
from fsdp_compile_lab.host import HostCPU

VOCAB, DIM = 64, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def loss_fn(logits):
    flat = logits.reshape(-1, VOCAB).float()
    return F.cross_entropy(flat, torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device))


def cpu_cluster(world):
    return Cluster(name="test-cpu", nodes=1, devices_per_node=world, device_memory=1 << 30,
                   peak_flops={torch.float32: 2e10}, memory_bandwidth=5e9, intra_node_bandwidth=1e9,
                   inter_node_bandwidth=None, intra_node_latency=2e-5, inter_node_latency=None,
                   device_type="cpu", host=HostCPU(op_overhead=1e-5))
'''

# Everything at the top level, as a first training script is written: the planner's child must
# not run this program again (it would join the job, and train).
TOP_LEVEL_SCRIPT = DEFINITIONS + '''
import torch.distributed as dist

with open(os.environ["RUNS_LOG"], "a") as log:
    log.write(f"rank {os.environ['RANK']} ran the script\\n")
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = TinyLM()
tokens = torch.zeros(2, 8, dtype=torch.long)
if rank == 0:
    plan = fsdp_compile.plan(model, (tokens,), cluster=cpu_cluster(world), loss_fn=loss_fn,
                             strategies=["FULL_SHARD", "NO_SHARD"], prefetch=(1,))
    print(f"plan rows: {sorted(r.strategy for r in plan.rows)}; best: {plan.best.strategy}")
backend = fsdp_compile.backend("auto", compiler="aot_eager", example_inputs=(tokens,), loss_fn=loss_fn,
                               cluster=cpu_cluster(world), memory_budget=1 << 30,
                               plan_options={"strategies": ["FULL_SHARD"], "prefetch": (1,)})
backend.shard(model)
print(f"rank {rank}: strategy='auto' chose {backend.strategy.name}")
dist.destroy_process_group()
'''

# The program under the main guard: the child runs the whole script (as spawn does), so a name
# the definitions read that a call computes (SCALE) is there too.
GUARDED_SCRIPT = DEFINITIONS + '''
SCALE = float(os.environ.get("LOSS_SCALE", "2"))


def describe(model, inputs, **kwargs):
    return f"{type(model).__name__} of {sum(p.numel() for p in model.parameters())} on {inputs[0].device}, " \\
           f"scale {SCALE}, run as {__name__}"


if __name__ == "__main__":
    from fsdp_compile.planning.child_process import run_in_subprocess

    with open(os.environ["RUNS_LOG"], "a") as log:
        log.write("the program ran\\n")
    print(run_in_subprocess(describe, TinyLM(), (torch.zeros(2, 8, dtype=torch.long),)))
'''


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join((str(ROOT), str(ROOT / "lab"))),
            "RUNS_LOG": str(tmp_path / "runs.log")}


# -m slow: two torchrun processes that import, plan and train (20 s on 2 cores); the default run
# plans a guarded script in the child (below).
@pytest.mark.slow
def test_a_script_with_everything_at_its_top_level_plans_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TOP_LEVEL_SCRIPT))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script)], env=_env(tmp_path), capture_output=True, text=True, timeout=900,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "plan rows: ['FULL_SHARD', 'NO_SHARD']; best: " in proc.stdout
    assert "rank 0: strategy='auto' chose FULL_SHARD" in proc.stdout
    assert "rank 1: strategy='auto' chose FULL_SHARD" in proc.stdout
    # The planning children (two on rank 0) ran the definitions only, not the program.
    assert sorted((tmp_path / "runs.log").read_text().splitlines()) == ["rank 0 ran the script",
                                                                        "rank 1 ran the script"]


def test_a_script_that_guards_its_program_runs_whole_in_the_child(tmp_path: Path) -> None:
    script = tmp_path / "guarded.py"
    script.write_text(textwrap.dedent(GUARDED_SCRIPT))
    proc = subprocess.run([sys.executable, str(script)], env=_env(tmp_path), capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # The child got the model as a meta-device copy and the script's own SCALE, computed by a
    # call at its top level; the guarded program ran once, in the parent.
    assert proc.stdout.strip().splitlines()[-1] == "TinyLM of 2720 on meta, scale 2.0, run as __mp_main__"
    assert (tmp_path / "runs.log").read_text() == "the program ran\n"
