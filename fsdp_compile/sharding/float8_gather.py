"""Which parameters gather in float8: torchao ``Float8Linear`` weights that ask for it
(``enable_fsdp_float8_all_gather=True``). Such a weight is stored as the tensor it wraps and its
spec carries the float8 dtype: the gather moves a byte per element plus a scale per weight and
hands ``Float8Linear`` the weight in the compute dtype. torchao is imported only when present.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

FLOAT8_EXTRA = 'pip install -e ".[float8]"'


@dataclass(frozen=True)
class Float8Gather:
    """How a weight's shard is cast for its all-gather (the fields of torchao's own cast)."""

    dtype: torch.dtype  # the float8 dtype, e.g. torch.float8_e4m3fn
    pow2_scale: bool  # Float8LinearConfig.round_scales_to_power_of_2


def _is_torchao(obj: object) -> bool:
    return type(obj).__module__.startswith("torchao.")


def _is_float8_weight(tensor: torch.Tensor) -> bool:
    if not _is_torchao(tensor):
        return False
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return isinstance(tensor, WeightWithDynamicFloat8CastTensor)


def float8_gather(module: nn.Module, name: str, param: torch.Tensor) -> Float8Gather | None:
    """The float8 cast of ``module.<name>``'s all-gather, or None: a weight torchao marked for
    FSDP's float8 all-gather (only with dynamic tensorwise scaling, which the gather reproduces)."""
    if name != "weight" or not _is_float8_weight(param):
        return None
    config = getattr(module, "config", None)
    return Float8Gather(param._dtype, bool(getattr(config, "round_scales_to_power_of_2", False)))


def plain_tensor(param: torch.Tensor) -> torch.Tensor:
    """The tensor a float8 weight wraps, else ``param`` itself."""
    return param._tensor if _is_float8_weight(param) else param


def like_float8_weight(original: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` wrapped as ``original`` is when that is a torchao float8 weight, else ``tensor``."""
    if not _is_float8_weight(original):
        return tensor
    return type(original)(tensor, original._linear_mm_config, original._dtype)


def require_torchao(what: str) -> None:
    """Raise a clear error when float8 is asked for without torchao installed."""
    try:
        import torchao  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"{what} needs torchao, which is not installed: {FLOAT8_EXTRA}") from exc
