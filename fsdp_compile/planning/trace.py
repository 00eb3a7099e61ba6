"""Trace every candidate's graphs with the backend's own pipeline, sharing what is the same.

Candidates that shard over groups of the same size (a *layout*: FULL_SHARD with SHARD_GRAD_OP, the two hybrids,
NO_SHARD) get the same joint graph but for the markers' arguments: one is traced, the others replay its joint graph with
their own markers (``Compiler.replay``; exactly the graphs a trace gives, tests/test_planning_plan.py), and those with
the same reshard policy share the partitioned graphs. The backend sits above the planner, which reaches it only through
``compilation/tracing.py``'s ``make_backend`` and the compiler's tracing door.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ..api import BucketPolicy, MixedPrecision, ShardingStrategy
from ..compilation import CompiledGraph, Compiler, JointCapture
from ..compilation.tracing import make_backend
from ..passes.graph import ROLE_META
from .tp import TPMeshes
from .world import fake_inputs, fake_model


@dataclass(frozen=True)
class Candidate:
    """One configuration the planner tries."""

    strategy: ShardingStrategy
    bucket: BucketPolicy = "module"
    prefetch: int = 1
    tp: int = 1  # the tensor-parallel degree (1: no TP); FSDP shards over dp = world / tp
    # A memory budget's mix (:mod:`.budget`), as reshard_after_forward= takes it; empty: the strategy's
    reshard: tuple[tuple[str, bool | int], ...] = ()

    def layout(self, devices_per_node: int, world: int) -> tuple[int, int]:
        """The TP degree and the ranks a parameter is sharded over: the shard shapes its traces see."""
        if self.strategy is ShardingStrategy.NO_SHARD:
            return self.tp, 1
        return self.tp, (devices_per_node if self.strategy.is_hybrid else world) // self.tp

    def bucket_label(self) -> str:
        b = self.bucket
        if isinstance(b, int) and not isinstance(b, bool):
            return f"{b / (1 << 20):g}MiB"
        if isinstance(b, str):
            return b
        return getattr(b, "__name__", type(b).__name__)

    def label(self) -> str:
        return candidate_label(self.strategy.name, self.tp, self.bucket_label(), self.prefetch, dict(self.reshard))


def candidate_label(strategy: str, tp: int, bucket: str, prefetch: int,
                    reshard: dict[str, bool | int] | None = None) -> str:
    """How a candidate, and the plan row it gives, is named to people."""
    at = f" tp={tp}" if tp > 1 else ""
    mix = f" {describe_reshard(reshard)}" if reshard else ""
    return f"{strategy}{at} bucket={bucket} prefetch={prefetch}{mix}"


def describe_reshard(reshard: dict[str, bool | int]) -> str:
    """A budget's mix in a row's name: how many units keep their gathered parameters, how many a shard over n ranks."""
    kept = sum(1 for value in reshard.values() if value is False)
    over = sorted({value for value in reshard.values() if value is not False and value is not True})
    parts = [f"{kept} kept"] if kept else []
    parts += [f"{sum(1 for v in reshard.values() if v is not False and v == n)} kept over {n}" for n in over]
    return "[" + ", ".join(parts) + "]"


class TracingBackend(Protocol):
    """What the planner shards and traces a candidate with: a backend's own ``shard()`` and compiler."""

    compiler: Compiler

    def shard(self, model: nn.Module, *, materialize: bool = True) -> nn.Module:
        """Shard ``model`` in place; with ``materialize=False`` a meta-device model keeps meta shards."""


@dataclass
class Traced:
    """A candidate's compiled graphs and the backend (with its sharded fake model) that made them."""

    candidate: Candidate
    backend: TracingBackend
    model: nn.Module
    records: list[CompiledGraph]
    seconds: float
    replayed: bool = False
    symbolic: dict[str, Any] = field(default_factory=dict)  # symbol name -> "batch" / "seq"
    tp_ranks: tuple[int, ...] | None = None  # this rank's tp group (TP candidates)


