"""Mixed precision: compute in a low-precision copy of the parameters, keep fp32 shards.

Shards, their gradients and so the optimizer state stay in the parameter's own dtype. The
gather casts each shard to ``param_dtype`` before communicating (half the bytes for bf16), the
gradient reduction runs in ``reduce_dtype`` (default: ``param_dtype``), and the result is cast
back to the parameter's dtype. Same semantics as FSDP2's ``MixedPrecisionPolicy``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

# Dtypes every collective backend can move and reduce.
COMMUNICABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: dtype of gathered parameters (and so of compute); ``reduce_dtype``: dtype
    gradients are reduced in; ``output_dtype``: cast of the root module's floating-point outputs;
    ``cast_forward_inputs``: cast the root module's floating-point inputs to ``param_dtype``.
    ``None`` keeps the parameter's dtype (for ``reduce_dtype``: ``param_dtype``)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in COMMUNICABLE_DTYPES:
                allowed = ", ".join(str(d) for d in COMMUNICABLE_DTYPES)
                raise ValueError(
                    f"MixedPrecision({name}={value}) cannot be communicated; use one of {allowed}"
                )
        if self.output_dtype is not None and not (
            isinstance(self.output_dtype, torch.dtype) and self.output_dtype.is_floating_point
        ):
            raise ValueError(f"MixedPrecision(output_dtype={self.output_dtype}) must be a floating-point dtype")

    def applies_to(self, param: torch.Tensor) -> bool:
        return param.is_floating_point()


def _cast(value: Any, dtype: torch.dtype) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, value)


def cast_inputs(policy: MixedPrecision, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The root module's forward inputs as ``policy`` wants them."""
    if policy.cast_forward_inputs and policy.param_dtype is not None:
        return _cast(args, policy.param_dtype), _cast(kwargs, policy.param_dtype)
    return args, kwargs


def cast_output(policy: MixedPrecision, output: Any) -> Any:
    """The root module's forward output as ``policy`` wants it."""
    return output if policy.output_dtype is None else _cast(output, policy.output_dtype)
