"""The planner chooses the TP degree: rows per degree, FSDP over dp = world / tp, TP parameters at
their TP-local size, TP collectives priced on the intra-node link, and the degrees it refuses."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from fsdp_compile.planning import Cluster, PlanError, plan

BATCH, SEQ, DIM, HIDDEN = 2, 8, 16, 32


class TPMLP(nn.Module):
    """An MLP every parameter of which the TP plan splits (float inputs, no embedding)."""

    n_heads = 4  # read by the planner's heads check

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, HIDDEN, bias=False)
        self.proj = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.relu(self.fc(x)))


def mlp_plan(model: nn.Module, tp_mesh) -> nn.Module:
    """Megatron's MLP split: fc column-wise, proj row-wise (one all-reduce forward, one backward)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(model, tp_mesh, {"fc": ColwiseParallel(), "proj": RowwiseParallel()})


class TokenMLP(TPMLP):
    """The same with token inputs and logits, for the CLI (``test_planning_tp:token_mlp``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, DIM)
        self.head = nn.Linear(DIM, 64, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(super().forward(self.emb(idx)))


def token_mlp() -> nn.Module:
    return TokenMLP()


def two_nodes() -> Cluster:
    """2 nodes x 2 devices: at world 4 FSDP over all ranks spans the nodes, a tp group of 2 does not."""
    return Cluster.preset("h100-sxm", nodes=2, devices_per_node=2)


@functools.cache
def mlp_plan_result():
    with torch.device("meta"):
        model = TPMLP()
    return plan(model, torch.zeros(BATCH, SEQ, DIM, device="meta"), cluster=two_nodes(), prefetch=(1,),
                strategies=["FULL_SHARD", "NO_SHARD"], tp_degrees=(1, 2), parallelize_fn=mlp_plan)


def test_rows_carry_the_tp_degree_and_fsdp_shards_over_world_over_tp() -> None:
    result = mlp_plan_result()
    assert sorted((r.strategy, r.tp) for r in result.rows) == [
        ("FULL_SHARD", 1), ("FULL_SHARD", 2), ("NO_SHARD", 1), ("NO_SHARD", 2)]
    params = DIM * HIDDEN * 2 * 4  # fp32 bytes of fc and proj
    states = {(r.strategy, r.tp): r.model_states["params"] for r in result.rows}
    # NO_SHARD: a rank holds its TP-local parameters whole, half of them at tp 2.
    assert states["NO_SHARD", 1] == params and states["NO_SHARD", 2] == params / 2
    # FULL_SHARD: over world 4 at tp 1, and the TP-local half over dp = 4 / 2 at tp 2.
    assert states["FULL_SHARD", 1] == params / 4 and states["FULL_SHARD", 2] == params / 2 / 2
    assert result.row("FULL_SHARD", tp=2).tp == 2 and result.best is not None
    text = str(result)
    assert " tp " in text.splitlines()[2] and "tp=2" not in text.splitlines()[2]


def test_tp_collectives_are_priced_on_the_intra_node_link() -> None:
    result = mlp_plan_result()
    flat, tp = result.row("FULL_SHARD", tp=1), result.row("FULL_SHARD", tp=2)
    # Without TP, FSDP's one group spans both nodes: nothing on the intra-node link.
    assert flat.bytes_per_step["intra"] == 0 and flat.tp_bytes_per_step == 0 and flat.bytes_per_step["inter"] > 0
    # proj's output all-reduce in forward, of the (batch, seq, dim) fp32 activation; a ring
    # all-reduce over 2 ranks sends its buffer once. (fc's input-gradient all-reduce in backward
    # does not run: the input needs no gradient.)
    activation = BATCH * SEQ * DIM * 4
    assert tp.tp_bytes_per_step == activation
    assert tp.bytes_per_step["intra"] == tp.tp_bytes_per_step  # the dp groups (ranks 0 and 2) span the nodes
    assert tp.bytes_per_step["inter"] > 0
    assert tp.tokens_per_second == pytest.approx(BATCH * SEQ / 2 / tp.step_seconds)  # a tp group shares its batch
    assert json.loads(json.dumps(tp.as_dict()))["tp"] == 2


def test_hybrid_strategies_shard_within_a_node_over_devices_per_node_over_tp() -> None:
    # 2 nodes x 4 devices at tp 2: a (dp_replicate 2, dp_shard 2, tp 2) mesh for the hybrid strategy,
    # (dp 4, tp 2) for the others; SHARD_GRAD_OP replays FULL_SHARD's joint graph (same layout).
    with torch.device("meta"):
        model = TPMLP()
    cluster = Cluster.preset("h100-sxm", nodes=2, devices_per_node=4)
    result = plan(model, torch.zeros(BATCH, SEQ, DIM, device="meta"), cluster=cluster, prefetch=(1,),
                  strategies=["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"], tp_degrees=(2,), parallelize_fn=mlp_plan)
    params = DIM * HIDDEN * 2 * 4
    rows = {r.strategy: r for r in result.rows}
    assert rows["HYBRID_SHARD"].model_states["params"] == params / 2 / 2  # TP-local over dp_shard = 4 / 2
    assert rows["FULL_SHARD"].model_states["params"] == params / 2 / 4  # TP-local over dp = 8 / 2
    assert result._context.traced[next(c for c in result._context.traced
                                       if c.strategy.name == "SHARD_GRAD_OP")].replayed
    for row in rows.values():
        assert row.tp == 2 and row.tp_bytes_per_step == BATCH * SEQ * DIM * 4


def test_strategies_with_nothing_left_to_shard_are_skipped_and_said() -> None:
    from fsdp_compile.planning.plan import _candidates

    candidates, skipped = _candidates(["FULL_SHARD", "HYBRID_SHARD"], ("module",), (1,), 16, 8, (1, 8))
    assert sorted((c.strategy.name, c.tp) for c in candidates) == [
        ("FULL_SHARD", 1), ("FULL_SHARD", 8), ("HYBRID_SHARD", 1)]
    assert any(line.startswith("HYBRID_SHARD at tp=8: no ranks left in a node") for line in skipped)
    candidates, skipped = _candidates(["FULL_SHARD", "NO_SHARD"], ("module",), (1,), 8, 8, (8,))
    assert [(c.strategy.name, c.tp) for c in candidates] == [("NO_SHARD", 8)]
    assert skipped == ["FULL_SHARD at tp=8: a data-parallel world of 1 has nothing to shard over"]


def test_refuses_a_degree_that_does_not_divide_a_node() -> None:
    with pytest.raises(PlanError, match=r"TP degree 4 does not divide the 2 devices of a node"):
        plan(TPMLP(), torch.zeros(BATCH, SEQ, DIM), cluster=two_nodes(), tp_degrees=(1, 4), parallelize_fn=mlp_plan)


def test_refuses_a_degree_that_does_not_divide_the_heads() -> None:
    from fsdp_compile.models.llama import Llama, LlamaConfig

    with torch.device("meta"):
        llama = Llama(LlamaConfig(n_heads=4, n_kv_heads=2))
    cluster = Cluster.preset("h100-sxm", nodes=1)
    with pytest.raises(PlanError, match=r"TP degree 4 does not divide the model's n_kv_heads=2"):
        plan(llama, torch.zeros(1, 8, dtype=torch.long), cluster=cluster, tp_degrees=(2, 4))
    model = TPMLP()
    model.n_heads = 6
    with pytest.raises(PlanError, match=r"TP degree 4 does not divide the model's n_heads=6"):
        plan(model, torch.zeros(BATCH, SEQ, DIM), cluster=cluster, tp_degrees=(4,), parallelize_fn=mlp_plan)


def test_a_custom_model_needs_parallelize_fn() -> None:
    with pytest.raises(PlanError, match=r"TP degrees \[2\] need parallelize_fn=.*TPMLP"):
        plan(TPMLP(), torch.zeros(BATCH, SEQ, DIM), cluster=two_nodes(), tp_degrees=(1, 2))


def test_the_built_in_models_bring_their_tp_plan() -> None:
    from fsdp_compile.models import gpt, llama
    from fsdp_compile.planning.tp import default_parallelize_fn

    with torch.device("meta"):
        assert default_parallelize_fn(llama.Llama(llama.LlamaConfig())) is llama.apply_tp
        assert default_parallelize_fn(gpt.GPT(gpt.GPTConfig())) is gpt.apply_tp
    assert default_parallelize_fn(TPMLP()) is None


def test_plan_command_takes_tp_degrees(tmp_path: Path, capsys) -> None:
    from fsdp_compile.__main__ import main

    out = tmp_path / "plan.json"
    code = main(["plan", "--model", "test_planning_tp:token_mlp", "--parallelize", "test_planning_tp:mlp_plan",
                 "--seq", "8", "--batch", "2", "--cluster", "h100-sxm", "--nodes", "2", "--devices-per-node", "2",
                 "--prefetch", "1", "--strategies", "FULL_SHARD", "--tp", "1,2", "--json", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0
    header = next(line for line in stdout.splitlines() if "strategy" in line and "bucket" in line)
    assert header.split()[:3] == ["strategy", "tp", "bucket"]
    assert sorted(r["tp"] for r in json.loads(out.read_text())["rows"]) == [1, 2]


def test_plan_command_names_the_degree_it_refuses(capsys) -> None:
    from fsdp_compile.__main__ import main

    assert main(["plan", "--model", "llama-tiny", "--seq", "8", "--cluster", "h100-sxm", "--tp", "1,3"]) == 2
    assert "TP degree 3 does not divide the 8 devices of a node" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--tp 'two'"):
        main(["plan", "--model", "llama-tiny", "--tp", "two"])


@pytest.mark.slow  # compare --tp 2 at world 4 (4 processes compile and train), and the 70B anchor at 2 layers
def test_tp_benchmark_runs_at_smoke_size(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, str(root / "bench" / "plan_tp.py"), "--smoke", "--steps", "4",
                           "--quiet-load", "100", "--out", str(tmp_path)], check=False, env=env, capture_output=True,
                          text=True, timeout=2400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "plan_tp_smoke.json").read_text())
    (run,) = data["measured"]["runs"]
    assert (run["strategy"], run["dp"], run["tp"]) == ("FULL_SHARD", 2, 2)
    # what the 2-D job's graphs sent, FSDP's and TP's collectives together, is what the plan predicted
    assert run["measured_wire_bytes"] == pytest.approx(run["predicted_wire_bytes"], rel=0.01)
    assert 0 < run["predicted_tp_wire_bytes"] < run["predicted_wire_bytes"]
    assert run["predicted_peak_bytes"] > 0 and run["measured_step_s"] > 0
    anchor = data["anchor"]
    assert anchor["layers"] == 2 and anchor["predicted"]["tokens_per_s_per_gpu"] > 0
    text = (tmp_path / "plan_tp_smoke.md").read_text()
    assert "## dp 2 x tp 2, measured on the CPU" in text and "torchtitan's published 2-D point" in text
