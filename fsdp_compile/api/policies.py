"""The policies a user passes as objects (as FSDP2's ``MixedPrecisionPolicy`` and ``OffloadPolicy``):
mixed precision and CPU offload."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
                raise ValueError(f"MixedPrecision({name}={value}) cannot be communicated; use one of {allowed}")
        output = self.output_dtype
        if output is not None and not (isinstance(output, torch.dtype) and output.is_floating_point):
            raise ValueError(f"MixedPrecision(output_dtype={self.output_dtype}) must be a floating-point dtype")

    def applies_to(self, param: torch.Tensor) -> bool:
        return param.is_floating_point()


@dataclass(frozen=True)
class CPUOffload:
    """Keep parameter shards (and so their gradients and optimizer state) in CPU memory: each
    gather copies them to the compute device, each reduced gradient comes back for the optimizer
    step. ``pin_memory`` pins the shards so those copies overlap (where an accelerator exists)."""

    pin_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise TypeError(f"CPUOffload(pin_memory=) takes a bool, got {type(self.pin_memory).__name__}")
