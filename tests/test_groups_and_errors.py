"""Process-group layouts for every way of describing them, and clear errors for bad input."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from distributed import PG_TIMEOUT, run_workers
from helpers import (
    PARAM_ATOL,
    TEST_CONFIG,
    assert_bitwise,
    batches,
    expect_error,
    max_diff,
    train,
)
from torch import nn

import fsdp_compile
from fsdp_compile.models.gpt import GPT


def _group_ranks(group) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


def groups_worker(rank: int, world: int) -> dict:
    """Hybrid layouts from each way of describing them, plus training through one of them."""
    import datetime
    import os

    from torch.distributed.device_mesh import init_device_mesh

    def layout(backend) -> tuple:
        topo = backend.topology
        return _group_ranks(topo.shard_group), _group_ranks(topo.replicate_group)

    def shard_tiny(**options):
        backend = fsdp_compile.backend("HYBRID_SHARD", **options)
        backend.shard(nn.Linear(4, 4))
        return backend

    def timeouts(backend) -> list[float]:
        topo = backend.topology
        return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                for g in (topo.shard_group, topo.replicate_group)]

    out = {}
    by_size = shard_tiny(shard_size=2)
    out["shard_size"] = layout(by_size)
    # Groups the backend creates get timeout=, else the default group's (tests: 300 s).
    out["timeouts"] = {"default": timeouts(by_size),
                       "given": timeouts(shard_tiny(shard_size=2, timeout=datetime.timedelta(seconds=123)))}
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    out["local_world_size"] = layout(shard_tiny())
    del os.environ["LOCAL_WORLD_SIZE"]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out["mesh"] = layout(shard_tiny(mesh=mesh))
    # Groups given by the user, built in a non-contiguous layout: shard groups {0,2} and {1,3}.
    shard_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replicate_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pgs = (shard_groups[rank % 2], replicate_groups[rank // 2])
    out["process_groups"] = layout(shard_tiny(process_groups=pgs))
    out["flat"] = layout(_shard_flat())

    # The same training through user groups and through the equivalent mesh is bitwise equal.
    torch.manual_seed(0)
    base = GPT(TEST_CONFIG)
    data = batches(TEST_CONFIG, world, 2)
    trained = {}
    for name, options in (("process_groups", {"process_groups": pgs}),
                          ("mesh", {"mesh": DeviceMeshFromLayout([[0, 2], [1, 3]])})):
        model = copy.deepcopy(base)
        fsdp_compile.backend("HYBRID_SHARD", compiler="aot_eager", **options).shard(model)
        trained[name] = train(model, model, data, rank)["params"]
    if rank == 0:
        reference = copy.deepcopy(base)
        trained["reference"] = train(reference, reference, data, None)["params"]
    out["trained"] = trained
    return out


def DeviceMeshFromLayout(layout: list[list[int]]):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.tensor(layout), mesh_dim_names=("replicate", "shard"))


def _shard_flat():
    backend = fsdp_compile.backend("FULL_SHARD")
    backend.shard(nn.Linear(4, 4))
    return backend


def test_hybrid_layouts_and_training_through_user_groups() -> None:
    reports = run_workers(groups_worker, 4)
    contiguous = {0: ([0, 1], [0, 2]), 1: ([0, 1], [1, 3]), 2: ([2, 3], [0, 2]), 3: ([2, 3], [1, 3])}
    for rank, report in enumerate(reports):
        for how in ("shard_size", "local_world_size", "mesh"):
            assert report[how] == contiguous[rank], how
        # User groups may lay ranks out any way that tiles the world.
        assert report["process_groups"] == ([rank % 2, rank % 2 + 2], [rank // 2 * 2, rank // 2 * 2 + 1])
        assert report["flat"] == ([0, 1, 2, 3], None)
    for report in reports:
        world_timeout = PG_TIMEOUT.total_seconds()  # the default group's, as the workers set it
        assert report["timeouts"] == {"default": [world_timeout] * 2, "given": [123.0, 123.0]}
    trained = reports[0]["trained"]
    assert_bitwise(trained["process_groups"], trained["mesh"], "user groups vs the same mesh")
    assert max_diff(trained["process_groups"], trained["reference"])[0] <= PARAM_ATOL


def hybrid_errors_worker(rank: int, world: int) -> dict:
    """Bad hybrid layouts fail on every rank (no rank left waiting in a collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    def shard_with(**options):
        return lambda: fsdp_compile.backend("HYBRID_SHARD", **options).shard(nn.Linear(4, 4))

    errors = {}
    errors["shard_size_not_dividing"] = expect_error(shard_with(shard_size=3))
    errors["no_node_size"] = expect_error(shard_with())
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pair[rank // 2]
    errors["replicas_inside_shard_group"] = expect_error(shard_with(process_groups=(mine, mine)))
    uneven = [dist.new_group([0]), dist.new_group([1, 2, 3])]
    errors["uneven_shard_groups"] = expect_error(
        shard_with(process_groups=(uneven[0] if rank == 0 else uneven[1], mine)))
    errors["one_group"] = expect_error(shard_with(process_groups=mine))
    flat_mesh = init_device_mesh("cpu", (world,))
    errors["flat_mesh_for_hybrid"] = expect_error(shard_with(mesh=flat_mesh))
    square = init_device_mesh("cpu", (2, 2))
    errors["square_mesh_for_flat"] = expect_error(
        lambda: fsdp_compile.backend("FULL_SHARD", mesh=square).shard(nn.Linear(4, 4)))
    # Still in step afterwards: a collective completes on every rank.
    flag = torch.ones(1)
    dist.all_reduce(flag)
    errors["still_in_step"] = flag.item() == world
    return errors


def test_bad_hybrid_layouts_fail_on_every_rank() -> None:
    reports = run_workers(hybrid_errors_worker, 4)
    assert all(r == reports[0] for r in reports), "ranks disagree about a bad layout"
    errors = reports[0]
    assert errors.pop("still_in_step") is True
    assert "shard_size=3 does not divide the world size 4" in errors["shard_size_not_dividing"]
    assert "LOCAL_WORLD_SIZE" in errors["no_node_size"] and "shard_size=" in errors["no_node_size"]
    assert "exactly one rank of each shard group" in errors["replicas_inside_shard_group"]
    assert "do not tile the world" in errors["uneven_shard_groups"]
    assert "(shard_pg, replicate_pg)" in errors["one_group"]
    assert "2-D mesh" in errors["flat_mesh_for_hybrid"]
    assert "FULL_SHARD takes a 1-D mesh" in errors["square_mesh_for_flat"]
    for message in errors.values():
        assert message.startswith(("ValueError", "TypeError"))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc(x)))


