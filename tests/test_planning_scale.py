"""plan() of Llama-3-70B-shaped models never allocates their parameters.

Each plan runs in a fresh subprocess that reports its peak resident memory before and after
``plan()``: the parameters the model describes are several times that budget, so a planner that
materialised them (or the gathered parameters, or real activations) would show up as growth.
How long the 80-layer plan for 512 H100s takes is measured by ``bench/plan_accuracy.py --part
scale`` (no timed assertions here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import json, resource, sys
    import torch
    import fsdp_compile
    from fsdp_compile.models.llama import Llama, LlamaConfig
    from fsdp_compile.planning import Cluster, plan
    from fsdp_compile.planning.cli import _token_loss

    layers, vocab, seq, nodes = (int(v) for v in sys.argv[1:5])
    with torch.device("meta"):
        model = Llama(LlamaConfig.llama3_70b(n_layers=layers, vocab_size=vocab, checkpoint_blocks=True))
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    tokens = torch.zeros(1, seq, dtype=torch.long, device="meta")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = plan(model, (tokens,), cluster=Cluster.preset("h100-sxm", nodes=nodes), loss_fn=_token_loss,
                  mixed_precision=fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                  strategies=["FULL_SHARD"], prefetch=(1,))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    row = result.row("FULL_SHARD")
    print(json.dumps({"param_bytes": param_bytes, "rss_growth": after - before, "rss_peak": after,
                      "world": result.world_size, "traced": row.traced, "fits": row.fits,
                      "still_meta": all(p.device.type == "meta" for p in model.parameters()),
                      "seconds": result.seconds}))
""")


def plan_in_fresh_process(layers: int, vocab: int, seq: int, nodes: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(layers), str(vocab), str(seq), str(nodes)],
                          check=False, capture_output=True, text=True, env=env, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_plan_of_a_llama3_70b_block_never_allocates_its_parameters():
    """One Llama-3-70B block and a 32k vocabulary (1.4B parameters, 5.6 GB in fp32) for 512 H100s:
    plan() must grow the process by far less than one gathered block (1.7 GB in bf16)."""
    r = plan_in_fresh_process(layers=1, vocab=32768, seq=1024, nodes=64)
    assert r["world"] == 512 and r["traced"] and r["still_meta"]
    assert r["param_bytes"] > 5e9
    assert r["rss_growth"] < 1 << 30, r


@pytest.mark.slow
def test_plan_of_llama3_70b_for_512_h100s_never_allocates_its_parameters():
    """The whole model (80 layers, 128k vocabulary, sequence 8192, activation checkpointing):
    282 GB of fp32 parameters, planned in a few GB at most."""
    r = plan_in_fresh_process(layers=80, vocab=128256, seq=8192, nodes=64)
    assert r["world"] == 512 and r["traced"] and r["still_meta"] and r["fits"]
    assert r["param_bytes"] > 2.5e11
    assert r["rss_growth"] < 2 << 30, r
