"""On a CUDA machine: a model built on the CPU trains on the GPU once sharded over an NCCL group.

Skipped without a GPU (CI has none); run them on a GPU machine. Each case runs in a fresh process
with a one-rank NCCL group, so nothing of it stays in the test session.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import assert_inductor_keeps_the_order, inductor_orders_in_a_fake_world

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    import fsdp_compile
    from fsdp_compile.models.gpt import GPT, GPTConfig

    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=67, block_size=16, n_layer=2, n_head=2, d_model=32)
    model = GPT(cfg)  # built on the CPU
    model.register_buffer("scale", torch.ones(1))
    reference = GPT(cfg).cuda()
    reference.load_state_dict({{k: v for k, v in model.state_dict().items() if k != "scale"}})
    mp = fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    backend = fsdp_compile.backend("FULL_SHARD", compiler="{compiler}", mixed_precision=mp)
    backend.shard(model)
    devices = {{p.to_local().device.type for p in model.parameters()}} | {{b.device.type for b in model.buffers()}}
    assert devices == {{"cuda"}}, devices
    idx = torch.randint(0, 67, (2, 17), device="cuda")
    loss = torch.nn.functional.cross_entropy(torch.compile(model, backend=backend)(idx[:, :-1]).float().reshape(-1, 67),
                                             idx[:, 1:].reshape(-1))
    loss.backward()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        expected = torch.nn.functional.cross_entropy(reference(idx[:, :-1]).float().reshape(-1, 67),
                                                     idx[:, 1:].reshape(-1))
    assert abs(loss.item() - expected.item()) < 2e-2, (loss.item(), expected.item())
    assert all(p.grad is not None and p.grad.to_local().is_cuda for p in model.parameters())
    dist.destroy_process_group()
    print("ok")
""")


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_a_cpu_built_model_is_moved_to_the_mesh_device_and_trains(compiler: str, tmp_path: Path) -> None:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000),
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(compiler=compiler)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


def test_inductor_runs_the_collectives_in_the_scheduled_order_on_cuda(tmp_path: Path) -> None:
    """As tests/test_graphs.py checks on the CPU, with Triton's wrapper code (a fake world of two
    ranks in one process: one GPU has no second rank): Inductor's peak-memory reordering stays
    off for graphs with collectives, so the step issues and waits for them in our scheduled
    order and keeps every overlap our schedule made."""
    order = inductor_orders_in_a_fake_world("FULL_SHARD", "cuda", tmp_path)
    assert order["reordered_for_memory"] == 0
    assert_inductor_keeps_the_order(order)
    assert any(order["graph"][1][1]), "the scheduled backward overlaps nothing"
