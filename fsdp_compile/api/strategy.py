"""The sharding strategies: how parameters, gradients and optimizer state split across ranks."""

from __future__ import annotations

import enum


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
        raise ValueError(f"strategy={value!r} is not a sharding strategy; use one of: {valid} "
                         "(as a string, any case, or fsdp_compile.ShardingStrategy)")

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
