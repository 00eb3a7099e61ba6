"""The checks and parsers of single option values, shared by the backend's options and by the
passes and planner that take the same values directly."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import torch.nn as nn

from .strategy import ShardingStrategy

COMPILERS = ("inductor", "aot_eager", "eager")
# strict= when the backend is not given it (the test suite sets it: no test passes through a fallback unnoticed).
STRICT_ENV = "FSDP_COMPILE_STRICT"

# Passes disable_passes= may switch off (the repairs and the region passes always run): declared
# with the option, so that the options need nothing of the passes.
OPTIONAL_PASSES = ("route_region_inputs", "elide_trivial_unshard", "tag_reshard_policy",
                   "lower_markers", "schedule_collectives")


def env_flag(name: str) -> bool:
    """Whether the environment variable ``name`` is set to something other than 0/false/no."""
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def check_prefetch(prefetch: Any) -> None:
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch={prefetch!r} must be an int >= 0 (0 disables prefetching)")


_BYTES = re.compile(r"^\s*(?P<number>[0-9]+\.?[0-9]*(?:e[+-]?[0-9]+)?)\s*(?P<unit>[kmgt]i?b|b)?\s*$", re.IGNORECASE)
_BYTE_UNITS = {"b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
               "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_bytes(value: Any, argument: str) -> int:
    """Bytes from a number or a string such as "12GiB", "500MB" (``argument`` names the option)."""
    if isinstance(value, bool):
        raise TypeError(f"{argument}= takes bytes (an int, or a string such as '12GiB'), got {value!r}")
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str) and (match := _BYTES.match(value)):
        number = float(match["number"]) * _BYTE_UNITS[(match["unit"] or "b").lower()]
    else:
        raise ValueError(f"{argument}={value!r}: give bytes as a number or a string such as '12GiB', '800MB'")
    if not number > 0 or number != number:
        raise ValueError(f"{argument}={value!r}: a memory budget must be positive")
    return int(number)


def check_inflight_budget(max_inflight_bytes: Any) -> None:
    if max_inflight_bytes is not None and (
            isinstance(max_inflight_bytes, bool) or not isinstance(max_inflight_bytes, int)
            or max_inflight_bytes <= 0):
        raise ValueError(f"max_inflight_bytes={max_inflight_bytes!r} must be a positive int (bytes) or None")


# A setting as the user gives it: one value, or values by unit (name, module or class).
ReshardOption = bool | int | Mapping[Any, bool | int] | None


def check_reshard_option(option: ReshardOption, strategy: ShardingStrategy, uses_units: bool) -> None:
    """The option's form (what can be checked before the model is seen)."""
    if option is None:
        return
    if not strategy.shards_parameters:
        raise ValueError("reshard_after_forward= decides what a unit keeps of its gathered parameters; NO_SHARD "
                         "keeps every parameter whole, so there is nothing to reshard: drop the option")
    values = option.values() if isinstance(option, Mapping) else [option]
    if isinstance(option, Mapping):
        if not uses_units:
            raise ValueError("reshard_after_forward={...} names bucket units, which bucket= sizes in bytes or per "
                             "parameter do not have; give one value for every parameter, or bucket='module'")
        for key in option:
            if not isinstance(key, (str, nn.Module, type)):
                raise TypeError(f"reshard_after_forward= keys are unit names, modules or module classes, got "
                                f"{type(key).__name__} {key!r}")
    for value in values:
        if not isinstance(value, (bool, int)) or (not isinstance(value, bool) and value < 2):
            raise ValueError(f"reshard_after_forward value {value!r}: use True (reshard to the shard), False (keep "
                             "the gathered parameters) or an int n >= 2 (keep a shard over groups of n ranks)")
