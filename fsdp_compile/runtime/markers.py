"""The two markers that put FSDP into the graph: ``unshard`` and its gradient ``reduce_grad``.

Each read of a sharded parameter becomes an ``unshard`` node; AOTAutograd derives the backward's
``reduce_grad`` from the autograd formula registered here. Their eager implementations
communicate for real (:mod:`.collectives`), so they are also the eager runtime. Every marker
names its parameter and bucket unit and spells out its :class:`CommSpec`, so a graph says by
itself what each marker communicates and with whom: the passes need nothing but the graph.
"""

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import guard_int

from .collectives import CommSpec, gather_params, padded_rows, reduce_grads, shard_bounds
from .faults import reraise_named
from .kernels import NAMESPACE

# Every marker ends with its CommSpec (CommSpec.op_args / from_op_args).
SPEC_SCHEMA = "str spec"


def _marker(name: str, head: str):
    return torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=(), schema=f"({head}, {SPEC_SCHEMA}) -> Tensor")


@_marker("unshard", "Tensor shard, str fqn, str unit, SymInt full_rows")
def unshard(shard: torch.Tensor, fqn: str, unit: str, full_rows: int, *spec_args) -> torch.Tensor:
    """The full parameter (in the compute dtype) gathered from every rank's dim-0 shard."""
    return _gather_one(shard, fqn, full_rows, CommSpec.from_op_args(*spec_args))


def _gather_one(shard: torch.Tensor, fqn: str, full_rows: int, spec: CommSpec) -> torch.Tensor:
    try:
        return gather_params([shard], [_full_shape(shard, full_rows, spec)], spec)[0]
    except Exception as exc:
        reraise_named(exc, f"the gather of parameter {fqn!r} (eager runtime)", None)


def _gathered_fake(shard: torch.Tensor, full_rows: int, spec: CommSpec) -> torch.Tensor:
    """The meta value of a gathered parameter (every gathering marker's fake)."""
    return torch.empty(_full_shape(shard, full_rows, spec), dtype=spec.compute_dtype(shard.dtype),
                       device=spec.compute_device or shard.device)


def _full_shape(shard: torch.Tensor, full_rows: int, spec: CommSpec) -> tuple:
    if spec.gathers:
        return (full_rows, *shard.shape[1:])
    return tuple(shard.shape)


@_marker("reduce_grad", "Tensor grad, str fqn, str unit, SymInt local_rows, ScalarType grad_dtype")
def reduce_grad(grad: torch.Tensor, fqn: str, unit: str, local_rows: int, grad_dtype: torch.dtype,
                *spec_args) -> torch.Tensor:
    """This rank's shard of the average over data-parallel ranks of the full gradient ``grad``."""
    try:
        return reduce_grads([grad], [local_rows], [grad_dtype], CommSpec.from_op_args(*spec_args))[0]
    except Exception as exc:
        reraise_named(exc, f"the gradient reduction of parameter {fqn!r} (eager runtime)", None)


@reduce_grad.register_fake
def _reduce_grad_fake(grad, fqn, unit, local_rows, grad_dtype, *spec_args):
    spec = CommSpec.from_op_args(*spec_args)
    shape = (local_rows, *grad.shape[1:]) if spec.gathers else grad.shape
    return torch.empty(shape, dtype=grad_dtype, device="cpu" if spec.compute_device else grad.device)


def _unshard_setup_context(ctx, inputs, output) -> None:
    shard, fqn, unit, _full_rows, *spec_args = inputs
    ctx.names = (fqn, unit)
    ctx.local_rows = shard.shape[0] if shard.dim() else 0
    ctx.grad_dtype = shard.dtype
    ctx.spec_args = spec_args


def _unshard_backward(ctx, grad: torch.Tensor):
    shard_grad = torch.ops.fsdp_compile.reduce_grad(
        grad, *ctx.names, ctx.local_rows, ctx.grad_dtype, *ctx.spec_args)
    return (shard_grad,) + (None,) * (3 + len(ctx.spec_args))


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)