def default_loss(output: Any) -> torch.Tensor:
    """The sum of every floating-point tensor of the output (the planner's default loss)."""
    leaves = [t for t in torch.utils._pytree.tree_leaves(output)
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise ValueError("the model's output has no floating-point tensor to build a loss from; pass loss_fn=")
    return sum((t.float().sum() for t in leaves[1:]), leaves[0].float().sum())


def _make_backend(candidate: Candidate, mixed_precision: MixedPrecision | None, devices_per_node: int,
                  world: int, tp_meshes: TPMeshes | None = None) -> TracingBackend:
    hybrid = candidate.strategy.is_hybrid
    # Without regions: the cost model prices the flat graph node by node; regions change where a block's operators are
    # written down, not which run or what is communicated.
    options: dict[str, Any] = {"shard_size": devices_per_node if hybrid else None}
    if candidate.tp > 1:  # FSDP over the dp part of the 2-D (hybrid: 3-D) mesh, as a real run
        options = {"mesh": tp_meshes.dp_mesh(candidate.tp, candidate.strategy)}
    if candidate.reshard:
        options["reshard_after_forward"] = dict(candidate.reshard)
    return make_backend(candidate.strategy, compiler="aot_eager", bucket=candidate.bucket,
                       prefetch=candidate.prefetch, mixed_precision=mixed_precision, regions=False, **options)


def tag_buffer_inputs(record: CompiledGraph) -> None:
    """Mark the forward graph's inputs that are module buffers (role ``buffer``): its tensor inputs other than shards
    are, in order, the Dynamo graph's plain tensor inputs (matched by position and shape; left alone where they do not
    line up)."""
    if record.forward is None:
        return
    dynamo = []
    for node in record.dynamo.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value")
        if not isinstance(value, torch.Tensor) or isinstance(value, nn.Parameter):
            continue
        # Dynamo names a placeholder after its source: L['model']._buffers['x'] -> l_model_buffers_x_
        dynamo.append((tuple(value.shape), "buffers_" in node.name))
    forward = [n for n in record.forward.graph.find_nodes(op="placeholder")
               if isinstance(n.meta.get("val"), torch.Tensor) and n.meta.get(ROLE_META) != "param"
               and "rng" not in n.name]
    forward = forward[:len(dynamo)]
    mismatched = any(tuple(n.meta["val"].shape) != shape for n, (shape, _) in zip(forward, dynamo))
    if len(forward) != len(dynamo) or mismatched:
        return
    for node, (_, is_buffer) in zip(forward, dynamo):
        if is_buffer:
            node.meta[ROLE_META] = "buffer"


# Attention as the target device runs it: traced on CPU fake tensors, ``scaled_dot_product_attention`` dispatches to the
# CPU's flash kernel, while a CUDA run's FlashAttention or memory-efficient kernel saves other tensors for backward; on
# a CUDA cluster the Dynamo graph calls the CUDA kernel's op.
_SDPA_TARGETS = {torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention}


def _cuda_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeat, dim=-3)
        value = value.repeat_interleave(repeat, dim=-3)
    if attn_mask is None and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256:
        return torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale)[0]


def use_cuda_attention(gm: fx.GraphModule) -> int:
    """Route every ``scaled_dot_product_attention`` of a Dynamo graph to the CUDA kernel it would dispatch to; returns
    how many were routed."""
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _SDPA_TARGETS:
            node.target = _cuda_sdpa
            count += 1
    return count


