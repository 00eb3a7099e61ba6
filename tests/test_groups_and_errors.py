"""Process-group layouts for every way of describing them, and clear errors for bad input."""

from __future__ import annotations

import pytest
import torch.nn as nn
from distributed import PG_TIMEOUT, run_workers
from test_parity import PARAM_ATOL, assert_bitwise, max_diff
from workers import api_errors_worker, groups_worker, hybrid_errors_worker

import fsdp_compile


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


def test_api_errors_name_what_is_wrong() -> None:
    errors = run_workers(api_errors_worker, 1)[0]
    assert "'fc.weight' is not sharded: call backend.shard(model)" in errors["not_sharded"]
    assert "already sharded" in errors["twice"]
    assert "takes an nn.Module" in errors["not_a_module"]
    assert "shard the plain module first" in errors["compiled_module"]
    assert "module '1' (RawWeight) has parameters or buffers on the meta device" in errors["meta"]
    assert "pass init_fn=" in errors["meta"]
    assert "'fc.weight' is already a DTensor" in errors["foreign_dtensor"]
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
