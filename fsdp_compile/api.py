"""What a user configures, and the checks it passes: the vocabulary of the public API.

Strategies, mixed precision, CPU offload, the error type for unworkable options, and
:class:`BackendOptions`, every option of :func:`fsdp_compile.backend` validated once, in one
place (as FSDP2 keeps its policies in ``_fsdp_api.py``). Nothing here depends on the rest of the
package except the bucket-policy parser.
"""

from __future__ import annotations

import datetime
import enum
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .errors import ConfigError as ConfigError  # the options module is where users have imported it from
from .passes.context import OPTIONAL_PASSES
from .sharding.units import BucketPolicy, Policy, parse_policy


class ShardingStrategy(enum.Enum):
    """How parameters, gradients and optimizer state are split across data-parallel ranks.

    The names and meanings follow torch FSDP1's ``ShardingStrategy``:

    * ``FULL_SHARD`` (ZeRO-3): parameters are sharded; each one is gathered before use in
      forward, freed after, gathered again in backward; gradients are reduce-scattered.
    * ``SHARD_GRAD_OP`` (ZeRO-2): like FULL_SHARD, but the gathered parameters are kept from
      forward to backward, so backward needs no second all-gather.
    * ``NO_SHARD`` (DDP): every rank holds whole parameters; gradients are all-reduced.
    * ``HYBRID_SHARD``: FULL_SHARD inside a shard group (a node), replicas across shard
      groups; gradients are reduce-scattered in the shard group, then all-reduced across.
    * ``HYBRID_SHARD_ZERO2``: HYBRID_SHARD with SHARD_GRAD_OP inside the shard group.
    """

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"
    HYBRID_SHARD_ZERO2 = "HYBRID_SHARD_ZERO2"

    @classmethod
    def parse(cls, value: ShardingStrategy | str) -> ShardingStrategy:
        """Accept an enum member or its name in any case; reject anything else by name."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().upper()
            if key in cls.__members__:
                return cls[key]
        valid = ", ".join(cls.__members__)
        raise ValueError(
            f"strategy={value!r} is not a sharding strategy; use one of: {valid} "
            "(as a string, any case, or fsdp_compile.ShardingStrategy)"
        )

    @property
    def is_hybrid(self) -> bool:
        return self in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)

    @property
    def shards_parameters(self) -> bool:
        return self is not ShardingStrategy.NO_SHARD

    @property
    def reshard_after_forward(self) -> bool:
        """Whether gathered parameters are dropped after forward and gathered again in backward."""
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


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


@dataclass(frozen=True)
class CPUOffload:
    """Keep parameter shards (and so their gradients and optimizer state) in CPU memory.

    Each gather copies the bucket's shards to the compute device first (asynchronously from
    pinned memory), and each reduced gradient shard is copied back to the host, where the
    optimizer steps. ``pin_memory`` pins the shards so those host-to-device copies overlap;
    it applies only where an accelerator exists (on a CPU-only machine the compute device is
    the CPU and every copy is a no-op).
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise TypeError(f"CPUOffload(pin_memory=) takes a bool, got {type(self.pin_memory).__name__}")


__version__ = "0.1.0"  # the one definition; readers look it up when they need it
COMPILERS = ("inductor", "aot_eager", "eager")
# strict= when the backend is not given it: set, every fallback after an error fsdp_compile does not
# expect raises (a pass's to the eager runtime, a region retry's; the test suite forces it on: a
# test cannot pass through one unless it says so).
STRICT_ENV = "FSDP_COMPILE_STRICT"


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