def trace_candidates(model: nn.Module, example_inputs: Sequence[Any], loss_fn: Callable[[Any], torch.Tensor] | None,
                     candidates: Sequence[Candidate], *, world: int, devices_per_node: int,
                     mixed_precision: MixedPrecision | None, device_type: str,
                     symbolic_dims: dict[int, dict[int, str]] | None = None,
                     progress: Callable[[str], None] | None = None,
                     tp_meshes: TPMeshes | None = None) -> dict[Candidate, Traced]:
    """Trace ``candidates`` in the current (fake) world. ``symbolic_dims`` ({input index: {dim: "batch" | "seq"}})
    traces those sizes as symbols; ``tp_meshes``: for TP degrees above 1."""
    loss_fn = loss_fn or default_loss
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    inputs = fake_inputs(mode, tuple(example_inputs))
    symbols: dict[tuple[int, int], str] = {}
    for index, dims in (symbolic_dims or {}).items():
        for dim, label in dims.items():
            torch._dynamo.mark_dynamic(inputs[index], dim)
            symbols[(index, dim)] = label
    dynamo_pass = use_cuda_attention if device_type == "cuda" else None
    layouts: dict[tuple[int, int], list[Candidate]] = {}
    for candidate in candidates:
        layouts.setdefault(candidate.layout(devices_per_node, world), []).append(candidate)

    traced: dict[Candidate, Traced] = {}
    with warnings.catch_warnings():
        # Pass failures are reported in the plan's rows; torch's own deprecation notices from deep-copying graphs say
        # nothing about the user's model.
        warnings.simplefilter("ignore", RuntimeWarning)
        warnings.simplefilter("ignore", FutureWarning)
        _trace_layouts(layouts, model, mode, inputs, loss_fn, mixed_precision, devices_per_node, world,
                       dynamo_pass, symbols, progress, traced, tp_meshes)
    return traced


def _trace_layouts(layouts, model, mode, inputs, loss_fn, mixed_precision, devices_per_node, world,
                   dynamo_pass, symbols, progress, traced, tp_meshes) -> None:
    for group in layouts.values():
        captures: list[JointCapture] = []
        partitions: dict[tuple[ShardingStrategy, int], tuple] = {}
        for i, candidate in enumerate(group):
            start = time.perf_counter()
            backend = _make_backend(candidate, mixed_precision, devices_per_node, world, tp_meshes)
            fake = fake_model(model, mode)
            tp_ranks = None
            if candidate.tp > 1:  # the user's TP plan on the fake copy, then FSDP over dp
                fake = tp_meshes.parallelize(fake, candidate.tp, candidate.strategy)
                tp_ranks = tp_meshes.tp_ranks(candidate.tp, candidate.strategy)
            sharded = backend.shard(fake, materialize=False)
            if i == 0:
                def step(*args: Any, _model: nn.Module = sharded) -> torch.Tensor:
                    return loss_fn(_model(*args))

                records, captures = backend.compiler.trace(step, inputs, keep_joint=len(group) > 1,
                                                           dynamo_pass=dynamo_pass, fake_mode=mode)
                for k, capture in enumerate(captures):
                    if capture.partitioned is not None:
                        partitions[(candidate.strategy, k)] = capture.partitioned
                replayed = False
            else:
                records = []
                for k, capture in enumerate(captures):
                    record, partitioned = backend.compiler.replay(capture, partitions.get((candidate.strategy, k)))
                    partitions[(candidate.strategy, k)] = partitioned
                    records.append(record)
                replayed = True
            for record in records:
                tag_buffer_inputs(record)
            entry = Traced(candidate, backend, sharded, records, time.perf_counter() - start, replayed,
                           tp_ranks=tp_ranks)
            if symbols:
                entry.symbolic = _symbol_labels(records, inputs, symbols)
            traced[candidate] = entry
            if progress is not None:
                progress(f"traced {candidate.label()} in {entry.seconds:.1f}s"
                         + (" (replayed the shared joint graph)" if replayed else ""))


def _symbol_labels(records: list[CompiledGraph], inputs: Sequence[Any],
                   symbols: dict[tuple[int, int], str]) -> dict[str, str]:
    """Which sympy symbol of the traced graphs stands for the batch and which for the sequence."""
    labels: dict[str, str] = {}
    for record in records:
        user = {node.name: node.meta["example_value"] for node in record.dynamo.graph.find_nodes(op="placeholder")
                if isinstance(node.meta.get("example_value"), torch.Tensor)}  # L['args'][i] -> l_args_i_
        for (index, dim), label in symbols.items():
            value = user.get(f"l_args_{index}_")
            if value is not None and dim < value.dim() and isinstance(value.shape[dim], torch.SymInt):
                labels.update((str(symbol), label) for symbol in value.shape[dim].node.expr.free_symbols)
    return labels