@_marker("unshard_no_sync", "Tensor shard, Tensor accumulator, str fqn, str unit, SymInt full_rows")
def unshard_no_sync(shard: torch.Tensor, accumulator: torch.Tensor, fqn: str, unit: str, full_rows: int,
                    *spec_args) -> torch.Tensor:
    """``unshard`` under ``backend.no_sync()``: the full gradient goes, unreduced, to the leaf
    ``accumulator``, whose ``.grad`` sums every micro-batch's; backward communicates nothing."""
    return _gather_one(shard, fqn, full_rows, CommSpec.from_op_args(*spec_args))


def _unshard_no_sync_setup_context(ctx, inputs, output) -> None:
    ctx.accumulator_dtype = inputs[1].dtype
    ctx.num_args = len(inputs)


def _unshard_no_sync_backward(ctx, grad: torch.Tensor):
    return (None, grad.to(ctx.accumulator_dtype)) + (None,) * (ctx.num_args - 2)


unshard_no_sync.register_autograd(_unshard_no_sync_backward, setup_context=_unshard_no_sync_setup_context)
unshard.register_fake(lambda shard, fqn, unit, rows, *spec: _gathered_fake(shard, rows, CommSpec.from_op_args(*spec)))
unshard_no_sync.register_fake(lambda shard, accumulator, fqn, unit, rows, *spec:
                              _gathered_fake(shard, rows, CommSpec.from_op_args(*spec)))


@_marker("reshard", "Tensor full, str fqn, str unit")
def reshard(full: torch.Tensor, fqn: str, unit: str, *spec_args) -> torch.Tensor:
    """This rank's padded dim-0 chunk of a gathered parameter over its reshard group: what a unit
    with ``reshard_after_forward=n`` keeps for backward, which gathers it inside that group."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    spec = CommSpec.from_op_args(*spec_args)
    start, length = shard_bounds(full.shape[0], spec.reshard_size, _resolve_process_group(spec.reshard_group).rank())
    kept = full.new_zeros((padded_rows(full.shape[0], spec.reshard_size), *full.shape[1:]))
    kept[:length].copy_(full[start:start + length])
    return kept


@reshard.register_fake
def _reshard_fake(full, fqn, unit, *spec_args):
    return full.new_empty((padded_rows(full.shape[0], CommSpec.from_op_args(*spec_args).reshard_size), *full.shape[1:]))


# A bucket's gather and reduction, issued by reads that run as Python (sharding/sharded_class.py: eager_read).
# Never in a graph; ops so that whatever watches the dispatcher sees what the eager runtime sends.
@torch.library.custom_op(f"{NAMESPACE}::unshard_bucket", mutates_args=(),
                         schema=f"(Tensor[] shards, str[] fqns, SymInt[] full_rows, {SPEC_SCHEMA}) -> Tensor[]")
def unshard_bucket(shards: list[torch.Tensor], fqns: list[str], full_rows: list[int], *spec_args) -> list[torch.Tensor]:
    """Every parameter of a bucket, gathered with one collective."""
    spec = CommSpec.from_op_args(*spec_args)
    try:
        return gather_params(shards, [_full_shape(s, r, spec) for s, r in zip(shards, full_rows)], spec)
    except Exception as exc:
        reraise_named(exc, f"the gather of {_bucket_label(fqns)} (eager runtime)", None)


@unshard_bucket.register_fake
def _unshard_bucket_fake(shards, fqns, full_rows, *spec_args):
    return [_gathered_fake(s, r, CommSpec.from_op_args(*spec_args)) for s, r in zip(shards, full_rows)]


@torch.library.custom_op(f"{NAMESPACE}::reduce_grad_bucket", mutates_args=(),
                         schema=f"(Tensor[] grads, str[] fqns, SymInt[] local_rows, ScalarType[] grad_dtypes, "
                                f"{SPEC_SCHEMA}) -> Tensor[]")
def reduce_grad_bucket(grads: list[torch.Tensor], fqns: list[str], local_rows: list[int],
                       grad_dtypes: list[torch.dtype], *spec_args) -> list[torch.Tensor]:
    """A bucket's shard gradients, reduced with one collective (copied: outputs may not share storage)."""
    try:
        return [g.clone() for g in reduce_grads(grads, local_rows, grad_dtypes, CommSpec.from_op_args(*spec_args))]
    except Exception as exc:
        reraise_named(exc, f"the gradient reduction of {_bucket_label(fqns)} (eager runtime)", None)