@dataclass
class BackendOptions:
    strategy: ShardingStrategy
    compiler: str
    mesh: DeviceMesh | None
    process_groups: Any
    shard_size: int | None
    timeout: datetime.timedelta | None
    bucket: Any
    mixed_precision: MixedPrecision | None
    schedule: bool
    prefetch: int
    max_inflight_bytes: int | None
    forward_prefetch: Any
    backward_prefetch: Any
    dump_dir: str | None
    strict: bool
    passes: dict[str, list[Callable]]
    offload: CPUOffload | None
    verify: bool
    cache_dir: str | None
    disable_passes: tuple[str, ...]
    bucket_policy: Policy
    regions: bool | int = True
    verify_gradients: bool | float = False
    reshard_after_forward: Any = None  # sharding/reshard_policy.py: one value, or values by unit
    memory_budget: int | None = None  # bytes per rank: the compiler chooses reshard_after_forward
    cluster: Any = None  # the planner's Cluster that memory_budget predicts communication on

    @classmethod
    def validate(
        cls,
        strategy: ShardingStrategy | str,
        *,
        compiler: str,
        mesh: DeviceMesh | None,
        process_groups: Any,
        shard_size: int | None,
        timeout: datetime.timedelta | None,
        bucket: BucketPolicy,
        mixed_precision: MixedPrecision | None,
        schedule: bool,
        prefetch: int,
        max_inflight_bytes: int | None,
        forward_prefetch: Any,
        backward_prefetch: Any,
        dump_dir: str | os.PathLike | None,
        strict: bool | None,
        passes: dict[str, Sequence[Callable]] | None,
        offload: CPUOffload | None,
        verify: bool,
        cache_dir: str | os.PathLike | None,
        disable_passes: Sequence[str],
        regions: bool | int = True,
        verify_gradients: bool | float = False,
        reshard_after_forward: Any = None,
        memory_budget: Any = None,
        cluster: Any = None,
    ) -> BackendOptions:
        """Every option of :func:`fsdp_compile.backend` checked, each once: a wrong one raises
        an error that names it and says what to use."""
        strategy = ShardingStrategy.parse(strategy)
        policy = parse_policy(bucket)
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise TypeError(
                f"mixed_precision= must be an fsdp_compile.MixedPrecision, got {type(mixed_precision).__name__}"
            )
        if compiler not in COMPILERS:
            raise ValueError(f"compiler={compiler!r} is not supported; use one of: {', '.join(COMPILERS)}")
        if mesh is not None and not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh= must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
        if timeout is not None and not isinstance(timeout, datetime.timedelta):
            raise TypeError(f"timeout= must be a datetime.timedelta, got {type(timeout).__name__}")
        if mesh is not None and process_groups is not None:
            raise ValueError("pass either mesh= or process_groups=, not both")
        if shard_size is not None and not strategy.is_hybrid:
            raise ValueError(
                f"shard_size= only applies to HYBRID_SHARD / HYBRID_SHARD_ZERO2, not {strategy.name}"
            )
        if shard_size is not None and (mesh is not None or process_groups is not None):
            raise ValueError("shard_size= only applies when neither mesh= nor process_groups= is given")
        check_prefetch(prefetch)
        check_inflight_budget(max_inflight_bytes)
        for name, order in (("forward_prefetch", forward_prefetch), ("backward_prefetch", backward_prefetch)):
            if order is not None and not isinstance(order, dict):
                raise TypeError(f"{name}= takes a dict {{unit: [units to prefetch]}}, got {type(order).__name__}")
            if order is not None and not policy.uses_units:
                raise ValueError(f"{name}= names bucket units, which bucket={policy.describe()} does not have")
        if offload is not None and not isinstance(offload, CPUOffload):
            raise TypeError(f"offload= must be an fsdp_compile.CPUOffload, got {type(offload).__name__}")
        if not isinstance(verify, bool):
            raise TypeError(f"verify= takes a bool, got {type(verify).__name__}")
        if strict is None:
            strict = env_flag(STRICT_ENV)
        elif not isinstance(strict, bool):
            raise TypeError(f"strict= takes a bool (or None: {STRICT_ENV} decides), got {type(strict).__name__}")
        if isinstance(verify_gradients, bool):
            pass
        elif not isinstance(verify_gradients, (int, float)) or not 0 < verify_gradients < 1:
            raise ValueError(f"verify_gradients={verify_gradients!r} takes True (the default tolerance), False, or a "
                             "tolerance between 0 and 1 (relative to each gradient's largest entry)")
        if not isinstance(regions, int):
            raise TypeError(f"regions= takes a bool or a number of copies, got {type(regions).__name__}")
        if not isinstance(regions, bool) and regions < 2:
            raise ValueError(f"regions={regions}: a block is compiled once for all its copies from 2 copies on; "
                             "give 2 or more, True (where it pays) or False")
        if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
            raise TypeError(f"cache_dir= takes a directory path, got {type(cache_dir).__name__}")
        phases = dict(passes or {})
        for phase, fns in phases.items():
            if phase not in ("forward", "backward"):
                raise ValueError(f"passes= takes the phases 'forward' and 'backward', not {phase!r}")
            if not all(callable(fn) for fn in fns):
                raise TypeError(f"passes[{phase!r}] must hold callables GraphModule -> GraphModule | None")
            phases[phase] = list(fns)
        if isinstance(disable_passes, str):
            disable_passes = (disable_passes,)
        unknown = [name for name in disable_passes if name not in OPTIONAL_PASSES]
        if unknown:
            raise ValueError(f"disable_passes= names {', '.join(map(repr, unknown))}, which is not a pass that can be "
                             f"switched off; use some of {', '.join(OPTIONAL_PASSES)}")
        check_reshard_option(reshard_after_forward, strategy, policy.uses_units)
        if memory_budget is not None:
            memory_budget = parse_bytes(memory_budget, "memory_budget")
            if strategy not in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD):
                raise ValueError(f"memory_budget= chooses what FULL_SHARD or HYBRID_SHARD keeps from forward to "
                                 f"backward; {strategy.name} already decides it (for a unit-by-unit choice of "
                                 "your own, pass reshard_after_forward=)")
            if reshard_after_forward is not None:
                raise ValueError("memory_budget= chooses reshard_after_forward itself: pass one of the two")
            if not policy.uses_units:
                raise ValueError("memory_budget= chooses per bucket unit, which bucket= sizes in bytes or per "
                                 "parameter do not have; use bucket='module' (the default)")
            if cluster is None:
                raise ValueError("memory_budget= predicts what each choice saves on a cluster model: pass cluster= "
                                 "(fsdp_compile.Cluster.measure(), or Cluster.preset(...) for a known GPU)")
        if cluster is not None and memory_budget is None:
            raise ValueError("cluster= is what memory_budget= predicts with; pass memory_budget= too "
                             "(strategy='auto' takes both to plan)")
        return cls(strategy, compiler, mesh, process_groups, shard_size, timeout, bucket, mixed_precision, schedule,
                   prefetch, max_inflight_bytes, forward_prefetch, backward_prefetch,
                   os.fspath(dump_dir) if dump_dir is not None else None, strict, phases, offload, verify,
                   os.fspath(cache_dir) if cache_dir is not None else None, tuple(dict.fromkeys(disable_passes)),
                   policy, regions, verify_gradients, reshard_after_forward, memory_budget, cluster)
