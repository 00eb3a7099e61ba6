"""The two markers that put FSDP into the graph: ``unshard`` and its gradient ``reduce_grad``.

Each read of a sharded parameter inside ``forward`` becomes one ``fsdp_compile::unshard`` node;
AOTAutograd derives one ``fsdp_compile::reduce_grad`` node in the backward graph from the
autograd formula registered here. Their eager implementations communicate for real (through
:mod:`fsdp_compile.runtime.collectives`), so they are also the eager runtime: a sharded model
runs without ``torch.compile`` with the same semantics, and a compiled graph that keeps the
markers runs them as ordinary ops.

Arguments after the tensor and its row count are a :class:`CommSpec` spelled out, so every
graph says by itself what each marker communicates and with whom.
"""

from typing import Optional

import torch

from .runtime.collectives import CommSpec, gather_params, reduce_grads

NAMESPACE = "fsdp_compile"


@torch.library.custom_op(f"{NAMESPACE}::unshard", mutates_args=())
def unshard(
    shard: torch.Tensor,
    full_rows: int,
    shard_group: str,
    shard_size: int,
    dim0_sharded: bool,
    replicate_group: str,
    replicate_size: int,
    param_dtype: Optional[torch.dtype],
    reduce_dtype: Optional[torch.dtype],
    reshard_after_forward: bool,
) -> torch.Tensor:
    """The full parameter (in the compute dtype) gathered from every rank's dim-0 shard."""
    spec = CommSpec(shard_group, shard_size, dim0_sharded, replicate_group, replicate_size,
                    param_dtype, reduce_dtype, reshard_after_forward)
    return gather_params([shard], [_full_shape(shard, full_rows, spec)], spec)[0]


@unshard.register_fake
def _unshard_fake(shard, full_rows, shard_group, shard_size, dim0_sharded, replicate_group,
                  replicate_size, param_dtype, reduce_dtype, reshard_after_forward):
    spec = CommSpec(shard_group, shard_size, dim0_sharded, replicate_group, replicate_size,
                    param_dtype, reduce_dtype, reshard_after_forward)
    return shard.new_empty(_full_shape(shard, full_rows, spec), dtype=spec.compute_dtype(shard.dtype))


def _full_shape(shard: torch.Tensor, full_rows: int, spec: CommSpec) -> tuple[int, ...]:
    if spec.gathers:
        return (full_rows, *shard.shape[1:])
    return tuple(shard.shape)


@torch.library.custom_op(f"{NAMESPACE}::reduce_grad", mutates_args=())
def reduce_grad(
    grad: torch.Tensor,
    local_rows: int,
    grad_dtype: torch.dtype,
    shard_group: str,
    shard_size: int,
    dim0_sharded: bool,
    replicate_group: str,
    replicate_size: int,
    param_dtype: Optional[torch.dtype],
    reduce_dtype: Optional[torch.dtype],
    reshard_after_forward: bool,
) -> torch.Tensor:
    """This rank's shard of the average over data-parallel ranks of the full gradient ``grad``."""
    spec = CommSpec(shard_group, shard_size, dim0_sharded, replicate_group, replicate_size,
                    param_dtype, reduce_dtype, reshard_after_forward)
    return reduce_grads([grad], [local_rows], [grad_dtype], spec)[0]


@reduce_grad.register_fake
def _reduce_grad_fake(grad, local_rows, grad_dtype, shard_group, shard_size, dim0_sharded,
                      replicate_group, replicate_size, param_dtype, reduce_dtype,
                      reshard_after_forward):
    if dim0_sharded and shard_size > 1:
        return grad.new_empty((local_rows, *grad.shape[1:]), dtype=grad_dtype)
    return grad.new_empty(grad.shape, dtype=grad_dtype)


def _unshard_setup_context(ctx, inputs, output) -> None:
    shard, _full_rows, *spec_args = inputs
    ctx.local_rows = shard.shape[0] if shard.dim() else 0
    ctx.grad_dtype = shard.dtype
    ctx.spec_args = spec_args


def _unshard_backward(ctx, grad: torch.Tensor):
    shard_grad = torch.ops.fsdp_compile.reduce_grad(grad, ctx.local_rows, ctx.grad_dtype, *ctx.spec_args)
    return (shard_grad,) + (None,) * (1 + len(ctx.spec_args))


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)

UNSHARD = torch.ops.fsdp_compile.unshard.default
REDUCE_GRAD = torch.ops.fsdp_compile.reduce_grad.default

# Positions of the CommSpec arguments in each marker's schema.
UNSHARD_SPEC_START = 2
REDUCE_GRAD_SPEC_START = 3


def unshard_spec(node_args: tuple) -> CommSpec:
    return CommSpec.from_op_args(node_args[UNSHARD_SPEC_START:])


def reduce_grad_spec(node_args: tuple) -> CommSpec:
    return CommSpec.from_op_args(node_args[REDUCE_GRAD_SPEC_START:])