@reduce_grad_bucket.register_fake
def _reduce_grad_bucket_fake(grads, fqns, local_rows, grad_dtypes, *spec_args):
    return [_reduce_grad_fake(g, f, "", r, d, *spec_args) for g, f, r, d in zip(grads, fqns, local_rows, grad_dtypes)]


def _bucket_label(fqns: list[str]) -> str:
    return "the bucket of " + ", ".join(fqns[:3]) + (", ..." if len(fqns) > 3 else "")


UNSHARD = torch.ops.fsdp_compile.unshard.default
RESHARD = torch.ops.fsdp_compile.reshard.default
UNSHARD_NO_SYNC = torch.ops.fsdp_compile.unshard_no_sync.default
# Both gather a parameter in forward; they differ only in where the gradient goes.
UNSHARD_TARGETS = (UNSHARD, UNSHARD_NO_SYNC)
REDUCE_GRAD = torch.ops.fsdp_compile.reduce_grad.default


@dataclass(frozen=True)
class Marker:
    """One marker node, decoded: which tensor it reads and what it communicates."""

    node: fx.Node
    input: fx.Node
    fqn: str
    unit: str
    rows: int  # unshard: full rows; reduce_grad: local rows
    spec: CommSpec
    grad_dtype: torch.dtype | None = None  # reduce_grad only

    @property
    def kind(self) -> str:
        return "reduce_grad" if self.node.target is REDUCE_GRAD else "unshard"

    @property
    def full_value(self) -> torch.Tensor:
        """The gathered parameter, or the full gradient before its reduction."""
        return self.node.meta["val"] if self.kind == "unshard" else self.input.meta["val"]

    @property
    def comm_dtype(self) -> torch.dtype:
        """The dtype the collective moves it in (gradients: the reduce dtype; float8: bytes)."""
        value = self.full_value
        if self.kind == "unshard":
            return torch.uint8 if self.spec.gathers_float8 else value.dtype
        return self.spec.grad_reduce_dtype(value.dtype)

    @property
    def full_shape(self) -> tuple[int, ...]:
        return tuple(static_int(size) for size in self.full_value.shape)

    @property
    def full_bytes(self) -> int:
        """Bytes the collective moves for it, unsharded (a float8 weight's scale aside)."""
        return static_int(self.full_value.numel()) * self.comm_dtype.itemsize

    @property
    def value_bytes(self) -> int:
        """Bytes of :attr:`full_value` itself: what holding the gathered parameter costs."""
        return static_int(self.full_value.numel()) * self.full_value.dtype.itemsize


def static_int(value: object) -> int:
    """A size a marker communicates, as an int (read from the node for a graph value). Dynamo may
    make a parameter's size symbolic when one frame reads several parameters; the lowered
    collectives bake sizes in, so it is specialized (a guard: another parameter compiles anew)."""
    if isinstance(value, fx.Node):
        value = value.meta.get("val", value.meta.get("example_value"))
    return guard_int(value) if isinstance(value, torch.SymInt) else int(value)


# Where each marker's fqn argument is (unshard_no_sync has its accumulator before it).
_FQN_POSITION = {UNSHARD: 1, UNSHARD_NO_SYNC: 2, REDUCE_GRAD: 1}


def decode(node: fx.Node) -> Marker:
    if node.target not in _FQN_POSITION:
        raise ValueError(f"{node.format_node()} is not an fsdp_compile marker")
    fqn, unit, rows, *rest = node.args[_FQN_POSITION[node.target]:]
    grad_dtype = rest.pop(0) if node.target is REDUCE_GRAD else None
    return Marker(node, node.args[0], fqn, unit, static_int(rows), CommSpec.from_op_args(*rest), grad_dtype)


def markers(graph: fx.Graph, kind: str | None = None) -> list[Marker]:
    """Decoded markers of ``graph`` in graph order (only ``"unshard"`` or ``"reduce_grad"`` ones
    when ``kind`` is given)."""
    targets = {"unshard": UNSHARD_TARGETS, "reduce_grad": (REDUCE_GRAD,), None: (*UNSHARD_TARGETS, REDUCE_GRAD)}
    if kind not in targets:
        raise ValueError(f"kind={kind!r}: use 'unshard', 'reduce_grad' or None")
    return [decode(n) for n in graph.nodes if n.op == "call_function" and n.target in targets[kind]]
