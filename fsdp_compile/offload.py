"""CPU offload: shards, their gradients and the optimizer step live in host memory."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def offload_pins_memory() -> bool:
    """Whether pinning is possible here: it needs an accelerator runtime."""
    return torch.cuda.is_available()
