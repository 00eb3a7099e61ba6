"""Tensor parallelism in the planner: which TP degrees apply, and the mesh each is traced on.

A degree ``tp`` splits the world into ``dp = world / tp`` groups of ``tp`` consecutive ranks, inside a node (its
collectives run every layer, priced on the intra-node link). FSDP shards over ``mesh["dp"]`` (dp x tp), or for hybrid
strategies ``mesh["dp_replicate", "dp_shard"]`` (dp_replicate x dp_shard x tp), as a real 2-D run is set up
(docs/tensor-parallel.md). ``parallelize_fn(model, tp_mesh)`` applies the TP plan (built in for GPT and Llama).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from ..api import ShardingStrategy
from .vocabulary import PlanError

# Attributes that name a count of attention heads, on a model's config or on its modules.
HEAD_ATTRIBUTES = ("n_heads", "n_kv_heads", "n_head", "num_heads", "num_attention_heads", "num_key_value_heads")


def default_parallelize_fn(model: nn.Module) -> Callable[[nn.Module, Any], nn.Module] | None:
    """The TP plan the built-in models ship: torchtitan's for :class:`~fsdp_compile.models.llama.Llama`, Megatron's MLP
    split for :class:`~fsdp_compile.models.gpt.GPT`; None for any other model."""
    from ..models.gpt import GPT
    from ..models.gpt import apply_tp as gpt_tp
    from ..models.llama import Llama
    from ..models.llama import apply_tp as llama_tp

    return llama_tp if isinstance(model, Llama) else gpt_tp if isinstance(model, GPT) else None


def model_heads(model: nn.Module) -> dict[str, int]:
    """The model's attention head counts by attribute name (``n_heads``, ``n_kv_heads``, ...), from its
    ``cfg``/``config`` or any submodule that carries them."""
    heads: dict[str, int] = {}
    for holder in (getattr(model, "cfg", None), getattr(model, "config", None), *model.modules()):
        for name in HEAD_ATTRIBUTES:
            value = getattr(holder, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0 and name not in heads:
                heads[name] = value
    return heads


def check_tp_degrees(degrees: Sequence[int], model: nn.Module, world: int, devices_per_node: int,
                     parallelize_fn: Callable | None) -> tuple[tuple[int, ...], Callable | None]:
    """The TP degrees to plan and the function applying the TP plan; :class:`PlanError` naming a degree that cannot run,
    and why."""
    out: list[int] = []
    for tp in degrees:
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise PlanError(f"tp_degrees: {tp!r} is not a TP degree (ints >= 1)")
        if tp in out:
            continue
        if devices_per_node % tp:
            raise PlanError(f"TP degree {tp} does not divide the {devices_per_node} devices of a node: "
                            "tensor parallelism stays inside a node (its collectives run every layer and need "
                            f"the intra-node link); use a divisor of {devices_per_node}")
        if world % tp:
            raise PlanError(f"TP degree {tp} does not divide the world of {world} devices (dp = world / tp)")
        for name, count in model_heads(model).items():
            if count % tp:
                raise PlanError(f"TP degree {tp} does not divide the model's {name}={count}: each tp rank "
                                "computes whole attention heads (heads / tp of them)")
        out.append(tp)
    if any(tp > 1 for tp in out) and parallelize_fn is None:
        parallelize_fn = default_parallelize_fn(model)
        if parallelize_fn is None:
            raise PlanError(f"TP degrees {[tp for tp in out if tp > 1]} need parallelize_fn=: a function "
                            f"(model, tp_mesh) -> model applying the TP plan of {type(model).__name__} with "
                            "torch's parallelize_module (the built-in GPT and Llama bring their own)")
    return tuple(out), parallelize_fn


def tp_mesh_dims(world: int, tp: int, devices_per_node: int, hybrid: bool) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The mesh a TP degree runs on: (dp, tp), or (dp_replicate, dp_shard, tp) for hybrid strategies."""
    if hybrid:
        return (world // devices_per_node, devices_per_node // tp, tp), ("dp_replicate", "dp_shard", "tp")
    return (world // tp, tp), ("dp", "tp")


class TPMeshes:
    """The meshes of each (TP degree, hybrid or not) in the current (fake) world, made once each."""

    def __init__(self, world: int, devices_per_node: int, parallelize_fn: Callable | None) -> None:
        self.world, self.devices_per_node, self.parallelize_fn = world, devices_per_node, parallelize_fn
        self._meshes: dict[tuple[int, bool], Any] = {}

    def mesh(self, tp: int, hybrid: bool) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        key = (tp, hybrid)
        if key not in self._meshes:
            shape, names = tp_mesh_dims(self.world, tp, self.devices_per_node, hybrid)
            self._meshes[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
        return self._meshes[key]

    def dp_mesh(self, tp: int, strategy: ShardingStrategy) -> Any:
        mesh = self.mesh(tp, strategy.is_hybrid)
        return mesh["dp_replicate", "dp_shard"] if strategy.is_hybrid else mesh["dp"]

    def tp_ranks(self, tp: int, strategy: ShardingStrategy) -> tuple[int, ...]:
        """This rank's tp group. By ranks, not by name: DTensor caches its sharding decisions by mesh, and two meshes'
        tp groups of the same ranks are interchangeable in a traced graph."""
        import torch.distributed as dist

        return tuple(dist.get_process_group_ranks(self.mesh(tp, strategy.is_hybrid)["tp"].get_group()))

    def parallelize(self, model: nn.Module, tp: int, strategy: ShardingStrategy) -> nn.Module:
        """``model`` (a fake copy) with the TP plan applied on the tp mesh."""
        tp_mesh = self.mesh(tp, strategy.is_hybrid)["tp"]
        try:
            out = self.parallelize_fn(model, tp_mesh)
        except Exception as exc:  # the user's TP plan: say which degree it failed at
            raise PlanError(f"parallelize_fn failed at TP degree {tp}: {type(exc).__name__}: {exc}") from exc
        return model if out is None else out


def tp_model_states(model: nn.Module, candidates: Sequence[Any], meshes: TPMeshes,
                    optimizer: str) -> dict[tuple[ShardingStrategy, int], dict[str, float]]:
    """Model states per device of each (strategy, TP degree) among ``candidates``, read off a fake copy with the TP plan
    applied (:func:`.states.model_state_bytes`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .states import model_state_bytes
    from .world import fake_model

    parallelized: dict[int, nn.Module] = {1: model}
    out: dict[tuple[ShardingStrategy, int], dict[str, float]] = {}
    for c in candidates:
        if (c.strategy, c.tp) in out:
            continue
        if c.tp not in parallelized:
            parallelized[c.tp] = meshes.parallelize(fake_model(model, FakeTensorMode()), c.tp,
                                                    ShardingStrategy.FULL_SHARD)
        out[c.strategy, c.tp] = model_state_bytes(parallelized[c.tp], c.strategy, meshes.world,
                                                  meshes.devices_per_node, optimizer, c.tp)
    return out