class RawWeight(nn.Module):
    """A parameter with no reset_parameters(): nothing can initialize it from the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def api_errors_worker(rank: int, world: int) -> dict:
    """Bad input to shard() and to compiled calls, at world 1."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    errors = {}
    backend = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager")
    unsharded = Net()
    errors["not_sharded"] = expect_error(lambda: torch.compile(unsharded, backend=backend)(torch.randn(2, 4)))
    sharded = backend.shard(Net())
    errors["twice"] = expect_error(lambda: backend.shard(sharded))
    errors["not_a_module"] = expect_error(lambda: backend.shard(lambda x: x))
    errors["compiled_module"] = expect_error(lambda: backend.shard(torch.compile(Net())))
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(4, 4), RawWeight())
    errors["meta"] = expect_error(lambda: fsdp_compile.backend().shard(meta))
    tp = Net()
    mesh = init_device_mesh("cpu", (world,))
    tp.fc.weight = nn.Parameter(distribute_tensor(tp.fc.weight.detach(), mesh, [Shard(0)]))
    errors["foreign_dtensor"] = expect_error(lambda: fsdp_compile.backend().shard(tp))
    other = fsdp_compile.backend("FULL_SHARD", compiler="aot_eager")
    errors["other_backend"] = expect_error(lambda: torch.compile(sharded, backend=other)(torch.randn(2, 4)))

    replaced = backend.shard(Net())
    replaced.fc.weight = nn.Parameter(torch.randn(4, 4))  # nn.Module registers it as is
    errors["replaced_parameter"] = expect_error(lambda: replaced(torch.randn(2, 4)))
    return errors


