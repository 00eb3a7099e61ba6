"""fsdp_compile: Fully Sharded Data Parallel training as a torch.compile backend.

    backend = fsdp_compile.backend(strategy="FULL_SHARD")
    model = torch.compile(backend.shard(model), backend=backend)
"""

from .backend import CompiledGraph, FSDPBackend, backend, compile
from .memory import MemoryEstimate, estimate_memory
from .mixed_precision import MixedPrecision
from .strategy import ShardingStrategy

__all__ = ["CompiledGraph", "FSDPBackend", "MemoryEstimate", "MixedPrecision", "ShardingStrategy",
           "backend", "compile", "estimate_memory"]
__version__ = "0.1.0"