def test_api_errors_name_what_is_wrong() -> None:
    errors = run_workers(api_errors_worker, 1)[0]
    assert "'fc.weight' is not sharded: call backend.shard(model)" in errors["not_sharded"]
    assert "already sharded" in errors["twice"]
    assert "takes an nn.Module" in errors["not_a_module"]
    assert "shard the plain module first" in errors["compiled_module"]
    assert "module '1' (RawWeight) has parameters or buffers on the meta device" in errors["meta"]
    assert "pass init_fn=" in errors["meta"]
    # A TP parameter without the dp mesh it is to be sharded over (tests/test_tensor_parallel.py: the rest).
    assert "parameter 'fc.weight' is a DTensor on the mesh" in errors["foreign_dtensor"]
    assert "mesh=mesh['dp']" in errors["foreign_dtensor"]
    assert "did not shard" in errors["other_backend"] and "'fc.weight'" in errors["other_backend"]
    assert "'fc.weight' was replaced by a plain tensor" in errors["replaced_parameter"]


def test_strategy_names() -> None:
    assert fsdp_compile.backend("full_shard").strategy is fsdp_compile.ShardingStrategy.FULL_SHARD
    assert fsdp_compile.backend(" Hybrid_Shard_Zero2 ").strategy.name == "HYBRID_SHARD_ZERO2"
    assert fsdp_compile.backend(fsdp_compile.ShardingStrategy.NO_SHARD).strategy.name == "NO_SHARD"
    with pytest.raises(ValueError) as err:
        fsdp_compile.backend("ZERO3")
    message = str(err.value)
    assert "strategy='ZERO3'" in message
    for name in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
        assert name in message
    with pytest.raises(ValueError, match="strategy=3"):
        fsdp_compile.backend(3)


def test_backend_option_errors() -> None:
    with pytest.raises(ValueError, match="compiler='tvm'.*inductor, aot_eager, eager"):
        fsdp_compile.backend(compiler="tvm")
    with pytest.raises(ValueError, match="shard_size= only applies to HYBRID"):
        fsdp_compile.backend("FULL_SHARD", shard_size=2)
    with pytest.raises(TypeError, match="mesh= must be"):
        fsdp_compile.backend(mesh="cpu")
    with pytest.raises(TypeError, match="timeout= must be"):
        fsdp_compile.backend(timeout=30)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bucket_size'"):
        fsdp_compile.backend(bucket_size=1)


def test_shard_needs_torch_distributed() -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()  # tests never initialize the pytest process itself
    with pytest.raises(RuntimeError, match="init_process_group"):
        fsdp_compile.backend().shard(nn.Linear(2, 2))


END_SCRIPT = """
import atexit, os, sys
import torch.distributed as dist
from fsdp_compile.sharding.groups import end_process_group
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
atexit.register(lambda: print("finalized"))
print("trained", end="")
end_process_group(exit_process=True)
print("not reached")
"""


def test_end_process_group_destroys_the_group_and_exits_without_finalizing(tmp_path) -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    proc = subprocess.run([sys.executable, "-c", END_SCRIPT, port], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # Unflushed output is written; neither atexit handlers nor anything after the call run.
    assert proc.stdout == "trained"


def test_error_classes_are_instances_of_their_documented_bases() -> None:
    # Users catch the documented bases (a configuration error as ValueError, a lost rank as
    # RuntimeError): an error class that moved to another base would slip past their handlers.
    documented = {
        fsdp_compile.AgreementError: ValueError,
        fsdp_compile.GraphMismatchError: fsdp_compile.AgreementError,
        fsdp_compile.RankFailure: RuntimeError,
        fsdp_compile.CheckpointError: ValueError,
        fsdp_compile.ConfigError: ValueError,
        fsdp_compile.PlanError: fsdp_compile.ConfigError,
        fsdp_compile.GradientMismatch: RuntimeError,
    }
    for error, base in documented.items():
        assert isinstance(error("message"), base), (error.__name__, base.__name__)
